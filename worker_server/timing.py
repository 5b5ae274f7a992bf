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

``compute_s`` is the rest: ``step_s - wait_cross_s - wait_group_s``.

Beside a step's row, ``wait_quorum_s``: from the rank's ``start_quorum`` call to the completion of
that step's quorum (torchft's ``_quorum_future``), host clock, synchronous or asynchronous quorum
alike: the rank whose group's quorum the job waits for waits least there from its own call,
while the time it blocks in ``wait_quorum`` (after forward and backward with the async quorum)
says nothing of its arrival. The completion is seen on torchft's quorum thread; one seen after
its step ended is dropped (the row has none). Without CUDA the cost is
two ``time.monotonic()`` calls per timed call and a few float additions; nothing is synchronized
and nothing is sent.

On CUDA the host clock alone is wrong: kernels run asynchronously, so the host meets the GPU's
work wherever it next synchronizes (inside a collective, or ``should_commit``'s device
synchronize), and a rank with a slow GPU shows the same host waits as its peers (docs/gpu.md has
the measurement).

So when the process uses CUDA, every timed wait also records a CUDA event on the current stream
as it begins and as it ends; a wait's length is then the GPU time between those two events: it
starts when the rank's own queued work before the collective is done and ends when the stream
can go on after it. That covers a host that blocks (gloo on CUDA tensors, the
commit vote: the GPU sits idle until the host returns) and a collective that only makes the
stream wait (NCCL: the span is the collective's own time on the GPU, its waits for peers
included). The step itself stays host time; ``compute_s = step_s - waits``.

``LIGHTKEEPER_CUDA_TIMING`` chooses: ``auto`` (default: CUDA events from the first step that
begins after this process initialized CUDA; host time without CUDA) or ``off`` (host time only).
Any other value is a ``ValueError`` when the timer is made. The wait in progress that readers
see (``waiting``) is always host time.

The cost on CUDA is two event records per timed wait (events reused; docs/gpu.md) and, at the
end of a step, one wait on the step's last event, which in a torchft loop has already passed
(``should_commit`` synchronizes the stream). A CUDA error while recording or reading events makes
that step's figures the host's, and the timer stays on host time from then on (logged once).
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from rank_wire import QUORUM_KEY, TIMING_ROWS

SCOPES = ("cross", "group")
TIMING_WINDOW = 16  # steps in the served median
CUDA_TIMING_ENV = "LIGHTKEEPER_CUDA_TIMING"
CUDA_TIMING_MODES = ("auto", "off")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepTiming:
    """Where one step's wall time went, in seconds on this rank's monotonic clock."""

    step: int
    step_s: float
    compute_s: float
    wait_cross_s: float
    wait_group_s: float


class CudaEvents:
    """The device clock: CUDA events recorded on the current stream (torch imported lazily).

    ``mark()`` records an event and returns it; ``spans_s(pairs)`` waits for the last event of
    ``pairs`` and returns each pair's GPU time in seconds, then reuses the events. Errors are
    torch's (``RuntimeError``); :class:`StepTimer` turns them into host timing."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._free: list = []

    def mark(self):
        event = self._free.pop() if self._free else self._torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def spans_s(self, pairs: list[tuple]) -> list[float]:
        try:
            pairs[-1][1].synchronize()
            return [begin.elapsed_time(end) / 1000.0 for begin, end in pairs]
        finally:
            for begin, end in pairs:
                self._free.extend((begin, end))


def cuda_timing_mode(value: str | None = None) -> str:
    """``LIGHTKEEPER_CUDA_TIMING`` (or ``value``) checked: one of :data:`CUDA_TIMING_MODES`;
    anything else raises ``ValueError`` naming the variable."""
    raw = os.environ.get(CUDA_TIMING_ENV, "auto") if value is None else value
    mode = raw.strip().lower() or "auto"
    if mode not in CUDA_TIMING_MODES:
        raise ValueError(f"{CUDA_TIMING_ENV}={raw!r}: expected one of {', '.join(CUDA_TIMING_MODES)}")
    return mode


def _cuda_in_use() -> bool:
    """Whether this process has initialized CUDA (never imports torch, never initializes CUDA)."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False


class StepTimer:
    """Adds up one rank's waits inside collectives per step; keeps the last ``max(window, rows)``
    steps and serves their medians over the last ``window``.

    Writers (``waiting``, ``begin_step``, ``end_step``) run on the training thread. A wait that
    starts inside another (``Manager.allreduce`` calls ``wait_quorum``) is counted once, by the
    outer one; waits on other threads (torchft's quorum thread) are not the training thread's
    and are not counted. Readers (``snapshot``) may run on any thread.

    ``device`` is the device clock: ``None`` chooses by ``LIGHTKEEPER_CUDA_TIMING`` (module
    docstring; a bad value raises ``ValueError`` here), ``False`` is host time only, and an object
    with ``mark()`` and ``spans_s(pairs)`` (as :class:`CudaEvents`) is used as given. ``clock``
    says which one the last step was measured with: ``"host"`` or ``"device"``.
    """

    def __init__(self, window: int = TIMING_WINDOW, clock: Callable[[], float] = time.monotonic,
                 device: object = None, rows: int = TIMING_ROWS):
        self._clock = clock
        self._window = window
        if device is None:
            self._device_mode = cuda_timing_mode()
            self._device = None
        else:
            self._device_mode = "given" if device else "off"
            self._device = device or None
        self._spans: list[tuple[str, object, object]] = []
        self.clock = "host"
        self._lock = threading.Lock()
        self._local = threading.local()
        self._step_began: float | None = None
        # The wait the training thread is in now (scope, start), for readers: a rank blocked
        # in a collective shows how long it has been blocked there.
        self._current: tuple[str, float] | None = None
        self._wait = dict.fromkeys(SCOPES, 0.0)
        self._recent: deque[StepTiming] = deque(maxlen=max(window, rows))
        # each row's wait_quorum_s or None; the running step's, and its number among steps
        self._quorums: deque[float | None] = deque(maxlen=max(window, rows))
        self._quorum_s: float | None = None
        self._seq = 0
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
        if self._step_began is None:  # first: the CUDA probe below is the step's time too
            self._step_began = self._clock()
        if self._device is None and self._device_mode == "auto" and _cuda_in_use():
            try:
                self._device = CudaEvents()
            except Exception:
                self._device_mode = "off"
                log.warning("CUDA event timing unavailable; step timing stays on host time",
                            exc_info=True)

    def quorum_called(self) -> Callable[[object], None]:
        """At the rank's ``start_quorum``: the done-callback of this step's quorum future, which
        records the seconds since this call as the running step's ``wait_quorum_s``, on any
        thread, unless that step has ended."""
        seq, began = self._seq, self._clock()

        def done(_future: object = None) -> None:
            seconds = self._clock() - began
            with self._lock:
                if self._seq == seq:
                    self._quorum_s = seconds
        return done

    def _device_waits(self) -> dict[str, float] | None:
        """This step's waits per scope on the device clock, or None (no device, or it failed)."""
        spans, self._spans = self._spans, []
        if self._device is None:
            return None
        waits = dict.fromkeys(SCOPES, 0.0)
        if not spans:
            return waits
        try:
            seconds = self._device.spans_s([(begin, end) for _, begin, end in spans])
        except Exception:
            self._device_failed()
            return None
        for (scope, _, _), span in zip(spans, seconds, strict=True):
            waits[scope] += max(0.0, span)
        return waits

    def _device_failed(self) -> None:
        log.warning("CUDA event timing failed; step timing is on host time from now on",
                    exc_info=True)
        self._device, self._device_mode = None, "off"

    def end_step(self, step: int) -> StepTiming | None:
        """Close the running step (``should_commit`` returned) and begin the next one."""
        now = self._clock()
        began, self._step_began = self._step_began, now
        cross, group = self._wait["cross"], self._wait["group"]
        self._wait = dict.fromkeys(SCOPES, 0.0)
        device = self._device_waits()  # reads (and frees) the step's events even without a step
        with self._lock:
            quorum, self._quorum_s, self._seq = self._quorum_s, None, self._seq + 1
        if began is None:
            return None
        if device is not None:
            cross, group = device["cross"], device["group"]
        self.clock = "host" if device is None else "device"
        step_s = now - began
        timing = StepTiming(step=step, step_s=step_s,
                            compute_s=max(0.0, step_s - cross - group),
                            wait_cross_s=cross, wait_group_s=group)
        with self._lock:
            self._recent.append(timing)
            self._quorums.append(quorum)
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
        (medians over the last ``window`` steps) and ``waiting`` (the wait in progress), each None
        when there is none, ``recent``: every step kept, oldest first (the monitor compares
        ranks step by step, by step number, so it needs each step, not only the last), and
        ``recent_quorum``: the ``wait_quorum_s`` of those that have one."""
        current = self._current  # one read: the training thread may replace it meanwhile
        now = self._clock()
        with self._lock:
            recent, quorums = list(self._recent), list(self._quorums)
        waiting = None if current is None else {
            "scope": current[0], "seconds": max(0.0, now - current[1])}
        quorum = [{"step": t.step, "wait_quorum_s": q}
                  for t, q in zip(recent, quorums, strict=True) if q is not None]
        if not recent:
            return {"last_step": None, "window": None, "waiting": waiting, "recent": [],
                    QUORUM_KEY: quorum, "clock": self.clock}
        last = recent[-self._window:]
        window: dict[str, float | int] = {"steps": len(last)}
        for key in ("step_s", "compute_s", "wait_cross_s", "wait_group_s"):
            window[key] = statistics.median(getattr(t, key) for t in last)
        return {"last_step": asdict(recent[-1]), "window": window, "waiting": waiting,
                "recent": [asdict(t) for t in recent], QUORUM_KEY: quorum,
                "clock": self.clock}


class _Wait:
    """One timed wait (a class, not a generator: it costs about a microsecond per collective)."""

    __slots__ = ("_timer", "_scope", "_started", "_mark")

    def __init__(self, timer: StepTimer, scope: str) -> None:
        self._timer = timer
        self._scope = scope
        self._started: float | None = None
        self._mark = None

    def __enter__(self) -> None:
        timer = self._timer
        if getattr(timer._local, "inside", False):
            return  # the enclosing wait already counts this time
        timer._local.inside = True
        try:
            if timer._device is not None:
                try:
                    self._mark = timer._device.mark()
                except Exception:
                    timer._device_failed()
            self._started = started = timer._clock()
        except BaseException:  # no __exit__ follows (a RecursionError, a KeyboardInterrupt)
            timer._local.inside = False  # else every later wait of this thread goes uncounted
            raise
        timer._current = (self._scope, started)

    def __exit__(self, *exc) -> None:
        if self._started is None:
            return
        timer = self._timer
        timer._current = None
        timer._wait[self._scope] += timer._clock() - self._started
        timer._local.inside = False
        device = timer._device
        if self._mark is not None and device is not None:
            try:
                timer._spans.append((self._scope, self._mark, device.mark()))
            except Exception:
                timer._device_failed()
