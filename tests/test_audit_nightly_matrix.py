"""docs/install.md's version matrix, noxfile.py, .ci/torchft-nightly.txt, pyproject.toml and
bin/bootstrap name the same sessions and pins (nox is run with -l only: nothing is installed)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support.noxfile import load_noxfile

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "install.md").read_text()


def noxfile():
    return load_noxfile()


def nightly_pin() -> str:
    lines = (ROOT / ".ci" / "torchft-nightly.txt").read_text().splitlines()
    (pin,) = [ln.split("==", 1)[1] for ln in lines if ln.startswith("torchft-nightly==")]
    return pin


def test_every_session_the_docs_name_exists():
    named = set(re.findall(r"nox -s (\w+)", DOC))
    assert named >= {"floor", "newest"}
    nox = Path(sys.executable).parent / "nox"
    for name in named:
        out = subprocess.run([str(nox), "-l", "--json", "-s", name], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert {s["name"] for s in json.loads(out.stdout)} == {name}


def test_the_docs_table_and_the_pins_agree_with_the_noxfile():
    nf = noxfile()
    rows = [r for r in DOC.splitlines() if r.startswith("| 2.")]
    torches = {r.split("|")[1].strip().split()[0]: r for r in rows}
    assert nf.DEFAULT_TORCH in torches and "nox -s floor" in torches[nf.FLOOR_TORCH]
    assert "nox -s newest" in torches[nf.NEWEST_TORCH]
    assert nf.TORCHFTS == ["0.2.0", "nightly"]
    trainer = tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]["trainer"]
    assert f"torchft=={nf.TORCHFTS[0]}" in trainer
    assert f"torch=={nf.DEFAULT_TORCH}" in (ROOT / "bin" / "bootstrap").read_text()
    minor = ".".join(nf.DEFAULT_TORCH.split(".")[:2])
    assert any(t.startswith(f"torch>={minor},") for t in trainer), trainer
    assert nf.torchft_requirement("nightly") == ["-r", str(nf.NIGHTLY_PIN)]
    matrix = (ROOT / "benchmarks" / "results" / "version_matrix.json").read_text()
    assert f"torchft-nightly {nightly_pin()}" in matrix
    assert nf.NEWEST_TORCH in matrix and nf.FLOOR_TORCH in matrix


def test_the_unpacked_nightly_is_the_pinned_one():
    site = Path(os.environ.get("LIGHTKEEPER_TORCHFT_NIGHTLY_SITE")
                or Path(sys.prefix) / "torchft-nightly")  # where the e2e test looks
    infos = [p.name for p in site.glob("torchft_nightly-*.dist-info")]
    if not infos:
        pytest.skip(f"no torchft-nightly in {site}: bin/bootstrap installs it there")
    assert infos == [f"torchft_nightly-{nightly_pin()}.dist-info"], (site, infos)
