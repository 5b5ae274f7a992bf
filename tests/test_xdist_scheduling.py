"""bin/test's pytest-xdist runs keep a module whole on one worker (tests/conftest.py's scheduler).

A module's module-scoped fixture (an e2e module's one job) must be built once, and the modules
that start `lightkeeper demo` (a machine-wide lock) must never run at once. pytest-xdist's own
`--dist loadgroup` once stopped grouping without a word (pytest-xdist issue #1386): this runs a
small suite under `-n 2` with this repository's conftest and reads which worker ran each test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

MODULE = '''
import os

import pytest


@pytest.mark.parametrize("i", range(4))
def test_where(i):
    with open(os.environ["WHERE_LOG"], "a") as f:
        f.write(f"{__name__} {os.environ['PYTEST_XDIST_WORKER']}\\n")
'''


def test_a_module_and_the_demo_modules_each_stay_on_one_worker(tmp_path):
    suite = tmp_path / "tests"
    suite.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), suite / "conftest.py")
    names = ["test_a", "test_b", "test_c", "test_d", "test_demo_e2e", "test_install_core"]
    for name in names:
        (suite / f"{name}.py").write_text(MODULE)
    log = tmp_path / "where.log"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider", str(suite)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
             "WHERE_LOG": str(log)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers: dict[str, set[str]] = defaultdict(set)
    for line in log.read_text().splitlines():
        module, worker = line.split()
        workers[module].add(worker)
    assert sorted(workers) == sorted(names), workers
    assert all(len(w) == 1 for w in workers.values()), workers  # each module whole
    assert workers["test_demo_e2e"] == workers["test_install_core"], workers  # the demo lock
    assert len(set().union(*workers.values())) == 2, workers  # and both workers used
