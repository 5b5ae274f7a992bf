"""``lightkeeper analyze``: files and directories in, text or JSON out, exit status."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from lightkeeper.cli import main
from monitor.analysis.loader import load_paths, rank_from_name
from tests.support.frgen import FRJob, loaded_pair_job, three_group_job, write_dumps

REPO = Path(__file__).resolve().parents[1]


def hang_job() -> FRJob:
    job = FRJob(4)
    job.repeat(6, [("0", "all_reduce", [[1024]])])
    job.collective("0", "all_reduce", [[1024]], absent=[2])
    return job


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["analyze", "--format", "json", *map(str, argv)])
    return code, json.loads(capsys.readouterr().out)


def test_pickle_directory_with_findings_exits_1_and_reports_json(tmp_path, capsys):
    write_dumps(hang_job().dumps(fmt="pickle"), tmp_path, fmt="pickle", prefix="nccl_trace_rank_")
    code, report = run_json(capsys, tmp_path)
    assert code == 1
    assert set(report) == {"ranks", "unknown_ranks", "errors", "findings", "lags", "notes",
                           "pickle_reader"}
    assert report["ranks"] == [0, 1, 2, 3] and report["errors"] == []
    (finding,) = report["findings"]
    assert {k: finding[k] for k in ("kind", "pg", "seq", "op", "culprit_ranks")} == {
        "kind": "hang",
        "pg": "0",
        "seq": 7,
        "op": "all_reduce",
        "culprit_ranks": [2],
    }
    assert isinstance(finding["detail"], str) and finding["waiting_ranks"] == [0, 1, 3]


def test_healthy_json_files_exit_0_and_text_says_no_findings(tmp_path, capsys):
    job = FRJob(3)
    job.repeat(5, [("0", "all_reduce", [[8]])])
    paths = write_dumps(job.dumps(), tmp_path, fmt="json")
    assert main(["analyze", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert "analyzed 3 rank(s)" in out and "no findings" in out


def test_text_says_when_no_two_ranks_clocks_could_be_compared(tmp_path, capsys):
    """gloo dumps without a host: the straggler check cannot run, and the report says so."""
    job = FRJob(3, flavour="gloo")
    job.repeat(5, [("0", "all_reduce", [[8]])])
    paths = write_dumps(job.dumps(), tmp_path, fmt="json")
    assert main(["analyze", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert "note: no straggler check in 1 group(s) (0)" in out and "--same-host" in out
    assert main(["analyze", "--same-host", "--world-size", "3", *map(str, paths)]) == 0
    assert "note:" not in capsys.readouterr().out


def test_gloo_dumps_that_may_lack_the_last_ranks_are_no_healthy_verdict(tmp_path, capsys):
    """gloo declares no world: two of a four-rank job's dumps, the ranks that arrived, would
    read as a healthy two-rank job, so the summary says its size is unknown."""
    job = FRJob(4, flavour="gloo")
    job.repeat(5, [("0", "all_reduce", [[8]])])
    job.collective("0", "all_reduce", [[8]], absent=[2, 3])  # ranks 2 and 3 never arrive
    dumps = job.dumps()
    paths = write_dumps({r: dumps[r] for r in (0, 1)}, tmp_path, fmt="json")
    assert main(["analyze", "--same-host", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert "no findings in ranks 0, 1 (the job's size unknown: see note)" in out
    assert "pass --world-size if it had more" in out
    assert main(["analyze", "--same-host", "--world-size", "4", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert "no dump from rank(s): 2, 3" in out and "--world-size if" not in out
    assert "no findings in the dumps read (none from rank(s) 2, 3)" in out
    # nor is a straggler judged among the dumps there are: said, not left to "no findings"
    assert "no straggler check in 1 group(s) (0): some of their members left no dump" in out


def test_gloo_dumps_with_a_finding_still_say_the_job_may_be_larger(tmp_path, capsys):
    """A straggler found in ranks 0-5 of an eight-rank gloo job whose ranks 6 and 7 never
    arrived (their dumps missing): the hang they would show is not seen, so the note stands."""
    job = FRJob(8, flavour="gloo", jitter_ms=1.0, seed=3)
    job.repeat(40, [("0", "all_reduce", [[64]])], delay_ms={1: 8.0})
    job.collective("0", "all_reduce", [[64]], absent=[6, 7])
    dumps = job.dumps()
    paths = write_dumps({r: dumps[r] for r in range(6)}, tmp_path, fmt="json")
    assert main(["analyze", "--same-host", *map(str, paths)]) == 1
    out = capsys.readouterr().out
    assert "[straggler]" in out and "6 rank(s), is taken from the highest rank read" in out


def test_text_format_has_one_block_per_finding(tmp_path, capsys):
    job = FRJob(4)
    job.group("1", [0, 1])
    job.repeat(4, [("0", "all_reduce", [[8]]), ("1", "all_gather", [[8]])])
    job.collective("1", "all_gather", [[8]], ops={1: "broadcast"})
    job.collective("0", "all_reduce", [[8]], absent=[3])
    write_dumps(job.dumps(), tmp_path, fmt="json")
    assert main(["analyze", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "2 finding(s)" in out
    assert "[hang] group '0' seq 5 all_reduce" in out
    assert "[mismatch] group '1' seq 5 all_gather" in out
    assert out.count("  culprits: ") == 2


def test_a_lag_between_two_groups_is_reported_and_the_exit_status_ignores_it(tmp_path, capsys):
    write_dumps(loaded_pair_job(0, bias_ms=10.0).dumps(), tmp_path, fmt="json")
    assert main(["analyze", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no findings; 1 lag(s) below" in out and "[lag] rank 1 behind rank 0 (not a finding)" in out
    code, report = run_json(capsys, tmp_path)
    assert code == 0 and report["findings"] == []
    assert [(f["kind"], f["rank"], f["peers"]) for f in report["lags"]] == [("lag", 1, [0])]


def test_a_late_arriver_into_one_of_three_groups_is_reported(tmp_path, capsys):
    # pickles as torch writes them, the generated shape of test_analysis_engine's regression test
    write_dumps(three_group_job(0).dumps(fmt="pickle"), tmp_path, fmt="pickle")
    code, report = run_json(capsys, tmp_path)
    assert code == 1
    assert [(f["kind"], f["pg"], f["culprit_ranks"]) for f in report["findings"]] == [("straggler", "1", [5])]


def test_rank_comes_from_the_dump_before_the_file_name(tmp_path, capsys):
    dumps = hang_job().dumps()
    for rank, dump in dumps.items():
        dump["rank"] = rank
        (tmp_path / f"dump-{rank}-of-4.json").write_text(json.dumps(dump))  # name's digits: 4
    code, report = run_json(capsys, tmp_path)
    assert code == 1 and report["ranks"] == [0, 1, 2, 3] and report["errors"] == []
    assert rank_from_name("rank12") == 12 and rank_from_name("trace_rank_3.json") == 3
    assert rank_from_name("notes.txt") is None


def test_broken_files_become_errors_and_the_rest_is_analyzed(tmp_path, capsys):
    dumps = hang_job().dumps(fmt="pickle")
    write_dumps({r: d for r, d in dumps.items() if r != 1}, tmp_path, fmt="pickle")
    full = pickle.dumps(dumps[1])
    (tmp_path / "rank1").write_bytes(full[: len(full) // 2])  # truncated
    (tmp_path / "rank7.json").write_text('{"version": "2.10", "entr')  # corrupt JSON
    (tmp_path / "rank8.json").write_text(json.dumps({"hello": "world"}))  # foreign schema
    (tmp_path / "rank9").write_bytes(pickle.dumps(Path("/etc/passwd")))  # a class: refused
    (tmp_path / "README").write_text("per-rank dumps")  # neither JSON nor pickle, no rank
    (tmp_path / ".hidden5").write_text("ignored")
    code, report = run_json(capsys, tmp_path, tmp_path / "missing-rank3")
    errors = {Path(e["path"]).name: e["error"] for e in report["errors"]}
    assert set(errors) == {"rank1", "rank7.json", "rank8.json", "rank9", "README", "missing-rank3"}
    assert "truncated" in errors["rank1"]
    assert "refusing" in errors["rank9"]
    assert report["ranks"] == [0, 2, 3]
    assert report["unknown_ranks"] == [1]
    # rank 2 never arrived at seq 7; rank 1 (no usable dump) is unknown, not a culprit
    assert [(f["kind"], f["culprit_ranks"], f["unknown_ranks"]) for f in report["findings"]] == [("hang", [2], [1])]
    assert code == 1


def test_duplicate_rank_is_an_error(tmp_path):
    job = FRJob(2)
    job.repeat(2, [("0", "all_reduce", [[8]])])
    dumps = job.dumps()
    write_dumps(dumps, tmp_path / "a", fmt="json")
    write_dumps({0: dumps[0]}, tmp_path / "b", fmt="json")
    loaded = load_paths([tmp_path / "a", tmp_path / "b"])
    assert sorted(loaded.traces) == [0, 1]
    assert len(loaded.errors) == 1 and "duplicate dump of rank 0" in loaded.errors[0]["error"]


def test_two_jobs_dumps_in_one_directory_are_refused_until_one_is_picked(tmp_path, capsys):
    """Two jobs' dumps side by side (each with a rank 0): reading either would be a guess, so the
    directory is an error naming both until ``--prefix`` picks one."""
    healthy = FRJob(2)
    healthy.repeat(3, [("0", "all_reduce", [[8]])])
    write_dumps(healthy.dumps(), tmp_path, prefix="jobA_rank")
    write_dumps(hang_job().dumps(), tmp_path, prefix="jobB_rank")
    code, report = run_json(capsys, tmp_path)
    assert code == 2 and report["ranks"] == []
    [error] = report["errors"]
    assert "'jobA_rank' (2 files), 'jobB_rank' (4 files)" in error["error"], error
    assert "--prefix" in error["error"]
    code, report = run_json(capsys, "--prefix", "jobB_", tmp_path)
    assert (code, report["ranks"], report["errors"]) == (1, [0, 1, 2, 3], [])
    assert [f["culprit_ranks"] for f in report["findings"]] == [[2]]


@pytest.mark.parametrize("manifest", ['{"tool": "collector"}', "{not json"])
def test_another_tools_manifest_beside_dumps_is_no_bundle(tmp_path, capsys, manifest):
    """A ``manifest.json`` that is not an incident bundle's, beside dumps: they are read, and the
    manifest is named as a file that is no dump."""
    write_dumps(hang_job().dumps(), tmp_path)
    (tmp_path / "manifest.json").write_text(manifest)
    code, report = run_json(capsys, tmp_path)
    assert (code, report["ranks"]) == (1, [0, 1, 2, 3])
    assert [Path(e["path"]).name for e in report["errors"]] == ["manifest.json"]


def test_output_cut_short_by_its_reader_ends_quietly(tmp_path):
    """``| head``: the reader is gone before the report is written; no traceback."""
    write_dumps(hang_job().dumps(), tmp_path)
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", f"'{sys.executable}' -m lightkeeper.cli "
                           f"analyze --format json '{tmp_path}' | true"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert (proc.returncode, proc.stderr) == (141, ""), proc.stderr


@pytest.mark.parametrize("content", [None, "garbage"])
def test_nothing_loadable_exits_2(tmp_path, capsys, content):
    if content is not None:
        (tmp_path / "rank0").write_text(content)
    code, report = run_json(capsys, tmp_path)
    assert code == 2
    assert report["ranks"] == [] and report["findings"] == []
    (error,) = report["errors"]  # why, in the JSON a script reads too
    assert error["error"] == ("no dump file here" if content is None
                              else "neither JSON nor a pickle")


def test_a_path_that_is_no_regular_file_is_said_not_waited_on(tmp_path, capsys):
    """A FIFO with no writer hung analyze for ever (its first bytes were read to tell a
    bundle); a process substitution was called missing. Both are said, the rest analyzed."""
    import os

    write_dumps(hang_job().dumps(), tmp_path / "dumps")
    fifo = tmp_path / "trace9"
    os.mkfifo(fifo)
    code, report = run_json(capsys, fifo, *sorted((tmp_path / "dumps").iterdir()))
    assert code == 1 and report["findings"]  # the hang, from the regular files
    assert {"path": str(fifo), "error": "not a regular file: not read"} in report["errors"]


def test_bad_flags_exit_2(tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["analyze", "--format", "yaml", str(tmp_path)])
    assert exc.value.code == 2


def test_real_format_sample_is_healthy(capsys):
    """The NCCL-shaped format sample shipped in tests/fixtures (see its README): both the
    json and the pickle dumps of a healthy 4-rank job analyze to no findings."""
    sample = REPO / "tests" / "fixtures" / "fr-format-sample"
    for sub in ("json", "pickle"):
        assert len(list((sample / sub).iterdir())) == 4, sample / sub
        code, report = run_json(capsys, sample / sub)
        assert (code, report["ranks"], report["errors"], report["findings"]) == (0, [0, 1, 2, 3], [], [])


def test_console_script_runs_without_importing_torch(tmp_path):
    write_dumps(hang_job().dumps(fmt="pickle"), tmp_path, fmt="pickle")
    code = (
        "import sys\n"
        "from lightkeeper.cli import main\n"
        "rc = main(['analyze', '--format', 'json', sys.argv[1]])\n"
        "assert 'torch' not in sys.modules, 'analyze imported torch'\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["findings"][0]["culprit_ranks"] == [2]


@pytest.mark.parametrize("protocol", [2, 4, pickle.HIGHEST_PROTOCOL])
def test_pickles_of_any_protocol_load_alike(tmp_path, protocol):
    # torch's own pickler writes protocol 2 (no frames); Python's default is framed
    dumps = hang_job().dumps(fmt="pickle")
    for rank, dump in dumps.items():
        (tmp_path / f"rank{rank}").write_bytes(pickle.dumps(dump, protocol=protocol))
    loaded = load_paths([tmp_path], jobs=1)
    assert loaded.errors == [] and sorted(loaded.traces) == [0, 1, 2, 3]
    assert loaded.traces == load_paths([write_dumps(dumps, tmp_path / "json", fmt="json")[0].parent], jobs=1).traces


def test_a_group_whose_entries_rolled_out_of_a_members_ring_says_so(tmp_path, capsys):
    """Every rank's dump is there, but rank 3's ring buffer rolled past group 1's entries: its
    straggler check is skipped for that, not for a missing dump."""
    job = FRJob(4, flavour="nccl", jitter_ms=1.0, seed=4)  # NCCL declares its members
    job.group("1", [0, 1, 2, 3])
    job.repeat(20, [("1", "all_reduce", [[64]])], delay_ms={1: 8.0})
    job.repeat(30, [("0", "all_reduce", [[64]])])
    dumps = job.dumps()
    dumps[3]["entries"] = [e for e in dumps[3]["entries"] if e["process_group"][0] != "1"]
    write_dumps(dumps, tmp_path, fmt="json")
    assert main(["analyze", "--same-host", "--world-size", "4", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no straggler check in 1 group(s) (1): some members' dumps hold none" in out, out
