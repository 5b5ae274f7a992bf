"""Inputs at the edges of what torch writes: a ring buffer cut through a coalesced collective,
NCCL dumps without TORCH_NCCL_ENABLE_TIMING, and folders this user may not list."""

from __future__ import annotations

import gzip
import io
import json
import pickle
import tarfile
from pathlib import Path

import pytest

from lightkeeper.cli import main
from monitor.analysis import analyze
from monitor.analysis.loader import load_paths
from tests.support.frgen import FRJob, write_dumps

PG = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}}


def entry(record_id: int, seq: int, name: str = "nccl:all_reduce", sizes: list | None = None, **extra) -> dict:
    sizes = [[4]] if sizes is None else sizes
    return {"process_group": ("0", "default_pg"), "collective_seq_id": seq, "p2p_seq_id": 0, "profiling_name": name,
            "input_sizes": sizes, "output_sizes": sizes, "input_dtypes": ["Float"], "output_dtypes": ["Float"],
            "state": "completed", "time_created_ns": 10**18 + record_id * 1_000_000, "record_id": record_id,
            "is_p2p": False, "duration_ms": 1.0, **extra}


def coalesced_job(kept_from: int, odd_rank: int | None = None, odd_seq: int = 8) -> dict[int, dict]:
    """Four ranks, seq 5 a coalesced group (two all_reduces and torch's closing entry); rank 3's
    buffer wrapped and kept its entries from index ``kept_from`` on (5: from the second part);
    ``odd_rank`` enqueued a broadcast at ``odd_seq``."""
    dumps = {}
    for rank in range(4):
        entries = []
        for seq in range(1, 11):
            if seq == 5:
                for name, sizes in (("nccl:all_reduce", [[4]]), ("nccl:all_reduce", [[8]]), ("nccl:coalesced", [])):
                    entries.append(entry(len(entries), seq, name, sizes))
            else:
                name = "nccl:broadcast" if (rank, seq) == (odd_rank, odd_seq) else "nccl:all_reduce"
                entries.append(entry(len(entries), seq, name))
        if rank == 3:
            entries = [dict(e, record_id=e["record_id"] + 1000) for e in entries[kept_from:]]
        dumps[rank] = {"version": "2.10", "rank": rank, "entries": entries, "pg_config": PG}
    return dumps


def analyzed(dumps: dict[int, dict], via: str, tmp_path: Path):
    if via == "dicts":
        return analyze(dumps)
    write_dumps(dumps, tmp_path, fmt="pickle")  # the loader's path: the C reader where built
    loaded = load_paths([tmp_path], jobs=1)
    assert loaded.errors == []
    return analyze(loaded.traces)


@pytest.mark.parametrize("via", ["dicts", "pickles"])
@pytest.mark.parametrize("kept_from", [5, 6])  # from the second part; only the closing entry
def test_a_coalesced_collective_cut_by_the_ring_buffer_is_no_mismatch(kept_from, via, tmp_path):
    result = analyzed(coalesced_job(kept_from), via, tmp_path)
    assert result.findings == []
    assert result.last_seq == {next(iter(result.last_seq)): {0: 10, 1: 10, 2: 10, 3: 10}}


@pytest.mark.parametrize("via", ["dicts", "pickles"])
def test_a_cut_coalesced_collective_does_not_hide_a_later_mismatch(via, tmp_path):
    result = analyzed(coalesced_job(5, odd_rank=1), via, tmp_path)
    (found,) = result.findings
    assert (found.kind, found.seq, found.op, found.mismatch, found.culprit_ranks) == ("mismatch", 8, "all_reduce", "op", [1])
    assert found.later_mismatches == 0


def test_an_unwrapped_rank_still_testifies_about_its_first_coalesced_collective():
    dumps = coalesced_job(0)
    for dump in dumps.values():  # every buffer begins at seq 5, nothing overwritten
        kept = [e for e in dump["entries"] if e["collective_seq_id"] >= 5]
        dump["entries"] = [dict(e, record_id=i) for i, e in enumerate(kept)]
    dumps[2]["entries"][1].update(input_sizes=[[16]], output_sizes=[[16]])  # its second part
    (found,) = analyze(dumps).findings
    assert (found.seq, found.op, found.mismatch, found.culprit_ranks) == (5, "coalesced", "size", [2])


def untimed_nccl(state: str) -> dict[int, dict]:
    """Four ranks on one host, rank 2 enqueuing 20 ms late; no duration_ms (torch's default
    without TORCH_NCCL_ENABLE_TIMING), ``state`` scheduled or completed."""
    dumps = {}
    for rank in range(4):
        entries = []
        for seq in range(1, 41):
            e = entry(seq - 1, seq, state=state, time_discovered_started_ns=0)
            del e["duration_ms"]
            e["time_created_ns"] = 10**18 + seq * 100_000_000 + (20_000_000 if rank == 2 else rank * 1000)
            entries.append(e)
        dumps[rank] = {"version": "2.10", "rank": rank, "host": "h1", "entries": entries, "pg_config": PG}
    return dumps


@pytest.mark.parametrize("state", ["scheduled", "completed"])
def test_nccl_without_timing_compares_enqueue_times_on_one_host(state):
    (found,) = analyze(untimed_nccl(state)).findings
    assert (found.kind, found.culprit_ranks, found.evidence) == ("straggler", [2], "host_clock")
    # never across hosts
    assert analyze({r: dict(d, host=f"h{r}") for r, d in untimed_nccl(state).items()}).findings == []


def test_nccl_with_timing_still_uses_durations():
    job = FRJob(4, jitter_ms=0.5, skew_ms=50.0, seed=1)
    job.repeat(40, [("0", "all_reduce", [[4096]])], delay_ms={1: 4.0})
    (found,) = analyze(job.dumps()).findings
    assert (found.culprit_ranks, found.evidence) == ([1], "duration_ms")


@pytest.fixture
def unlistable(monkeypatch):
    """Folders whose listing raises PermissionError (as for another user's 0700 folder)."""
    blocked: set[Path] = set()
    original = Path.iterdir

    def iterdir(self):
        if self in blocked:
            raise PermissionError(13, "Permission denied", str(self))
        return original(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    return blocked


def small_job_dir(path: Path) -> Path:
    job = FRJob(2)
    job.repeat(3, [("0", "all_reduce", [[8]])])
    write_dumps(job.dumps(), path, fmt="json")
    return path


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_a_folder_that_cannot_be_listed_is_an_error_and_exit_2(unlistable, tmp_path, capsys, fmt):
    folder = small_job_dir(tmp_path / "dumps")
    unlistable.add(folder)
    code = main(["analyze", "--format", fmt, str(folder)])
    out = capsys.readouterr()
    assert code == 2
    if fmt == "json":
        report = json.loads(out.out)
        assert report["ranks"] == []
        assert report["errors"] == [{"path": str(folder), "error": "cannot read it: Permission denied"}]
    else:
        assert f"error: {folder}: cannot read it: Permission denied" in out.out
        assert "no usable dump" in out.err


def test_an_unlistable_folder_beside_readable_dumps_is_an_error_the_rest_analyzed(unlistable, tmp_path, capsys):
    good = small_job_dir(tmp_path / "good")
    bad = tmp_path / "bad"
    bad.mkdir()
    unlistable.update({bad, tmp_path})  # the parent too: a dump folder is read without it
    code = main(["analyze", "--format", "json", str(good), str(bad)])
    report = json.loads(capsys.readouterr().out)
    # the folder not read may hold the culprit's dump: no findings in the rest is no healthy verdict
    assert (code, report["ranks"]) == (2, [0, 1])
    assert [e["path"] for e in report["errors"]] == [str(bad)]


def test_load_paths_reports_a_folder_it_cannot_list(unlistable, tmp_path):
    folder = small_job_dir(tmp_path / "dumps")
    unlistable.add(folder)
    loaded = load_paths([folder], jobs=1)
    assert loaded.traces == {}
    assert loaded.errors == [{"path": str(folder), "error": "cannot read it: Permission denied"}]


def hides_no_rank(folder: Path) -> None:
    (folder / "config.json").write_text('{"lr": 0.1}')
    (folder / "old.tar.gz").write_bytes(b"\x1f\x8b\x08\x00" + bytes(20))
    (folder / "rank1.log").write_text("step 3\n")
    (folder / "slurm-12345.out").write_text("srun: job 12345\n")  # digits no rank of the job's
    (folder / "train.log-20261129").write_text("step 3\n")


def may_hide_rank_2(folder: Path) -> None:
    (folder / "rank2").write_bytes(b"")  # digits naming a rank not read


def may_hide_a_pickle(folder: Path) -> None:
    job = FRJob(3)
    job.repeat(3, [("0", "all_reduce", [[8]])])
    (folder / "dump.bak").write_bytes(pickle.dumps(job.dumps()[2])[:200])  # a dump cut short


def may_hide_a_json_dump(folder: Path) -> None:
    job = FRJob(3)
    job.repeat(3, [("0", "all_reduce", [[8]])])
    (folder / "latest.json").write_text(json.dumps({k: v for k, v in job.dumps()[2].items() if k != "rank"}))


@pytest.mark.parametrize("beside, code", [(hides_no_rank, 0), (may_hide_rank_2, 2), (may_hide_a_pickle, 2),
                                          (may_hide_a_json_dump, 2)])
def test_an_unreadable_file_is_incomplete_input_only_where_it_may_hide_a_rank(beside, code, tmp_path, capsys):
    """A stray config.json or old archive beside every rank's dump exited 2, "incomplete input":
    only a file whose name's digits name a rank not read, or that began as a dump, may hide one."""
    folder = small_job_dir(tmp_path / "dumps")
    beside(folder)
    assert main(["analyze", "--format", "json", str(folder)]) == code
    report = json.loads(capsys.readouterr().out)
    stray = sorted(p.name for p in folder.iterdir() if not p.name.startswith("rank0") and p.name != "rank1.json")
    assert (report["ranks"], sorted(Path(e["path"]).name for e in report["errors"])) == ([0, 1], stray)
    assert main(["analyze", str(folder)]) == code
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == ("no findings" if code == 0 else "no findings in the dumps read: incomplete input, not a healthy verdict")


def rank_2s_dump_in(name: str) -> bytes:
    """What a file named ``name`` beside ranks 0 and 1's dumps holds that may be rank 2's dump."""
    job = FRJob(3)
    job.repeat(3, [("0", "all_reduce", [[8]])])
    dump = pickle.dumps(job.dumps()[2])
    if name.endswith(".gz"):
        return gzip.compress(dump)
    if name.endswith(".tar"):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            member = tarfile.TarInfo("nccl_trace_rank_2")
            member.size = len(dump)
            tar.addfile(member, io.BytesIO(dump))
        return buf.getvalue()
    if name.endswith(".zst"):
        return b"\x28\xb5\x2f\xfd" + bytes(50)  # zstd's magic: compressed, not read here
    return bytes(4096)  # torch writes its dump in place: a crash may leave it zero-filled


@pytest.mark.parametrize("name", ["trace.gz", "dumps.tar", "nccl_trace_rank_2", "rank2.json.zst"])
def test_a_file_that_may_be_a_missing_ranks_dump_is_incomplete_input(name, tmp_path, capsys):
    """Rank 2's dump gzipped or tarred without digits in its name, zero-filled, or compressed
    under its rank's name, beside ranks 0 and 1's: read as a stray file, it exited 0 "no findings"
    with rank 2 never read. An archive beside every rank's dump still hides none."""
    job = FRJob(3)
    job.repeat(3, [("0", "all_reduce", [[8]])])
    folder = tmp_path / "dumps"
    write_dumps(job.dumps(ranks=[0, 1]), folder)
    (folder / name).write_bytes(rank_2s_dump_in(name))
    assert main(["analyze", "--format", "json", str(folder)]) == 2
    report = json.loads(capsys.readouterr().out)
    assert (report["ranks"], report["unknown_ranks"], [Path(e["path"]).name for e in report["errors"]]) == \
        ([0, 1], [2], [name])
    assert main(["analyze", str(folder)]) == 2
    assert capsys.readouterr().out.endswith("no findings in the dumps read: incomplete input, not a healthy verdict\n")
    (folder / "rank1.log").write_text("step 3\n")  # rank 1's log: rank 1 is read
    (folder / name).unlink()
    assert main(["analyze", str(folder)]) == 0
    if name.endswith((".gz", ".tar")):
        write_dumps(job.dumps(ranks=[2]), folder)
        (folder / name).write_bytes(rank_2s_dump_in(name))
        assert main(["analyze", str(folder)]) == 0
        assert capsys.readouterr().out.endswith("\nno findings\n")


@pytest.mark.parametrize("rank, said", [("abc", "'rank' is 'abc': not a rank"),
                                         (-3, "'rank' is -3: not a rank"),
                                         (10**30, "not a rank"), ("\u00b2", "not a rank"),
                                         ("\uff11", "not a rank"), (None, "a null 'rank'")])
def test_a_dump_whose_rank_is_no_rank_says_what_it_holds(rank, said, tmp_path, capsys):
    """A rank that is no C int from 0 is refused, and the error says what the key held (it
    read "the dump has no 'rank' key" for one that had it); a null one is the file name's."""
    job = FRJob(1, flavour="gloo")
    job.repeat(2, [("0", "all_reduce", [[8]])])
    (path,) = write_dumps(job.dumps(), tmp_path, fmt="json")
    dump = json.loads(path.read_text())
    dump["rank"] = rank
    for name in ("dump.json", "dump_rank7.json"):
        path = path.with_name(name)
        path.write_text(json.dumps(dump))
        code = main(["analyze", str(path)])
        out = capsys.readouterr().out
        if rank is None and name == "dump_rank7.json":  # null: the name's rank
            assert code == 0 and "analyzed 1 rank(s): 7" in out, out
        else:
            assert code == 2 and said in out, out
