"""Several monitors, one job: each shard polls its replica groups and proposes evictions in etcd;
one :class:`Leader` applies the global rails and kills (docs/scaling.md, "The etcd protocol").
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
import uuid
from functools import lru_cache
from typing import Any

from http_serving import redact_url

from .act.enforcer import out_of_sight
from .act.trouble import Trouble
from .config import ShardConfig
from .lease import KV, Etcd, EtcdError, SessionLease, created_never, leased_by, modified_at
from .shard_leader import Leader, _audit, _by_rid, _is_proposal

log = logging.getLogger(__name__)

REPROBE_S = 60.0  # a target of another shard is asked its group again this often


@lru_cache(maxsize=1 << 16)  # an MD5 per group, not per target and sweep
def shard_of(replica_group: int, shards: int) -> int:
    """Prometheus' ``hashmod`` of the group's decimal id (the last 8 bytes of its MD5, big-endian,
    mod N): Prometheus shard I keeps the groups of monitor shard I."""
    digest = hashlib.md5(str(int(replica_group)).encode(), usedforsecurity=False).digest()
    return int.from_bytes(digest[8:], "big") % shards


def expected_in_slice(expected_groups: int | None, shard: Any) -> int | None:
    """Of ``--expected-groups`` (the job's), those a shard's ledger sees and expects."""
    if shard is None or expected_groups is None:
        return expected_groups
    return sum(shard_of(g, shard.shards) == shard.index for g in range(expected_groups))


def _acted_on(record: KV | None) -> bool:
    """Whether a leader sent, or is sending, a kill on the record: a ``failed`` one is retried
    only while its proposal stands."""
    if record is None:
        return False
    rec = record.json()
    return not isinstance(rec, dict) or rec.get("state") != "failed"


def _summary(f: Any) -> dict[str, Any]:
    ev = f.evidence or {}
    return {"kind": f.kind, "first_seen": f.first_seen, "confirmed_at": f.confirmed_at,
            "culprit_ranks": ev.get("culprit_ranks", f.ranks),
            "culprit_hosts": ev.get("culprit_hosts", []),
            "detail": str(ev.get("detail") or ev.get("reason") or "")[:500]}


class Shards:
    """The shard side of one monitor (target filter, report, proposals; on the sweep loop's
    thread), and its :class:`Leader` candidate with ``--lead``."""

    def __init__(self, cfg: ShardConfig, monitor: Any) -> None:
        self.cfg = cfg
        self.mon = monitor  # monitor.service.Monitor: its store, rails, metrics
        self.root = f"{cfg.etcd_prefix.rstrip('/')}/{monitor.cfg.job}/"
        self.etcd = Etcd(cfg.etcd)  # the sweep loop's connection
        self.session = SessionLease(self.etcd, cfg.lease_ttl_s)
        # url -> (replica group, learned at); a rank kept unreachable across a restart (--state)
        # stays in its group's slice, so its death is found again as a single monitor finds it
        self._groups: dict[str, tuple[int, float]] = {
            u: (g, monitor.clock()) for u, (_, s, _) in monitor.store.unreachable().items()
            if isinstance(g := s.get("replica_group"), int)}
        self._learned = 0  # counts the groups learned that differ from the last known
        self._slice: list = []  # the last own_targets, for its key until the next reprobe
        self._slice_key: tuple = (None, -1)
        self._reprobe_at = float("-inf")
        self._unplaced = True  # no target's group is known yet: any may be this slice's
        self._proposed: set[str] = set()
        self._mirrored: set[str] = set()  # leader kills copied into this shard's audit log
        self.run = uuid.uuid4().hex[:12]  # this run of the shard: its proposals name it
        # whether this run holds its index's report key (None: not known yet); another monitor
        # started with the same --shard holds it, this one stands by: no report, no proposals
        self.holds: bool | None = None
        self.held_by: dict[str, Any] | None = None
        # when this run's hold ends unless renewed (monotonic): the lease's TTL counted from
        # before the last renewal that answered, so etcd cannot have let it go sooner
        self._holds_until = float("-inf")
        self._lapse_said = False
        self.etcd_trouble = Trouble(f"shard {cfg.index} cannot report or propose", f"etcd answers "
                                    f"again: shard {cfg.index} reports and proposes", log=log)
        self._retry_at = float("-inf")  # etcd failed: asked again from then (monotonic)
        # set up so that nothing acts on it: its index held by a shard of another --shards, or
        # no leader under its prefix (a wrong --etcd-prefix or --job); its error, said
        self.misconfig = Trouble(f"shard {cfg.index}/{cfg.shards}: nothing acts on it",
                                 f"shard {cfg.index}/{cfg.shards}: set up right again",
                                 logging.ERROR, log)
        self._stray: str | None = None  # why its index is another --shards' (_report)
        self._leader_at = time.monotonic()  # when a leader key was last seen (or the start)
        self.sent_kills: set[str] = set()  # the job's kills the leader sent, any slice's
        self.proposals_made = 0
        self.leader: Leader | None = None

    def owns(self, replica_group: int) -> bool:
        return self.cfg.index is not None and shard_of(replica_group, self.cfg.shards) \
            == self.cfg.index

    def start(self) -> None:
        if self.cfg.lead:  # once the API serves: the leader key names the monitor's url
            self.leader = Leader(self.cfg, self.mon, self.root)
            self.leader.start()

    def stop(self) -> None:
        if self.leader is not None:
            self.leader.stop()
        self.session.revoke()  # the report goes with it: the leader sees this shard gone at once
        self.etcd.close()

    def own_targets(self, targets: list, poller: Any, now: float, version: Any = None) -> list:
        """The targets of this shard's groups (by their last state, else their registration's
        hint); one with neither is asked here, another shard's one again every REPROBE_S. The
        last slice is reused while ``version`` (Discovery.version) and the groups learned stand."""
        if self.cfg.index is None:
            return []
        key = (version, self._learned)
        if version is not None and key == self._slice_key and now < self._reprobe_at:
            return list(self._slice)
        known = {t.url for t in targets}
        self._groups = {u: g for u, g in self._groups.items() if u in known}
        mine, probe, reprobe_at = [], [], float("inf")
        for t in targets:
            g, at = self._groups.get(t.url, (t.replica_group, now))
            if g is None or (not self.owns(g) and now - at >= REPROBE_S):
                probe.append(t)
            elif self.owns(g):
                mine.append(t)
            else:
                reprobe_at = min(reprobe_at, at + REPROBE_S)
        if probe:
            for url, p in poller.sweep([t.url for t in probe]).items():
                g = p.data.get("replica_group") if p.ok and isinstance(p.data, dict) else None
                if isinstance(g, int) and not isinstance(g, bool):
                    self._groups[url] = (g, now)
            mine += [t for t in probe if t.url in self._groups
                     and self.owns(self._groups[t.url][0])]
            for t in probe:  # one still without a group is asked again next sweep
                g, at = self._groups.get(t.url, (None, now))
                if g is None or not self.owns(g):
                    reprobe_at = min(reprobe_at, now if g is None else at + REPROBE_S)
        self._slice, self._slice_key, self._reprobe_at = mine, key, reprobe_at
        # one without a group while others have one never answered with one (dead, mistyped,
        # no torchft rank): no rank anyone knows, so it leaves an empty slice empty
        self._unplaced = bool(targets) and all(
            self._groups.get(t.url, (t.replica_group, 0))[0] is None for t in targets)
        return list(mine)

    def after_sweep(self, view: Any, evidence: Any, now: float) -> None:
        """Learn the groups of the ranks polled, report this shard, propose its evictions.
        Never raises: etcd unreachable is logged once and shown."""
        for url in self.mon.views.changed:
            r = view.ranks.get(url)
            if r is not None and r.replica_group is not None and r.fresh:
                old = self._groups.get(url)
                self._groups[url] = (r.replica_group, now)
                if old is None or old[0] != r.replica_group:
                    self._learned += 1  # the slice may differ
        if self.cfg.index is None or time.monotonic() < self._retry_at:
            return
        mon = self.mon
        try:
            before, asked_at = self.session.lease, time.monotonic()
            lease = self.session.refresh()
            if self.holds and before and lease == before:
                # kept alive, so the key under it is still this run's: proposals go out in the
                # sweep etcd answers again, not one later
                self._holds_until = asked_at + self.session.granted_ttl
            # before the report: a leader that sees this run's report sees its proposals
            records = _by_rid(self.etcd, self.root + "evictions/")
            # the read's revision as far as the leader needs it: a record written after the read
            # is newer than every one it holds, one written before it is among them
            records_rev = max((kv.mod_revision for kv in records.values()), default=0)
            self.sent_kills = {rid for rid, kv in records.items()
                               if isinstance(rec := kv.json(), dict) and rec.get("state") == "sent"}
            # the single monitor's rail: reach outside the groups gone (the job's kills, and
            # those the Lighthouse lists as stopped while no more than the groups reached and
            # no id heard is unknown here or to the other shards), so
            # a kill of its slice blinds it to no other. A slice with no rank while a target's
            # group is known (more shards than groups, or its groups left) has nothing to be cut
            # off from: blind, it would hold every kill
            blind = mon.enforcer.blind_to_kills(
                evidence, mon.lighthouse_status, unheard=True, also=self.sent_kills,
                who=f"shard {self.cfg.index}", heard=not (view.ranks or self._unplaced),
                elsewhere=self.reported_elsewhere)
            # the proposals it keeps while their group is out of sight: the leader holds them.
            # Not acting (its lease lapsed), it withdraws nothing, so vouches for none: all held
            kept = self._propose_findings(view, evidence, now, records, blind) \
                if self.acting() else set(self._proposed)
            self._mirror_evictions(records)
            self._report(self.session.lease, {  # granted anew if it lapsed while proposing
                "shard": self.cfg.index, "shards": self.cfg.shards, "at": now,
                "monitor": mon.url, "sweeps": mon.sweeps, "blind": blind,
                "ranks": len(view.ranks), "run": self.run, "records_rev": records_rev,
                "out_of_sight": sorted(kept),
                "groups": {str(g): gv.replica_id for g, gv in evidence.groups.items()},
                # what its ranks answer as: another shard tells a group gone by it
                "reporting": sorted({rid for gv in view.groups.values()
                                     for rid in gv.reported_replica_ids if rid})}, asked_at)
            self.etcd_trouble.update(None, now)
            self.misconfig.update("; ".join(filter(None, (self._stray, self._no_leader())))
                                  or None, now)
        except EtcdError as e:
            self.etcd_trouble.update(str(e), now)
            self._back_off(e)
        m = mon.metrics
        # 0: it proposes nothing anyone acts on, for either reason
        m.shard_etcd_up.labels(m.job, "shard").set(0 if self.error else 1)
        m.shard_standby.labels(m.job).set(1 if self.holds is False else 0)

    @property
    def error(self) -> str | None:
        return self.etcd_trouble.error or self.misconfig.error

    def _no_leader(self) -> str | None:
        """Why no leader acts on this shard: no ``leader`` key under its prefix for 3 lease
        TTLs (a leader's lapse is replaced within one); None once one is seen."""
        now = time.monotonic()
        if self.etcd.get(self.root + "leader") is not None:
            self._leader_at = now
        elif now - self._leader_at > 3 * self.cfg.lease_ttl_s:
            return (f"no leader under {self.root} for {now - self._leader_at:.0f} s: nothing "
                    "acts on its proposals (the leader's --etcd-prefix and --job must be its "
                    "own)")
        return None

    def acting(self) -> bool:
        """Whether this run may act for its slice (abort, tell orphans to exit, fetch bundles,
        propose): it holds the slice's key and its lease cannot have lapsed. Not known yet (etcd
        never answered) or lapsed (etcd unreachable past the TTL, so another monitor may hold the
        slice now): it acts on nothing until etcd answers again."""
        if not self.holds:
            return False
        if time.monotonic() < self._holds_until:
            self._lapse_said = False
            return True
        if not self._lapse_said:
            log.warning("shard %s/%s: its lease may have lapsed (etcd unreachable for %d s): "
                        "acting on nothing until etcd answers", self.cfg.index, self.cfg.shards,
                        self.session.granted_ttl)
            self._lapse_said = True
        return False

    def _back_off(self, e: EtcdError) -> None:
        """A hung etcd costs each call its timeout: asked a third of the TTL later, not every
        sweep."""
        if e.timed_out:
            now, third = time.monotonic(), self.cfg.lease_ttl_s / 3.0
            retry = now + third
            if self.holds and self._holds_until > now:  # renewed before the hold can lapse
                retry = min(retry, max(now, self._holds_until - third))
            self._retry_at = retry

    def reported_elsewhere(self) -> tuple[set[str], bool]:
        """The replica ids the other shards' reachable ranks report (their leased reports), and
        whether every other shard of this --shards reported and could see its slice (a blind
        shard's report vouches for nothing); etcd unreachable: nothing, no."""
        if time.monotonic() < self._retry_at:  # a hung etcd: not asked again this sweep
            return set(), False
        try:
            kvs = self.etcd.range_prefix(self.root + "shards/")
        except EtcdError as e:
            self._back_off(e)
            return set(), False
        ids: set[str] = set()
        seen: set[int] = set()
        for kv in kvs:
            r = kv.json()
            if not isinstance(r, dict) or r.get("shards") != self.cfg.shards \
                    or not isinstance(r.get("reporting"), list) or r.get("shard") == self.cfg.index \
                    or r.get("blind") or not r.get("ranks"):
                continue
            seen.add(r["shard"])
            ids.update(x for x in r["reporting"] if isinstance(x, str))
        return ids, set(range(self.cfg.shards)) - {self.cfg.index} <= seen

    def _report(self, lease: int, report: dict[str, Any], asked_at: float) -> None:
        """Write this shard's report where the key is free or already this run's; held by another
        run (a second monitor with the same --shard, a SIGKILLed predecessor), stand by until
        that lease ends (said once). ``asked_at``: when the lease was last renewed (monotonic)."""
        key = f"{self.root}shards/{self.cfg.index}"
        did = self.etcd.put_if([leased_by(key, lease)], key, report, lease)[0] \
            or self.etcd.put_if([created_never(key)], key, report, lease)[0]
        where = f"shard {self.cfg.index}/{self.cfg.shards}"
        self._stray = None
        if did:
            if self.holds is False:
                log.warning("%s: the other monitor's lease ended: this one reports and "
                            "proposes", where)
            self.holds, self.held_by = True, None
            # renewed while proposing: held until later than the sweep's first renewal says
            self._holds_until = max(self._holds_until, asked_at + self.session.granted_ttl)
            return
        kv = self.etcd.get(key)
        other = kv.json() if kv is not None else None
        other = other if isinstance(other, dict) else {}
        n = other.get("shards")
        if n != self.cfg.shards:  # one of them was given the wrong --shards: never let go
            self._stray = (f"{where} is held by a monitor of --shards {n} ({other.get('monitor')}"
                           f", shard {other.get('shard')}/{n}): the job's slices are cut "
                           f"{self.cfg.shards} or {n} ways, not both; stop the wrong one")
        elif self.holds is not False:
            log.warning("%s is already run by another monitor (%s, run %s): this one stands by, "
                        "proposing nothing, until that one's lease ends", where,
                        other.get("monitor"), other.get("run"))
        self.holds = False
        self.held_by = {k: other.get(k) for k in ("monitor", "run", "at")}

    def _propose_findings(self, view: Any, evidence: Any, now: float,
                          records: dict[str, KV], blind: str | None) -> set[str]:
        """The enforcer's decisions under the shard's own rails, ``blind`` its report's, a
        proposal for each eviction (min replicas and cooldown are the leader's); then the
        withdrawals. Returns the replica
        ids of the proposals kept while their group is out of sight (all, if none withdrawn)."""
        mon = self.mon
        wanted: set[str] = set()

        def propose(f: Any) -> bool:
            wanted.add(f.replica_id)
            if f.replica_id in self._proposed:
                return True
            fid = mon.enforcer.finding_id(f.key)
            # kept before the proposal, so before any kill the leader sends on it
            bundle = mon.enforcer.keep_bundle(view, evidence, f.to_dict(), fid, {
                "decision": "proposed", "reason": f.kind, "source": "auto",
                "status": "proposing", "replica_group": f.replica_group,
                "replica_id": f.replica_id, "at": mon.clock()})
            if not self._renewed():
                return False
            did = self._propose(f.replica_group, f.replica_id, _summary(f), fid, f.to_dict(),
                                "auto")
            if did is not None and bundle is not None:
                mon.store.update_decision(did, bundle=bundle["id"])
            return True

        local = dataclasses.replace(mon.cfg.rails, min_replicas=0, cooldown_s=0.0)
        decided = mon.enforcer.decide(view, evidence, now, local, propose, lambda _: blind)
        # its group out of sight, a proposal made stays while its finding is open (it resolves
        # as left_job after --dead-sweeps): a flapping group is not proposed, with a bundle
        # fetched, and withdrawn every other sweep, even where that makes the shard blind (a
        # small slice); the leader holds it meanwhile
        kept = {f.replica_id for f in mon.detectors.open_findings()
                if f.replica_id in self._proposed and f.kind in local.evict_kinds
                and out_of_sight(evidence, f)}
        if not decided:  # its lease lapsed while proposing: nothing withdrawn, all held
            return set(self._proposed)
        self._withdraw(wanted | kept, records)
        return kept & self._proposed

    def _renewed(self) -> bool:
        """After a proposal's bundle (up to --bundle-timeout on this thread): the lease renewed,
        so a sweep of many proposals outlasts no hold; False: it lapsed meanwhile (its keys went,
        another run may hold the slice), propose nothing more. Raises EtcdError."""
        before, asked_at = self.session.lease, time.monotonic()
        if self.session.refresh() != before:
            return False
        self._holds_until = asked_at + self.session.granted_ttl
        return True

    def _withdraw(self, wanted: set[str], records: dict[str, KV]) -> None:
        """Delete this shard's automatic proposals that no open finding of this run stands behind
        (or it is blind, but for one whose group is out of sight) and no leader acted on: a
        leader never evicts on evidence the shard no longer holds (one of an earlier run goes
        too: the next sweep proposes anew). So does one
        of this shard's groups made by a shard whose run does not report (of an earlier
        --shards): the leader would hold it for ever, and this shard could propose nothing."""
        proposals = _by_rid(self.etcd, self.root + "proposals/")
        # one gone (withdrawn by another run that held the slice meanwhile): proposed anew
        self._proposed &= proposals.keys()
        runs: dict[Any, Any] | None = None  # the reporting shards' runs, read when needed
        for rid, kv in proposals.items():
            p = kv.json()
            rec = records.get(rid)
            if not _is_proposal(p) or p.get("manual") or _acted_on(rec):
                continue  # (a leader acted on it: it stays, and costs no txn every sweep)
            if p.get("shard") == self.cfg.index:
                if rid in wanted and p.get("run") == self.run:
                    continue
            elif not self.owns(p["replica_group"]):
                continue
            else:
                if runs is None:
                    runs = {str(r.get("shard")): r.get("run") for x in
                            self.etcd.range_prefix(self.root + "shards/")
                            if isinstance(r := x.json(), dict)}
                if p.get("run") is not None and runs.get(str(p.get("shard"))) == p["run"]:
                    continue  # its shard still runs (another --shards: the leader is blind)
            # the record as read: a leader retrying the failed kill meanwhile changed it
            record = f"{self.root}evictions/{rid}"
            if self.etcd.delete_if([created_never(record) if rec is None
                                    else modified_at(record, rec.mod_revision),
                                    modified_at(kv.key, kv.mod_revision)], kv.key):
                self._proposed.discard(rid)
                detail = ("no open finding stands behind the proposal, or this shard is blind"
                          if p.get("run") == self.run else "made by an earlier run of this "
                          "shard: proposed anew while a finding stands behind it"
                          if p.get("shard") == self.cfg.index else f"made by shard "
                          f"{p.get('shard')} in a run that does not report (an earlier "
                          "--shards?): this shard owns the group and proposes anew while a "
                          "finding stands behind it")
                log.warning("withdrew the proposal to evict %s: %s", rid, detail)
                _audit(self.mon, p, rid, "withdrawn", p["kind"], detail, source="auto")

    def _mirror_evictions(self, records: dict[str, KV]) -> None:
        """Copy the leader's sent kills of this shard's groups into its audit log (``sent``,
        ``source: leader``, with the finding proposed): the shard confirms them and charges them
        to that finding's goodput incident as a single monitor does."""
        mirrored: set[str] | None = None
        for rid, kv in records.items():
            rec = kv.json()
            if rid in self._mirrored or not isinstance(rec, dict) \
                    or rec.get("shard") != self.cfg.index or rec.get("state") != "sent":
                continue
            self._mirrored.add(rid)
            if mirrored is None:  # this shard's copies, not the rows of its own --lead thread
                mirrored = self.mon.store.mirrored_replica_ids()
            if rid in mirrored:  # by an earlier run
                continue
            fid, finding = self._finding_of(rid)
            _audit(self.mon, rec, rid, "evict", str(rec.get("kind")),
                   f"sent by the leader {rec.get('leader')} (attempt {rec.get('attempt')}): "
                   f"{rec.get('detail', '')}", "sent", finding_id=fid, finding=finding)

    def _finding_of(self, replica_id: str) -> tuple[int | None, dict | None]:
        """The finding this shard proposed ``replica_id``'s eviction on (its ``proposed`` row),
        else its open finding of that replica id; (None, None): neither is known."""
        row = self.mon.store.proposal_of(replica_id)
        if row is not None and isinstance(row.get("finding"), dict):
            return row.get("finding_id"), row["finding"]
        for f in self.mon.detectors.open_findings():
            if f.replica_id == replica_id:
                return self.mon.enforcer.finding_id(f.key), f.to_dict()
        return None, None

    def _propose(self, replica_group: int, replica_id: str, summary: dict[str, Any],
                 finding_id: int | None, finding: dict[str, Any], source: str) -> int | None:
        """Write the proposal unless one exists for this replica id: its audit row's id, None
        when one existed; raises EtcdError."""
        key = f"{self.root}proposals/{replica_id}"
        value = {"replica_group": replica_group, "replica_id": replica_id, "shard": self.cfg.index,
                 "monitor": self.mon.url, "at": self.mon.clock(), "source": source,
                 "manual": source == "manual", "run": self.run, **summary}
        created, _ = self.etcd.put_if([created_never(key)], key, value)
        self._proposed.add(replica_id)
        if not created:
            return None
        self.proposals_made += 1
        log.warning("proposed evicting replica group %s (%s): %s", replica_group, replica_id,
                    summary["kind"])
        return self.mon.store.add_decision(
            replica_group=replica_group, replica_id=replica_id, decision="proposed",
            reason=summary["kind"], detail=f"proposed to the leader as {key}",
            finding_id=finding_id, finding=finding, source=source, at=self.mon.clock())

    def propose_manual(self, replica_group: int, replica_id: str | None,
                       reason: str) -> dict[str, Any]:
        """``POST /v1/evict`` on a shard: a proposal the leader judges with the manual rails.
        A group of another shard, or one without a verified replica id, is held here (409)."""
        def hold(why: str, detail: str) -> dict[str, Any]:
            return {"id": None, "decision": "hold", "reason": why, "detail": detail}

        if not self.owns(replica_group):
            me = "this leader candidate (it owns none)" if self.cfg.index is None \
                else self.cfg.index
            return hold("other_shard", f"replica group {replica_group} belongs to shard "
                        f"{shard_of(replica_group, self.cfg.shards)}, not {me}: ask that shard")
        if replica_id is None:
            return hold("no_replica_id", "no verified rank of the group reports a torchft "
                        "replica id")
        key = f"{self.root}proposals/{replica_id}"
        try:
            for _ in range(3):  # the proposal or its record changed meanwhile: read them again
                did = self._propose(replica_group, replica_id, {"kind": "manual",
                                                               "detail": reason},
                                    None, {"kind": "manual", "reason": reason}, "manual")
                if did is not None:
                    return {"id": did, "decision": "proposed", "created": True, "proposal": key,
                            "reason": "proposed"}
                out = self._make_manual(replica_group, replica_id, reason)
                if out is not None:
                    return out
        except EtcdError as e:
            return hold("etcd_unreachable", str(e))
        return hold("busy", f"{key} kept changing while this request was made: ask again")

    def _make_manual(self, replica_group: int, replica_id: str,
                     reason: str) -> dict[str, Any] | None:
        """The proposal standing for ``replica_id`` made manual (judged with the manual rails,
        never withdrawn) unless a kill on it is in flight or was sent; audited either way. None:
        the keys changed since read or the proposal is gone; raises EtcdError."""
        key, record = f"{self.root}proposals/{replica_id}", f"{self.root}evictions/{replica_id}"
        kv, rec = self.etcd.get(key), self.etcd.get(record)
        if kv is None:
            return None
        p = kv.json()
        p = p if isinstance(p, dict) else {}
        row = {"replica_group": replica_group}
        finding = {"kind": "manual", "reason": reason}
        if _acted_on(rec):  # (a failed kill is retried, as manual, by the proposal made so)
            sent = isinstance(r := rec.json(), dict) and r.get("state") == "sent"
            why, detail = ("already_evicted", f"the leader already sent the kill of {replica_id}") \
                if sent else ("kill_in_flight", f"a leader's kill of {replica_id} is in flight: "
                              "ask again if the group stays")
            did = _audit(self.mon, row, replica_id, "hold", why, f"{detail} (given: {reason})",
                         source="manual", finding=finding)
            return {"id": did, "decision": "hold", "reason": why, "detail": detail}
        if p.get("manual") is True:
            did = _audit(self.mon, row, replica_id, "proposed", "manual",
                         f"already proposed by hand as {key} (given: {reason})",
                         source="manual", finding=finding)
            return {"id": did, "decision": "proposed", "created": False, "proposal": key,
                    "reason": "already_proposed"}
        value = {**p, "replica_group": replica_group, "replica_id": replica_id,
                 "shard": self.cfg.index, "monitor": self.mon.url, "at": self.mon.clock(),
                 "source": "manual", "manual": True, "run": self.run, "kind": "manual",
                 "detail": reason, "auto_kind": p.get("kind")}
        if not self.etcd.put_if([modified_at(key, kv.mod_revision),
                                 created_never(record) if rec is None
                                 else modified_at(record, rec.mod_revision)], key, value)[0]:
            return None
        log.warning("made the proposal to evict replica group %s (%s) manual: %s",
                    replica_group, replica_id, reason)
        did = _audit(self.mon, row, replica_id, "proposed", "manual",
                     f"the automatic proposal {key} ({p.get('kind')}) made manual: the leader "
                     f"judges it with the manual rails (given: {reason})", source="manual",
                     finding=finding)
        return {"id": did, "decision": "proposed", "created": False, "proposal": key,
                "reason": "made_manual"}

    def to_json(self) -> dict[str, Any]:
        e = self.leader.election if self.leader else None
        return {"index": self.cfg.index, "shards": self.cfg.shards, "lead": self.cfg.lead,
                "etcd": redact_url(self.cfg.etcd), "prefix": self.root, "held_by": self.held_by,
                "error": self.error, "standby": self.holds is False,
                # read, not judged: only the sweep says a lapse (a status read changes no log)
                "acting": bool(self.holds) and time.monotonic() < self._holds_until,
                "proposals_made": self.proposals_made,
                "owned_groups": sorted({g for g, _ in self._groups.values() if self.owns(g)}),
                "leading": bool(e and e.leading), "leader": e.leader if e else None,
                "candidate_id": e.id if e else None,
                "leader_error": self.leader.error if self.leader else None,
                "leader_blind": self.leader.blind if self.leader else None}
