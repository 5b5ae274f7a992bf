"""Loading dumps with worker processes: same report as without, and failures that cost one file.

Everything here is real: worker processes are real interpreters, dumps are real files, a dying
worker is really killed (SIGKILL). The pool's size threshold is lowered where a test needs the
pool on small inputs, and the call is spied on to prove the pool ran.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from lightkeeper.cli import main
from monitor.analysis import loader, pool, wire
from monitor.analysis.loader import LOAD_TASK, load_outcome, load_paths
from tests.support.frgen import FRJob, plain_dump, write_dumps

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 120


@pytest.fixture
def pool_calls(monkeypatch) -> list[int]:
    """The ``jobs`` of every pool run; the size threshold lowered so small inputs use the pool."""
    calls: list[int] = []
    real = loader.run_pool

    def spy(files, jobs, *args, **kwargs):
        calls.append(jobs)
        return real(files, jobs, *args, **kwargs)

    monkeypatch.setattr(loader, "run_pool", spy)
    monkeypatch.setattr(loader, "POOL_MIN_BYTES", 0)
    return calls


def as_lists(trace):
    """A trace with every column a list (the pool hands enqueue times and durations back as
    arrays, the sequences the engine reads them as)."""
    if trace is None:
        return None
    groups = {
        key: dataclasses.replace(g, created_ns=list(g.created_ns), duration_ms=list(g.duration_ms))
        for key, g in trace.groups.items()
    }
    return dataclasses.replace(trace, groups=groups)


def decoded(outcomes):
    """The pool's answers to LOAD_TASK with each pickled trace decoded."""
    return [(None if blob is None else wire.from_bytes(blob), error) for blob, error in outcomes]


def hang_job() -> FRJob:
    job = FRJob(6, seed=1)
    job.group("1", [0, 1, 2])
    job.repeat(20, [("0", "all_reduce", [[1024]]), ("1", "all_gather", [[64]])])
    job.collective("0", "all_reduce", [[1024]], absent=[4])
    return job


def mismatch_job() -> FRJob:
    job = FRJob(6, seed=2)
    job.repeat(20, [("0", "all_reduce", [[1024]])])
    job.collective("0", "all_reduce", [[1024]], rank_sizes={5: [[1025]]})
    job.repeat(3, [("0", "all_reduce", [[1024]])])
    return job


def straggler_job() -> FRJob:
    job = FRJob(6, seed=3)
    job.repeat(40, [("0", "all_reduce", [[1024]])], delay_ms={2: 3.0})
    return job


def write_scenario(name: str, directory: Path) -> None:
    job = {"hang": hang_job, "mismatch": mismatch_job, "straggler": straggler_job}[name.split()[0]]()
    if name.endswith("json"):
        write_dumps(job.dumps(buffer_size=50), directory, fmt="json")
        return
    write_dumps(job.dumps(fmt="pickle", buffer_size={r: 40 + 3 * r for r in range(6)}), directory, fmt="pickle")
    if name.endswith("broken"):
        data = (directory / "rank1").read_bytes()
        (directory / "rank1").write_bytes(data[: len(data) // 2])  # truncated
        (directory / "rank9").write_bytes(pickle.dumps(Path("/etc/passwd")))  # a class: refused
        (directory / "notes").write_text("neither JSON nor pickle")
        (directory / "copy-of-rank3.json").write_text(json.dumps(job.dumps()[3] | {"rank": 3}))


def report(capsys, *argv: str) -> tuple[int, str]:
    code = main(["analyze", "--format", "json", *argv])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("name", ["hang", "mismatch", "straggler", "hang json", "mismatch broken"])
def test_jobs_1_and_2_give_the_same_report(name, tmp_path, capsys, pool_calls):
    write_scenario(name, tmp_path)
    code1, alone = report(capsys, str(tmp_path), "--jobs", "1")
    assert pool_calls == []
    code2, pooled = report(capsys, str(tmp_path), "--jobs", "2")
    assert pool_calls == [2]
    assert (code2, pooled) == (code1, alone)
    found = json.loads(pooled)
    assert code1 == 1 and found["findings"], "the scenario must produce a finding"
    assert found["findings"][0]["kind"] == name.split()[0]
    if name.endswith("broken"):
        errors = {Path(e["path"]).name: e["error"] for e in found["errors"]}
        assert set(errors) == {"rank1", "rank9", "notes", "rank3"}  # rank3's second dump comes later
        assert "truncated" in errors["rank1"] and "refusing" in errors["rank9"]
        assert "duplicate dump of rank 3" in errors["rank3"]


def test_small_inputs_are_loaded_without_workers(tmp_path, monkeypatch):
    write_scenario("hang", tmp_path)
    calls: list[int] = []
    monkeypatch.setattr(loader, "run_pool", lambda files, jobs, *args: calls.append(jobs) or [])
    size = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert size < loader.POOL_MIN_BYTES
    assert sorted(load_paths([tmp_path], jobs=2).traces) == list(range(6))
    assert calls == []


def test_workers_default_to_the_available_cores(tmp_path, pool_calls):
    write_scenario("hang", tmp_path)
    load_paths([tmp_path])
    cores = len(os.sched_getaffinity(0))
    assert pool_calls == ([cores] if cores > 1 else [])


def test_jobs_must_be_positive(tmp_path, capsys):
    write_scenario("hang", tmp_path)
    assert main(["analyze", "--jobs", "0", str(tmp_path)]) == 2
    assert "--jobs must be positive" in capsys.readouterr().err
    with pytest.raises(ValueError):
        load_paths([tmp_path], jobs=0)


def test_a_huge_jobs_starts_at_most_a_few_workers_per_core(tmp_path, monkeypatch, capsys):
    """``--jobs 100000`` on many files started one interpreter per file. Each worker answers
    with its pid (a task on PYTHONPATH, which ``python -S`` keeps): the pids are the workers."""
    (tmp_path / "pidtask.py").write_text("import os\n\ndef pid(path):\n    return os.getpid(), None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO)]))
    monkeypatch.setattr(pool, "available_cores", lambda: 1)
    assert pool.max_workers() == pool.JOBS_PER_CORE
    files = [tmp_path / f"f{i}" for i in range(4 * pool.JOBS_PER_CORE)]
    for f in files:
        f.write_text("x")
    pids = {pid for pid, _ in in_time(pool.run_pool, files, 100_000, "pidtask:pid")}
    assert len(pids) == pool.max_workers()
    # the command line says so once, in the report's notes
    write_scenario("hang", tmp_path / "dumps")
    code, out = report(capsys, str(tmp_path / "dumps"), "--jobs", "100000")
    notes = json.loads(out)["notes"]
    assert code == 1 and [n for n in notes if n.startswith("--jobs")] == [
        f"--jobs 100000: at most {pool.max_workers()} worker processes start "
        f"({pool.JOBS_PER_CORE} per available core, of 1)"]


def big_dumps(directory: Path, ranks: int = 24, entries: int = 2000) -> list[Path]:
    """Files that take a worker milliseconds each, so that one can be killed mid-load."""
    dumps = {r: plain_dump(r, ranks, entries) for r in range(ranks)}
    return write_dumps(dumps, directory, fmt="pickle")


def in_time(fn, *args):
    """Run ``fn`` on a thread; fail (instead of hanging the suite) past the deadline."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), f"still running after {DEADLINE_S} s"
    return out[0]


def test_a_killed_worker_costs_only_the_file_it_was_reading(tmp_path, monkeypatch):
    files = big_dumps(tmp_path)
    killed: list[int] = []
    settle = pool._Pool._settle

    def settle_then_kill(self, index, outcome):
        settle(self, index, outcome)
        busy = [w for w in self.workers if w.in_flight and w.ready]
        if not killed and busy:
            killed.append(busy[0].proc.pid)
            os.kill(busy[0].proc.pid, signal.SIGKILL)

    monkeypatch.setattr(pool._Pool, "_settle", settle_then_kill)
    outcomes = decoded(in_time(pool.run_pool, files, 2, LOAD_TASK))
    assert killed, "no worker was busy to be killed"
    died = [i for i, (trace, error) in enumerate(outcomes) if error and "loader process died" in error]
    assert len(died) == 1
    assert "killed by SIGKILL" in outcomes[died[0]][1]
    for i, (trace, error) in enumerate(outcomes):
        if i != died[0]:
            assert error is None and as_lists(trace) == load_outcome(files[i])[0]
    with pytest.raises(ProcessLookupError):
        os.kill(killed[0], 0)  # reaped, not left a zombie


def test_workers_that_cannot_start_leave_the_files_to_this_process(tmp_path, monkeypatch, capfd):
    files = big_dumps(tmp_path, ranks=4, entries=50)
    monkeypatch.setattr(pool, "_BOOT", "import sys; sys.exit(3)")
    outcomes = decoded(in_time(pool.run_pool, files, 2, LOAD_TASK))
    assert [(as_lists(t), e) for t, e in outcomes] == [load_outcome(f) for f in files]


def test_a_task_that_does_not_resolve_is_refused_before_any_worker_starts(tmp_path):
    for task in ("monitor.analysis.loader:no_such_function", "no_such_module:f", "load", "monitor.analysis.loader:LOAD_TASK"):
        with pytest.raises(ValueError, match="unknown task"):
            pool.run_pool([tmp_path / "rank0"], 2, task)


def test_pool_works_from_a_thread_while_other_threads_hold_locks(tmp_path, pool_calls):
    # as in the monitor: other threads log and print while one loads (fork without exec
    # could copy a held lock into a worker; the workers exec a fresh interpreter)
    files = big_dumps(tmp_path, ranks=6, entries=300)
    log = logging.getLogger("test.pool.noise")
    log.addHandler(logging.NullHandler())
    stop = threading.Event()

    def noise():
        while not stop.is_set():
            log.warning("busy")
            print("", end="", flush=True)

    noisy = [threading.Thread(target=noise, daemon=True) for _ in range(2)]
    for t in noisy:
        t.start()
    try:
        loaded = in_time(load_paths, [tmp_path], 2)
    finally:
        stop.set()
    assert pool_calls == [2]
    assert loaded.errors == [] and {r: as_lists(t) for r, t in loaded.traces.items()} == {
        r: load_outcome(files[r])[0] for r in range(6)
    }


def test_no_process_imports_torch(tmp_path):
    # a stand-in torch first on the path records every process that imports it
    marker = tmp_path / "imported-torch"
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"import os\nopen({str(marker)!r}, 'a').write(f'{{os.getpid()}}\\n')\n")
    dumps = tmp_path / "dumps"
    write_scenario("hang", dumps)
    code = (
        "import sys\n"
        "import monitor.analysis.loader as loader\n"
        "loader.POOL_MIN_BYTES = 0\n"
        "real, runs = loader.run_pool, []\n"
        "loader.run_pool = lambda *a, **k: runs.append(1) or real(*a, **k)\n"
        "from lightkeeper.cli import main\n"
        "rc = main(['analyze', '--format', 'json', '--jobs', '2', sys.argv[1]])\n"
        "assert runs == [1], 'the pool did not run'\n"
        "sys.exit(rc)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake.parent), str(REPO)]))
    proc = subprocess.run([sys.executable, "-c", code, str(dumps)], capture_output=True, text=True, cwd=REPO, env=env, timeout=DEADLINE_S)
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["findings"][0]["culprit_ranks"] == [4]
    assert not marker.exists(), f"torch imported by process(es) {marker.read_text().split()}"
    # the stand-in works: a process that imports torch is recorded
    subprocess.run([sys.executable, "-c", "import torch"], env=env, check=True, timeout=DEADLINE_S)
    assert marker.exists()


@pytest.mark.parametrize(
    "values",
    [
        [],
        [5, 5, 5],
        [1, 2, 3],
        [1.5, float("nan"), 2.5],
        [3, 3.0, True],  # equal to ==, not of one type
        [None, 4, None],
        [2**70, 1],  # beyond 64 bits
        [10**18 + 7, 10**18 + 9],  # enqueue times in ns
        [0, 0, 0],  # gloo's enqueue times
        [1, True, 1],  # first and last alike, not of one type
        [1, 2, True],  # a machine array of ints would take the bool
        [1.0, 2, 3.0],  # and one of floats the int
        [True, False],
        ["a", "a"],
    ],
)
def test_columns_come_back_as_the_same_values_of_the_same_types(values):
    back = list(wire._as_sequence(pickle.loads(pickle.dumps(wire.pack_column(values)))))
    assert [type(v) for v in back] == [type(v) for v in values]
    assert [repr(v) for v in back] == [repr(v) for v in values]
    if all(type(v) is int for v in values) and None not in values:
        codes = list(wire._as_sequence(pickle.loads(pickle.dumps(wire.pack_column(values, int)))))
        assert codes == values


@pytest.mark.parametrize("ranks", [(0, 1, 2, 3), (5,), (), (True, 1), (2**70, 1), tuple(range(1024))])
def test_member_lists_come_back_equal_of_the_same_types_and_shared(ranks):
    back = [wire._as_ranks(pickle.loads(pickle.dumps(wire.pack_ranks(ranks)))) for _ in range(2)]
    assert back[0] == ranks and [type(r) for r in back[0]] == [type(r) for r in ranks]
    if ranks and all(type(r) is int for r in ranks) and max(ranks) < 2**63:
        assert back[0] is back[1]  # one tuple per list in the receiving process
