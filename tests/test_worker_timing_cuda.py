"""The device clock of worker_server/timing.py on a CPU: a simulated CUDA stream.

On a GPU the host returns from kernel launches at once; a rank's GPU work shows up wherever the
host next blocks (gloo's copy of CUDA tensors, ``should_commit``'s synchronize), so host time
alone gives a slow rank and its peer the same wait (measured on an H100: docs/gpu.md,
benchmarks/gpu/cuda_step_timing.py). With CUDA the timer measures waits between events on the
stream. CUDA cannot run here, so ``Stream`` below stands in for it (a fake, for that reason
only): events complete when both the host has recorded them and the work queued before them is
done, which is what CUDA events do. The real ``CudaEvents`` runs in the GPU benchmark.
"""

from __future__ import annotations

import logging

import pytest

from tests.support.clock import ManualClock as Clock
from worker_server import timing
from worker_server.timing import StepTimer


class Stream:
    """One CUDA stream on a shared clock: ``launch`` queues GPU work, ``mark`` records an event
    (completes when the queue before it is done), ``spans_s`` is ``elapsed_time``."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.free_at = clock.now
        self.marks = 0

    def launch(self, gpu_seconds: float) -> None:
        self.free_at = max(self.free_at, self.clock.now) + gpu_seconds

    def drain(self) -> None:  # the host waits for the stream (synchronize, gloo's copy)
        self.clock.now = max(self.clock.now, self.free_at)

    def mark(self) -> float:
        self.marks += 1
        self.free_at = max(self.free_at, self.clock.now)
        return self.free_at

    def spans_s(self, pairs):
        return [end - begin for begin, end in pairs]


def gloo_step(timer: StepTimer, clock: Clock, stream: Stream, step: int, gpu_s: float,
              peer_ready_at: float) -> None:
    """A torchft-like step on CUDA with gloo: launch (1 ms of host time) ``gpu_s`` of kernels,
    all_reduce (the host blocks until its own GPU work is done and the peer has sent), commit."""
    timer.begin_step()
    clock.advance(0.001)
    stream.launch(gpu_s)
    with timer.waiting("cross"):
        stream.drain()
        clock.now = max(clock.now, peer_ready_at)
    with timer.waiting("group"):
        stream.drain()
        clock.advance(0.0005)  # the commit vote
    timer.end_step(step)


def two_ranks(device: bool) -> dict[str, dict]:
    """Rank "slow" has 0.4 s of GPU work a step, rank "fast" 0.1 s; each waits for the other."""
    out = {}
    for name, gpu_s, peer in (("slow", 0.4, 0.1), ("fast", 0.1, 0.4)):
        clock = Clock()
        stream = Stream(clock)
        timer = StepTimer(clock=clock, device=stream if device else False)
        start = clock.now
        gloo_step(timer, clock, stream, 0, gpu_s, peer_ready_at=start + 0.001 + max(gpu_s, peer))
        snap = timer.snapshot()
        out[name] = {**snap["last_step"], "clock": snap["clock"]}  # as /v1/state serves it
    return out


def test_host_time_gives_the_slow_rank_the_same_wait_as_its_peer():
    """The failure the device clock fixes: compute is only launch time on both ranks."""
    host = two_ranks(device=False)
    assert host["slow"]["compute_s"] == pytest.approx(0.001)
    assert host["fast"]["compute_s"] == pytest.approx(0.001)
    assert host["slow"]["wait_cross_s"] == pytest.approx(host["fast"]["wait_cross_s"])


def test_device_time_gives_the_slow_rank_the_short_wait():
    dev = two_ranks(device=True)
    assert dev["slow"]["clock"] == dev["fast"]["clock"] == "device"
    assert dev["slow"]["compute_s"] == pytest.approx(0.401)
    assert dev["slow"]["wait_cross_s"] == pytest.approx(0.0)
    assert dev["fast"]["compute_s"] == pytest.approx(0.101)
    assert dev["fast"]["wait_cross_s"] == pytest.approx(0.3)  # it waited for the slow rank
    for r in dev.values():
        assert r["wait_group_s"] == pytest.approx(0.0005)  # the vote, not the GPU backlog
        assert r["step_s"] == pytest.approx(r["compute_s"] + r["wait_cross_s"] + r["wait_group_s"])


def test_nested_waits_record_one_span_and_events_are_read_once_per_step():
    clock = Clock()
    stream = Stream(clock)
    timer = StepTimer(clock=clock, device=stream)
    timer.begin_step()
    with timer.waiting("cross"), timer.waiting("cross"):  # allreduce calling wait_quorum
        clock.advance(0.2)
    timer.end_step(0)
    assert stream.marks == 2
    assert timer.snapshot()["last_step"]["wait_cross_s"] == pytest.approx(0.2)


def test_an_error_escaping_a_waits_start_leaves_the_later_waits_counted():
    """An error raised while a wait starts (a RecursionError near Python's limit, an interrupt)
    has no ``__exit__`` after it: the rank's later waits must still be counted, on the GPU's
    clock. On an H100 one such error left every wait after the first step uncounted."""

    class Interrupted(Stream):
        def mark(self):
            raise KeyboardInterrupt

    clock = Clock()
    stream = Interrupted(clock)
    timer = StepTimer(clock=clock, device=stream)
    timer.begin_step()
    with pytest.raises(KeyboardInterrupt), timer.waiting("cross"):
        pass
    stream.__class__ = Stream  # marks work again
    start = clock.now  # 0.1 s of its own GPU work, then the peer's data at +0.5 s
    gloo_step(timer, clock, stream, 0, gpu_s=0.1, peer_ready_at=start + 0.5)
    snap = timer.snapshot()
    assert snap["clock"] == "device"
    assert snap["last_step"]["wait_cross_s"] == pytest.approx(0.5 - 0.001 - 0.1)


class Broken(Stream):
    def spans_s(self, pairs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_cuda_error_falls_back_to_host_time_for_good(caplog):
    clock = Clock()
    stream = Broken(clock)
    timer = StepTimer(clock=clock, device=stream)
    with caplog.at_level(logging.WARNING, logger="worker_server.timing"):
        gloo_step(timer, clock, stream, 0, gpu_s=0.3, peer_ready_at=0.0)
    snap = timer.snapshot()
    last = snap["last_step"]
    assert snap["clock"] == "host"
    assert last["wait_cross_s"] == pytest.approx(0.3)  # the host's figure, not an exception
    assert "step timing is on host time from now on" in caplog.text
    marks = stream.marks
    gloo_step(timer, clock, stream, 1, gpu_s=0.3, peer_ready_at=0.0)
    assert stream.marks == marks  # no more events once it failed


def test_the_mode_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("LIGHTKEEPER_CUDA_TIMING", "sometimes")
    with pytest.raises(ValueError, match="LIGHTKEEPER_CUDA_TIMING='sometimes': expected one of auto, off"):
        StepTimer()
    # auto (the default) turns the device clock on only once CUDA is in use
    monkeypatch.delenv("LIGHTKEEPER_CUDA_TIMING")
    made = []
    monkeypatch.setattr(timing, "CudaEvents", lambda: made.append(1) or Stream(Clock()))
    timer = StepTimer()
    monkeypatch.setattr(timing, "_cuda_in_use", lambda: False)
    timer.begin_step()
    assert made == []
    monkeypatch.setattr(timing, "_cuda_in_use", lambda: True)
    timer.begin_step()
    assert made == [1]
    monkeypatch.setenv("LIGHTKEEPER_CUDA_TIMING", "off")
    off = StepTimer()
    off.begin_step()
    assert made == [1]


def test_cuda_in_use_is_false_on_this_cpu_machine():
    assert timing._cuda_in_use() is False
