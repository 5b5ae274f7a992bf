"""``lightkeeper analyze`` on incident bundles with fuzzed manifests and findings, and on one
that unpacks to more than it may read: an exit status and error entries, never a traceback.
The bundle is the one a real job's monitor kept (tests/fixtures/torch-debug-server-h100).
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import tarfile
from pathlib import Path

import pytest

from lightkeeper.cli import main
from monitor.analysis import bundle
from tests.support.fuzz import mutate

FIXTURE = Path(__file__).parent / "fixtures" / "torch-debug-server-h100" / "bundle-evict-hang.tar.gz"
WEIRD = [None, True, 0, -1, 2**70, 1e308, float("nan"), "", "x", "\u00e9", [], {}, [1],
         [{"a": 1}], {"a": 1}, [None], ["x"], [{"fr_trace": []}], [-1]]


def members() -> list[tuple[str, bytes]]:
    with tarfile.open(FIXTURE) as src:
        return [(m.name, src.extractfile(m).read()) for m in src if m.isfile()]


def write(path: Path, files: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w:gz") as dst:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            dst.addfile(info, io.BytesIO(data))
    return path


def analyze(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["analyze", *args])
    return rc, out.getvalue()


@pytest.mark.parametrize("trigger", [[], {}, {"a": 1}])
def test_a_manifest_whose_trigger_is_not_a_string_is_an_error_entry(tmp_path, trigger):
    """Before: ``TypeError: unhashable type`` out of the text report."""
    files = [(n, json.dumps({**json.loads(d), "trigger": trigger}).encode())
             if n.endswith("/manifest.json") else (n, d) for n, d in members()]
    path = write(tmp_path / "b.tar.gz", files)
    rc, out = analyze(str(path))
    assert rc == 2 and f"error: {path}: manifest.json: trigger is not a string" in out, out


def test_fuzzed_manifests_and_findings_never_raise(tmp_path):
    rng = random.Random(11)
    base = members()
    for i in range(80):
        files = []
        for name, data in base:
            if name.endswith(("/manifest.json", "/findings.json")) and rng.random() < 0.7:
                doc = json.loads(data)
                mutate(rng, doc, WEIRD)
                data = json.dumps(doc).encode()
            files.append((name, data))
        path = write(tmp_path / f"b{i}.tar.gz", files)
        for fmt in ("json", "text"):
            rc, _ = analyze("--format", fmt, str(path))
            assert rc in (0, 1, 2), (i, fmt)


def test_what_a_bundle_unpacks_to_is_bounded_in_all(tmp_path, monkeypatch):
    """Each member was capped (1 GiB), their number not: a small archive of many members of
    zeros unpacked to any size on disk. Now the members read are capped in all; what came
    before the cap is analyzed, with an error entry."""
    files = members()
    read = [len(d) for n, d in files if n.endswith(("/manifest.json", "/findings.json"))
            or "/fr/" in n]  # the members analyze reads, in the archive's order
    assert len(read) == 4  # manifest, findings, two dumps: the cap lets the first dump in
    monkeypatch.setattr(bundle, "MAX_READ_BYTES", sum(read[:3]))
    path = write(tmp_path / "b.tar.gz", files)
    rc, out = analyze("--format", "json", str(path))
    report = json.loads(out)
    assert len(report["ranks"]) == 1, report
    [error] = report["errors"]
    assert error["path"] == str(path) and "bytes unpacked" in error["error"], error
