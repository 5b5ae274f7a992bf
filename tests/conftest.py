"""Shared pytest setup: the repo root on sys.path so `tests.support` imports work."""

from __future__ import annotations

import functools
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


# Under pytest-xdist (bin/test's passes) a module stays whole on one worker: its module-scoped
# fixture (an e2e module's one job) is built once. The modules that start `lightkeeper demo`
# share one worker: the demo holds a machine-wide lock. Our own scheduler, since `--dist
# loadgroup` silently stopped grouping on pytest 9.2 (pytest-xdist issue #1386).
DEMO_MODULES = {"test_demo_e2e.py", "test_demo_hosts.py", "test_demo_keep_running.py",
                "test_demo_placement.py", "test_install_core.py"}


def module_scope(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return "demo" if Path(module).name in DEMO_MODULES else module


# The longest modules of the two parallel passes, longest first (their tests' summed time in
# that pass): they are handed out first, so the workers end together (pytest-xdist's own order
# is by test count, which says little here). A module with tests in both passes sits by its
# end-to-end part; its in-process part then comes early in the first pass, where only
# test_monitor_shard.py's is long (the first pass's longest).
LONGEST_FIRST = (
    # end-to-end jobs (bin/test's second pass)
    "test_trainer_ranks_e2e.py", "test_planned_maintenance_e2e.py", "test_dashboards_live.py",
    "test_trainer_group_sizes.py", "test_audit_quarantine_slurm.py", "test_secrets_shown.py",
    "test_trainer_launch.py", "test_torch_debug_server_e2e.py", "test_monitor_shard.py",
    "test_rank_abort_e2e.py", "test_monitor_stuck_starting.py", "test_torchtitan.py",
    "test_audit_time_monitor.py",
    # in-process (the first pass)
    "test_dashboards_promtool.py", "test_install_core.py", "test_monitor_network.py",
    "test_monitor_api.py", "test_shard_decide.py", "test_bench_smoke.py",
    "test_monitor_fr_wait.py", "test_monitor_poll_process.py", "test_audit_trainer.py",
    "test_monitor_poller.py", "test_monitor_trust.py", "test_audit_restart.py",
    "test_autostart_ddp.py", "test_audit_longrun.py", "test_analysis_torchft_gloo.py",
    "test_audit_false_positives.py", "test_audit_security.py", "test_audit_fuzz_state.py",
    "test_slurm_sink_jobs.py")
_RANK = {name: i for i, name in enumerate(LONGEST_FIRST)}


@pytest.hookimpl(tryfirst=True)  # before -m deselects: every marked test is seen
def pytest_collection_modifyitems(config, items):
    """Longest modules first (a stable sort: each module's tests keep their file order).

    bin/test's end-to-end passes collect only the files that name their marker
    (``mark.e2e``, ``mark.solo``); a test marked another way would silently run in no pass."""
    for item in items:
        for mark in ("e2e", "solo"):
            if item.get_closest_marker(mark) and f"mark.{mark}" not in _text(item.path):
                raise pytest.UsageError(f"{item.nodeid} is marked {mark}, but its file does "
                                        f"not say mark.{mark}: bin/test would not run it")
    items.sort(key=lambda item: _RANK.get(Path(item.nodeid.split("::", 1)[0]).name,
                                          len(LONGEST_FIRST)))


@functools.cache
def _text(path: Path) -> str:
    return path.read_text()


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the order above

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return module_scope(nodeid)

        def _reschedule(self, node) -> None:
            # The next module only once the worker is down to the test it holds back (a worker
            # runs a test once it knows the one after): pytest-xdist's own hands it out two
            # tests early, binding a module to a worker that may still run a long test.
            if self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    return ModuleScheduling(config, log)


def pytest_sessionfinish(session, exitstatus):
    # the faked processes the tests killed leave libfaketime's pairs in /dev/shm: not ours to keep
    try:  # (tests/test_xdist_scheduling.py runs this file in a suite of its own, without support/)
        from tests.support.faketime import remove_stale_objects
    except ImportError:
        return
    remove_stale_objects()
