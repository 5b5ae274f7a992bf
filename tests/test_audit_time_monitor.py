"""A monitor whose wall clock steps while it runs (NTP correcting it, a VM resumed after a pause):
its durations are on a clock that does not step (docs/monitor.md, Limits).

The monitor runs as its own process under libfaketime (Debian's ``faketime``), its offset read
from a file on every call (``FAKETIME_TIMESTAMP_FILE``, ``FAKETIME_NO_CACHE``), the monotonic
clock left true; the test writes the file to step the clock. The ranks are simulated groups in
a real torchft Lighthouse's quorum (``SimJob``, tests/support/monitor_sim.py), their steps moved
by a thread of the test.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from lightkeeper.processes import start_monitor_process, stop_process, wait_until
from tests.conftest import require_binary
from tests.support.faketime import stepping_env
from tests.support.monitor_sim import SimJob

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).parent.parent


def monitor_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The environment of a process whose wall clock is what ``offset_file`` says."""
    offset_file = tmp_path / "faketime-offset"
    env = stepping_env(tmp_path / "shim", offset_file)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT)])
    return {**os.environ, **env}, offset_file


def test_a_monitor_whose_wall_clock_steps_accounts_only_the_time_that_passed(tmp_path):
    """Stepped an hour forward, the ledger booked an hour that never passed (a 3600 s gap, E x
    3600 replica-seconds of badput); stepped back, it skipped every sweep for an hour."""
    require_binary("faketime")
    env, offset_file = monitor_env(tmp_path)
    job = SimJob(3)
    stop = threading.Event()

    def train():  # every group commits a step every 0.1 s
        while not stop.is_set():
            for g in job.alive:
                for r in job.sim.group(g):
                    r.update(step=r.state["step"] + 1, commits=r.state["commits"] + 1,
                             last_step_at=time.time(), last_step_seconds=0.1,
                             recent_step_seconds=[0.1] * 16)
            stop.wait(0.1)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    proc = None
    try:
        proc, url = start_monitor_process(
            [sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0",
             "--state", str(tmp_path / "state.sqlite"), "--interval", "0.2",
             "--targets", ",".join(job.sim.urls), "--lighthouse", job.url, "--job", "sim",
             "--expected-groups", "3", "--dry-run"],
            tmp_path / "monitor.out", tmp_path / "monitor.log", env=env)

        def goodput() -> dict:
            return requests.get(url + "/v1/goodput?incidents=0&intervals=0", timeout=5).json()

        def sweeps() -> int:
            return requests.get(url + "/healthz", timeout=5).json()["sweeps"]

        wait_until(lambda: goodput()["wall_seconds"] > 1.0, 30, what="the ledger to start")
        for offset in ("+3600s", "-3600s"):
            real = time.monotonic()
            before = goodput()
            offset_file.write_text(offset + "\n")
            seen = sweeps()
            wait_until(lambda s=seen: sweeps() >= s + 5, 30, what="five sweeps after the step")
            after = goodput()
            passed = after["wall_seconds"] - before["wall_seconds"]
            # ``before`` is the ledger as of its last sweep, which on a loaded box may have
            # ended a second or two before ``real``: 5 s of slack, against the hour it guards
            assert 0 < passed <= time.monotonic() - real + 5.0, (offset, before, after)
            assert after["at"] - before["at"] == pytest.approx(passed, abs=0.5), (offset, after)
            assert (after["gaps"], after["gap_seconds"], after["skipped_sweeps"]) == (0, 0.0, 0)
            assert after["job"]["badput_seconds"]["unattributed"] < 3.0, after["job"]
    finally:
        stop.set()
        if proc is not None:
            stop_process(proc, grace=3)
        job.stop()
