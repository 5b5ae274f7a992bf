"""What ``lightkeeper analyze`` reads of a folder: a hostile pickle in little memory, torchft's
newest quorum folder that holds dumps, per-rank logs beside the dumps."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from lightkeeper.cli import main
from monitor.analysis import loader
from tests.support.frgen import FRJob, write_dumps


def run_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["analyze", "--format", "json", "--jobs", "1", *map(str, argv)])
    return code, json.loads(capsys.readouterr().out)


def healthy_dumps(world: int = 2) -> dict[int, dict]:
    job = FRJob(world)
    job.repeat(4, [("0", "all_reduce", [[64]])])
    return job.dumps()


@pytest.mark.parametrize("pure", ["", "1"])
@pytest.mark.parametrize("data", [
    b"\x80\x02I1\nr\x00\x00\x40\x00.",  # an opcode the C reader refuses, then a memo index of 2**22
    b"\x80\x02}r\x00\x00\x40\x00.",
    b"\x80\x02}p4194304\n.",
])
def test_a_memo_index_past_the_file_costs_no_memory(tmp_path, monkeypatch, pure, data):
    # Python's C unpickler grows its memo array to the index: 11 bytes asked for 64 MiB here
    # (2**27: 2 GiB), whichever reader ran first
    monkeypatch.setenv(loader.PURE_PYTHON_ENV, pure)
    path = tmp_path / "rank0"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        trace, error = loader.load_outcome(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert trace is None
    assert error.startswith("invalid pickle: memo index out of range"), error
    assert peak < 1 << 20, peak


@pytest.mark.parametrize("pure", ["", "1"])
def test_truncated_pickles_still_read_as_truncated(tmp_path, monkeypatch, pure):
    monkeypatch.setenv(loader.PURE_PYTHON_ENV, pure)
    write_dumps(healthy_dumps(1), tmp_path)
    data = (tmp_path / "rank0").read_bytes()
    for cut in (len(data) // 3, len(data) // 2, len(data) - 1):
        (tmp_path / "rank0").write_bytes(data[:cut])
        trace, error = loader.load_outcome(tmp_path / "rank0")
        assert trace is None and error.startswith(("truncated file", "invalid pickle")), error


def test_the_newest_quorum_folder_holding_dumps_is_read(tmp_path, capsys):
    # torchft makes a folder at every quorum: the newest ones are empty, the dumps in quorum 5's
    write_dumps(healthy_dumps(), tmp_path / "trace_quorum_5", prefix="")
    for q in (6, 7):
        (tmp_path / f"trace_quorum_{q}").mkdir()
    code, report = run_json(capsys, tmp_path / "trace")
    assert report["errors"] == []
    assert report["ranks"] == [0, 1]
    assert [(q["quorum_id"], q["read"]) for q in report["torchft_quorums"]] == [(5, True), (6, False), (7, False)]
    assert any("quorum 5" in n and "6, 7" in n for n in report["notes"]), report["notes"]
    assert code == 0
    # --quorum still reads the one asked for, empty or not
    code, report = run_json(capsys, "--quorum", 7, tmp_path)
    assert report["ranks"] == [] and code == 2


def test_quorum_folders_none_of_which_holds_a_dump_are_named(tmp_path, capsys):
    for q in (1, 2):
        (tmp_path / f"trace_quorum_{q}").mkdir()
    code, report = run_json(capsys, tmp_path)
    [error] = report["errors"]
    assert "none of its 2 torchft quorum folders" in error["error"]
    assert not any(q["read"] for q in report["torchft_quorums"])
    assert code == 2


def test_per_rank_logs_beside_the_dumps_are_no_second_job(tmp_path, capsys):
    write_dumps(healthy_dumps(), tmp_path, prefix="nccl_trace_rank_")
    for r in (0, 1):
        (tmp_path / f"train_rank{r}.log").write_text("ok\n")
    code, report = run_json(capsys, tmp_path)
    assert report["ranks"] == [0, 1]
    errors = {e["path"].rsplit("/", 1)[-1]: e["error"] for e in report["errors"]}
    assert errors == {"train_rank0.log": "neither JSON nor a pickle", "train_rank1.log": "neither JSON nor a pickle"}
    assert code == 0


def test_two_jobs_dumps_are_still_refused(tmp_path, capsys):
    # gzip-compressed dumps look like dumps too: unpacked, they would be a second job's
    write_dumps(healthy_dumps(), tmp_path, prefix="jobA_rank")
    for r in (0, 1):
        (tmp_path / f"jobB_rank{r}.gz").write_bytes(b"\x1f\x8b\x08\x00" + bytes(20))
    code, report = run_json(capsys, tmp_path)
    assert report["ranks"] == []
    assert "pick one with --prefix" in report["errors"][0]["error"]
    assert code == 2
