"""``lightkeeper analyze`` on incident bundles that are damaged or hand-edited: one error entry
and exit status 2, never a traceback (docs/analyze.md, Exit status). The bundle is the one a
real job's monitor kept (tests/fixtures/torch-debug-server-h100/bundle-evict-hang.tar.gz)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from lightkeeper.cli import main

FIXTURE = Path(__file__).parent / "fixtures" / "torch-debug-server-h100" / "bundle-evict-hang.tar.gz"


def repacked(tmp_path: Path, manifest_patch: dict) -> Path:
    """The fixture bundle with its manifest's fields replaced."""
    out = tmp_path / "edited.tar.gz"
    with tarfile.open(FIXTURE) as src, tarfile.open(out, "w:gz") as dst:
        for m in src:
            data = src.extractfile(m).read()
            if m.name.endswith("/manifest.json"):
                data = json.dumps({**json.loads(data), **manifest_patch}).encode()
            info = tarfile.TarInfo(m.name)
            info.size = len(data)
            dst.addfile(info, io.BytesIO(data))
    return out


@pytest.mark.parametrize("patch", [{"culprit_ranks": "1"}, {"culprit_ranks": [1.5]},
                                   {"decision": "evict"}, {"ranks": [1]}, {"left_out": ["x"]}])
def test_a_manifest_of_the_wrong_shape_is_an_error_entry(tmp_path, capsys, patch):
    path = repacked(tmp_path, patch)
    assert main(["analyze", str(path)]) == 2
    out = capsys.readouterr().out
    [line] = [x for x in out.splitlines() if x.startswith("error: ")]
    assert line.startswith(f"error: {path}: manifest.json: {next(iter(patch))} is not "), line
    assert main(["analyze", "--format", "json", str(path)]) == 2
    [error] = json.loads(capsys.readouterr().out)["errors"]
    assert error["path"] == str(path)


def test_the_untouched_fixture_still_agrees(tmp_path, capsys):
    path = repacked(tmp_path, {})
    assert main(["analyze", "--format", "json", str(path)]) == 1
    [b] = json.loads(capsys.readouterr().out)["bundles"]
    assert (b["culprit_ranks"], b["analysis_agrees"]) == ([1], True)


def test_two_bundles_at_once_are_refused(tmp_path, capsys):
    """Two incidents' ranks 0..N are not one job: one bundle's verdict must not be judged
    against the other's dumps."""
    a, b = tmp_path / "a.tar.gz", tmp_path / "b.tar.gz"
    a.write_bytes(FIXTURE.read_bytes())
    b.write_bytes(FIXTURE.read_bytes())
    assert main(["analyze", "--format", "json", str(a), str(b)]) == 2
    got = capsys.readouterr()
    assert got.out == "" and "2 incident bundles given; analyze one at a time" in got.err


def test_a_broken_dump_inside_a_bundle_is_named_in_the_bundle(tmp_path, capsys):
    """Not by the temporary folder it was unpacked into, gone once analyze ends."""
    out = tmp_path / "cut.tar.gz"
    with tarfile.open(FIXTURE) as src, tarfile.open(out, "w:gz") as dst:
        for m in src:
            data = src.extractfile(m).read()
            if m.name.endswith("/fr/rank1.json"):
                data = data[:5000]
            info = tarfile.TarInfo(m.name)
            info.size = len(data)
            dst.addfile(info, io.BytesIO(data))
    assert main(["analyze", "--format", "json", str(out)]) == 2  # the culprit's dump unread: incomplete
    [error] = json.loads(capsys.readouterr().out)["errors"]
    assert error["path"] == f"{out}: fr/rank1.json", error
    assert error["error"].startswith("invalid JSON"), error


def test_a_bundle_cut_short_keeps_what_came_before_the_cut(tmp_path, capsys):
    """A download cut short: the manifest and the dumps before the cut are analyzed, and the
    error says the archive broke (not 'not an incident bundle')."""
    data = FIXTURE.read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(data[:len(data) - 500])  # the fixture's last member: fr/rank0.json
    main(["analyze", "--format", "json", str(cut)])
    report = json.loads(capsys.readouterr().out)
    assert report["ranks"] == [1] and report["bundles"][0]["culprit_ranks"] == [1]
    [error] = report["errors"]
    assert error["path"] == str(cut)
    assert error["error"].startswith("archive broken after its manifest, the rest not read: ")


def test_a_corrupt_deflate_stream_is_an_error_entry_not_a_traceback(tmp_path, capsys):
    data = bytearray(FIXTURE.read_bytes())
    for i in range(2000, 2050):
        data[i] ^= 0x5A
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(bytes(data))
    assert main(["analyze", "--format", "json", str(bad)]) == 2
    [error] = json.loads(capsys.readouterr().out)["errors"]
    assert error["path"] == str(bad) and "Error -3 while decompressing data" in error["error"]


def test_a_bundle_without_a_readable_dump_claims_no_disagreement(tmp_path, capsys):
    """The culprit's group silent while the bundle was taken: no dump, so no verdict on the
    monitor's culprit either way."""
    out = tmp_path / "nodumps.tar.gz"
    with tarfile.open(FIXTURE) as src, tarfile.open(out, "w:gz") as dst:
        for m in src:
            if "/fr/" not in m.name:
                dst.addfile(m, src.extractfile(m))
    assert main(["analyze", "--format", "json", str(out)]) == 2
    [b] = json.loads(capsys.readouterr().out)["bundles"]
    assert b["culprit_ranks"] == [1] and b["analysis_agrees"] is None
    main(["analyze", str(out)])
    text = capsys.readouterr().out
    assert "(hang, kept before the kill)\n" in text and "does not name" not in text


def test_a_bundle_saved_under_the_urls_name_is_still_a_bundle(tmp_path, capsys):
    """``curl -O .../v1/incidents/<id>/bundle`` saves it as ``bundle``."""
    saved = tmp_path / "bundle"
    saved.write_bytes(FIXTURE.read_bytes())
    assert main(["analyze", "--format", "json", str(saved)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["errors"] == [] and report["bundles"][0]["analysis_agrees"] is True
