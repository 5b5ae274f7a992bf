"""``lightkeeper run`` from one install, the job on another Python (docs/run.md: "``lightkeeper
run`` itself can come from any install"): its warning that torchft is missing where it runs
must not say the job is unobserved when the job's own Python serves its rank.

Faked: a ``lightkeeper run`` without torchft. A real one is a second install (tests/
test_install_core.py builds one, a wheel build and a venv); here torchft is hidden from the one
Python that runs ``lightkeeper run`` (``sys.modules['torchft'] = None``). The job is real: the
example under .venv's Python, a real Lighthouse, its WorkerServer answering.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import requests

from lightkeeper.processes import free_port, stop_process, wait_until

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torchft_two_groups.py"
RUN_WITHOUT_TORCHFT = ("import sys; sys.modules['torchft'] = None; "
                       "from lightkeeper.cli import main; sys.exit(main(sys.argv[1:]))")


def test_run_without_torchft_does_not_say_an_observed_job_is_unobserved(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("REPLICA_GROUP_ID", "LIGHTKEEPER_MONITOR", "LIGHTKEEPER_AUTOSTART",
                        "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}", REPLICA_GROUP_ID="0",
               PYTHONUNBUFFERED="1")
    lighthouse = subprocess.Popen(
        [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1",
         "--bind", f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    log = tmp_path / "job.log"
    with open(log, "wb") as out:
        job = subprocess.Popen([sys.executable, "-c", RUN_WITHOUT_TORCHFT, "run", "--",
                                sys.executable, str(EXAMPLE), "--steps", "100000"],
                               stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                               start_new_session=True)
    try:
        def served():
            m = re.search(r"worker_server=(http://\S+)", log.read_text(errors="replace"))
            if m is None and job.poll() is not None:
                raise AssertionError(log.read_text(errors="replace")[-3000:])
            return m and m.group(1)
        url = wait_until(served, 120, what="the job's WorkerServer line")
        assert requests.get(f"{url}/v1/state", timeout=5).json()["replica_group"] == 0
        (line,) = [ln for ln in log.read_text().splitlines() if ln.startswith("lightkeeper run:")]
        assert line.startswith(f"lightkeeper run: torchft is not installed in {sys.executable}")
        assert "a job on this Python is not observed" in line, line
        assert "its ranks are not observed" not in line, line
    finally:
        stop_process(job, grace=3)
        stop_process(lighthouse, grace=3)
