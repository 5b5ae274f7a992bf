"""A torchft whose Manager the hook does not know, under ``lightkeeper run``.

The "newer torchft" is a fake package written into a temp dir and put first on the job's
PYTHONPATH: no released torchft has an API the hook does not know, so it cannot be a real one.
docs/install.md promises one ``cannot instrument ...`` line naming the version, the rank still
served, and the job's own calls and exit status untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

FAKE_INIT = '__version__ = "9.0.0"\n'
FAKE_MANAGER = '''
class Manager:
    def __init__(self, replica_id=None, lighthouse_addr=None):
        self._replica_id = replica_id

    def step_all(self):  # a new API: none of start_quorum/wait_quorum/allreduce/should_commit
        return 41
'''
JOB = '''
import json, sys, urllib.request
from torchft.manager import Manager
from worker_server.autostart import started_server

m = Manager(replica_id="job_2")
total = sum(m.step_all() for _ in range(3))
with urllib.request.urlopen(started_server().url + "/v1/state", timeout=30) as r:
    state = json.load(r)
print(json.dumps({"total": total, "torchft_version": state["torchft_version"],
                  "replica_group": state["replica_group"]}))
sys.exit(7)  # the job's own status must come back unchanged
'''


def test_a_torchft_the_hook_does_not_know_is_one_line_and_the_job_goes_on(tmp_path):
    pkg = tmp_path / "site" / "torchft"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_INIT)
    (pkg / "manager.py").write_text(FAKE_MANAGER)
    (tmp_path / "job.py").write_text(JOB)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LIGHTKEEPER_", "REPLICA_GROUP_ID", "TORCHFT_"))}
    env["PYTHONPATH"] = str(tmp_path / "site")
    lightkeeper = Path(sys.executable).parent / "lightkeeper"
    proc = subprocess.run([str(lightkeeper), "run", "--", sys.executable, str(tmp_path / "job.py")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 7, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"total": 123, "torchft_version": "9.0.0", "replica_group": 2}
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("[lightkeeper]")]
    cannot = [ln for ln in lines if "cannot instrument" in ln]
    assert len(cannot) == 1, lines
    assert "torchft 9.0.0; supported: 0.2.x and nightly" in cannot[0]
    assert "training goes on" in cannot[0]
    for name in ("start_quorum", "wait_quorum", "allreduce", "should_commit"):
        assert name in cannot[0]
    assert "Traceback" not in proc.stderr
