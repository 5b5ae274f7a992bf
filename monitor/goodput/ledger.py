"""The goodput ledger: where the job's replica-seconds went, and what each incident cost, so that
``goodput + sum(badput) + pending == expected groups x wall seconds`` (docs/goodput.md).
"""

from __future__ import annotations

from collections import deque
from itertools import chain, repeat
from operator import attrgetter
from typing import Any

import numpy as np

from monitor.evidence.view import ClusterView

from .columns import CommitReader, History, Judged, Slots
from .incidents import DRAG_KINDS, SLOWING, UNSTOPPING, Incidents
from .model import PENDING, GoodputConfig, Incident, Interval, Run, SweepAccount
from .pace import JobPace, pace_of
from .report import GoodputReport
from .settle import GoodputSettlement, _link
from .snapshot import GoodputSnapshot

# how long after a kill a job with no rank running is still down for it, not ended: the
# monitor's default --starting-timeout, the time a relaunched rank may take to answer
RELAUNCH_S = 300.0


class GoodputLedger(GoodputReport, GoodputSnapshot, GoodputSettlement):
    """:meth:`update` once per sweep; read with :meth:`to_json` (report.py), save and resume
    with :meth:`snapshot`, :meth:`unsaved`, :meth:`restore` (snapshot.py); runs: settle.py."""

    def __init__(self, cfg: GoodputConfig | None = None) -> None:
        self.cfg = cfg or GoodputConfig()
        self.since: float | None = None  # first accounted sweep
        self.last_at: float | None = None
        self.slots, self.hist, self.judged = Slots(), History(), Judged()
        self.reader = CommitReader()
        self.job = JobPace(self.cfg)
        self.incidents = Incidents(self.cfg, self.slots, self._explain)
        self.last_commit_at: float | None = None  # the last sweep that saw a commit
        self.committed_at: float | None = None  # the earliest that commit may have been made
        # the last that saw one with no killed incarnation in the quorum: the job went on
        # without it (a commit seen after a kill may have been made before it landed)
        self.went_on_at: float | None = None
        self.expected_groups = 0
        self.first_incident = 1  # the store's incidents below are an older ledger's
        self.unobserved_s = self.gap_s = 0.0
        self.gaps = self.skipped_sweeps = 0
        # goodput re-judged as badput after the (monotonic) metrics counted it: paid back later
        self.goodput_debt = 0.0
        self._revised: list[tuple[str, float]] = []  # re-judged (cause, seconds) not counted
        self.runs: list[Run] = []  # unsettled badput, a group's in time order
        # kills sent and not yet seen land: the recovery booked after them is held uncounted
        self.unsure_kills: set[int] = set()
        self.intervals: deque[Interval] = deque(maxlen=self.cfg.keep_intervals)
        self.open_intervals: dict[str, Interval] = {}  # group key -> the interval it extends
        self._closed_intervals: list[Interval] = []  # not saved yet

    @property
    def baseline(self) -> float | None:
        return self.job.baseline

    def update(self, view: ClusterView, findings: list[dict[str, Any]],
               evictions: list[dict[str, Any]], now: float) -> SweepAccount:
        """Account one sweep: the evidence view, open confirmed findings and eviction decisions
        (each with its store ``id``). A sweep at or before the previous one is skipped."""
        acct = SweepAccount()
        if self.last_at is not None and now <= self.last_at:
            self.skipped_sweeps += 1
            return acct
        live = (r for r in view.ranks.values() if r.reachable and r.state)  # lazily
        first = next(live, None)
        if self.since is None and first is None:
            return acct  # no job seen yet: the ledger's clock has not started
        in_quorum = {g.replica_group for g in view.in_quorum()}
        deltas = self.reader.read(view, in_quorum, self.slots, self.hist.next, now,
                                  self.last_at is None)
        self.hist.append(now, self.slots.cum, self.job.window)
        self.incidents.ingest_findings(view, findings, now, self.since, self.job.horizon)
        self.incidents.ingest_evictions(evictions, now, self.since)
        self._judge_kills(evictions)
        self._end_recoveries(now)
        job_moved = self.job.ingest(self.reader.quorum_steps, now, self.reader.step_at,
                                    self.reader.quorum_rids, self.reader.rids, self.last_at)
        if self.since is None:
            self.since = self.last_at = now
            self._revised.clear()
            return acct
        for cause, seconds in self._revised:
            acct.badput[cause] += seconds
            acct.goodput -= seconds
        self._revised.clear()
        dt = now - self.last_at
        running = first is not None and any(r.state.get("phase") != "stopped"
                                            for r in chain((first,), live))
        if not running:
            self._account_down(view, dt, now, acct)
        elif dt > self.cfg.max_gap_s:
            self._account_gap(in_quorum, deltas, dt, now, acct)
        else:
            self._account(in_quorum, deltas, job_moved, dt, now, acct)
        self.goodput_debt -= min(0.0, acct.goodput)
        pay = min(max(0.0, acct.goodput), self.goodput_debt)
        acct.goodput, self.goodput_debt = max(0.0, acct.goodput) - pay, self.goodput_debt - pay
        self.last_at = now
        acct.expected_groups = self.expected_groups  # also where not accounted (metrics)
        self.incidents.follow(in_quorum, now, self.job)
        self.job.sample(now, self.incidents.unsettled(now, self.job.horizon))
        self._settle(now, acct)
        acct.group_goodput_ratio, acct.job_goodput_ratio = self.slots.ratios()
        return acct

    def _explain(self, inc: Incident) -> None:
        """A new incident claims the unsettled badput since its onset that it explains: a
        fault that slows commits (DRAG_KINDS) the slow time with commits as its drag, one that
        cannot stop them (SLOWING) the time without too."""
        self.job.forget_since(inc.onset_at)  # its pace is no norm: judged again without it
        for r in self.runs:
            if r.t1 <= inc.onset_at:
                continue
            if r.cause == PENDING and inc.kind in SLOWING:
                r.cause = "straggler_drag"
            elif (r.cause == PENDING and r.idle) or (inc.kind not in SLOWING
                                                      and self._provisional(r)):
                r.cause = "stall"
            elif r.cause == PENDING and inc.kind in DRAG_KINDS:
                r.cause = "straggler_drag"
            elif r.incident is not None or not (
                    r.cause == "stall" or (r.cause == "capacity_lost"
                                           and r.groups[0] == inc.replica_group)):
                continue
            _link(r, inc)
        self._rejudge(inc)

    def _rejudge(self, inc: Incident) -> None:
        """Judge again the sweeps since the onset that a window reaching before it credited whole:
        below pace, a sweep keeps ``commits x b`` and the rest is the incident's drag or stall."""
        b, J, S = self.baseline, self.judged, self.slots
        if b is None or not J:
            return
        cause = "straggler_drag" if inc.kind in DRAG_KINDS else "stall"
        t_on, n = inc.onset_at, len(S)
        t0, t1, before, after, credit = J.dense(n)
        judged = ~np.isnan(credit)
        ar = np.arange(n)
        # each group's cum at the onset
        by_then = judged & (t1 <= t_on + 1e-9)[:, None]
        first = np.argmax(judged, axis=0)
        last_by_then = len(t1) - 1 - np.argmax(by_then[::-1], axis=0)
        cum0 = np.where(by_then[first, ar], after[last_by_then, ar], before[first, ar])
        span = (t1 - t_on)[:, None]
        with np.errstate(invalid="ignore", divide="ignore"):  # masked out by `take`
            take = judged & ~by_then & (credit > 1e-9)
            take &= ~((span >= 2 * b) & ((after - cum0[None, :]) * b / span
                                         >= self.cfg.pace_threshold))
        slots_of, ks = np.nonzero(take.T)  # slot by slot, each in time order
        if not len(ks):
            return
        seconds = credit[ks, slots_of] * np.minimum(1.0, span[:, 0] / (t1 - t0))[ks]
        self._revised.extend(zip(repeat(cause), seconds.tolist()))
        for k in np.unique(ks).tolist():  # a run per sweep
            m = ks == k
            slots, sec = slots_of[m], seconds[m]
            J[k].credit[slots] = credit[k, slots] - sec
            g = S.gpus[slots]
            S.good[0, slots] -= sec
            S.good[1, slots[g > 0]] -= sec[g > 0] * g[g > 0]
            r = self._run(max(float(t0[k]), t_on), float(t1[k]), slots, sec.tolist(), cause,
                          counted=True)
            _link(r, inc)
            self.runs.append(r)
        self.runs.sort(key=attrgetter("t0"))  # a group's runs settle in time order

    def _judge_kills(self, evictions: list[dict[str, Any]]) -> None:
        """Recovery after a kill is counted once the kill is confirmed; after one turned
        unconfirmed (the group never left) that time was the fault's own, not a recovery."""
        self.unsure_kills = {d.get("id") for d in evictions if d.get("status") == "sent"}
        missed = {d.get("id") for d in evictions if d.get("status") == "unconfirmed"}
        for r in self.runs:
            if r.cause == "recovery" and not r.counted and r.eviction_id in missed:
                inc = self.incidents.get(r.incident)
                r.eviction_id = None
                if inc is None or not inc.finding_ids:  # a kill nothing found: unexplained
                    r.cause, r.incident, r.finding_id = PENDING, None, None
                else:
                    r.cause = "straggler_drag" if inc.kind in DRAG_KINDS and not r.idle \
                        else "stall"

    def _partition(self, in_quorum: set[int]) -> tuple[np.ndarray, np.ndarray, int]:
        """(slots in the quorum, known slots out of it filling expected ones, unseen count)."""
        S = self.slots
        gids = np.asarray(S.gids[1:], np.int64)
        known = np.argsort(gids, kind="stable") + 1
        inq = np.fromiter(map(in_quorum.__contains__, S.gids[1:]), bool, len(gids))
        inside, outside = known[inq[known - 1]], known[~inq[known - 1]]
        if self.cfg.expected_groups is None:
            self.expected_groups = len(gids)
            return inside, outside, 0
        e = self.expected_groups = max(self.cfg.expected_groups, len(inside))
        last_in = np.nan_to_num(S.last_in_quorum_at[outside], nan=0.0)
        outside = outside[np.argsort(-last_in, kind="stable")][:e - len(inside)]
        if e > len(inside) + len(outside):
            S.size_unseen()
        return inside, outside, e - len(inside) - len(outside)

    def _account(self, in_quorum: set[int], deltas: np.ndarray, job_moved: bool,
                 dt: float, now: float, acct: SweepAccount) -> None:
        t0, b, S, incs = self.last_at, self.baseline, self.slots, self.incidents
        inside, outside, unseen = self._partition(in_quorum)
        acct.accounted = True
        startup = b is None
        committed = bool(deltas[inside].any())
        if job_moved or committed:
            self.last_commit_at = now
            at = self.reader.step_at  # the ranks' date of it, else after the sweep before
            self.committed_at = at if at is not None and t0 < at <= now else t0
            killed = {i.replica_id for i in incs.open() if i.evicted_at is not None
                      and i.rejoined_at is None and i.replica_id is not None}
            if killed.isdisjoint(map(S.rid.__getitem__, inside.tolist())):
                self.went_on_at = now
        window = self.job.window
        # a stall: no group committed for a whole pace window
        stall = not startup and (self.last_commit_at is None
                                 or now - self.last_commit_at >= window)
        drag, other = incs.explaining(True, now), incs.explaining(False, now, self.committed_at)
        recovering = incs.recovering(now)
        idle = not job_moved and not committed
        # the pace window never reaches back across the onset of an incident not acted on
        cuts = [i.onset_at for i in incs.unacted(now) if now - window < i.onset_at < now]
        self.judged.drop_before(now - self.job.horizon)
        # only a slowdown open: a whole-window stall is its idle drag, until the job commits again
        keep = drag is not None and other is None
        if stall and recovering is None:  # only a fault that may stop commits holds a stall
            self._pending_to_stall(other, keep)
        slow = False
        if cuts:
            window = min(window, now - max(cuts))
        if startup:
            self._add_good(inside, np.zeros(len(inside)), dt, acct)
            if len(inside):
                self._book(self._run(t0, now, inside, [dt] * len(inside), "startup"), None, acct)
        else:
            pace = self.hist.pace(inside, S.born, window, b) if window >= 2 * b \
                else np.full(len(inside), np.nan)
            d = deltas[inside]
            held = d * b + S.carry[inside]
            earned = np.minimum(dt, held)
            at_pace = pace >= self.cfg.pace_threshold
            good = np.where(at_pace, dt, earned)
            S.carry[inside] = np.where(at_pace, 0.0, np.minimum(b, held - earned))
            cum = S.cum[inside]
            self.judged.add(t0, now, len(S), inside, cum - d, cum, good - earned)
            self._add_good(inside, good, dt, acct)
            rest = dt - good
            below = np.flatnonzero(rest > 1e-9)
            if len(below):
                if recovering is not None:
                    cause, inc = "recovery", recovering
                elif stall and not keep:
                    cause, inc = "stall", other
                elif idle and other is not None:  # a straggler slows, never stops
                    cause, inc = "stall", other
                elif drag is not None:  # slow, still committing
                    cause, inc = "straggler_drag", drag
                else:
                    cause, inc, slow = PENDING, None, True
                self._book(self._run(t0, now, inside[below], rest[below].tolist(), cause,
                                     idle=idle), inc, acct)
        S.carry[outside] = 0.0
        self._add_good(outside, np.zeros(len(outside)), dt, acct)
        for slot in outside.tolist():
            g = S.gids[slot]
            inc = None if startup else incs.of_group(g)
            # a group never yet in the quorum, with nothing wrong found, is still starting
            if startup or (np.isnan(S.last_in_quorum_at[slot]) and inc is None):
                cause = "startup"
            elif inc is None and recovering is not None:
                cause, inc = "recovery", recovering  # a survivor between quorums
            else:
                cause = "capacity_lost"
            self._book(self._run(t0, now, np.array([slot]), [dt], cause), inc, acct)
        self._book_unseen(unseen, t0, now, "startup" if startup else "capacity_lost", acct)
        self.job.ratio = pace_of(self.job.history, self.job.window, b)
        self.job.slow_since = (self.job.slow_since or t0) if slow else None

    def _end_recoveries(self, now: float) -> None:
        """A fault confirmed while the job recovers from an eviction ends that recovery at its
        detection, one held since before the kill once the kill's own part is over
        (:meth:`_held`); one that clears unevicted, the job below pace, gives the recovery
        back."""
        incs = self.incidents
        at_pace = self.job.ratio is not None and self.job.ratio >= self.cfg.pace_threshold
        cleared = {i.id for i in incs.open() if i.resolved_at == now and i.evicted_at is None}
        for inc in incs.values() if cleared and not at_pace else ():
            if inc.superseded_by in cleared:
                inc.back_to_pace_at = inc.superseded_by = inc.closed_at = None
                incs.dirty.add(inc.id)
        opened = incs.open()
        for inc in opened:
            if inc.evicted_at is None or inc.back_to_pace_at is not None:
                continue
            later = min((i for i in opened if i is not inc and i.resolved_at is None
                         and i.detected_at > inc.evicted_at),
                        key=attrgetter("detected_at", "id"), default=None)
            if later is not None:
                inc.back_to_pace_at, inc.superseded_by = later.detected_at, later.id
                self.incidents.dirty.add(inc.id)
            elif (held := self._held(inc, opened, now)) is not None:
                inc.back_to_pace_at, inc.superseded_by = self.last_at, held.id
                self.incidents.dirty.add(inc.id)

    def _held(self, inc: Incident, opened: list[Incident], now: float) -> Incident | None:
        """A fault confirmed by ``inc``'s kill and not acted on then (its eviction held) that
        explains the job's slowness once the kill's own part is over, by the ranks' commits:
        the job went on without the killed group (a fault that slows commits), or committed
        nothing for a whole window since the kill (one that may stop them); not one of a group
        the others go on without (Incidents.left)."""
        if self.last_at is None or self.last_at <= inc.evicted_at:
            return None
        went_on = self.went_on_at is not None and self.went_on_at > inc.evicted_at
        stalled = now - max(inc.evicted_at, self.last_commit_at or 0.0) >= self.job.window
        left = self.incidents.left
        return min((i for i in opened if i is not inc and i.resolved_at is None
                    and i.detected_at <= inc.evicted_at and i.replica_group not in left
                    and (i.evicted_at is None or i.evicted_at > inc.evicted_at)
                    and ((went_on and i.kind in DRAG_KINDS)
                         or (stalled and i.kind not in UNSTOPPING))),
                   key=attrgetter("detected_at", "id"), default=None)

    def _account_down(self, view: ClusterView, dt: float, now: float,
                      acct: SweepAccount) -> None:
        """No rank running. Within ``RELAUNCH_S`` of an unrejoined kill the job did not go on
        without, capacity is lost (on the group's own incident, else the kill's); otherwise the
        job ended: the time is unobserved."""
        killed = [i for i in self.incidents.open() if i.evicted_at is not None
                  and i.evicted_at < now and i.rejoined_at is None]
        inc = max(killed, key=attrgetter("evicted_at"), default=None)
        lost = 0.0
        if inc is not None and dt <= self.cfg.max_gap_s and not self._ended(view, inc, killed):
            lost = max(0.0, min(now, inc.evicted_at + max(RELAUNCH_S, self.job.horizon))
                       - self.last_at)
        self.unobserved_s += dt - lost
        if lost <= 0:
            return
        _, outside, unseen = self._partition(set())
        acct.accounted = True
        t0, t1 = self.last_at, self.last_at + lost
        self.slots.carry[outside] = 0.0
        self._add_good(outside, np.zeros(len(outside)), lost, acct)
        own = {i.replica_group: i for i in sorted(  # of_group's, for every group at once
            self.incidents.open(), key=attrgetter("detected_at", "id"))}
        for slot in outside.tolist():
            mine = own.get(self.slots.gids[slot])
            if mine is None and np.isnan(self.slots.last_in_quorum_at[slot]):
                self._book(self._run(t0, t1, np.array([slot]), [lost], "startup"), None, acct)
                continue
            self._book(self._run(t0, t1, np.array([slot]), [lost], "capacity_lost"),
                       mine or inc, acct)
        self._book_unseen(unseen, t0, t1, "capacity_lost", acct)

    def _ended(self, view: ClusterView, inc: Incident, killed: list[Incident]) -> bool:
        if self.went_on_at is not None and self.went_on_at > inc.evicted_at:
            return True  # it went on without the killed group: it is not down for the kill
        rids = {i.replica_id for i in killed}
        return any(r.reachable and r.state and r.replica_id not in rids
                   for r in view.ranks.values())

    def _pending_to_stall(self, inc: Incident | None, keep: bool = False) -> None:
        """``keep``: only a slowdown open, whose idle drag stays provisionally its own (a later
        hang's to claim until the job commits again, else the slowdown's). A hang claims none
        of that drag from before its onset: that part of the step was the slowdown's. Idle
        recovery stays its kill's here: only an incident opened since claims it (_explain)."""
        for r in self.runs:
            if (r.cause == PENDING or not keep and r.cause == "straggler_drag"
                    and self._provisional(r)) \
                    and self.last_commit_at is not None and r.t0 >= self.last_commit_at - 1e-9 \
                    and not (r.cause != PENDING and inc is not None
                             and r.t1 <= inc.onset_at + 1e-9):
                r.cause, r.incident, r.finding_id, r.eviction_id = "stall", None, None, None
                _link(r, inc)

    def _account_gap(self, in_quorum: set[int], deltas: np.ndarray, dt: float, now: float,
                     acct: SweepAccount) -> None:
        """Credit the commits made across a gap over ``max_gap_s``; the rest is unattributed."""
        inside, outside, unseen = self._partition(in_quorum)
        acct.accounted = True
        self.gaps += 1
        self.gap_s += dt
        b, S = self.baseline, self.slots
        for slot in inside.tolist() + outside.tolist():
            g = S.gids[slot]
            good = min(dt, int(deltas[slot]) * b) if b is not None and g in in_quorum else 0.0
            self._add_good(np.array([slot]), np.array([good]), dt, acct)
            if dt - good > 1e-9:
                self._book(self._run(self.last_at, now, np.array([slot]), [dt - good],
                                     "unattributed"), None, acct)
        self._book_unseen(unseen, self.last_at, now, "unattributed", acct)

    def _book_unseen(self, unseen: int, t0: float, t1: float, cause: str,
                     acct: SweepAccount) -> None:
        """The slots never seen, ``t1 - t0`` each, booked as one slice of slot 0: one a slot
        would give every sweep an interval of its own, overlapping the others."""
        for _ in range(unseen):  # one by one: slot 0 repeated in one array adds once
            self._add_good(np.zeros(1, np.int64), np.zeros(1), t1 - t0, acct)
        if unseen:
            self._book(self._run(t0, t1, np.zeros(1, np.int64), [(t1 - t0) * unseen], cause),
                       None, acct)

    def _add_good(self, slots: np.ndarray, good: np.ndarray, dt: float,
                  acct: SweepAccount) -> None:
        self.slots.add_good(slots, good, dt)
        acct.goodput = sum(good.tolist(), acct.goodput)
