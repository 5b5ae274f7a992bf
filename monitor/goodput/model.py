"""The goodput ledger's settings, causes and records (docs/goodput.md defines them)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from monitor.evidence.verification import as_int

CAUSES = ("straggler_drag", "stall", "recovery", "capacity_lost", "startup", "unattributed")
PENDING = "pending"  # slow time nothing explains yet (settles within the horizon)
UNSEEN = "unseen"  # the totals key of an expected group never seen
SNAPSHOT_VERSION = 3
JOB_RESTART_STEPS = 100  # the job's newest step falling this far: it started over
HUGE = 1 << 53  # a count from this on is not one (a float holds any below it exactly)


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


@dataclass(eq=False)
class Run:
    """Unsettled badput of one sweep for groups sharing all but their seconds and world sizes,
    claimed and settled as one (benchmarks/bench_ledger_incident.py)."""

    t0: float
    t1: float
    slots: np.ndarray  # int64, one per group (0: a slot never seen)
    groups: list[int | None]
    seconds: list[float]
    gpus: list[int | None]
    cause: str
    incident: int | None = None
    finding_id: int | None = None
    eviction_id: int | None = None
    idle: bool = False  # no group committed in it
    counted: bool = False  # in a SweepAccount's badput already (else when it settles)

    def part(self, mask: np.ndarray) -> Run:
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
    def of(cls, r: Run, g: int | None, x: float, m: int | None, settled: bool = True
           ) -> Interval:
        return cls(r.t0, r.t1, g, r.cause, x, x * m if m else None, r.incident, r.finding_id,
                   r.eviction_id, settled)

    def extend(self, r: Run, x: float, m: int | None) -> bool:
        """Append a group's ``x`` seconds of ``r``; False if they do not continue this one."""
        if (r.cause, r.incident, r.eviction_id) != (self.cause, self.incident, self.eviction_id) \
                or abs(self.end - r.t0) > 1e-6:
            return False
        self.end = r.t1
        self.replica_seconds += x
        self.gpu_seconds = self.gpu_seconds + x * m if self.gpu_seconds is not None and m \
            else None
        return True

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("start", "end", "replica_seconds", "gpu_seconds"):
            if d[k] is not None:
                d[k] = round(d[k], 3)
        return d


INTERVAL_FIELDS = tuple(Interval.__dataclass_fields__)


@dataclass
class Incident:
    """One faulty replica group incarnation (or job-wide fault), from onset to closed."""

    id: int
    kind: str
    replica_group: int | None
    replica_id: str | None
    ranks: list[int]
    onset_at: float
    onset_source: str  # faults_struck_at | first_seen | eviction | job_wide
    detected_at: float
    finding_ids: list[int] = field(default_factory=list)
    eviction_id: int | None = None
    evicted_at: float | None = None
    resolved_at: float | None = None  # its finding is no longer open
    back_to_pace_at: float | None = None
    # back "settled" below pace: the pace in units of the old baseline, the new step time
    settled_pace: float | None = None
    settled_step_s: float | None = None
    superseded_by: int | None = None  # the incident whose confirmation ended its recovery
    rejoined_at: float | None = None
    closed_at: float | None = None
    gpus_per_group: int | None = None
    cost: dict[str, float] = field(default_factory=dict)  # settled replica-seconds by cause
    gpu_cost: float = 0.0  # settled GPU-seconds
    gpu_cost_known: bool = True  # every settled slice had a known world size
    closed_step_s: float | None = None  # the baseline it closed with: its group-steps' unit

    @property
    def open(self) -> bool:
        return self.closed_at is None

    @property
    def search_from(self) -> float:
        """Back at pace is looked for from here: the eviction, else the detection."""
        return self.evicted_at if self.evicted_at is not None else self.detected_at

    @property
    def waiting(self) -> bool:
        """Acted on (evicted or cleared) and not yet back at pace."""
        return self.open and self.back_to_pace_at is None and (
            self.evicted_at is not None or self.resolved_at is not None)

    def charge(self, r: Run) -> None:
        """Add the badput of ``r`` (tied to this incident) to its cost."""
        self.cost[r.cause] = sum(r.seconds, self.cost.get(r.cause, 0.0))
        for x, m in zip(r.seconds, r.gpus, strict=True):
            if m:
                self.gpu_cost += x * m
            else:
                self.gpu_cost_known = False

    def to_store(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_store(cls, d: dict[str, Any]) -> Incident:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass
class SweepAccount:
    """What one update added: the seconds the metrics count (pending time once it settles)."""

    accounted: bool = False
    expected_groups: int = 0
    goodput: float = 0.0
    badput: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    group_goodput_ratio: dict[int, float] = field(default_factory=dict)
    job_goodput_ratio: float | None = None


# a rank's state is read without trusting its types: odd values are None, never raised
def as_float(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def as_ints(v: Any) -> list[int]:
    return [x for x in v if as_int(x) is not None] if isinstance(v, list) else []
