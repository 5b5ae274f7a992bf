"""The goodput ledger: where the job's replica-seconds went, and what each incident cost.

Fed once per sweep with the *evidence* view (verified ranks), the open confirmed findings and the
eviction decisions, at the sweep's time on the monitor's own clock. It splits the wall time since
the previous sweep, times the *expected* replica groups, into goodput and badput by cause, so that
at every sweep ``goodput + sum(badput) + pending == expected groups x wall seconds`` (exactly, up
to float rounding). No HTTP, no threads, no I/O: :mod:`monitor.service` feeds it and persists
:meth:`GoodputLedger.snapshot`; ``docs/goodput.md`` is the manual.

Definitions (per replica group slot, per sweep interval ``dt``; ``docs/goodput.md`` has more):

- **healthy baseline** ``b``: the rolling median (last ``baseline_samples``) of the job's mean
  step time over the trailing pace window, one sample per sweep. Frozen (no sample) while an
  incident is open, and while the job is below ``pace_threshold`` without explanation for less
  than the attribution horizon, so a fault never drags the baseline it is measured against (a
  lasting unexplained change of pace is adopted after the horizon). Before the baseline exists
  every sample counts (a fault during startup is part of the startup), and a young baseline
  (fewer than a quarter of its window) keeps following a job that warms up or settles.
- **pace window** ``W = max(pace_window_s, pace_window_steps x b)``; a group's *pace* is its
  commits in the trailing ``W`` times ``b`` over the window's length (1.0 = healthy pace).
- **goodput**: a group in the quorum (participating) at a pace of at least ``pace_threshold``
  counts the whole ``dt``; below, only ``commits x b`` (the time its commits take at healthy
  pace), at most ``dt``, what they hold beyond it carried to the group's next sweep (at most
  ``b``). The pace window never reaches back across the onset of an incident not yet acted
  on, and an incident's confirmation judges again, from its onset, the sweeps a window reaching
  back before it credited whole (:meth:`GoodputLedger._rejudge`).
- **badput**, the rest of the slot, by the first cause that applies: ``startup`` (no baseline
  yet: from the first sweep that sees a verified rank; and a group seen but never yet in the
  quorum, with no finding about it), ``capacity_lost`` (the slot's group is out of the quorum:
  evicted, restarting, healing, never seen), ``recovery`` (after an eviction, until the job is
  back at pace; a survivor between quorums then too), ``stall`` (no group committed for a whole
  window ``W``, from its last commit; or none in this sweep while an incident other than a
  straggler is open), ``straggler_drag`` (slow commits while a straggler finding is open, or
  before it was confirmed, back to its onset), ``unattributed`` (slow, nothing explains it).
  Slow time nothing explains yet is held as ``pending`` for the attribution horizon
  ``H = max(horizon_s, horizon_steps x b)``: a straggler confirmed within ``H`` claims it back
  to its onset, any other incident the time without commits since its onset (as ``stall``), a
  stall the time since the last commit; otherwise it settles as ``unattributed``.
- **incident**: one faulty replica group incarnation (its first confirmed finding, or a manual
  eviction; later findings about the same replica id join it, e.g. the ``dead`` that follows a
  kill). Onset: the culprit ranks' own ``faults_struck_at`` when they report one, else the
  finding's ``first_seen``. Back at pace: the start of the first trailing window ``W`` after
  the eviction (or the detection, when not evicted) over which the job's pace is at least
  ``pace_threshold``. Closed once acted on (evicted, or its findings cleared), back at pace and
  its group back in the quorum. Cost: every badput slice tied to it, in replica-seconds and,
  with the group world size the ranks report (one accelerator per rank), GPU-seconds.

Robustness: a sweep at or before the previous one is skipped (counted); a gap longer than
``max_gap_s`` (the monitor was down, or stalled) is credited with the commits made across it and
the rest is ``unattributed``; a sweep that sees no reachable rank, or only stopped ones, with no
incident open is not accounted (``unobserved_seconds``). Odd values in a rank's state are
ignored, never raised.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from itertools import chain, compress, repeat
from operator import attrgetter, eq, is_not, ne
from typing import Any

import numpy as np

from monitor.evidence.view import ClusterView

CAUSES = ("straggler_drag", "stall", "recovery", "capacity_lost", "startup", "unattributed")
_CAUSE = {c: i for i, c in enumerate(CAUSES)}  # a cause's column
PENDING = "pending"  # slow time nothing explains yet (settles within the horizon)
# 2: per-group state and totals as columns (:func:`snapshot_rows` reads it back as 1's
# per-group dicts); 3: the unsettled badput as runs (see _Run), a run's groups, seconds and
# world sizes as lists. A store's version-1 or -2 snapshot still resumes.
SNAPSHOT_VERSION = 3
_RUN_LISTS = {"replica_group": "groups", "seconds": "seconds", "gpus": "gpus"}  # Slice: _Run
UNSEEN = "unseen"  # a slot of an expected group never seen (its key in per-group totals)
# the job's newest step falling this far means it started over (one group lagging a step behind
# another that left the quorum is not that)
JOB_RESTART_STEPS = 100


class GoodputError(ValueError):
    """A ledger setting it cannot run with."""


@dataclass
class GoodputConfig:
    expected_groups: int | None = None  # None: the number of replica groups ever seen
    pace_threshold: float = 0.9  # "at healthy pace" and "back at pace"
    pace_window_s: float = 3.0  # W's floor
    pace_window_steps: int = 20  # W >= this many baseline steps
    baseline_samples: int = 120  # the rolling median's window (samples, one per healthy sweep)
    baseline_min_samples: int = 10  # startup ends with this many
    horizon_s: float = 60.0  # H's floor: how long pending slow time waits for an explanation
    horizon_steps: int = 30  # H >= this many baseline steps
    max_gap_s: float = 30.0  # a longer gap between sweeps is accounted as a gap
    keep_intervals: int = 2000  # settled intervals kept in memory (all go to the store)
    keep_incidents: int = 200  # closed incidents kept in memory (all go to the store)

    def validate(self) -> None:
        if self.expected_groups is not None and self.expected_groups < 1:
            raise GoodputError(f"expected_groups must be >= 1, got {self.expected_groups}")
        if not 0 < self.pace_threshold <= 1:
            raise GoodputError(f"pace_threshold must be in (0, 1], got {self.pace_threshold}")
        for name in ("pace_window_s", "horizon_s", "max_gap_s"):
            if not getattr(self, name) > 0:
                raise GoodputError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("pace_window_steps", "baseline_samples", "baseline_min_samples",
                     "horizon_steps", "keep_intervals", "keep_incidents"):
            if getattr(self, name) < 1:
                raise GoodputError(f"{name} must be >= 1, got {getattr(self, name)!r}")


@dataclass
class Slice:
    """One slot's badput over one sweep interval (kept until settled, then merged)."""

    t0: float
    t1: float
    replica_group: int | None
    cause: str
    seconds: float
    gpus: int | None
    incident: int | None = None
    finding_id: int | None = None
    eviction_id: int | None = None
    idle: bool = False  # no group committed in it (pending: a stall not yet a window long)
    counted: bool = False  # in a SweepAccount's badput already (else counted when it settles)


@dataclass(eq=False)
class _Run:
    """Unsettled badput of one sweep interval for one or more groups that share all but their
    seconds and world sizes, in the order the ledger booked them. The slices
    :meth:`GoodputLedger._account` books in one sweep for every group below pace (12,500 at
    100,000 ranks while the job is slow or stalled) are one run: claimed, linked, walked and
    settled as one, where a ``Slice`` each cost ~20-30 us a group in a fault's sweeps
    (docs/scaling.md, eleventh round). Every other booking (a group out of the quorum, a slot
    never seen, a gap, a stored slice) is a run of one, so a run of more than one is never of
    ``capacity_lost`` and never of a slot never seen (``_claim_unsettled``, ``_settle`` rely
    on it). :meth:`slices` gives the slices back."""

    t0: float
    t1: float
    slots: np.ndarray  # int64, one per slice (0: a slot never seen, UNSEEN)
    groups: list[int | None]
    seconds: list[float]
    gpus: list[int | None]
    cause: str
    incident: int | None = None
    finding_id: int | None = None
    eviction_id: int | None = None
    idle: bool = False
    counted: bool = False

    def __len__(self) -> int:
        return len(self.groups)

    def slices(self) -> list[Slice]:
        return [Slice(self.t0, self.t1, g, self.cause, sec, n, self.incident, self.finding_id,
                      self.eviction_id, self.idle, self.counted)
                for g, sec, n in zip(self.groups, self.seconds, self.gpus, strict=True)]

    def part(self, mask: np.ndarray) -> _Run:
        """The slices where ``mask`` is set, in order, as a run of their own."""
        idx = np.flatnonzero(mask)
        at = idx.tolist()
        return replace(self, slots=self.slots[idx], groups=[self.groups[i] for i in at],
                       seconds=[self.seconds[i] for i in at], gpus=[self.gpus[i] for i in at])


@dataclass
class Interval:
    """Settled badput: consecutive slices of one group with one cause and one incident."""

    start: float
    end: float
    replica_group: int | None
    cause: str
    replica_seconds: float
    gpu_seconds: float | None
    incident: int | None
    finding_id: int | None
    eviction_id: int | None
    settled: bool = True

    @classmethod
    def of(cls, s: Slice, settled: bool = True) -> Interval:
        return cls(s.t0, s.t1, s.replica_group, s.cause, s.seconds,
                   s.seconds * s.gpus if s.gpus else None, s.incident, s.finding_id,
                   s.eviction_id, settled)

    def extend(self, s: Slice) -> bool:
        """Append the slice that continues this interval (same cause and ties); False if not."""
        if (s.cause, s.incident, s.eviction_id) != (self.cause, self.incident, self.eviction_id) \
                or abs(self.end - s.t0) > 1e-6:
            return False
        self.end = s.t1
        self.replica_seconds += s.seconds
        self.gpu_seconds = self.gpu_seconds + s.seconds * s.gpus \
            if self.gpu_seconds is not None and s.gpus else None
        return True

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("start", "end", "replica_seconds", "gpu_seconds"):
            if d[k] is not None:
                d[k] = round(d[k], 3)
        return d


@dataclass
class Incident:
    id: int
    kind: str
    replica_group: int | None
    replica_id: str | None
    ranks: list[int]
    onset_at: float
    onset_source: str  # faults_struck_at | first_seen | eviction
    detected_at: float
    finding_ids: list[int] = field(default_factory=list)
    eviction_id: int | None = None
    evicted_at: float | None = None
    resolved_at: float | None = None  # its finding is no longer open
    back_to_pace_at: float | None = None
    # back "settled" below pace: the job's steady pace then, in units of the old baseline's
    # (e.g. 0.8), and the step time the baseline moved to (None: back at pace, or not yet)
    settled_pace: float | None = None
    settled_step_s: float | None = None
    rejoined_at: float | None = None
    closed_at: float | None = None
    gpus_per_group: int | None = None
    cost: dict[str, float] = field(default_factory=dict)  # settled replica-seconds by cause
    gpu_cost: float = 0.0  # settled GPU-seconds
    gpu_cost_known: bool = True  # every settled slice had a known group world size

    @property
    def open(self) -> bool:
        return self.closed_at is None

    @property
    def search_from(self) -> float:
        """Back at pace is looked for from here: the eviction, else the detection."""
        return self.evicted_at if self.evicted_at is not None else self.detected_at

    def to_store(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_store(cls, d: dict[str, Any]) -> Incident:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class SweepAccount:
    """What one update added: the seconds the metrics count (pending time once it settles)."""

    accounted: bool = False
    dt: float = 0.0
    expected_groups: int = 0
    goodput: float = 0.0
    badput: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    group_goodput_ratio: dict[int, float] = field(default_factory=dict)
    job_goodput_ratio: float | None = None


class _Slots:
    """The ledger's per-group state as numpy columns by group slot (docs/scaling.md: one
    vector operation per sweep over every group, where a Python pass per group was ~20 us a
    group at 12,500 groups). Slot 0 holds the totals of ``UNSEEN`` (no group); a group keeps
    the slot it was given when first seen, in the order the views listed them (the order the
    ledger's dict of groups had)."""

    FLOATS = ("carry", "last_in_quorum_at", "good", "exp", "ggood", "gexp")
    INTS = ("commits", "cum", "gpus", "born")

    def __init__(self) -> None:
        self.gids: list[int | None] = [None]  # slot -> replica group (slot 0: UNSEEN)
        self.index: dict[int, int] = {}  # replica group -> slot
        self.rid: list[str | None] = [None]  # the incarnation its commits are of
        # commits: last count of rid (-1: none yet); cum: commits over its incarnations;
        # gpus: its group world size (0: not known); born: the history sample it began at
        self.commits = np.full(1, -1, np.int64)
        self.cum = np.zeros(1, np.int64)
        self.gpus = np.zeros(1, np.int64)
        self.born = np.zeros(1, np.int64)
        self.carry = np.zeros(1)  # below pace: credit held beyond the sweep (see _account)
        self.last_in_quorum_at = np.full(1, np.nan)  # nan: never
        # its totals row: settled goodput and expected replica-seconds, badput by cause (a
        # column per CAUSES entry, and whether the row has that cause at all), and the same in
        # GPU-seconds
        self.good, self.exp = np.zeros(1), np.zeros(1)
        self.ggood, self.gexp = np.zeros(1), np.zeros(1)
        self.bad, self.gbad = np.zeros((1, len(CAUSES))), np.zeros((1, len(CAUSES)))
        self.bad_has = np.zeros((1, len(CAUSES)), bool)
        self.gbad_has = np.zeros((1, len(CAUSES)), bool)

    def __len__(self) -> int:
        return len(self.gids)

    def add(self, groups: list[int], born: int) -> None:
        """New groups, in this order, from history sample ``born`` on."""
        n = len(groups)
        for g in groups:
            self.index[g] = len(self.gids)
            self.gids.append(g)
            self.rid.append(None)
        for name, fill in (("commits", -1), ("cum", 0), ("gpus", 0), ("born", born)):
            setattr(self, name, np.concatenate([getattr(self, name),
                                                np.full(n, fill, np.int64)]))
        for name in self.FLOATS:
            fill = np.nan if name == "last_in_quorum_at" else 0.0
            setattr(self, name, np.concatenate([getattr(self, name), np.full(n, fill)]))
        for name in ("bad", "gbad", "bad_has", "gbad_has"):
            col = getattr(self, name)
            setattr(self, name, np.concatenate([col, np.zeros((n, len(CAUSES)), col.dtype)]))

    def gpus_of(self, g: int | None) -> int | None:
        s = self.index.get(g) if g is not None else None
        n = int(self.gpus[s]) if s is not None else 0
        return n or None


class _History:
    """Every group's cumulative commits at each sweep, on one time axis (a group's history is
    the samples from its ``born`` on): what a deque of (t, cum) per group held, trimmed the
    same way (one sample at or before the window's start, and what follows)."""

    def __init__(self) -> None:
        self.t: deque[float] = deque()
        self.cum: deque[np.ndarray] = deque()  # the column of every slot's cum, per sample
        self.first = 0  # the number of the oldest sample kept (numbers count every sample)

    @property
    def next(self) -> int:
        return self.first + len(self.t)

    def append(self, now: float, cum: np.ndarray, window: float) -> None:
        self.t.append(now)
        self.cum.append(cum.copy())
        end = now - window
        while len(self.t) >= 2 and self.t[1] <= end:
            self.t.popleft()
            self.cum.popleft()
            self.first += 1

    def pace(self, slots: np.ndarray, born: np.ndarray, window: float, b: float) -> np.ndarray:
        """:func:`_pace` of each slot's history (nan: None), all at once."""
        out = np.full(len(slots), np.nan)
        if not self.t or not len(slots):
            return out
        ts = np.fromiter(self.t, float, len(self.t))
        t_end = ts[-1]
        first = np.maximum(born[slots], self.first) - self.first  # its oldest sample kept
        last = len(ts) - 1
        # the last sample at or before the window's start, else its first
        at = int(np.searchsorted(ts, t_end - window, side="right")) - 1
        start = np.maximum(first, at)
        v_end = self.cum[-1][slots]
        v_start = np.empty(len(slots), np.int64)
        for u in np.unique(start).tolist():
            if u > last:
                continue
            m = start == u
            v_start[m] = self.cum[u][slots[m]]
        span = t_end - ts[np.minimum(start, last)]
        ok = (first < last) & (span > 0)
        out[ok] = np.maximum(0, v_end[ok] - v_start[ok]) * b / span[ok]
        return out

    def last_sample(self, slot: int, born: int) -> list[tuple[float, int]]:
        """The group's newest sample, as the snapshot stores it."""
        if not self.t or born >= self.next:
            return []
        return [(self.t[-1], int(self.cum[-1][slot]))]


class _Judged:
    """The sweeps each group was judged in over the horizon (see :meth:`GoodputLedger._rejudge`),
    on one axis: per sweep (t0, t1) and, per slot, cum before and after and ``credit`` (nan:
    that group was not judged in it)."""

    def __init__(self) -> None:
        self.t0: deque[float] = deque()
        self.t1: deque[float] = deque()
        self.before: deque[np.ndarray] = deque()
        self.after: deque[np.ndarray] = deque()
        self.credit: deque[np.ndarray] = deque()

    def drop_before(self, t: float) -> None:
        while self.t1 and self.t1[0] < t:
            for q in (self.t0, self.t1, self.before, self.after, self.credit):
                q.popleft()

    def append(self, t0: float, t1: float, n: int, slots: np.ndarray, before: np.ndarray,
               after: np.ndarray, credit: np.ndarray) -> None:
        col = np.full(n, np.nan)
        col[slots] = credit
        b, a = np.zeros(n, np.int64), np.zeros(n, np.int64)
        b[slots], a[slots] = before, after
        self.t0.append(t0)
        self.t1.append(t1)
        self.before.append(b)
        self.after.append(a)
        self.credit.append(col)

    def dense(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(before, after, credit) as sweeps x slots (credit nan where not judged)."""
        k = len(self.t1)
        before, after = np.zeros((k, n), np.int64), np.zeros((k, n), np.int64)
        credit = np.full((k, n), np.nan)
        for i, (b, a, c) in enumerate(zip(self.before, self.after, self.credit, strict=True)):
            before[i, :len(b)], after[i, :len(a)], credit[i, :len(c)] = b, a, c
        return before, after, credit



# --- reading a rank's state without trusting its types -------------------------------------
def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _int(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, int):
        return None
    return v


def _ints(v: Any) -> list[int]:
    return [x for x in v if _int(x) is not None] if isinstance(v, list) else []


def _stored_count(v: Any, missing: int) -> int:
    """A count from a stored snapshot as the int64 columns hold it (``missing``: none, or not
    one they can hold: an older ledger stored whatever a rank claimed)."""
    return v if type(v) is int and 0 <= v < _HUGE else missing


_INTERVAL_FIELDS = tuple(Interval.__dataclass_fields__)


def _with_none(values: np.ndarray, none: np.ndarray) -> list[Any]:
    """``values`` as a list, None where ``none``."""
    out = values.tolist()
    for i in np.flatnonzero(none).tolist():
        out[i] = None
    return out


def snapshot_rows(state: dict[str, Any]) -> dict[str, Any]:
    """A version-2 or -3 snapshot as version 1 had it (one dict per group, one totals row per
    key, one dict per unsettled slice), which :meth:`GoodputLedger.restore` reads; any other
    state is returned as it is."""
    if not state or state.get("version") not in (2, 3):
        return state
    if state["version"] == 3:
        state = {**state, "unsettled": [
            {**{k: v for k, v in r.items() if k not in _RUN_LISTS.values()},
             **dict(zip(_RUN_LISTS, one, strict=True))}
            for r in state.get("unsettled") or []
            for one in zip(*(r[f] for f in _RUN_LISTS.values()), strict=True)]}
    g = state.get("groups") or {}
    t = g.get("history_t")
    groups = {
        str(gid): {"replica_id": rid, "commits": c if c != -1 else None, "cum": cum,
                   "gpus": gpus or None, "last_in_quorum_at": at,
                   "history": [] if h is None else [(t, h)]}
        for gid, rid, c, cum, gpus, at, h in zip(
            g["gid"], g["replica_id"], g["commits"], g["cum"], g["gpus"],
            g["last_in_quorum_at"], g["history_cum"], strict=True)}
    iv = state.get("open_intervals") or {"key": []}
    columns = [iv[f] for f in _INTERVAL_FIELDS]
    open_intervals = {k: dict(zip(_INTERVAL_FIELDS, row, strict=True))
                      for k, *row in zip(iv["key"], *columns, strict=True)}
    return {**state, "version": 1, "groups": groups, "open_intervals": open_intervals,
            "totals": _totals_rows_of(state.get("totals")),
            "gpu_totals": _totals_rows_of(state.get("gpu_totals"))}


def _totals_rows_of(cols: dict[str, Any] | None) -> dict[str, dict[str, float]]:
    if not cols:
        return {}
    causes = [(c, cols[c]) for c in CAUSES if c in cols]
    rows = {}
    for i, key in enumerate(cols["key"]):
        row = {c: v[i] for c, v in causes if v[i] is not None}
        row["goodput"], row["expected"] = cols["goodput"][i], cols["expected"][i]
        rows[key] = row
    return rows


def _pace(history: deque, window: float, b: float | None) -> float | None:
    """Commits (or steps) in the trailing window x b / the window's length; None without data."""
    if b is None or len(history) < 2:
        return None
    t_end, v_end = history[-1]
    start = history[0]
    for t, v in history:
        if t <= t_end - window:
            start = (t, v)
        else:
            break
    span = t_end - start[0]
    if span <= 0:
        return None
    return max(0, v_end - start[1]) * b / span


_SLOTS = range(1 << 30)  # flat rank positions for compress()
_READ = attrgetter("replica_id", "reachable", "step")  # what the ledger reads of a GroupView
# a count from this on is not one (the columns are int64; a float holds any below it exactly):
# a rank claiming more commits or a larger group is ignored, as a negative count is
_HUGE = 1 << 53


def _trim(history: deque, now: float, keep: float) -> None:
    """Keep one sample at or before ``now - keep`` and everything after."""
    while len(history) >= 2 and history[1][0] <= now - keep:
        history.popleft()


class GoodputLedger:
    """See the module docstring. Call :meth:`update` once per sweep."""

    def __init__(self, cfg: GoodputConfig | None = None) -> None:
        self.cfg = cfg or GoodputConfig()
        self.cfg.validate()
        self.since: float | None = None  # first accounted sweep
        self.last_at: float | None = None
        self.slots = _Slots()  # every group ever seen: its state, by slot (numpy columns)
        self.hist = _History()  # their commits over the pace window
        self.judged = _Judged()  # their sweeps in the quorum over the horizon (_rejudge)
        # what _ingest_groups last read of the view's ranks (a RankView read is not read again)
        self._read: tuple | None = None
        self._quorum_steps: list[int] = []
        self.job_step: int | None = None
        self.job_history: deque = deque()  # (t, job step)
        self.baseline_samples: deque = deque(maxlen=self.cfg.baseline_samples)
        self.baseline: float | None = None
        self.slow_since: float | None = None  # pace below threshold, unexplained, since
        self.last_commit_at: float | None = None  # the last sweep that saw a commit
        self.pace: float | None = None  # the job's pace over the last window
        self.open_findings = 0  # open confirmed findings this sweep
        # (time, job step) where the job's pace became steady, while an incident acted on
        # waits to be back at pace (see _track_steady)
        self.steady: tuple[float, int] | None = None
        # settled totals: key -> {"goodput", "expected", cause...} (replica-seconds), and GPU-s
        # the settled totals (goodput, expected, badput by cause) are the slots' columns; per
        # kind of row (replica-seconds, GPU-seconds): its rows' keys -> slots, in the order the
        # rows were made (the sums over them follow it), their slots in that order, and which
        # slots have a row (see _row, totals)
        self._rows: tuple[dict[str, int], dict[str, int]] = ({}, {})
        self._row_order: tuple[list[int], list[int]] = ([], [])
        self._has_row = (np.zeros(1, bool), np.zeros(1, bool))
        self.expected_groups = 0
        self.unobserved_s = 0.0
        self.gap_s = 0.0
        self.gaps = 0
        self.skipped_sweeps = 0
        # goodput taken back by a re-judgement (see _rejudge) that the metrics' counter, which
        # never decreases, has counted already: paid back from the next sweeps' goodput
        self.goodput_debt = 0.0
        # re-judged slices' (cause, seconds) not yet in a SweepAccount, in the order made
        self._revised: list[tuple[str, float]] = []
        self._runs: list[_Run] = []  # unsettled badput (see _Run), a group's in time order
        self.intervals: deque[Interval] = deque(maxlen=self.cfg.keep_intervals)
        self.open_intervals: dict[str, Interval] = {}  # group key -> the interval being extended
        self.incidents: dict[int, Incident] = {}
        self.next_incident = 1
        self.seen_evictions: set[int] = set()
        # for the store: what changed since the last save
        self._dirty_incidents: set[int] = set()
        self._closed_intervals: list[Interval] = []

    # --- derived settings ------------------------------------------------------------
    @property
    def window(self) -> float:
        b = self.baseline or 0.0
        return max(self.cfg.pace_window_s, self.cfg.pace_window_steps * b)

    @property
    def horizon(self) -> float:
        b = self.baseline or 0.0
        return max(self.cfg.horizon_s, self.cfg.horizon_steps * b)

    @property
    def unsettled(self) -> list[Slice]:
        """The badput not settled yet, slice by slice (a group's in time order)."""
        return [x for r in self._runs for x in r.slices()]

    # --- the sweep -------------------------------------------------------------------
    def update(self, view: ClusterView, findings: list[dict[str, Any]],
               evictions: list[dict[str, Any]], now: float) -> SweepAccount:
        """Fold one sweep: ``view`` (evidence), open confirmed findings (each with its store
        ``id``), eviction decisions (``decision == "evict"``, with ``id``), the sweep's time."""
        acct = SweepAccount()
        if self.last_at is not None and now <= self.last_at:
            self.skipped_sweeps += 1  # out of order or repeated: nothing to split
            return acct
        # lazily: both uses stop at the first live (running) rank; a list was O(ranks) a sweep
        live = (r for r in view.ranks.values() if r.reachable and r.state)
        first = next(live, None)
        if self.since is None and first is None:
            return acct  # no job seen yet: the ledger's clock has not started
        in_quorum = {g.replica_group for g in view.in_quorum()}
        deltas = self._ingest_groups(view, in_quorum, now)
        self._ingest_findings(view, findings, now)
        self._ingest_evictions(evictions, now)
        job_moved = self._ingest_job_step(view, in_quorum, now)
        if self.since is None:
            self.since = self.last_at = now
            self._revised.clear()
            return acct
        for cause, seconds in self._revised:  # goodput a confirmation took back (_rejudge)
            acct.badput[cause] += seconds
            acct.goodput -= seconds
        self._revised.clear()
        dt = now - self.last_at
        running = first is not None and any(r.state.get("phase") != "stopped"
                                            for r in itertools.chain((first,), live))
        if not running and not any(i.open for i in self.incidents.values()):
            self.unobserved_s += dt  # the job is not there (ended, or not reachable): no split
        elif dt > self.cfg.max_gap_s:
            self._account_gap(in_quorum, deltas, dt, now, acct)
        else:
            self._account(in_quorum, deltas, job_moved, dt, now, acct)
        # the counter never decreases: goodput taken back is paid from this sweep's first
        self.goodput_debt -= min(0.0, acct.goodput)
        pay = min(max(0.0, acct.goodput), self.goodput_debt)
        acct.goodput, self.goodput_debt = max(0.0, acct.goodput) - pay, self.goodput_debt - pay
        self.last_at = now
        self._follow_incidents(in_quorum, now)
        self._sample_baseline(now)
        self._settle(now, acct)
        self._publish_ratios(acct)
        return acct

    def _ingest_groups(self, view: ClusterView, in_quorum: set[int], now: float
                       ) -> np.ndarray:
        """Commits each group made since the last sweep (its current incarnation's), by slot.

        A group's commit count is the most any of its reachable ranks of its replica id
        reports, its world size the one most report. The ranks are read as one flat list: a
        RankView object read last sweep (a view never changes one) keeps its counts, so a
        leader sweep reads the ranks that answered anew, and numpy takes each group's max."""
        S, groups = self.slots, view.groups
        keys = list(groups)
        rd = self._read
        if rd is None or rd[0] != keys:
            new = [g for g in keys if g not in S.index]
            if new:
                S.add(new, self.hist.next)
            vslots = np.fromiter(map(S.index.__getitem__, keys), np.int64, len(keys))
        else:
            vslots = rd[1]
        # one pass over the GroupViews (12,500 objects: each touch is a cache miss)
        rows = list(map(_READ, groups.values()))
        rids, reaches, steps = zip(*rows, strict=True) if rows else ((), (), ())
        rids, lens = list(rids), list(map(len, reaches))
        inq = list(map(in_quorum.__contains__, keys))
        # the in-quorum groups' steps (_ingest_job_step)
        self._quorum_steps = list(filter(partial(is_not, None), compress(steps, inq)))
        flat = list(chain.from_iterable(reaches))
        if rd is not None and rd[0] == keys and rd[3] == lens:
            owner, commits, sizes, states = rd[5], rd[6], rd[7], rd[8]
            todo = compress(_SLOTS, map(is_not, flat, rd[4]))
            if rd[2] != rids:  # a new incarnation: every rank of that group again
                again = set(compress(_SLOTS, map(ne, rids, rd[2])))
                todo = sorted(set(todo).union(i for i, o in enumerate(owner) if o in again))
                states = [None] * len(flat)
        else:
            owner = list(chain.from_iterable(map(repeat, range(len(lens)), lens)))
            commits, sizes = np.full(len(flat), -1, np.int64), np.full(len(flat), -1, np.int64)
            states = [None] * len(flat)
            todo = range(len(flat))
        read, counts, of_size = [], [], []
        # a rank's commits and group world size, if it is of the group's incarnation and they
        # are counts (-1: not); inline, ~15,000-30,000 ranks a sweep at 100,000. A new RankView
        # with the state read last sweep (a rank polled then, not now: a copy marked not fresh)
        # keeps its counts.
        for i in todo:
            st = flat[i].state
            if st is states[i]:
                continue
            states[i] = st
            read.append(i)
            if not st or st.get("replica_id") != rids[owner[i]]:
                counts.append(-1)
                of_size.append(-1)
                continue
            c = st.get("commits")
            if type(c) is not int:  # JSON's ints pass as they are; anything else: _int
                c = _int(c)
            n = st.get("group_world_size")
            if type(n) is not int:
                n = _int(n)
            counts.append(c if c is not None and 0 <= c < _HUGE else -1)
            of_size.append(n if n is not None and 1 <= n < _HUGE else -1)
        commits[read] = counts
        sizes[read] = of_size
        self._read = (keys, vslots, rids, lens, flat, owner, commits, sizes, states)
        # per group (of those with a reachable rank): the most commits, the world sizes
        has = np.asarray(lens) > 0
        offsets = np.cumsum(lens) - lens
        starts = offsets[has]
        c = np.full(len(keys), -1, np.int64)
        c[has] = np.maximum.reduceat(commits, starts) if len(starts) else []
        most = np.full(len(keys), -1, np.int64)
        least = np.full(len(keys), -1, np.int64)
        if len(starts):
            most[has] = np.maximum.reduceat(sizes, starts)
            least[has] = np.minimum.reduceat(np.where(sizes < 0, 1 << 62, sizes), starts)
        sized = most >= 1
        S.gpus[vslots[sized & (least == most)]] = most[sized & (least == most)]
        for i in np.flatnonzero(sized & (least != most)).tolist():  # the majority's
            o = int(offsets[i])
            vals = [v for v in sizes[o:o + lens[i]].tolist() if v >= 1]
            S.gpus[vslots[i]] = max(set(vals), key=vals.count)
        # what each group committed since the last sweep
        got = c >= 0
        vs = vslots[got]
        c = c[got]
        was = S.commits[vs]
        old_rids = list(map(S.rid.__getitem__, vs.tolist()))
        rid_got = list(compress(rids, got))
        same = np.fromiter(map(eq, rid_got, old_rids), bool, len(vs))
        d = np.where(was < 0, np.where(same | (self.last_at is None), 0, c),
                     np.where(same, np.maximum(0, c - was), c))
        for i in np.flatnonzero(~same).tolist():
            S.rid[vs[i]] = rid_got[i]
        S.commits[vs] = c
        S.cum[vs] += d
        S.last_in_quorum_at[vs[np.asarray(inq, bool)[got]]] = now
        deltas = np.zeros(len(S), np.int64)
        deltas[vs] = d
        self.hist.append(now, S.cum, self.window)
        return deltas

    def _ingest_job_step(self, view: ClusterView, in_quorum: set[int], now: float) -> bool:
        steps = self._quorum_steps  # read by _ingest_groups, in the same pass
        moved = False
        if steps:
            s = max(steps)
            if self.job_step is not None and s > self.job_step:
                moved = True
            if self.job_step is not None and s < self.job_step - JOB_RESTART_STEPS:
                self.job_history.clear()  # the job started over (e.g. from a checkpoint)
            if self.job_step is None or s > self.job_step or not self.job_history:
                self.job_step = s
        if self.job_step is not None:
            self.job_history.append((now, self.job_step))
            _trim(self.job_history, now, self.window)
        return moved

    # --- incidents -------------------------------------------------------------------
    def _ingest_findings(self, view: ClusterView, findings: list[dict[str, Any]],
                         now: float) -> None:
        open_ids = set()
        self.open_findings = sum(1 for f in findings if _int(f.get("id")) is not None)
        for f in findings:
            fid = _int(f.get("id"))
            if fid is None:
                continue
            open_ids.add(fid)
            if any(fid in i.finding_ids for i in self.incidents.values()):
                continue
            # one incident per faulty incarnation: a later finding about the same replica id
            # (the `dead` that follows a kill, the same fault confirmed again by a restarted
            # monitor) joins the open incident
            same = [i for i in self.incidents.values() if i.open
                    and i.replica_group == f.get("replica_group")
                    and i.replica_id == f.get("replica_id")
                    and (i.replica_id is not None or i.kind == f.get("kind"))]
            if same:
                same[-1].finding_ids.append(fid)
                same[-1].resolved_at = None
                self._dirty_incidents.add(same[-1].id)
                continue
            self._open_incident(f, fid, view, now)
        for inc in self.incidents.values():
            if inc.finding_ids and inc.resolved_at is None and inc.open \
                    and not open_ids.intersection(inc.finding_ids):
                inc.resolved_at = now
                self._dirty_incidents.add(inc.id)

    def _open_incident(self, f: dict[str, Any], fid: int | None, view: ClusterView | None,
                       now: float) -> Incident:
        first = _num(f.get("first_seen"))
        detected = _num(f.get("confirmed_at")) or first or now
        first = first if first is not None else detected
        onset, source = first, "first_seen"
        strike = self._strike_time(f, view, detected) if view is not None else None
        if strike is not None and strike < first:
            onset, source = strike, "faults_struck_at"
        if self.since is not None:
            onset = max(onset, self.since)
        g = _int(f.get("replica_group"))
        inc = Incident(id=self.next_incident, kind=str(f.get("kind") or "unknown"),
                       replica_group=g, replica_id=f.get("replica_id"),
                       ranks=_ints(f.get("ranks")),
                       onset_at=onset, onset_source=source, detected_at=detected,
                       finding_ids=[fid] if fid is not None else [],
                       gpus_per_group=self.slots.gpus_of(g))
        self.next_incident += 1
        self.incidents[inc.id] = inc
        self._dirty_incidents.add(inc.id)
        self._claim_unsettled(inc)
        self._rejudge(inc)
        return inc

    def _rejudge(self, inc: Incident) -> None:
        """Judge again, from the incident's onset, the sweeps since then that a pace window
        reaching back before it credited whole: commits made before a fault say nothing about
        the pace after it. A sweep whose commits since the onset (over at least two baseline
        steps) are below ``pace_threshold`` keeps ``commits x b`` of goodput; the rest of it
        (from the onset, in the sweep the onset falls in) becomes the incident's badput: a
        straggler's ``straggler_drag``, any other's ``stall``. Within the horizon only (what
        the ledger's judged sweeps hold; a restarted monitor's record starts empty)."""
        b = self.baseline
        J = self.judged
        if b is None or not J.t1:
            return
        cause = "straggler_drag" if inc.kind == "straggler" else "stall"
        t_on = inc.onset_at
        S = self.slots
        n = len(S)
        before, after, credit = J.dense(n)
        t0 = np.fromiter(J.t0, float, len(J.t0))
        t1 = np.fromiter(J.t1, float, len(J.t1))
        judged = ~np.isnan(credit)
        ar = np.arange(n)
        # each group's cumulative commits at the sweep at or before the onset: after its last
        # sweep ending by then, else before its first (None: never judged)
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
        frac = np.minimum(1.0, span[:, 0] / (t1 - t0))
        seconds = credit[ks, slots_of] * frac[ks]
        # the account takes them back in that order (a deque per group was walked so)
        self._revised.extend(zip(repeat(cause), seconds.tolist()))
        # the rows they book to (made in that order; a slot judged has them already)
        self._rows_for(np.unique(slots_of), gpu=False)
        self._rows_for(np.unique(slots_of[S.gpus[slots_of] > 0]), gpu=True)
        runs = []
        for k in np.unique(ks).tolist():  # a run per sweep re-judged, its slots in order
            m = ks == k
            slots, sec = slots_of[m], seconds[m]
            J.credit[k][slots] = credit[k, slots] - sec
            n = S.gpus[slots]
            S.good[slots] -= sec
            S.ggood[slots[n > 0]] -= sec[n > 0] * n[n > 0]
            r = _Run(max(float(t0[k]), t_on), float(t1[k]), slots,
                     list(map(S.gids.__getitem__, slots.tolist())), sec.tolist(),
                     [x or None for x in n.tolist()], cause, counted=True)
            self._link(r, inc)
            runs.append(r)
        self._runs.extend(runs)
        self._runs.sort(key=attrgetter("t0"))  # a group's slices settle in time order

    @staticmethod
    def _strike_time(f: dict[str, Any], view: ClusterView, detected: float) -> float | None:
        """The latest fault strike a culprit rank reports before the detection. A finding
        about one incarnation (its replica id) of a group in the view has its culprits among
        that group's ranks (its old processes too): only those are read, not every rank
        (0.15-0.25 s an incident at 100,000 ranks)."""
        ev = f.get("evidence") if isinstance(f.get("evidence"), dict) else {}
        ranks = set(_ints(f.get("ranks")) + _ints(ev.get("culprit_ranks")))
        strikes = []
        gv = view.groups.get(_int(f.get("replica_group"))) \
            if f.get("replica_id") is not None else None
        for r in chain(gv.ranks, gv.superseded) if gv is not None else view.ranks.values():
            if r.state is None or r.rank not in ranks:
                continue
            if f.get("replica_id") is not None and r.replica_id != f.get("replica_id"):
                continue
            struck = r.state.get("faults_struck_at")
            if isinstance(struck, dict):
                strikes += [t for t in map(_num, struck.values())
                            if t is not None and t <= detected]
        return max(strikes) if strikes else None

    def _ingest_evictions(self, evictions: list[dict[str, Any]], now: float) -> None:
        for d in sorted(evictions, key=lambda d: _num(d.get("at")) or 0.0):
            did = _int(d.get("id"))
            if did is None or did in self.seen_evictions or d.get("decision") != "evict" \
                    or d.get("status") == "failed":
                continue
            at = _num(d.get("at")) or now
            if at < (self.since if self.since is not None else now) - self.cfg.max_gap_s:
                self.seen_evictions.add(did)  # from before this ledger: not its business
                continue
            self.seen_evictions.add(did)
            fid = _int(d.get("finding_id"))
            inc = next((i for i in self.incidents.values() if fid is not None
                        and fid in i.finding_ids), None)
            if inc is None:
                finding = d.get("finding") if isinstance(d.get("finding"), dict) else {}
                manual = d.get("source") == "manual" or not finding.get("first_seen")
                f = {"kind": "manual" if manual else finding.get("kind"),
                     "replica_group": d.get("replica_group"), "replica_id": d.get("replica_id"),
                     "ranks": finding.get("ranks") or [],
                     "first_seen": at if manual else finding.get("first_seen"),
                     "confirmed_at": at if manual else finding.get("confirmed_at") or at}
                inc = self._open_incident(f, fid, None, now)
                if manual:
                    inc.onset_source = "eviction"
            if inc.evicted_at is None:
                inc.evicted_at, inc.eviction_id = at, did
                inc.back_to_pace_at = None  # looked for after the eviction
                self._dirty_incidents.add(inc.id)

    def _claim_unsettled(self, inc: Incident) -> None:
        """A new incident explains unsettled badput since its onset: a straggler the pending
        slow time, any other the pending time without commits (as ``stall``), any incident a
        stall nothing explained, its group's capacity lost (a run of one: see _Run)."""
        for r in self._runs:
            if r.t1 <= inc.onset_at:
                continue
            if r.cause == PENDING and inc.kind == "straggler":
                r.cause = "straggler_drag"
            elif (r.cause == PENDING and r.idle) or (inc.kind != "straggler"
                                                      and self._provisional(r)):
                r.cause = "stall"  # the first seconds of the stall this incident caused
            elif r.incident is not None or not (
                    r.cause == "stall" or (r.cause == "capacity_lost"
                                           and r.groups[0] == inc.replica_group)):
                continue
            self._link(r, inc)

    def _provisional(self, s: _Run) -> bool:
        """Straggler drag booked while no group committed, with no commit since: it may be
        the first seconds of a stall another fault caused (confirmed a little later), so it
        stays open to that fault's claim until the job commits again (or the horizon)."""
        if s.cause != "straggler_drag" or not s.idle:
            return False
        inc = self.incidents.get(s.incident) if s.incident is not None else None
        return (inc is None or inc.kind == "straggler") and (
            self.last_commit_at is None or self.last_commit_at < s.t1 - 1e-9)

    def _link(self, s: _Run, inc: Incident | None) -> None:
        if inc is None:
            return
        s.incident = inc.id
        s.finding_id = inc.finding_ids[0] if inc.finding_ids else None
        s.eviction_id = inc.eviction_id if inc.evicted_at is not None \
            and inc.evicted_at < s.t1 else None

    def _open_incidents(self) -> list[Incident]:
        return [i for i in self.incidents.values() if i.open]

    def _recovering(self, t: float) -> Incident | None:
        """The latest evicted incident whose job is not back at pace by ``t``."""
        cands = [i for i in self._open_incidents() if i.evicted_at is not None
                 and i.evicted_at < t and i.back_to_pace_at is None]
        return max(cands, key=lambda i: i.evicted_at) if cands else None

    def _explaining(self, straggler: bool | None = None) -> Incident | None:
        """The latest open incident (of a straggler, or of anything but one, or either)."""
        cands = [i for i in self._open_incidents()
                 if straggler is None or (i.kind == "straggler") == straggler]
        return max(cands, key=lambda i: (i.detected_at, i.id)) if cands else None

    def _group_incident(self, g: int | None) -> Incident | None:
        cands = [i for i in self._open_incidents() if g is not None and i.replica_group == g]
        return max(cands, key=lambda i: (i.detected_at, i.id)) if cands else None

    # --- splitting a sweep -----------------------------------------------------------
    def _slots(self, in_quorum: set[int]) -> tuple[np.ndarray, np.ndarray, int]:
        """(slots of the groups in the quorum, of known groups out of it that fill slots, unseen
        slots), each in replica group order."""
        S = self.slots
        gids = np.asarray(S.gids[1:], np.int64)
        known = np.argsort(gids, kind="stable") + 1
        inq = np.fromiter(map(in_quorum.__contains__, S.gids[1:]), bool, len(gids))
        inside = known[inq[known - 1]]
        outside = known[~inq[known - 1]]
        if self.cfg.expected_groups is None:
            self.expected_groups = len(gids)
            return inside, outside, 0
        e = max(self.cfg.expected_groups, len(inside))
        self.expected_groups = e
        last_in = np.nan_to_num(S.last_in_quorum_at[outside], nan=0.0)
        outside = outside[np.argsort(-last_in, kind="stable")][:e - len(inside)]
        return inside, outside, e - len(inside) - len(outside)

    def _default_gpus(self) -> int | None:
        sizes = self.slots.gpus[self.slots.gpus > 0].tolist()
        return max(set(sizes), key=sizes.count) if sizes else None

    def _account(self, in_quorum: set[int], deltas: np.ndarray, job_moved: bool,
                 dt: float, now: float, acct: SweepAccount) -> None:
        t0, b = self.last_at, self.baseline
        S = self.slots
        inside, outside, unseen = self._slots(in_quorum)
        acct.accounted, acct.dt, acct.expected_groups = True, dt, self.expected_groups
        startup = b is None
        committed = bool(deltas[inside].any())
        if job_moved or committed:
            self.last_commit_at = now
        # a stall: no group committed for a whole pace window (shorter gaps are slow steps)
        stall = not startup and (self.last_commit_at is None
                                 or now - self.last_commit_at >= self.window)
        recovering = self._recovering(now)
        straggler = self._explaining(straggler=True)
        other = self._explaining(straggler=False)
        stall_cause = other or straggler
        idle = not job_moved and not committed
        # the pace window never reaches back across the onset of an incident not yet acted on
        cuts = [i.onset_at for i in self._open_incidents() if i.evicted_at is None
                and i.resolved_at is None and now - self.window < i.onset_at < now]
        cut = max(cuts) if cuts else None
        self.judged.drop_before(now - self.horizon)
        if stall and recovering is None:
            self._pending_to_stall(stall_cause)
        slow = False
        window = self.window if cut is None else min(self.window, now - cut)
        gpus = S.gpus[inside].tolist()
        if startup:
            self._add_many(inside, np.zeros(len(inside)), dt, acct)
            if len(inside):  # one run, settled by _settle in this sweep (startup is final)
                self._book_run(_Run(t0, now, inside, list(map(S.gids.__getitem__,
                                                              inside.tolist())),
                                    [dt] * len(inside), [n or None for n in gpus], "startup"),
                               None, acct)
        else:
            pace = self.hist.pace(inside, S.born, window, b) if window >= 2 * b \
                else np.full(len(inside), np.nan)
            d = deltas[inside]
            held = d * b + S.carry[inside]  # what its commits take at healthy pace
            earned = np.minimum(dt, held)
            at_pace = pace >= self.cfg.pace_threshold  # over the window: the whole interval
            good = np.where(at_pace, dt, earned)
            S.carry[inside] = np.where(at_pace, 0.0, np.minimum(b, held - earned))
            cum = S.cum[inside]
            self.judged.append(t0, now, len(S), inside, cum - d, cum, good - earned)
            self._add_many(inside, good, dt, acct)
            rest = dt - good
            below = np.flatnonzero(rest > 1e-9)
            if len(below):  # one cause for all of them: one run (see _Run)
                if recovering is not None:
                    cause, inc = "recovery", recovering
                elif stall:
                    cause, inc = "stall", stall_cause
                elif idle and other is not None:  # stalling, with a fault that stops commits
                    cause, inc = "stall", other  # before a straggler: it slows, never stops
                elif straggler is not None:
                    cause, inc = "straggler_drag", straggler
                else:
                    cause, inc, slow = PENDING, None, True
                slots = inside[below]
                self._book_run(_Run(t0, now, slots, list(map(S.gids.__getitem__, slots.tolist())),
                                    rest[below].tolist(),
                                    [gpus[i] or None for i in below.tolist()], cause, idle=idle),
                               inc, acct)
        for slot in outside.tolist():
            g = S.gids[slot]
            S.carry[slot] = 0.0
            self._add(g, 0.0, dt, acct)
            inc = None if startup else self._group_incident(g)
            # a group never yet in the quorum, with nothing wrong found, is still starting
            first = np.isnan(S.last_in_quorum_at[slot]) and inc is None
            if startup or first:
                cause = "startup"
            elif inc is None and recovering is not None:
                cause, inc = "recovery", recovering  # a survivor between quorums
            else:
                cause = "capacity_lost"
            self._badput(t0, now, g, cause, dt, S.gpus_of(g), inc, acct)
        for _ in range(unseen):
            self._add(None, 0.0, dt, acct)
            self._badput(t0, now, None, "startup" if startup else "capacity_lost", dt,
                         self._default_gpus(), None, acct)
        self.pace = _pace(self.job_history, self.window, b)
        self.slow_since = (self.slow_since or t0) if slow else None

    def _pending_to_stall(self, inc: Incident | None) -> None:
        """Pending slow time since the last commit was the stall's beginning."""
        for r in self._runs:
            if (r.cause == PENDING or self._provisional(r)) and self.last_commit_at is not None \
                    and r.t0 >= self.last_commit_at - 1e-9:
                r.cause = "stall"
                self._link(r, inc)

    def _account_gap(self, in_quorum: set[int], deltas: np.ndarray, dt: float, now: float,
                     acct: SweepAccount) -> None:
        """A gap: credit the commits made across it, leave the rest unexplained."""
        inside, outside, unseen = self._slots(in_quorum)
        acct.accounted, acct.dt, acct.expected_groups = True, dt, self.expected_groups
        self.gaps += 1
        self.gap_s += dt
        b = self.baseline
        S = self.slots
        for slot in inside.tolist() + outside.tolist() + [0] * unseen:
            g = S.gids[slot]
            good = min(dt, int(deltas[slot]) * b) if b is not None and g in in_quorum else 0.0
            self._add(g, good, dt, acct)
            if dt - good > 1e-9:
                gpus = S.gpus_of(g) if g is not None else self._default_gpus()
                self._badput(self.last_at, now, g, "unattributed", dt - good, gpus, None, acct)

    def _key(self, g: int | None) -> str:
        return UNSEEN if g is None else str(g)

    def _row(self, slot: int, key: str, gpu: bool = False) -> None:
        """Make the totals row (GPU-seconds: ``gpu``) of ``slot`` if it has none."""
        rows = self._rows[gpu]
        if key not in rows:
            rows[key] = slot
            order, have = self._row_order[gpu], self._has_row[gpu]
            order.append(slot)
            if len(have) < len(self.slots):
                have.resize(len(self.slots), refcheck=False)
            have[slot] = True

    def _add(self, g: int | None, good: float, dt: float, acct: SweepAccount) -> None:
        slot = self.slots.index[g] if g is not None else 0
        self._add_many(np.array([slot]), np.array([good]), dt, acct,
                       None if g is not None else self._default_gpus())

    def _add_many(self, slots: np.ndarray, good: np.ndarray, dt: float, acct: SweepAccount,
                  unseen_gpus: int | None = None) -> None:
        """Each slot's goodput and expected seconds of the sweep (in slot order, as one
        ``_add`` per group did)."""
        S = self.slots
        self._rows_for(slots, gpu=False)
        S.good[slots] += good
        S.exp[slots] += dt
        gpus = S.gpus[slots] if unseen_gpus is None else np.array([unseen_gpus or 0])
        with_gpus = gpus > 0
        if with_gpus.any():
            on, n = slots[with_gpus], gpus[with_gpus]
            self._rows_for(on, gpu=True)
            S.ggood[on] += good[with_gpus] * n
            S.gexp[on] += dt * n
        acct.goodput = sum(good.tolist(), acct.goodput)

    def _rows_for(self, slots: np.ndarray, gpu: bool) -> None:
        """Make the totals rows these slots do not have yet, in their order."""
        have = self._has_row[gpu]
        if len(have) < len(self.slots):
            have.resize(len(self.slots), refcheck=False)
        missing = slots[~have[slots]]
        gids = self.slots.gids
        for slot in missing.tolist():
            self._row(slot, self._key(gids[slot]), gpu)

    def _badput(self, t0: float, t1: float, g: int | None, cause: str, seconds: float,
                gpus: int | None, inc: Incident | None, acct: SweepAccount,
                idle: bool = False) -> None:
        slot = self.slots.index[g] if g is not None else 0
        self._book_run(_Run(t0, t1, np.array([slot], np.int64), [g], [seconds], [gpus], cause,
                            idle=idle), inc, acct)

    def _book_run(self, r: _Run, inc: Incident | None, acct: SweepAccount) -> None:
        """Unsettled badput: ``r`` (see _Run), tied to ``inc``."""
        self._link(r, inc)
        self._runs.append(r)
        # counted now unless its cause may still change (pending; idle straggler drag): those
        # count once settled, under their final cause (one by one, in order)
        if r.cause != PENDING and not (r.cause == "straggler_drag" and r.idle):
            acct.badput[r.cause] = sum(r.seconds, acct.badput[r.cause])
            r.counted = True

    # --- after the split -------------------------------------------------------------
    def _follow_incidents(self, in_quorum: set[int], now: float) -> None:
        hist = list(self.job_history)
        b = self.baseline
        settled = self._track_steady(now)
        for inc in self._open_incidents():
            changed = False
            back_in = inc.replica_group is None or inc.replica_group in in_quorum
            if inc.evicted_at is not None and inc.rejoined_at is None \
                    and inc.replica_group in in_quorum \
                    and self.slots.rid[self.slots.index[inc.replica_group]] \
                    != inc.replica_id:
                inc.rejoined_at, changed = now, True
            if inc.back_to_pace_at is None and b is not None and len(hist) >= 2:
                back = self._back_at(hist, inc.search_from, now, b)
                if back is not None:
                    inc.back_to_pace_at, changed = back, True
                elif settled is not None and self._waiting(inc):
                    inc.back_to_pace_at = settled[0]
                    inc.settled_pace = round(b / settled[1], 3)
                    inc.settled_step_s = round(settled[1], 4)
                    changed = True
            # closed: acted on (evicted) or cleared, the job back at pace, the group back in
            acted = inc.evicted_at is not None or inc.resolved_at is not None
            if inc.back_to_pace_at is not None and acted and back_in:
                inc.closed_at, changed = now, True
            if changed:
                self._dirty_incidents.add(inc.id)

    def _waiting(self, inc: Incident) -> bool:
        """Acted on (evicted, or its findings cleared) and not yet back at pace."""
        return inc.open and inc.back_to_pace_at is None and (
            inc.evicted_at is not None or inc.resolved_at is not None)

    def _track_steady(self, now: float) -> tuple[float, float] | None:
        """The "settled" rule: while an incident acted on waits to be back at >= 90% of the
        (frozen) baseline's pace, follow the job's pace; once it has been steady for the horizon
        ``H`` (every trailing window ``W`` with at least 3 steps, each window's pace within 10%
        of the steady period's mean, no confirmed finding open, the period starting after every
        waiting incident's eviction or clearing), the job has settled at a new level: returns
        (start of the steady period, its mean step time) and moves the baseline there (its
        samples replaced), else None. A commit gap, a finding or a change of pace restarts it."""
        waiting = [i for i in self._open_incidents() if self._waiting(i)]
        hist = self.job_history
        if not waiting or self.open_findings or self.baseline is None or len(hist) < 2:
            self.steady = None
            return None
        (t0, s0), (t1, s1) = hist[0], hist[-1]
        after = max(i.search_from for i in waiting)
        if s1 - s0 < 3 or t1 - t0 < 0.9 * self.window or t0 < after - 1e-9:
            self.steady = None  # a commit gap, or a window not yet wholly after the action
            return None
        if self.steady is None:
            self.steady = (t0, s0)
            return None
        st, ss = self.steady
        mean = (s1 - ss) / (t1 - st) if t1 > st else 0.0
        if mean <= 0 or abs((s1 - s0) / (t1 - t0) / mean - 1) > 0.1:
            self.steady = (t0, s0)  # the pace changed: a new steady period may begin here
            return None
        if now - st < self.horizon:
            return None
        level = 1 / mean
        self.baseline = level
        self.baseline_samples.clear()
        self.baseline_samples.extend([level] * self.cfg.baseline_min_samples)
        self.slow_since = None
        self.steady = None
        return st, level

    def _back_at(self, hist: list[tuple[float, int]], after: float, now: float,
                 b: float) -> float | None:
        """Start of the trailing window (>= ``after``) at pace, or None."""
        w = self.window
        start = None
        for t, s in hist:
            if t <= now - w:
                start = (t, s)
        if start is None or start[0] < after - 1e-9:
            return None
        span = now - start[0]
        if span <= 0 or (hist[-1][1] - start[1]) * b / span < self.cfg.pace_threshold:
            return None
        # never before the sweep after which the job first committed again
        first_move = next((hist[i - 1][0] for i in range(1, len(hist))
                           if hist[i][0] > after and hist[i][1] > hist[i - 1][1]), start[0])
        return max(start[0], first_move)

    def _sample_baseline(self, now: float) -> None:
        """One sample (the job's mean step time over the trailing window) per healthy sweep."""
        hist = self.job_history
        if len(hist) < 2:
            return
        span = hist[-1][0] - hist[0][0]
        steps = hist[-1][1] - hist[0][1]
        if steps < 3 or span < 0.9 * self.window:
            return  # too few steps, or not a whole window yet
        if self.baseline is not None and any(i.open and i.settled_pace is None
                                             for i in self.incidents.values()):
            return  # frozen: an incident is open (its own slowness must not become the norm)
        young = len(self.baseline_samples) < self.cfg.baseline_samples // 4
        if not young and self.slow_since is not None and now - self.slow_since < self.horizon:
            return  # frozen: unexplained slowness, still waiting for an explanation
        self.baseline_samples.append(span / steps)
        if len(self.baseline_samples) >= self.cfg.baseline_min_samples:
            self.baseline = statistics.median(self.baseline_samples)

    def _settle(self, now: float, acct: SweepAccount) -> None:
        """Slices nothing can change any more become final (totals, incident costs, intervals):
        those tied to an incident or of ``startup`` or of a group never seen at once, the rest
        (pending, and stall or capacity lost nothing explains yet) after the horizon, pending
        then as ``unattributed``. A group's slices settle in time order."""
        cutoff = now - self.horizon
        keep: list[_Run] = []
        blocked = np.zeros(len(self.slots), bool)  # slots with an earlier slice still open
        for r in self._runs:
            # a run of more than one is never of a slot never seen (see _Run)
            final = r.t1 <= cutoff or (r.cause != PENDING and not self._provisional(r) and (
                r.incident is not None or r.cause == "startup" or r.groups[0] is None))
            if not final:
                blocked[r.slots] = True
                keep.append(r)
                continue
            held = blocked[r.slots]
            if held.any():
                if held.all():
                    keep.append(r)
                    continue
                keep.append(r.part(held))
                r = r.part(~held)
            if r.cause == PENDING:
                r.cause = "unattributed"
            if not r.counted:
                acct.badput[r.cause] = sum(r.seconds, acct.badput[r.cause])  # one by one
                r.counted = True
            self._settle_run(r)
        self._runs = keep
        # an interval that neither this sweep nor an open slice continues is over: close it
        continued: dict[float, np.ndarray] = {}  # a kept slice's start -> the slots it is of
        for r in keep:
            at = continued.get(round(r.t0, 6))
            if at is None:
                at = continued[round(r.t0, 6)] = np.zeros(len(self.slots), bool)
            at[r.slots] = True
        index = self.slots.index
        for key, iv in list(self.open_intervals.items()):
            if iv.end < now - 1e-6:
                at = continued.get(round(iv.end, 6))
                slot = 0 if key == UNSEEN else index.get(int(key))
                if at is None or slot is None or not at[slot]:
                    self._close_interval(self.open_intervals.pop(key))

    def _settle_run(self, r: _Run) -> None:
        """Book ``r``'s slices as settled: the totals, its incident's cost and the groups'
        intervals (each slice extends its group's open interval or starts one), in order."""
        S, c = self.slots, _CAUSE[r.cause]
        slots, sec = r.slots, np.asarray(r.seconds)
        self._rows_for(slots, gpu=False)
        S.bad[slots, c] += sec
        S.bad_has[slots, c] = True
        n = np.fromiter((x or 0 for x in r.gpus), np.int64, len(r))
        on = n > 0
        if on.any():
            self._rows_for(slots[on], gpu=True)
            S.gbad[slots[on], c] += sec[on] * n[on]
            S.gbad_has[slots[on], c] = True
        inc = self.incidents.get(r.incident) if r.incident is not None else None
        if inc is not None:
            inc.cost[r.cause] = sum(r.seconds, inc.cost.get(r.cause, 0.0))
            cost = inc.gpu_cost
            for x, m in zip(r.seconds, r.gpus, strict=True):
                if m:
                    cost += x * m
                else:
                    inc.gpu_cost_known = False
            inc.gpu_cost = cost
            self._dirty_incidents.add(inc.id)
        ties = (r.cause, r.incident, r.eviction_id)
        t0, t1, open_iv = r.t0, r.t1, self.open_intervals
        for g, x, m in zip(r.groups, r.seconds, r.gpus, strict=True):
            key = UNSEEN if g is None else str(g)
            cur = open_iv.get(key)
            if cur is not None and (cur.cause, cur.incident, cur.eviction_id) == ties \
                    and abs(cur.end - t0) <= 1e-6:  # Interval.extend, inline
                cur.end = t1
                cur.replica_seconds += x
                cur.gpu_seconds = cur.gpu_seconds + x * m \
                    if cur.gpu_seconds is not None and m else None
                continue
            if cur is not None:
                self._close_interval(cur)
            open_iv[key] = Interval(t0, t1, g, r.cause, x, x * m if m else None, r.incident,
                                    r.finding_id, r.eviction_id)

    def _close_interval(self, iv: Interval) -> None:
        self.intervals.append(iv)
        self._closed_intervals.append(iv)

    def _publish_ratios(self, acct: SweepAccount) -> None:
        S = self.slots
        order = np.asarray(self._row_order[False], np.int64)
        groups = order[order > 0]  # not UNSEEN's row
        exp = S.exp[groups]
        with_time = exp != 0
        ratios = (S.good[groups][with_time] / exp[with_time]).tolist()
        acct.group_goodput_ratio = dict(zip(map(S.gids.__getitem__, groups[with_time].tolist()),
                                            ratios, strict=True))
        acct.job_goodput_ratio = self.job_ratio()

    # --- reading ---------------------------------------------------------------------
    def job_ratio(self) -> float | None:
        order = self._row_order[False]
        expected = sum(self.slots.exp[order].tolist(), 0.0)  # the rows' order, one by one
        good = sum(self.slots.good[order].tolist(), 0.0)
        return good / expected if expected > 0 else None

    @property
    def totals(self) -> dict[str, dict[str, float]]:
        """The settled totals by row key (a group, or ``UNSEEN``): goodput, expected and
        badput by cause, replica-seconds; made from the columns (a copy)."""
        return self._totals_rows()

    @property
    def gpu_totals(self) -> dict[str, dict[str, float]]:
        """:attr:`totals` in GPU-seconds (rows of slots with a known group world size)."""
        return self._totals_rows(gpu=True)

    def _totals_rows(self, gpu: bool = False) -> dict[str, dict[str, float]]:
        S = self.slots
        good, exp, bad, has = (S.ggood, S.gexp, S.gbad, S.gbad_has) if gpu else \
            (S.good, S.exp, S.bad, S.bad_has)
        order = self._row_order[gpu]
        rows = {}
        for key, g, e, b, h in zip(self._rows[gpu], good[order].tolist(), exp[order].tolist(),
                                   bad[order].tolist(), has[order].tolist(), strict=True):
            row = dict(compress(zip(CAUSES, b, strict=True), h)) if any(h) else {}
            row["goodput"], row["expected"] = g, e
            rows[key] = row
        return rows

    def _live_totals(self) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
        """Settled totals plus the unsettled slices (pending as its own key)."""
        rows = self._totals_rows()
        gpu = self._totals_rows(gpu=True)
        for s in self.unsettled:  # (the API's: a slice each is fine here)
            key = self._key(s.replica_group)
            rows.setdefault(key, {})[s.cause] = rows.get(key, {}).get(s.cause, 0.0) + s.seconds
            if s.gpus:
                gpu.setdefault(key, {})[s.cause] = gpu.get(key, {}).get(s.cause, 0.0) \
                    + s.seconds * s.gpus
        return rows, gpu

    @staticmethod
    def _summary(rows: list[dict[str, float]]) -> dict[str, Any]:
        expected = sum(r.get("expected", 0.0) for r in rows)
        good = sum(r.get("goodput", 0.0) for r in rows)
        return {"goodput_ratio": round(good / expected, 4) if expected > 0 else None,
                "goodput_seconds": round(good, 3),
                "expected_seconds": round(expected, 3),
                "badput_seconds": {c: round(sum(r.get(c, 0.0) for r in rows), 3)
                                   for c in CAUSES},
                "pending_seconds": round(sum(r.get(PENDING, 0.0) for r in rows), 3)}

    def incident_json(self, inc: Incident) -> dict[str, Any]:
        cost = dict(inc.cost)
        gpu, gpu_known = inc.gpu_cost, inc.gpu_cost_known
        for r in self._runs:
            if r.incident != inc.id:
                continue
            for x, m in zip(r.seconds, r.gpus, strict=True):
                cost[r.cause] = cost.get(r.cause, 0.0) + x
                if m:
                    gpu += x * m
                else:
                    gpu_known = False
        total = sum(cost.values())

        def since_onset(t: float | None) -> float | None:
            return round(t - inc.onset_at, 3) if t is not None else None

        return {
            "id": inc.id, "kind": inc.kind, "replica_group": inc.replica_group,
            "replica_id": inc.replica_id, "ranks": inc.ranks, "finding_ids": inc.finding_ids,
            "eviction_id": inc.eviction_id, "open": inc.open,
            "onset_at": inc.onset_at, "onset_source": inc.onset_source,
            "detected_at": inc.detected_at, "evicted_at": inc.evicted_at,
            "resolved_at": inc.resolved_at, "back_to_pace_at": inc.back_to_pace_at,
            "back_to_pace": None if inc.back_to_pace_at is None
            else "settled" if inc.settled_pace is not None else "reached",
            "settled_pace": inc.settled_pace, "settled_step_s": inc.settled_step_s,
            "rejoined_at": inc.rejoined_at, "closed_at": inc.closed_at,
            "detect_s": since_onset(inc.detected_at), "evict_s": since_onset(inc.evicted_at),
            "recovery_s": since_onset(inc.back_to_pace_at),
            "rejoin_s": since_onset(inc.rejoined_at),
            "gpus_per_group": inc.gpus_per_group,
            "cost": {"replica_seconds": round(total, 3),
                     "by_cause": {k: round(v, 3) for k, v in sorted(cost.items())},
                     "gpu_seconds": round(gpu, 3) if gpu_known and total > 0 else
                     (0.0 if total == 0 else None),
                     # the group-steps that time holds at the healthy pace
                     "group_steps": round(total / self.baseline, 1)
                     if self.baseline else None},
        }

    def intervals_json(self, limit: int = 200) -> list[dict[str, Any]]:
        """Newest first: unsettled slices merged on the fly, then the settled intervals."""
        merged: dict[str, Interval] = {}
        out: list[Interval] = []
        for s in sorted(self.unsettled, key=lambda s: (s.t0, self._key(s.replica_group))):
            key = self._key(s.replica_group)
            cur = merged.get(key)
            if cur is not None and cur.extend(s):
                continue
            merged[key] = Interval.of(s, settled=False)
            out.append(merged[key])
        rows = list(self.intervals) + list(self.open_intervals.values()) + out
        rows.sort(key=lambda iv: (iv.end, iv.start), reverse=True)
        return [iv.to_dict() for iv in rows[:limit]]

    def to_json(self, incidents: int = 50, intervals: int = 200) -> dict[str, Any]:
        """``GET /v1/goodput``: the job, each group, incidents and intervals (newest first)."""
        rows, gpu = self._live_totals()
        job = self._summary(list(rows.values()))
        job["gpu_seconds"] = self._summary(list(gpu.values())) if gpu else None
        if job["gpu_seconds"]:
            job["gpu_seconds"].pop("goodput_ratio", None)
        groups = []
        for key in sorted(rows, key=lambda k: (k == UNSEEN, int(k) if k != UNSEEN else 0)):
            row = self._summary([rows[key]])
            slot = self.slots.index.get(int(key)) if key != UNSEEN else None
            row.update(replica_group=None if key == UNSEEN else int(key),
                       **self._group_fields(slot))
            groups.append(row)
        incs = sorted(self.incidents.values(), key=lambda i: i.id, reverse=True)[:incidents]
        return {
            "since": self.since, "at": self.last_at,
            "wall_seconds": round(self.last_at - self.since, 3) if self.since is not None
            and self.last_at is not None else 0.0,
            "unobserved_seconds": round(self.unobserved_s, 3),
            "gaps": self.gaps, "gap_seconds": round(self.gap_s, 3),
            "skipped_sweeps": self.skipped_sweeps,
            "expected_groups": self.expected_groups,
            "expected_groups_source": "flag" if self.cfg.expected_groups else "max_seen",
            "baseline": {"step_seconds": round(self.baseline, 4) if self.baseline else None,
                         "samples": len(self.baseline_samples),
                         "window_samples": self.cfg.baseline_samples,
                         "frozen": self.baseline_frozen()},
            "pace": {"ratio": round(self.pace, 3) if self.pace is not None else None,
                     "threshold": self.cfg.pace_threshold, "window_s": round(self.window, 3)},
            "horizon_s": round(self.horizon, 3),
            "job": job,
            "groups": groups,
            "incidents": [self.incident_json(i) for i in incs],
            "intervals": self.intervals_json(intervals),
        }

    def _group_fields(self, slot: int | None) -> dict[str, Any]:
        S = self.slots
        if slot is None:
            return {"replica_id": None, "gpus": None, "last_in_quorum_at": None}
        at = float(S.last_in_quorum_at[slot])
        return {"replica_id": S.rid[slot], "gpus": int(S.gpus[slot]) or None,
                "last_in_quorum_at": None if math.isnan(at) else at}

    def baseline_frozen(self) -> str | None:
        """Why the baseline takes no samples now (None: it does)."""
        opened = [i.id for i in self._open_incidents() if i.settled_pace is None]
        if opened and self.baseline is not None:
            return f"incident {opened[-1]} open"
        young = len(self.baseline_samples) < self.cfg.baseline_samples // 4
        if not young and self.slow_since is not None and self.last_at is not None \
                and self.last_at - self.slow_since < self.horizon:
            return "unexplained slowness, waiting for an explanation"
        return None

    # --- persistence -----------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The state a restarted monitor resumes from (incidents and settled intervals are
        stored apart, see :meth:`unsaved`). Per-group state and totals are columns, one list
        per field (:func:`snapshot_rows` gives version 1's per-group dicts): at 12,500 groups
        the dicts were 0.07 s to build and 6 MB of JSON, written from the sweep's thread."""
        return {
            "version": SNAPSHOT_VERSION, "since": self.since, "last_at": self.last_at,
            "groups": self._groups_snapshot(),
            "job_step": self.job_step, "job_history": list(self.job_history)[-1:],
            "baseline_samples": list(self.baseline_samples), "baseline": self.baseline,
            "pace": self.pace, "slow_since": self.slow_since, "last_commit_at": self.last_commit_at,
            "steady": list(self.steady) if self.steady else None,
            "totals": self._totals_columns(), "gpu_totals": self._totals_columns(gpu=True),
            "expected_groups": self.expected_groups, "unobserved_s": self.unobserved_s,
            "gap_s": self.gap_s, "gaps": self.gaps, "skipped_sweeps": self.skipped_sweeps,
            "goodput_debt": self.goodput_debt,
            # flat dataclasses of scalars: their __dict__ is asdict() without its deep copy
            # a run's fields, its lists as they are (a slice a dict was ~6 us and 180 bytes
            # a group, every group's while the job is slow or stalled)
            "unsettled": [{k: v for k, v in vars(r).items() if k != "slots"}
                          for r in self._runs],
            # one open interval a group (every group's startup, at first): columns by field
            "open_intervals": {"key": list(self.open_intervals), **{
                f: list(map(attrgetter(f), self.open_intervals.values()))
                for f in _INTERVAL_FIELDS}},
            "next_incident": self.next_incident,
            "seen_evictions": sorted(self.seen_evictions)[-1000:],
        }

    def _groups_snapshot(self) -> dict[str, Any]:
        """Every group's slot as columns: ``commits`` -1 and ``gpus`` 0 are none, as in the
        slots; ``history_cum`` is the group's count at the one history sample ``history_t``
        (None: its history starts after it)."""
        S, hist = self.slots, self.hist
        n = len(S)
        last_in = S.last_in_quorum_at[1:]
        never = np.isnan(last_in)
        newest = hist.cum[-1][1:n] if hist.cum else np.zeros(0, np.int64)
        sampled = S.born[1:1 + len(newest)] < hist.next
        return {
            "gid": S.gids[1:], "replica_id": S.rid[1:], "commits": S.commits[1:].tolist(),
            "cum": S.cum[1:].tolist(), "gpus": S.gpus[1:].tolist(),
            "last_in_quorum_at": _with_none(last_in, never),
            "history_t": hist.t[-1] if hist.t else None,
            "history_cum": _with_none(newest, ~sampled) + [None] * (n - 1 - len(newest)),
        }

    def _totals_columns(self, gpu: bool = False) -> dict[str, Any]:
        """:meth:`_totals_rows` as columns: a cause's list holds None where a row has none
        (a cause no row has is left out)."""
        S = self.slots
        good, exp, bad, has = (S.ggood, S.gexp, S.gbad, S.gbad_has) if gpu else \
            (S.good, S.exp, S.bad, S.bad_has)
        order = self._row_order[gpu]
        out: dict[str, Any] = {"key": list(self._rows[gpu]), "goodput": good[order].tolist(),
                               "expected": exp[order].tolist()}
        b, h = bad[order], has[order]
        for c, cause in enumerate(CAUSES):
            if h[:, c].any():
                out[cause] = _with_none(b[:, c], ~h[:, c])
        return out

    def unsaved(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Incidents changed and intervals closed since :meth:`saved` (for the store, with
        :meth:`snapshot`)."""
        incs = [self.incidents[i].to_store() for i in sorted(self._dirty_incidents)
                if i in self.incidents]
        return incs, [dict(vars(iv)) for iv in self._closed_intervals]

    def saved(self) -> None:
        """What :meth:`unsaved` returned is stored: forget it (and closed incidents beyond
        ``keep_incidents``, which the store keeps)."""
        self._dirty_incidents.clear()
        self._closed_intervals = []
        self._forget_old_incidents()

    def _forget_old_incidents(self) -> None:
        closed = sorted((i for i in self.incidents.values() if not i.open), key=lambda i: i.id)
        for inc in closed[:max(0, len(closed) - self.cfg.keep_incidents)]:
            if not any(r.incident == inc.id for r in self._runs):
                del self.incidents[inc.id]

    @classmethod
    def restore(cls, cfg: GoodputConfig | None, state: dict[str, Any] | None,
                incidents: list[dict[str, Any]], intervals: list[dict[str, Any]]
                ) -> GoodputLedger:
        """A ledger resuming from what :meth:`snapshot` and :meth:`unsaved` stored (a version-1
        snapshot, written before per-group columns, too). A snapshot of another version is not
        resumed (a fresh ledger starts; the old rows stay stored)."""
        led = cls(cfg)
        runs = state.get("unsettled") if state and state.get("version") == 3 else None
        state = snapshot_rows(state)
        if not state or state.get("version") != 1:
            return led
        led.since, led.last_at = state.get("since"), state.get("last_at")
        groups = state.get("groups") or {}
        S = led.slots
        S.add([int(g) for g in groups], 0)
        # each group's newest history sample: one sample of the shared axis (a group stored
        # without one, or with an older one, starts its history at the next sweep)
        newest = {tuple(d["history"][-1]) for d in groups.values() if d.get("history")}
        t = max(x[0] for x in newest) if newest else None
        if t is not None:
            led.hist.t.append(t)
            led.hist.cum.append(np.zeros(len(S), np.int64))
        for slot, d in enumerate(groups.values(), 1):
            S.rid[slot] = d.get("replica_id")
            S.commits[slot] = _stored_count(d.get("commits"), -1)
            S.cum[slot] = _stored_count(d.get("cum"), 0)
            S.gpus[slot] = _stored_count(d.get("gpus"), 0)
            at = d.get("last_in_quorum_at")
            S.last_in_quorum_at[slot] = np.nan if at is None else at
            h = d.get("history")
            if h and h[-1][0] == t:
                led.hist.cum[0][slot] = _stored_count(h[-1][1], 0)
            else:
                S.born[slot] = led.hist.next
        led.job_step = state.get("job_step")
        led.job_history.extend(tuple(x) for x in state.get("job_history") or [])
        led.baseline_samples.extend(state.get("baseline_samples") or [])
        led.baseline = state.get("baseline")
        led.slow_since = state.get("slow_since")
        led.pace = state.get("pace")
        led.last_commit_at = state.get("last_commit_at")
        steady = state.get("steady")
        led.steady = (float(steady[0]), int(steady[1])) if steady else None
        for gpu, rows in ((False, state.get("totals")), (True, state.get("gpu_totals"))):
            good, exp = (S.ggood, S.gexp) if gpu else (S.good, S.exp)
            for key, row in (rows or {}).items():
                if key != UNSEEN and int(key) not in S.index:
                    S.add([int(key)], led.hist.next)
                    good, exp = (S.ggood, S.gexp) if gpu else (S.good, S.exp)
                slot = 0 if key == UNSEEN else S.index[int(key)]
                led._row(slot, key, gpu)
                bad, has = (S.gbad, S.gbad_has) if gpu else (S.bad, S.bad_has)
                for cause, v in row.items():
                    if cause in _CAUSE:  # goodput and expected below
                        bad[slot, _CAUSE[cause]], has[slot, _CAUSE[cause]] = v, True
                good[slot], exp[slot] = row.get("goodput", 0.0), row.get("expected", 0.0)
        led.expected_groups = int(state.get("expected_groups") or 0)
        led.unobserved_s = float(state.get("unobserved_s") or 0.0)
        led.gap_s = float(state.get("gap_s") or 0.0)
        led.gaps = int(state.get("gaps") or 0)
        led.skipped_sweeps = int(state.get("skipped_sweeps") or 0)
        led.goodput_debt = float(state.get("goodput_debt") or 0.0)
        if runs is None:  # stored slice by slice (version 1 or 2): a run of one each
            runs = [{"counted": d.get("cause") != PENDING,
                     **{k: v for k, v in d.items() if k not in _RUN_LISTS},
                     **{r: [d[f]] for f, r in _RUN_LISTS.items()}}
                    for d in state.get("unsettled") or []]
        for d in runs:
            new = [g for g in d["groups"] if g is not None and g not in S.index]
            if new:  # (a group's totals row came without it)
                S.add(list(dict.fromkeys(new)), led.hist.next)
            slots = np.fromiter((S.index[g] if g is not None else 0 for g in d["groups"]),
                                np.int64, len(d["groups"]))
            led._runs.append(_Run(slots=slots, **d))
        led.open_intervals = {k: Interval(**v) for k, v in
                              (state.get("open_intervals") or {}).items()}
        led.next_incident = int(state.get("next_incident") or 1)
        led.seen_evictions = set(state.get("seen_evictions") or [])
        for d in incidents:
            inc = Incident.from_store(d)
            led.incidents[inc.id] = inc
            led.next_incident = max(led.next_incident, inc.id + 1)
        led.intervals.extend(Interval(**iv) for iv in intervals)
        return led
