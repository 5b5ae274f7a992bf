"""A nox session of the version matrix (noxfile.py) can run its test: pytest, in an environment
holding exactly what the session installs, collects tests/test_torchft_versions_e2e.py.

Faked: the session's pip installs. A real session installs torch from a wheel into a fresh venv
(about two minutes), too slow for the suite; here the session function runs against a recording
stand-in for ``nox.Session``, and each distribution it would install (with its requirements) is
linked from .venv into a fresh venv (``tests/test_install_core.py``'s way), so the venv holds
what the session's would and nothing else (no pytest-xdist unless the session installs it).
"""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

from tests.support.noxfile import load_noxfile
from tests.test_install_core import linked_venv

ROOT = Path(__file__).resolve().parents[1]


class RecordingSession:
    posargs: list[str] = []

    def __init__(self) -> None:
        self.installs: list[str] = []
        self.runs: list[tuple[str, ...]] = []

    def install(self, *args: str) -> None:
        self.installs.extend(args)

    def run(self, *args: str) -> None:
        self.runs.append(args)


def session_requirements() -> tuple[list[str], tuple[str, ...]]:
    """What the default session with torchft 0.2.0 installs (``.[worker,monitor]`` as requirements) and
    the pytest command it runs."""
    noxfile = load_noxfile()
    session = RecordingSession()
    noxfile.run_matrix_test(session, noxfile.DEFAULT_TORCH, "0.2.0")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = []
    for item in session.installs:
        if item.startswith(".["):  # the project with its extras, as their requirements
            reqs += project["dependencies"]
            for extra in item[2:-1].split(","):
                reqs += [r for r in project["optional-dependencies"][extra]
                         if not r.startswith("lightkeeper")]
        else:
            reqs.append(item.replace("==", ">=", 1))  # .venv's own build of the pinned one
    (pytest_run,) = [r for r in session.runs if r[:3] == ("python", "-m", "pytest")]
    return reqs, pytest_run[1:]


def test_a_nox_session_collects_the_matrix_test(tmp_path):
    reqs, pytest_args = session_requirements()
    python, _ = linked_venv(tmp_path / "venv", reqs)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LIGHTKEEPER_AUTOSTART", "PYTEST_ADDOPTS")}
    res = subprocess.run([str(python), *pytest_args, "--collect-only"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "test_torchft_versions_e2e.py::" in res.stdout and "this_python" in res.stdout, res.stdout
