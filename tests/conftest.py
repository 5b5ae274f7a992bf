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
