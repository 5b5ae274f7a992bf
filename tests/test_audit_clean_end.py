"""``lightkeeper run``'s hook at the end of a job with no Lightkeeper code: a clean exit says the
rank finished (so a monitor counts it ended, not dead), an exception or a non-zero exit does not.

Fresh interpreters with the real hook and a stand-in ``torchft.manager.Manager`` (no torch, to
keep it cheap: the hook only needs a Manager to be constructed); the test polls each rank's real
``/v1/state`` as the monitor's poller does (``User-Agent: lightkeeper-monitor``) until it is gone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request

from lightkeeper.processes import wait_until
from tests.support.hook import hooked_env

JOB = """
import sys, threading
from torchft.manager import Manager
from worker_server import autostart
Manager(replica_id="clean_end_0")
print(autostart.started_server().url, flush=True)
sys.stdin.readline()  # the test has read /v1/state: end as told
how = sys.argv[1]
if how == "raise":
    raise RuntimeError("the job's own error")
if how == "exit1":
    sys.exit(1)
if how == "thread":
    t = threading.Thread(target=lambda: 1 / 0)
    t.start()
    t.join()
if how == "exit0":
    sys.exit(0)
"""
ENDS = {"clean": 0, "exit0": 0, "raise": 1, "exit1": 1, "thread": 0}


def poll_until_gone(url: str, seen: list) -> None:
    """Read ``/v1/state`` every 50 ms as the monitor does, until the rank stops answering."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        req = urllib.request.Request(url + "/v1/state",
                                     headers={"User-Agent": "lightkeeper-monitor"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                seen.append(json.load(r)["finished"])
        except OSError:
            return
        time.sleep(0.05)


def test_a_clean_exit_says_finished_and_an_error_exit_does_not(tmp_path):
    env = hooked_env(tmp_path)
    procs = {how: subprocess.Popen([sys.executable, "-c", JOB, how], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=env, cwd=tmp_path) for how in ENDS}
    try:
        seen: dict[str, list] = {how: [] for how in ENDS}
        pollers = []
        for how, proc in procs.items():
            url = proc.stdout.readline().strip()
            assert url.startswith("http://127.0.0.1:"), (how, url, proc.stderr.read())
            pollers.append(threading.Thread(target=poll_until_gone, args=(url, seen[how])))
            pollers[-1].start()
        for how, proc in procs.items():
            wait_until(lambda reads=seen[how]: reads, 30, interval=0.01, what=f"{how}: a first read")
            proc.stdin.write("end\n")
            proc.stdin.flush()
        for how, proc in procs.items():
            _, err = proc.communicate(timeout=30)
            assert proc.returncode == ENDS[how], (how, err)
            assert "Traceback" not in err or how in ("raise", "thread"), (how, err)
            assert "[lightkeeper] training finished, but nothing read" not in err, (how, err)
        for t in pollers:
            t.join(30)
        assert seen["clean"][-1] is True and seen["exit0"][-1] is True, seen
        for how in ("raise", "exit1", "thread"):
            assert True not in seen[how], (how, seen[how])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
