"""``straggler``: the replica group the others wait for at the cross-group step.
Each rank's own clock only; the rule and its thresholds: docs/monitor.md.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from monitor.config import DetectorConfig
from monitor.evidence.group import rank_order
from monitor.evidence.view import STEP_TIMES_READ, ClusterView, GroupView, RankView
from rank_wire import QUORUM_KEY, TIMING_KEYS, TIMING_ROWS

from .findings import Finding, Findings
from .rank_state import phases, torch_step_seconds
from .step_memory import StepMemory

STATE_ASK = f"recent={STEP_TIMES_READ}&packed=1"
WINDOW_SLACK_STEPS = 2  # a new rank is asked for its group's window and this (groups a step apart)
STEP_MEMORY = TIMING_ROWS  # per-step timings kept per rank, as many as ranks serve
STEP_S, COMPUTE_S, WAIT_CROSS_S, WAIT_GROUP_S = range(len(TIMING_KEYS))

log = logging.getLogger(__name__)


@dataclass
class GroupMemory:
    """What the detectors remember of one incarnation of a group."""

    replica_id: str | None
    straggler_windows: int = 0
    straggler_newest: int | None = None  # newest step of the last straggler evaluation
    straggler_first_seen: float | None = None
    straggler_lags: list[float] = field(default_factory=list)


def is_late_window(lags: np.ndarray, threshold: float, need: int) -> np.ndarray:
    """Per row of ``lags`` (a group's lag per step): waited for in ``need`` steps and by
    ``threshold`` in the median one (per-step waits scatter too much to ask it of each)."""
    return ((lags > 0).sum(axis=1) >= need) & (np.median(lags, axis=1) >= threshold)


def lag_floor(min_lag: float, own: np.ndarray) -> float:
    """The least lag of a straggler: ``min_lag``, or the median group's own work a step (``own``:
    group x step; of two middle groups the lower) when shorter: a group late by that much at
    least halves the job's pace, and a GPU job's steps of tens of ms are under 0.1 s."""
    typical = float(np.quantile(np.median(own, axis=1), 0.5, method="lower"))
    return typical if 0 < typical < min_lag else min_lag


def late_for(values: np.ndarray, threshold: float, step_s: np.ndarray) -> float:
    """How long a window's late run has lasted, by the ranks' own step seconds: from the start
    of its earliest step at or over ``threshold`` after which the median stays there, through
    the newest step (0.0 when there is none)."""
    for j in range(len(values)):
        if values[j] >= threshold and np.median(values[j:]) >= threshold:
            return float(step_s[j:].sum())
    return 0.0


def straggler_lags(cross: np.ndarray, threshold: float, need: int
                   ) -> tuple[np.ndarray, set[int], list[int]]:
    """(per group, how long the others waited for it per step; rows late; rows not late), against
    the median of the others in O(G log G); a late one again against the least-waiting on time."""
    n = cross.shape[0] - 1  # the others
    if n <= 0:
        others = np.zeros_like(cross)
    else:
        ordered = np.sort(cross, axis=0)
        # taking each group's own value out of its column shifts the later positions by one
        at_or_after = np.empty(cross.shape, dtype=np.intp)
        for s in range(cross.shape[1]):
            at_or_after[:, s] = np.searchsorted(ordered[:, s], cross[:, s], side="left")

        def at(j: int) -> np.ndarray:  # position j of each group's list of the others
            return np.where(j < at_or_after, ordered[j], ordered[j + 1])

        others = at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2
    lags = others - cross
    late = is_late_window(lags, threshold, need)
    candidates = set(np.flatnonzero(late).tolist())
    healthy = np.flatnonzero(~late).tolist()
    if candidates and healthy:
        lags[late] = cross[~late].min(axis=0) - cross[late]
    return lags, candidates, healthy


@dataclass(frozen=True)
class Window:
    """The job's last straggler window, as monitor.detect.jobwide reads it: its steps, the median
    TIMING_KEYS seconds over every polled rank and step, the lag needed and each group's lag."""

    first: int
    newest: int
    step_s: float
    compute_s: float
    wait_cross_s: float
    wait_group_s: float
    lag_threshold_s: float
    lags: dict[int, float]
    steps_s: np.ndarray  # each step's median step seconds
    quorum_lags: dict[int, dict[str, Any]] | None = None  # Straggler.quorum_lags


@dataclass(slots=True, eq=False)
class Answers:
    """One pass over a view's answers: commit failures by URL, the silent and starting URLs,
    per group its ranks with timings (RankView, slot, replica id), groups of mixed replica ids."""

    view: ClusterView
    counts: dict[str, int] = field(default_factory=dict)
    silent: list[str] = field(default_factory=list)
    by_group: dict[int, list[tuple[RankView, int, str | None]]] = field(default_factory=dict)
    mixed: set[int] = field(default_factory=set)
    starting: list[str] = field(default_factory=list)


class Straggler:
    def __init__(self, cfg: DetectorConfig, findings: Findings,
                 groups: dict[int, GroupMemory]) -> None:
        self.cfg, self.findings, self.groups = cfg, findings, groups
        self.memory = StepMemory(STEP_MEMORY)
        # per group: (replica id, the newest step folded from any of its ranks)
        self._group_newest: dict[int, tuple[str | None, int]] = {}
        self.last_answers: Answers | None = None
        self._streaks: set[int] = set()  # groups whose memory may hold a late streak
        self.last_lags: dict[int, float] = {}  # replica_group -> how long the others waited
        self.last_window: Window | None = None  # the job's last full window
        self.lag_floor = cfg.straggler_min_lag_s  # of the last window (lag_floor)
        self.apart_since: float | None = None  # since when the ranks' rows share no window
        self._shrunk = 0  # sweeps in a row the quorum had fewer than two timed groups

    def state_queries(self, urls: Iterable[str], kept: Container[str] | None,
                      view: ClusterView | None) -> list[str]:
        """Per URL, its next ``/v1/state`` query (``?since=N&...``, N its newest folded step);
        ``kept``: the URLs the next fold keeps (the others count as holding none)."""
        memory, group_newest = self.memory, self._group_newest
        ranks = view.ranks if view is not None else {}
        back = self.cfg.straggler_steps + WINDOW_SLACK_STEPS
        out = []
        for url in urls:
            newest = memory.newest(url)
            if newest is None or (kept is not None and url not in kept):
                rv = ranks.get(url)
                st = rv.state if rv is not None else None
                got = group_newest.get(st.get("replica_group")) if st else None
                if got is None or got[0] != st.get("replica_id"):
                    out.append(f"?{STATE_ASK}")
                    continue
                newest = got[1] - back
            out.append(f"?since={newest}&{STATE_ASK}")
        return out

    def answers(self, view: ClusterView) -> Answers:
        """The pass over this sweep's answers (once per view), their timing rows folded."""
        got = self.last_answers
        if got is not None and got.view is view:
            return got
        memory, group_newest = self.memory, self._group_newest
        memory.keep_only(view.ranks.keys() if view.polled is None else set(view.polled))
        slot_of, rid_of, take = memory.slot.get, memory.rid, memory.take
        out = self.last_answers = Answers(view)
        counts, silent, by_group, mixed = out.counts, out.silent, out.by_group, out.mixed
        slots, blobs, quorum, polled = [], [], [], []
        for r in view.polled_ranks:
            url, s = r.url, r.state
            if not r.reachable or not s:
                silent.append(url)
                continue
            counts[url] = int(s.get("commit_failures") or 0)
            if s["quorum_id"] < 0:
                out.starting.append(url)
            if not r.fresh:  # carried: folded when it was polled
                continue
            rid = s.get("replica_id")
            slot = slot_of(url)
            if slot is None or rid_of[slot] != rid:
                slot = take(url, rid)
            timing = s.get("timing")
            rows = timing.get("recent") if type(timing) is dict else None
            waits = timing.get(QUORUM_KEY) if type(timing) is dict else None
            slots.append(slot)
            blobs.append(rows if type(rows) is bytes else b"")
            quorum.append(waits if type(waits) is bytes else b"")
            polled.append((r, slot, s["replica_group"], rid))
        added = memory.fold(slots, blobs, quorum)
        for (r, slot, g, rid), n, newest in zip(polled, added, memory.newest_of(slots),
                                                strict=True):
            if newest is None:
                continue
            if n:
                was = group_newest.get(g)
                if was is None or was[1] < newest or was[0] != rid:
                    group_newest[g] = (rid, newest)
            rows = by_group.setdefault(g, [])
            if rows and rid != rows[0][2]:
                mixed.add(g)
            rows.append((r, slot, rid))
        if len(group_newest) > 2 * len(view.groups) + 1024:  # groups gone: forgotten
            self._group_newest = {g: v for g, v in group_newest.items() if g in view.groups}
        return out

    def judge(self, view: ClusterView, now: float, blind: bool = False) -> list[Finding]:
        """``blind``: the monitor may be the one cut off: a quorum it sees shrink then has not."""
        self.answers(view)  # every sweep, judged or not
        # groups on torch's debug server only have no step timing: from_flight_recorder's
        groups = {g.replica_group: g for g in view.in_quorum() if not _torch_only(g)}
        members = self.members(view, groups) if len(groups) >= 2 else None
        if members is None:
            self.last_lags, self.last_window = {}, None
            shrunk = len(groups) < 2 and quorum_size(view, self.cfg.dead_sweeps, True) < 2
            # one sweep of a shrunk quorum (ids skewed a sweep, a blip) is no shrink: closing
            # then would reopen the same episode as a new finding at the group's next window
            if not shrunk:
                self._shrunk = 0
            elif not blind:
                self._shrunk += 1
            if shrunk and self._shrunk >= self.cfg.dead_sweeps:
                # nobody waits for a group alone: its finding would never see a window again
                for mem in self.groups.values():
                    mem.straggler_windows, mem.straggler_first_seen = 0, None
                    mem.straggler_lags = []
                self._streaks.clear()
                for key, f in list(self.findings.open.items()):
                    if key[0] == "straggler" and f.evidence.get("source") != "flight_recorder":
                        self.findings.resolve(key, "quorum_shrunk", now)
            return []
        self._shrunk = 0
        # a group's slots side by side: reduceat at its first rank gives its maximum
        order = list(groups)
        slots, starts = [], []
        for g in order:
            starts.append(len(slots))
            slots.extend(slot for _, slot, _ in members[g])
        slots = np.asarray(slots, np.int64)
        window = self.memory.common_steps(slots)[-self.cfg.straggler_steps:]
        if len(window) < self.cfg.straggler_steps:
            # no window: the arrival lags served must not be an old one's
            self.last_lags, self.last_window = {}, None
            self._apart(slots, now)
            return []
        if self.apart_since is not None:
            log.info("straggler: the replica groups' timing rows share a window again (steps "
                     "%d-%d); stragglers are judged", window[0], window[-1])
            self.apart_since = None
        timings = self.memory.seconds(slots, window)  # polled rank x window x TIMING_KEYS
        steps_s = np.median(timings[:, :, STEP_S], axis=0)
        # the cross-group all_reduce keeps a quorum's groups in lockstep: no rank waits there
        # longer than the ranks' median step less its own compute; one serving more is cut
        waits = np.minimum(timings[:, :, WAIT_CROSS_S],
                           np.maximum(steps_s - timings[:, :, COMPUTE_S], 0.0))
        cross = np.maximum.reduceat(waits, starts, axis=0)
        cut_s = np.median(timings[:, :, WAIT_CROSS_S] - waits, axis=1)  # per polled rank
        med_step = float(np.median(timings[:, :, STEP_S]))
        # a group's own work a step: its step outside the cross-group wait, its busiest rank's
        # (the step cut to the lockstep as the wait is)
        own = np.maximum.reduceat(np.minimum(timings[:, :, STEP_S], steps_s) - waits, starts,
                                  axis=0)
        floor = self.lag_floor = lag_floor(self.cfg.straggler_min_lag_s, own)
        threshold = max(floor, self.cfg.straggler_rel_lag * med_step)
        need = math.ceil(0.75 * len(window))
        lags, candidates, healthy = straggler_lags(cross, threshold, need)
        med_lags = np.median(lags, axis=1)
        late_in = (lags >= threshold).sum(axis=1).tolist()  # every step: one window confirms
        waited_in = (lags > 0).sum(axis=1).tolist()
        is_late = is_late_window(lags, threshold, need)
        self.last_lags = dict(zip(order, [round(v, 4) for v in
                                          np.maximum(med_lags, 0.0).tolist()], strict=True))
        meds = np.median(timings, axis=(0, 1)).tolist()
        self.last_window = Window(window[0], window[-1], meds[STEP_S], meds[COMPUTE_S],
                                  meds[WAIT_CROSS_S], meds[WAIT_GROUP_S], threshold,
                                  self.last_lags, steps_s,
                                  self.quorum_lags(order, members, slots, starts, window, floor,
                                                   timings))
        med_lags = med_lags.tolist()
        findings, mems = self.findings, self.groups
        open_groups = findings.groups("straggler")
        newest, new = window[-1], []
        for i in self.judged(order, is_late, open_groups):
            g = order[i]
            mem = mems.get(g)
            if mem is None or mem.straggler_newest == newest:
                continue  # no newer steps since the last evaluation
            mem.straggler_newest = newest
            if not is_late[i]:
                mem.straggler_windows, mem.straggler_first_seen, mem.straggler_lags = 0, None, []
                self._streaks.discard(g)
                f = findings.open.get(("straggler", g, groups[g].replica_id))
                # one found before its quorum shows no arrival lag: pre_quorum resolves it
                if f is not None and f.evidence.get("cause") != "before_quorum":
                    findings.resolve(f.key, "caught_up", now)
                continue
            mem.straggler_windows += 1
            self._streaks.add(g)
            mem.straggler_lags.append(round(med_lags[i], 4))
            if mem.straggler_first_seen is None:  # since its first late step began
                mem.straggler_first_seen = now - late_for(lags[i], threshold, steps_s)
            if mem.straggler_windows < self.cfg.straggler_windows and late_in[i] < len(window):
                continue
            # in the group's order of ranks, as its evidence lists them
            rows = sorted(members[g], key=lambda m: rank_order(m[0]))
            ranks, in_group = self._late_ranks(rows, window, threshold)
            against = healthy if i in candidates and healthy else [
                j for j in range(len(order)) if j != i]
            ev = {"summary": f"the other groups wait for replica group {g} at the cross-group "
                             f"step: {med_lags[i]:.3f}s in the median of steps {window[0]}-"
                             f"{window[-1]} (threshold {threshold:.3f}s, late in "
                             f"{late_in[i]}/{len(window)}); {in_group['verdict']}",
                  "median_lag_s": round(med_lags[i], 4), "threshold_s": round(threshold, 4),
                  "floor_s": round(floor, 4),
                  "median_step_s": round(med_step, 4), "late_in": f"{late_in[i]}/{len(window)}",
                  "waited_for_in": f"{waited_in[i]}/{len(window)}",
                  "lag_against": [order[j] for j in against],
                  "steps": [window[0], window[-1]], "windows": mem.straggler_windows,
                  "window_lags_s": mem.straggler_lags[-10:],
                  "peer_lags_s": {str(k): v for k, v in self.last_lags.items()},
                  "cross_wait_s": {str(h): round(statistics.median(row), 4)
                                   for h, row in zip(order, cross.tolist(), strict=True)},
                  # ranks whose served waits the cut lowered by a lag's worth
                  "cross_wait_cut_ranks": [
                      r.rank for (r, _, _), c in zip((m for h in order for m in members[h]),
                                                     cut_s.tolist(), strict=True)
                      if c >= threshold and r.rank is not None],
                  "in_group": in_group, "quorum_id": view.quorum_id,
                  "phases": phases(view, [r.rank for r, _, _ in rows if r.rank is not None]),
                  "evidence": "each rank's own per-step wait times (no clocks compared)"}
            new.append(findings.confirm("straggler", groups[g], ranks, ev,
                                        mem.straggler_first_seen, now, view))
        for mem in map(mems.get, order):  # the groups not judged: this window was seen
            if mem is not None:
                mem.straggler_newest = newest
        return [f for f in new if f]

    def quorum_lags(self, order: list[int], members: dict, slots: np.ndarray,
                    starts: list[int], window: list[int], floor: float, timings: np.ndarray
                    ) -> dict[int, dict[str, Any]] | None:
        """Each group's lag at torchft's quorum this window (job_slow's evidence, docs/monitor.md):
        a group's least quorum wait a step is its last arriver's, its lag a step the others'
        median less its own; with its last arriver (named when the same rank in 3/4 of the
        steps) and ``floor`` (the straggler's lag floor); ``extras_s``: per rank of it, its median
        compute a step less the median of every other polled rank's (work before the quorum
        shows there, a wait does not), ``extra_s`` its named last arriver's. Only with every
        polled rank's wait at every step, every group polled whole (a leader alone is not its
        last arriver)."""
        if any(len(members[g]) != members[g][0][0].state.get("group_world_size") for g in order):
            return None
        q = self.memory.quorum(slots, window)
        if np.isnan(q).any():
            return None
        need = math.ceil(0.75 * len(window))
        lags = straggler_lags(np.minimum.reduceat(q, starts, axis=0), math.inf, need)[0]
        # per polled rank, the others' median compute less its own: its extra work, negated
        extra = (-straggler_lags(np.median(timings[:, :, COMPUTE_S], axis=1)[:, None],
                                 math.inf, 1)[0][:, 0]).round(4).tolist()
        out = {}
        for i, g in enumerate(order):
            last = np.bincount(np.argmin(q[starts[i]:starts[i] + len(members[g])], axis=0),
                               minlength=len(members[g]))
            j = int(np.argmax(last))
            rv = members[g][j][0] if last[j] >= need else None
            mine = extra[starts[i]:starts[i] + len(members[g])]
            out[g] = {"rank": rv.rank if rv else None,
                      "host": rv.state.get("host") if rv else None,
                      "extra_s": mine[j] if rv else None,
                      "extras_s": {m[0].rank: e for m, e in zip(members[g], mine, strict=True)},
                      "steps": [int(last[j]), len(window)], "floor_s": floor,
                      "step_lags_s": [round(x, 4) for x in lags[i].tolist()]}
        return out

    def _apart(self, slots: np.ndarray, now: float) -> None:
        """Every rank holds a window of its own, but the ranks' rows share none (answered too
        many steps apart: steps of ms): stragglers go unjudged, said once until they share one."""
        need = self.cfg.straggler_steps
        if self.apart_since is not None or len(slots) == 0 \
                or int(self.memory.held(slots).min()) < need:
            return  # said already, or too few steps yet (a start, a heal): not apart
        newest = self.memory.newest_of(slots.tolist())
        log.warning("straggler: the replica groups' timing rows share no %d steps (their newest "
                    "steps %d-%d, %d kept per rank: answered too far apart): stragglers are not "
                    "judged until they do", need, min(newest), max(newest), STEP_MEMORY)
        self.apart_since = now

    def members(self, view: ClusterView, groups: dict[int, GroupView]
                ) -> dict[int, list[tuple[RankView, int, Any]]] | None:
        """Each group's ranks with timings of its replica id; None when a group has none."""
        answers = self.answers(view)
        by_group, mixed = answers.by_group, answers.mixed
        members = {}
        for g, gv in groups.items():
            rows = by_group.get(g)
            rid = gv.replica_id
            if rows is not None and (g in mixed or rows[0][2] != rid):
                rows = [m for m in rows if m[2] == rid] or None
            if rows is None:
                return None
            members[g] = rows
        return members

    def judged(self, order: list[int], is_late: np.ndarray, open_groups: set[int]) -> list[int]:
        """The positions in ``order`` to judge: late groups, those with a streak to reset or
        a finding to resolve."""
        late, known = np.flatnonzero(is_late).tolist(), self._streaks | open_groups
        if not known:
            return late
        late = set(late)
        return [i for i, g in enumerate(order) if i in late or g in known]

    def _late_ranks(self, rows: list[tuple[RankView, int, Any]], window: list[int],
                    threshold: float) -> tuple[list[int], dict[str, Any]]:
        keys = (("wait_group_s", WAIT_GROUP_S), ("compute_s", COMPUTE_S),
                ("wait_cross_s", WAIT_CROSS_S))
        ranked = [(r.rank, slot) for r, slot, _ in rows if r.rank is not None]
        # rank x TIMING_KEYS: each rank's median over the window
        meds = np.median(self.memory.seconds([s for _, s in ranked], window), axis=1).tolist()
        per_rank = {rank: {k: round(med[i], 4) for k, i in keys}
                    for (rank, _), med in zip(ranked, meds, strict=True)}
        waits = {rank: m["wait_group_s"] for rank, m in per_rank.items()}
        late = [rank for rank, w in waits.items() if len(waits) >= 2
                and statistics.median(v for k, v in waits.items() if k != rank) - w >= threshold]
        verdict = ("the rank(s) its peers wait for inside the group" if late else
                   "no rank stands out: the whole group is late")
        info = {"verdict": verdict, "ranks": {str(k): v for k, v in sorted(per_rank.items())}}
        return sorted(late) if late else sorted(per_rank), info


def quorum_size(view: ClusterView, dead_sweeps: int, timed: bool = False) -> int:
    """The groups at the newest quorum, each by its ranks' last answers: one missed this sweep
    or healing counts, one gone ``dead_sweeps`` sweeps or ended does not. No rank reachable:
    the newest id those answers name. ``timed``: only groups with step timing."""
    per_group = []
    for gv in view.groups.values():
        if timed and _torch_only(gv):
            continue
        qs = {r.state.get("quorum_id") for r in gv.ranks if r.state and not r.ended
              and (r.reachable or r.failures < dead_sweeps)}
        per_group.append({q for q in qs if type(q) is int and q >= 0})
    q = view.quorum_id
    if q is None:
        q = max((x for qs in per_group for x in qs), default=None)
    return sum(q in qs for qs in per_group) if q is not None and q >= 0 else 0


def _torch_only(gv: GroupView) -> bool:
    """Its ranks are on torch's debug server only (they share its store: one rank tells)."""
    s = gv.ranks[0].state if gv.ranks else None
    return s is not None and "torch_only" in s


def from_flight_recorder(view: ClusterView, analysis: list[dict] | None, now: float,
                         findings: Findings, cfg: DetectorConfig) -> list[Finding]:
    """Stragglers among ranks on torch's debug server only (no step timing of their own): the
    Flight Recorder engine's (monitor/analysis/stragglers.py), at each look, whose peers' median
    wait is at least --straggler-rel-lag of the step, as Lightkeeper's ranks' lag must be (the
    step the Lighthouse's step counter shows; none known yet: the engine's own floors); one it no
    longer names so is resolved ``caught_up``. Without it a group 11 ms late on a 0.35-s step,
    on a busy host, was evicted."""
    if analysis is None:
        return []
    floor = cfg.straggler_rel_lag * (torch_step_seconds(view) or 0.0)
    in_quorum = {gv.replica_group: gv for gv in view.in_quorum()}
    named: dict[int, tuple[list[int], dict]] = {}
    for s in analysis:
        wait = s.get("raw", {}).get("median_wait_ms") if s["kind"] == "straggler" else None
        if not isinstance(wait, (int, float)) or wait / 1000 < floor:
            continue
        for rank in s["culprits"]:
            rv = view.rank_view(rank)
            if rv is None or not rv.state or "torch_only" not in rv.state \
                    or rv.replica_group not in in_quorum:
                continue  # a Lightkeeper rank: its own timing is the straggler detector's
            ranks, _ = named.setdefault(rv.replica_group, ([], s["raw"]))
            ranks.append(rank)
    new = []
    for g, (ranks, raw) in named.items():
        ev = {"summary": f"rank(s) {sorted(ranks)} of replica group {g} late into the "
                         f"collectives of their Flight Recorder dumps: {raw.get('detail')}",
              "source": "flight_recorder", "clock": raw.get("evidence"), "z": raw.get("z"),
              "median_wait_ms": raw.get("median_wait_ms"),
              "collectives": raw.get("collectives"), "detail": raw.get("detail"),
              "analysis": raw}
        new.append(findings.confirm("straggler", in_quorum[g], sorted(ranks), ev, now, now,
                                    view))
    for key, f in list(findings.open.items()):
        if key[0] == "straggler" and f.evidence.get("source") == "flight_recorder" \
                and key[1] not in named:
            findings.resolve(key, "caught_up", now)
    return [f for f in new if f]
