"""rank_wire, the one spec of a rank's timing rows and step times on the wire: the same
vectors (valid and invalid rows, step times) through the WorkerServer's writer
(worker_server/packed.py), the monitor's conversion of a plain answer and of a packed one
(monitor/poll/packed_state.py), and the monitor's readers (the view's step times, the
detectors' step memory): every path keeps exactly the valid ones, in the order served."""

from __future__ import annotations

import json
import math
import struct
import typing

import msgspec
import numpy as np
import pytest

import rank_wire
from monitor.detect.step_memory import StepMemory
from monitor.evidence.view import RankView
from monitor.poll import packed_state
from monitor.poll.packed_state import pack_state
from monitor.poll.poller import judge_body
from tests.support.rank_rows import unpack_rows
from worker_server.packed import state_packed

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
SECS = {"step_s": 1.0, "compute_s": 0.5, "wait_cross_s": 0.25, "wait_group_s": 0.125}


def row(step, **kw):
    return {"step": step, **SECS, **kw}


# (served row, valid): out of order on purpose (9 before 7); the int64 edges both ways
ROWS = [
    (row(9), True),
    (row(7), True),
    (row(8, step_s=2, compute_s=0), True),  # ints are seconds too
    (row(0, step_s=0.0, compute_s=0.0, wait_cross_s=0.0, wait_group_s=0.0), True),
    (row(-3), True),
    (row(I64_MAX), True),
    (row(I64_MIN), True),
    (row(I64_MAX + 1), False),
    (row(I64_MIN - 1), False),
    (row(10, step_s=math.nan), False),
    (row(11, wait_group_s=-0.1), False),
    (row(12, compute_s=math.inf), False),
    (row(13, compute_s=True), False),
    (row(14, wait_cross_s="1"), False),
    (row(15, step_s=None), False),
    (row(16, step_s=10**400), False),  # beyond a float
    ({"step": 17, "step_s": 1.0}, False),  # seconds missing
    (row(True), False),
    (row(False), False),
    (row(18.0), False),
    (row("19"), False),
    ("not a row", False),
    (None, False),
]
SECONDS = [(0.5, True), (3, True), (0.0, True), (-1.0, False), (math.nan, False),
           (math.inf, False), (True, False), ("x", False), (None, False), (10**400, False),
           (2.25, True)]


def expected_rows() -> list[tuple[int, tuple[float, ...]]]:
    return [(r["step"], tuple(float(r[k]) for k in rank_wire.TIMING_KEYS))
            for r, ok in ROWS if ok]


def expected_seconds() -> list[float]:
    return [float(v) for v, ok in SECONDS if ok]


def doc() -> dict:
    return {"timing": {"recent": [r for r, _ in ROWS], "waiting": None},
            "recent_step_seconds": [v for v, _ in SECONDS], "step": 3}


def test_valid_row_is_the_spec_of_every_vector():
    for r, ok in ROWS:
        if isinstance(r, dict):
            assert rank_wire.valid_row(r.get("step"), [r.get(k) for k in rank_wire.TIMING_KEYS]) \
                is ok, r
    for v, ok in SECONDS:
        assert rank_wire.valid_seconds(v) is ok, v


def kept_forms() -> dict[str, dict]:
    """The answer as the monitor keeps it, by each path it may take."""
    plain = json.dumps(doc()).encode()
    served = json.dumps(state_packed(doc())).encode()
    return {"plain": pack_state(json.loads(plain)),
            "plain, polled": judge_body("u", plain, 0.0, 1.0, state=True).data,
            "served packed": judge_body("u", served, 0.0, 1.0, state=True).data}


def test_writer_and_reader_keep_the_same_valid_rows_in_order():
    forms = kept_forms()
    blobs = {name: kept["timing"]["recent"] for name, kept in forms.items()}
    assert all(type(b) is bytes for b in blobs.values())
    assert len(set(blobs.values())) == 1, "the writer and the monitor pack the same bytes"
    for name, blob in blobs.items():
        assert unpack_rows(blob) == expected_rows(), name
    for name, kept in forms.items():
        assert type(kept["recent_step_seconds"]) is bytes
        assert RankView("u", True, kept).recent_steps() == expected_seconds(), name
        assert kept["step"] == 3 and kept["timing"]["waiting"] is None


def test_the_step_memory_folds_the_valid_rows():
    """The vectors but the int64 edges (a memory keeps its newest 32 steps), written by the
    WorkerServer, kept by the monitor, folded: the valid rows, and only those."""
    near = [r for r, _ in ROWS if not isinstance(r, dict) or type(r["step"]) is not int
            or abs(r["step"]) < 2**62]
    served = json.dumps(state_packed({"timing": {"recent": near}})).encode()
    blob = judge_body("u", served, 0.0, 1.0, state=True).data["timing"]["recent"]
    want = dict(s for s in expected_rows() if abs(s[0]) < 2**62)
    mem = StepMemory(depth=32)
    slot = mem.take("u", "r")
    assert mem.fold([slot], [blob]) == [len(want)]
    steps = mem.common_steps(np.asarray([slot]))
    assert steps == sorted(want)
    assert [tuple(v) for v in mem.seconds([slot], steps)[0].tolist()] == [want[s] for s in steps]


def test_invalid_records_a_rank_serves_packed_are_dropped_by_the_readers():
    """Another writer's records: the monitor keeps the bytes as served, and every reader
    drops the records that are not valid (NaN, negative, infinite seconds)."""
    records = [(5, 1.0, 0.5, 0.25, 0.125), (6, -1.0, 0.5, 0.25, 0.125),
               (7, math.nan, 0.0, 0.0, 0.0), (8, 0.0, math.inf, 0.0, 0.0),
               (9, 2.0, 1.0, 0.5, 0.25)]
    raw = b"".join(rank_wire.TIMING_ROW.pack(*r) for r in records)
    secs = struct.pack("<4d", 0.5, -2.0, math.nan, 0.75)
    answer = {"packed": 1, "timing": {"recent": rank_wire.encode(raw)},
              "recent_step_seconds": rank_wire.encode(secs)}
    kept = judge_body("u", json.dumps(answer).encode(), 0.0, 1.0, state=True).data
    assert kept["timing"]["recent"] == raw
    assert unpack_rows(raw) == [(5, (1.0, 0.5, 0.25, 0.125)), (9, (2.0, 1.0, 0.5, 0.25))]
    assert RankView("u", True, kept).recent_steps() == [0.5, 0.75]
    mem = StepMemory(depth=8)
    slot = mem.take("u", "r")
    assert mem.fold([slot], [raw]) == [2]
    assert mem.common_steps(np.asarray([slot])) == [5, 9]


@pytest.mark.parametrize("packed,recent,seconds", [
    (1, "not base64!", "AAA"), (1, rank_wire.encode(b"x" * 39), rank_wire.encode(b"x" * 9)),
    (1, "é" * 8, "\u2603"), (True, rank_wire.encode(rank_wire.TIMING_ROW.pack(5, 1, 1, 1, 1)),
                             rank_wire.encode(struct.pack("<d", 0.5))),
    (2, "", ""), ("1", "", ""), (None, "", ""), (1, "", "")])
def test_anything_but_the_format_is_kept_as_nothing_served(packed, recent, seconds):
    """Decoded only where the answer says ``"packed": 1`` (not ``true``, not another
    format), only strict base64 of whole records; anything else is kept as empty bytes, and
    a base64-looking value anywhere else in the answer is left alone."""
    answer = {"packed": packed, "host": recent, "timing": {"recent": recent},
              "recent_step_seconds": seconds}
    kept = judge_body("u", json.dumps(answer).encode(), 0.0, 1.0, state=True).data
    assert kept["timing"]["recent"] == b"" and kept["recent_step_seconds"] == b""
    assert kept["host"] == recent and kept["packed"] == packed


# timing.recent_quorum (rank_wire.QUORUM_RECORD): (served item, valid)
QUORUM = [
    ({"step": 9, "wait_quorum_s": 0.25}, True),
    ({"step": 7, "wait_quorum_s": 0}, True),  # an int is seconds too
    ({"step": I64_MIN, "wait_quorum_s": 1.5}, True),
    ({"step": 8, "wait_quorum_s": -0.1}, False),
    ({"step": 10, "wait_quorum_s": math.nan}, False),
    ({"step": 11, "wait_quorum_s": math.inf}, False),
    ({"step": 12, "wait_quorum_s": True}, False),
    ({"step": 13, "wait_quorum_s": None}, False),
    ({"step": 14}, False),
    ({"step": True, "wait_quorum_s": 0.5}, False),
    ({"step": 15.0, "wait_quorum_s": 0.5}, False),
    ({"step": I64_MAX + 1, "wait_quorum_s": 0.5}, False),
    ("not a record", False),
]


def test_quorum_waits_are_one_spec_for_the_writer_and_every_reader():
    for item, ok in QUORUM:
        if isinstance(item, dict):
            assert rank_wire.valid_quorum(item.get("step"), item.get("wait_quorum_s")) is ok, item
    want = b"".join(rank_wire.QUORUM_RECORD.pack(i["step"], float(i["wait_quorum_s"]))
                    for i, ok in QUORUM if ok)
    answer = {"timing": {"recent": [row(9)], "recent_quorum": [i for i, _ in QUORUM]}}
    plain = json.dumps(answer).encode()
    served = json.dumps(state_packed(json.loads(plain))).encode()
    assert json.loads(served)["packed"] == 1
    kept = [pack_state(json.loads(plain)),
            judge_body("u", plain, 0.0, 1.0, state=True).data,
            judge_body("u", served, 0.0, 1.0, state=True).data]
    assert [k["timing"]["recent_quorum"] for k in kept] == [want] * 3


def test_an_older_rank_serving_no_quorum_waits_is_read_as_before():
    """No ``recent_quorum`` (an older WorkerServer): its rows as before, its steps' quorum
    waits unknown (NaN) in the step memory."""
    served = json.dumps(state_packed({"timing": {"recent": [row(4), row(5)]}})).encode()
    kept = judge_body("u", served, 0.0, 1.0, state=True).data
    assert "recent_quorum" not in kept["timing"]
    assert unpack_rows(kept["timing"]["recent"]) == [(4, tuple(SECS.values())),
                                                     (5, tuple(SECS.values()))]
    mem = StepMemory(depth=8)
    slot = mem.take("u", "r")
    assert mem.fold([slot], [kept["timing"]["recent"]], [b""]) == [2]
    assert np.isnan(mem.quorum([slot], [4, 5])).all()


def test_a_rank_serving_quorum_waits_is_read_whole_by_a_monitor_that_ignores_them():
    """An older monitor (its schema without ``recent_quorum``, decoding only the 40-byte rows
    of an answer that says ``"packed": 1``) reads an upgraded rank as before: the format's
    version and the row record are unchanged, and the extra key is dropped unread."""
    assert rank_wire.PACKED_FORMAT == 1 and rank_wire.TIMING_ROW.size == 40
    upgraded = {"timing": {"recent": [row(4)], "recent_quorum": [
        {"step": 4, "wait_quorum_s": 0.125}]}, "step": 5}
    served = json.dumps(state_packed(upgraded)).encode()
    hints = typing.get_type_hints(packed_state._Timing, include_extras=True)
    old_timing = typing.TypedDict("OldTiming", {k: v for k, v in hints.items()
                                                if k != "recent_quorum"}, total=False)
    # the functional form: a class's annotations would be strings (this module's __future__)
    old = typing.TypedDict("Old", {"timing": old_timing, "packed": int},  # noqa: UP013
                           total=False)
    got = msgspec.json.Decoder(old).decode(served)
    assert set(got["timing"]) == {"recent"} and got["packed"] == 1
    raw = rank_wire.decode(got["timing"]["recent"], rank_wire.TIMING_ROW.size)
    assert unpack_rows(raw) == [(4, tuple(SECS.values()))]
