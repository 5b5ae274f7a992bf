"""``bin/bootstrap`` is quick when everything is there, also where the analyzer's C reader cannot
be built (a C compiler but no Python headers): it tries that build once, says so once, and does
not reinstall the project on every later run (``bin/lightkeeper`` runs it before each command).

Faked: .venv's ``python`` is a stand-in that records what ``python -m pip`` is asked (it builds
nothing, as where the headers are missing). A real .venv takes minutes to build (torch first);
what is checked here is bootstrap's own decision, run by bash on a copy of the files it reads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("bin/bootstrap", "pyproject.toml", "setup.py", "monitor/analysis/_frpickle.c",
          ".ci/torchft-nightly.txt", "dashboards/schema/package-lock.json")


def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    for rel in COPIED:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, root / rel)
    pin = next(line.split("==", 1)[1] for line in
               (root / ".ci/torchft-nightly.txt").read_text().splitlines()
               if line.startswith("torchft-nightly=="))
    (root / f".venv/torchft-nightly/torchft_nightly-{pin}.dist-info").mkdir(parents=True)
    modules = root / "dashboards/schema/node_modules"
    modules.mkdir()
    (modules / ".package-lock.json").write_text("{}")
    bindir = root / ".venv/bin"
    bindir.mkdir(parents=True)
    # torch, torchtitan: "importable"; `python -m pip` (how bootstrap runs pip) records its args
    (bindir / "python").write_text(
        f'#!/bin/sh\nif [ "$1 $2" = "-m pip" ]; then shift 2; echo "$*" >> "{root}/pip.log"; fi\n'
        "exit 0\n")
    (bindir / "python").chmod(0o755)
    return root


def bootstrap(root: Path) -> subprocess.CompletedProcess:
    # CC names a compiler that exists; the stand-in pip builds nothing with it
    env = {"PATH": os.environ["PATH"], "CC": "true", "HOME": str(root)}
    return subprocess.run(["bash", str(root / "bin/bootstrap")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=60)


def installs(root: Path) -> int:
    log = root / "pip.log"
    return sum("-e .[dev]" in line for line in log.read_text().splitlines()) \
        if log.exists() else 0


def test_a_c_reader_that_cannot_build_is_not_retried_every_run(tmp_path):
    root = checkout(tmp_path)
    first = bootstrap(root)
    assert first.returncode == 0, first.stderr
    assert installs(root) == 1 and "C reader was not built" in first.stderr, first.stderr
    second = bootstrap(root)
    assert second.returncode == 0, second.stderr
    assert installs(root) == 1, second.stderr
    assert "installing lightkeeper" not in second.stderr and "C reader" not in second.stderr
    # a changed setup.py is installed again (and the build tried again)
    stamp = root / ".venv/.lightkeeper-installed"
    os.utime(stamp, (stamp.stat().st_atime - 10, stamp.stat().st_mtime - 10))
    (root / "setup.py").touch()
    assert bootstrap(root).returncode == 0 and installs(root) == 2


def test_installing_prometheus_stops_only_the_service_the_install_started(tmp_path):
    """``--prometheus`` as root where none is installed: apt-get installs it (no Recommends, so
    no node exporter), bootstrap stops the system Prometheus the package started, and kills
    nothing else (a node exporter running there is the operator's). Faked: apt-get, systemctl
    and every process killer record their calls; PATH holds only them and what bash needs."""
    root = checkout(tmp_path)
    shims = tmp_path / "shims"
    shims.mkdir()
    calls = tmp_path / "calls.log"
    for tool in ("dirname", "cat", "grep", "env"):
        (shims / tool).symlink_to(shutil.which(tool))
    fakes = {"id": "echo 0", "python3": "exit 0",
             **{n: f'echo "{n} $*" >> "{calls}"'
                for n in ("apt-get", "systemctl", "pkill", "killall", "pgrep")}}
    for name, body in fakes.items():
        (shims / name).write_text(f"#!/bin/sh\n{body}\n")
        (shims / name).chmod(0o755)
    env = {"PATH": str(shims), "CC": "true", "HOME": str(root)}
    done = subprocess.run([shutil.which("bash"), str(root / "bin/bootstrap"), "--prometheus"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = calls.read_text().splitlines()
    assert "apt-get install -y -qq --no-install-recommends prometheus" in lines, lines
    assert "systemctl stop prometheus" in lines, lines
    assert not [line for line in lines if line.split()[0] in ("pkill", "killall", "pgrep")]
