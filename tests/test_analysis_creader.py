"""The C reader of dump pickles (``monitor/analysis/_frpickle.c``) against Python's unpickler.

Real parts: the built extension, real pickle bytes (``pickle.dumps`` at protocols 2 and 5, the
NCCL H100 fixture torch wrote), the loader's own functions. The reader must give what the
pure-Python path gives, trace for trace and error for error, on every dump the other analysis
tests make; the common shapes must take its column route (else the equality would hold
vacuously); anything it refuses must still get the Python path's answer; hostile bytes
(truncated at every offset, random byte flips, huge declared lengths, classes) must give a clean
error or the same verdict, never a crash: the fuzzing runs in a child ``python -X dev`` so that
a crash fails the test instead of killing pytest.
"""

from __future__ import annotations

import gc
import os
import pickle
import struct
import subprocess
import sys
import tracemalloc
from collections import OrderedDict
from operator import itemgetter
from pathlib import Path

import pytest

from monitor.analysis import analyze, loader, wire
from monitor.analysis.columnar import _KEYS, normalize, normalize_parsed
from tests.support.frgen import plain_dump, steady_dump
from tests.test_analysis_columnar import BAD, SHAPES, form

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
PURE = loader.PURE_PYTHON_ENV


def test_ci_builds_the_c_reader():
    # CI must never measure or test only the fallback without saying so
    if os.environ.get("CI") != "true":
        pytest.skip("only under CI=true: elsewhere the C reader is optional (setup.py builds it where it compiles)")
    assert loader._frpickle is not None, "the C reader (monitor/analysis/_frpickle.c) was not built"
    assert loader.pickle_reader() == "c"


frpickle = pytest.importorskip("monitor.analysis._frpickle", reason="the C reader is not built here (no compiler at install time?)")


@pytest.fixture
def use_c(monkeypatch):
    monkeypatch.delenv(PURE, raising=False)


class Watched:
    """A parsed pickle that notes in ``built_whole`` when the C path builds the whole dump
    (``load``) instead of taking its columns."""

    def __init__(self, data: bytes, built_whole: list[bytes]) -> None:
        self.doc, self.data, self.built_whole = frpickle.parse(data), data, built_whole

    def columns(self, *args):
        return self.doc.columns(*args)

    def load(self):
        self.built_whole.append(self.data)
        return self.doc.load()


def rank_of(rank: int):
    return lambda raw: loader._rank_of(raw, f"rank{rank}")


ALL = SHAPES
# incarnations (told apart by pg_id, not a column), optional keys left out of some entries
WHOLE = {"torchft incarnations", "without optional keys", "some without duration"}


@pytest.mark.parametrize("protocol", [2, 5])
@pytest.mark.parametrize("name", sorted(ALL))
def test_same_trace_and_packed_trace_as_the_python_path(name, protocol):
    built_whole: list[bytes] = []
    for rank, dump in list(ALL[name]().items())[:4]:  # 4 ranks of each job are enough, and cheap
        data = pickle.dumps(dump, protocol=protocol)
        assert frpickle.parse(data).load() == pickle.loads(data)
        expected = form(normalize(pickle.loads(data), rank))
        assert form(normalize_parsed(Watched(data, built_whole), rank_of(rank), packed=False)) == expected, (name, rank)
        sent = wire.from_bytes(wire.to_bytes(normalize_parsed(Watched(data, built_whole), rank_of(rank), packed=True)))
        assert form(sent) == expected
    if name in WHOLE:
        assert built_whole, "expected at least one of these dumps to be built whole"
    else:
        assert built_whole == [], "a common shape must take the column route"


@pytest.mark.parametrize("protocol", [2, 5])
def test_columns_are_the_entries_fields(protocol):
    for dump in (steady_dump(3, 16, 200), plain_dump(1, 8, 100, frames=3), plain_dump(0, 4, 10, flavour="gloo")):
        data = pickle.dumps(dump, protocol=protocol)
        top, cols, first, last = frpickle.parse(data).columns(_KEYS, "duration_ms")
        entries = pickle.loads(data)["entries"]
        keys = _KEYS + (("duration_ms",) if "duration_ms" in entries[0] else ())
        assert list(cols) == list(zip(*map(itemgetter(*keys), entries), strict=True))
        assert all(type(c) is tuple for c in cols)
        assert top == {k: v for k, v in dump.items() if k != "entries"}
        assert (first, last) == (entries[0], entries[-1])


@pytest.mark.parametrize("bad", BAD, ids=range(len(BAD)))
def test_malformed_dump_raises_what_the_python_path_raises(bad):
    data = pickle.dumps(bad, protocol=2)
    with pytest.raises(Exception) as expected:
        normalize(pickle.loads(data), 1)
    for packed in (False, True):
        with pytest.raises(type(expected.value)) as got:
            normalize_parsed(frpickle.parse(data), lambda raw: 1, packed)
        assert str(got.value) == str(expected.value)


def test_an_unexpected_type_in_a_kept_field_gets_the_python_paths_answer(tmp_path):
    dump = plain_dump(0, 2, 20)
    dump["entries"][7]["collective_seq_id"] = "7"  # normalize's error
    dump2 = plain_dump(1, 2, 20)
    dump2["entries"][3]["is_p2p"] = True  # left out of its group either way
    for rank, d in ((0, dump), (1, dump2)):
        (tmp_path / f"rank{rank}").write_bytes(pickle.dumps(d, protocol=2))
    assert_loader_agrees(tmp_path)


def test_a_memo_reference_into_a_part_the_reader_skips_is_resolved():
    # the dtypes list is pickled first inside a stack frame (skipped), then referenced by memo
    dump = plain_dump(0, 2, 30)
    for e in dump["entries"]:
        e["frames"] = [{"name": "f", "filename": "x.py", "line": 1, "dtypes": e["input_dtypes"]}]
        e["frames"], e["input_dtypes"] = e.pop("frames"), e.pop("input_dtypes")  # frames first
        assert list(e).index("frames") < list(e).index("input_dtypes")
    data = pickle.dumps(dump, protocol=2)
    built_whole: list[bytes] = []
    assert normalize_parsed(Watched(data, built_whole), rank_of(0), packed=False) == normalize(pickle.loads(data), 0)
    assert built_whole == []


def test_what_the_reader_refuses_still_gets_the_right_answer(tmp_path):
    job = {r: plain_dump(r, 3, 12) for r in range(3)}
    job[0]["extra"] = {1, 2}  # a set: not read by the C reader, plain data to Python's
    job[1]["entries"][0]["frames"] = {("a", 1): "b"}  # a tuple as a dict key: refused
    deep: list = []
    for _ in range(150):  # deeper than the reader builds (its first entry is built whole)
        deep = [deep]
    job[2]["entries"][0]["frames"] = deep
    for rank, d in job.items():
        data = pickle.dumps(d, protocol=2)
        (tmp_path / f"rank{rank}").write_bytes(data)
        with pytest.raises(frpickle.DumpRefused):
            normalize_parsed(frpickle.parse(data), rank_of(rank), packed=False)
    assert_loader_agrees(tmp_path)


def test_classes_are_refused_by_both_readers(tmp_path):
    dump = plain_dump(0, 1, 4)
    dump["pg_config"] = OrderedDict(dump["pg_config"])  # GLOBAL + REDUCE
    data = pickle.dumps(dump, protocol=2)
    with pytest.raises(frpickle.DumpRefused, match="opcode"):
        frpickle.parse(data)
    (tmp_path / "rank0").write_bytes(data)
    result = assert_loader_agrees(tmp_path)
    assert "refusing to load collections.OrderedDict" in result.errors[0]["error"]


def test_fixtures_and_faulty_jobs_load_alike_through_the_loader(tmp_path):
    for directory in ("nccl-fr-h100/pickle", "nccl-fr-h100/timeout", "nccl-fr-h100/inflight", "fr-format-sample/pickle"):
        assert_loader_agrees(FIXTURES / directory)
    for i, name in enumerate(sorted(set(ALL) - BIG)):
        job = tmp_path / str(i)
        job.mkdir()
        for rank, dump in ALL[name]().items():
            (job / f"rank{rank}").write_bytes(pickle.dumps(dump, protocol=2))
        assert_loader_agrees(job)


BIG = {"steady", "steady gloo", "plain"}  # healthy and common: compared above, per dump


def assert_loader_agrees(directory: Path) -> loader.LoadResult:
    """load_paths and each file's packed outcome, by the C reader and by Python's: the same
    traces, errors and report."""
    got = {}
    for pure in ("", "1"):
        os.environ[PURE] = pure
        try:
            result = loader.load_paths([directory], jobs=1)
            packed = [loader.load_packed(p) for p in sorted(directory.iterdir()) if p.is_file()]
        finally:
            del os.environ[PURE]
        assert result.pickle_reader == ("python" if pure else "c")
        unpacked = [(None if blob is None else repr(wire.from_bytes(blob)), error) for blob, error in packed]
        got[pure] = (repr(result.traces), result.errors, unpacked, analyze(result.traces).to_dict())
    assert got[""] == got["1"]
    return result


def test_lightkeeper_analyze_says_which_reader_ran(tmp_path, monkeypatch, capsys):
    from lightkeeper.cli import main

    (tmp_path / "rank0").write_bytes(pickle.dumps(plain_dump(0, 1, 5), protocol=2))
    for pure, reader in (("", "c"), ("1", "python")):
        monkeypatch.setenv(PURE, pure)
        assert main(["analyze", "--format", "json", str(tmp_path)]) == 0
        assert f'"pickle_reader": "{reader}"' in capsys.readouterr().out
        assert main(["analyze", str(tmp_path)]) == 0
        assert f"(pickle reader: {reader})" in capsys.readouterr().out.splitlines()[0]


# ---- hostile input -----------------------------------------------------------------------------


def hostile_inputs() -> list[bytes]:
    """A small dump truncated at every offset, with random byte flips (fixed seed), and with
    huge declared lengths and indices."""
    import random

    base = pickle.dumps(steady_dump(2, 8, 12, frames=2), protocol=2)
    framed = pickle.dumps(plain_dump(1, 4, 6), protocol=5)
    out = [base[:i] for i in range(len(base))] + [framed[:i] for i in range(0, len(framed), 7)]
    rng = random.Random(10)
    for _ in range(1000):
        mutant = bytearray(rng.choice((base, framed)))
        for _ in range(rng.randint(1, 3)):
            mutant[rng.randrange(2, len(mutant))] = rng.randrange(256)
        out.append(bytes(mutant))
    huge = [
        b"\x80\x04\x95" + struct.pack("<Q", 2**63 - 1) + b"N.",  # FRAME
        b"\x80\x04\x8d" + struct.pack("<Q", 2**63 - 1) + b"ab.",  # BINUNICODE8
        b"\x80\x04\x8e" + struct.pack("<Q", 2**64 - 1) + b"ab.",  # BINBYTES8
        b"\x80\x02X" + struct.pack("<I", 2**32 - 1) + b"ab.",  # BINUNICODE
        b"\x80\x02Nr" + struct.pack("<I", 2**32 - 1) + b".",  # LONG_BINPUT
        b"\x80\x02Nq\x00j" + struct.pack("<I", 2**32 - 1) + b".",  # LONG_BINGET
        b"\x80\x02\x8a\xff" + b"\x01" * 10 + b".",  # LONG1 past the end
        b"\x80\x02" + b"](" * 100_000 + b"e" * 100_000 + b".",  # deep nesting
        b"\x80\x02" + b"(" * 100_000 + b"N.",  # many marks
        b"\x80\x02}N]s.",  # a list as a dict key
        b"\x80\x02X\x02\x00\x00\x00\xc3(.",  # not UTF-8
        b"\x80\x02X\x03\x00\x00\x00\xed\xa0\x80.",  # a lone surrogate: pickle takes it
        b"\x80\x02]q\x00h\x00a.",  # a list that contains itself
        b"\x80\x02]q\x00h\x00\x85q\x01a.",  # a list in a tuple in that list
    ]
    return out + huge


# Every input the C reader accepts is compared with the Python path, file by file through the
# loader; one it refuses needs no comparison, since the loader then reads it with Python's
# unpickler anyway (and some of these would make that unpickler allocate gigabytes: a
# LONG_BINPUT index of 2**31 grows its memo to that size, which the C reader refuses).
FUZZ = """
import os, pickle, sys, tempfile
from pathlib import Path
from monitor.analysis import _frpickle, loader
from tests.test_analysis_creader import hostile_inputs
bad, accepted, refused = [], 0, 0
with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "rank3"
    for i, data in enumerate(hostile_inputs()):
        try:
            built = _frpickle.parse(data).load()
        except _frpickle.DumpRefused:
            refused += 1
            continue
        accepted += 1
        try:  # pickled again: equal values, and the same sharing and cycles (== recurses forever on those)
            same = pickle.dumps(built, protocol=5) == pickle.dumps(pickle.loads(data), protocol=5)
        except Exception as exc:
            same = repr(exc)
        path.write_bytes(data)
        got = []
        for pure in ("", "1"):
            os.environ[loader.PURE_PYTHON_ENV] = pure
            trace, error = loader.load_outcome(path)
            got.append((repr(trace), error))
        if same is not True or got[0] != got[1]:
            bad.append((i, same, got))
print(accepted, refused, len(bad), bad[:3])
sys.exit(1 if bad else 0)
"""


def test_hostile_bytes_give_a_clean_error_or_the_python_verdict_under_dev_mode():
    res = subprocess.run([sys.executable, "-X", "dev", "-c", FUZZ], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    accepted, refused, mismatched = map(int, res.stdout.split()[:3])
    assert mismatched == 0
    assert accepted > 100, "too few mutants were read by the C reader: the comparison would be vacuous"
    assert refused > 1000  # every truncation, at least


def test_no_leak_over_many_loads():
    good = pickle.dumps(plain_dump(0, 2, 60, frames=2), protocol=2)
    deep = plain_dump(0, 2, 10)
    nested: list = []
    for _ in range(150):
        nested = [nested]
    deep["entries"][0]["frames"] = nested  # parsed, then a build fails half-way
    deep_data = pickle.dumps(deep, protocol=2)

    def once():
        d = frpickle.parse(good)
        d.columns(_KEYS, "duration_ms")
        d.load()
        for bad in (good[:-1], good[: len(good) // 2]):
            with pytest.raises(frpickle.DumpRefused):
                frpickle.parse(bad)
        d = frpickle.parse(deep_data)
        for method in (lambda: d.columns(_KEYS, "duration_ms"), d.load):
            with pytest.raises(frpickle.DumpRefused):
                method()

    tracemalloc.start()
    try:
        for _ in range(30):  # allocators' free lists and caches fill up first (traced too)
            once()
        gc.collect()  # the caught exceptions' tracebacks are cycles: only the collector frees them
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(100):
            once()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # leak-free, nothing grows once warm (measured: 0 to 32 bytes); one leaked object of the
    # smallest size (a 1-tuple, 48 bytes) per round would be 4.8 KiB, one per entry 290 KiB
    assert grown < 4096, grown


def test_a_memo_index_past_the_file_is_an_error_not_a_huge_memo(tmp_path, monkeypatch):
    # LONG_BINPUT 2**31 - 1: Python's unpickler would grow its memo to that many slots (~16 GiB
    # of pointers); the C reader refuses it and the loader must not hand it on
    monkeypatch.delenv(loader.PURE_PYTHON_ENV, raising=False)
    if loader.pickle_reader() != "c":
        pytest.skip("the C reader is not built here (CI asserts it is)")
    path = tmp_path / "rank0"
    path.write_bytes(b"\x80\x02}r\xff\xff\xff\x7f.")
    trace, error = loader.load_outcome(path)
    assert trace is None
    assert error.startswith("invalid pickle: memo index out of range"), error
