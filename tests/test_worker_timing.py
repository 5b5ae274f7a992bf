"""Per-step compute and collective waits on a rank's own clock (worker_server/timing.py), and how
/v1/state and /metrics serve them. The clock is a counter the test advances, so the figures are
exact; the server is real (waitress on an ephemeral port)."""

from __future__ import annotations

import base64
import threading

import pytest
import requests

from rank_wire import TIMING_ROW
from tests.support.clock import ManualClock as Clock
from worker_server import RankIdentity, RankState, WorkerServer
from worker_server.timing import StepTimer


def labels_key(labels: dict) -> tuple:
    return tuple(sorted(labels.items()))


def scrape(url: str) -> dict:
    """/metrics parsed with prometheus_client's own parser: {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url + "/metrics", timeout=5).text
    return {(s.name, labels_key(s.labels)): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def run_step(timer: StepTimer, clock: Clock, step: int, compute: float, cross: float,
             group: float) -> None:
    """One step as the instrumented Manager and FSDP drive the timer."""
    timer.begin_step()
    with timer.waiting("cross"):  # quorum
        clock.advance(cross / 2)
    clock.advance(compute)
    with timer.waiting("group"):  # an FSDP all-gather
        clock.advance(group / 2)
    with timer.waiting("cross"), timer.waiting("cross"):  # allreduce calling wait_quorum
        clock.advance(cross / 2)
    with timer.waiting("group"):  # should_commit
        clock.advance(group / 2)
    timer.end_step(step)


def test_a_step_splits_into_compute_and_waits_and_nested_waits_count_once():
    clock = Clock()
    timer = StepTimer(clock=clock)
    assert timer.snapshot() == {"last_step": None, "window": None, "waiting": None,
                                "recent": [], "recent_quorum": [], "clock": "host"}
    run_step(timer, clock, 0, compute=0.5, cross=0.2, group=0.1)
    last = timer.snapshot()["last_step"]
    assert last["step"] == 0
    assert timer.snapshot()["recent"] == [last]  # every step of the window, by step number
    assert last["step_s"] == pytest.approx(0.8)
    assert last["wait_cross_s"] == pytest.approx(0.2)  # not 0.3: the nested wait counted once
    assert last["wait_group_s"] == pytest.approx(0.1)
    assert last["compute_s"] == pytest.approx(0.5)


def test_the_next_step_begins_where_the_commit_ended():
    """The optimizer step and data loading after a commit belong to the next step's compute."""
    clock = Clock()
    timer = StepTimer(clock=clock)
    run_step(timer, clock, 0, compute=0.1, cross=0.0, group=0.0)
    clock.advance(0.3)  # optimizer.step(), data loading: before the next start_quorum
    run_step(timer, clock, 1, compute=0.1, cross=0.0, group=0.0)
    last = timer.snapshot()["last_step"]
    assert last["step"] == 1 and last["compute_s"] == pytest.approx(0.4)
    assert last["step_s"] == pytest.approx(0.4)


def test_window_is_the_median_of_the_last_steps():
    clock = Clock()
    timer = StepTimer(window=4, clock=clock)
    for step, group in enumerate([9.0, 0.1, 0.2, 0.3, 5.0]):  # the first falls out of the window
        run_step(timer, clock, step, compute=0.1, cross=0.0, group=group)
    window = timer.snapshot()["window"]
    assert window["steps"] == 4
    assert window["wait_group_s"] == pytest.approx(0.25)  # median of 0.1, 0.2, 0.3, 5.0
    assert window["compute_s"] == pytest.approx(0.1)


def test_a_wait_in_progress_is_served_with_its_scope_and_age():
    clock = Clock()
    timer = StepTimer(clock=clock)
    timer.begin_step()
    with timer.waiting("group"):
        clock.advance(7.0)
        assert timer.snapshot()["waiting"] == {"scope": "group", "seconds": pytest.approx(7.0)}
    assert timer.snapshot()["waiting"] is None


def test_unknown_scope_is_refused():
    with pytest.raises(ValueError, match="unknown wait scope 'disk'"):
        with StepTimer().waiting("disk"):
            pass


def test_waits_on_other_threads_do_not_hide_the_training_threads():
    """torchft's quorum thread may block too; only nesting on one thread counts once."""
    clock = Clock()
    timer = StepTimer(clock=clock)
    timer.begin_step()
    inside, release = threading.Event(), threading.Event()

    def other():
        with timer.waiting("cross"):
            inside.set()
            release.wait(5)

    t = threading.Thread(target=other)
    t.start()
    inside.wait(5)
    with timer.waiting("group"):  # not swallowed by the other thread's open wait
        clock.advance(0.5)
    release.set()
    t.join(5)
    assert timer.end_step(0).wait_group_s == pytest.approx(0.5)


def test_state_and_metrics_serve_the_timing():
    state = RankState(RankIdentity(job="unit", replica_group=1, group_rank=1, group_world_size=2))
    clock = Clock()
    state.timing = StepTimer(clock=clock)
    srv = WorkerServer(state).serve()  # WorkerMetrics listens to state.timing from here on
    try:
        for step in range(3):
            run_step(state.timing, clock, step, compute=0.3, cross=0.02, group=0.6)
        body = requests.get(srv.url + "/v1/state", timeout=5).json()
        timing = body["timing"]
        assert timing["last_step"]["step"] == 2
        assert timing["window"]["steps"] == 3
        assert timing["window"]["wait_group_s"] == pytest.approx(0.6)
        assert timing["window"]["wait_cross_s"] == pytest.approx(0.02)
        assert timing["window"]["compute_s"] == pytest.approx(0.3)
        samples = scrape(srv.url)
        labels = {"group_rank": "1", "job": "unit", "rank": "3", "replica_group": "1"}
        assert samples[("lightkeeper_step_compute_seconds_count", labels_key(labels))] == 3
        group, cross = {**labels, "scope": "group"}, {**labels, "scope": "cross"}
        assert samples[("lightkeeper_collective_wait_seconds_sum", labels_key(group))] == (
            pytest.approx(1.8))
        assert samples[("lightkeeper_collective_wait_seconds_bucket",
                        labels_key({**cross, "le": "0.025"}))] == 3
        assert samples[("lightkeeper_collective_wait_seconds_bucket",
                        labels_key({**group, "le": "0.5"}))] == 0
    finally:
        srv.stop()


def test_a_rank_serves_its_last_32_steps_and_their_newest_16s_median():
    """The monitor keeps 32 rows a rank (monitor/detect/straggler.py's STEP_MEMORY): with steps
    of ms, ranks answering a few steps apart still share the straggler's window."""
    state = RankState(RankIdentity(job="unit", replica_group=0, group_rank=0, group_world_size=1))
    clock = Clock()
    state.timing = StepTimer(clock=clock)
    srv = WorkerServer(state).serve()
    try:
        for step in range(40):
            run_step(state.timing, clock, step, compute=0.3 if step < 24 else 0.1, cross=0.02,
                     group=0.05)
        timing = requests.get(srv.url + "/v1/state", timeout=5).json()["timing"]
        assert [r["step"] for r in timing["recent"]] == list(range(8, 40))
        assert timing["window"]["steps"] == 16
        assert timing["window"]["compute_s"] == pytest.approx(0.1)  # steps 24-39 only
        packed = requests.get(srv.url + "/v1/state?packed=1&since=20", timeout=5).json()
        assert len(base64.b64decode(packed["timing"]["recent"])) == 19 * TIMING_ROW.size
    finally:
        srv.stop()


def test_identity_names_the_node_and_local_rank(monkeypatch):
    monkeypatch.setenv("NODE_NAME", "gpu-node-17")
    monkeypatch.setenv("LOCAL_RANK", "3")
    srv = WorkerServer(RankState(RankIdentity())).serve()
    try:
        body = requests.get(srv.url + "/v1/state", timeout=5).json()
        assert body["host"] == "gpu-node-17" and body["local_rank"] == 3
        text = requests.get(srv.url + "/metrics", timeout=5).text
        assert 'host="gpu-node-17"' in text and 'local_rank="3"' in text
    finally:
        srv.stop()


def test_a_job_set_empty_is_the_default_job(monkeypatch):
    """LIGHTKEEPER_JOB= (set empty) served job "": an empty label is none to Prometheus, and
    a monitor of the default job refused the rank. Set empty is unset, as for the host."""
    import argparse

    from trainer.cli import add_arguments

    monkeypatch.setenv("LIGHTKEEPER_JOB", "")
    srv = WorkerServer.start(port=0)
    try:
        assert requests.get(srv.url + "/v1/state", timeout=5).json()["job"] == "lightkeeper"
    finally:
        srv.stop()
    p = argparse.ArgumentParser()
    add_arguments(p)  # the default is read as the parser is built
    assert p.parse_args([]).job == "lightkeeper"


def test_a_bad_local_rank_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "zero")
    with pytest.raises(ValueError, match="LOCAL_RANK='zero' is not an integer"):
        RankIdentity()
