"""Detectors: from the cluster view (and live Flight Recorder dumps) to findings.

Each finding names a replica group (and its torchft ``replica_id``, i.e. one incarnation of the
group), the culprit ranks and their hosts (``evidence.culprit_ranks``, ``culprit_hosts`` and
``culprits``: rank, group rank, host, local rank, pid, URL, phase), the evidence, when it was first
seen and when it was confirmed. Only a *confirmed* finding is handed on to the decisions; a
candidate that does not persist is dropped silently.

No detector compares clocks of different hosts. What ranks measure about themselves (each rank's
per-step compute and collective-wait seconds on its own monotonic clock, ``timing`` in
``/v1/state``), Flight Recorder sequence numbers, and the monitor's own clock are the evidence.

- ``straggler``: the replica group the others wait for at the cross-group step. Each rank serves
  its last steps' ``wait_cross_s`` (time blocked in torchft's quorum and all_reduce) keyed by step
  number. Per step, a group's cross wait is its most-waiting rank's; the group that waits least is
  the late one and its *lag* is the median of the other groups' cross waits minus its own: how long
  they waited for it. A group is a straggler when, over the newest ``straggler_steps`` steps every
  group served, the others waited for it (lag above 0) in 3 of 4 steps and its median lag is at
  least ``max(straggler_min_lag_s, straggler_rel_lag x median step time)``, in
  ``straggler_windows`` consecutive evaluations that each saw newer steps, or its lag reached
  that threshold in every step of one window (as much evidence, a sweep sooner).
  A group late by that measure is measured again against the groups that
  are not late themselves: its lag is then the least-waiting one's cross wait minus its own (each
  healthy group waited at least that long; the median of the others is kept when every other
  group is late). On a loaded box the groups spread apart (issue 14/9: cross waits 0.41, 0.27
  and 0.61 s over many steps), and the fastest group's long wait no longer makes a middle-slow
  group a straggler. Inside that group the culprit is the rank everyone waits for: the one whose
  in-group wait (``wait_group_s``: FSDP's collectives, the commit vote) is at least that threshold
  below the median of its peers'; when no rank stands out, every rank of the group is late
  (the whole group is slow) and all are named.
- ``hang``: a rank of the newest quorum has waited inside a collective for at least ``max(hang_floor_s,
  hang_factor x median step time)`` (its own clock: ``timing.waiting``; waiting for a quorum is not a
  collective), no group's step moved since the previous sweep, and the analysis engine finds a
  collective of the current incarnation that some members enqueued and the culprits never did.
  When the engine also finds one inside the culprit group (its in-group process group, e.g. FSDP's
  all-gather), the culprits are the ranks that never entered *that* one (their peers are blocked
  in it); otherwise the group's ranks missing from the cross-group collective. A culprit must not
  itself be waiting inside the collective it is blamed for.
- ``mismatch``: the analysis engine over the live dumps finds members of one group that enqueued
  different collectives at one sequence id. The culprit is the minority; without a majority (two
  ranks of a replica group, or two survivors of a crashed cross-group all_reduce) it is the rank
  whose collective breaks its own repeating per-step pattern of collectives (``step_pattern``), or
  else differs from its own history of that collective (the engine's ``departs_from_history``).
  When neither singles one out, nothing is reported.
- ``dead_rank``: a rank unreachable for ``dead_sweeps`` consecutive sweeps while the rest of its
  group lives on: group rank 0 (whose process runs the group's torchft Manager and heartbeats to
  the Lighthouse) still answers with the same replica id. torchft keeps such a group in the quorum
  and every group waits for it until its timeouts: this one evicts by default.
- ``dead``: ranks unreachable for ``dead_sweeps`` sweeps whose group's Manager rank is gone too (the
  group died whole, or its rank 0 did): torchft drops such a group itself (reported only).
- ``stuck_starting``: a rank that answers but has not reached its first quorum (``quorum_id`` -1)
  for ``starting_timeout_s`` on the monitor's clock since the monitor first saw it so (e.g. its
  group's store or rank 0 never came up, or its Lighthouse is unreachable). Judged on every rank
  the monitor polls, verified or not; its replica id is the verified one or none (so it can only
  be evicted, when asked for with ``--evict-on``, once its group is verified).

Every sweep's dumps are normalized once (:func:`monitor.analysis.normalize_dumps`). A dump that is
not a Flight Recorder dump is left out (and logged); the other ranks are still judged.

A group whose ``replica_id`` changes (torchft restarted it) starts from a clean slate: nothing
seen about the previous incarnation carries over. A detector that fails on odd input logs and
skips that sweep; it never takes the monitor down.
"""

from __future__ import annotations

import logging
import math
import statistics
import struct
import time
from collections import deque
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import numpy as np

from monitor.analysis import GroupKey, RankTrace, analyze, normalize_dumps
from monitor.config import DetectorConfig
from monitor.evidence.view import STEP_TIMES_READ, ClusterView, GroupView, RankView
from monitor.poll.packed_state import TIMING_KEYS, TIMING_ROW

from .step_memory import StepMemory

log = logging.getLogger(__name__)

Analyzer = Callable[[Mapping[int, RankTrace]], Any]  # normalized traces -> result with .findings
KINDS = ("straggler", "hang", "mismatch", "dead_rank", "dead", "stuck_starting",
         "quarantined_host")  # the last one is opened by monitor.act.hosts through report()
# what every /v1/state is asked for: the step times the view reads, and the two number lists
# packed (worker_server/packed.py: ~5 us less per answer to read, monitor/poll/packed_state.py)
STATE_ASK = f"recent={STEP_TIMES_READ}&packed=1"
# the query of a rank whose rows the detectors hold none of, nor its group's: every timing row
# it serves (Detectors.state_queries)
EVERY_ROW_QUERY = f"?{STATE_ASK}"
# a rank with no rows folded whose group's are (a member polled at its slower cadence) is asked
# for the rows after its group's newest folded step less the straggler's window and this many
# steps more: what a window needs, with room for groups a step apart (Detectors.state_queries)
WINDOW_SLACK_STEPS = 2
STEP_MEMORY = 32  # per-step timings kept per rank (ranks serve their last 16)
# a folded step row is a tuple in TIMING_KEYS' order (a dict per row cost ~2x as much to make)
STEP_S, COMPUTE_S, WAIT_CROSS_S, WAIT_GROUP_S = range(4)
_PLAIN, _INF = (float, int), math.inf  # timing_rows' fast check
_TIMING_VALUES = itemgetter(*TIMING_KEYS)  # a served row's four seconds, in TIMING_KEYS order
# a folded row in the per-rank memory: its four seconds packed (32 bytes, one object): the
# straggler reads ~21,000 ranks' window rows a sweep at 100,000 ranks, and four float objects
# a row, each allocated apart when its answer was parsed, cost a cache miss each to reach
_ROW = struct.Struct(f"<{len(TIMING_KEYS)}d")
# a packed served row is its step and then a _ROW (monitor/poll/packed_state.py)
_PACKED_ROW, _PACKED_STEP = TIMING_ROW, struct.Struct("<q")


@dataclass
class Finding:
    kind: str
    replica_group: int
    replica_id: str | None
    ranks: list[int]
    evidence: dict[str, Any]
    first_seen: float
    confirmed_at: float | None = None
    resolved_at: float | None = None
    resolution: str | None = None

    @property
    def key(self) -> tuple[str, int, str | None]:
        return (self.kind, self.replica_group, self.replica_id)

    @property
    def open(self) -> bool:
        return self.resolved_at is None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "replica_group": self.replica_group,
                "replica_id": self.replica_id, "ranks": list(self.ranks),
                "evidence": self.evidence, "first_seen": self.first_seen,
                "confirmed_at": self.confirmed_at, "resolved_at": self.resolved_at,
                "resolution": self.resolution}


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def engine_findings(result: Any) -> list[dict[str, Any]]:
    """Normalize an analyzer result's findings to dicts with kind, culprits and the engine JSON."""
    out = []
    for f in _get(result, "findings", None) or []:
        try:
            as_dict = f.to_dict() if hasattr(f, "to_dict") else dict(f) if isinstance(
                f, Mapping) else dict(vars(f))
            culprits = _get(f, "culprit_ranks", None) or []
            group = _get(f, "group", None)
            out.append({
                "kind": _get(f, "kind"),
                "culprits": sorted(int(r) for r in culprits),
                "quorum_id": as_dict.get("quorum_id", _get(group, "quorum_id")),
                "replica_group": as_dict.get("replica_group", _get(group, "replica_group")),
                "has_majority": as_dict.get("has_majority", True),
                "waiting": [int(r) for r in as_dict.get("waiting_ranks") or []],
                "seq": as_dict.get("seq"),
                "raw": as_dict,
            })
        except Exception as e:  # an engine finding of a shape we do not know: skip it
            log.warning("ignoring analysis finding %r: %s", f, e)
    return out


# --- what a rank says about itself ------------------------------------------------------------

def timing_rows(state: Mapping[str, Any] | None, skip: Mapping[int, Any] | tuple = (),
                packed: bool = False) -> list[tuple[int, Any]]:
    """The per-step timings a ``/v1/state`` serves (``timing.recent``, else
    ``timing.last_step``): (step, (step_s, compute_s, wait_cross_s, wait_group_s)) with an int
    step (not ``true``/``false``) and four finite non-negative float seconds, in the order served (``packed``: the
    seconds as one ``_ROW`` bytes, as the detectors keep them); malformed rows are left out,
    and so are the steps already folded (``skip``).

    A rank serves its last 16 steps' rows, oldest first, again at every poll, and a completed
    step's row does not change: with ``skip`` the rows are read from the newest back and the
    reading stops at the first folded step (a leader polled every sweep then reads one or two
    rows, not 16). A rank that serves its rows out of order loses its own rows older than its
    newest folded step, nobody else's (the straggler detector needs a step from every polled
    rank, which a rank can withhold anyway by not serving it)."""
    timing = state.get("timing") if type(state) is dict or isinstance(state, Mapping) else None
    if type(timing) is not dict and not isinstance(timing, Mapping):
        return []
    rows = timing.get("recent")
    if type(rows) is bytes:  # packed by the poller (monitor/poll/packed_state.py)
        return _packed_timing_rows(rows, skip, packed)
    if not isinstance(rows, list) or not rows:
        rows = [timing.get("last_step")]
    elif skip:
        # the rows not folded yet are the newest: read back to the first folded step
        for i in range(len(rows) - 1, -1, -1):
            row = rows[i]
            if (type(row) is dict or isinstance(row, Mapping)) \
                    and type(step := row.get("step")) is int and step in skip:
                rows = rows[i + 1:]
                break
    out = []
    for row in rows:
        # most rows were folded at an earlier poll: the fewest checks that tell (the exact
        # types first: isinstance against Mapping is an ABC check, ~10x a type test)
        if type(row) is dict:
            step = row.get("step")
        elif isinstance(row, Mapping):
            step = row.get("step")
        else:
            continue
        # an int step, not true/false (which JSON parses as bools, and bool is an int):
        # the packer's rule too (monitor/poll/packed_state.py), so both forms read the same rows
        if (type(step) is not int and (not isinstance(step, int) or isinstance(step, bool))) \
                or step in skip:
            continue
        if type(row) is dict:
            # the four values in one C-level call (~15 % less per new row than four gets); a
            # missing one leaves the row out, as the None of get did below
            try:
                values = a, b, c, d = _TIMING_VALUES(row)
            except KeyError:
                continue
        else:
            values = a, b, c, d = (row.get("step_s"), row.get("compute_s"),
                                   row.get("wait_cross_s"), row.get("wait_group_s"))
        # JSON's own floats first, as they are, then its ints (a rank serves ~16 rows, 21,000
        # ranks a sweep at 100,000: docs/scaling.md); anything else takes the general check
        if type(a) is float and type(b) is float and type(c) is float and type(d) is float:
            if 0 <= a < _INF and 0 <= b < _INF and 0 <= c < _INF and 0 <= d < _INF:
                out.append((step if type(step) is int else int(step),
                            _ROW.pack(a, b, c, d) if packed else values))
            continue
        if type(a) in _PLAIN and type(b) in _PLAIN and type(c) in _PLAIN and type(d) in _PLAIN:
            if not (0 <= a < _INF and 0 <= b < _INF and 0 <= c < _INF and 0 <= d < _INF):
                continue
        elif not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                     and math.isfinite(v) and v >= 0 for v in (a, b, c, d)):
            continue
        values = (float(a), float(b), float(c), float(d))
        out.append((int(step), _ROW.pack(*values) if packed else values))
    return out


def _packed_timing_rows(rows: bytes, skip: Mapping[int, Any] | tuple, packed: bool
                        ) -> list[tuple[int, Any]]:
    """timing_rows of a packed ``timing.recent`` (monitor/poll/packed_state.py): the same rows, read
    back from the newest to the first folded step; a row whose seconds are not four finite
    numbers >= 0 (NaN: served malformed) is left out."""
    size, step_at, row_at = _PACKED_ROW.size, _PACKED_STEP.unpack_from, _PACKED_ROW.unpack_from
    start, end = 0, len(rows) - len(rows) % size
    if skip:
        for at in range(end - size, -1, -size):
            if step_at(rows, at)[0] in skip:
                start = at + size
                break
    out = []
    for at in range(start, end, size):
        step, a, b, c, d = row_at(rows, at)
        # checked as a JSON row is: four finite seconds >= 0 (NaN: served malformed)
        if 0 <= a < _INF and 0 <= b < _INF and 0 <= c < _INF and 0 <= d < _INF \
                and step not in skip:
            out.append((step, rows[at + 8:at + size] if packed else (a, b, c, d)))
    return out


def current_wait(state: Mapping[str, Any] | None) -> tuple[str | None, float | None]:
    """(scope, seconds) of the collective wait the rank is blocked in now, on its own clock;
    (None, None) when it is not waiting or does not say."""
    timing = state.get("timing") if isinstance(state, Mapping) else None
    w = timing.get("waiting") if isinstance(timing, Mapping) else None
    if not isinstance(w, Mapping):
        return None, None
    scope, secs = w.get("scope"), w.get("seconds")
    if not isinstance(scope, str) or not isinstance(secs, (int, float)) or not math.isfinite(secs):
        return None, None
    return scope, float(secs)


def collective_wait(state: Mapping[str, Any] | None, now: float) -> tuple[str | None, float]:
    """How long the rank has been blocked inside a *collective* (not a quorum): ("group" or
    "cross", seconds), or (None, 0.0). A rank without ``timing`` falls back to its phase
    (``allreduce`` since ``phase_since``: its own clock against the monitor's)."""
    if type(state) is dict:
        timing = state.get("timing")
        if type(timing) is dict and timing.get("waiting") is None:
            return None, 0.0  # not waiting: what the general path says, sooner (most answers)
    elif not isinstance(state, Mapping):
        return None, 0.0
    if isinstance(state.get("timing"), Mapping):
        scope, secs = current_wait(state)
        if scope == "group" or (scope == "cross" and state.get("phase") == "allreduce"):
            return scope, secs or 0.0
        return None, 0.0
    if state.get("phase") == "allreduce" and isinstance(state.get("phase_since"), (int, float)):
        return "cross", max(0.0, now - float(state["phase_since"]))
    return None, 0.0


def describe_ranks(view: ClusterView, ranks: list[int], now: float) -> list[dict[str, Any]]:
    """Who the culprit ranks are and where they run, from their last ``/v1/state``."""
    out = []
    for rank in ranks:
        rv = _rank_view(view, rank)
        s = (rv.state if rv else None) or {}
        scope, secs = current_wait(s)
        out.append({"rank": rank, "group_rank": s.get("group_rank"), "host": s.get("host"),
                    "node": s.get("node") or s.get("host"), "device": s.get("device"),
                    "local_rank": s.get("local_rank"), "pid": s.get("pid"),
                    "url": rv.url if rv else None, "reachable": bool(rv and rv.reachable),
                    "phase": s.get("phase"), "step": s.get("step"),
                    "waiting": None if scope is None else {"scope": scope,
                                                           "seconds": round(secs or 0.0, 3)},
                    "stacks": f"{rv.url}/v1/stacks" if rv else None})
    return out


def _rank_view(view: ClusterView, rank: int) -> RankView | None:
    return view.rank_view(rank)  # indexed once per view: a scan per call was quadratic


def _fresh(view: ClusterView):
    """(url, RankView) of the ranks polled this sweep: with leader polling the others are
    carried unchanged, so what is folded from them was folded when they were polled."""
    if view.polled is None:
        return view.ranks.items()
    ranks = view.ranks
    return [(u, ranks[u]) for u in view.polled if u in ranks]


def _median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else 0.0


def is_late_window(lags: np.ndarray, threshold: float, need: int) -> np.ndarray:
    """Per row of ``lags`` (a group's lag per step of the window): waited for by the others
    in at least ``need`` steps (lag above 0: it arrived last) and by at least ``threshold`` in
    the median step.

    The count asks only that the others waited, the median how long: per-step waits on a loaded
    box scatter by +-0.15 s (2-core CI, 6 ranks: healthy cross waits 0.12-0.78 s from step to
    step), and a straggler waited for 0.33 s in the median against a 0.23 s threshold fell
    under it in 2-3 steps of 6 in window after window; asking each of 3 in 4 steps to reach
    the threshold confirmed it 11-17 steps after onset, or never (issue 17). A group that is
    merely last by chance, or by a little, still fails the median."""
    return ((lags > 0).sum(axis=1) >= need) & (np.median(lags, axis=1) >= threshold)


def straggler_lags(cross: np.ndarray, threshold: float, need: int
                   ) -> tuple[np.ndarray, set[int], list[int]]:
    """Per group (row of ``cross``: its cross-group wait per step of the window, one column
    per step), how long the others waited for it at the cross-group step; the rows first
    found late, and the rows measured against.

    First against the median of all other groups; a group late by that measure (``need``
    steps and the median at or over ``threshold``) is then measured again against the
    least-waiting of the groups that are *not* late: each of them waited at least that long.
    Groups that merely spread apart (on a loaded box the fastest group waits far more than a
    middle one) no longer make a middle-slow group look late; a real straggler is waited for
    by every healthy group, and two late groups are each measured against the healthy ones
    (the median would have counted the other late group). When every group is late, the
    median stays.

    Returns (lags, the rows late by the first measure, the rows not late: what those were
    measured against). The median of the others, per step, is one sorted column and a binary
    search per group (what ``statistics.median`` of the list without that group gives, to the
    bit): O(G log G) in numpy, where a median per group was O(G^2) and 12,500 groups a Python
    loop each sweep (docs/scaling.md)."""
    n_groups = cross.shape[0]
    n = n_groups - 1  # the others
    if n <= 0:
        others = np.zeros_like(cross)
    else:
        ordered = np.sort(cross, axis=0)
        # where each group's own value sits in its step's column (bisect_left): taking it out
        # shifts every later position by one
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
        least = cross[~late].min(axis=0)  # per step: the least-waiting healthy group
        rows = np.flatnonzero(late)
        lags[rows] = least - cross[rows]
    return lags, candidates, healthy


class _RankGroups:
    """rank -> its replica group, for the ranks a Flight Recorder finding names: from the
    rank's RankView in the view (ClusterView.rank_view's index: a reachable one if any, never
    a superseded one) when it answered, else from its dump's own claim. Looked up per rank
    named: a dict of every rank was ~100,000 ``RankView.rank`` calls a confirming sweep at
    100,000 ranks."""

    __slots__ = ("view", "dumps", "claimed")

    def __init__(self, view: ClusterView, dumps: Mapping[int, dict]) -> None:
        self.view, self.dumps = view, dumps
        self.claimed: dict[int, int] | None = None  # the dumps' claims, made on first need

    def get(self, rank: int) -> int | None:
        rv = self.view.rank_view(rank)
        if rv is not None and rv.state is not None:
            return rv.replica_group
        if self.claimed is None:
            self.claimed = {int(r): d["replica_group"] for r, d in self.dumps.items()
                            if isinstance(d, Mapping) and isinstance(d.get("replica_group"), int)}
        return self.claimed.get(rank)


# --- per-group memory ---------------------------------------------------------------------------

class _SeenGroups:
    """Which groups' ``GroupView`` differs from the one a consumer saw at its last call.

    An incremental view (``ViewBuilder``) keeps a group's GroupView *object* while nothing in
    the group changed, and a view is never changed once built, so identity tells what to read
    again: a consumer that walked every group each sweep then reads only those (a view built
    afresh, as in the tests, changes every group). Each consumer keeps its own, so one that
    skipped a sweep still sees everything that changed since it last looked."""

    def __init__(self) -> None:
        self.groups: Mapping[int, GroupView] = {}

    def changed(self, view: ClusterView) -> tuple[list[int], set[int]]:
        """(groups of ``view`` new or changed since the last call, groups gone), in view
        order; O(groups) in C-level dict lookups."""
        seen, groups = self.groups, view.groups
        changed = [g for g, gv in groups.items() if seen.get(g) is not gv]
        gone = seen.keys() - groups.keys() if len(seen) > len(groups) - len(changed) else set()
        self.groups = groups
        return changed, gone


@dataclass
class _GroupMemory:
    replica_id: str | None
    straggler_windows: int = 0
    straggler_newest: int | None = None  # newest step of the last straggler evaluation
    straggler_first_seen: float | None = None
    straggler_lags: list[float] = field(default_factory=list)


class _Answers:
    """What :meth:`Detectors._collect_steps` read from one view's answers: commit failures
    by URL of the reachable ranks polled, the URLs polled that did not answer, those that
    answered without a quorum, and per group its polled ranks with per-step timings
    (RankView, its StepMemory slot, replica id), the groups whose ranks do not all report one
    replica id in ``mixed``."""

    __slots__ = ("view", "counts", "silent", "by_group", "mixed", "starting")

    def __init__(self, view: ClusterView) -> None:
        self.view = view
        self.counts: dict[str, int] = {}
        self.silent: list[str] = []
        # (RankView, its slot in the step memory, replica id)
        self.by_group: dict[int, list[tuple[RankView, int, str | None]]] = {}
        self.mixed: set[int] = set()
        self.starting: list[str] = []  # the URLs answering without a quorum (quorum id < 0)

    def members(self) -> tuple[dict, set[int]]:
        return self.by_group, self.mixed


_NO_QUORUM = object()  # _note_progress before its first view


class Detectors:
    """Stateful detectors; call :meth:`fr_wanted` then :meth:`update` once per sweep."""

    def __init__(self, cfg: DetectorConfig | None = None, analyzer: Analyzer | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg or DetectorConfig()
        self.analyzer = analyzer or analyze
        self.clock = clock
        self._groups: dict[int, _GroupMemory] = {}
        self._open: dict[tuple, Finding] = {}
        self._resolved: deque[Finding] = deque(maxlen=200)
        self._commit_failures: dict[str, int] = {}
        self._last_fr_at = 0.0
        self._fr_reason: str | None = None
        self._periodic_held: tuple[float, bool] | None = None  # (now, held) of that sweep
        self._longest_wait: tuple[float, float] | None = None  # (now, seconds): longest_wait
        # per rank URL: its replica id and its newest steps' timing rows, from the ranks' own
        # timing (monitor/detect/step_memory.py)
        self._memory = StepMemory(STEP_MEMORY)
        self._since_queries: dict[int, str] = {}  # step -> "?since=<step>&..." (state_queries)
        # per replica group: (replica id, the newest step folded from any of its ranks)
        self._group_newest: dict[int, tuple[str | None, int]] = {}
        # job progress on the monitor's clock: each in-quorum group's step (of the newest
        # quorum id, ``_progress_quorum``), kept per group, and since when none moved
        self._progress_steps: dict[int, int] = {}
        self._progress_quorum: Any = _NO_QUORUM
        self._progress_at: float | None = None
        self._progress_noted_at: float | None = None
        self._progress_seen = _SeenGroups()
        self._remembered: ClusterView | None = None  # the view _remember_groups last read
        self._remembered_seen = _SeenGroups()
        self._dead_seen = _SeenGroups()
        self._down_groups: set[int] = set()  # groups _dead last saw with a rank down
        # the last two views' (URL, RankView) polled this sweep (evidence and full view)
        self._fresh_of: dict[int, tuple[ClusterView, list]] = {}
        # the pass over the last view's answers (_collect_steps)
        self._answers: _Answers | None = None
        self._stall_seen: tuple | None = None  # (view, now, stalled sweeps, _stall's answer)
        self._stalled_sweeps = 0
        # stuck_starting: (url, pid, started_at) -> monitor time first seen without a quorum
        self._starting: dict[tuple, float] = {}
        self.last_lags: dict[int, float] = {}  # replica_group -> how long the others waited (s)
        # groups whose memory may hold a late streak (straggler_windows and the rest), a
        # superset: judged every evaluation until one resets it
        self._straggler_streaks: set[int] = set()
        self.last_error: str | None = None

    # --- public ----------------------------------------------------------------------
    def state_queries(self, urls: Iterable[str], kept: Container[str] | None = None,
                      view: ClusterView | None = None) -> list[str]:
        """Per URL, the query its next ``/v1/state`` is asked with: ``?since=N&recent=16&packed=1``,
        N the newest step whose timing row is folded for it (the WorkerServer then serves only
        the newer rows, monitor/poll/poller.py's per-URL queries), or ``?recent=16&packed=1`` where
        none is (a new rank: it serves every row it has). The rows left out are those
        :func:`timing_rows` would skip anyway (it reads back to the first folded step);
        ``recent=16``: of its 64 ``recent_step_seconds`` the newest 16, all the view reads
        (STEP_TIMES_READ); ``packed=1``: both lists served packed (STATE_ASK). A rank that
        ignores the query (an older WorkerServer) serves them all, as lists, as before.

        A rank with nothing folded whose replica group has rows folded (``view``: the group it
        last answered as, of the same replica id), as a member polled at its slower cadence
        is, is asked ``?since=G-W-2&recent=16&packed=1``, G its group's newest folded step and W the
        straggler's window: the newest steps, all the window reads of it (its group's ranks
        step together, and the groups within a step of each other), not the 16 a rank serves
        (at 100,000 ranks ~2,900 members a sweep, 16 rows each, were more rows than the
        12,500 leaders').

        A rank whose incarnation changed under the same URL may be asked past its new rows
        once: the fold then starts its memory afresh (new replica id), empty, and the next
        sweep asks it for every row.

        ``kept``: the URLs whose memory the next fold keeps, when the queries are made before
        it (the rest are asked for every row): a fold keeps only the memory of the ranks its
        view polled, and a rank asked ``since`` its dropped memory would serve too few rows
        for the window."""
        memory, cache, group_newest = self._memory, self._since_queries, self._group_newest
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
                    out.append(EVERY_ROW_QUERY)
                    continue
                newest = got[1] - back
            q = cache.get(newest)
            if q is None:
                if len(cache) > 4096:
                    cache.clear()
                q = cache[newest] = f"?since={newest}&{STATE_ASK}"
            out.append(q)
        return out

    def open_findings(self) -> list[Finding]:
        return sorted(self._open.values(), key=lambda f: (f.confirmed_at or 0, f.kind))

    def resolved_findings(self) -> list[Finding]:
        return list(self._resolved)

    def report(self, f: Finding) -> bool:
        """Open a finding confirmed outside the detectors (``quarantined_host``, from
        :mod:`monitor.act.hosts`): it is then resolved like any other (group replaced, gone, left
        the job) or by :meth:`resolve`. False when one with its key is open already."""
        if f.key in self._open:
            return False
        self._open[f.key] = f
        return True

    def resolve(self, key: tuple, how: str, now: float) -> None:
        """Resolve an open finding by key (a no-op when none is open)."""
        self._resolve(key, how, now)

    def fr_wanted(self, view: ClusterView, now: float | None = None) -> list[str]:
        """URLs whose ``/v1/fr_trace`` this sweep needs (empty: no Flight Recorder this time)."""
        now = self.clock() if now is None else now
        reason = None
        try:
            self._remember_groups(view)
            self._note_progress(view, now)
            if self._stall(view, now)[0]:
                reason = "hang"
            elif self._commit_failures_rose(view):
                reason = "commit_failures"
            elif now - self._last_fr_at >= self.cfg.fr_interval_s \
                    and not self.periodic_look_held(view, now):
                reason = "periodic"
        except Exception as e:  # never let a trigger bug stop the sweep
            log.exception("Flight Recorder trigger failed")
            self.last_error = f"{type(e).__name__}: {e}"
        self._fr_reason = reason
        if reason is None:
            return []
        self._last_fr_at = now  # asked for, answered or not: the periodic clock restarts
        # reachable ranks polled this sweep (a carried rank's dump would describe the past)
        return [u for u, r in self._fresh_ranks(view) if r.reachable and not r.superseded
                and r.replica_group in view.groups]

    def periodic_look_held(self, view: ClusterView | None, now: float,
                           states: Iterable[Any] | None = None) -> bool:
        """Whether the periodic Flight Recorder look, due at ``now``, waits for a later sweep:
        a rank polled this sweep has been blocked in a collective for a third of the hang
        threshold or more. A stall may be building: if it is a hang, the hang look fetches the
        dumps once the waits pass the threshold, a sweep or two later, and the periodic look
        (every leader's dump: ~0.9 s at 100,000 ranks) in between would delay that sweep, and
        the hang's confirmation, by as much (docs/scaling.md). Held at most until
        2 x ``fr_interval_s`` since the last look (a slow group the others keep waiting for
        must not stop the looks). ``states``: this sweep's answers (default: those of the
        view's ranks polled this sweep); decided once per ``now``, so the monitor, asking the
        dumps early from its poller's answers, and :meth:`fr_wanted` agree."""
        held = self._periodic_held
        if held is not None and held[0] == now:
            return held[1]
        out = False
        if now - self._last_fr_at < 2 * self.cfg.fr_interval_s:
            out = self.longest_wait(view, now, states) >= self.hang_threshold(view) / 3
        self._periodic_held = (now, out)
        return out

    def hang_look_possible(self, view: ClusterView, now: float) -> bool:
        """Whether :meth:`fr_wanted` may ask for a hang's Flight Recorder dumps at ``now``: a
        rank polled this sweep has been blocked in a collective for the hang threshold or
        longer (the hang trigger needs that; :meth:`_stall` also needs a sweep without
        progress). False means no hang look this sweep; True only that one may come."""
        return self.longest_wait(view, now) >= self.hang_threshold(view)

    def longest_wait(self, view: ClusterView | None, now: float,
                     states: Iterable[Any] | None = None) -> float:
        """The longest a rank polled this sweep has been blocked in a collective (seconds,
        :func:`collective_wait`), once per ``now``: ``states`` are this sweep's answers
        (default: those of ``view``'s ranks polled this sweep)."""
        got = self._longest_wait
        if got is not None and got[0] == now:
            return got[1]
        if states is None:
            states = [r.state for _, r in self._fresh_ranks(view) if r.reachable] \
                if view is not None else []
        longest = max((collective_wait(st, now)[1] for st in states), default=0.0)
        self._longest_wait = (now, longest)
        return longest

    def update(self, view: ClusterView, dumps: Mapping[int, dict] | None = None,
               now: float | None = None, full_view: ClusterView | None = None) -> list[Finding]:
        """Fold one sweep (and the dumps :meth:`fr_wanted` asked for); returns newly confirmed.

        ``view`` holds the ranks whose answers count as evidence; ``full_view`` (default: the
        same) every rank the monitor polls, which only ``stuck_starting`` reads."""
        now = self.clock() if now is None else now
        new: list[Finding] = []
        self._remember_groups(view)
        self._note_progress(view, now)
        traces: dict[int, RankTrace] = {}
        analysis = None
        if dumps:
            try:
                traces, errors = normalize_dumps(dumps)
                for err in errors:
                    log.warning("Flight Recorder dump of rank %s left out: %s", err["rank"],
                                err["error"])
                analysis = engine_findings(self.analyzer(traces))
            except Exception as e:
                log.exception("Flight Recorder analysis failed")
                self.last_error = f"analysis: {type(e).__name__}: {e}"
        steps = [(self._dead, view), (self._hang, view), (self._straggler, view),
                 (self._mismatch, view), (self._stuck_starting, full_view or view)]
        for step, v in steps:
            try:
                new.extend(step(v, dumps or {}, traces, analysis, now))
            except Exception as e:
                log.exception("detector %s failed", step.__name__)
                self.last_error = f"{step.__name__}: {type(e).__name__}: {e}"
        self._resolve_gone(view, full_view or view, now)
        if view.polled is None:
            self._commit_failures = {}
        cf = self._commit_failures
        counts, silent = self._commit_counts(view)
        cf.update(counts)
        for u in silent:
            cf.pop(u, None)
        if not cf.keys() <= view.ranks.keys():
            for u in cf.keys() - view.ranks.keys():
                del cf[u]
        return new

    # --- bookkeeping -----------------------------------------------------------------
    def _fresh_ranks(self, view: ClusterView) -> list:
        """:func:`_fresh` once per view (the trigger and five detectors walk it)."""
        got = self._fresh_of.get(id(view))
        if got is not None and got[0] is view:
            return got[1]
        if len(self._fresh_of) >= 2:
            self._fresh_of.clear()
        out = list(_fresh(view))
        self._fresh_of[id(view)] = (view, out)
        return out

    def _commit_counts(self, view: ClusterView) -> tuple[dict[str, int], list[str]]:
        """({URL: commit failures} of the reachable ranks polled this sweep, the URLs polled
        that did not answer), from the pass over the sweep's answers."""
        got = self._collect_steps(view)
        return got.counts, got.silent

    def _remember_groups(self, view: ClusterView) -> None:
        if view is self._remembered:
            return  # fr_wanted and update of one sweep: once
        self._remembered = view
        groups = view.groups
        for g in self._remembered_seen.changed(view)[0]:  # an unchanged group: nothing new
            gv = groups[g]
            rid = gv.replica_id
            mem = self._groups.get(g)
            if mem is None or (rid is not None and mem.replica_id != rid):
                if mem is not None:
                    self._resolve_group(g, "replaced", self.clock(),
                                        keep_kinds=("dead", "stuck_starting"))
                self._groups[g] = _GroupMemory(rid)

    def _open_or_get(self, kind: str, gv: GroupView, ranks: list[int], ev: dict[str, Any],
                     first_seen: float, now: float, view: ClusterView,
                     replica_id: Any = ...) -> Finding | None:
        """Open a confirmed finding unless one with the same key is already open."""
        rid = gv.replica_id if replica_id is ... else replica_id
        culprits = describe_ranks(view, ranks, now)
        ev = {**ev, "culprit_ranks": list(ranks),
              "culprit_hosts": [c["host"] for c in culprits], "culprits": culprits}
        key = (kind, gv.replica_group, rid)
        if key in self._open:
            self._open[key].evidence = ev
            return None
        f = Finding(kind, gv.replica_group, rid, ranks, ev, first_seen, now)
        self._open[key] = f
        hosts = sorted({str(c["host"]) for c in culprits})
        log.warning("confirmed %s in replica group %d: rank(s) %s on %s", kind, gv.replica_group,
                    ranks, ", ".join(hosts))
        return f

    def _resolve(self, key: tuple, how: str, now: float) -> None:
        f = self._open.pop(key, None)
        if f is not None:
            f.resolved_at, f.resolution = now, how
            self._resolved.append(f)

    def _resolve_kind(self, kind: str, g: int, how: str, now: float) -> None:
        for key in [k for k in self._open if k[0] == kind and k[1] == g]:
            self._resolve(key, how, now)

    def _resolve_group(self, g: int, how: str, now: float,
                       keep_kinds: tuple[str, ...] = ()) -> None:
        for key in [k for k in self._open if k[1] == g and k[0] not in keep_kinds]:
            self._resolve(key, how, now)

    def _resolve_gone(self, view: ClusterView, full: ClusterView, now: float) -> None:
        for key in list(self._open):
            kind, g, _rid = key
            gv = (full if kind == "stuck_starting" else view).groups.get(g)
            if gv is None:
                self._resolve(key, "gone", now)
            elif kind not in ("dead", "stuck_starting") and not gv.reachable:
                self._resolve(key, "left_job", now)

    def _commit_failures_rose(self, view: ClusterView) -> bool:
        prev = self._commit_failures
        for u, n in self._commit_counts(view)[0].items():
            was = prev.get(u)
            if was is not None and n > was:
                return True
        return False

    @staticmethod
    def _rank_group(view: ClusterView, dumps: Mapping[int, dict]) -> _RankGroups:
        return _RankGroups(view, dumps)

    # --- dead and dead_rank ----------------------------------------------------------
    def _dead(self, view, dumps, traces, analysis, now) -> list[Finding]:
        new = []
        open_dead = {k[1] for k in self._open if k[0] in ("dead", "dead_rank")}
        changed, gone = self._dead_seen.changed(view)
        down_groups = self._down_groups
        down_groups.difference_update(gone)
        # a group whose GroupView did not change, with no rank down and nothing open, has
        # nothing new to judge (most groups; a changed one is judged again)
        groups = view.groups
        for g in sorted(down_groups.union(changed, open_dead)):
            gv = groups.get(g)
            if gv is None:
                continue
            if len(gv.reachable) == len(gv.ranks):
                down_groups.discard(g)
                if g not in open_dead:
                    continue  # nothing down, nothing open: nothing to do
            else:
                down_groups.add(g)
            rid = gv.replica_id
            if rid is not None:  # what was dead of an earlier incarnation is over
                for key in [k for k in self._open if k[0] in ("dead", "dead_rank") and k[1] == g
                            and k[2] not in (None, rid)]:
                    self._resolve(key, "replaced", now)
            # a rank of an earlier incarnation (its group restarted, its own rank not back yet)
            # is not this incarnation's loss
            down = [r for r in gv.ranks if not r.reachable and not r.superseded
                    and r.failures >= self.cfg.dead_sweeps
                    and (rid is None or r.replica_id in (None, rid))]
            # group rank 0 runs the group's torchft Manager: alive, it heartbeats to the Lighthouse
            manager_up = [r for r in gv.reachable if r.state.get("group_rank") == 0
                          and r.replica_id == rid and rid is not None]
            lost = [r for r in down if r.replica_id == rid and r.state
                    and r.state.get("group_rank") != 0]
            if manager_up and lost:
                self._resolve(("dead", g, rid), "rank_dead_in_live_group", now)
                ranks = sorted(r.rank for r in lost if r.rank is not None)
                ev = {"unreachable": self._unreachable(lost),
                      "alive": sorted(r.rank for r in gv.reachable if r.rank is not None),
                      "manager_rank": manager_up[0].rank,
                      "why": "the group's Manager (group rank 0) still heartbeats, so torchft "
                             "keeps the group in the quorum and every group waits for these "
                             "ranks until its timeouts"}
                f = self._open_or_get("dead_rank", gv, ranks, ev,
                                      min(r.unreachable_since or now for r in lost), now, view)
                if f:
                    new.append(f)
                continue
            self._resolve_kind("dead_rank", g, "group_dead" if down else "reachable", now)
            if not down:
                self._resolve_kind("dead", g, "reachable", now)
                continue
            ev = {"unreachable": self._unreachable(down), "group_ranks_unreachable": len(down),
                  "group_ranks": len(gv.ranks)}
            f = self._open_or_get("dead", gv, sorted({r.rank for r in down if r.rank is not None}),
                                  ev, min(r.unreachable_since or now for r in down), now, view)
            if f:
                new.append(f)
        return new

    @staticmethod
    def _unreachable(ranks: list[RankView]) -> dict[str, Any]:
        return {str(r.rank): {"url": r.url, "reason": r.reason, "error": r.error,
                              "sweeps": r.failures, "since": r.unreachable_since}
                for r in ranks}

    # --- hang ------------------------------------------------------------------------
    def _note_progress(self, view: ClusterView, now: float) -> None:
        """Count the sweeps (the monitor's own clock) since the in-quorum groups' steps moved."""
        if self._progress_noted_at == now:
            return  # fr_wanted and update of one sweep: counted once
        self._progress_noted_at = now
        changed, gone = self._progress_seen.changed(view)
        q, groups, steps = view.quorum_id, view.groups, self._progress_steps
        moved = False
        if q != self._progress_quorum:  # a new quorum: which groups are in it, afresh
            self._progress_quorum = q
            now_steps = {g: gv.step or 0 for g, gv in groups.items() if q in gv.taking_part}
            moved, self._progress_steps = now_steps != steps, now_steps
        else:  # the same quorum: only a changed group's step or membership can have moved
            for g in gone:
                moved = steps.pop(g, None) is not None or moved
            for g in changed:
                gv = groups[g]
                if q in gv.taking_part:
                    step = gv.step or 0
                    if steps.get(g) != step:
                        steps[g], moved = step, True
                elif steps.pop(g, None) is not None:
                    moved = True
        if self._progress_at is None or moved:
            self._progress_at = now
            self._stalled_sweeps = 0
        else:
            self._stalled_sweeps += 1

    def hang_threshold(self, view: ClusterView | None) -> float:
        """Seconds a rank must be blocked in a collective, with no progress, to be a hang:
        max(``hang_floor_s``, ``hang_factor`` x the median step time)."""
        if view is None:
            return self.cfg.hang_floor_s
        return max(self.cfg.hang_floor_s, self.cfg.hang_factor * (view.median_step_seconds() or 0))

    def _stall(self, view: ClusterView, now: float) -> tuple[bool, float, float, dict[int, tuple]]:
        """(stalled, longest collective wait (s), threshold, {rank: (scope, seconds)} of the
        ranks blocked in a collective at least that long). Once per sweep: fr_wanted and
        update ask it of the same view (a pass over every rank polled)."""
        if self._stalled_sweeps < 1:
            # a group moved since the last sweep: not stalled whatever the waits, which only
            # a stall reads (the median step time and a pass over every rank polled: skipped)
            return False, 0.0, 0.0, {}
        seen = self._stall_seen
        if seen is not None and seen[0] is view and seen[1] == now \
                and seen[2] == self._stalled_sweeps:
            return seen[3]
        threshold = self.hang_threshold(view)
        waits: dict[int, tuple[str, float]] = {}
        in_quorum = {g.replica_group for g in view.in_quorum()}
        for _, r in self._fresh_ranks(view):  # a wait carried from an older poll is not a wait now
            if not r.reachable or not r.fresh or r.replica_group not in in_quorum:
                continue
            scope, secs = collective_wait(r.state, now)
            if scope is not None and secs >= threshold and r.rank is not None:
                waits[r.rank] = (scope, secs)
        stalled = bool(waits)
        longest = max((s for _, s in waits.values()), default=0.0)
        self._stall_seen = (view, now, self._stalled_sweeps, (stalled, longest, threshold, waits))
        return stalled, longest, threshold, waits

    def _hang(self, view, dumps, traces, analysis, now) -> list[Finding]:
        stalled, longest, threshold, waits = self._stall(view, now)
        if not stalled:
            for key in [k for k in self._open if k[0] == "hang"]:
                self._resolve(key, "progress", now)
            return []
        if analysis is None:
            return []
        newest_q = view.quorum_id
        rank_group = self._rank_group(view, dumps)
        in_quorum = {g.replica_group for g in view.in_quorum()}
        hangs = [h for h in analysis if h["kind"] == "hang"]
        cross: dict[int, list[dict]] = {}
        inner: dict[int, dict] = {}
        for h in hangs:
            if h["replica_group"] is not None:  # a process group inside one replica group
                inner.setdefault(int(h["replica_group"]), h)
            elif h["quorum_id"] in (None, newest_q):
                for r in h["culprits"]:
                    g = rank_group.get(r)
                    if g is not None and h not in cross.setdefault(g, []):
                        cross[g].append(h)
        new = []
        for g in sorted(set(cross) | set(inner)):
            gv = view.groups.get(g)
            if gv is None or g not in in_quorum:
                continue
            h_in = inner.get(g)
            peers_blocked = self._in_group_blocked(view, g, h_in, waits, rank_group, now)
            if peers_blocked:
                level, ranks, found = "in_group", list(h_in["culprits"]), [h_in]
                waiting = peers_blocked
            else:
                ranks = sorted({r for h in cross.get(g, []) for r in h["culprits"]
                                if rank_group.get(r) == g})
                waiting = sorted({r for h in cross.get(g, []) for r in h["waiting"]
                                  if r in waits})
                if not ranks or not waiting or not self._not_waiting(view, ranks, now, "cross"):
                    continue
                level, found = "cross_group", cross[g]
                # the group the stalled job waits for: inside it, the rank(s) that never entered
                # the collective its other ranks are blocked in now, however long, are the ones
                # that stop it (those ranks can have begun waiting after the other groups did:
                # 0.23 s later on the multi-rank e2e job at ~1.3 s steps, under the threshold
                # when the others passed it, and both of the group's ranks were named)
                blocked = self._blocked_in_group_now(view, h_in, now)
                inner_peers = self._in_group_blocked(view, g, h_in, blocked, rank_group, now)
                if inner_peers:
                    level, ranks, found = "in_group", list(h_in["culprits"]), [h_in]
                    waiting, waits = inner_peers, {**blocked, **waits}
            pending = found[0]["raw"]
            ev = {"level": level, "stalled_s": round(longest, 3),
                  "threshold_s": round(threshold, 3),
                  "median_step_s": view.median_step_seconds(),
                  "pending": {"pg": pending.get("pg"), "replica_group": pending.get("replica_group"),
                              "quorum_id": pending.get("quorum_id"), "seq": pending.get("seq"),
                              "op": pending.get("op")},
                  "pending_seq": pending.get("seq"), "quorum_id": newest_q,
                  "never_arrived": ranks, "waiting_ranks": waiting,
                  "waits": {str(r): {"scope": waits[r][0], "seconds": round(waits[r][1], 3)}
                            for r in waiting},
                  "phases": self._phases(view, ranks + waiting, now),
                  "analysis": [h["raw"] for h in found]
                  + [h["raw"] for h in cross.get(g, []) if h not in found]}
            f = self._open_or_get("hang", gv, ranks, ev, now - longest, now, view)
            if f:
                new.append(f)
        return new

    def _in_group_blocked(self, view: ClusterView, g: int, h_in: dict | None,
                          waits: dict[int, tuple], rank_group: _RankGroups,
                          now: float) -> list[int]:
        """The peers blocked at least the hang threshold (``waits``) in ``h_in``, the engine's
        hang inside group ``g``, when it is that group's in-group hang: its culprits all of
        ``g`` and none itself blocked in the group; else empty."""
        peers_blocked = [r for r in (h_in["waiting"] if h_in else []) if r in waits
                         and waits[r][0] == "group"]
        if h_in and h_in["culprits"] and peers_blocked and all(
                rank_group.get(r) == g for r in h_in["culprits"]) and \
                self._not_waiting(view, h_in["culprits"], now, "group"):
            return peers_blocked
        return []

    @staticmethod
    def _blocked_in_group_now(view: ClusterView, h_in: dict | None,
                              now: float) -> dict[int, tuple]:
        """{rank: ("group", seconds)} of ``h_in``'s waiting ranks blocked in an in-group
        collective this sweep, however long."""
        out: dict[int, tuple] = {}
        for rank in (h_in["waiting"] if h_in else []):
            r = _rank_view(view, rank)
            if r is None or not r.reachable or not r.fresh:
                continue
            scope, secs = collective_wait(r.state, now)
            if scope == "group" and secs > 0:
                out[rank] = (scope, secs)
        return out

    def in_group_hangs(self, view: ClusterView, dumps: Mapping[int, dict],
                       now: float) -> set[int]:
        """The groups of the newest quorum whose hang :meth:`update` confirms at the in-group
        level this sweep from ``dumps`` alone (their own ranks' dumps): no other group's dump
        changes that (monitor/service.py then skips the leaders' cross-group fetch). Call
        between :meth:`fr_wanted` and :meth:`update` of one sweep; empty on any error."""
        try:
            stalled, _, _, waits = self._stall(view, now)
            if not stalled or not dumps:
                return set()
            traces, _ = normalize_dumps(dumps)
            inner: dict[int, dict] = {}
            for h in engine_findings(self.analyzer(traces)):
                if h["kind"] == "hang" and h["replica_group"] is not None:
                    inner.setdefault(int(h["replica_group"]), h)
            in_quorum = {gv.replica_group for gv in view.in_quorum()}
            rank_group = self._rank_group(view, dumps)
            return {g for g, h in inner.items() if g in in_quorum and g in view.groups
                    and self._in_group_blocked(view, g, h, waits, rank_group, now)}
        except Exception:  # never let it stop the sweep: the caller then fetches everything
            log.exception("in-group hang check failed")
            return set()

    @staticmethod
    def _not_waiting(view: ClusterView, ranks: list[int], now: float, scope: str) -> bool:
        """True when no culprit is itself blocked inside a collective of ``scope`` (then it is
        not the one that never came)."""
        for rank in ranks:
            r = _rank_view(view, rank)
            if r is not None and r.reachable and collective_wait(r.state, now)[0] == scope:
                return False
        return True

    @staticmethod
    def _phases(view: ClusterView, ranks: list[int], now: float) -> dict[str, Any]:
        out = {}
        for rank in ranks:
            r = _rank_view(view, rank)
            if r is None or not r.state:
                continue
            scope, secs = current_wait(r.state)
            out[str(rank)] = {"phase": r.state["phase"], "reachable": r.reachable,
                              "step": r.state["step"], "host": r.state.get("host"),
                              "waiting": None if scope is None else
                              {"scope": scope, "seconds": round(secs or 0.0, 3)}}
        return out

    # --- straggler -------------------------------------------------------------------
    def _collect_steps(self, view: ClusterView) -> _Answers:
        """One pass over the answers of this sweep (once per view: the trigger, the straggler
        and the bookkeeping read it): every reachable rank's served per-step timings folded
        into the per-rank memory (:class:`~monitor.detect.step_memory.StepMemory`), each group's
        ranks with timings, and the commit failures.

        Each answer's state is reached once here (at 100,000 ranks, ~21,000 a sweep, reaching
        them cost more than reading them: one pass a stage was ~3x this one's misses); its
        rows, packed bytes as the poller keeps them, are folded by numpy for all answers at
        once."""
        got = self._answers
        if got is not None and got.view is view:
            return got
        memory, group_newest = self._memory, self._group_newest
        # only ranks polled this sweep are judged, and a rank serves its last 16 steps when
        # polled again: with leader polling the others' memory is dropped (100,000 ranks x 32
        # steps of timings were ~1 GiB as dicts; docs/scaling.md). First: the slots taken
        # below stay those of the ranks until the next view's pass
        memory.keep_only(view.ranks.keys() if view.polled is None else set(view.polled))
        # its URL -> slot map and slots' replica ids, read inline (take() only adds to them)
        slot_of, rid_of, take = memory.slots().get, memory.replica_ids(), memory.take
        out = self._answers = _Answers(view)
        counts, silent, by_group, mixed = out.counts, out.silent, out.by_group, out.mixed
        slots, blobs, polled = [], [], []
        size = TIMING_ROW.size
        for url, r in self._fresh_ranks(view):
            s = r.state
            if not r.reachable or not s:
                silent.append(url)
                continue
            counts[url] = int(s.get("commit_failures") or 0)
            q = s["quorum_id"]
            if (q if type(q) is int else int(q)) < 0:
                out.starting.append(url)  # no quorum yet: for stuck_starting
            if not r.fresh:  # carried: folded when it was polled
                continue
            rid = s.get("replica_id")
            slot = slot_of(url)
            if slot is None or rid_of[slot] != rid:
                slot = take(url, rid)
            timing = s.get("timing")
            rows = timing.get("recent") if type(timing) is dict else None
            if type(rows) is bytes:  # packed by the poller (monitor/poll/packed_state.py)
                blob = rows if not len(rows) % size else rows[:len(rows) - len(rows) % size]
            else:  # as served (a test's state, another server): its well-formed rows
                blob = b"".join([TIMING_ROW.pack(step, *values)
                                 for step, values in timing_rows(s)])
            g = s["replica_group"]
            slots.append(slot)
            blobs.append(blob)
            polled.append((r, slot, g if type(g) is int else int(g), rid))
        added = memory.fold(slots, blobs)
        for (r, slot, g, rid), n, newest in zip(polled, added, memory.newest_of(slots),
                                                strict=True):
            if newest is None:
                continue  # nothing folded for it (no rows served yet)
            if n:  # its group's newest folded step (state_queries' members)
                was = group_newest.get(g)
                if was is None or was[1] < newest or was[0] != rid:
                    group_newest[g] = (rid, newest)
            rows = by_group.get(g)
            if rows is None:
                by_group[g] = [(r, slot, rid)]
            else:
                if rid != rows[0][2]:
                    mixed.add(g)
                rows.append((r, slot, rid))
        if len(group_newest) > 2 * len(view.groups) + 1024:  # groups gone: forgotten
            self._group_newest = {g: v for g, v in group_newest.items() if g in view.groups}
        return out

    def _straggler(self, view, dumps, traces, analysis, now) -> list[Finding]:
        self._collect_steps(view)  # every sweep, judged or not (once per view)
        groups = {g.replica_group: g for g in view.in_quorum()}
        members = self._straggler_members(view, groups) if len(groups) >= 2 else None
        if members is None:
            self.last_lags = {}
            return []
        # per group (in view order) and step of the window: its most-waiting rank's cross
        # wait; and every polled rank's step times over the window. Python only lists each
        # group's polled ranks' slots (ranks of a group next to each other); the step memory
        # finds the steps all of them have and gives the ranks x window x 4 array in one
        # indexing (monitor/detect/step_memory.py); numpy takes each group's maximum over its ranks
        # (reduceat at the group's first rank: max of floats is exact, so equal to the
        # per-step max() it replaces) and the median step time (of the same values in
        # another order), and compares the groups over the matrix
        order = list(groups)
        slots, starts = [], []
        for g in order:
            rows = members[g]
            starts.append(len(slots))
            if len(rows) == 1:
                slots.append(rows[0][1])
            else:
                slots.extend([slot for _, slot, _ in rows])
        slots = np.asarray(slots, np.int64)
        window = self._memory.common_steps(slots)[-self.cfg.straggler_steps:]
        if len(window) < self.cfg.straggler_steps:
            return []
        timings = self._memory.seconds(slots, window)  # polled rank x window x TIMING_KEYS
        cross = np.maximum.reduceat(timings[:, :, WAIT_CROSS_S], starts, axis=0)
        med_step = float(np.median(timings[:, :, STEP_S]))
        threshold = max(self.cfg.straggler_min_lag_s, self.cfg.straggler_rel_lag * med_step)
        need = math.ceil(0.75 * len(window))
        lags, candidates, healthy = straggler_lags(cross, threshold, need)
        med_lags = np.median(lags, axis=1)
        late_in = (lags >= threshold).sum(axis=1)  # every step: confirmed on one window
        waited_in = (lags > 0).sum(axis=1)
        is_late = is_late_window(lags, threshold, need)
        self.last_lags = dict(zip(order, [round(v, 4) for v in
                                          np.maximum(med_lags, 0.0).tolist()], strict=True))
        med_lags, late_in, waited_in = med_lags.tolist(), late_in.tolist(), waited_in.tolist()
        open_groups = {k[1] for k in self._open if k[0] == "straggler"}
        newest, mems = window[-1], self._groups
        new = []
        for i in self._straggler_judged(order, is_late, open_groups):
            g = order[i]
            mem = mems.get(g)
            if mem is None or mem.straggler_newest == newest:
                continue  # no newer steps since the last evaluation: nothing new to judge
            mem.straggler_newest = newest
            if not is_late[i]:
                if mem.straggler_windows or mem.straggler_lags \
                        or mem.straggler_first_seen is not None:
                    mem.straggler_windows, mem.straggler_first_seen = 0, None
                    mem.straggler_lags = []
                self._straggler_streaks.discard(g)
                if g in open_groups:
                    self._resolve(("straggler", g, groups[g].replica_id), "caught_up", now)
                continue
            med_lag = med_lags[i]
            mem.straggler_windows += 1
            self._straggler_streaks.add(g)
            mem.straggler_lags.append(round(med_lag, 4))
            if mem.straggler_first_seen is None:
                mem.straggler_first_seen = now
            # every step of one window at the threshold is as much evidence as the
            # consecutive windows (each with newer steps): at 100,000 ranks a sweep spans several steps,
            # and waiting for the next one cost a whole sweep (issue 17)
            if mem.straggler_windows < self.cfg.straggler_windows and late_in[i] < len(window):
                continue
            gv = groups[g]
            # in the group's order of ranks (GroupView's), as its evidence lists them
            rows = sorted(members[g], key=lambda m: (m[0].rank if m[0].rank is not None
                                                     else 1 << 62, m[0].url))
            ranks, in_group = self._late_ranks(rows, window, threshold)
            against = healthy if i in candidates and healthy else [
                j for j in range(len(order)) if j != i]
            ev = {"median_lag_s": round(med_lag, 4), "threshold_s": round(threshold, 4),
                  "median_step_s": round(med_step, 4), "late_in": f"{late_in[i]}/{len(window)}",
                  "waited_for_in": f"{waited_in[i]}/{len(window)}",
                  "lag_against": [order[j] for j in against],
                  "steps": [window[0], window[-1]], "windows": mem.straggler_windows,
                  "window_lags_s": mem.straggler_lags[-10:],
                  "peer_lags_s": {str(k): v for k, v in self.last_lags.items()},
                  "cross_wait_s": {str(h): round(_median(row), 4)
                                   for h, row in zip(order, cross.tolist(), strict=True)},
                  "in_group": in_group, "quorum_id": view.quorum_id,
                  "phases": self._phases(view, [r.rank for r, _, _ in rows
                                                if r.rank is not None], now),
                  "evidence": "each rank's own per-step wait times (no clocks compared)"}
            f = self._open_or_get("straggler", gv, ranks, ev, mem.straggler_first_seen, now, view)
            if f:
                new.append(f)
        for mem in map(mems.get, order):  # the groups not judged: this window was seen
            if mem is not None:
                mem.straggler_newest = newest
        return new

    def _straggler_members(self, view: ClusterView, groups: dict[int, GroupView]
                           ) -> dict[int, list[tuple[RankView, int, Any]]] | None:
        """Each group's ranks polled this sweep with their per-step timings folded under the
        group's replica id (RankView, its step memory's slot, replica id), from the pass over the answers (leader polling carries the others'
        older timings; a rank that serves no timing at all, e.g. an older WorkerServer, is left
        out). None when a group has none: it cannot be judged, and then no group is."""
        by_group, mixed = self._collect_steps(view).members()
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

    def _straggler_judged(self, order: list[int], is_late: np.ndarray,
                          open_groups: set[int]) -> list[int]:
        """The positions in ``order`` of the groups the straggler's verdict loop must judge,
        ascending: the late ones, those whose memory holds a late streak (to be reset) and
        those with an open straggler finding (to be resolved). For every other group judging
        it only records the window's newest step, which the caller does for all."""
        judged = np.flatnonzero(is_late).tolist()
        known = self._straggler_streaks | open_groups
        if known:
            judged.extend(i for i, g in enumerate(order) if g in known)
            judged = sorted(set(judged))
        return judged

    def _late_ranks(self, rows: list[tuple[RankView, int, Any]], window: list[int],
                    threshold: float) -> tuple[list[int], dict[str, Any]]:
        """The ranks of a late group its peers wait for: in-group wait at least ``threshold``
        below the median of the others'. None standing out: every rank (the group is slow)."""
        keys = (("wait_group_s", WAIT_GROUP_S), ("compute_s", COMPUTE_S),
                ("wait_cross_s", WAIT_CROSS_S))
        ranked = [(r, slot) for r, slot, _ in rows if r.rank is not None]
        seconds = self._memory.seconds([slot for _, slot in ranked], window).tolist() \
            if ranked else []
        per_rank = {r.rank: {k: round(_median(row[i] for row in rank_rows), 4)
                             for k, i in keys}
                    for (r, _), rank_rows in zip(ranked, seconds, strict=True)}
        late = []
        if len(per_rank) >= 2:
            for rank, m in per_rank.items():
                others = _median(v["wait_group_s"] for k, v in per_rank.items() if k != rank)
                if others - m["wait_group_s"] >= threshold:
                    late.append(rank)
        verdict = ("the rank(s) its peers wait for inside the group" if late else
                   "no rank stands out: the whole group is late")
        info = {"verdict": verdict, "ranks": {str(k): v for k, v in sorted(per_rank.items())}}
        return sorted(late) if late else sorted(per_rank), info

    # --- mismatch --------------------------------------------------------------------
    def _mismatch(self, view, dumps, traces, analysis, now) -> list[Finding]:
        if not analysis:
            return []
        rank_group = self._rank_group(view, dumps)
        new = []
        for m in analysis:
            if m["kind"] != "mismatch":
                continue
            culprits = list(m["culprits"])
            how = "majority"
            if not m["has_majority"]:
                culprits = departs_from_step_pattern(traces, m["raw"])
                how = "step_pattern"
                if not culprits:
                    culprits = [int(r) for r in m["raw"].get("departs_from_history") or []]
                    how = "own_history"
                participants = [r for v in m["raw"].get("variants") or [] for r in v["ranks"]]
                if len(culprits) >= len(participants):
                    culprits = []  # everyone "departs": that singles nobody out
            if not culprits:
                continue  # no way to tell who is wrong: report nothing we cannot back
            by_group: dict[int, list[int]] = {}
            for r in culprits:
                g = rank_group.get(r)
                if g is not None:
                    by_group.setdefault(g, []).append(r)
            if len(by_group) * 2 > len({rank_group.get(r) for r in dumps}) and how != "majority":
                continue  # most groups "differ": the evidence does not single one out
            for g, ranks in by_group.items():
                gv = view.groups.get(g)
                if gv is None:
                    continue
                ev = {"quorum_id": m["quorum_id"], "seq": m["seq"],
                      "pg": m["raw"].get("pg"), "level": "in_group"
                      if m["replica_group"] is not None else "cross_group",
                      "attributed_by": how, "analysis": m["raw"]}
                f = self._open_or_get("mismatch", gv, ranks, ev, now, now, view)
                if f:
                    new.append(f)
        return new

    # --- stuck_starting --------------------------------------------------------------
    def _stuck_starting(self, full, dumps, traces, analysis, now) -> list[Finding]:
        # only the ranks polled this sweep can have started or begun starting; a carried rank
        # keeps what its last poll said
        starting = {}
        ans = self._answers
        if ans is not None and (ans.view is full or (
                full.evidence_view is ans.view and len(ans.view.ranks) == len(full.ranks))):
            # every rank is evidence (the usual case): the pass over the evidence's answers
            # read the quorum ids (RankViews of the two views share their states)
            polled = [(url, full.ranks[url]) for url in ans.starting]
        else:
            polled = self._fresh_ranks(full)
        for url, r in polled:
            s = r.state
            if not r.reachable or not s:
                continue
            q = s["quorum_id"]  # a quorum first: most ranks have one, the rest is not read
            if (q if type(q) is int else int(q)) >= 0 or r.replica_group is None:
                continue
            starting[url] = (url, s.get("pid"), s.get("started_at"))
        if full.polled is not None and self._starting:
            fresh = set(full.polled)
            for ident in self._starting:
                url = ident[0]
                if url not in fresh and url in full.ranks:
                    r = full.ranks[url]
                    if r.reachable and r.state and r.replica_group is not None:
                        starting.setdefault(url, ident)
        seen = set(starting.values())
        stuck: dict[int, list[RankView]] = {}
        for ident in seen:
            first = self._starting.setdefault(ident, now)
            if now - first >= self.cfg.starting_timeout_s:
                r = full.ranks[ident[0]]
                stuck.setdefault(r.replica_group, []).append(r)
        for ident in [i for i in self._starting if i not in seen]:
            del self._starting[ident]
        new = []
        for key in [k for k in self._open if k[0] == "stuck_starting"
                    and k[1] in full.groups and k[1] not in stuck]:
            self._resolve(key, "started", now)
        for g, ranks in stuck.items():
            gv = full.groups.get(g)
            if gv is None:
                continue
            verified = self._groups.get(g)
            rid = verified.replica_id if verified else None
            if rid is not None and any(r.replica_id not in (None, rid) for r in ranks):
                rid = None
            first = min(self._starting[(r.url, r.state.get("pid"), r.state.get("started_at"))]
                        for r in ranks)
            ev = {"starting_timeout_s": self.cfg.starting_timeout_s,
                  "for_s": round(now - first, 1),
                  "ranks": {str(r.rank): {
                      "phase": r.state.get("phase"), "replica_id": r.replica_id,
                      "verified": bool(getattr(getattr(r, "trust", None), "evidence", True)),
                      "why": "no torchft Manager yet (waiting for the group's store or rank 0)"
                      if not r.replica_id else "the Manager exists but no quorum was formed "
                      "(Lighthouse unreachable, or the group's other ranks never asked)"}
                      for r in ranks}}
            f = self._open_or_get("stuck_starting", gv, sorted(r.rank for r in ranks
                                                               if r.rank is not None),
                                  ev, first, now, full, replica_id=rid)
            if f:
                new.append(f)
        return new


# --- mismatch attribution -------------------------------------------------------------------

def _period(sigs: list[int | None], skip: int, max_period: int = 128) -> int | None:
    """The shortest period with which a rank's collectives repeat (one training step's pattern),
    judged on its own history without position ``skip``; None when none holds for 9 in 10."""
    n = len(sigs)
    for p in range(1, min(max_period, n // 3) + 1):
        same = total = 0
        allowed = 0.1 * (n - p)  # give up on this period once too many positions disagree
        for i in range(p, n):
            if i == skip or i - p == skip or sigs[i] is None or sigs[i - p] is None:
                continue
            total += 1
            if sigs[i] == sigs[i - p]:
                same += 1
            elif total - same > allowed:
                break
        if total >= 2 * p and same >= 0.9 * total:
            return p
    return None


def _expected(sigs: list[int | None], i: int, p: int) -> int | None:
    """What the repeating pattern puts at position ``i``: the nearest period-aligned neighbour."""
    for k in range(1, 4):
        for j in (i - k * p, i + k * p):
            if 0 <= j < len(sigs) and sigs[j] is not None:
                return sigs[j]
    return None


def departs_from_step_pattern(traces: Mapping[int, RankTrace], raw: Mapping[str, Any]) -> list[int]:
    """Participants of a mismatch whose collective at its sequence id breaks their own repeating
    per-step pattern, when at least one other participant's follows its pattern.

    Training repeats the same collectives every step (FSDP gathers each unit in turn, a cross-group
    all_reduce per step), so the op at a sequence id is predictable from the same rank's earlier
    and later steps. A rank that issued something else there departs; a rank whose pattern
    predicts exactly what it issued does not. Empty when that does not single anyone out (no
    period, or every participant departs)."""
    key = GroupKey(raw.get("pg"), raw.get("replica_group"), raw.get("quorum_id"),
                   raw.get("group_rank"))
    seq = raw.get("seq")
    if not isinstance(seq, int):
        return []
    departs, conforms = [], []
    for v in raw.get("variants") or []:
        for rank in v.get("ranks") or []:
            t = traces.get(rank)
            row = t.groups.get(key) if t is not None else None
            if row is None or not row.first_seq <= seq <= row.last_seq:
                continue
            # the steps around it are enough to see the pattern (and keep this cheap)
            lo = max(0, seq - row.first_seq - 600)
            sigs = row.sigs[lo:seq - row.first_seq + 300]
            i = seq - row.first_seq - lo
            p = _period(sigs, i)
            expected = None if p is None else _expected(sigs, i, p)
            if expected is None:
                continue
            (conforms if expected == sigs[i] else departs).append(rank)
    return sorted(departs) if departs and conforms else []
