"""The demo's scenario: which faults, when, and how long each stage may take.

The default story: healthy for ``healthy_s`` -> ``slow`` in group 1 -> detected -> evicted ->
restarted -> rejoined -> ``hang`` in group 2 -> ... -> healthy for ``end_s``. Every stage has a
deadline: a stage that never happens ends that fault (and the demo moves on) with what it has.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FaultPlan:
    replica_group: int
    kind: str                      # "slow" / "hang" (injected live) or "spec" (at start)
    spec: str | None = None        # the trainer's --inject spec when given by the user


@dataclass
class Scenario:
    faults: list[FaultPlan] = field(default_factory=list)
    healthy_s: float = 20.0        # healthy phase before the first fault
    end_s: float = 15.0            # healthy phase after the last fault
    slow_delay_s: float = 0.6      # slow:delay= of the default straggler
    hang_in_steps: int = 4         # hang:at_step = current step + this
    detect_timeout_s: float = 60.0  # injection -> detection
    evict_timeout_s: float = 30.0   # detection -> eviction (dry run: how long to watch)
    rejoin_timeout_s: float = 120.0  # eviction -> group back in the quorum
    step_pause_s: float = 0.1      # trainer --step-pause (keeps 2 cores breathing)
    pg_timeout_s: float = 20.0


def default_faults(groups: int) -> list[FaultPlan]:
    """slow into group 1, then hang into group 2 (wrapping around when there are fewer)."""
    if groups < 2:
        return []
    return [FaultPlan(1 % groups, "slow"), FaultPlan(2 % groups if groups > 2 else 1, "hang")]


def parse_inject(value: str) -> FaultPlan:
    """``GROUP:SPEC`` (SPEC as the trainer's ``--inject``) -> a FaultPlan; ValueError if bad."""
    from trainer.faults import parse_fault

    group, sep, spec = value.partition(":")
    if not sep or not group.strip().isdigit():
        raise ValueError(f"--inject {value!r}: expected GROUP:SPEC, e.g. 1:slow:delay=0.5")
    parse_fault(spec)  # raises FaultSpecError (a ValueError) naming the problem
    return FaultPlan(int(group), "spec", spec)
