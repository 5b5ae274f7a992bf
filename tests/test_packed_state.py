"""A ``/v1/state`` answer as the monitor keeps it (monitor/packed_state.py): its timing rows and
step times packed into bytes by the poller, read by the detectors and the view exactly as the
answer served. The in-thread poller and the poller process's reader pack the same. Real HTTP on
127.0.0.1 for the two pollers."""

from __future__ import annotations

import json
import math
import time

import pytest

from monitor.detectors import timing_rows
from monitor.packed_state import TIMING_ROW, pack_state
from monitor.poll_process import ProcessPoller
from monitor.poller import STATE_PATH, Poller, judge_body
from monitor.view import RankView
from tests.support.monitor_sim import SimRanks
from tests.support.virtual_ranks import VirtualRanks


def answers() -> list[bytes]:
    """Answers of a WorkerServer's keys and sizes (tests/test_virtual_ranks.py checks them
    against a RankState snapshot): a leader asked since its newest step, a member asked since
    its group's less the window, a rank asked for every row, and one with no rows yet."""
    vr = VirtualRanks(16, 0, 8, 1.0, epoch=time.monotonic() - 40.3)
    step = json.loads(vr.state_asked(0))["step"]
    fresh = VirtualRanks(16, 0, 8, 1.0, epoch=time.monotonic())
    return [vr.state_asked(0, f"?since={step - 1}&recent=16"),
            vr.state_asked(1, f"?since={step - 9}&recent=16"), vr.state_asked(2, "?recent=16"),
            fresh.state_asked(3)]


def test_a_packed_answer_reads_as_the_answer_served():
    """Every reader of the two packed lists gets what it got of the served JSON: the rows
    after any folded step (read back from the newest), the step times; every other key is
    left as parsed, and the packed answer is smaller to hold (fewer objects)."""
    for body in answers():
        served, kept = json.loads(body), pack_state(json.loads(body))
        rows = served["timing"]["recent"]
        if rows:
            assert type(kept["timing"]["recent"]) is bytes
            assert len(kept["timing"]["recent"]) == len(rows) * TIMING_ROW.size
        assert type(kept["recent_step_seconds"]) is bytes
        steps = [r["step"] for r in rows]
        for skip in ({}, {s: None for s in steps[:1]}, {s: None for s in steps[:-1]},
                     {s: None for s in steps}, {-5: None}):
            assert timing_rows(kept, skip) == timing_rows(served, skip)
            assert timing_rows(kept, skip, packed=True) == timing_rows(served, skip, packed=True)
        assert RankView("u", True, kept).recent_steps() == \
            RankView("u", True, served).recent_steps()
        assert {k: v for k, v in kept.items() if k not in ("timing", "recent_step_seconds")} == \
            {k: v for k, v in served.items() if k not in ("timing", "recent_step_seconds")}
        assert {k: v for k, v in kept["timing"].items() if k != "recent"} == \
            {k: v for k, v in served["timing"].items() if k != "recent"}


def test_what_cannot_be_packed_is_left_as_served():
    """A step beyond int64 leaves the rows as served (and they read as before); no rows, a
    list that is not one, or step times beyond a float are left as they are; nothing raises."""
    row = {"step": 2**70, "step_s": 1.0, "compute_s": 0.5, "wait_cross_s": 0.25,
           "wait_group_s": 0.125}
    big = {"timing": {"recent": [row]}, "recent_step_seconds": [1.0, 10**400]}
    kept = pack_state(json.loads(json.dumps(big)))
    assert kept == big
    assert timing_rows(kept) == [(2**70, (1.0, 0.5, 0.25, 0.125))]
    for odd in ({"timing": {"recent": []}}, {"timing": {"recent": "x"}}, {"timing": None},
                {"recent_step_seconds": None}, {"recent_step_seconds": {"a": 1}}, {}):
        assert pack_state(json.loads(json.dumps(odd))) == odd
    # no rows served: the last step's row still reads (timing_rows' fallback)
    last = {"timing": {"recent": [], "last_step": dict(row, step=4)}}
    assert timing_rows(pack_state(last)) == [(4, (1.0, 0.5, 0.25, 0.125))]


def test_the_poller_keeps_state_answers_packed_and_nothing_else():
    """judge_body packs an answer of /v1/state (``state``) and leaves any other as parsed; an
    answer that is no JSON object fails with the same words either way."""
    for body in answers():
        assert judge_body("u", body, 0.1, 5.0, state=True).data == pack_state(json.loads(body))
        assert judge_body("u", body, 0.1, 5.0).data == json.loads(body)
    for body in (b"[1, 2]", b"{not json"):
        packed, plain = judge_body("u", body, 0.1, 5.0, state=True), judge_body("u", body, 0.1, 5.0)
        assert (packed.ok, packed.reason, packed.error) == (plain.ok, plain.reason, plain.error)
        assert (packed.ok, packed.reason) == (False, "bad_response")


@pytest.fixture
def sim():
    s = SimRanks.start(6, groups=3)
    for rank in s.ranks:  # the timing rows a WorkerServer serves, a malformed one among them
        rank.state["timing"] = {"recent": [
            {"step": 98, "step_s": 0.2, "compute_s": 0.1, "wait_cross_s": 0.05,
             "wait_group_s": 0.05},
            {"step": 99, "step_s": -1.0, "compute_s": 0.1, "wait_cross_s": 0.05,
             "wait_group_s": 0.05},
            {"step": 100, "step_s": 0.25, "compute_s": 0.1, "wait_cross_s": 0.1,
             "wait_group_s": 0.05}], "waiting": None}
    yield s
    s.stop()


def test_both_pollers_keep_the_same_packed_answers(sim):
    """The in-thread poller packs what the poller process packs: the same dicts, bytes and
    all, read as served (the malformed row left out)."""
    thread, process = Poller(timeout_s=2.0), ProcessPoller(timeout_s=2.0)
    try:
        a, b = thread.sweep(sim.urls, STATE_PATH), process.sweep(sim.urls, STATE_PATH)
        assert all(p.ok for p in a.values()) and all(p.ok for p in b.values())
        assert {u: p.data for u, p in a.items()} == {u: p.data for u, p in b.items()}
        for p in a.values():
            assert type(p.data["timing"]["recent"]) is bytes
            assert [s for s, _ in timing_rows(p.data)] == [98, 100]
            assert math.isclose(RankView("u", True, p.data).recent_steps()[0], 0.2)
    finally:
        thread.close()
        process.close()
