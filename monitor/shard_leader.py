"""The one leader of a sharded monitor's job (docs/scaling.md, "The etcd protocol"): it applies
the global rails to the shards' proposals in etcd and sends the kills (used by monitor/shard.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .act.actions import Lighthouse
from .act.decisions import Situation, decide
from .config import ShardConfig
from .evidence.lighthouse_status import LighthouseReader, LighthouseStatus
from .lease import KV, Etcd, EtcdError, LeaderLease, created_never, modified_at

log = logging.getLogger(__name__)

RECORD_KEEP_S = 3600.0  # a kill's record and proposal, once the Lighthouse no longer hears it


def _by_rid(etcd: Etcd, prefix: str) -> dict[str, KV]:
    return {kv.key[len(prefix):]: kv for kv in etcd.range_prefix(prefix)}


def _is_proposal(p: Any) -> bool:
    return isinstance(p, dict) and isinstance(p.get("kind"), str) \
        and isinstance(p.get("replica_group"), int) and not isinstance(p["replica_group"], bool)


def _audit(mon: Any, rec: dict, rid: str, decision: str, reason: str, detail: str,
           status: str | None = None, source: str = "leader", finding_id: int | None = None,
           finding: dict | None = None) -> int:
    return mon.store.add_decision(
        replica_group=rec.get("replica_group"), replica_id=rid, decision=decision, reason=reason,
        detail=detail, finding_id=finding_id, finding=rec if finding is None else finding,
        status=status, source=source, at=mon.clock())


class Leader(threading.Thread):
    """A leader candidate, a thread with its own etcd and Lighthouse connections: while it holds the
    lease each tick resolves kills left in flight, then decides the proposals. Never fatal."""

    def __init__(self, cfg: ShardConfig, monitor: Any, root: str) -> None:
        super().__init__(daemon=True, name="lightkeeper-shard-leader")
        self.cfg, self.mon, self.root = cfg, monitor, root
        self.etcd = Etcd(cfg.etcd)
        name = "leader" if cfg.index is None else f"shard{cfg.index}"
        self.election = LeaderLease(self.etcd, root + "leader",
                                    {"name": name, "monitor": monitor.url}, cfg.lease_ttl_s)
        self.lighthouse = Lighthouse(monitor.cfg.lighthouse, monitor.cfg.kill_timeout_s)
        self.reader = LighthouseReader(monitor.cfg.lighthouse, monitor.cfg.lighthouse_timeout_s)
        self.error: str | None = None
        self.blind: str | None = None
        self._held: dict[str, str] = {}  # replica id -> last hold reason (logged once)
        self._sending_seen: dict[tuple[str, int], float] = {}
        # (replica id, failed record's revision) -> the first report since, of a shard that does
        # not say which records its sweep read
        self._reported_after: dict[tuple[str, int], int] = {}
        # a kill left in flight is lost once its replica still heartbeats 3 timeouts later
        self.resend_after_s = 3 * (monitor.cfg.lighthouse_heartbeat_timeout_ms or 5000) / 1000.0
        self._stopping = threading.Event()  # not _stop: threading.Thread has one

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=10)

    def run(self) -> None:
        tick = max(0.05, min(self.mon.cfg.interval_s, self.cfg.lease_ttl_s / 3.0))
        try:
            while not self._stopping.is_set():
                started, etcd_up = time.monotonic(), False
                try:
                    if self.election.campaign():
                        self.lead_once()
                    else:
                        self._sending_seen.clear()
                        self._reported_after.clear()
                        self._held.clear()
                    self.error = self.election.error
                    etcd_up = self.error is None
                except EtcdError as e:
                    self.error = str(e)
                except Exception as e:  # a bug in one tick must not end leadership's loop
                    log.exception("leader tick failed")
                    self.error = f"{type(e).__name__}: {e}"
                m = self.mon.metrics
                m.shard_etcd_up.labels(m.job, "leader").set(1 if etcd_up else 0)
                m.shard_leading.labels(m.job).set(1 if self.election.leading else 0)
                self._stopping.wait(max(0.0, tick - (time.monotonic() - started)))
        finally:
            self.election.resign()
            self.lighthouse.close()
            self.reader.close()
            self.etcd.close()

    def _blind(self, reports: dict[int, dict], status: LighthouseStatus | None,
               error: str | None) -> str | None:
        if status is None:
            return f"the leader cannot read the Lighthouse: {error}"
        missing = [i for i in range(self.cfg.shards) if i not in reports]
        if missing:
            return (f"shard(s) {', '.join(map(str, missing))} of {self.cfg.shards} have not "
                    f"reported within the lease TTL ({self.cfg.lease_ttl_s}s)")
        odd = [f"{i} ({r.get('shards')})" for i, r in sorted(reports.items())
               if r.get("shards") != self.cfg.shards]
        if odd:  # the slices do not cover the job: some groups nobody watches
            return f"shard(s) {', '.join(odd)} run another --shards than {self.cfg.shards}"
        return "; ".join(f"shard {i} is blind: {r['blind']}" for i, r in sorted(reports.items())
                         if r.get("blind")) or None

    def lead_once(self) -> None:
        """One tick of :meth:`run` while this monitor leads: the shards' reports, proposals and
        eviction records read, the rails applied, kills sent or resent."""
        status, error = self.reader.read()
        kvs = [(kv, r) for kv in self.etcd.range_prefix(self.root + "shards/")
               if isinstance(r := kv.json(), dict) and isinstance(r.get("shard"), int)
               and isinstance(r.get("groups", {}), dict)]
        reports = {r["shard"]: r for _, r in kvs}
        reported_at = {r["shard"]: kv.mod_revision for kv, r in kvs}  # its last report's
        proposals = _by_rid(self.etcd, self.root + "proposals/")
        records = _by_rid(self.etcd, self.root + "evictions/")
        self.blind = blind = self._blind(reports, status, error)
        # 1. kills a leader left in flight (this leader's own are never in flight between ticks):
        # landed, or lost and then ``failed``, retried by 2. only through the rails
        resolved = [rid for rid, kv in records.items()
                    if isinstance(rec := kv.json(), dict) and rec.get("state") == "sending"
                    and self._resolve(rid, kv, rec, status)]
        if resolved:
            records = _by_rid(self.etcd, self.root + "evictions/")
        # 2. proposals without a record, or whose kill failed (its shard withdraws it once no
        # finding stands behind it), oldest first
        group_of = {rid: int(g) for r in reports.values()
                    for g, rid in (r.get("groups") or {}).items()
                    if isinstance(rid, str) and str(g).isdigit()}
        for rid, kv in sorted(proposals.items(), key=lambda x: x[1].create_revision):
            rec = records[rid].json() if rid in records else None
            if rec is not None and (not isinstance(rec, dict) or rec.get("state") != "failed"):
                continue
            p = kv.json()
            if not _is_proposal(p):  # written by something else: never acted on
                continue
            if rec is not None and p.get("manual") is True \
                    and isinstance(done := rec.get("done_at"), (int, float)):
                # a manual kill skips the cooldown, but its retry is no new request: not every
                # tick while the Lighthouse is away
                wait = self.mon.cfg.rails.cooldown_s - (self.mon.clock() - done)
                if wait > 0:
                    self._hold(rid, p, "cooldown", f"its kill failed; tried again in "
                               f"{wait:.1f}s (--cooldown {self.mon.cfg.rails.cooldown_s:g})")
                    continue
            report = reports.get(p.get("shard"))
            if status is not None and rid not in status.members and rid not in status.heartbeats:
                self._hold(rid, p, "gone", "no longer in the Lighthouse's quorum or heartbeats")
                continue
            if not p.get("manual") and (report is None or report.get("run") != p.get("run")):
                # its shard withdraws it or proposes it again; no shard of this --shards has
                # that index (an earlier N's): nobody holds its evidence
                self._hold(rid, p, "stale_proposal", f"proposed by an earlier run of shard "
                           f"{p.get('shard')}" if report else f"shard {p.get('shard')} of the "
                           "proposal does not report")
                continue
            if not p.get("manual") and rid in (report.get("out_of_sight") or ()):
                # as a single monitor, no kill for a group no rank of which answers
                self._hold(rid, p, "out_of_sight", f"no rank of replica group "
                           f"{p['replica_group']} answers shard {p.get('shard')}")
                continue
            if rec is not None and not p.get("manual") and not self._read_failed(
                    rid, records[rid].mod_revision, report, reported_at[p["shard"]]):
                continue  # its shard may withdraw it once a sweep of it reads the kill failed
            d = decide(p["kind"], p["replica_group"], rid,
                       self._situation(status, records, group_of, blind), self.mon.cfg.rails,
                       manual=p.get("manual") is True)
            if not d.evict:
                self._hold(rid, p, d.reason, d.detail)
                continue
            if not self.election.keep():  # slow kills outlasted the lease: campaign again
                log.warning("leadership lapsed while sending kills: the rest wait for the "
                            "next term")
                self.election.leading = False
                return
            self._send(rid, p, (rec.get("attempt", 0) if rec else 0) + 1, records.get(rid),
                       d.detail, modified_at(kv.key, kv.mod_revision))  # not withdrawn meanwhile
            records = _by_rid(self.etcd, self.root + "evictions/")  # the cooldown's start
        # 3. kills sent (or failed) long ago of groups gone from the Lighthouse: their keys go,
        # else every shard's sweep and every tick reads every kill the job ever had (proposal
        # first: a proposal without its record would be sent again)
        keep_s = max(RECORD_KEEP_S, self.mon.cfg.rails.cooldown_s)  # the cooldown's start stays
        for rid, kv in records.items():
            rec = kv.json()
            if status is None or not isinstance(rec, dict) \
                    or rec.get("state") not in ("sent", "failed") \
                    or not isinstance(rec.get("at"), (int, float)) or rid in status.members \
                    or status.heartbeating(rid) or self.mon.clock() - rec["at"] < keep_s:
                continue
            guard = [self.election.guard(), modified_at(kv.key, kv.mod_revision)]
            p = proposals.get(rid)
            if p is None or self.etcd.delete_if([*guard, modified_at(p.key, p.mod_revision)],
                                                p.key):
                self.etcd.delete_if(guard, kv.key)

    def _read_failed(self, rid: str, failed_rev: int, report: dict, report_rev: int) -> bool:
        """Whether the sweep behind ``report`` read the evictions/ records at or after the
        failed record's revision (before it, the shard could not yet withdraw the proposal)."""
        seen = report.get("records_rev")
        if isinstance(seen, int) and not isinstance(seen, bool):
            return seen >= failed_rev
        # a shard that does not say (an older version): the second report since the failure,
        # whose sweep began after the first was written
        if report_rev <= failed_rev:
            return False
        return report_rev > self._reported_after.setdefault((rid, failed_rev), report_rev)

    def _hold(self, rid: str, p: dict, reason: str, detail: str) -> None:
        """Log and record a hold once per replica id and reason."""
        if self._held.get(rid) == reason:
            return
        self._held[rid] = reason
        log.info("leader holds %s (%s): %s", rid, reason, detail)
        self.mon.metrics.decisions.labels(self.mon.cfg.job, "hold", reason).inc()
        _audit(self.mon, p, rid, "hold", reason, f"leader: {detail}")

    def _situation(self, status: LighthouseStatus | None, records: dict[str, KV],
                   group_of: dict[str, int], blind: str | None) -> Situation:
        """The quorum from the Lighthouse (heartbeating members not evicted, by replica group
        where a shard reported it); evictions and the last one from etcd's records."""
        recs = {rid: r for rid, kv in records.items() if isinstance(r := kv.json(), dict)}
        evicted = {rid for rid, r in recs.items() if r.get("state") in ("sending", "sent")}
        last = max((r["at"] for r in recs.values() if isinstance(r.get("at"), (int, float))),
                   default=None)
        # a group killed this tick still heartbeats in this read: "evicted" leaves it out
        in_quorum = set() if status is None else {
            group_of.get(rid, rid) for rid in status.members
            if status.heartbeating(rid) and rid not in evicted}
        return Situation(now=self.mon.clock(), groups_in_quorum=in_quorum,
                         evicted_replica_ids=evicted, last_eviction_at=last, blind_reason=blind)

    def _send(self, rid: str, p: dict, attempt: int, prior: KV | None, detail: str,
              *also: dict) -> None:
        """``sending`` (guarded by the leader lease and the ``prior`` record as read), the kill,
        then ``sent``/``failed`` (guarded by the record still being ours)."""
        key = f"{self.root}evictions/{rid}"
        guard = modified_at(key, prior.mod_revision) if prior else created_never(key)
        rec = {"state": "sending", "replica_id": rid, "replica_group": p.get("replica_group"),
               "kind": p.get("kind"), "shard": p.get("shard"), "attempt": attempt,
               "leader": self.election.id, "term": self.election.leader_revision,
               "at": self.mon.clock()}
        ok, out = self.etcd.put_if([self.election.guard(), guard, *also], key, rec)
        if not ok:  # not leader any more, or someone wrote the record since: next tick decides
            log.info("not sending %s: the leader lease or the record changed", rid)
            return
        revision = int(out["header"]["revision"])
        log.warning("leader evicting replica group %s (%s), attempt %d: %s",
                    p.get("replica_group"), rid, attempt, detail)
        result = self.lighthouse.kill(rid)
        done = {**rec, "state": "sent" if result.sent else "failed", "done_at": self.mon.clock(),
                "http_status": result.http_status, "detail": result.detail}
        try:
            if not self.etcd.put_if([modified_at(key, revision)], key, done)[0]:
                log.warning("%s changed while its kill was in flight; left as it is", key)
        except EtcdError as e:  # stays "sending": the next leader tick resolves it
            log.warning("could not record the outcome of %s: %s", key, e)
        m, job = self.mon.metrics, self.mon.cfg.job
        m.decisions.labels(job, "evict", str(p.get("kind"))).inc()
        if result.sent:
            m.evictions.labels(job, str(p.get("replica_group"))).inc()
        m.last_eviction.labels(job).set(self.mon.clock())
        _audit(self.mon, p, rid, "evict", str(p.get("kind")),
               f"leader, attempt {attempt}: {detail}; kill: {result.detail}",
               "leader_sent" if result.sent else "leader_failed")

    def _resolve(self, rid: str, kv: KV, rec: dict, status: LighthouseStatus | None) -> bool:
        """A ``sending`` left by a leader that stopped mid-kill: ``sent`` once the replica left
        the Lighthouse, ``failed`` (retried as any failed kill) if it still heartbeats after
        resend_after_s. Whether the record was written."""
        if status is None:  # cannot tell whether the kill landed: wait
            return False
        first = self._sending_seen.setdefault((rid, kv.mod_revision), time.monotonic())
        key, was = f"{self.root}evictions/{rid}", rec.get("leader")
        if not status.heartbeating(rid):
            state, how = "sent", "leader_resolved"
            detail = (f"in flight when {was} stopped; the replica no longer heartbeats to the "
                      "Lighthouse: recorded sent, not sent again")
        elif time.monotonic() - first >= self.resend_after_s:
            state, how = "failed", "leader_failed"
            detail = (f"in flight when {was} stopped; still heartbeating "
                      f"{self.resend_after_s:g}s later: the kill was lost, recorded failed (sent "
                      "again only through the rails, while its proposal stands)")
        else:
            return False
        if not self.etcd.put_if([self.election.guard(), modified_at(key, kv.mod_revision)], key,
                                {**rec, "state": state, "resolved_by": self.election.id,
                                 "done_at": self.mon.clock(), "detail": detail})[0]:
            return False
        log.warning("eviction of %s was %s", rid, detail)
        _audit(self.mon, rec, rid, "evict", str(rec.get("kind")), f"leader: {detail}", how)
        return True
