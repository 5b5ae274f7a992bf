"""benchmarks/bench_analyze.py's load floors: the fastest read of a pickle there is, C
``pickle.load``, so "vs floor" can exceed its target; the loader's safe unpickler is pure Python."""

from __future__ import annotations

import pickle

import pytest

from benchmarks import bench_analyze
from tests.support.frgen import FRJob, write_dumps


@pytest.mark.parametrize("task", [bench_analyze.read_only, bench_analyze.read_fields])
def test_the_load_floors_unpickle_without_the_pure_python_unpickler(tmp_path, monkeypatch, task):
    job = FRJob(1)
    job.repeat(3, [("0", "all_reduce", [[64]])])
    [path] = write_dumps(job.dumps(), tmp_path)

    def refused(self):
        raise AssertionError("the floor ran Python's pure-Python unpickler")

    monkeypatch.setattr(pickle._Unpickler, "load", refused)
    assert task(str(path)) == (None, None)
