"""One tick of the demo's loop (``lightkeeper/demo_loop.py``) through its parts: every rank
sampled, the fault a rank says struck told in its story and in the report's ``faults[]``, and
the ``--duration`` deadline ending the run. The ranks are plain data in the shape ``/v1/state``
serves, with no monitor nor Lighthouse to read; the real processes run in
tests/test_demo_e2e.py."""

from __future__ import annotations

import argparse
import os

import pytest

from lightkeeper import demo_loop
from lightkeeper.demo import add_arguments
from lightkeeper.demo_loop import Demo, Stop
from lightkeeper.scenario import Scenario

SPEC = "slow_compute:factor=3,from_step=5,rank=1"


class _Group:
    def __init__(self, g: int) -> None:
        self.worker_urls = {r: f"http://g{g}r{r}" for r in range(2)}
        self.proc = argparse.Namespace(returncode=None)

    def alive(self) -> bool:
        return True

    def log(self) -> str:
        return ""


def _demo(tmp_path, monkeypatch) -> Demo:
    monkeypatch.setattr(demo_loop, "TICK_S", 0.0)  # a tick waits out the rest of its period
    p = argparse.ArgumentParser()
    add_arguments(p)
    demo = Demo(p.parse_args(["--groups", "2"]), Scenario(), tmp_path)
    demo.cluster = argparse.Namespace(groups={g: _Group(g) for g in range(2)},
                                      lighthouse_url=None, spares={})
    demo.tty = False
    return demo


def _state(g: int, r: int, step: int, struck: dict) -> dict:
    return {"group_rank": r, "rank": 2 * g + r, "step": step, "participating": True,
            "num_participants": 2, "phase": "train", "last_step_seconds": 0.1,
            "last_step_at": None, "quorum_id": 4, "replica_id": f"group{g}",
            "pid": os.getpid(), "host": f"node-{g}", "faults_struck_at": struck}


def test_a_tick_samples_every_rank_and_tells_the_strike_a_rank_reports(tmp_path, monkeypatch):
    demo = _demo(tmp_path, monkeypatch)
    tr = demo.arm(SPEC, 1, "start", 0.0)
    struck_at = demo.t0_unix + 1.5
    served = {f"http://g{g}r{r}": _state(g, r, 6 + g, {tr.record["spec"]: struck_at}
                                         if (g, r) == (1, 1) else {})
              for g in range(2) for r in range(2)}
    demo.state = served.get  # what each rank serves at /v1/state

    demo.tick()
    assert [(s["replica_group"], s["rank"], s["step"]) for s in demo.samples] == [
        (0, 0, 6), (0, 1, 6), (1, 2, 7), (1, 3, 7)]
    assert demo.ticks[-1][1] == 7 and demo.job_step() == 7 and demo.all_stepping()
    assert demo.faults[0]["struck_at_s"] == 1.5 and demo.faults[0]["host"] == "node-1"
    assert [(e["kind"], e["replica_group"]) for e in demo.events] == [("struck", 1)]
    assert demo.pids() == [os.getpid()]
    # each sample dated by its answer, in seconds since the start (not a strike's unix time)
    assert all(demo.ticks[-1][0] <= s["t"] < demo.ticks[-1][0] + 5 for s in demo.samples)
    assert {s["tick"] for s in demo.samples} == {demo.ticks[-1][0]}


def test_a_tick_past_the_duration_stops_the_run(tmp_path, monkeypatch):
    demo = _demo(tmp_path, monkeypatch)
    demo.state = lambda url: None  # no rank answers: nothing sampled, the run still ends
    demo.deadline, demo.train_start_s = 1.0, demo.now() - 2.0
    with pytest.raises(Stop, match="--duration 1s reached"):
        demo.tick()
    assert demo.samples == [] and demo.latest == {0: [], 1: []}


def test_each_look_is_dated_by_its_answer(tmp_path, monkeypatch):
    """Rank 0's host is offline (its look waits out its timeout): the looks after it are dated
    when they came, not at the tick's start, and the tick keeps its own time."""
    demo = _demo(tmp_path, monkeypatch)
    clock = [100.0]
    monkeypatch.setattr(demo, "now", lambda: clock[0])

    def state(url: str) -> dict | None:
        g, r = int(url[8]), int(url[10])
        clock[0] += 1.0 if (g, r) == (0, 0) else 0.01  # the offline rank's timeout
        return None if (g, r) == (0, 0) else _state(g, r, 6, {})

    demo.state = state
    demo.tick()
    assert [(s["replica_group"], s["rank"]) for s in demo.samples] == [(0, 1), (1, 2), (1, 3)]
    assert [round(s["t"], 2) for s in demo.samples] == [101.01, 101.02, 101.03]
    assert {s["tick"] for s in demo.samples} == {100.0}


def test_a_hold_for_a_kill_already_sent_is_not_told_again(tmp_path, monkeypatch):
    """The monitor holds a second finding on a group it just evicted (``already_evicted``):
    the story says "evicted" once, and other holds as they come."""
    demo = _demo(tmp_path, monkeypatch)
    rows = [{"id": 1, "replica_group": 2, "at": 10.0, "decision": "evict", "reason": "hang"},
            {"id": 2, "replica_group": 2, "at": 11.0, "decision": "hold",
             "reason": "already_evicted"},
            {"id": 3, "replica_group": 1, "at": 12.0, "decision": "hold", "reason": "cooldown"},
            {"id": 4, "replica_group": 2, "at": 12.0, "decision": "abort", "reason": "peer_gone"}]
    demo.monitor_get = {"/v1/evictions": rows}.get
    demo.poll_monitor()
    demo.poll_monitor()  # each row told once
    assert [(e["kind"], e["replica_group"], e["detail"]) for e in demo.events] == [
        ("evicted", 2, "evict (hang)"), ("held", 1, "hold (cooldown)"),
        ("survivors_released", 2, "abort (peer_gone)")]
    assert len(demo.evictions) == 4  # the report keeps every decision


def test_a_dry_run_abort_is_told_as_one(tmp_path, monkeypatch):
    """--dry-run: the monitor records the survivors' abort it did not send; the story said
    "abort (peer_gone)" as for one it sent."""
    demo = _demo(tmp_path, monkeypatch)
    rows = [{"id": 1, "replica_group": 1, "at": 12.0, "decision": "abort", "reason": "peer_gone",
             "status": "dry_run"}]
    demo.monitor_get = {"/v1/evictions": rows}.get
    demo.poll_monitor()
    assert [(e["kind"], e["replica_group"], e["detail"]) for e in demo.events] == [
        ("survivors_released", 1, "abort (peer_gone) (dry run)")]
