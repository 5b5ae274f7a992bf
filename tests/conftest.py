"""Shared pytest setup: the repo root on sys.path so `tests.support` imports work."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_binary(name: str) -> str:
    """Path of a system binary the test needs: a failure in CI (the test command installs it),
    a skip with the reason elsewhere."""
    path = shutil.which(name)
    if path:
        return path
    msg = f"{name} not found on PATH (bin/test installs it with apt-get)"
    if IN_CI:
        pytest.fail(msg)
    pytest.skip(msg)


# Under pytest-xdist (bin/test: `-n 2`) a module stays whole on one worker: its module-scoped
# fixture (an e2e module's one job) is built once. The modules that start `lightkeeper demo`
# share one worker: the demo holds a machine-wide lock. Our own scheduler, since `--dist
# loadgroup` silently stopped grouping on pytest 9.2 (pytest-xdist issue #1386).
DEMO_MODULES = {"test_demo_e2e.py", "test_demo_hosts.py", "test_demo_keep_running.py",
                "test_demo_placement.py", "test_install_core.py"}


def module_scope(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return "demo" if Path(module).name in DEMO_MODULES else module


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return module_scope(nodeid)

    return ModuleScheduling(config, log)
