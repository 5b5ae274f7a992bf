"""Flight Recorder dumps fuzzed: what a rank's ``/v1/fr_trace`` or a dump file holds is checked
before the analysis reads it. A bad dump is an ``errors`` entry (the monitor: a warning line) and
the other ranks are still analyzed; no small dump costs gigabytes; no pickle runs code.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import random
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from monitor.analysis import analyze, loader
from monitor.analysis.engine import normalize_dumps
from tests.support.frgen import FRJob
from tests.support.fuzz import mutate

ROOT = Path(__file__).resolve().parents[1]
WEIRD = [None, True, 0, -1, 2**70, 1e308, float("nan"), float("inf"), "", "x", "\u00e9\u2603",
         [], {}, [1, 2], {"a": 1}, [[[[]]]], 0.5, "1", [None], ["x"], [[1, 2], [3]]]


def torchft_job(flavour: str) -> FRJob:
    job = FRJob(4, flavour=flavour, hosts={r: "h0" for r in range(4)}, replica_group_size=2,
                seed=1)
    job.group("rg0", [0, 1])
    job.group("rg1", [2, 3])
    job.quorum(1, [0, 1])
    for _ in range(12):
        job.collective("rg0", "all_gather", [[64]])
        job.collective("rg1", "all_gather", [[64]])
        job.ft_collective("all_reduce", [[4096]])
    return job


def mutant(rng: random.Random, dump: dict) -> dict:
    """``dump`` with 1 to 3 values anywhere in it replaced or deleted."""
    dump = copy.deepcopy(dump)
    mutate(rng, dump, WEIRD, delete_p=0.15)
    return dump


def test_mutated_dumps_are_errors_never_a_failed_analysis():
    """Before, a dump with e.g. a string ``time_created_ns``, a dict in ``input_sizes`` or a
    list as an incarnation's ``pg_id`` normalized (or raised TypeError) and then failed the
    analysis of every rank: the monitor logged "Flight Recorder analysis failed" and judged no
    dump that sweep."""
    rng = random.Random(7)
    bases = [torchft_job(f).dumps(fmt=fmt) for f in ("gloo", "nccl") for fmt in ("json", "pickle")]
    for i in range(300):
        base = rng.choice(bases)
        bad = rng.randrange(4)
        dumps = {r: mutant(rng, d) if r == bad else d for r, d in base.items()}
        traces, errors = normalize_dumps(dumps)
        analyze(traces)  # raises nothing
        assert set(traces) | {e["rank"] for e in errors} == set(range(4)), i


def test_a_jump_in_sequence_ids_costs_no_memory():
    """A 12-entry dump whose ids jump by 10**7 filled the gap with empty slots (four lists of
    10**7: ~320 MiB; 10**9, as a rank may answer, ~32 GiB); a rank whose ids are 10**7 past its
    peers' made a list that long when the ranks were compared. Now both take kilobytes."""
    job = FRJob(3, flavour="gloo", seed=1)
    for _ in range(12):
        job.collective("0", "all_reduce", [[4]])
    dumps = job.dumps()
    dumps[0]["entries"][-1]["collective_seq_id"] = 10**7
    for i, e in enumerate(dumps[1]["entries"]):
        e["collective_seq_id"] = 10**7 + i
    tracemalloc.start()
    try:
        traces, errors = normalize_dumps(dumps)
        result = analyze(traces)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert errors == [] and peak < 16 << 20, peak
    assert result.findings  # the ranks disagree: still reported


@pytest.mark.parametrize("seq", [-1, 2**63])
def test_a_sequence_id_no_torch_writes_is_an_error(seq):
    job = FRJob(2, flavour="gloo", seed=1)
    job.collective("0", "all_reduce", [[4]])
    dump = job.dumps()[0]
    dump["entries"][0]["collective_seq_id"] = seq
    _, errors = normalize_dumps({0: dump})
    assert "no integer collective_seq_id" in errors[0]["error"]


def test_lightkeeper_analyze_names_a_bad_dump_and_reads_the_rest(tmp_path):
    """``lightkeeper analyze`` on a folder with one mutated dump (either reader): an ``errors``
    entry for it, the other ranks analyzed, no traceback (before: a TypeError traceback)."""
    dumps = torchft_job("nccl").dumps(fmt="pickle")
    dumps[2]["entries"][5]["time_created_ns"] = "soon"
    for r, d in dumps.items():
        (tmp_path / f"rank{r}").write_bytes(pickle.dumps(d, protocol=2))
    (tmp_path / "rank3").write_bytes(json.dumps(torchft_job("nccl").dumps()[3]).encode())
    for pure in ("", "1"):
        res = subprocess.run([sys.executable, "-m", "lightkeeper.cli", "analyze", "--format",
                              "json", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, env={**os.environ, loader.PURE_PYTHON_ENV: pure})
        assert "Traceback" not in res.stderr, res.stderr[-2000:]
        report = json.loads(res.stdout)
        assert report["ranks"] == [0, 1, 3], report
        # nothing found in the rest, and rank 2's dump unread: no healthy verdict
        assert (res.returncode, report["findings"]) == (2, []), res.stderr[-2000:]
        assert [e["path"] for e in report["errors"]] == [str(tmp_path / "rank2")]
        assert "time_created_ns" in report["errors"][0]["error"]


@pytest.mark.parametrize("pickled", [
    b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00echo\x85R.",  # GLOBAL + REDUCE
    b"\x80\x04\x8c\x02os\x8c\x06system\x93X\x04\x00\x00\x00echo\x85R.",  # STACK_GLOBAL
    b"\x80\x02(X\x04\x00\x00\x00echoios\nsystem\n.",  # INST
    b"\x80\x02(cos\nsystem\nX\x04\x00\x00\x00echoo.",  # OBJ
    b"\x80\x02cbuiltins\neval\nX\x01\x00\x00\x001\x85R.",
])
def test_a_pickle_naming_a_function_is_refused_by_both_readers(tmp_path, pickled, monkeypatch):
    path = tmp_path / "rank0"
    path.write_bytes(pickled)
    for pure in ("", "1"):
        monkeypatch.setenv(loader.PURE_PYTHON_ENV, pure)
        trace, error = loader.load_outcome(path)
        assert trace is None and "refusing to load" in error, (pure, error)



def test_a_pickle_declaring_a_terabyte_string_is_a_clear_error(tmp_path, monkeypatch):
    """Before: the error was "MemoryError: " and nothing more."""
    path = tmp_path / "rank0"
    path.write_bytes(b"\x80\x04\x8d" + (1 << 40).to_bytes(8, "little") + b"ab.")  # BINUNICODE8
    for pure in ("", "1"):
        monkeypatch.setenv(loader.PURE_PYTHON_ENV, pure)
        trace, error = loader.load_outcome(path)
        assert trace is None and error.startswith("out of memory reading it"), (pure, error)


def test_a_rank_number_past_any_world_costs_no_gigabytes():
    """gloo's dumps do not list the default group's members, so rank numbers tell the world: a
    dump claiming rank 10**7 made ten million members (1.4 GB, seconds; 10**9: out of memory).
    Now at most 2**20 are made up from rank numbers."""
    job = FRJob(2, flavour="gloo", seed=1)
    for _ in range(4):
        job.collective("0", "all_reduce", [[4]])
    dumps = job.dumps()
    for d in dumps.values():
        d.pop("pg_config", None)
    dumps[1]["rank"] = 10**7
    traces, errors = normalize_dumps({0: dumps[0], 10**7: dumps[1]})
    assert errors == [] and sorted(traces) == [0, 10**7]
    assert len(analyze(traces).unknown_ranks) < 1 << 20
