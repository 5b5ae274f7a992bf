"""The goodput ledger's incidents: one per faulty replica group incarnation, opened by its first
confirmed finding or an eviction decision (docs/goodput.md, "Definitions")."""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from operator import attrgetter
from typing import Any

from monitor.evidence.view import ClusterView

from .columns import Slots
from .model import GoodputConfig, Incident, as_float, as_int, as_ints
from .pace import JobPace

# first_seen dates a straggler from the start of its first late step: a strike inside that step
# (a later fault of the same rank is not its cause) comes this much after it at most
STRIKE_SLACK_S = 1.0
# faults that slow the job's commits, not only stop them: their slow commits are their drag
DRAG_KINDS = frozenset({"straggler", "network", "job_slow"})
# found, a group out of the quorum (torchft dropped a dead one, a stuck_starting one never
# joined): it costs capacity, never the pace of the groups that go on
OUT_KINDS = frozenset({"dead", "stuck_starting"})
# faults that slow the job's commits and cannot stop them: their idle sweeps are drag
SLOWING = frozenset({"straggler", "job_slow"})
# faults that cannot stop the job's commits once found: their stall is another fault's (but a
# crash stops them until they commit again: Incidents.explaining)
UNSTOPPING = OUT_KINDS | SLOWING


class Incidents(dict[int, Incident]):
    """Incidents by id; ``on_open`` is called with each new one."""

    def __init__(self, cfg: GoodputConfig, slots: Slots,
                 on_open: Callable[[Incident], None]) -> None:
        super().__init__()
        self.cfg, self.slots, self.on_open = cfg, slots, on_open
        self.next_id = 1
        self.seen_evictions: set[int] = set()
        self.open_findings = 0  # in the last sweep
        # the groups that answered out of the newest quorum in the last sweep: a group the
        # others go on without holds none of their commits (Incidents.unacted)
        self.left: set[int] = set()
        self.dirty: set[int] = set()  # changed since the last save
        self.swept = False  # a sweep's findings ingested (a restored ledger: not yet)
        # incidents whose findings a monitor restart closed -> until when they wait for the
        # restarted monitor to confirm the same fault again (saved: a later restart keeps it)
        self.held: dict[int, float] = {}

    def ingest_findings(self, view: ClusterView, findings: list[dict[str, Any]], now: float,
                        since: float | None, horizon: float) -> None:
        """Open an incident per new faulty incarnation (a later finding about it joins it); one
        whose findings all cleared is resolved. On a restored ledger's first sweep, an incident
        whose findings the restart closed is held ``horizon`` for the same fault to be confirmed
        again; one held before keeps its deadline (else frequent restarts never resolve it)."""
        open_ids = {fid for fid in map(as_int, (f.get("id") for f in findings))
                    if fid is not None}
        self.left = {g for g, gv in view.groups.items() if gv.reachable} \
            - {gv.replica_group for gv in view.in_quorum()}
        if not self.swept:
            self.swept = True
            new = [i.id for i in self.open() if i.finding_ids and i.resolved_at is None
                   and i.id not in self.held and not open_ids.intersection(i.finding_ids)]
            self.held.update(dict.fromkeys(new, now + horizon))
            self.dirty.update(new)  # saved soon: a restart before the next save holds them anew
        for f in findings:
            fid = as_int(f.get("id"))
            if fid is None or any(fid in i.finding_ids for i in self.values()):
                continue
            same = [i for i in self.values() if i.open
                    and i.replica_group == f.get("replica_group")
                    and i.replica_id == f.get("replica_id")
                    and (i.replica_id is not None or i.kind == f.get("kind"))]
            if same:
                same[-1].finding_ids.append(fid)
                same[-1].resolved_at = None
                self.held.pop(same[-1].id, None)
                self.dirty.add(same[-1].id)
                continue
            job = self._explained(f)
            if job is not None:
                self._name_group(job, f, fid)
                continue
            self._open(f, fid, view, now, since)
        self.open_findings = len(open_ids)
        if self.held:
            self.held = {i: until for i, until in self.held.items()
                         if now < until and i in self and self[i].open}
        for inc in self.values():
            if inc.finding_ids and inc.resolved_at is None and inc.open \
                    and inc.id not in self.held and not open_ids.intersection(inc.finding_ids):
                inc.resolved_at = now
                self.dirty.add(inc.id)

    def _explained(self, f: dict[str, Any]) -> Incident | None:
        """The open job-wide incident a group finding names the cause of: its evidence lists
        the job-wide findings it explains (``job_findings``: a network fault's host found by
        probing while the whole job stalled)."""
        ev = f.get("evidence") if isinstance(f.get("evidence"), dict) else {}
        kinds = ev.get("job_findings")
        if as_int(f.get("replica_group")) is None or not isinstance(kinds, list):
            return None
        return min((i for i in self.open() if i.replica_group is None and i.kind in kinds),
                   key=lambda i: i.onset_at, default=None)

    def _name_group(self, inc: Incident, f: dict[str, Any], fid: int) -> None:
        """The job-wide incident becomes the named group's: one fault, one incident, its cost
        counted from when the whole job first stalled, not from when the probes named a host."""
        g = as_int(f.get("replica_group"))
        inc.kind, inc.replica_group, inc.replica_id = str(f.get("kind")), g, f.get("replica_id")
        inc.ranks, inc.onset_source = as_ints(f.get("ranks")), "job_wide"
        inc.detected_at = as_float(f.get("confirmed_at")) or inc.detected_at
        inc.gpus_per_group = self._gpus(g)
        inc.finding_ids.append(fid)
        inc.resolved_at = None
        self.dirty.add(inc.id)

    def _gpus(self, g: int | None) -> int | None:
        """The group's world size as its ranks report it; None for a group never seen."""
        slot = self.slots.index.get(g)
        return (int(self.slots.gpus[slot]) or None) if slot else None

    def ingest_evictions(self, evictions: list[dict[str, Any]], now: float,
                         since: float | None) -> None:
        """Mark each new eviction's incident evicted: its finding's, else the incarnation's open
        one not yet evicted, else one it opens. Failed ones, ones from before this ledger and a
        sharded leader's own rows (``leader_*``: its shard's ``sent`` is the kill) are ignored;
        sending or interrupted ones until judged. One turned unconfirmed is taken back: its
        incident is open until acted on again (one it opened alone: resolved)."""
        for d in sorted(evictions, key=lambda d: as_float(d.get("at")) or 0.0):
            did = as_int(d.get("id"))
            if d.get("status") == "unconfirmed" and did in self.seen_evictions:
                self.seen_evictions.discard(did)
                for inc in self.values():
                    if inc.eviction_id == did:
                        inc.eviction_id = inc.evicted_at = inc.rejoined_at = None
                        if inc.superseded_by is not None:  # a recovery that never was
                            inc.back_to_pace_at = inc.superseded_by = None
                        if not inc.finding_ids:  # opened by this kill: nothing else to act on
                            inc.resolved_at = inc.resolved_at or now
                        elif inc.resolved_at is None:
                            inc.closed_at = None
                        self.dirty.add(inc.id)
            if did is None or did in self.seen_evictions or d.get("decision") != "evict" \
                    or d.get("status") in ("failed", "sending", "interrupted", "unconfirmed") \
                    or str(d.get("status")).startswith("leader_"):
                continue
            self.seen_evictions.add(did)
            at = as_float(d.get("at")) or now
            if at < (since if since is not None else now) - self.cfg.max_gap_s:
                continue
            fid = as_int(d.get("finding_id"))
            inc = next((i for i in self.values() if fid in i.finding_ids), None) \
                if fid is not None else self._unevicted(d)
            if inc is None:
                finding = d.get("finding") if isinstance(d.get("finding"), dict) else {}
                manual = d.get("source") == "manual" or not finding.get("first_seen")
                f = {"kind": "manual" if manual else finding.get("kind"),
                     "replica_group": d.get("replica_group"), "replica_id": d.get("replica_id"),
                     "ranks": finding.get("ranks") or [],
                     "first_seen": at if manual else finding.get("first_seen"),
                     "confirmed_at": at if manual else finding.get("confirmed_at") or at}
                inc = self._open(f, fid, None, now, since)
                if manual:
                    inc.onset_source = "eviction"
            if inc.evicted_at is None:
                inc.evicted_at, inc.eviction_id = at, did
                # looked for after this eviction: what ended an earlier one says nothing now
                inc.back_to_pace_at = inc.superseded_by = None
                inc.settled_pace = inc.settled_step_s = None
                self.dirty.add(inc.id)

    def _unevicted(self, d: dict[str, Any]) -> Incident | None:
        """The open incident not yet evicted of the incarnation a decision with no finding kills
        (``POST /v1/evict`` of a held finding's group): the kill acts on that fault."""
        g = as_int(d.get("replica_group"))
        return max((i for i in self.open() if g is not None and i.evicted_at is None
                    and i.replica_group == g and i.replica_id == d.get("replica_id")),
                   key=lambda i: (i.detected_at, i.id), default=None)

    def _open(self, f: dict[str, Any], fid: int | None, view: ClusterView | None, now: float,
              since: float | None) -> Incident:
        """Onset: the culprits' latest fault strike by the finding's ``first_seen`` (the ranks'
        own record of the fault its evidence began with), else ``first_seen``, never before the
        ledger began."""
        first = as_float(f.get("first_seen"))
        detected = as_float(f.get("confirmed_at")) or first or now
        onset, source = first if first is not None else detected, "first_seen"
        strike = strike_time(f, view, min(detected, onset + STRIKE_SLACK_S)) \
            if view is not None else None
        if strike is not None:
            onset, source = strike, "faults_struck_at"
        if since is not None:
            onset = max(onset, since)
        g = as_int(f.get("replica_group"))
        inc = Incident(id=self.next_id, kind=str(f.get("kind") or "unknown"),
                       replica_group=g, replica_id=f.get("replica_id"),
                       ranks=as_ints(f.get("ranks")), onset_at=onset, onset_source=source,
                       detected_at=detected, finding_ids=[fid] if fid is not None else [],
                       gpus_per_group=self._gpus(g))
        self.next_id += 1
        self[inc.id] = inc
        self.dirty.add(inc.id)
        self.on_open(inc)
        return inc

    def follow(self, in_quorum: set[int], now: float, job: JobPace) -> None:
        """Rejoined, back at pace (or settled), closed: acted on, back at pace and the group
        back in the quorum."""
        b = job.baseline  # before a settle moves it
        settled = job.track_steady(now, [i for i in self.open() if i.waiting],
                                   self.open_findings)
        S = self.slots
        for inc in self.open():
            changed = False
            if inc.evicted_at is not None and inc.rejoined_at is None \
                    and inc.replica_group in in_quorum \
                    and S.rid[S.index[inc.replica_group]] != inc.replica_id:
                inc.rejoined_at, changed = now, True
            if inc.back_to_pace_at is None:
                back = job.back_at(inc.search_from, now, b)
                if back is not None:
                    inc.back_to_pace_at, changed = back, True
                elif settled is not None and inc.waiting:
                    inc.back_to_pace_at = settled[0]
                    inc.settled_pace = round(b / settled[1], 3)
                    inc.settled_step_s = round(settled[1], 4)
                    changed = True
            acted = inc.evicted_at is not None or inc.resolved_at is not None
            back_in = inc.replica_group is None or inc.replica_group in in_quorum
            if inc.back_to_pace_at is not None and acted and back_in:
                # its cost in group-steps stays what it was, however the baseline moves on
                inc.closed_at, inc.closed_step_s, changed = now, b, True
            if changed:
                self.dirty.add(inc.id)

    def open(self) -> list[Incident]:
        return [i for i in self.values() if i.open]

    def unsettled(self, now: float, horizon: float) -> int | None:
        """The newest open incident whose fault may still set the job's pace (it freezes the
        baseline): not back at pace since its eviction or detection, or not acted on. One that
        only waits for its group to return holds it no more, nor one of a group out of the
        quorum (OUT_KINDS) back at pace or found ``horizon`` ago: capacity, not pace."""
        return next((i.id for i in reversed(self.open()) if (
            i.back_to_pace_at is None or (i.evicted_at is None and i.resolved_at is None))
            and (i.kind not in OUT_KINDS or (i.back_to_pace_at is None
                                             and now - i.detected_at < horizon))), None)

    def recovering(self, t: float) -> Incident | None:
        """The latest evicted incident whose job is not back at pace by ``t``."""
        return max((i for i in self.open() if i.evicted_at is not None and i.evicted_at < t
                    and i.back_to_pace_at is None), key=lambda i: i.evicted_at, default=None)

    def unacted(self, t: float) -> list[Incident]:
        """Open incidents not acted on by ``t``: findings open, no eviction before ``t`` (the
        kill a sweep decides is stamped after its time: that sweep's slow time is still the
        fault's, not yet a recovery); begun before ``t`` (a manual kill stamped after a sweep's
        time explains none of it); not of a group that answers out of the quorum (``left``):
        the others go on without it, so it stops none of their commits (its cost is capacity)."""
        return [i for i in self.open() if i.resolved_at is None and i.onset_at < t
                and (i.evicted_at is None or i.evicted_at >= t)
                and i.replica_group not in self.left]

    def explaining(self, drag: bool, t: float, committed_at: float | None = None
                   ) -> Incident | None:
        """The latest incident not acted on by ``t``, of a fault that slows commits (``drag``)
        or of one that may stop them (not UNSTOPPING). Evicted or its findings cleared, it
        explains no later slowness or stall (its group may never return; an eviction the job
        is still recovering from is :meth:`recovering`'s). With none that may stop them, a
        crash (``dead``, not evicted by ``t``, its findings cleared or not: a restarted group)
        while the job committed nothing since its onset (``committed_at``: its newest commit):
        torchft's survivors fail the step it struck in and wait for a new quorum."""
        key = attrgetter("detected_at", "id")
        found = max((i for i in self.unacted(t)
                     if (i.kind in DRAG_KINDS if drag else i.kind not in UNSTOPPING)),
                    key=key, default=None)
        if drag or found is not None:
            return found
        return max((i for i in self.open() if i.kind == "dead" and i.onset_at < t
                    and (i.evicted_at is None or i.evicted_at >= t)
                    and (committed_at is None or committed_at <= i.onset_at)),
                   key=key, default=None)

    def of_group(self, g: int | None) -> Incident | None:
        return max((i for i in self.open() if g is not None and i.replica_group == g),
                   key=lambda i: (i.detected_at, i.id), default=None)

    def unsaved(self) -> list[dict[str, Any]]:
        return [self[i].to_store() for i in sorted(self.dirty) if i in self]

    def forget_old(self, in_use: set[int | None]) -> None:
        """Drop closed incidents beyond ``keep_incidents`` that no unsettled badput is tied
        to (the store keeps them)."""
        closed = sorted((i for i in self.values() if not i.open), key=lambda i: i.id)
        for inc in closed[:max(0, len(closed) - self.cfg.keep_incidents)]:
            if inc.id not in in_use:
                del self[inc.id]


def strike_time(f: dict[str, Any], view: ClusterView, by: float) -> float | None:
    """The latest fault strike a culprit rank reports by ``by`` (of the finding's incarnation's
    ranks only, when it names one)."""
    ev = f.get("evidence") if isinstance(f.get("evidence"), dict) else {}
    ranks = set(as_ints(f.get("ranks")) + as_ints(ev.get("culprit_ranks")))
    strikes = []
    gv = view.groups.get(as_int(f.get("replica_group"))) \
        if f.get("replica_id") is not None else None
    for r in chain(gv.ranks, gv.superseded) if gv is not None else view.ranks.values():
        if r.state is None or r.rank not in ranks:
            continue
        if f.get("replica_id") is not None and r.replica_id != f.get("replica_id"):
            continue
        struck = r.state.get("faults_struck_at")
        if isinstance(struck, dict):
            strikes += [t for t in map(as_float, struck.values())
                        if t is not None and t <= by]
    return max(strikes) if strikes else None
