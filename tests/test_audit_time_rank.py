"""A rank whose wall clock steps while it trains (NTP correcting it, a VM resumed after a pause):
the durations it serves are on its monotonic clock (docs/worker_server.md).

The rank is a WorkerServer in its own process under libfaketime (Debian's ``faketime``), its
offset read from a file on every call (``FAKETIME_TIMESTAMP_FILE``, ``FAKETIME_NO_CACHE``), the
monotonic clock left true; the rank's process steps its own clock by writing the file between
the calls a training loop makes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import requests

from lightkeeper.processes import stop_process, wait_until
from tests.conftest import require_binary
from tests.support.faketime import stepping_env
from tests.support.lines import first_line

ROOT = Path(__file__).parent.parent
RANK = r'''
import sys, time
from pathlib import Path
from worker_server.server import WorkerServer
from worker_server.state import RankIdentity, RankState

offset = Path(sys.argv[1])
srv = WorkerServer(RankState(RankIdentity(job="t"))).serve()
st = srv.state
st.step_started()
offset.write_text("-3600s\n")  # set back an hour in the middle of a step
time.sleep(0.2)
st.step_finished(1, committed=True)
st.set_phase("forward")
offset.write_text("+0s\n")  # and forward again in the middle of a phase
print(srv.url, flush=True)
sys.stdin.readline()  # the test has read the state and the metrics, and polled once
offset.write_text("+3600s\n")
print("finish read", srv.finish(wait_s=10), flush=True)
srv.stop()
'''


def test_a_rank_whose_wall_clock_steps_serves_true_durations(tmp_path):
    """Before, the step was -3600 s long, the phase 3600 s old (so the rules' "stuck in a
    collective" alert could fire), and a clock stepped forward made ``finish()`` think no
    monitor polled it (it ended at once; the monitor then counts the rank dead)."""
    require_binary("faketime")
    offset = tmp_path / "faketime-offset"
    env = stepping_env(tmp_path / "shim", offset)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT)])
    proc = subprocess.Popen([sys.executable, "-c", RANK, str(offset)], env={**os.environ, **env},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    try:
        url = first_line(proc, timeout=30)
        as_monitor = {"User-Agent": "lightkeeper-monitor"}
        state = requests.get(url + "/v1/state", headers=as_monitor, timeout=5).json()
        assert 0.15 <= state["last_step_seconds"] < 5, state["last_step_seconds"]
        metrics = requests.get(url + "/metrics", timeout=5).text
        phase = next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith("lightkeeper_phase_duration_seconds{"))
        assert 0 <= phase < 5, phase
        proc.stdin.write(b"\n")
        proc.stdin.flush()
        def finished() -> bool:
            try:
                return requests.get(url + "/v1/state", headers=as_monitor,
                                    timeout=5).json()["finished"]
            except requests.ConnectionError:  # waitress drops a connection open across the
                return False  # hour's step (its idle check is on the wall clock): ask again

        wait_until(finished, 10, what="the rank to say it finished")
        assert first_line(proc, timeout=30) == "finish read True"
        assert proc.wait(timeout=30) == 0
    finally:
        stop_process(proc, grace=2)
