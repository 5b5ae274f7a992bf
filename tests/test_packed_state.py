"""A ``/v1/state`` answer as the monitor keeps it (monitor/poll/packed_state.py): its timing rows and
step times as rank_wire bytes, made by the poller where it parses the answer; the valid numbers
served, in order. The in-thread poller and the poller process's reader keep the same. A rank
asked ``?packed=1`` (worker_server/packed.py) serves them packed, and the monitor keeps the same
bytes; bytes appear nowhere else. The vectors of valid and invalid numbers are
tests/test_rank_wire.py's. Real HTTP on 127.0.0.1 for the pollers and the WorkerServer."""

from __future__ import annotations

import json
import math
import time

import pytest

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from monitor.evidence.view import RankView
from monitor.poll.packed_state import pack_state
from monitor.poll.poll_process import ProcessPoller
from monitor.poll.poller import STATE_PATH, Poller, judge_body
from rank_wire import TIMING_KEYS, TIMING_ROW
from tests.support.monitor_sim import SimRanks
from tests.support.rank_rows import unpack_rows
from tests.support.virtual_ranks import VirtualRanks
from worker_server import RankIdentity, RankState, WorkerServer


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
    """The kept bytes are the served rows and step times, in order; every other key is left
    as parsed."""
    for body in answers():
        served, kept = json.loads(body), pack_state(json.loads(body))
        rows = served["timing"]["recent"]
        assert type(kept["timing"]["recent"]) is bytes
        assert len(kept["timing"]["recent"]) == len(rows) * TIMING_ROW.size
        assert unpack_rows(kept["timing"]["recent"]) == \
            [(r["step"], tuple(r[k] for k in TIMING_KEYS)) for r in rows]
        assert RankView("u", True, kept).recent_steps() == served["recent_step_seconds"]
        assert {k: v for k, v in kept.items() if k not in ("timing", "recent_step_seconds")} == \
            {k: v for k, v in served.items() if k not in ("timing", "recent_step_seconds")}
        assert {k: v for k, v in kept["timing"].items() if k != "recent"} == \
            {k: v for k, v in served["timing"].items() if k != "recent"}


def test_an_answer_without_the_lists_is_left_as_it_is():
    for odd in ({"timing": None}, {"timing": "garbage"}, {"step": 3}, {}):
        assert pack_state(json.loads(json.dumps(odd))) == odd
    assert pack_state({"timing": {"recent": None}, "recent_step_seconds": {"a": 1}}) == \
        {"timing": {"recent": b""}, "recent_step_seconds": b""}


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
            assert [s for s, _ in unpack_rows(p.data["timing"]["recent"])] == [98, 100]
            assert math.isclose(RankView("u", True, p.data).recent_steps()[0], 0.2)
    finally:
        thread.close()
        process.close()


STAMPS = ("phase_since", "last_step_at", "started_at")  # a template's, made at its first answer


def bytes_at(doc, path=()) -> list[tuple]:
    """The paths of every bytes value in ``doc``."""
    if isinstance(doc, bytes):
        return [path]
    if isinstance(doc, dict):
        return [p for k, v in doc.items() for p in bytes_at(v, (*path, k))]
    if isinstance(doc, list):
        return [p for i, v in enumerate(doc) for p in bytes_at(v, (*path, i))]
    return []


def test_an_answer_served_packed_is_kept_as_the_lists_packed_here():
    """A rank asked ``?packed=1`` serves the two lists as base64 records: the monitor keeps
    the same bytes it makes of the lists (the same numbers, bit for bit), and has bytes in
    those two places only."""
    vr = VirtualRanks(16, 0, 8, 1.0, epoch=time.monotonic() - 40.3)
    step = json.loads(vr.state_asked(0))["step"]
    for rank, query in ((0, f"?since={step - 2}&recent=16"), (1, f"?since={step - 9}&recent=16"),
                        (2, "?recent=16"), (3, "")):
        plain = judge_body("u", vr.state_asked(rank, query), 0.0, 1.0, state=True).data
        body = vr.state_asked(rank, query + ("&" if query else "?") + "packed=1")
        assert type(json.loads(body)["timing"]["recent"]) is str  # as served: base64
        served = judge_body("u", body, 0.0, 1.0, state=True).data
        assert served.pop("packed") == 1
        for doc in (plain, served):
            for k in STAMPS:
                doc.pop(k)
        assert served == plain, query
        assert set(bytes_at(served)) == {("timing", "recent"), ("recent_step_seconds",)}
        assert RankView("u", True, served).recent_steps() == \
            RankView("u", True, plain).recent_steps()


def test_a_worker_server_asked_as_the_monitor_asks_is_kept_as_its_lists_packed():
    """A real WorkerServer over HTTP, asked with the detectors' queries (``packed=1``) by the
    in-thread poller: the kept answers equal its plain answers packed by the monitor."""
    state = RankState(RankIdentity(job="unit", replica_group=0, group_rank=0,
                                   group_world_size=1, lighthouse="http://127.0.0.1:1"))
    for step in range(1, 25):
        state.step_started()
        state.step_finished(step, committed=True)
        state.timing.begin_step()
        state.timing.end_step(step)
    srv = WorkerServer(state)
    srv.serve()
    poller = Poller(timeout_s=2.0)
    try:
        (query,) = Detectors(DetectorConfig()).state_queries([srv.url])
        assert "packed=1" in query
        got = poller.sweep([srv.url], STATE_PATH, queries=[query])[srv.url]
        plain = poller.sweep([srv.url], STATE_PATH, queries=[query.replace("packed=1",
                                                                           "packed=0")])[srv.url]
        assert got.ok and plain.ok
        assert got.data.pop("packed") == 1
        assert type(got.data["timing"]["recent"]) is bytes
        assert len(got.data["timing"]["recent"]) == 24 * TIMING_ROW.size  # all 24: it keeps 32
        for doc in (got.data, plain.data):
            doc.pop("phase_since")
        assert got.data == plain.data  # both packed: the served bytes and the monitor's own
        assert [s for s, _ in unpack_rows(got.data["timing"]["recent"])] == list(range(1, 25))
    finally:
        poller.close()
        srv.stop()
