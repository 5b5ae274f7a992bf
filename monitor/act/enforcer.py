"""From confirmed findings to decisions and kills (audit log, rails, bundles; hosts: host_side.py,
confirmation: confirm.py). A failed decision or kill raises into the sweep, which goes on."""

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
from .actions import Lighthouse, Orphans, RankCalls
from .bundles import CONFIRM_KINDS, Bundles
from .confirm import Confirmations
from .decisions import Decision, Situation, blind_reason, decide
from .host_rails import drained_groups
from .host_side import HostSide
from .hosts import DeadGroups, HostLedger
from .survivors import Survivors
from .trouble import Trouble

log = logging.getLogger(__name__)


def in_quorum_by_replica_id(evidence: ClusterView) -> dict[str | None, set[int]]:
    """The evidence's groups in the newest quorum, by the replica id they report."""
    out: dict[str | None, set[int]] = {}
    for gv in evidence.in_quorum():
        out.setdefault(gv.replica_id, set()).add(gv.replica_group)
    return out


def out_of_sight(evidence: ClusterView, f: Finding) -> bool:
    """No rank of the group answers this sweep, so its finding waits: a kill for a group
    nobody sees would start the cooldown and hide the death that follows. Never a dead one."""
    if f.kind in DEAD_KINDS:
        return False
    gv = evidence.groups.get(f.replica_group)
    return gv is None or not gv.reachable


def blindness_of(view: ClusterView, blind: str | None, rails: RailsConfig, who: str = "the monitor",
                 gone: Collection[str] = (), heard: bool = False) -> str | None:
    """Why nobody may be blamed now (decisions.blind_reason) by ``view``'s verified ranks less the
    groups ``gone``; none known: blind (``who`` may be cut off) unless the Lighthouse ``heard``."""
    ev = view.evidence_view or view
    known, up, _ = ev.counts
    for gv in ev.groups.values():
        if gv.replica_id in gone:
            known, up = known - len(gv.ranks), up - len(gv.reachable)
    if known <= 0 and heard:
        return blind
    return blind_reason(blind, up / known if known > 0 else 0.0, rails, who)


def _news(ev: dict) -> tuple:
    """What of an open job-wide finding's evidence is written again when it changes: its probe
    round's verdict, and whom job_slow names at torchft's quorum (often a window after it opens)."""
    q = ev.get("quorum_late") or {}
    return gist(ev.get("probe")), q.get("group"), q.get("rank")


class Enforcer(HostSide, Confirmations):
    """Findings -> audit log, hosts, decisions, kills. ``blind()``: why ranks are unverified."""

    def __init__(self, cfg: MonitorConfig, store: Store, detectors: Detectors, hosts: HostLedger,
                 lighthouse: Lighthouse, lh_settings: LighthouseSettingsWatch, metrics: Any,
                 blind: Callable[[], str | None], clock: Callable[[], float],
                 bundles: Bundles) -> None:
        self.cfg, self.store, self.detectors, self.hosts = cfg, store, detectors, hosts
        store.job = cfg.job  # the cooldown counts this job's kills, not another job's
        self._bundled: set[int] = set()  # findings whose kill this sweep took a bundle
        self._bundled_rids: set[str] = set()  # and their replica ids (a shard's proposals too)
        self.bundles, self.lighthouse, self.lh_settings = bundles, lighthouse, lh_settings
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
        # set each sweep: a standby (another monitor holds the slice) sends no abort or exit but
        # keeps its host ledger, so a handover leaves no quarantine unreleased; it fetches no
        # bundle unless its hold merely may have lapsed (read-only, and no one else may fetch)
        self.standby, self.fetch_bundles = False, True
        self._finding_ids: dict[tuple, int] = {}
        self._marks: dict[tuple, tuple] = {}  # Detectors.restarted as last saved
        self._verdicts: dict[tuple, tuple] = {}  # job-wide finding -> its _news written
        self._unrecorded: list[Finding] = []  # confirmed, not in the audit log yet
        self._recorded: list[Finding] = []  # in the audit log, not yet handed on by record()
        self._last_decision: dict[tuple, str] = {}  # finding key -> the hold last recorded
        self._lock = threading.Lock()  # one decision at a time (the loop, the API)
        self._host_actions: threading.Thread | None = None
        self.dead = DeadGroups()
        self._vouched: dict[str, Any] = {}  # replica id -> its GroupView as last verified
        aborts = RankCalls(cfg.rank_exit_token if cfg.abort_survivors else None,
                           cfg.kill_timeout_s, cfg.rank_auth, self.claims)
        self.survivors = Survivors(aborts, store, metrics, cfg.job, cfg.rails.dry_run)

    def finding_id(self, key: tuple) -> int | None:
        """The audit log's id of an open finding."""
        return self._finding_ids.get(key)

    def open_findings(self) -> list[dict[str, Any]]:
        """The detectors' open findings as the audit log knows them (with ``id``)."""
        return [{**f.to_dict(), "id": self._finding_ids.get(f.key)}
                for f in self.detectors.open_findings()]

    def record(self, new: list[Finding], now: float) -> list[Finding]:
        """Add the new findings (and those a failed write left out) to the audit log, a job-wide
        one's evidence again when its probe verdict changes; close the resolved. Those added."""
        new = self._unrecorded + new
        for i, f in enumerate(new):
            if f.key in self.detectors.restarted:
                f.reconfirms = self.detectors.restarted[f.key][0]
            try:
                self._finding_ids[f.key] = self.store.add_finding(f.to_dict())
            except Exception:
                self._unrecorded = new[i:]  # tried again at the next sweep, not lost
                self._recorded += new[:i]  # written: handed on (offences, bundles) then
                raise
            group = "job" if f.replica_group is None else str(f.replica_group)
            if f.reconfirms is not None:  # counted by the run that found it
                self.detectors.restarted.pop(f.key, None)
            else:
                self.metrics.findings.labels(self.cfg.job, f.kind, group).inc()
            self._verdicts[f.key] = _news(f.evidence)
        self._unrecorded = []
        self._recorded += new  # a failed resolution below must not lose them either
        if self.detectors.restarted != self._marks:  # a run that stops early hands them on
            self.store.save_restart_marks(self.detectors.restarted)
            self._marks = dict(self.detectors.restarted)
        failed = None
        for f in self.detectors.job_findings():
            said = _news(f.evidence)
            if f.key in self._finding_ids and said != self._verdicts.get(f.key):
                try:
                    self.store.update_finding_evidence(self._finding_ids[f.key], f.evidence)
                except sqlite3.Error as e:  # a verdict's note: tried again, the sweep goes on
                    failed = f"{type(e).__name__}: {e}"
                    continue
                if said[1] is not None and said[1:] != self._verdicts.get(f.key, (None,))[1:]:
                    # its confirmation's line blamed the network: the log says whom it names now
                    log.warning("%s now: %s", f.kind, f.evidence.get("summary"))
                self._verdicts[f.key] = said
        self.verdict_trouble.update(failed, now, kind="write")
        open_keys = {f.key for f in self.detectors.open_findings()}
        resolved = {f.key: f for f in self.detectors.resolved_findings()}
        for key in [k for k in self._finding_ids if k not in open_keys]:
            f = resolved.get(key)
            # a job-wide one keeps whom its probe rounds (after its confirmation) named, or none
            self.store.resolve_finding(self._finding_ids[key], f.resolved_at if f else now,
                                       f.resolution if f else "cleared",
                                       f.evidence if f and f.kind in JOB_KINDS else None)
            del self._finding_ids[key]  # once written: a failed write is tried again
            self._verdicts.pop(key, None)
            self._last_decision.pop(key, None)
        new, self._recorded = self._recorded, []
        return new

    def blindness(self, view: ClusterView) -> str | None:
        """Why nobody may be blamed now: ranks unverified, or the monitor (maybe the one cut off)
        reaches no more than ``--min-reachable`` of the verified ranks (anyone may register)."""
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
        """As :meth:`blindness`, less the groups told to go (the monitor's kills, ``also``: a
        shard's leader's); ``heard`` as blindness_of (default: ``lighthouse`` given, not
        ``unheard``). ``unheard``: less too those it reaches none of that ``lighthouse`` no longer
        hears, while no more than those it reaches and it hears no id of a lost group's name
        (:func:`_base`) that no rank known (a shard: nor ``elsewhere``, the others') reports."""
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

    def release_survivors(self, view: ClusterView, evidence: ClusterView, now: float,
                          lighthouse: LighthouseStatus | None,
                          shard: Any = None) -> list[dict]:
        """Tell ranks blocked with a gone group to abort (survivors.py); nothing while blind or
        on a standby. ``shard``: adds the leader's kills and the other shards' ranks' word."""
        # forget what was said of claims and refusals gone from the view: said again on return
        self.claims.keep(view)
        self.orphans.exits.keep(view)
        self.survivors.aborts.keep(view)
        if self.standby:  # the monitor holding the slice tells its survivors
            return []
        evicted = self.store.evicted_replica_ids()
        if shard is not None:
            evicted = evicted | shard.sent_kills
        elsewhere = None if shard is None else shard.reported_elsewhere
        # a gone group's ranks count against no reach: with two groups, half the ranks
        blind = self.blind_to_kills(view, lighthouse, unheard=True, elsewhere=elsewhere)
        return self.survivors.release(view, evidence, lighthouse, blind, evicted, now, elsewhere)

    def bundle_confirmed(self, view: ClusterView, evidence: ClusterView,
                         new: list[Finding]) -> None:
        """A bundle (on the bundles' thread) for each new hang, mismatch or network finding no kill
        bundled this sweep; none on a standby (a second fetch doubles the ranks' load)."""
        bundled, self._bundled = self._bundled, set()
        rids, self._bundled_rids = self._bundled_rids, set()
        if not self.fetch_bundles or not self.bundles.enabled:
            return
        confirmed = [f for f in new if f.kind in CONFIRM_KINDS]
        # one told to go (a kill sent, or proposed to the leader this sweep) has its evidence in
        # the kill's bundle: fetched after, it would find the group going down and name another
        # culprit; an unconfirmed kill told nobody to go: the live group's findings keep theirs
        killed = self.store.told_to_go_replica_ids() | rids if confirmed else set()
        for f in confirmed:
            fid = self.finding_id(f.key)
            if fid not in bundled and f.replica_id not in killed:
                self.bundles.capture_later("confirm", view, evidence, f.to_dict(), fid,
                                           self._related(f.replica_group, fid))

    def keep_bundle(self, view: ClusterView | None, evidence: ClusterView | None,
                    finding: dict[str, Any] | None, finding_id: int | None,
                    decision: dict[str, Any]) -> dict | None:
        """The bundle of an eviction, kept before the kill (no confirmation bundle then for its
        finding, nor its replica id's once sent). None: none kept; never raises."""
        if not self.bundles.enabled or view is None:
            return None
        bundle = self.bundles.capture("evict", view, evidence, finding, finding_id, decision,
                                      self._related(decision["replica_group"], finding_id))
        if bundle is not None:
            if finding_id is not None:
                self._bundled.add(finding_id)
            if decision.get("replica_id"):
                self._bundled_rids.add(decision["replica_id"])
        return bundle

    def _related(self, group: int | None, finding_id: int | None) -> list[dict[str, Any]]:
        """The group's other open findings and the job-wide ones (a stall that came first),
        with their evidence (the bundle's ``findings.json``)."""
        return [f for f in self.open_findings() if f["replica_group"] in (group, None)
                and (f["id"] != finding_id or finding_id is None)]

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
        """Reachability by ``blind`` (else :meth:`blindness`); the quorum from verified ranks, less
        the groups going down: sent a kill, or on a quarantined host (``drained``)."""
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
               rails: RailsConfig | None = None, evict: Callable[[Finding], bool] | None = None,
               blind: Callable[[ClusterView], str | None] | None = None,
               lighthouse: LighthouseStatus | None = None) -> bool:
        """Evict or hold every open finding of an evictable kind, except those out_of_sight.
        ``monitor_blind``: reach outside the groups gone (:meth:`blind_to_kills` ``unheard`` by
        ``lighthouse``), so a dead group's ranks count against no eviction, its own included. A
        shard gives ``rails``, ``evict`` (its proposal: False stops the loop) and ``blind``."""
        rails = rails or self.cfg.rails
        blind = blind or (lambda v: self.blind_to_kills(v, lighthouse, unheard=True))
        in_quorum = drained = None  # once per sweep, only when a finding asks (most: none)
        for f in self.detectors.open_findings():
            if f.kind not in rails.evict_kinds or out_of_sight(evidence, f):
                continue  # reported only (e.g. dead), or waiting until its group answers
            with self._lock:
                if in_quorum is None:
                    in_quorum = in_quorum_by_replica_id(evidence)
                    drained = drained_groups(evidence, self.hosts.quarantined())
                s = self.situation(view, evidence, now, in_quorum, drained, blind)
                s.quarantine_held = self.hosts.held_back_on(f.to_dict(), s.evicted_replica_ids, now)
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
        """Record the decision; to evict, keep the bundle (``view``), send the kill, record it."""
        # an eviction counted by what it was for, as its audit row says (straggler, manual, ...)
        reason = (finding or {}).get("kind", source) if d.evict else d.reason
        given = (finding or {}).get("reason") if source == "manual" else None
        detail = f"{d.detail} (given: {given})" if given else d.detail  # the operator's why
        did = self.store.add_decision(replica_group=replica_group, replica_id=replica_id,
                                      decision=d.decision, reason=reason, detail=detail,
                                      finding_id=finding_id, finding=finding, source=source,
                                      status="sending" if d.evict else None, at=self.clock())
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
        note += _quarantined_note(finding, self.hosts.quarantined())
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


def _quarantined_note(finding: dict[str, Any] | None, quarantined: list[str]) -> str:
    """The culprit hosts already quarantined (this sweep, before the kill): the audit row is
    where an on-call reads what to release."""
    ev = (finding or {}).get("evidence")
    hosts = ev.get("culprit_hosts") if isinstance(ev, dict) else None
    held = [h for h in dict.fromkeys(hosts or []) if h in quarantined]
    return f"; host(s) {', '.join(held)} quarantined (POST /v1/hosts/<host>/release)" \
        if held else ""


def _base(replica_id: str) -> str | None:
    """torchft's Manager id ``<replica id>:<uuid>`` less its incarnation; None: not so named."""
    base, sep, _ = replica_id.rpartition(":")
    return base if sep else None
