"""The analyzer on real NCCL Flight Recorder dumps (tests/fixtures/nccl-fr-h100/, made on an H100
with torch 2.11.0+cu130 / NCCL 2.28.9 by benchmarks/gpu/nccl_fr_dump.py; its README says how).

CPU machines cannot make NCCL dumps, so these files are the only real NCCL format the suite sees;
the other analysis tests use the synthetic generator (tests/support/frgen.py). What the real
format has that the synthetic one does not is listed in docs/gpu.md; the tests below pin each
difference the loader must survive: ``process_group`` as a tuple in pickles, an unfinished
entry without a ``duration_ms`` key (and ``None`` discovery times), a coalesced collective
written as two entries with one sequence id, ``all_reduce_barrier``, and the dump the watchdog
itself writes on a collective timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``).

The job had one GPU, so every group has world size 1 (NCCL refuses two ranks on one GPU); the
cross-rank test at the end derives a second rank from the real timeout dump.
"""

from __future__ import annotations

import copy
import json
import math
import pickle
from pathlib import Path

import pytest

from lightkeeper.cli import main
from monitor.analysis import GroupKey
from monitor.analysis.columnar import normalize
from monitor.analysis.loader import load_paths, read_dump
from monitor.analysis.model import COMPLETED, SCHEDULED

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "nccl-fr-h100"


def trace_of(path: Path):
    loaded = load_paths([path])
    assert loaded.errors == []
    (trace,) = loaded.traces.values()
    return trace


def resolved(trace, key: GroupKey) -> list[tuple]:
    """One group's collectives as comparable rows: (seq, signature, state, created, duration)."""
    g = trace.groups[key]
    return [(g.first_seq + i, trace.signatures[s], st, c, d)
            for i, (s, st, c, d) in enumerate(zip(g.sigs, g.states, g.created_ns, g.duration_ms,
                                                  strict=True))]


def test_pickle_and_json_dumps_of_the_job_normalize_alike_with_gpu_durations():
    pickled = trace_of(FIXTURE / "pickle" / "rank0")
    from_json = trace_of(FIXTURE / "json" / "rank0.json")
    for trace in (pickled, from_json):
        assert trace.rank == 0  # no 'rank' key in torch's dumps: from the file name
        assert trace.flavour == "nccl"
        assert set(trace.groups) == {GroupKey("0"), GroupKey("1"), GroupKey("2")}
        assert trace.members[GroupKey("1")] == (0,)
        assert {k: (g.first_seq, g.last_seq) for k, g in trace.groups.items()} == {
            GroupKey("0"): (1, 8), GroupKey("1"): (1, 12), GroupKey("2"): (1, 12)}
        for g in trace.groups.values():
            assert set(g.states) == {COMPLETED}
            # TORCH_NCCL_ENABLE_TIMING: every completed entry has its GPU time, microseconds on
            # a world-size-1 group
            assert all(0 < d < 50 for d in g.duration_ms), g.duration_ms
    for key in pickled.groups:
        assert resolved(pickled, key) == resolved(from_json, key)


def test_the_real_op_names_and_the_coalesced_pair():
    trace = trace_of(FIXTURE / "pickle" / "rank0")
    ops = {key.pg: [trace.signatures[s].op for s in g.sigs[:4]] for key, g in trace.groups.items()}
    assert ops == {
        "0": ["all_reduce", "all_reduce_barrier", "all_reduce", "all_reduce_barrier"],
        "1": ["_all_gather_base", "all_gather", "_reduce_scatter_base", "_all_gather_base"],
        "2": ["broadcast", "all_to_all", "coalesced", "broadcast"],
    }
    # _coalescing_manager's two all_reduces: 'allreduce_coalesced' (both tensors) then
    # 'coalesced' (no sizes), one sequence id: one collective with both parts
    coalesced = trace.signatures[trace.groups[GroupKey("2")].sigs[2]]
    assert [p.op for p in coalesced.parts] == ["allreduce_coalesced", "coalesced"]
    assert coalesced.parts[0].input_sizes == ((64,), (32,))
    # all_to_all's sizes may differ between ranks: not compared
    assert trace.signatures[trace.groups[GroupKey("2")].sigs[1]].input_sizes is None


def test_a_collective_stuck_behind_a_kernel_has_no_duration_key_and_stays_scheduled():
    raw = read_dump(FIXTURE / "inflight" / "rank0")
    stuck = raw["entries"][-1]
    assert "duration_ms" not in stuck and stuck["time_discovered_started_ns"] is None
    assert raw["pg_status"]["1"]["last_enqueued_collective"] == 13
    assert raw["pg_status"]["1"]["last_started_collective"] == 12
    for name in ("rank0", "rank0.json"):
        trace = trace_of(FIXTURE / "inflight" / name)
        g = trace.groups[GroupKey("1")]
        assert g.last_seq == 13 and g.states[-1] == SCHEDULED and math.isnan(g.duration_ms[-1])
        assert all(d > 0 for d in g.duration_ms[:-1])  # the finished ones keep theirs
        assert trace.last_entry == {"pg": "1", "seq": 13, "op": "all_reduce", "state": "scheduled"}


def test_an_only_active_dump_holds_just_the_unfinished_collective():
    trace = trace_of(FIXTURE / "inflight" / "active-rank0.json")
    assert list(trace.groups) == [GroupKey("1")]
    g = trace.groups[GroupKey("1")]
    assert (g.first_seq, g.last_seq, g.states) == (13, 13, [SCHEDULED])
    # no entry carries timing, so nothing marks it as NCCL: the engine falls back to enqueue
    # times for stragglers, and there is no duration to compare anyway (docs/gpu.md)
    assert trace.flavour == "gloo"


def test_the_dump_the_watchdog_writes_on_a_timeout_loads():
    path = FIXTURE / "timeout" / "rank0"
    raw = read_dump(path)
    assert raw["entries"][-1]["timeout_ms"] == 4000 and raw["entries"][-1]["frames"]
    trace = trace_of(path)
    key = GroupKey("1")
    assert trace.groups[key].last_seq == 4 and trace.groups[key].states[-1] == SCHEDULED
    assert trace.last_entry == {"pg": "1", "seq": 4, "op": "all_reduce", "state": "scheduled"}


def test_lightkeeper_analyze_reads_every_fixture_directory(capsys):
    for sub in ("pickle", "json", "timeout"):
        assert main(["analyze", "--format", "json", str(FIXTURE / sub)]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["ranks"] == [0] and report["errors"] == [] and report["findings"] == []


def test_a_hang_across_ranks_in_the_real_timeout_dump_names_the_rank_that_never_enqueued(
        tmp_path, capsys):
    """Rank 1 is derived: rank 0's real dump with both groups declared as ranks [0, 1], less the
    stuck all_reduce (rank 1 never enqueued it). The entries stay as torch pickled them."""
    rank0 = read_dump(FIXTURE / "timeout" / "rank0")
    for cfg in rank0["pg_config"].values():
        cfg["ranks"] = "[0, 1]"
    rank1 = copy.deepcopy(rank0)
    rank1["entries"] = rank1["entries"][:-1]
    for rank, dump in ((0, rank0), (1, rank1)):
        (tmp_path / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(dump, protocol=2))
    assert main(["analyze", "--format", "json", str(tmp_path)]) == 1
    (finding,) = json.loads(capsys.readouterr().out)["findings"]
    assert {k: finding[k] for k in ("kind", "pg", "seq", "op", "culprit_ranks")} == {
        "kind": "hang", "pg": "1", "seq": 4, "op": "all_reduce", "culprit_ranks": [1]}


@pytest.mark.parametrize("name", ["rank0", "inflight/rank0", "timeout/rank0"])
def test_pickles_hold_plain_data_only(name):
    """The loader's unpickler refuses every class: torch's pickles must not need one."""
    path = FIXTURE / (name if "/" in name else f"pickle/{name}")
    assert isinstance(read_dump(path), dict)


def test_durations_survive_when_the_oldest_kept_entry_is_the_unfinished_one():
    """A wrapped ring buffer whose oldest kept entry is the stuck collective (it hung while other
    groups went on). Built from the real in-flight dump: its stuck entry, then group "0"'s real
    completed entries renumbered after it."""
    raw = read_dump(FIXTURE / "inflight" / "rank0")
    stuck = raw["entries"][-1]
    later = [copy.deepcopy(e) for e in raw["entries"] if e["process_group"][0] == "0"]
    for i, e in enumerate(later):
        e["record_id"], e["collective_seq_id"] = stuck["record_id"] + 1 + i, 9 + i
    wrapped = {**raw, "entries": [stuck, *later]}
    durations = normalize(wrapped, 0).groups[GroupKey("0")].duration_ms
    assert durations == [e["duration_ms"] for e in later]
