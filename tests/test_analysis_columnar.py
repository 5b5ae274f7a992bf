"""The loader's fast path (``normalize_columnar``) against ``normalize`` itself.

Every dump the generator makes, healthy or faulty, common or not, must normalize to an equal
RankTrace both ways, and a malformed dump must raise the same error; the common shapes must
actually take the fast path (else the equality would hold vacuously).
"""

from __future__ import annotations

import copy
import json
import random
from array import array

import pytest

from monitor.analysis import analyze, columnar, model, wire
from monitor.analysis.columnar import normalize_columnar, normalize_packed
from monitor.analysis.model import DumpFormatError, normalize
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


def resolved(trace) -> dict:
    """What a trace says per group and sequence id, signatures by value instead of by id."""
    return {
        key: (g.first_seq, [trace.signatures[i] for i in g.sigs], g.states, g.created_ns, g.duration_ms)
        for key, g in trace.groups.items()
    }


FAST = {
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
EQUAL_BY_VALUE = {"numbers of different types": numbers_of_different_types}
FALLBACK = {
    "torchft incarnations": torchft,
    "coalesced": coalesced,
    "p2p": p2p,
    "gap and restart": with_gap_and_restart,
    "without optional keys": without_optional_keys,
    "names of two types": names_of_two_types,
    "some without duration": some_without_duration,  # rank 0's None is fast, rank 1's gap is not
}


@pytest.fixture
def fallbacks(monkeypatch) -> list[int]:
    """Ranks whose whole dump went to normalize (the header-only call does not count)."""
    seen: list[int] = []

    def spy(dump, rank=None):
        if isinstance(dump, dict) and dump.get("entries"):
            seen.append(rank)
        return model.normalize(dump, rank)

    monkeypatch.setattr(columnar, "normalize", spy)
    return seen


@pytest.mark.parametrize("name", sorted(FAST) + sorted(FALLBACK))
def test_same_trace_as_normalize(name, fallbacks):
    dumps = {**FAST, **FALLBACK}[name]()
    pristine = copy.deepcopy(dumps)
    for rank, dump in dumps.items():
        assert normalize_columnar(dump, rank) == normalize(dump, rank), (name, rank)
    assert dumps == pristine  # neither changes the dump
    if name in FAST:
        assert fallbacks == []
    else:
        assert fallbacks, "expected normalize to take at least one of these dumps"


def packed_form(packed: wire.Packed) -> tuple:
    """A packed trace, comparable: arrays by type code and values, every value by its repr (so
    that NaN equals NaN, and 3 differs from 3.0)."""
    def column(c):
        return ("array", c.typecode, repr(c.tolist())) if type(c) is array else repr(c)

    return packed.trace, {key: tuple(map(column, cols)) for key, cols in packed.columns.items()}, packed.members


@pytest.mark.parametrize("name", sorted(FAST) + sorted(FALLBACK))
def test_packed_straight_from_the_dump_as_normalize_then_pack(name, fallbacks):
    # the workers' path (normalize_packed) sends what packing normalize's trace would send
    dumps = {**FAST, **FALLBACK}[name]()
    pristine = copy.deepcopy(dumps)
    for rank, dump in dumps.items():
        assert packed_form(normalize_packed(dump, rank)) == packed_form(wire.pack(normalize(dump, rank))), (name, rank)
    assert dumps == pristine
    if name in FAST:
        assert fallbacks == []
    else:
        assert fallbacks, "expected normalize to take at least one of these dumps"


def test_signatures_equal_but_of_other_types_share_an_id_and_reports_agree(fallbacks):
    dumps = numbers_of_different_types()
    fast = {r: normalize_columnar(d, r) for r, d in dumps.items()}
    slow = {r: normalize(d, r) for r, d in dumps.items()}
    assert fallbacks == []
    assert len(fast[0].signatures) < len(slow[0].signatures)  # the documented difference
    for rank in dumps:
        assert resolved(fast[rank]) == resolved(slow[rank])
        assert fast[rank].last_entry == slow[rank].last_entry
    by_fast, by_slow = analyze(fast).to_dict(), analyze(slow).to_dict()
    assert by_fast == by_slow and [f["kind"] for f in by_fast["findings"]] == ["mismatch"]


def test_signature_ids_follow_first_occurrence_across_groups():
    # group "1" uses the default group's signature too, and is seen first in the dump
    job = tp_job()
    job.collective("1", "all_reduce", [[1024]])
    job.repeat(4, STEP)
    dump = job.dumps()[0]
    fast, slow = normalize_columnar(dump, 0), normalize(dump, 0)
    assert fast.signatures == slow.signatures and len(fast.signatures) == 2
    assert fast.groups == slow.groups


BAD = [
    [],
    "not a dump",
    {"entries": []},
    {"version": "3.0", "entries": [{}]},
    {"version": "2.10", "entries": "nope"},
    {"version": "2.10", "entries": [{"unrelated": 1}]},
    {"version": "2.10", "entries": [{"process_group": ["0", ""], "profiling_name": "nccl:all_reduce", "record_id": 0, "collective_seq_id": "x"}]},
    {"version": "2.10", "incarnations": "nope", "entries": []},
]


@pytest.mark.parametrize("bad", BAD, ids=range(len(BAD)))
def test_malformed_dump_raises_what_normalize_raises(bad):
    with pytest.raises(DumpFormatError) as expected:
        normalize(bad, 1)
    for fast in (normalize_columnar, normalize_packed):
        with pytest.raises(DumpFormatError) as got:
            fast(bad, 1)
        assert str(got.value) == str(expected.value)


def test_malformed_entry_in_a_common_dump_raises_what_normalize_raises():
    dump = plain_dump(0, 2, 20)
    dump["entries"][7]["collective_seq_id"] = "7"
    with pytest.raises(DumpFormatError) as expected:
        normalize(dump, 0)
    for fast in (normalize_columnar, normalize_packed):
        with pytest.raises(DumpFormatError) as got:
            fast(dump, 0)
        assert str(got.value) == str(expected.value)
