"""Which of torchft's per-quorum folders ``lightkeeper analyze`` reads by default: the one whose
dumps are the newest, not the highest quorum id, and never silently one rank's stray dump."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from lightkeeper.cli import main
from tests.support.frgen import FRJob, write_dumps


def run_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["analyze", "--format", "json", "--jobs", "1", *map(str, argv)])
    return code, json.loads(capsys.readouterr().out)


def dumps(absent: int | None = None) -> dict[int, dict]:
    job = FRJob(3, flavour="gloo")
    job.repeat(4, [("0", "all_reduce", [[64]])])
    if absent is not None:
        job.collective("0", "all_reduce", [[64]], absent=[absent])
    return job.dumps()


def write_quorum(folder: Path, ranks: dict[int, dict], age_s: float) -> None:
    for path in write_dumps(ranks, folder, prefix=""):
        when = time.time() - age_s
        os.utime(path, (when, when))


def read(report: dict) -> list[int]:
    return [q["quorum_id"] for q in report["torchft_quorums"] if q["read"]]


def test_a_restarted_lighthouses_lower_quorum_id_with_the_newer_dumps_is_read(tmp_path, capsys):
    """The Lighthouse keeps its quorum id in memory: restarted, it counts from 0 again, and a
    2-day-old run's healthy quorum 7 was read instead of today's hang in quorum 2 (exit 0)."""
    write_quorum(tmp_path / "trace_quorum_7", dumps(), age_s=2 * 86400)
    write_quorum(tmp_path / "trace_quorum_2", dumps(absent=2), age_s=60)
    (tmp_path / "trace_quorum_3").mkdir()
    code, report = run_json(capsys, tmp_path / "trace")
    assert read(report) == [2]
    assert [f["culprit_ranks"] for f in report["findings"]] == [[2]]
    assert code == 1
    [note] = [n for n in report["notes"] if "torchft quorum" in n]
    assert "quorum 7 holds older dumps" in note and "restarted Lighthouse" in note, note
    assert "quorum 3 hold none" in note, note
    # --quorum still reads the one asked for
    code, report = run_json(capsys, "--quorum", 7, tmp_path)
    assert (read(report), report["findings"], code) == ([7], [], 0)


def test_one_ranks_stray_newest_dump_is_no_healthy_verdict(tmp_path, capsys):
    """Quorum 3 holds the hang's three dumps, quorum 4 one rank's later dump: reading quorum 4
    alone said "analyzed 1 rank(s)", "no findings", exit 0, and nothing of quorum 3."""
    write_quorum(tmp_path / "trace_quorum_3", dumps(absent=2), age_s=600)
    write_quorum(tmp_path / "trace_quorum_4", {1: dumps()[1]}, age_s=60)
    (tmp_path / "trace_quorum_5").mkdir()
    code, report = run_json(capsys, tmp_path)
    assert (read(report), report["ranks"], report["findings"]) == ([4], [1], [])
    [error] = report["errors"]
    assert "quorum 4's 1 dump file(s)" in error["error"] and "quorum 3's 3" in error["error"], error
    assert "--quorum 3 reads them" in error["error"], error
    assert code == 2
    assert main(["analyze", "--jobs", "1", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "another holds more dumps (--quorum 3)" in captured.err
    code, report = run_json(capsys, "--quorum", 3, tmp_path)
    assert [f["culprit_ranks"] for f in report["findings"]] == [[2]] and report["errors"] == []
    assert code == 1
