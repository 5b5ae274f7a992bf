"""Clock-free evidence of who waits for whom: per step, how long this rank computed and how long
it waited inside collectives, measured on its own monotonic clock.

Comparing when different ranks *enqueued* a collective compares different hosts' clocks. What a
rank measures about itself needs no clock sync: the rank everyone waits for is the one that waits
least in-group, and the group that waits least at the cross-group all_reduce is the slow group.

A step, on the training thread, runs from the end of the previous step's ``should_commit`` (the
first one: from its ``start_quorum``) to the end of its own ``should_commit``, so the optimizer
step and data loading are inside it. Inside it the timer adds up the time the training thread
spent blocked in:

- ``cross``: torchft's cross-group work: ``start_quorum``/``wait_quorum`` (the Lighthouse quorum)
  and ``Manager.allreduce`` through the end of its ``wait()``;
- ``group``: the replica group's own collectives: FSDP2's all-gathers and reduce-scatters (see
  :mod:`worker_server.fsdp`) and ``should_commit``, the in-group commit vote (a healing step's
  commit also loads the peer's state).

``compute_s`` is the rest: ``step_s - wait_cross_s - wait_group_s``. The cost is two
``time.monotonic()`` calls per timed call and a few float additions; nothing is synchronized
and nothing is sent.

Only wall time on the host is measured. With NCCL, collectives run asynchronously on CUDA streams:
the host returns from a launch at once and waits in ``should_commit``'s device synchronize, so on
GPUs the in-group figure sees the launch, not the wait (the Flight Recorder's per-entry durations
are the GPU-side source there). On gloo (CPU) the calls block and the figures are the waits.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

SCOPES = ("cross", "group")
TIMING_WINDOW = 16  # steps in the served median


@dataclass(frozen=True)
class StepTiming:
    """Where one step's wall time went, in seconds on this rank's monotonic clock."""

    step: int
    step_s: float
    compute_s: float
    wait_cross_s: float
    wait_group_s: float


class StepTimer:
    """Adds up one rank's waits inside collectives per step; keeps the last ``window`` steps.

    Writers (``waiting``, ``begin_step``, ``end_step``) run on the training thread. A wait that
    starts inside another (``Manager.allreduce`` calls ``wait_quorum``) is counted once, by the
    outer one; waits on other threads (torchft's quorum thread) are not the training thread's
    and are not counted. Readers (``snapshot``) may run on any thread.
    """

    def __init__(self, window: int = TIMING_WINDOW, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._local = threading.local()
        self._step_began: float | None = None
        # The wait the training thread is in now (scope, start), for readers: a rank blocked
        # in a collective shows how long it has been blocked there.
        self._current: tuple[str, float] | None = None
        self._wait = dict.fromkeys(SCOPES, 0.0)
        self._recent: deque[StepTiming] = deque(maxlen=window)
        self._listeners: list[Callable[[StepTiming], None]] = []

    # --- training thread ---------------------------------------------------------------
    def waiting(self, scope: str) -> _Wait:
        """A context manager timing its block as this step's wait in ``scope`` (``cross`` or
        ``group``)."""
        if scope not in self._wait:
            raise ValueError(f"unknown wait scope {scope!r}; expected one of {SCOPES}")
        return _Wait(self, scope)

    def begin_step(self) -> None:
        """A step begins (``start_quorum``) unless one is already running."""
        if self._step_began is None:
            self._step_began = self._clock()

    def end_step(self, step: int) -> StepTiming | None:
        """Close the running step (``should_commit`` returned) and begin the next one."""
        now = self._clock()
        began, self._step_began = self._step_began, now
        cross, group = self._wait["cross"], self._wait["group"]
        self._wait = dict.fromkeys(SCOPES, 0.0)
        if began is None:
            return None
        step_s = now - began
        timing = StepTiming(step=step, step_s=step_s,
                            compute_s=max(0.0, step_s - cross - group),
                            wait_cross_s=cross, wait_group_s=group)
        with self._lock:
            self._recent.append(timing)
            listeners = list(self._listeners)
        for listener in listeners:
            listener(timing)
        return timing

    def add_listener(self, listener: Callable[[StepTiming], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    # --- readers -----------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The ``timing`` object of ``/v1/state`` (docs/CONTRACTS.md): ``last_step``, ``window``
        (medians over the last steps) and ``waiting`` (the wait in progress), each None when
        there is none, and ``recent``: the window's steps, oldest first (the monitor compares
        ranks step by step, by step number, so it needs each step, not only the last)."""
        current = self._current  # one read: the training thread may replace it meanwhile
        now = self._clock()
        with self._lock:
            recent = list(self._recent)
        waiting = None if current is None else {
            "scope": current[0], "seconds": max(0.0, now - current[1])}
        if not recent:
            return {"last_step": None, "window": None, "waiting": waiting, "recent": []}
        window: dict[str, float | int] = {"steps": len(recent)}
        for key in ("step_s", "compute_s", "wait_cross_s", "wait_group_s"):
            window[key] = statistics.median(getattr(t, key) for t in recent)
        return {"last_step": asdict(recent[-1]), "window": window, "waiting": waiting,
                "recent": [asdict(t) for t in recent]}


class _Wait:
    """One timed wait (a class, not a generator: it costs about a microsecond per collective)."""

    __slots__ = ("_timer", "_scope", "_started")

    def __init__(self, timer: StepTimer, scope: str) -> None:
        self._timer = timer
        self._scope = scope
        self._started: float | None = None

    def __enter__(self) -> None:
        timer = self._timer
        if getattr(timer._local, "inside", False):
            return  # the enclosing wait already counts this time
        timer._local.inside = True
        self._started = started = timer._clock()
        timer._current = (self._scope, started)

    def __exit__(self, *exc) -> None:
        if self._started is None:
            return
        timer = self._timer
        timer._current = None
        timer._wait[self._scope] += timer._clock() - self._started
        timer._local.inside = False
