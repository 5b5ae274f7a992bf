"""A coalesced collective (several Flight Recorder entries under one ``collective_seq_id``)
compares as one across ranks: equal when every part matches, a mismatch naming the parts when
any differs; and a run of thousands of parts costs its parts once, not once per prefix (20,000
tiny parts took ``lightkeeper analyze`` 33 s and 4.6 GB)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from lightkeeper.cli import main
from monitor.analysis import loader

REPO = Path(__file__).resolve().parents[1]
READERS = ["", "1"]  # the C reader where built, Python's unpickler
PG = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}}
CLOSING = ("nccl:coalesced", [])  # torch's closing entry of a coalesced collective: no sizes


def entry(record_id: int, seq: int, name: str = "nccl:all_reduce", sizes: list | None = None) -> dict:
    sizes = [[4]] if sizes is None else sizes
    dtypes = ["Float"] * len(sizes)
    return {"process_group": ["0", "default_pg"], "collective_seq_id": seq, "p2p_seq_id": 0,
            "profiling_name": name, "input_sizes": sizes, "output_sizes": sizes, "input_dtypes": dtypes,
            "output_dtypes": dtypes, "state": "completed", "time_created_ns": 10**18 + record_id * 1000,
            "record_id": record_id, "is_p2p": False, "duration_ms": 1.0}


def write_job(path: Path, runs: dict[int, dict[int, list]]) -> None:
    """Three ranks, seqs 1..7 one all_reduce each except where ``runs[rank][seq]`` lists a
    coalesced collective's entries as ``(profiling_name, sizes)``."""
    for rank in range(3):
        entries: list[dict] = []
        for seq in range(1, 8):
            for name, sizes in runs.get(rank, {}).get(seq, [("nccl:all_reduce", [[4]])]):
                entries.append(entry(len(entries), seq, name, sizes))
        dump = {"version": "2.10", "rank": rank, "pg_config": PG, "entries": entries}
        (path / f"rank{rank}").write_bytes(pickle.dumps(dump))


def report_of(tmp_path: Path, capsys, monkeypatch, pure: str) -> tuple[int, dict]:
    monkeypatch.setenv(loader.PURE_PYTHON_ENV, pure)
    code = main(["analyze", "--format", "json", str(tmp_path)])
    return code, json.loads(capsys.readouterr().out)


def parts(*sizes: int) -> list:
    return [("nccl:all_reduce", [[s]]) for s in sizes] + [CLOSING]


@pytest.mark.parametrize("pure", READERS)
def test_equal_coalesced_runs_on_every_rank_are_no_mismatch(tmp_path, capsys, monkeypatch, pure):
    write_job(tmp_path, {rank: {4: parts(4, 8, 16), 6: parts(2, 2, 2)} for rank in range(3)})
    code, report = report_of(tmp_path, capsys, monkeypatch, pure)
    assert (code, report["errors"], report["findings"]) == (0, [], [])


@pytest.mark.parametrize("pure", READERS)
@pytest.mark.parametrize(("odd", "mismatch"), [(parts(4, 32, 16), "size"), (parts(4, 8, 16, 16), "op")])
def test_a_coalesced_run_with_one_part_different_is_a_mismatch_naming_it(tmp_path, capsys, monkeypatch,
                                                                           pure, odd, mismatch):
    # seq 4 the same on all; seq 6 differs on rank 2 (a part's size, or one part more)
    runs = {rank: {4: parts(4, 8, 16), 6: odd if rank == 2 else parts(4, 8, 16)} for rank in range(3)}
    write_job(tmp_path, runs)
    code, report = report_of(tmp_path, capsys, monkeypatch, pure)
    assert (code, report["errors"]) == (1, [])
    (found,) = report["findings"]
    assert (found["kind"], found["seq"], found["op"], found["mismatch"], found["culprit_ranks"]) == \
        ("mismatch", 6, "coalesced", mismatch, [2])
    majority, minority = found["variants"]
    assert (majority["ranks"], minority["ranks"]) == ([0, 1], [2])
    assert [p["input_sizes"] for p in majority["parts"]] == [[[4]], [[8]], [[16]], []]
    assert [p["input_sizes"] for p in minority["parts"]] == [[[s]] for _, [[s]] in odd[:-1]] + [[]]
    described = ", ".join(f"all_reduce [[{s}]] Float" for _, [[s]] in odd[:-1])
    assert f"rank(s) 2 enqueued coalesced[{described}, coalesced []]" in found["detail"]


@pytest.mark.parametrize("pure", READERS)
def test_a_coalesced_run_of_twenty_thousand_parts_is_analyzed_within_a_deadline(tmp_path, pure):
    """The bound is a subprocess timeout, not a ratio: a fold per prefix of the run took 33 s
    and 4.6 GB on these two dumps; one signature per run takes well under a second, so 20 s
    leaves room for a slow, shared machine while the quadratic fold cannot make it."""
    entries = [entry(i, 1) for i in range(20_000)]
    for rank in range(2):
        dump = {"version": "2.10", "rank": rank, "pg_config": PG, "entries": entries}
        (tmp_path / f"rank{rank}").write_bytes(pickle.dumps(dump))
    env = {**os.environ, loader.PURE_PYTHON_ENV: pure}
    proc = subprocess.run([sys.executable, "-m", "lightkeeper.cli", "analyze", "--format", "json", str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=20)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["ranks"], report["errors"], report["findings"]) == ([0, 1], [], [])


@pytest.mark.parametrize("pure", READERS)
def test_a_long_coalesced_mismatch_is_described_by_its_first_parts_and_where_it_differs(
        tmp_path, capsys, monkeypatch, pure):
    # FSDP coalesces thousands of parts: rank 2's run of 3,000 differs at part 1234 only
    long = [(8, 8)] * 3000
    odd = long[:1234] + [(8, 16)] + long[1235:]
    runs = {rank: {4: parts(*(s for _, s in (odd if rank == 2 else long)))} for rank in range(3)}
    write_job(tmp_path, runs)
    code, report = report_of(tmp_path, capsys, monkeypatch, pure)
    (found,) = report["findings"]
    assert (found["mismatch"], found["culprit_ranks"]) == ("size", [2])
    assert "first apart at part 1234: all_reduce [[16]] Float vs all_reduce [[8]] Float" \
        in found["detail"]
    assert len(found["detail"]) < 2000 and "more]" in found["detail"]
    for v in found["variants"]:  # the parts listed are the first 64, with their count
        assert (len(v["parts"]), v["parts_total"]) == (64, 3001)


@pytest.mark.parametrize("pure", READERS)
def test_without_a_majority_each_long_variant_says_where_it_departs(tmp_path, capsys, monkeypatch,
                                                                    pure):
    long = [8] * 3000
    runs = {0: {4: parts(*long)}, 1: {4: parts(*long[:1234], 16, *long[1235:])},
            2: {4: parts(*long[:99], 32, *long[100:])}}
    write_job(tmp_path, runs)
    code, report = report_of(tmp_path, capsys, monkeypatch, pure)
    (found,) = report["findings"]
    assert "no variant has a majority" in found["detail"]
    assert "first apart at part 1234: all_reduce [[16]] Float vs all_reduce [[8]] Float" in \
        found["detail"] or "first apart at part 1234: all_reduce [[8]] Float vs all_reduce " \
        "[[16]] Float" in found["detail"]
    assert "first apart at part 99:" in found["detail"]
    assert found["detail"].count("first apart") == 2  # the variant compared with, not with itself


@pytest.mark.parametrize("pure", READERS)
def test_a_coalesced_run_apart_only_in_a_dtype_is_a_dtype_mismatch(tmp_path, capsys, monkeypatch,
                                                                    pure):
    runs = {rank: {4: parts(4, 8, 16)} for rank in range(3)}
    write_job(tmp_path, runs)
    for rank in range(3):  # rank 2's second part in Half
        path = tmp_path / f"rank{rank}"
        dump = pickle.loads(path.read_bytes())
        if rank == 2:
            e = next(e for e in dump["entries"] if e["collective_seq_id"] == 4
                     and e["input_sizes"] == [[8]])
            e["input_dtypes"] = e["output_dtypes"] = ["Half"]
            path.write_bytes(pickle.dumps(dump))
    code, report = report_of(tmp_path, capsys, monkeypatch, pure)
    (found,) = report["findings"]
    assert (found["mismatch"], found["culprit_ranks"]) == ("dtype", [2])
