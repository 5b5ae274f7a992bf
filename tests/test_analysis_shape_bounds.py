"""A dump's tensor shapes are bounded before the analysis reads them: through a pickle's memo a
few KB can name one list of a thousand ints a million times (an 11 KB file ran ``lightkeeper
analyze`` past a minute). An entry with too many tensors or dims, or a dump with too many in
all (each reference counted), is an error naming the file and the limit, from the C reader and
Python's alike; real shapes pass. Within the bounds a coalesced collective of many parts costs
its parts once each, not once per part for every prefix of the run.
"""

from __future__ import annotations

import pickle

import pytest

from monitor.analysis import analyze, loader, normalize
from monitor.analysis.model import Signature
from tests.support.frgen import plain_dump

READERS = ["", "1"]  # the C reader where built, Python's unpickler


def _entry(i: int, sizes: list, seq: int | None = None, dtypes: list | None = None) -> dict:
    dtypes = ["Float"] * len(sizes) if dtypes is None else dtypes
    return {"record_id": i, "pg_id": 0, "collective_seq_id": i + 1 if seq is None else seq,
            "p2p_seq_id": 0, "op_id": i + 1, "profiling_name": "nccl:all_reduce",
            "time_created_ns": 1, "input_sizes": sizes, "output_sizes": sizes,
            "input_dtypes": dtypes, "output_dtypes": dtypes,
            "state": "scheduled", "frames": [{"name": "f", "filename": "x", "line": 1}],
            "process_group": ["0", "default_pg"], "is_p2p": False}


def _write(path, entries: list) -> None:
    dump = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg",
                                                   "ranks": "[0, 1]"}},
            "pg_status": {}, "rank": 0, "entries": entries}
    path.write_bytes(pickle.dumps(dump, protocol=4))  # one list, pickled once, named by the memo


def _load_error(tmp_path, monkeypatch, pure: str, entries: list) -> tuple[str, str]:
    monkeypatch.setenv(loader.PURE_PYTHON_ENV, pure)
    path = tmp_path / "rank_0.pkl"
    _write(path, entries)
    res = loader.load_paths([path], jobs=1)
    assert list(res.traces) == [] and len(res.errors) == 1  # no trace's repr: millions of ints
    return res.errors[0]["path"], res.errors[0]["error"]


@pytest.mark.parametrize("pure", READERS)
def test_a_tensor_of_too_many_dims_is_refused_naming_the_file_and_limit(tmp_path, monkeypatch, pure):
    sizes, dtypes = [[10] * 1000] * 1000, ["Float"] * 1000
    entries = [_entry(i, sizes, seq=1, dtypes=dtypes) for i in range(200)]
    path, error = _load_error(tmp_path, monkeypatch, pure, entries)
    assert (tmp_path / "rank_0.pkl").stat().st_size < 32 << 10
    assert path == str(tmp_path / "rank_0.pkl")
    assert "1000 dims" in error and f"limit of {loader.MAX_DIMS}" in error


@pytest.mark.parametrize("pure", READERS)
def test_an_entry_of_too_many_tensors_is_refused(tmp_path, monkeypatch, pure):
    entries = [_entry(0, [[4]]), _entry(1, [[4]] * (loader.MAX_TENSORS + 1))]
    _, error = _load_error(tmp_path, monkeypatch, pure, entries)
    assert error.startswith("entry 1:") and f"limit of {loader.MAX_TENSORS}" in error


@pytest.mark.parametrize("pure", READERS)
def test_too_many_shapes_in_all_are_refused_though_each_entry_is_within(tmp_path, monkeypatch, pure):
    sizes = [[10] * loader.MAX_DIMS] * 1000  # 65,000 dims and tensors an entry: in bounds
    n = loader.MAX_SHAPE_INTS // (2 * 65 * 1000) + 1
    _, error = _load_error(tmp_path, monkeypatch, pure, [_entry(i, sizes) for i in range(n)])
    assert str(loader.MAX_SHAPE_INTS) in error


@pytest.mark.parametrize("pure", READERS)
def test_real_shapes_pass(tmp_path, monkeypatch, pure):
    monkeypatch.setenv(loader.PURE_PYTHON_ENV, pure)
    dump = plain_dump(0, 2, 2000)
    # a coalesced collective of a thousand 2-d tensors among them
    dump["entries"][-1]["input_sizes"] = [[1024, 1024]] * 1000
    (tmp_path / "rank_0.pkl").write_bytes(pickle.dumps(dump))
    res = loader.load_paths([tmp_path], jobs=1)
    assert res.errors == [] and list(res.traces) == [0]


class _Dim(int):
    """A dim that counts how often it is hashed."""

    hashed = 0

    def __hash__(self) -> int:
        _Dim.hashed += 1
        return int.__hash__(self)


def test_a_long_coalesced_run_hashes_each_parts_shapes_a_few_times():
    n = 400
    traces = {}
    for rank in (0, 1):
        dump = plain_dump(rank, 2, 1)
        dump["entries"] = [dict(dump["entries"][0], record_id=i, collective_seq_id=1)
                           for i in range(n)]
        trace = normalize(dump, rank)
        # its one part's shapes made of counting dims; the run's signature rebuilt over it
        base, = (s for s in trace.signatures if not s.parts)
        part = base._replace(input_sizes=((_Dim(4), _Dim(4)),))
        swap = {id(base): part}
        sigs = []
        for s in trace.signatures:
            sigs.append(Signature("coalesced", None, None, (), (), tuple(swap[id(p)] for p in s.parts))
                        if s.parts else swap[id(s)])
        assert max(len(s.parts) for s in sigs) == n
        trace.signatures = sigs
        traces[rank] = trace
    _Dim.hashed = 0
    result = analyze(traces)
    assert result.errors == []
    assert _Dim.hashed <= 16, _Dim.hashed  # not n**2
