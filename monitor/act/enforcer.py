"""From confirmed findings to decisions and actions: the audit log, the host ledger, the rails.

Each sweep's new findings are recorded, counted by the host ledger and decided under the rails;
kills are sent and later confirmed. A host ledger failure is logged and shown (``hosts_trouble``);
a failed decision or kill raises into the sweep, which logs it and goes on.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Collection
from typing import Any

from ..config import MonitorConfig, RailsConfig
from ..detect import JOB_KINDS, Detectors, Finding
from ..detect.liveness import DEAD_KINDS
from ..detect.network import gist
from ..evidence.claims import Claims
from ..evidence.lighthouse_settings import LighthouseSettingsWatch
from ..evidence.lighthouse_status import LighthouseStatus
from ..evidence.view import ClusterView
from ..store import Store
from .actions import NOT_IN_QUORUM, Lighthouse, Orphans, RankCalls
from .bundles import CONFIRM_KINDS, Bundles
from .decisions import Decision, Situation, blind_reason, decide
from .host_rails import drained_groups
from .hosts import DeadGroups, HostLedger, protected_hosts
from .survivors import Survivors
from .trouble import Trouble

log = logging.getLogger(__name__)


def in_quorum_by_replica_id(evidence: ClusterView) -> dict[str | None, set[int]]:
    """The evidence's groups in the newest quorum, by the replica id they report."""
    out: dict[str | None, set[int]] = {}
    for gv in evidence.in_quorum():
        out.setdefault(gv.replica_id, set()).add(gv.replica_group)
    return out


def reporting(view: ClusterView, replica_id: str | None) -> list:
    """The reachable ranks reporting ``replica_id``, in the targets' order (rank hint, URL)."""
    found = [r for gv in view.groups.values() if replica_id in gv.reported_replica_ids
             for r in gv.reachable if r.replica_id == replica_id]
    return sorted(found, key=lambda r: (r.target.rank if r.target is not None
                                        and r.target.rank is not None else 1 << 62, r.url))


def out_of_sight(evidence: ClusterView, f: Finding) -> bool:
    """No rank of the group answers this sweep, so its finding waits: a kill for a group
    nobody sees would start the cooldown and hide the death that follows. Never a dead one."""
    if f.kind in DEAD_KINDS:
        return False
    gv = evidence.groups.get(f.replica_group)
    return gv is None or not gv.reachable


def blindness_of(view: ClusterView, blind: str | None, rails: RailsConfig, who: str = "the monitor",
                 gone: Collection[str] = (), heard: bool = False) -> str | None:
    """Why nobody may be blamed now (decisions.blind_reason), by the verified ranks of ``view``
    less the groups of the replica ids ``gone``, for the monitor and its shards. Knowing none is
    blind (nothing shows ``who`` is not cut off) unless ``heard``: the Lighthouse's word counts."""
    ev = view.evidence_view or view
    known, up, _ = ev.counts
    for gv in ev.groups.values():
        if gv.replica_id in gone:
            known, up = known - len(gv.ranks), up - len(gv.reachable)
    if known <= 0 and heard:
        return blind
    return blind_reason(blind, up / known if known > 0 else 0.0, rails, who)


class Enforcer:
    """Findings -> audit log, host ledger, decisions, kills. ``blind()``: why ranks cannot be
    verified now (None: they can)."""

    def __init__(self, cfg: MonitorConfig, store: Store, detectors: Detectors, hosts: HostLedger,
                 lighthouse: Lighthouse, lh_settings: LighthouseSettingsWatch, metrics: Any,
                 blind: Callable[[], str | None], clock: Callable[[], float],
                 bundles: Bundles) -> None:
        self.cfg, self.store, self.detectors, self.hosts = cfg, store, detectors, hosts
        store.job = cfg.job  # the cooldown counts this job's kills, not another job's
        self.bundles = bundles
        self._bundled: set[int] = set()  # findings whose kill this sweep took a bundle
        self._bundled_rids: set[str] = set()  # and their replica ids (a shard's proposals too)
        self.lighthouse, self.lh_settings = lighthouse, lh_settings
        # shared by exits, aborts and probes (ProbeMesh) so each claim is said once
        self.claims = Claims()
        self.orphans = Orphans(RankCalls(cfg.rank_exit_token, cfg.kill_timeout_s,
                                         cfg.rank_auth, self.claims), cfg.orphan_grace_s)
        self.metrics, self.blind, self.clock = metrics, blind, clock
        self.hosts_trouble = Trouble("host ledger failed (its offences kept, tried again next "
                                     "sweep)", "the host ledger works again", logging.ERROR, log)
        self.verdict_trouble = Trouble("probe verdict not written to the audit log (tried again "
                                       "next sweep)", "probe verdicts written again", log=log)
        self._hosts_failed = False  # host_findings failed this sweep: judge_hosts keeps it said
        # set each sweep: another monitor holds this shard's slice, so this one sends no abort
        # or exit and fetches no bundle; it keeps its host ledger (and sinks) so that a
        # handover never leaves a quarantine nobody releases
        self.standby = False
        # another monitor holds the slice: it fetches the bundles (one whose hold merely may
        # have lapsed still does: they are read-only, and no one else may be there to)
        self.fetch_bundles = True
        self._finding_ids: dict[tuple, int] = {}
        self._verdicts: dict[tuple, tuple] = {}  # job-wide finding -> its probe verdict written
        self._unrecorded: list[Finding] = []  # confirmed, not in the audit log yet
        self._recorded: list[Finding] = []  # in the audit log, not yet handed on by record()
        self._last_decision: dict[tuple, str] = {}  # finding key -> the hold last recorded
        self._lock = threading.Lock()  # one decision at a time (the loop, the API)
        self._host_actions: threading.Thread | None = None
        self.dead = DeadGroups()
        self._vouched: dict[str, Any] = {}  # replica id -> its GroupView as last verified
        self.survivors = Survivors(RankCalls(cfg.rank_exit_token if cfg.abort_survivors
                                              else None, cfg.kill_timeout_s, cfg.rank_auth,
                                              self.claims),
                                   store, metrics, cfg.job, cfg.rails.dry_run)

    def finding_id(self, key: tuple) -> int | None:
        """The audit log's id of an open finding."""
        return self._finding_ids.get(key)

    def open_findings(self) -> list[dict[str, Any]]:
        """The detectors' open findings as the audit log knows them (with ``id``)."""
        return [{**f.to_dict(), "id": self._finding_ids.get(f.key)}
                for f in self.detectors.open_findings()]

    def record(self, new: list[Finding], now: float) -> list[Finding]:
        """Add the new findings to the audit log, with those a failed write (a full disk) left
        out before; write an open job-wide finding's evidence when its probe verdict changes
        (a restart leaves it as last written); close those the detectors resolved. The findings
        added."""
        new = self._unrecorded + new
        for i, f in enumerate(new):
            try:
                self._finding_ids[f.key] = self.store.add_finding(f.to_dict())
            except Exception:
                self._unrecorded = new[i:]  # tried again at the next sweep, not lost
                self._recorded += new[:i]  # written: handed on (offences, bundles) then
                raise
            group = "job" if f.replica_group is None else str(f.replica_group)
            self.metrics.findings.labels(self.cfg.job, f.kind, group).inc()
            self._verdicts[f.key] = gist(f.evidence.get("probe"))
        self._unrecorded = []
        self._recorded += new  # a failed resolution below must not lose them either
        failed = None
        for f in self.detectors.job_findings():
            said = gist(f.evidence.get("probe"))
            if f.key in self._finding_ids and said != self._verdicts.get(f.key):
                try:
                    self.store.update_finding_evidence(self._finding_ids[f.key], f.evidence)
                except sqlite3.Error as e:  # a verdict's note: tried again, the sweep goes on
                    failed = f"{type(e).__name__}: {e}"
                    continue
                self._verdicts[f.key] = said
        self.verdict_trouble.update(failed, now, kind="write")
        open_keys = {f.key for f in self.detectors.open_findings()}
        resolved = {f.key: f for f in self.detectors.resolved_findings()}
        for key in [k for k in self._finding_ids if k not in open_keys]:
            f = resolved.get(key)
            # a job-wide finding's probe rounds came after its confirmation: why nobody (or
            # whom) they named is kept with it
            self.store.resolve_finding(self._finding_ids[key], f.resolved_at if f else now,
                                       f.resolution if f else "cleared",
                                       f.evidence if f and f.kind in JOB_KINDS else None)
            del self._finding_ids[key]  # once written: a failed write is tried again
            self._verdicts.pop(key, None)
            self._last_decision.pop(key, None)
        new, self._recorded = self._recorded, []
        return new

    def host_findings(self, view: ClusterView, evidence: ClusterView, now: float,
                      reshaped: Any) -> list[Finding]:
        """New quarantined_host findings; those of released hosts are resolved. Never raises."""
        self._hosts_failed = False
        try:
            self.hosts.observe(view, now, reshaped)
            bad = set(self.hosts.quarantined())
            for f in self.detectors.open_findings():
                if f.kind == "quarantined_host" and not bad & set(f.evidence.get("hosts", {})):
                    self.detectors.resolve(f.key, "host_released", now)
            return [f for f in self.hosts.group_findings(evidence, now)
                    if self.detectors.report(f)]
        except Exception as e:
            self._hosts_failed = True
            self._host_ledger_failed(e, now)
            return []

    def judge_hosts(self, view: ClusterView, new: list[Finding], now: float,
                    lighthouse: LighthouseStatus | None = None) -> None:
        """Offences (a ``dead`` one once ``lighthouse``, the status just read, agrees:
        DeadGroups), the quarantine policy, then due sink actions on a background thread
        (a slow sink never delays a sweep). Never raises."""
        try:
            # a group the monitor sent a kill for ends by that kill (even one left unconfirmed,
            # its Manager gone and a bare rank still up): no host's fault
            killed = self.store.evicted_replica_ids()
            new = [f for f in new if f.kind not in ("dead", "dead_rank")
                   or f.replica_id not in killed]
            counted = [f for f in new if f.kind != "dead"] + self.dead.agreed(
                new, {f.key for f in self.detectors.open_findings()}, view, lighthouse, killed)
            group_hosts = {f.replica_group: view.groups[f.replica_group].hosts for f in counted
                           if f.replica_group in view.groups}
            charged = [{**f.to_dict(), "id": self._finding_ids.get(f.key)} for f in counted]
            # a network finding a later round widened to another host: that host charged now,
            # by its own culprits only (the hosts named before were charged at its opening)
            opened = {f.key for f in counted}  # charged from its culprits now, added ones too
            for f, added in self.detectors.network_hosts_added():
                if f.key in opened:
                    continue
                d = f.to_dict()
                culprits = [c for c in d["evidence"].get("culprits") or ()
                            if c.get("host") in added]
                charged.append({**d, "id": self._finding_ids.get(f.key),
                                "evidence": {**d["evidence"], "culprits": culprits}})
            self.hosts.record(charged, now, group_hosts)
            self.hosts.decide(now, self.blindness(view), len(self.hosts.known_hosts()),
                              lambda: protected_hosts(view, self.cfg.rails.min_replicas))
            if self.hosts.sinks and self.store.host_actions(due_at=now, limit=1):
                self._start_host_actions()
            self.metrics.set_hosts(self.hosts.counts(), self.hosts.to_json(now))
            if not self._hosts_failed:
                self.hosts_trouble.update(None, now)
        except Exception as e:
            self._host_ledger_failed(e, now)

    def _host_ledger_failed(self, e: Exception, now: float) -> None:
        # the audit log full is no bug: no traceback
        self.hosts_trouble.update(f"{type(e).__name__}: {e}", now,
                                  None if isinstance(e, sqlite3.OperationalError) else e,
                                  type(e).__name__)

    def blindness(self, view: ClusterView) -> str | None:
        """Why nobody may be blamed now: ranks cannot be verified, or the monitor reaches no
        more than ``--min-reachable`` of them (it may be the one cut off); None: neither."""
        # of the verified ranks: addresses anyone may register must not hold every eviction
        return blindness_of(view, self.blind(), self.cfg.rails)

    def cut_off(self, view: ClusterView, lighthouse: LighthouseStatus | None) -> str | None:
        """The reach half of :meth:`blindness`, only while the Lighthouse still hears a group
        the monitor misses (the monitor, not the job, is cut off)."""
        ev = view.evidence_view or view
        if lighthouse is None or not any(
                gv.replica_id and not gv.reachable and lighthouse.heartbeating(gv.replica_id)
                for gv in ev.groups.values()):
            return None
        return blindness_of(view, None, self.cfg.rails)

    def blind_to_kills(self, view: ClusterView, lighthouse: LighthouseStatus | None = None,
                       unheard: bool = False, also: Collection[str] = (),
                       who: str = "the monitor", heard: bool | None = None,
                       elsewhere: Callable[[], tuple[set[str], bool]] | None = None
                       ) -> str | None:
        """As :meth:`blindness`, without the ranks of groups told to go (they stop answering
        because of the monitor's own kills, or ``also``: a shard's leader's), ``lighthouse``
        heard when given (``heard``: whether knowing none is seen, if not so). ``unheard``: nor
        of groups it reaches none of that ``lighthouse`` lists as no longer heard (gone, as both
        agree), while they are no more than the groups it reaches (else both may be cut off
        together) and it hears no replica id of a lost group's name (:func:`_base`) that no
        rank known (a shard: nor ``elsewhere``, the other shards') reports."""
        gone = self.store.told_to_go_replica_ids() | set(also)
        if unheard and lighthouse is not None:
            groups = (view.evidence_view or view).groups.values()
            # heard, then stopped: a restarted Lighthouse lists none it has not heard yet
            lost = {gv.replica_id for gv in groups if gv.replica_id and not gv.reachable
                    and gv.replica_id in lighthouse.stale} - gone  # not its own kills
            # more groups lost than reached: the monitor and the Lighthouse may be the ones
            # cut off together (say, on one group's node), not the job
            if lost and len(lost) <= sum(1 for gv in groups if gv.reachable):
                # an id heard that no rank known reports may be a lost group's new incarnation
                # behind the same cut: torchft names one `<replica id>:<uuid>`, so only one of a
                # lost group's replica id (or named otherwise) may; a spare's may not
                bases = {_base(rid) for rid in lost}
                new = {rid for rid in lighthouse.heartbeats if lighthouse.heartbeating(rid)
                       and (_base(rid) is None or _base(rid) in bases)} \
                    - gone - {r.replica_id for r in view.ranks.values()}
                if new and elsewhere is not None:
                    new -= elsewhere()[0]
                if not new:
                    gone |= lost
        return blindness_of(view, self.blind(), self.cfg.rails, who, gone=gone,
                            heard=lighthouse is not None and not unheard if heard is None
                            else heard)

    def hosts_json(self) -> dict[str, Any]:
        """``GET /v1/hosts``."""
        q = self.cfg.quarantine
        return {"hosts": self.hosts.to_json(self.clock()), "counts": self.hosts.counts(),
                "quarantined": self.hosts.quarantined(), "dry_run": q.dry_run,
                "actions": [s.name for s in self.hosts.sinks],
                "policy": {"after": q.after, "window_s": q.window_s, "ttl_s": q.ttl_s,
                           "max_quarantined": q.max_quarantined,
                           "cap": q.cap(len(self.hosts.known_hosts()))},
                "decisions": self.store.host_decisions(limit=50), "error": self.hosts_trouble.error}

    def release_host(self, host: str, reason: str) -> dict[str, Any]:
        """``POST /v1/hosts/{host}/release``; KeyError / ValueError as HostLedger.release."""
        out = self.hosts.release(host, reason)
        if self.hosts.sinks:
            self._start_host_actions()
        return out

    def _start_host_actions(self) -> None:
        t = self._host_actions
        if t is not None and t.is_alive():
            return  # one run at a time
        self._host_actions = threading.Thread(target=self.hosts.run_actions,
                                              name="lightkeeper-host-actions", daemon=True)
        self._host_actions.start()

    def release_survivors(self, view: ClusterView, evidence: ClusterView, now: float,
                          lighthouse: LighthouseStatus | None,
                          shard: Any = None) -> list[dict]:
        """Tell ranks blocked with a gone group to abort (monitor.act.survivors); nothing while
        blind or on a standby. ``shard``: adds the leader's kills and what the other shards'
        ranks report."""
        # forget what was said of claims and refusals gone from the view: said again on return
        self.claims.keep(view)
        self.orphans.exits.keep(view)
        self.survivors.aborts.keep(view)
        if self.standby:  # the monitor holding the slice tells its survivors
            return []
        evicted = self.store.evicted_replica_ids()
        if shard is not None:
            evicted = evicted | shard.sent_kills
        # a gone group's ranks count against no reach: with two groups, half the ranks
        elsewhere = None if shard is None else shard.reported_elsewhere
        return self.survivors.release(view, evidence, lighthouse,
                                      self.blind_to_kills(view, lighthouse, unheard=True,
                                                          elsewhere=elsewhere),
                                      evicted, now, elsewhere)

    def bundle_confirmed(self, view: ClusterView, evidence: ClusterView,
                         new: list[Finding]) -> None:
        """A bundle for each new hang, mismatch or network finding that no kill bundled this
        sweep (held by a rail, say), written on the bundles' helper thread; none on a standby
        (the monitor holding the slice fetches them: a second fetch doubles the ranks' load)."""
        bundled, self._bundled = self._bundled, set()
        rids, self._bundled_rids = self._bundled_rids, set()
        if not self.fetch_bundles or not self.bundles.enabled:
            return
        confirmed = [f for f in new if f.kind in CONFIRM_KINDS]
        # an incarnation told to go (a kill sent this sweep or before, or proposed to the
        # leader this sweep) has its evidence in the kill's bundle: fetched after, it would find
        # the group going down and name another culprit. A kill that turned unconfirmed told
        # nobody to go: the live group's new findings keep their bundles
        killed = self.store.told_to_go_replica_ids() | rids if confirmed else set()
        for f in confirmed:
            fid = self.finding_id(f.key)
            if fid not in bundled and f.replica_id not in killed:
                self.bundles.capture_later("confirm", view, evidence, f.to_dict(), fid,
                                           self._related(f.replica_group))

    def keep_bundle(self, view: ClusterView | None, evidence: ClusterView | None,
                    finding: dict[str, Any] | None, finding_id: int | None,
                    decision: dict[str, Any]) -> dict | None:
        """The bundle of an eviction about to be sent, kept before the kill (its finding then
        gets no confirmation bundle, nor does any finding of its replica id once the kill is
        sent). None: none kept; never raises."""
        if not self.bundles.enabled or view is None:
            return None
        bundle = self.bundles.capture("evict", view, evidence, finding, finding_id, decision,
                                      self._related(decision["replica_group"]))
        if bundle is not None:
            if finding_id is not None:
                self._bundled.add(finding_id)
            if decision.get("replica_id"):
                self._bundled_rids.add(decision["replica_id"])
        return bundle

    def _related(self, group: int | None) -> list[dict[str, Any]]:
        """The group's open findings with their evidence (the bundle's ``findings.json``)."""
        return [f for f in self.open_findings() if f["replica_group"] == group]

    def close(self) -> None:
        """Let a sink action or a bundle under way finish (bounded)."""
        self.bundles.close()
        self.survivors.close()
        self.orphans.exits.close()
        if self._host_actions is not None:
            self._host_actions.join(timeout=self.cfg.quarantine.action_timeout_s + 5)

    def situation(self, view: ClusterView, evidence: ClusterView, now: float,
                  in_quorum: dict[str | None, set[int]] | None = None,
                  drained: set[int] | None = None,
                  blind: Callable[[ClusterView], str | None] | None = None) -> Situation:
        """Reachability by ``blind`` (else :meth:`blindness`); the quorum from verified ranks,
        less the groups sent a kill and those on a quarantined host (``drained``), which are
        going down."""
        evicted = self.store.evicted_replica_ids()
        if in_quorum is None:
            in_quorum = in_quorum_by_replica_id(evidence)
        if drained is None:
            # real quarantines only: a dry run's would-be one drains nothing, its groups stay
            drained = drained_groups(evidence, self.hosts.quarantined())
        groups = set().union(*in_quorum.values()) - drained
        for rid in evicted:
            groups -= in_quorum.get(rid, set())
        return Situation(now=now, groups_in_quorum=groups, evicted_replica_ids=evicted,
                         last_eviction_at=self.store.last_eviction_at(),
                         blind_reason=(blind or self.blindness)(view))

    def decide(self, view: ClusterView, evidence: ClusterView, now: float,
               rails: RailsConfig | None = None,
               evict: Callable[[Finding], bool] | None = None,
               blind: Callable[[ClusterView], str | None] | None = None,
               lighthouse: LighthouseStatus | None = None) -> bool:
        """Evict or hold every open finding of an evictable kind, except those out_of_sight.
        The ``monitor_blind`` rail: reach outside the groups gone (:meth:`blind_to_kills`,
        ``unheard``, by ``lighthouse``, the sweep's good read), so a dead group's own ranks
        count against no eviction, its own included. A shard gives its ``rails``, ``evict``
        (its proposal: False from it stops the loop) and ``blind`` (its report's blindness)."""
        rails = rails or self.cfg.rails
        if blind is None:
            def blind(v: ClusterView) -> str | None:
                return self.blind_to_kills(v, lighthouse, unheard=True)
        in_quorum = drained = None  # once per sweep, only when a finding asks (most: none)
        for f in self.detectors.open_findings():
            if f.kind not in rails.evict_kinds or out_of_sight(evidence, f):
                continue  # reported only (e.g. dead), or waiting until its group answers
            with self._lock:
                if in_quorum is None:
                    in_quorum = in_quorum_by_replica_id(evidence)
                    drained = drained_groups(evidence, self.hosts.quarantined())
                s = self.situation(view, evidence, now, in_quorum, drained, blind)
                s.quarantine_held = self.hosts.held_back_on(f.to_dict(),
                                                            s.evicted_replica_ids, now)
                d = decide(f.kind, f.replica_group, f.replica_id, s, rails)
                if d.evict and evict is not None:
                    if not evict(f):
                        return False
                # a hold is recorded once per reason, not every sweep it lasts
                elif d.evict or self._last_decision.get(f.key) != d.reason:
                    self.apply(d, f.replica_group, f.replica_id, self.finding_id(f.key),
                               f.to_dict(), "auto", view, evidence)
                    self._last_decision[f.key] = d.reason  # once written: a failed one is retried
        return True

    def evict_manual(self, view: ClusterView | None, evidence: ClusterView | None,
                     replica_group: int, replica_id: str | None, reason: str) -> dict[str, Any]:
        """``POST /v1/evict``: the same rails minus evidence, cooldown and blindness."""
        with self._lock:
            now = self.clock()
            s = self.situation(view, evidence, now) if view and evidence \
                else Situation(now=now, groups_in_quorum=set())
            d = decide("manual", replica_group, replica_id, s, self.cfg.rails, manual=True)
            return self.apply(d, replica_group, replica_id, None,
                              {"kind": "manual", "reason": reason}, "manual", view, evidence)

    def apply(self, d: Decision, replica_group: int, replica_id: str | None,
              finding_id: int | None, finding: dict[str, Any] | None,
              source: str, view: ClusterView | None = None,
              evidence: ClusterView | None = None) -> dict[str, Any]:
        """Record the decision; for an eviction keep the incident bundle (with ``view``), then
        send the kill and record how it went."""
        # an eviction counted by what it was for, as its audit row says (straggler, manual, ...)
        reason = (finding or {}).get("kind", source) if d.evict else d.reason
        given = (finding or {}).get("reason") if source == "manual" else None
        detail = f"{d.detail} (given: {given})" if given else d.detail  # the operator's why
        did = self.store.add_decision(replica_group=replica_group, replica_id=replica_id,
                                      decision=d.decision, reason=reason, detail=detail,
                                      finding_id=finding_id, finding=finding,
                                      status="sending" if d.evict else None, source=source,
                                      at=self.clock())
        self.metrics.decisions.labels(self.cfg.job, d.decision, reason).inc()  # once recorded
        if not d.evict:
            log.info("hold replica group %s (%s): %s", replica_group, d.reason, detail)
            return {"id": did, "decision": "hold", "reason": d.reason, "detail": detail}
        log.warning("evicting replica group %s (%s): %s", replica_group, replica_id, detail)
        bundle = self.keep_bundle(view, evidence, finding, finding_id, {
            "id": did, "decision": "evict", "reason": reason, "detail": detail,
            "source": source, "status": "sending", "replica_group": replica_group,
            "replica_id": replica_id, "at": self.clock()})
        if bundle is not None:
            try:  # the bundle's own row names the decision: the kill must not wait for this
                self.store.update_decision(did, bundle=bundle["id"])
            except sqlite3.Error as e:
                log.warning("decision %s not linked to bundle %s: %s", did, bundle["id"], e)
        result = self.lighthouse.kill(replica_id)
        note = f"; evidence kept in bundle {bundle['id']} ({bundle['seconds']:.2f}s)" \
            if bundle else ""
        try:  # unwritten (a full disk), the store keeps the outcome and writes it later
            self.store.update_decision(did, status="sent" if result.sent else "failed",
                                       http_status=result.http_status,
                                       detail=f"{detail}{note}; kill: {result.detail}")
        except sqlite3.Error as e:
            log.error("eviction %s %s, not recorded yet (%s)", did,
                      "sent" if result.sent else "failed", e)
        if result.sent:
            self.metrics.evictions.labels(self.cfg.job, str(replica_group)).inc()
        if result.sent and not result.unreached:  # one out of its quorum leaves nothing
            self.lh_settings.kill_sent(replica_id, self.clock())
        self.metrics.last_eviction.labels(self.cfg.job).set(self.clock())
        return {"id": did, "decision": "evict", "reason": reason, "sent": result.sent,
                "detail": result.detail, "bundle": bundle["id"] if bundle else None}

    def confirm_evictions(self, view: ClusterView, evidence: ClusterView, now: float,
                          lighthouse: LighthouseStatus | None = None) -> None:
        """Confirmed once no reachable rank reports the evicted replica id and ``lighthouse``
        (when given) no longer hears it, in a sweep that is not blind; ranks the kill missed are
        told to exit (or named); unconfirmed after ``confirm_timeout_s``. A standby judges
        none: its pending ones (the leader's kills copied) wait until it holds its slice."""
        pending = self.store.pending_confirmations()
        self.orphans.keep({d["id"] for d in pending})
        # a pending eviction's group as verified before its kill: only those ranks get the exit
        # token, never a stranger that registered claiming the evicted replica id
        groups = {gv.replica_id: gv for gv in evidence.groups.values()}
        groups.update((d["replica_id"], self._vouched[d["replica_id"]]) for d in pending
                      if d["replica_id"] in self._vouched)
        self._vouched = groups  # kept by a standby too: the ranks it may tell once it holds
        if self.standby:  # the monitor holding the slice confirms them and tells their orphans
            return
        blind = self.blind_to_kills(view, lighthouse) if pending else None
        for d in pending:
            rid = d["replica_id"]
            still = reporting(view, rid)
            landed = None
            if d["status"] == "interrupted":  # a previous run stopped while sending it
                if blind:
                    continue  # judged once the ranks can be seen: unseen is not gone
                landed = _landed(rid, still, lighthouse) if still else None
                if landed:  # the ranks still reporting are orphans, followed as a sent kill's
                    d["detail"] = f"{d['detail']}; the monitor stopped while sending: {landed}"
                    self.store.update_decision(d["id"], status="sent", detail=d["detail"])
                elif still:  # a killed Manager exits within a second
                    self.store.update_decision(d["id"], status="failed", detail=(
                        f"{d['detail']}; the monitor stopped while sending and the replica "
                        "still answers: the kill never landed"))
                    continue
            # a dry run (perhaps restarted to stop acting) tells no rank to exit
            urls = {r.url for r in groups[rid].ranks} \
                if rid in groups and not self.cfg.rails.dry_run else ()
            # as the audit row says (a restarted monitor, a shard's copy of the leader's kill)
            unreached = f"kill: {NOT_IN_QUORUM}" in (d["detail"] or "")
            note = self.orphans.follow(d["id"], rid, [r for r in still if r.url in urls],
                                       now - d["at"], view, unreached)
            if note:
                d["detail"] = f"{d['detail']}; {note}"
                self.store.update_decision(d["id"], detail=d["detail"])
            # ranks the monitor cannot reach are not gone while the Lighthouse hears the replica
            # (a killed Manager's heartbeat turns old after the Lighthouse's timeout)
            heard = lighthouse is not None and lighthouse.heartbeating(rid)
            if still or heard:
                if now - d["at"] > self.cfg.confirm_timeout_s and not landed:
                    # not one judged landed this sweep: its orphans were told only now
                    self._not_gone(d, still)
                continue
            if blind:
                continue  # unseen by a monitor that may be the one cut off is not gone
            lh = "" if lighthouse is None else "; the Lighthouse no longer hears it"
            if unreached:  # out of the quorum before the kill
                gone = "no rank reports it any more"
            else:  # the ranks' word: they may not be in the quorum that dropped it yet
                gone = (f"left the quorum (the survivors last said quorum_id {view.quorum_id}, "
                        f"{view.quorum_participants()} participants)")
            self.store.update_decision(d["id"], status="confirmed", confirmed_at=now,
                                       detail=f"{d['detail']}; {gone}{lh}")
            log.info("eviction of %s confirmed after %.1fs", rid, now - d["at"])

    def _not_gone(self, d: dict[str, Any], still: list) -> None:
        """Still reported or heard ``confirm_timeout_s`` after the kill: ``unconfirmed``, or
        ``failed`` for an interrupted kill (it never landed)."""
        why = "still reporting" if still else "the Lighthouse still hears it"
        if d["status"] == "interrupted":
            self.store.update_decision(d["id"], status="failed", detail=(
                f"{d['detail']}; the monitor stopped while sending and {why} after "
                f"{self.cfg.confirm_timeout_s:g}s: the kill never landed"))
        else:
            self.store.update_decision(d["id"], status="unconfirmed", detail=(
                f"{d['detail']}; {why} after {self.cfg.confirm_timeout_s:g}s"))


def _landed(replica_id: str, still: list, lighthouse: LighthouseStatus | None) -> str | None:
    """Why an interrupted kill landed although ``still`` report its replica id, or None: it
    reaches only group rank 0 (the Manager), so it landed once that rank is gone and the
    Lighthouse (when read) no longer hears the replica."""
    if any((r.state or {}).get("group_rank") == 0 for r in still):
        return None  # the Manager's process answers: the kill never reached it
    if lighthouse is None:
        return "the group's rank 0 (its Manager) no longer answers: the kill landed"
    if lighthouse.heartbeating(replica_id):
        return None
    return "the group's rank 0 (its Manager) no longer answers and the Lighthouse no longer " \
           "hears the replica: the kill landed"


def _base(replica_id: str) -> str | None:
    """torchft's Manager id ``<replica id>:<uuid>`` less its incarnation; None: not so named."""
    base, sep, _ = replica_id.rpartition(":")
    return base if sep else None
