"""The demo's scenario: which faults, where, when, and how long each stage may take.

The default story (faults on single ranks): healthy for ``healthy_s`` -> ``slow_compute`` on
the last rank of group 1 -> detected -> evicted -> restarted -> rejoined -> an in-group ``hang``
(``where=group``) on the last rank of group 2 -> ... -> on namespaced hosts, a ``partition`` of
group 0's host -> ... -> healthy for ``end_s``. The demo injects
these into the running rank. ``--inject GROUP[.RANK]:SPEC`` replaces them with faults given to
the group when it starts. Every stage has a deadline (:mod:`lightkeeper.faulttrack`): a stage
that never happens ends that fault's story with what it has.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice


@dataclass(frozen=True)
class FaultPlan:
    """One fault of the scenario: where it strikes and what it is."""

    replica_group: int
    kind: str                      # the trainer's fault kind: slow, slow_compute, hang, ...
    spec: str | None = None        # the whole spec, given at start (--inject); None: the demo
    #                                writes it (steps relative to the running job) when it injects
    group_rank: int | None = None  # the one group rank it strikes; None: every rank of the group

    @property
    def at_start(self) -> bool:
        return self.spec is not None


@dataclass
class Scenario:
    faults: list[FaultPlan] = field(default_factory=list)
    healthy_s: float = 8.0         # healthy phase before the first fault (the baseline rate)
    end_s: float = 3.0             # healthy phase after the last fault (the ledger's wait
    #                                after it holds the run for one whole pace window after the
    #                                last eviction; this only shows the pace, ~15 steps)
    ledger_wait_s: float = 30.0    # after a story (and the healthy end), at most this long
    #                                for the monitor's ledger to see the job back at pace
    slow_delay_s: float = 0.6      # slow_compute:delay= of the default straggler rank
    hang_in_steps: int = 4         # hang:at_step = current step + this
    strike_timeout_s: float = 30.0  # armed -> struck, plus 2 s per step still to go
    detect_timeout_s: float = 60.0  # strike -> detection
    evict_timeout_s: float = 30.0   # detection -> eviction (a hold that does not lift)
    rejoin_timeout_s: float = 120.0  # eviction -> group back in the quorum
    step_pause_s: float = 0.1      # trainer --step-pause (keeps 2 cores breathing)
    pg_timeout_s: float = 20.0
    quorum_timeout_s: float = 60.0  # trainer --quorum-timeout (torchft Manager)
    # torchft Lighthouse: how long a replica may go without a heartbeat before it is dead, and
    # how long a quorum waits for heartbeating replicas that have not asked to join. After an
    # eviction the survivors' next quorum waits for the shorter of the two (docs/demo.md).
    heartbeat_timeout_ms: int = 1000  # docs/lighthouse.md: no false drop in 10 healthy min
    join_timeout_ms: int = 5000
    hang_floor_s: float = 1.0      # monitor --hang-floor: a hang is >= this many s without progress
    warm_spares: bool = True       # the supervisor keeps one started, imported spare per group


def default_faults(groups: int, ranks_per_group: int,
                   network: bool = False) -> list[FaultPlan]:
    """slow_compute on one rank of group 1, then hang on one rank of group 2 (group 1 again
    with two groups). The last rank of the group: not rank 0, which also runs the group's
    torchft Manager, so the culprit is not the rank a guess would name. With ``network``
    (namespaced hosts) and three groups or more, then a ``partition`` of group 0's host: it
    still reaches the Lighthouse and the monitor, not its peers."""
    if groups < 2:
        return []
    rank = ranks_per_group - 1
    plans = [FaultPlan(1, "slow_compute", group_rank=rank),
             FaultPlan(2 if groups > 2 else 1, "hang", group_rank=rank)]
    if network and groups > 2:
        plans.append(FaultPlan(0, "partition"))
    return plans


def parse_inject(value: str, groups: int, ranks_per_group: int) -> FaultPlan:
    """``GROUP[.RANK]:SPEC`` -> a FaultPlan given to GROUP at start; ValueError naming the problem.

    SPEC is the trainer's ``--inject`` (``trainer/faults.py``). ``.RANK`` places the fault on
    that group rank (the spec's ``rank=``; both may be given when they agree); without either,
    every rank of the group (``where=group`` needs one: on every rank it does nothing). The
    placement is checked against ``groups`` x ``ranks_per_group``.
    """
    import re

    from trainer.faults import FaultSpecError, check_fits_group, parse_fault

    placement, sep, spec = value.partition(":")
    m = re.fullmatch(r"\s*(\d+)(?:\.(\d+))?\s*", placement)
    if not sep or not m:
        raise ValueError(f"--inject {value!r}: expected GROUP[.RANK]:SPEC, e.g. "
                         "1:slow:delay=0.5,from_step=40 or 1.1:slow_compute:factor=3")
    group = int(m.group(1))
    rank = None if m.group(2) is None else int(m.group(2))
    if group >= groups:
        raise ValueError(f"--inject {value!r}: group {group} is out of range: the demo runs "
                         f"{groups} replica groups (0..{groups - 1}; --groups)")
    if rank is not None and rank >= ranks_per_group:
        raise ValueError(f"--inject {value!r}: rank {rank} is out of range: each group has "
                         f"{ranks_per_group} rank{'s' if ranks_per_group > 1 else ''} "
                         f"(0..{ranks_per_group - 1}; --ranks-per-group)")
    try:
        fault = parse_fault(spec)
        if fault.network and rank is not None:
            raise FaultSpecError(f"{fault.kind} strikes the group's host, every rank on it: "
                                 f"give GROUP, not GROUP.RANK")
        if rank is not None and fault.rank is not None and fault.rank != rank:
            raise FaultSpecError(f"the placement says rank {rank}, the spec rank={fault.rank}")
        if rank is not None and fault.rank is None:
            fault = parse_fault(f"{fault.spec},rank={rank}")
        check_fits_group(fault, ranks_per_group)
    except FaultSpecError as e:
        raise ValueError(f"--inject {value!r}: {e}") from None
    return FaultPlan(group, fault.kind, fault.spec, fault.rank)


RANK_KINDS = ("slow_compute", "hang", "mismatch", "crash")  # strike one rank of the group


SOAK_FIRST = 60  # kinds the schedule draws up front (a seed's schedule depends on it)


def soak_schedule(seed: int, groups: int, ranks_per_group: int,
                  network: bool) -> Iterator[FaultPlan]:
    """A seeded random schedule for ``--soak``, endless: every kind of the grammar once first
    (in a random order, so a short soak still sees each), then kinds drawn at random; each on a
    random group, and a random rank for the kinds that strike one rank. Network kinds need
    ``network``. The demo injects them one at a time until the soak's time is up: its time,
    not the schedule, ends it."""
    import random

    from trainer.faults import KINDS, NETWORK_KINDS

    rng = random.Random(seed)
    kinds = list(KINDS) + (list(NETWORK_KINDS) if network else [])

    def plan(kind: str) -> FaultPlan:
        rank = rng.randrange(ranks_per_group) if kind in RANK_KINDS else None
        return FaultPlan(rng.randrange(groups), kind, group_rank=rank)

    # SOAK_FIRST kinds drawn up front, as when the schedule was a list of them: seeds repeat
    for kind in rng.sample(kinds, len(kinds)) + [rng.choice(kinds) for _ in range(SOAK_FIRST)]:
        yield plan(kind)
    while True:
        yield plan(rng.choice(kinds))


class Schedule(list[FaultPlan]):
    """The first faults of an endless schedule, listed (what is checked and shown before the
    run); ``rest`` draws those after them, for the demo to go on with."""

    def __init__(self, first: Iterable[FaultPlan], rest: Iterator[FaultPlan]) -> None:
        super().__init__(first)
        self.rest = rest


def soak_faults(seed: int, groups: int, ranks_per_group: int, network: bool,
                count: int = SOAK_FIRST) -> Schedule:
    """The first ``count`` faults of :func:`soak_schedule`, and the rest of it."""
    plans = soak_schedule(seed, groups, ranks_per_group, network)
    return Schedule(islice(plans, count), plans)
