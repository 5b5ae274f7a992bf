"""monitor/detect/step_memory.py: the detectors' per-rank step timings in columns, against a plain dict
memory folded row by row from what the ranks served."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest

from monitor.detect.step_memory import NONE, StepMemory
from rank_wire import TIMING_ROW, pack_rows
from tests.support.rank_rows import unpack_rows


def served_row(rng: random.Random, step: int) -> dict:
    row = {"step": step, "step_s": rng.random(), "compute_s": rng.random(),
           "wait_cross_s": rng.random() / 4, "wait_group_s": rng.random() / 8}
    kind = rng.random()
    if kind < 0.04:
        row["step_s"] = -1.0  # not valid: left out
    elif kind < 0.06:
        row["step"] = str(step)  # not an int step: left out when packed
    elif kind < 0.08:
        del row["compute_s"]
    return row


def rows(mem: StepMemory, url: str) -> dict[int, tuple]:
    """``url``'s folded rows, {step: its four seconds}, oldest first."""
    slot = mem.slot.get(url)
    if slot is None:
        return {}
    steps = mem.common_steps(np.asarray([slot]))
    return {s: tuple(v) for s, v in zip(steps, mem.seconds([slot], steps)[0].tolist(),
                                        strict=True)}


def test_folding_answers_keeps_the_newest_depth_steps_a_row_by_row_fold_keeps():
    """Random ranks, each polled now and then for its last 16 steps (some missing, some
    malformed, some answers served in full again, some asked only past the newest folded
    step), restarted now and then under a new replica id: after every fold each rank's memory
    is the rows a row-by-row fold of the same answers holds for the steps after its newest
    folded step less the depth, and its newest step is that fold's."""
    rng = random.Random(7)
    depth = 8
    mem = StepMemory(depth, capacity=4)  # grows as ranks come
    ranks = [f"http://r{i}" for i in range(23)]
    history = {u: [served_row(rng, s) if rng.random() < 0.93 else None for s in range(200)]
               for u in ranks}
    rid = {u: "a" for u in ranks}
    ref: dict[str, dict[int, tuple]] = {u: {} for u in ranks}
    at = {u: rng.randrange(0, 10) for u in ranks}
    folded_any = 0
    for _ in range(60):
        polled = [u for u in ranks if rng.random() < 0.7 and at[u] < 200]
        slots, blobs = [], []
        for u in polled:
            if rng.random() < 0.05:  # a new incarnation: its memory starts from nothing
                rid[u] = rid[u] + "'"
                ref[u] = {}
            served = [r for r in history[u][max(0, at[u] - 15):at[u] + 1] if r is not None]
            newest = max(ref[u]) if ref[u] else None
            if newest is not None and rng.random() < 0.5:  # asked ?since=newest
                served = [r for r in served if not isinstance(r["step"], int)
                          or r["step"] > newest]
            slots.append(mem.take(u, rid[u]))
            blobs.append(pack_rows(served))
            new = {s: v for s, v in unpack_rows(pack_rows(served))
                   if newest is None or s > newest}
            ref[u].update(new)
            at[u] += rng.randrange(1, 6)
        added = mem.fold(slots, blobs)
        for u, n in zip(polled, added, strict=True):
            newest = max(ref[u]) if ref[u] else None
            assert mem.newest(u) == newest
            want = {s: v for s, v in sorted(ref[u].items()) if s > newest - depth} \
                if newest is not None else {}
            assert rows(mem, u) == want, u
            folded_any += n
    assert folded_any > 500


def test_a_rank_not_kept_is_forgotten_and_the_room_given_back():
    mem = StepMemory(4, capacity=4)
    urls = [f"http://r{i}" for i in range(5000)]
    slots = [mem.take(u, "x") for u in urls]
    mem.fold(slots, [TIMING_ROW.pack(i, 1.0, 0.5, 0.25, float(i)) for i in range(len(urls))])
    kept = set(urls[::100])
    mem.keep_only(kept)
    assert set(mem.slot) == kept
    assert len(mem.rid) < 5000  # compacted: the forgotten ranks' room given back
    for i in range(0, 5000, 100):
        assert rows(mem, urls[i]) == {i: (1.0, 0.5, 0.25, float(i))}
    assert mem.newest(urls[1]) is None and rows(mem, urls[1]) == {}
    # a slot reused after forgetting starts empty
    s = mem.take(urls[1], "x")
    assert mem.fold([s], [b""]) == [0] and mem.newest(urls[1]) is None


def test_a_new_replica_id_starts_clean_and_a_step_served_twice_keeps_its_last_row():
    mem = StepMemory(8)
    s = mem.take("u", "a")
    mem.fold([s], [TIMING_ROW.pack(5, 1.0, 1.0, 0.0, 0.0)])
    assert mem.take("u", "a") == s and rows(mem, "u") == {5: (1.0, 1.0, 0.0, 0.0)}
    s = mem.take("u", "b")
    assert rows(mem, "u") == {} and mem.newest("u") is None
    assert mem.fold([s], [TIMING_ROW.pack(3, 1.0, 0.0, 0.0, 0.0)
                          + TIMING_ROW.pack(3, 2.0, 0.0, 0.0, 0.0)]) == [1]
    assert rows(mem, "u") == {3: (2.0, 0.0, 0.0, 0.0)}


def test_rows_far_behind_or_at_int64s_edge_are_dropped_without_an_error():
    mem = StepMemory(4)
    s = mem.take("u", "a")
    lo, hi = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    blob = b"".join(TIMING_ROW.pack(step, 1.0, 1.0, 1.0, 1.0)
                    for step in (100, 10, lo, lo + 1, 101, 102))
    blob += struct.pack("<q4d", 103, float("nan"), 0.0, 0.0, 0.0)  # malformed seconds
    assert mem.fold([s], [blob]) == [3]  # 100, 101, 102: 10 is more than 4 steps behind
    assert sorted(rows(mem, "u")) == [100, 101, 102] and mem.newest("u") == 102
    assert mem.fold([s], [TIMING_ROW.pack(hi, 0.0, 0.0, 0.0, 0.0)]) == [1]
    assert rows(mem, "u") == {hi: (0.0, 0.0, 0.0, 0.0)}
    assert NONE == lo


@pytest.mark.parametrize("seed", range(5))
def test_common_steps_and_their_seconds_are_those_of_every_ranks_rows(seed):
    """The steps every given rank has (not only the newest ``depth`` of the least advanced
    one's places: a place not written since a skipped step holds no row of the memory) and
    their seconds, against the ranks' rows read one by one."""
    rng = random.Random(seed)
    mem = StepMemory(6)
    urls = [f"u{i}" for i in range(12)]
    slots = [mem.take(u, "r") for u in urls]
    for _ in range(8):
        blobs = []
        for u in urls:
            top = (mem.newest(u) or 0) + rng.randrange(0, 4)
            steps = [s for s in range(top - 7, top + 1) if s >= 0 and rng.random() < 0.9]
            blobs.append(b"".join(TIMING_ROW.pack(s, rng.random(), 0.0, rng.random(), 0.0)
                                  for s in steps))
        mem.fold(slots, blobs)
        pick = rng.sample(range(len(urls)), rng.randrange(1, len(urls) + 1))
        got_rows = [rows(mem, urls[i]) for i in pick]
        want = sorted(set.intersection(*(set(r) for r in got_rows)))
        got = mem.common_steps(np.asarray([slots[i] for i in pick]))
        assert got == want
        if got:
            sec = mem.seconds([slots[i] for i in pick], got).tolist()
            assert sec == [[list(r[s]) for s in got] for r in got_rows]


def test_a_quorum_wait_is_kept_only_where_it_could_be_true():
    """Per folded row, its ``wait_quorum_s`` from the same answer: finite, >= 0 and within its
    row's ``step_s`` (+1 ms; a rank serving ms, or anything else larger, cannot be right), else
    NaN; a record of a step not folded is dropped, and a new row in a place starts unknown."""
    mem = StepMemory(depth=4)
    slot = mem.take("u", "r")
    served = pack_rows([{"step": s, "step_s": 0.5, "compute_s": 0.2, "wait_cross_s": 0.2,
                         "wait_group_s": 0.1} for s in range(1, 6)])
    waits = [(1, 0.25), (2, 0.5005), (3, 0.502), (4, -0.1), (5, float("nan")), (9, 0.1)]
    blob = b"".join(struct.pack("<qd", s, v) for s, v in waits)
    assert mem.fold([slot], [served], [blob]) == [4]  # steps 2-5: depth 4
    got = mem.quorum([slot], [2, 3, 4, 5])[0].tolist()
    assert got[0] == 0.5005 and all(np.isnan(got[1:])), got
    more = pack_rows([{"step": 6, "step_s": 0.5, "compute_s": 0.2, "wait_cross_s": 0.2,
                       "wait_group_s": 0.1}])
    mem.fold([slot], [more], [struct.pack("<qd", 2, 0.1)])  # step 2's place is step 6's now
    assert np.isnan(mem.quorum([slot], [6])).all()
