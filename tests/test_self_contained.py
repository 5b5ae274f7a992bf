"""A clone is whole: nothing the project runs reads a path beside or outside its checkout, and
what a fresh machine lacks is installed by bin/bootstrap or named in one clear line.

(.ci/run runs the whole suite from a fresh clone in an empty temporary directory; these tests
catch the same mistakes in any checkout, in a second.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Built from pieces so that this file does not match itself.
OUTSIDE = ["." + "./shared", "/work" + "/shared", "/work" + "/main",
           "shared" + "/grafana-schema"]


def tracked_files() -> list[Path]:
    r = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, timeout=60,
                       check=True)
    return [REPO / name for name in r.stdout.decode().split("\0") if name]


def test_no_tracked_file_names_a_path_outside_the_repository():
    files = tracked_files()
    assert len(files) > 50 and REPO / "bin" / "test" in files
    hits = []
    for path in files:
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary (pictures, pickled dumps) or deleted in this working tree
        hits += [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
                 for n, line in enumerate(text.splitlines(), 1)
                 if any(s in line for s in OUTSIDE)]
    assert not hits, "\n".join(hits)


def test_the_flight_recorder_format_sample_is_a_fixture_in_the_repository():
    sample = REPO / "tests" / "fixtures" / "fr-format-sample"
    tracked = {p.relative_to(sample).as_posix() for p in tracked_files()
               if p.is_relative_to(sample)}
    assert tracked == {"README.md", *(f"json/rank{r}.json" for r in range(4)),
                       *(f"pickle/rank{r}" for r in range(4))}


def test_the_schema_check_is_pinned_in_the_repository():
    """The dashboard schema check installs from the lock file committed beside it, and its
    node_modules is never committed."""
    names = {p.relative_to(REPO).as_posix() for p in tracked_files()}
    assert {"dashboards/schema/package.json", "dashboards/schema/package-lock.json",
            "dashboards/schema/dashboard.ts"} <= names
    assert not any("node_modules" in n for n in names)


def test_demo_without_prometheus_says_in_one_line_how_to_get_it(monkeypatch, tmp_path):
    from lightkeeper import prometheus

    monkeypatch.delenv("PROMETHEUS_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no prometheus on it
    assert prometheus.binary() is None
    assert "\n" not in prometheus.INSTALL_HINT
    assert "bin/bootstrap --prometheus" in prometheus.INSTALL_HINT
    with pytest.raises(prometheus.PrometheusError, match="bin/bootstrap --prometheus"):
        prometheus.start(["127.0.0.1:1"], tmp_path)
