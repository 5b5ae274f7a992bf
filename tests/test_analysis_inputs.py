"""``lightkeeper analyze`` on inputs that used to read the wrong thing or read as healthy:
torchft quorum folders of two jobs, dumps with no entry, host-prefixed file names of one job, a
bundle beside other dumps, compressed dumps and archives, a missing rank's dump."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

from lightkeeper.cli import main
from monitor.analysis import analyze
from tests.support.frgen import FRJob, write_dumps

BUNDLE = Path(__file__).parent / "fixtures" / "torch-debug-server-h100" / "bundle-evict-hang.tar.gz"


def run_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["analyze", "--format", "json", *map(str, argv)])
    return code, json.loads(capsys.readouterr().out)


def hang_dumps(world: int, absent: int) -> dict[int, dict]:
    job = FRJob(world, flavour="gloo")
    job.repeat(4, [("0", "all_reduce", [[64]])])
    job.collective("0", "all_reduce", [[64]], absent=[absent])
    return job.dumps()


def write_quorum(folder: Path, absent: int) -> None:
    folder.mkdir(parents=True)
    for rank, dump in hang_dumps(3, absent).items():
        (folder / str(rank)).write_text(json.dumps(dump))


def test_quorum_folders_of_two_prefixes_are_refused_not_mixed(tmp_path, capsys):
    """Keyed by quorum id alone, jobB's quorum 2 replaced jobA's (by listing order) and job B's
    dumps were analyzed as the newest quorum of a job they are not part of."""
    write_quorum(tmp_path / "jobA_quorum_1", absent=0)
    write_quorum(tmp_path / "jobA_quorum_2", absent=1)
    write_quorum(tmp_path / "jobB_quorum_2", absent=2)
    code, report = run_json(capsys, tmp_path)
    assert (code, report["ranks"], report["findings"]) == (2, [], [])
    [error] = report["errors"]
    assert error["path"] == str(tmp_path)
    assert "'jobA' (2 quorums), 'jobB' (1 quorum)" in error["error"], error
    assert f"give one prefix: {tmp_path / 'jobA'}" in error["error"], error
    # the prefix's own path reads that job's quorums only
    code, report = run_json(capsys, tmp_path / "jobA")
    assert code == 1 and [f["culprit_ranks"] for f in report["findings"]] == [[1]]
    assert [(q["quorum_id"], Path(q["path"]).name, q["read"]) for q in report["torchft_quorums"]] == [
        (1, "jobA_quorum_1", False), (2, "jobA_quorum_2", True)]


def test_dumps_without_entries_say_nothing_was_compared_and_exit_2(tmp_path, capsys):
    """Flight Recorder off (TORCH_NCCL_TRACE_BUFFER_SIZE=0): the dumps load, but no collective
    is in any of them; "no findings" with exit 0 read as a healthy job."""
    dumps = FRJob(4).dumps(fmt="pickle")
    assert all(d["entries"] == [] for d in dumps.values())
    note = analyze(dumps).notes[-1]
    assert note.startswith("no collective recorded in any dump: Flight Recorder off?"), note
    assert "TORCH_FR_BUFFER_SIZE" in note and "TORCH_NCCL_TRACE_BUFFER_SIZE" in note
    write_dumps(dumps, tmp_path, fmt="pickle")
    code, report = run_json(capsys, tmp_path)
    assert (code, report["ranks"], report["findings"]) == (2, [0, 1, 2, 3], [])
    assert note in report["notes"]
    assert main(["analyze", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert f"note: {note}" in out and "nothing compared" in out and "no findings" not in out
    # one rank with entries is something compared: the usual exit status
    job = FRJob(2)
    job.repeat(3, [("0", "all_reduce", [[8]])])
    some = job.dumps(buffer_size={0: 0, 1: 3})
    assert not any(n.startswith("no collective recorded") for n in analyze(some).notes)


def test_host_prefixed_names_of_one_job_are_read_as_one(tmp_path, capsys):
    """``node-a_nccl_trace_rank_0..3`` and ``node-b_nccl_trace_rank_4..7``: two name prefixes,
    but no rank twice, so one job (said in a note), not a refusal."""
    job = FRJob(8)
    job.repeat(4, [("0", "all_reduce", [[64]])])
    job.collective("0", "all_reduce", [[64]], absent=[5])
    dumps = job.dumps(fmt="pickle")
    write_dumps({r: dumps[r] for r in range(4)}, tmp_path, prefix="node-a_nccl_trace_rank_")
    write_dumps({r: dumps[r] for r in range(4, 8)}, tmp_path, prefix="node-b_nccl_trace_rank_")
    code, report = run_json(capsys, tmp_path)
    assert (code, report["ranks"], report["errors"]) == (1, list(range(8)), [])
    assert [f["culprit_ranks"] for f in report["findings"]] == [[5]]
    [note] = [n for n in report["notes"] if "read as one job" in n]
    assert "'node-a_nccl_trace_rank_' (ranks 0-3)" in note and "'node-b_nccl_trace_rank_' (ranks 4-7)" in note
    # a rank under both prefixes: two jobs after all, refused as before
    write_dumps({3: dumps[3]}, tmp_path, prefix="node-b_nccl_trace_rank_")
    code, report = run_json(capsys, tmp_path)
    assert (code, report["ranks"]) == (2, [])
    [error] = report["errors"]
    assert "dumps of 2 jobs" in error["error"] and "--prefix" in error["error"], error


def test_a_bundle_with_other_paths_is_refused(tmp_path, capsys):
    write_dumps(hang_dumps(3, absent=2), tmp_path / "d", fmt="json")
    for argv in ([BUNDLE, tmp_path / "d"], [tmp_path / "d", BUNDLE]):
        assert main(["analyze", "--format", "json", *map(str, argv)]) == 2
        got = capsys.readouterr()
        assert got.out == "" and len(got.err.splitlines()) == 1, got.err
        assert "an incident bundle is analyzed alone" in got.err and str(BUNDLE) in got.err


def test_a_bundles_errors_name_its_members_not_the_deleted_temp_folder(tmp_path, capsys):
    """fr/rank0.json holding rank 1's dump: the duplicate's text named the other file by its
    path in a temporary folder gone once analyze ended."""
    out = tmp_path / "dup.tar.gz"
    with tarfile.open(BUNDLE) as src:
        members = [(m, src.extractfile(m).read()) for m in src]
    rank1 = next(data for m, data in members if m.name.endswith("/fr/rank1.json"))
    with tarfile.open(out, "w:gz") as dst:
        for m, data in members:
            data = rank1 if m.name.endswith("/fr/rank0.json") else data
            info = tarfile.TarInfo(m.name)
            info.size = len(data)
            dst.addfile(info, io.BytesIO(data))
    code, report = run_json(capsys, out)
    assert code in (0, 1) and report["ranks"] == [1]
    [error] = report["errors"]
    assert error == {"path": f"{out}: fr/rank1.json",
                     "error": f"duplicate dump of rank 1 (also {out}: fr/rank0.json)"}


def test_compressed_dumps_and_archives_say_what_to_do(tmp_path, capsys):
    dumps = hang_dumps(2, absent=1)
    folder = tmp_path / "gz"
    for path in write_dumps(dumps, folder, fmt="pickle"):
        path.write_bytes(gzip.compress(path.read_bytes()))
    code, report = run_json(capsys, folder)
    assert code == 2
    assert [e["error"] for e in report["errors"]] == ["gzip-compressed: gunzip it first"] * 2
    # a tar of a dump folder, gzipped or not
    write_dumps(dumps, tmp_path / "plain", fmt="pickle")
    for name, mode in (("dumps.tar.gz", "w:gz"), ("dumps.tar", "w")):
        with tarfile.open(tmp_path / name, mode) as tar:
            tar.add(tmp_path / "plain", arcname="plain")
        code, report = run_json(capsys, tmp_path / name)
        assert code == 2
        [error] = report["errors"]
        assert "not an incident bundle" in error["error"], error
        assert error["error"].endswith("unpack it and give the folder"), error
    # one gzipped dump given by itself (not a tar: no bundle) is told to be gunzipped too
    [one] = sorted(folder.iterdir())[:1]
    code, report = run_json(capsys, one)
    assert code == 2
    assert [e["error"] for e in report["errors"]] == ["gzip-compressed: gunzip it first"]


def test_a_missing_ranks_dump_hints_at_blame_missing(tmp_path, capsys):
    """Everyone with a dump waits at the same seq; the rank that never arrived left no dump:
    no finding is right, but the note says how to count it as not having arrived."""
    job = FRJob(4)
    job.repeat(4, [("0", "all_reduce", [[64]])])
    job.collective("0", "all_reduce", [[64]], absent=[3])
    dumps = job.dumps()
    del dumps[3]
    write_dumps(dumps, tmp_path, fmt="json")
    code, report = run_json(capsys, tmp_path)
    assert (code, report["findings"], report["unknown_ranks"]) == (0, [], [3])
    assert any("--blame-missing" in n for n in report["notes"]), report["notes"]
    code, report = run_json(capsys, "--blame-missing", tmp_path)
    assert code == 1 and [f["culprit_ranks"] for f in report["findings"]] == [[3]]
    assert not any("--blame-missing" in n for n in report["notes"])

