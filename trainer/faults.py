"""Fault injection for tests and the demo: ``--inject SPEC``.

Grammar (one fault per ``--inject``; repeat the flag for several)::

    SPEC   := KIND ":" PARAMS
    PARAMS := KEY "=" VALUE ("," KEY "=" VALUE)*

    slow:delay=SECONDS[,from_step=N]   sleep SECONDS before every cross-group all_reduce
                                       from step N on (default 0): a straggler
    hang:at_step=N                     block forever before the all_reduce of step N; the
                                       process stays alive and keeps heartbeating
    mismatch:at_step=N                 at step N, all_reduce a tensor of another shape than
                                       the peers' (one extra element): a mismatched collective
    crash:at_step=N                    exit hard (os._exit(1)) before the all_reduce of step N

Steps are torchft's committed step numbers (``manager.current_step()``). A bad spec raises
:class:`FaultSpecError` with a message that names the problem; nothing is injected by default.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

KINDS: dict[str, dict[str, tuple[type, bool]]] = {
    # kind -> {param: (type, required)}
    "slow": {"delay": (float, True), "from_step": (int, False)},
    "hang": {"at_step": (int, True)},
    "mismatch": {"at_step": (int, True)},
    "crash": {"at_step": (int, True)},
}


class FaultSpecError(ValueError):
    """A ``--inject`` spec that does not follow the grammar."""


@dataclass(frozen=True)
class Fault:
    kind: str
    spec: str
    delay: float = 0.0
    from_step: int = 0
    at_step: int = -1

    def applies(self, step: int) -> bool:
        if self.kind == "slow":
            return step >= self.from_step
        return step == self.at_step


def parse_fault(spec: str) -> Fault:
    """Parse one spec; raise FaultSpecError naming what is wrong."""
    kind, sep, rest = spec.strip().partition(":")
    if kind not in KINDS:
        raise FaultSpecError(
            f"unknown fault kind {kind!r} in {spec!r}; expected one of {', '.join(KINDS)}"
        )
    if not sep or not rest:
        raise FaultSpecError(f"fault {spec!r} has no parameters; e.g. {_example(kind)}")
    allowed = KINDS[kind]
    values: dict[str, float | int] = {}
    for part in rest.split(","):
        key, eq, raw = part.partition("=")
        key = key.strip()
        if not eq:
            raise FaultSpecError(f"parameter {part!r} in {spec!r} is not KEY=VALUE")
        if key not in allowed:
            raise FaultSpecError(
                f"{kind} takes {', '.join(allowed)}; got unknown parameter {key!r} in {spec!r}"
            )
        if key in values:
            raise FaultSpecError(f"parameter {key!r} given twice in {spec!r}")
        typ = allowed[key][0]
        try:
            value = typ(raw.strip())
        except ValueError:
            raise FaultSpecError(
                f"{key} in {spec!r} must be {'a number' if typ is float else 'an integer'}, got {raw!r}"
            ) from None
        if value < 0 or (typ is float and value != value):
            raise FaultSpecError(f"{key} in {spec!r} must be >= 0, got {raw!r}")
        values[key] = value
    missing = [k for k, (_, required) in allowed.items() if required and k not in values]
    if missing:
        raise FaultSpecError(f"{kind} needs {', '.join(missing)}; e.g. {_example(kind)}")
    return Fault(kind=kind, spec=spec.strip(), **values)


def _example(kind: str) -> str:
    return {
        "slow": "slow:delay=0.5,from_step=10",
        "hang": "hang:at_step=20",
        "mismatch": "mismatch:at_step=20",
        "crash": "crash:at_step=20",
    }[kind]


class FaultInjector:
    """Applies parsed faults at the cross-group all_reduce of each step."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = list(faults)
        self._hang_forever = threading.Event()  # never set: a hang lasts until the process dies

    def inject(self, spec: str) -> Fault:
        """Add a fault while training runs (from ``POST /v1/faults``); raises FaultSpecError."""
        fault = parse_fault(spec)
        self.faults = [*self.faults, fault]  # one assignment: the training thread never sees half
        return fault

    @property
    def specs(self) -> list[str]:
        return [f.spec for f in self.faults]

    def before_allreduce(self, step: int) -> None:
        """Run before this rank issues its all_reduce for ``step``: may sleep, block or exit."""
        for fault in self.faults:
            if not fault.applies(step):
                continue
            if fault.kind == "slow":
                time.sleep(fault.delay)
            elif fault.kind == "hang":
                self._hang_forever.wait()
            elif fault.kind == "crash":
                os._exit(1)

    def mismatch_at(self, step: int) -> bool:
        return any(f.kind == "mismatch" and f.applies(step) for f in self.faults)
