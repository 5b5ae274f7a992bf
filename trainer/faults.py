"""Fault injection for tests and the demo: ``--inject SPEC`` and ``POST /v1/faults``.

Grammar (one fault per ``--inject``; repeat the flag for several)::

    SPEC   := KIND ":" PARAMS
    PARAMS := KEY "=" VALUE ("," KEY "=" VALUE)*

    slow:delay=S[,from_step=N]           sleep S seconds before every cross-group all_reduce from
                                         step N on (default 0): the whole group arrives late
    slow_compute:factor=F[,from_step=N]  the rank computes F times slower (F > 1): after each
    slow_compute:delay=S[,from_step=N]   forward pass it sleeps (F-1) x its measured compute time
                                         (this forward + the last backward), or S seconds, as a
                                         throttled GPU would (on CUDA the time is spent on the
                                         GPU, by a kernel that only spins; the host goes on
                                         launching); its group peers wait for it inside
                                         FSDP's next collective, then the whole group arrives late
                                         at the cross-group all_reduce
    hang:at_step=N[,where=cross|group]   block forever at step N (the process stays alive and its
                                         group keeps heartbeating): before the cross-group
                                         all_reduce (cross, the default) or before the forward
                                         pass's first in-group FSDP all-gather (group): group peers
                                         block inside that collective, other groups in the
                                         cross-group all_reduce
    mismatch:at_step=N[,where=cross|group]
                                         at step N issue a collective unlike the peers': the
                                         cross-group all_reduce with one extra element (cross;
                                         on gloo the peers that receive the bigger message
                                         abort), or the forward pass's first in-group FSDP
                                         all-gather as integers of the same width (group: same
                                         bytes, so it completes and training is unharmed, but
                                         the Flight Recorder records another dtype)
    crash:at_step=N                      exit hard (os._exit(1)) before the cross-group all_reduce
                                         of step N

Network faults strike the group's *host*, not its processes: the job's runner (``lightkeeper
demo``, on hosts that are network namespaces: lightkeeper/fabric.py) applies them when the group
reaches the step; the trainer refuses them (a process cannot degrade its own host's link)::

    slow_link:mbit=M[,from_step=N]       the host's link runs at M Mbit/s both ways (a degraded
                                         link or NIC): every group waits on it in the
                                         cross-group all_reduce
    partition:at_step=N                  the host still reaches the control plane (Lighthouse,
                                         monitor) but not its peers (a bad switch port or route)
    host_offline:at_step=N               the host drops off the network (kernel panic, power,
                                         NIC death): its link goes down, its processes live on

    Every process kind also takes rank=R: the group rank it strikes (default: every rank of the
    group; where=group needs one, as on every rank it does nothing); a network kind strikes the
    host, and refuses rank=R.
    A process fault at step N that a rank never runs acts at the first step past N it runs when
    the rank joined the job before N (then healed past it) or was given the fault live (posted
    after N); a process that joined past N, or healed into the running job at N (a late group,
    a restart with the same --inject), says so once and never acts on it. A step whose quorum
    errored (torchft discards it and runs it again) strikes no one-off fault.
    What torchft 0.2.0 then does (one rank of a group crashed or hung, the others alive) is
    measured in the README's Trainer section.

Steps are torchft's committed step numbers (``manager.current_step()``); a ``delay`` is at most
MAX_DELAY_S (one day), and a ``factor``'s sleep is capped there. A bad spec raises
:class:`FaultSpecError` with a message that names the problem; what can only be checked against
the replica group (``rank`` out of range, ``where=group`` in a one-rank group or without
``rank``) is checked by :class:`FaultInjector`, which knows the group. Nothing is injected by
default.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

WHERE = ("cross", "group")
# The longest delay a spec may ask for, and the cap on a factor's sleep: a "slow" fault must
# slow the rank, not crash it (time.sleep raises OverflowError past threading.TIMEOUT_MAX).
MAX_DELAY_S = 86400.0

# kind -> {param: (type, required)}. A one-of pair (slow_compute's factor/delay) is checked below.
KINDS: dict[str, dict[str, tuple[type, bool]]] = {
    "slow": {"delay": (float, True), "from_step": (int, False), "rank": (int, False)},
    "slow_compute": {"factor": (float, False), "delay": (float, False),
                     "from_step": (int, False), "rank": (int, False)},
    "hang": {"at_step": (int, True), "where": (str, False), "rank": (int, False)},
    "mismatch": {"at_step": (int, True), "where": (str, False), "rank": (int, False)},
    "crash": {"at_step": (int, True), "rank": (int, False)},
}
NETWORK_KINDS: dict[str, dict[str, tuple[type, bool]]] = {
    "slow_link": {"mbit": (float, True), "from_step": (int, False)},
    "partition": {"at_step": (int, True)},
    "host_offline": {"at_step": (int, True)},
}

_EXAMPLES = {
    "slow": "slow:delay=0.5,from_step=10",
    "slow_compute": "slow_compute:factor=3,from_step=10,rank=1",
    "hang": "hang:at_step=20,where=group,rank=1",
    "mismatch": "mismatch:at_step=20",
    "crash": "crash:at_step=20,rank=1",
    "slow_link": "slow_link:mbit=20,from_step=60",  # after the monitor's healthy baseline
    "partition": "partition:at_step=20",
    "host_offline": "host_offline:at_step=20",
}


class FaultSpecError(ValueError):
    """A ``--inject`` spec that does not follow the grammar, or does not fit the replica group."""


@dataclass(frozen=True)
class Fault:
    kind: str
    spec: str
    delay: float = 0.0
    factor: float = 1.0
    from_step: int = 0
    at_step: int = -1
    where: str = "cross"
    rank: int | None = None  # group rank it strikes; None: every rank of the group
    mbit: float = 0.0

    @property
    def network(self) -> bool:
        """A fault of the group's host's network (applied by the job's runner)."""
        return self.kind in NETWORK_KINDS

    def applies(self, step: int) -> bool:
        """Whether it acts at ``step``; a one-off (``at_step``) only there, which a rank that
        heals past it, or is given it late, never sees: FaultInjector moves it on."""
        if self.kind in ("slow", "slow_compute", "slow_link"):
            return step >= self.from_step
        return step == self.at_step

    def targets(self, group_rank: int) -> bool:
        return self.rank is None or self.rank == group_rank


def parse_fault(spec: str) -> Fault:
    """Parse one spec; raise FaultSpecError naming what is wrong."""
    kind, sep, rest = spec.strip().partition(":")
    kinds = {**KINDS, **NETWORK_KINDS}
    if kind not in kinds:
        raise FaultSpecError(
            f"unknown fault kind {kind!r} in {spec!r}; expected one of {', '.join(kinds)}"
        )
    if not sep or not rest:
        raise FaultSpecError(f"fault {spec!r} has no parameters; e.g. {_EXAMPLES[kind]}")
    allowed = kinds[kind]
    values: dict[str, float | int | str] = {}
    for part in rest.split(","):
        key, eq, raw = part.partition("=")
        key, raw = key.strip(), raw.strip()
        if not eq:
            raise FaultSpecError(f"parameter {part!r} in {spec!r} is not KEY=VALUE")
        if key not in allowed:
            raise FaultSpecError(
                f"{kind} takes {', '.join(allowed)}; got unknown parameter {key!r} in {spec!r}"
            )
        if key in values:
            raise FaultSpecError(f"parameter {key!r} given twice in {spec!r}")
        values[key] = _value(key, allowed[key][0], raw, spec)
    missing = [k for k, (_, required) in allowed.items() if required and k not in values]
    if missing:
        raise FaultSpecError(f"{kind} needs {', '.join(missing)}; e.g. {_EXAMPLES[kind]}")
    if kind == "slow_compute":
        given = [k for k in ("factor", "delay") if k in values]
        if len(given) != 1:
            raise FaultSpecError(
                f"slow_compute takes factor or delay, {'not both' if given else 'one of them'}: "
                f"got {spec!r}; e.g. slow_compute:factor=3 or slow_compute:delay=0.5"
            )
        if "factor" in values and values["factor"] <= 1:
            raise FaultSpecError(
                f"factor in {spec!r} must be > 1 (how many times slower the rank computes), "
                f"got {values['factor']:g}"
            )
    if "delay" in values and not values["delay"] > 0:  # a fault that does nothing, "struck"
        raise FaultSpecError(f"delay in {spec!r} must be > 0 seconds, got {values['delay']:g}")
    if "delay" in values and values["delay"] > MAX_DELAY_S:
        raise FaultSpecError(f"delay in {spec!r} must be at most {MAX_DELAY_S:g} seconds (one "
                             f"day), got {values['delay']:g}")
    if kind == "slow_link" and values["mbit"] <= 0:
        raise FaultSpecError(f"mbit in {spec!r} must be > 0 (the link's rate in Mbit/s); a "
                             f"link that carries nothing is host_offline")
    return Fault(kind=kind, spec=spec.strip(), **values)


def _value(key: str, typ: type, raw: str, spec: str) -> float | int | str:
    if key == "where":
        if raw not in WHERE:
            raise FaultSpecError(f"where in {spec!r} must be cross or group, got {raw!r}")
        return raw
    try:
        value = typ(raw)
    except ValueError:
        raise FaultSpecError(
            f"{key} in {spec!r} must be {'a number' if typ is float else 'an integer'}, got {raw!r}"
        ) from None
    if typ is float and not math.isfinite(value):
        raise FaultSpecError(f"{key} in {spec!r} must be a finite number, got {raw!r}")
    if value < 0:
        raise FaultSpecError(f"{key} in {spec!r} must be >= 0, got {raw!r}")
    return value


def check_fits_group(fault: Fault, group_world_size: int) -> None:
    """Raise FaultSpecError when ``fault`` cannot strike a replica group of this size."""
    if fault.rank is not None and fault.rank >= group_world_size:
        raise FaultSpecError(
            f"rank={fault.rank} in {fault.spec!r} is out of range: this replica group has "
            f"{group_world_size} rank{'s' if group_world_size > 1 else ''} "
            f"(0..{group_world_size - 1})"
        )
    if fault.where == "group" and group_world_size < 2:
        raise FaultSpecError(
            f"where=group in {fault.spec!r} needs a replica group of several ranks (FSDP inside "
            f"the group); this one has 1 rank, so there is no in-group collective"
        )
    if fault.where == "group" and fault.rank is None:
        # struck on every rank, it is no fault of one: each issues the same dtype, or each
        # blocks before the all-gather, where no peer waits for it
        does = ("blocks before the all-gather, so no peer waits inside it" if fault.kind == "hang"
                else "sends the same dtype, so nothing mismatches")
        raise FaultSpecError(
            f"where=group in {fault.spec!r} needs rank=R, the one group rank it strikes: on "
            f"every rank of the group it does nothing (each {does}); e.g. "
            f"{fault.spec},rank={group_world_size - 1}"
        )


def fault_key(fault: Fault, group_world_size: int) -> Fault:
    """What ``fault`` does in a group of ``group_world_size`` ranks, for telling two faults
    apart: not its text (slow:delay=1 and slow:delay=1.0 are one fault), and in a one-rank
    group no rank and rank=0 are one (in a bigger one, no rank strikes every rank: another)."""
    rank = 0 if fault.rank is None and group_world_size == 1 else fault.rank
    return replace(fault, spec="", rank=rank)


def check_reached(fault: Fault, steps: int) -> None:
    """Raise FaultSpecError when a one-off ``fault`` is at or past the run's ``steps``: a rank
    stops once step ``steps - 1`` commits, so it would be accepted and never strike."""
    if fault.at_step >= steps:
        raise FaultSpecError(f"{fault.spec!r}: at_step {fault.at_step} is never reached: the job "
                             f"trains steps 0 to {steps - 1} (--steps {steps})")


def check_process_fault(fault: Fault) -> None:
    """Raise FaultSpecError for a network fault: the job's runner applies it to the host."""
    if fault.network:
        raise FaultSpecError(
            f"{fault.spec!r} is a network fault of the group's host: the job's runner applies "
            f"it (lightkeeper demo --inject GROUP:{fault.spec}, on namespaced hosts), not the "
            f"trainer")


class FaultInjector:
    """Applies the faults that strike this rank at their places in the step.

    Every rank of a group is given the same specs (torchrun passes the same ``--inject`` to all);
    each rank acts only on those whose ``rank`` is unset or its own ``group_rank``.
    The hooks run on the training thread and may sleep, block forever or exit the process.
    ``steps`` (the run's ``--steps``; None: unbounded) refuses a one-off fault never reached.
    A fault cannot be removed, nor posted again (``inject``) once given: equal faults share
    one strike, so a repeated one-off would never act and a repeated ``slow`` would stack.
    """

    def __init__(self, faults: list[Fault], group_rank: int = 0, group_world_size: int = 1,
                 steps: int | None = None) -> None:
        self.group_rank = group_rank
        self.group_world_size = group_world_size
        self.steps = steps
        # every fault this process was given, for any rank, by what it does (not its text:
        # slow:delay=1 and slow:delay=1.0 are one fault)
        self._given: set[Fault] = set()
        self._lock = threading.Lock()  # POST /v1/faults runs on the server's threads
        for fault in faults:
            self._check(fault)
            self._given.add(fault_key(fault, group_world_size))
        self.faults = [f for f in faults if f.targets(group_rank)]
        self._hang_forever = threading.Event()  # never set: a hang lasts until the process dies
        # Told once per fault, on the training thread, the first time it acts (before a hang
        # blocks or a crash exits), so the rank can say when it struck (/v1/state).
        self.on_strike: Callable[[Fault], None] | None = None
        self._struck: set[Fault] = set()
        # a one-off fault's step: its at_step, or the first step past it this process ran when
        # it joined the job before it (then healed past it) or was given it live (posted after
        # it); a process that joined past it, or healed into the job at it (a late group, a
        # restart by torchrun or a pod's restart policy, given the same --inject) says so once
        # and never strikes
        self._due: dict[Fault, int] = {}
        self._joined: int | None = None  # the first step this process committed
        # the step of this process's first iteration, its first quorum done: past 0, it joined
        # a running job by healing to it (a restart heals to the step its fault stopped the
        # job at, and must not strike there again)
        self._started: int | None = None
        self._discarded = False  # this step's quorum errored (started())
        self._live: set[Fault] = set()
        self._passed: set[Fault] = set()
        # how slow_compute spends its extra seconds: the host sleeps; on CUDA, gpu_stall's
        self.stretch: Callable[[float], None] = time.sleep

    def _strike(self, fault: Fault) -> None:
        if fault not in self._struck:
            self._struck.add(fault)
            if self.on_strike is not None:
                self.on_strike(fault)

    def inject(self, spec: str) -> Fault:
        """Add a fault while training runs (``POST /v1/faults``); raises FaultSpecError.

        Returns the fault; it acts only when ``fault.targets(group_rank)``."""
        fault = parse_fault(spec)
        with self._lock:
            self._check(fault)
            # a second slow would stack, a second one-off never strike
            key = fault_key(fault, self.group_world_size)
            if key in self._given:
                raise FaultSpecError(f"already injected: {fault.spec} (faults cannot be removed; "
                                     f"restart the process to clear them)")
            self._given.add(key)
            if fault.targets(self.group_rank):
                self._live.add(fault)
                # one assignment: the training thread never sees half
                self.faults = [*self.faults, fault]
        return fault

    def _check(self, fault: Fault) -> None:
        check_process_fault(fault)
        check_fits_group(fault, self.group_world_size)
        if self.steps is not None:
            check_reached(fault, self.steps)

    @property
    def specs(self) -> list[str]:
        """Specs of the faults that strike this rank."""
        return [f.spec for f in self.faults]

    def joined(self, step: int) -> None:
        """Told after each commit: ``step``, the step committed (the first one counts)."""
        if self._joined is None:
            self._joined = step

    def started(self, step: int, discarded: bool = False) -> None:
        """Told at each step once its quorum is known, before any hook: ``step`` (the first
        one not ``discarded`` counts). ``discarded``: the quorum errored, so torchft discards
        this step and runs it again; no one-off fault strikes in it."""
        self._discarded = discarded
        if self._started is None and not discarded:
            self._started = step

    def _applies(self, fault: Fault, step: int) -> bool:
        if fault.at_step < 0 or step < fault.at_step:
            return fault.applies(step)
        if self._discarded:  # strikes at the step's next run, which torchft keeps
            return False
        if fault not in self._due:
            started = self._started or 0  # past 0: healed into a running job
            if 0 < started and fault.at_step <= started:
                at: int | None = started  # joined at (or past) its step
            elif step > fault.at_step and (self._joined is None or self._joined > fault.at_step):
                at = step if self._joined is None else self._joined  # joined past it
            else:
                at = None
            if at is not None and fault not in self._live:  # struck (or passed) before this process
                if fault not in self._passed:
                    self._passed.add(fault)
                    where = "at its step" if at == fault.at_step else f"past step {fault.at_step}"
                    print(f"[lightkeeper] fault {fault.spec!r}: this process joined the job at "
                          f"step {at}, {where}: not struck", file=sys.stderr, flush=True)
                return False
            self._due[fault] = step
        return self._due[fault] == step

    def _active(self, step: int, kind: str, where: str | None = None):
        return [f for f in self.faults if f.kind == kind and self._applies(f, step)
                and (where is None or f.where == where)]

    def before_forward(self, step: int) -> None:
        """Run before the forward pass (and so before its first in-group all-gather)."""
        for fault in self._active(step, "hang", "group"):
            self._strike(fault)
            self._hang_forever.wait()

    def throttle(self, step: int, compute_s: float) -> float:
        """slow_compute: sleep after the forward pass, before backward's in-group collectives.

        ``compute_s`` is the compute time to stretch (this forward + the last backward, measured
        by the caller). Returns the seconds slept."""
        active = self._active(step, "slow_compute")
        for fault in active:
            self._strike(fault)
        extra = sum(f.delay if f.delay else (f.factor - 1.0) * max(0.0, compute_s)
                    for f in active)
        extra = min(extra, MAX_DELAY_S)  # a huge factor (or inf from it) would overflow sleep
        if extra > 0:
            self.stretch(extra)
        return extra

    def before_allreduce(self, step: int) -> None:
        """Run before this rank issues its cross-group all_reduce for ``step``: may sleep, block or exit."""
        for fault in self.faults:
            acts_here = fault.kind in ("slow", "crash") or (fault.kind, fault.where) == (
                "hang", "cross")
            if not (acts_here and self._applies(fault, step)):
                continue
            self._strike(fault)
            if fault.kind == "slow":
                time.sleep(fault.delay)
            elif fault.kind == "hang" and fault.where == "cross":
                self._hang_forever.wait()
            elif fault.kind == "crash":
                os._exit(1)

    def mismatch_at(self, step: int) -> bool:
        """Whether this rank's cross-group all_reduce of ``step`` carries one extra element."""
        return self._strikes(self._active(step, "mismatch", "cross"))

    def group_mismatch_at(self, step: int) -> bool:
        """Whether the forward of ``step`` issues its first in-group all-gather mismatched."""
        return self._strikes(self._active(step, "mismatch", "group"))

    def _strikes(self, faults: list[Fault]) -> bool:
        for fault in faults:
            self._strike(fault)
        return bool(faults)


def gpu_stall(device) -> Callable[[float], None]:
    """``stall(seconds)``: that much more work on ``device``'s current stream, a kernel that
    only spins (``torch.cuda._sleep``): the GPU is slower, its host is not, as with a throttled
    GPU. Its cycles a second are measured on the first call (a GPU shared with another process
    measures low, so the stall comes out short). If the kernel cannot be launched
    the host sleeps instead from then on, said once: the fault still slows the rank."""
    import torch

    rate: list[float] = []  # cycles a second, once measured; [0.0]: no GPU stall, host sleeps

    def stall(seconds: float) -> None:
        if rate == [0.0]:
            time.sleep(seconds)
            return
        try:
            with torch.cuda.device(device):
                if not rate:  # the fastest of 3: another process's kernels may slice in
                    probe, spans = 10_000_000, []
                    for _ in range(3):
                        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                        start.record()
                        torch.cuda._sleep(probe)
                        end.record()
                        end.synchronize()
                        spans.append(start.elapsed_time(end) / 1e3)
                    rate.append(probe / min(spans))
                torch.cuda._sleep(int(seconds * rate[0]))
        except Exception as e:  # noqa: BLE001 - a fault injector never stops the job
            print(f"[lightkeeper] slow_compute: no GPU stall ({type(e).__name__}: {e}); the "
                  "host sleeps instead", file=sys.stderr, flush=True)
            rate[:] = [0.0]
            time.sleep(seconds)

    return stall
