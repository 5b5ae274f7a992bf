"""Core ``lightkeeper`` (a rank's WorkerServer, ``lightkeeper run``, analyze, dashboards build)
installs and runs in a fresh virtual environment that has no torch, no torchft and none of the
monitor's own dependencies (numpy, msgspec, promql-parser) nor matplotlib: ``[worker]`` goes into
a training job's environment, which may pin them (docs/install.md). The ``[monitor]`` extra then
runs the monitor.

How the environments are built, offline: the project is built into a wheel from a copy of the
checkout (with .venv's setuptools, no index); a new venv (``python -m venv``, no system site
packages) gets that wheel with ``pip --python`` and ``--no-deps``, and its dependencies are the
wheel's own ``Requires-Dist`` (core alone, or with the ``monitor`` extra), resolved transitively
against what .venv has installed and linked into the new venv's site-packages, distribution by
distribution (its RECORD). ``pip check`` in the core venv then proves the wheel's requirements
are met there, and the test asserts torch and torchft are not in that closure and cannot be
imported. Then the console script runs: ``--help``, ``analyze`` on the shipped format sample,
``dashboards build --check``, ``run --print-env``, the autostart ``.pth`` with
``LIGHTKEEPER_AUTOSTART=1``, ``train``'s and ``monitor``'s one-line answers that they need an
extra; with the ``monitor`` extra, ``monitor`` serving its API.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import requests
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from lightkeeper.processes import stop_process, wait_until

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lightkeeper", "worker_server", "trainer", "monitor", "dashboards", "http_serving",
            "rank_wire")
HEAVY = {"torch", "torchft", "triton", "nvidia-nccl-cu12"}
# what a training job's environment may pin, which a rank's install must not upgrade
JOB_PINNED = {"numpy", "matplotlib", "msgspec", "promql-parser"}
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]


def closure(requirements: list[str]) -> set[str]:
    """Canonical names of the installed distributions ``requirements`` need (extras off)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        todo.extend(Requirement(r) for r in metadata.distribution(name).requires or [])
    return seen


def link_distribution(name: str, site: Path) -> None:
    """Symlink every top-level entry a distribution installed (per its RECORD) into ``site``."""
    dist = metadata.distribution(name)
    base = Path(dist.locate_file(""))
    tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
    for top in tops:
        target = site / top
        if not target.exists() and (base / top).exists():
            target.symlink_to(base / top)


def linked_venv(venv: Path, requirements: list[str]) -> tuple[Path, Path]:
    """A new venv (no pip, no system site packages) at ``venv`` holding ``requirements``'
    distributions linked from .venv; its Python and site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"], check=True,
                               capture_output=True, text=True).stdout.strip())
    for name in closure(requirements):
        link_distribution(name, site)
    return python, site


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    d = tmp_path_factory.mktemp("wheel")
    src = d / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "node_modules", "*.egg-info", "build")
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=ignore)
    subprocess.run([*PIP, "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(d / "dist"), str(src)], check=True, timeout=180,
                   capture_output=True)
    path = next((d / "dist").glob("lightkeeper-*.whl"))
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines()
                if line.startswith("Requires-Dist:")]
    return path, names, requires


def make_env(d: Path, wheel, extra: str | None = None) -> dict:
    """A venv holding the wheel and its requirements (core, or with ``extra``)."""
    path, names, requires = wheel
    wanted = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and extra and req.marker.evaluate({"extra": extra}):
            req.marker = None
        wanted.append(str(req))
    venv = d / "venv"
    deps = closure([r for r in wanted if not r.startswith("lightkeeper")])
    python, _ = linked_venv(venv, sorted(deps))
    subprocess.run([*PIP, "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(path)], check=True, timeout=180, capture_output=True)
    # only the core venv's is asserted (test_core_installs_without_torch): pip is slow to start
    check = subprocess.run([*PIP, "--python", str(python), "check"], capture_output=True,
                           text=True, timeout=120) if extra is None else None
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LIGHTKEEPER_AUTOSTART")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    work = d / "work"  # not the checkout: nothing importable from the working directory
    work.mkdir()
    return {"python": str(python), "lightkeeper": str(venv / "bin" / "lightkeeper"), "env": env,
            "cwd": work, "deps": deps, "wheel_names": names, "pip_check": check,
            "requires": requires}


@pytest.fixture(scope="module")
def core_env(tmp_path_factory, wheel):
    return make_env(tmp_path_factory.mktemp("core"), wheel)


@pytest.fixture(scope="module")
def monitor_env(tmp_path_factory, wheel):
    return make_env(tmp_path_factory.mktemp("monitor"), wheel, extra="monitor")


def run(venv, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=120,
                          cwd=venv["cwd"], env={**venv["env"], **env})


def test_core_installs_without_torch(core_env):
    assert not core_env["deps"] & (HEAVY | JOB_PINNED), sorted(core_env["deps"])
    assert core_env["pip_check"].returncode == 0, core_env["pip_check"].stdout
    res = run(core_env, core_env["python"], "-c", "import torch")
    assert res.returncode == 1 and "No module named 'torch'" in res.stderr
    res = run(core_env, core_env["python"], "-c", "import torchft")
    assert res.returncode == 1 and "No module named 'torchft'" in res.stderr
    # torch and torchft are in the extras, never in the core requirements; [worker] keeps the
    # job's torchft (0.2.x or nightly: both own torchft/) and so requires none
    extras = [r for r in core_env["requires"] if "extra ==" in r]
    assert any(r.startswith("torch>=2.7") and '"worker"' in r for r in extras), extras
    assert not [r for r in extras if r.startswith("torchft") and '"worker"' in r], extras
    assert not [r for r in core_env["requires"] if "extra ==" not in r
                and canonicalize_name(Requirement(r).name) in HEAVY]


def test_core_entry_points_run_without_torch(core_env, tmp_path):
    lk = core_env["lightkeeper"]
    res = run(core_env, lk, "--help")
    assert res.returncode == 0 and "analyze" in res.stdout and "run" in res.stdout, res.stderr

    sample = ROOT / "tests" / "fixtures" / "fr-format-sample" / "json"
    res = run(core_env, lk, "analyze", "--format", "json", str(sample))
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert (report["ranks"], report["findings"], report["errors"]) == ([0, 1, 2, 3], [], [])

    res = run(core_env, lk, "dashboards", "build", "--check")
    assert res.returncode == 0, res.stdout + res.stderr

    res = run(core_env, lk, "run", "--print-env")
    assert res.returncode == 0 and "LIGHTKEEPER_AUTOSTART=1" in res.stdout, res.stderr
    res = run(core_env, lk, "run", "--", core_env["python"], "-c", "print('job')")
    assert res.returncode == 0 and res.stdout == "job\n", res.stderr
    assert res.stderr.startswith("lightkeeper run: torchft is not installed in ") and \
        res.stderr.count("\n") == 1, res.stderr

    res = run(core_env, lk, "train", "--lighthouse", "http://127.0.0.1:1")
    assert res.returncode == 1
    assert "needs torch and torchft" in res.stderr and "lightkeeper[trainer]" in res.stderr

    res = run(core_env, lk, "demo", "--no-faults")  # says so before starting anything
    assert res.returncode == 2
    assert "needs torch and torchft" in res.stderr and "lightkeeper[trainer]" in res.stderr

    # the .pth at the top of site-packages: with LIGHTKEEPER_AUTOSTART=1 every interpreter of
    # the environment installs the hook (and, without torchft, nothing else happens)
    probe = ("import sys; from worker_server import autostart; "
             "print(any(isinstance(f, autostart.ManagerFinder) for f in sys.meta_path))")
    assert "lightkeeper-autostart.pth" in core_env["wheel_names"]
    for value, expected in (("1", "True"), ("0", "False")):
        res = run(core_env, core_env["python"], "-c", probe, LIGHTKEEPER_AUTOSTART=value)
        assert (res.returncode, res.stdout.strip(), res.stderr) == (0, expected, ""), value

    # a rank's install has no monitor: said in one line, with the extra that brings it
    res = run(core_env, lk, "monitor", "--port", "0")
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert "pip install 'lightkeeper[monitor]'" in res.stderr, res.stderr


def test_the_monitor_extra_runs_the_monitor(monitor_env, tmp_path):
    assert monitor_env["deps"] >= {"numpy", "msgspec", "promql-parser"}, monitor_env["deps"]
    assert not monitor_env["deps"] & HEAVY, sorted(monitor_env["deps"] & HEAVY)
    lk = monitor_env["lightkeeper"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "monitor.log", "wb")
    proc = subprocess.Popen([lk, "monitor", "--port", str(port), "--interval", "0.5",
                             "--state", str(tmp_path / "m.sqlite")], stdout=log,
                            stderr=subprocess.STDOUT, cwd=monitor_env["cwd"], env=monitor_env["env"],
                            start_new_session=True)
    log.close()
    try:
        def serving():
            if proc.poll() is not None:
                raise AssertionError((tmp_path / "monitor.log").read_text())
            try:
                return requests.get(f"http://127.0.0.1:{port}/v1/cluster", timeout=1).json()
            except requests.RequestException:
                return None
        cluster = wait_until(serving, 60, what="the monitor to serve")
        assert cluster["groups"] == []
        wait_until(lambda: requests.get(f"http://127.0.0.1:{port}/v1/cluster",
                                        timeout=1).json()["sweeps"] >= 2, 30, what="2 sweeps")
    finally:
        stop_process(proc, grace=3)
