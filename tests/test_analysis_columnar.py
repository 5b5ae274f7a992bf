"""normalize on every dump shape the generator makes, healthy or faulty, common or not.

What each uncommon shape means for the trace is asserted here; every shape must come back from
the workers' packed form (``normalize_packed``, pickled and unpacked) as ``normalize`` gives it,
and neither may change the dump; a malformed dump raises the same error either way.
"""

from __future__ import annotations

import copy
import json
import math
import random

import pytest

from monitor.analysis import GroupKey, analyze, wire
from monitor.analysis.columnar import normalize, normalize_packed
from monitor.analysis.model import DumpFormatError
from tests.support.frgen import TP_STEP, FRJob, plain_dump, steady_dump, tp_job

STEP = TP_STEP


def faulty(flavour: str) -> dict[int, dict]:
    job = tp_job(flavour, seed=3)
    job.repeat(12, STEP)
    job.collective("1", "all_gather", [[64]], ops={1: "broadcast"})
    job.collective("2", "all_gather", [[64]], rank_sizes={3: [[65]]})
    job.repeat(12, STEP, delay_ms={2: 4.0})
    job.collective("0", "all_reduce", [[1024]], absent=[3])
    return job.dumps(buffer_size={0: 30, 1: 41, 2: 55, 3: 70})


def repeated_group_in_a_step() -> dict[int, dict]:
    # the default group twice per step: one name at two places of the period
    job = tp_job()
    job.repeat(10, [("0", "all_reduce", [[8]]), ("1", "all_gather", [[8]]), ("0", "broadcast", [[8]]), ("2", "all_gather", [[8]])])
    return job.dumps()


def no_fixed_order() -> dict[int, dict]:
    job = tp_job(seed=9)
    order = random.Random(9)
    for _ in range(40):
        pg, op, sizes = order.choice(STEP)
        job.collective(pg, op, sizes)
    return job.dumps(buffer_size=50)


def scoped_to_a_replica_group() -> dict[int, dict]:
    job = tp_job()
    job.repeat(5, STEP)
    dumps = job.dumps()
    for rank, dump in dumps.items():
        dump.update(replica_group=rank // 2, group_world_size=2, host=f"host{rank // 2}", dump_time_ns=123)
    return dumps


def numbers_of_different_types() -> dict[int, dict]:
    # 8 and 8.0, 1 and True: equal to ==, not to normalize's signature keys (rank 0)
    job = tp_job()
    job.repeat(6, [("0", "all_reduce", [[8]]), ("1", "all_gather", [[4]])])
    job.collective("1", "all_gather", [[4]], rank_sizes={1: [[5]]})
    dumps = job.dumps()
    for e in dumps[0]["entries"]:
        if e["process_group"][0] == "1":
            e["input_sizes"] = [[1]]
    dumps[0]["entries"][2]["input_sizes"] = [[8.0]]
    dumps[0]["entries"][3]["input_sizes"] = [[True]]
    return dumps


def torchft() -> dict[int, dict]:
    job = FRJob(4, flavour="gloo", replica_group_size=2, seed=4)
    job.quorum(1, [0, 1])
    for _ in range(4):
        job.ft_collective()
    return job.dumps()


def coalesced() -> dict[int, dict]:
    dumps = plain(3, 5)
    for dump in dumps.values():
        tail = dict(dump["entries"][-1])
        dump["entries"].append(dict(tail, record_id=tail["record_id"] + 1, input_sizes=[[16]]))
    return dumps


def p2p() -> dict[int, dict]:
    dumps = plain(2, 5)
    send = dict(dumps[0]["entries"][-1], profiling_name="nccl:send 0->1", is_p2p=True, record_id=99)
    dumps[0]["entries"].append(send)
    return dumps


def with_gap_and_restart() -> dict[int, dict]:
    dumps = plain(3, 12)
    del dumps[0]["entries"][5]  # seq 6 missing
    for e in dumps[1]["entries"][6:]:
        e["collective_seq_id"] -= 6  # a new group reused the name
    return dumps


def without_optional_keys() -> dict[int, dict]:
    dumps = faulty("nccl")
    for dump in dumps.values():
        for e in dump["entries"]:
            for key in ("thread_name", "thread_id", "duration_ms", "is_p2p", "timeout_ms"):
                e.pop(key, None)
    return dumps


def some_without_duration() -> dict[int, dict]:
    dumps = plain(2, 6)
    del dumps[1]["entries"][3]["duration_ms"]
    dumps[0]["entries"][2]["duration_ms"] = None
    return dumps


def names_of_two_types() -> dict[int, dict]:
    dumps = plain(2, 6)
    dumps[0]["entries"][1]["process_group"] = [0, "default_pg"]  # str(0) == "0": one group
    return dumps


def plain(ranks: int, entries: int, **kwargs) -> dict[int, dict]:
    return {r: plain_dump(r, ranks, entries, **kwargs) for r in range(ranks)}


def json_round_trip(dumps: dict[int, dict]) -> dict[int, dict]:
    return {r: json.loads(json.dumps(d)) for r, d in dumps.items()}


COMMON = {
    "steady": lambda: {r: steady_dump(r, 16, 300) for r in range(16)},
    "steady gloo": lambda: {r: steady_dump(r, 16, 301, flavour="gloo") for r in range(16)},
    "plain": lambda: plain(8, 300),
    "plain gloo, 3 frames": lambda: plain(4, 50, flavour="gloo", frames=3),
    "plain one entry": lambda: plain(2, 1),
    "faulty nccl": lambda: faulty("nccl"),
    "faulty gloo": lambda: faulty("gloo"),
    "faulty json": lambda: json_round_trip(faulty("nccl")),
    "repeated group in a step": repeated_group_in_a_step,
    "no fixed order": no_fixed_order,
    "scoped to a replica group": scoped_to_a_replica_group,
}
UNCOMMON = {
    "numbers of different types": numbers_of_different_types,
    "torchft incarnations": torchft,
    "coalesced": coalesced,
    "p2p": p2p,
    "gap and restart": with_gap_and_restart,
    "without optional keys": without_optional_keys,
    "names of two types": names_of_two_types,
    "some without duration": some_without_duration,
}
SHAPES = {**COMMON, **UNCOMMON}


def form(trace) -> tuple:
    """A trace, comparable whether its columns are lists or arrays: each group's columns by
    their values' repr (NaN equals NaN, 3 differs from 3.0), signatures by value."""
    groups = {key: (g.first_seq, [None if i is None else trace.signatures[i] for i in g.sigs], list(g.states),
                    repr(list(g.created_ns)), repr(list(g.duration_ms))) for key, g in trace.groups.items()}
    return (trace.rank, trace.flavour, trace.host, trace.oldest_record_id, trace.members, trace.incarnations,
            trace.last_entry, trace.is_torchft, trace.dump_time_ns, groups)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_workers_packed_trace_is_normalizes_trace(name):
    dumps = SHAPES[name]()
    pristine = copy.deepcopy(dumps)
    for rank, dump in dumps.items():
        sent = wire.from_bytes(wire.to_bytes(normalize_packed(dump, rank)))
        assert form(sent) == form(normalize(dump, rank)), (name, rank)
    assert dumps == pristine  # neither changes the dump


def test_what_the_uncommon_shapes_mean():
    key = GroupKey("0")
    trace = normalize(coalesced()[1], 1)  # two entries at the last seq
    c = trace.groups[key]
    assert (c.last_seq, len(c.sigs), trace.signatures[c.sigs[-1]].op) == (10, 5, "coalesced")
    sent = normalize(p2p()[0], 0)
    assert sent.groups[key].last_seq == 10 and sent.last_entry["op"] == "send"
    gapped = with_gap_and_restart()
    assert normalize(gapped[0], 0).groups[key].sigs[5] is None  # a seq missing
    restarted = normalize(gapped[1], 1).groups[key]
    assert restarted.duration_ms == [e["duration_ms"] for e in gapped[1]["entries"][6:]]  # the newest run only
    assert list(normalize(names_of_two_types()[0], 0).groups) == [key]
    partly = some_without_duration()
    for rank, missing in ((0, 2), (1, 3)):
        durations = normalize(partly[rank], rank).groups[key].duration_ms
        assert [math.isnan(d) for d in durations] == [i == missing for i in range(6)]
    ft = normalize(torchft()[0], 0)
    assert ft.is_torchft and all(k.quorum_id == 1 for k in ft.groups)
    bare, full = without_optional_keys(), faulty("nccl")
    for rank in bare:
        assert {k: g.sigs for k, g in normalize(bare[rank], rank).groups.items()} == \
               {k: g.sigs for k, g in normalize(full[rank], rank).groups.items()}
    # 8 and 8.0 in one rank's sizes: the analysis still finds the one real mismatch
    report = analyze({r: normalize(d, r) for r, d in numbers_of_different_types().items()}).to_dict()
    assert [f["kind"] for f in report["findings"]] == ["mismatch"]


def test_signature_ids_follow_first_occurrence_across_groups():
    # group "1" uses the default group's signature too, and is seen first in the dump
    job = tp_job()
    job.collective("1", "all_reduce", [[1024]])
    job.repeat(4, STEP)
    trace = normalize(job.dumps()[0], 0)
    assert len(trace.signatures) == 2 and trace.signatures[0].op == "all_reduce"
    assert trace.groups[GroupKey("1")].sigs[0] == trace.groups[GroupKey("0")].sigs[0] == 0


BAD = [
    [],
    "not a dump",
    {"entries": []},
    {"version": "3.0", "entries": [{}]},
    {"version": "2.10", "entries": "nope"},
    {"version": "2.10", "entries": [{"unrelated": 1}]},
    {"version": "2.10", "entries": [{"process_group": ["0", ""], "profiling_name": "nccl:all_reduce", "record_id": 0, "collective_seq_id": "x",
                                     "input_sizes": [], "output_sizes": [], "input_dtypes": [], "output_dtypes": []}]},
    # no signature field: "entry 0 (record_id 0) has no 'input_sizes' field", not a size of []
    {"version": "2.10", "entries": [{"process_group": ["0", ""], "profiling_name": "nccl:all_reduce", "record_id": 0, "collective_seq_id": 1}]},
    {"version": "2.10", "incarnations": "nope", "entries": []},
]


@pytest.mark.parametrize("bad", BAD, ids=range(len(BAD)))
def test_malformed_dump_raises_dump_format_error(bad):
    with pytest.raises(DumpFormatError) as expected:
        normalize(bad, 1)
    with pytest.raises(DumpFormatError) as got:
        normalize_packed(bad, 1)
    assert str(got.value) == str(expected.value)


def test_malformed_entry_in_a_common_dump_is_named():
    dump = plain_dump(0, 2, 20)
    dump["entries"][7]["collective_seq_id"] = "7"
    for fn in (normalize, normalize_packed):
        with pytest.raises(DumpFormatError, match="no integer collective_seq_id"):
            fn(dump, 0)
