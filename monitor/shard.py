"""Several monitors, one job: each shard owns a slice of the replica groups, one leader acts.

``lightkeeper monitor --shard I/N --etcd URL`` polls and analyzes only the replica groups whose
:func:`shard_of` is ``I``, and turns each eviction it wants into a *proposal* in etcd;
``--lead`` makes a monitor a candidate for the one leader, elected through an etcd lease
(:class:`monitor.lease.LeaderLease`), which applies the global rails (min replicas, cooldown,
blindness: a shard that has not reported within its lease TTL counts as blind) and sends the
Lighthouse kill. docs/scaling.md, "Beyond one machine", has the protocol; in short, under
``--etcd-prefix``/``<job>``/:

``leader``              the leader's identity, under its lease (created only when absent)
``shards/<I>``          shard I's report, rewritten every sweep under a lease the sweep loop
                        renews: present means "shard I swept less than a TTL ago"
``proposals/<rid>``     an eviction a shard wants for torchft replica id ``rid`` (created only
                        when absent, no lease: it outlives the shard and any leader; withdrawn
                        by the shard once no open finding of its run stands behind it, unless
                        a leader already acted; a leader holds one of an earlier run)
``evictions/<rid>``     the leader's record: ``sending`` is written *before* the kill, in one
                        txn that also requires the leader key under the writer's lease, no
                        earlier record and the proposal unchanged, and ``sent``/``failed``
                        after it

Each ``sending`` is one kill: a second one (a retry of ``failed``, a resend) needs the record
unchanged since it was read (a compare on its mod_revision), so two leaders cannot both write
it, and a replica id with ``sending`` or ``sent`` is never decided again. A new leader that finds a
``sending`` left by a leader that died mid-kill does not send again while it cannot tell: it
reads the Lighthouse, and a replica that no longer heartbeats there is recorded ``sent`` (the
kill landed, or the group died anyway); one still heartbeating after ``resend_after_s`` (three
Lighthouse heartbeat timeouts) had its kill lost, and is sent again (the one at-least-once
case: a group can be asked twice, never two groups once too often). A proposal is never lost:
it waits in etcd for whichever leader comes next.

Nothing here raises into the sweep: an etcd that cannot be reached leaves the shard without
proposals (logged, shown in ``/v1/cluster``'s ``shard``) and the leader without decisions; the
leader never evicts on a Lighthouse it could not read or with a shard missing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
import uuid
from typing import Any

from .act.actions import Lighthouse
from .act.decisions import Situation, decide
from .config import ShardConfig
from .evidence.lighthouse_status import LighthouseReader, LighthouseStatus
from .lease import (
    KV,
    Etcd,
    EtcdError,
    LeaderLease,
    SessionLease,
    created_never,
    delete_op,
    modified_at,
    put_op,
)

log = logging.getLogger(__name__)


def shard_of(replica_group: int, shards: int) -> int:
    """The shard that owns a replica group: Prometheus' ``hashmod`` of its decimal id (the last
    8 bytes of its MD5 as a big-endian integer, modulo the shard count).

    Stable across processes and restarts (``hash()`` is salted per process), and the same
    function as a Prometheus ``hashmod`` relabelling on the ``replica_group`` label: monitor
    shard I and Prometheus shard I (``modulus: N``, keep ``I``) see the same groups.
    """
    digest = hashlib.md5(str(int(replica_group)).encode(), usedforsecurity=False).digest()
    return int.from_bytes(digest[8:], "big") % shards


def _summary(f: Any) -> dict[str, Any]:
    """What a proposal carries of its finding: enough for the leader's log and audit."""
    ev = f.evidence or {}
    return {"kind": f.kind, "first_seen": f.first_seen, "confirmed_at": f.confirmed_at,
            "culprit_ranks": ev.get("culprit_ranks", f.ranks),
            "culprit_hosts": ev.get("culprit_hosts", []),
            "detail": str(ev.get("detail") or ev.get("reason") or "")[:500]}


class Shards:
    """The shard side (target filter, report, proposals: the sweep loop's thread) and the
    leader side (its own thread, its own etcd and Lighthouse connections) of one monitor."""

    def __init__(self, cfg: ShardConfig, monitor: Any) -> None:
        self.cfg = cfg
        self.mon = monitor  # the Monitor (monitor.service) this shard runs in: store, rails, ...
        job = monitor.cfg.job
        self.root = f"{cfg.etcd_prefix.rstrip('/')}/{job}/"
        self.etcd = Etcd(cfg.etcd, cfg.etcd_timeout_s)  # the sweep loop's connection
        self.session = SessionLease(self.etcd, cfg.lease_ttl_s)
        self._groups: dict[str, tuple[int, float]] = {}  # url -> (replica group, learned at)
        self._proposed: set[str] = set()
        self._mirrored: set[str] = set()  # leader kills copied into this shard's audit log
        self.run = uuid.uuid4().hex[:12]  # this run of the shard: its proposals name it
        self.error: str | None = None
        self.proposals_made = 0
        # the leader side
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.election: LeaderLease | None = None
        self.leader_error: str | None = None
        self.leader_blind: str | None = None
        self._held: dict[str, str] = {}  # replica id -> last hold reason (logged once)
        self._sending_seen: dict[tuple[str, int], float] = {}
        hb_s = (monitor.cfg.lighthouse_heartbeat_timeout_ms or 5000) / 1000.0
        self.resend_after_s = cfg.resend_after_s if cfg.resend_after_s is not None else 3 * hb_s

    # --- keys ------------------------------------------------------------------------
    def key(self, kind: str, name: str | int = "") -> str:
        return f"{self.root}{kind}/{name}" if kind != "leader" else f"{self.root}leader"

    def owns(self, replica_group: int) -> bool:
        return self.cfg.index is not None and shard_of(replica_group, self.cfg.shards) \
            == self.cfg.index

    # --- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        if self.cfg.lead:
            self._thread = threading.Thread(target=self._lead_loop, daemon=True,
                                            name="lightkeeper-shard-leader")
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.cfg.index is not None:
            try:  # the report goes with the lease: the leader sees this shard gone at once
                self.session.revoke()
            except Exception:  # a stop never fails on etcd
                pass
        self.etcd.close()

    # --- shard side: which targets are ours ---------------------------------------------
    def own_targets(self, targets: list, poller: Any, now: float) -> list:
        """The targets of this shard's replica groups. A target's group is what its last
        ``/v1/state`` said, else its registration or file_sd hint; a target with neither is
        asked for ``/v1/state`` once here (and every ``reprobe_s`` while it belongs to another
        shard, in case the address now serves another group). A leader-only monitor owns none."""
        if self.cfg.index is None:
            return []
        known = {t.url for t in targets}
        for url in [u for u in self._groups if u not in known]:
            del self._groups[url]
        mine, probe = [], []
        for t in targets:
            g, at = self._groups.get(t.url, (t.replica_group, now))
            if g is None or (not self.owns(g) and now - at >= self.cfg.reprobe_s):
                probe.append(t)
            elif self.owns(g):
                mine.append(t)
        if probe:
            for url, p in poller.sweep([t.url for t in probe]).items():
                g = p.data.get("replica_group") if p.ok and isinstance(p.data, dict) else None
                if isinstance(g, int) and not isinstance(g, bool):
                    self._groups[url] = (g, now)
            # one that did not answer stays unknown: asked again next sweep, polled by no shard
            mine += [t for t in probe if t.url in self._groups
                     and self.owns(self._groups[t.url][0])]
        return mine

    # --- shard side: report and proposals (after the detectors, every sweep) --------------
    def after_sweep(self, view: Any, evidence: Any, now: float) -> None:
        """Learn the groups of the ranks polled, report this shard, propose its evictions.
        Never raises: etcd unreachable is logged once and shown."""
        # a rank polled this sweep has a RankView made anew (ViewBuilder.changed): the others'
        # groups were learned when they were last polled
        for url in self.mon.views.changed:
            r = view.ranks.get(url)
            if r is not None and r.replica_group is not None and r.fresh:
                self._groups[url] = (r.replica_group, now)
        if self.cfg.index is None:
            return
        mon = self.mon
        try:
            lease = self.session.refresh()
            # proposals (and withdrawals) before the report: a leader that sees this run's
            # report sees its proposals as they stand
            self._propose_findings(view, evidence, now)
            self._mirror_evictions()
            blind = mon.blind_reason()
            if not blind and view.ranks and \
                    view.reachable_fraction <= mon.cfg.rails.min_reachable_fraction:
                blind = (f"shard {self.cfg.index} reaches only {view.reachable_fraction:.0%} "
                         "of its ranks")
            self.etcd.put(self.key("shards", self.cfg.index), {
                "shard": self.cfg.index, "shards": self.cfg.shards, "at": now,
                "monitor": mon.url, "sweeps": mon.sweeps, "blind": blind,
                "ranks": len(view.ranks), "run": self.run,
                "groups": {str(g): gv.replica_id for g, gv in evidence.groups.items()}}, lease)
            if self.error:
                log.warning("etcd answers again: shard %s reports and proposes",
                            self.cfg.index)
            self.error = None
        except EtcdError as e:
            if str(e) != self.error:
                log.warning("shard %s cannot report or propose: %s", self.cfg.index, e)
            self.error = str(e)

    def _propose_findings(self, view: Any, evidence: Any, now: float) -> None:
        """The shard's own rails (kind, replica id, dry run, blindness), then a proposal; min
        replicas and cooldown are global, the leader's."""
        mon = self.mon
        local = dataclasses.replace(mon.cfg.rails, min_replicas=0, cooldown_s=0.0)
        s = mon.enforcer.situation(view, evidence, now)
        wanted: set[str] = set()
        for f in mon.detectors.open_findings():
            if f.kind not in local.evict_kinds:
                continue
            d = decide(f.kind, f.replica_group, f.replica_id, s, local)
            if not d.evict:
                mon.enforcer.hold(f, d)  # recorded once per reason
                continue
            wanted.add(f.replica_id)
            if f.replica_id not in self._proposed:
                self.propose(f.replica_group, f.replica_id, _summary(f),
                             mon.enforcer.finding_id(f.key), f.to_dict(), "auto")
        self._withdraw(wanted)

    def _withdraw(self, wanted: set[str]) -> None:
        """Delete this shard's proposals that no open finding of this run stands behind (the
        finding resolved, the shard went blind, or an earlier run of the shard made it) and
        that no leader has acted on: a leader never evicts on evidence the shard no longer
        holds. Manual proposals stay. One txn each, guarded by "no eviction record" and "the
        proposal as read"."""
        for kv in self.etcd.range_prefix(self.key("proposals")):
            p = _json(kv)
            rid = kv.key[len(self.key("proposals")):]
            if not _is_proposal(p) or p.get("shard") != self.cfg.index or p.get("manual") \
                    or rid in wanted:
                continue
            ok, _ = self.etcd.txn([created_never(self.key("evictions", rid)),
                                   modified_at(kv.key, kv.mod_revision)], [delete_op(kv.key)])
            self._proposed.discard(rid)
            if ok:
                log.warning("withdrew the proposal to evict %s: no open finding stands behind "
                            "it any more", rid)
                self.mon.store.add_decision(
                    replica_group=p["replica_group"], replica_id=rid, decision="withdrawn",
                    reason=p["kind"], detail="no open finding of this shard stands behind the "
                    "proposal any more", finding=p, source="auto", at=self.mon.clock())

    def _mirror_evictions(self) -> None:
        """Copy the leader's sent kills of this shard's groups into its own audit log (status
        ``sent``, ``source: leader``): then the shard confirms them (the group leaves), tells
        the group's other ranks to exit (``--rank-exit-token``) and its goodput ledger sees
        them, as a single monitor does for its own kills."""
        store = self.mon.store
        for kv in self.etcd.range_prefix(self.key("evictions")):
            rec, rid = _json(kv), kv.key[len(self.key("evictions")):]
            if rid in self._mirrored or not isinstance(rec, dict) \
                    or rec.get("shard") != self.cfg.index or rec.get("state") != "sent":
                continue
            self._mirrored.add(rid)
            if rid in store.evicted_replica_ids():  # mirrored by an earlier run
                continue
            store.add_decision(
                replica_group=rec.get("replica_group"), replica_id=rid, decision="evict",
                reason=str(rec.get("kind")), detail=f"sent by the leader {rec.get('leader')} "
                f"(attempt {rec.get('attempt')}): {rec.get('detail', '')}", finding=rec,
                status="sent", source="leader", at=self.mon.clock())

    def propose(self, replica_group: int, replica_id: str, summary: dict[str, Any],
                finding_id: int | None, finding: dict[str, Any] | None,
                source: str) -> dict[str, Any]:
        """Write the proposal (only when none exists for this replica id); raises EtcdError."""
        key = self.key("proposals", replica_id)
        value = {"replica_group": replica_group, "replica_id": replica_id, "shard": self.cfg.index,
                 "monitor": self.mon.url, "at": self.mon.clock(), "source": source,
                 "manual": source == "manual", "run": self.run, **summary}
        created, _ = self.etcd.txn([created_never(key)], [put_op(key, value)])
        self._proposed.add(replica_id)
        if created:
            self.proposals_made += 1
            log.warning("proposed evicting replica group %s (%s): %s", replica_group, replica_id,
                        summary.get("kind"))
            did = self.mon.store.add_decision(
                replica_group=replica_group, replica_id=replica_id, decision="proposed",
                reason=summary.get("kind") or source, detail=f"proposed to the leader as {key}",
                finding_id=finding_id, finding=finding, source=source, at=self.mon.clock())
            return {"id": did, "decision": "proposed", "proposal": key, "created": True}
        return {"id": None, "decision": "proposed", "proposal": key, "created": False}

    def propose_manual(self, replica_group: int, replica_id: str | None,
                       reason: str) -> dict[str, Any]:
        """``POST /v1/evict`` on a shard: a proposal the leader judges with the manual rails
        (min replicas; not cooldown or blindness). A group of another shard, or one without a
        verified replica id, is refused here (409)."""
        if not self.owns(replica_group):
            return {"id": None, "decision": "hold", "reason": "other_shard",
                    "detail": f"replica group {replica_group} belongs to shard "
                              f"{shard_of(replica_group, self.cfg.shards)}, not {self.cfg.index}"}
        if replica_id is None:
            return {"id": None, "decision": "hold", "reason": "no_replica_id",
                    "detail": "no verified rank of the group reports a torchft replica id"}
        try:
            out = self.propose(replica_group, replica_id, {"kind": "manual", "detail": reason},
                               None, {"kind": "manual", "reason": reason}, "manual")
        except EtcdError as e:
            return {"id": None, "decision": "hold", "reason": "etcd_unreachable",
                    "detail": str(e)}
        return {**out, "reason": "proposed" if out["created"] else "already_proposed"}

    # --- leader side ----------------------------------------------------------------------
    def _lead_loop(self) -> None:
        etcd = Etcd(self.cfg.etcd, self.cfg.etcd_timeout_s)
        name = "leader" if self.cfg.index is None else f"shard{self.cfg.index}"
        self.election = LeaderLease(etcd, self.key("leader"),
                                    {"name": name, "monitor": self.mon.url}, self.cfg.lease_ttl_s)
        lighthouse = Lighthouse(self.mon.cfg.lighthouse, self.mon.cfg.kill_timeout_s)
        reader = LighthouseReader(self.mon.cfg.lighthouse, self.mon.cfg.lighthouse_timeout_s) \
            if self.mon.cfg.lighthouse else None
        tick = max(0.05, min(self.mon.cfg.interval_s, self.cfg.lease_ttl_s / 3.0))
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    if self.election.campaign():
                        self._lead_once(etcd, lighthouse, reader)
                    else:
                        self._sending_seen.clear()
                        self._held.clear()
                    self.leader_error = self.election.error
                except EtcdError as e:
                    self.leader_error = str(e)
                except Exception as e:  # a bug in one tick must not end leadership's loop
                    log.exception("leader tick failed")
                    self.leader_error = f"{type(e).__name__}: {e}"
                self._stop.wait(max(0.0, tick - (time.monotonic() - started)))
        finally:
            self.election.resign()
            lighthouse.close()
            if reader is not None:
                reader.close()
            etcd.close()

    def _blind(self, reports: dict[int, dict], status: LighthouseStatus | None,
               error: str | None) -> str | None:
        if status is None:
            return f"the leader cannot read the Lighthouse: {error or 'no --lighthouse'}"
        missing = [i for i in range(self.cfg.shards) if i not in reports]
        if missing:
            return (f"shard(s) {', '.join(map(str, missing))} of {self.cfg.shards} have not "
                    f"reported within the lease TTL ({self.cfg.lease_ttl_s}s)")
        blind = {i: r["blind"] for i, r in reports.items() if r.get("blind")}
        if blind:
            return "; ".join(f"shard {i} is blind: {why}" for i, why in sorted(blind.items()))
        return None

    def _lead_once(self, etcd: Etcd, lighthouse: Lighthouse,
                   reader: LighthouseReader | None) -> None:
        status, error = reader.read() if reader is not None else (None, None)
        reports: dict[int, dict] = {}
        for kv in etcd.range_prefix(self.key("shards")):
            r = _json(kv)
            if isinstance(r, dict) and isinstance(r.get("shard"), int) \
                    and isinstance(r.get("groups", {}), dict):
                reports[r["shard"]] = r
        proposals = {kv.key[len(self.key("proposals")):]: kv
                     for kv in etcd.range_prefix(self.key("proposals"))}
        records = {kv.key[len(self.key("evictions")):]: kv
                   for kv in etcd.range_prefix(self.key("evictions"))}
        self.leader_blind = blind = self._blind(reports, status, error)
        # 1. kills a leader left in flight (this leader's own are never in flight between ticks)
        for rid, kv in records.items():
            rec = _json(kv)
            if isinstance(rec, dict) and rec.get("state") == "sending":
                self._resolve(etcd, lighthouse, rid, kv, rec, status)
        # 2. proposals without a record, or whose kill failed, oldest first
        group_of = {rid: int(g) for r in reports.values()
                    for g, rid in (r.get("groups") or {}).items()
                    if isinstance(rid, str) and str(g).isdigit()}
        for rid, kv in sorted(proposals.items(), key=lambda x: x[1].create_revision):
            rec = _json(records[rid]) if rid in records else None
            if rec is not None and (not isinstance(rec, dict) or rec.get("state") != "failed"):
                continue
            p = _json(kv)
            if not _is_proposal(p):  # written by something else: never acted on
                if self._held.get(rid) != "bad_proposal":
                    self._held[rid] = "bad_proposal"
                    log.warning("ignoring %s: not a proposal: %r", kv.key, kv.value[:200])
                continue
            s = self._situation(status, records, group_of, blind)
            report = reports.get(p.get("shard"))
            if status is not None and rid not in status.members and rid not in status.heartbeats:
                d_reason, d = "gone", None  # torchft no longer knows it: nothing to kill
            elif not p.get("manual") and report is not None and report.get("run") != p.get("run"):
                # made by an earlier run of that shard: it withdraws it or proposes it again
                d_reason, d = "stale_proposal", None
            else:
                d = decide(p["kind"], p["replica_group"], rid, s, self.mon.cfg.rails,
                           manual=p.get("manual") is True)
                d_reason = d.reason
            if d is None or not d.evict:
                if self._held.get(rid) != d_reason:
                    self._held[rid] = d_reason
                    detail = d.detail if d else {
                        "gone": "no longer in the Lighthouse's quorum or heartbeats",
                        "stale_proposal": f"proposed by an earlier run of shard {p.get('shard')}"
                    }[d_reason]
                    log.info("leader holds %s (%s): %s", rid, d_reason, detail)
                    self.mon.metrics.decisions.labels(self.mon.cfg.job, "hold", d_reason).inc()
                    self.mon.store.add_decision(
                        replica_group=p.get("replica_group"), replica_id=rid, decision="hold",
                        reason=d_reason, detail=f"leader: {detail}", finding=p,
                        source="leader", at=self.mon.clock())
                continue
            attempt = (rec.get("attempt", 0) if rec else 0) + 1
            guard = modified_at(self.key("evictions", rid), records[rid].mod_revision) \
                if rid in records else created_never(self.key("evictions", rid))
            self._send(etcd, lighthouse, rid, p, attempt, guard, d.detail,
                       modified_at(kv.key, kv.mod_revision))  # not withdrawn meanwhile
            records = {kv.key[len(self.key("evictions")):]: kv
                       for kv in etcd.range_prefix(self.key("evictions"))}  # the cooldown's start

    def _situation(self, status: LighthouseStatus | None, records: dict[str, KV],
                   group_of: dict[str, int], blind: str | None) -> Situation:
        """The global picture: the quorum from the Lighthouse (heartbeating members not already
        evicted, by replica group where a shard reported it), evictions and the last one from
        etcd's records."""
        evicted, last = set(), None
        for rid, kv in records.items():
            rec = _json(kv)
            if not isinstance(rec, dict):
                continue
            if rec.get("state") in ("sending", "sent"):
                evicted.add(rid)
            if isinstance(rec.get("at"), (int, float)):
                last = rec["at"] if last is None else max(last, rec["at"])
        in_quorum: set = set()
        if status is not None:  # a group killed this tick still heartbeats in this read
            in_quorum = {group_of.get(rid, rid) for rid in status.members
                         if status.heartbeating(rid) and rid not in evicted}
        return Situation(now=self.mon.clock(), reachable_fraction=1.0,
                         groups_in_quorum=in_quorum, evicted_replica_ids=evicted,
                         last_eviction_at=last, blind_reason=blind)

    def _send(self, etcd: Etcd, lighthouse: Lighthouse, rid: str, p: dict, attempt: int,
              guard: dict, detail: str, *also: dict) -> None:
        """``sending`` (guarded by the leader lease and the record as read), the kill, then
        ``sent``/``failed`` (guarded by the record still being ours)."""
        key = self.key("evictions", rid)
        rec = {"state": "sending", "replica_id": rid, "replica_group": p.get("replica_group"),
               "kind": p.get("kind"), "shard": p.get("shard"), "attempt": attempt,
               "leader": self.election.id, "term": self.election.leader_revision,
               "at": self.mon.clock()}
        ok, out = etcd.txn([self.election.guard(), guard, *also], [put_op(key, rec)])
        if not ok:  # not leader any more, or someone wrote the record since: next tick decides
            log.info("not sending %s: the leader lease or the record changed", rid)
            return
        revision = int(out["header"]["revision"])
        log.warning("leader evicting replica group %s (%s), attempt %d: %s",
                    p.get("replica_group"), rid, attempt, detail)
        result = lighthouse.kill(rid)
        self._finish(etcd, key, revision, {**rec, "state": "sent" if result.sent else "failed",
                                           "http_status": result.http_status,
                                           "detail": result.detail, "done_at": self.mon.clock()})
        m = self.mon.metrics
        m.decisions.labels(self.mon.cfg.job, "evict", "evict").inc()
        if result.sent:
            m.evictions.labels(self.mon.cfg.job, str(p.get("replica_group"))).inc()
        m.last_eviction.labels(self.mon.cfg.job).set(self.mon.clock())
        self.mon.store.add_decision(
            replica_group=p.get("replica_group"), replica_id=rid, decision="evict",
            reason=str(p.get("kind")), detail=f"leader, attempt {attempt}: {detail}; kill: "
                                              f"{result.detail}",
            finding=p, status="leader_sent" if result.sent else "leader_failed",
            source="leader", at=self.mon.clock())

    def _finish(self, etcd: Etcd, key: str, revision: int, rec: dict) -> None:
        try:
            ok, _ = etcd.txn([modified_at(key, revision)], [put_op(key, rec)])
            if not ok:
                log.warning("%s changed while its kill was in flight; left as it is", key)
        except EtcdError as e:  # stays "sending": the next leader tick resolves it
            log.warning("could not record the outcome of %s: %s", key, e)

    def _resolve(self, etcd: Etcd, lighthouse: Lighthouse, rid: str, kv: KV, rec: dict,
                 status: LighthouseStatus | None) -> None:
        """A ``sending`` left by a leader that stopped mid-kill (or could not record it)."""
        if status is None:
            return  # cannot tell whether the kill landed: wait
        first = self._sending_seen.setdefault((rid, kv.mod_revision), time.monotonic())
        key = self.key("evictions", rid)
        if not status.heartbeating(rid):
            ok, _ = etcd.txn([self.election.guard(), modified_at(key, kv.mod_revision)],
                             [put_op(key, {**rec, "state": "sent", "resolved_by":
                                           self.election.id, "done_at": self.mon.clock(),
                                           "detail": f"in flight when {rec.get('leader')} "
                                                     "stopped; the replica no longer heartbeats "
                                                     "to the Lighthouse: not sent again"})])
            if ok:
                log.warning("eviction of %s was in flight when %s stopped; it left the "
                            "Lighthouse: recorded sent, not sent again", rid, rec.get("leader"))
                self.mon.store.add_decision(
                    replica_group=rec.get("replica_group"), replica_id=rid, decision="evict",
                    reason=str(rec.get("kind")), detail="leader: resolved an eviction in flight "
                    f"from {rec.get('leader')}: the replica left the Lighthouse, not sent again",
                    finding=rec, status="leader_resolved", source="leader", at=self.mon.clock())
            return
        if time.monotonic() - first >= self.resend_after_s:
            log.warning("eviction of %s left in flight by %s: still heartbeating after %.0fs, "
                        "sending again", rid, rec.get("leader"), self.resend_after_s)
            self._send(etcd, lighthouse, rid, rec, int(rec.get("attempt", 1)) + 1,
                       modified_at(key, kv.mod_revision),
                       f"resent: still heartbeating {self.resend_after_s:g}s after "
                       f"{rec.get('leader')} stopped mid-kill")

    # --- shown in /v1/cluster -----------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        e = self.election
        return {"index": self.cfg.index, "shards": self.cfg.shards, "lead": self.cfg.lead,
                "etcd": self.cfg.etcd, "prefix": self.root, "error": self.error,
                "proposals_made": self.proposals_made,
                "owned_groups": sorted({g for g, _ in self._groups.values() if self.owns(g)}),
                "leading": bool(e and e.leading), "leader": e.leader if e else None,
                "candidate_id": e.id if e else None, "leader_error": self.leader_error,
                "leader_blind": self.leader_blind}


def _json(kv: KV) -> Any:
    """The value as JSON, None when it is not (never acted on)."""
    try:
        return kv.json()
    except ValueError:
        return None


def _is_proposal(p: Any) -> bool:
    return isinstance(p, dict) and isinstance(p.get("kind"), str) \
        and isinstance(p.get("replica_group"), int) and not isinstance(p["replica_group"], bool)
