"""LocalCluster.stop(): every group is asked to stop (SIGTERM) before any is waited for, so a
SIGTERMed rank's wait for a monitor's read (worker_server's stopped()) is not added up group
after group; what does not exit within the grace, and anything left of a group's process tree,
is killed by PID. The "ranks" are small Python scripts, planted as the groups' processes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from lightkeeper.cluster import LocalCluster, ReplicaGroupProcess
from lightkeeper.processes import signal_same, stamped, wait_until

# A rank that, SIGTERMed, waits until every rank of the job was asked to stop, then exits 0;
# asked alone it is still waiting when the grace ends (and is killed). Its child ignores SIGTERM
# in a session of its own, as torchrun's workers run. argv: its name, the folder, all names.
RANK = r"""
import os, signal, subprocess, sys, time
name, d, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
child = subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "time.sleep(60)"], start_new_session=True)
asked = []
signal.signal(signal.SIGTERM, lambda *_: asked.append(1))
open(os.path.join(d, "child." + name), "w").write(str(child.pid))
open(os.path.join(d, "ready." + name), "w").close()
deadline = time.monotonic() + 60
while not asked and time.monotonic() < deadline:
    time.sleep(0.02)
open(os.path.join(d, "term." + name), "w").close()
while time.monotonic() < deadline:
    if all(os.path.exists(os.path.join(d, "term." + n)) for n in names):
        sys.exit(0)
    time.sleep(0.02)
sys.exit(3)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # dead, not reaped yet
    except FileNotFoundError:
        return True


def test_stop_asks_every_group_before_waiting_and_leaves_no_process(tmp_path: Path):
    names = ["g0r0", "g0r1", "g1r0"]
    procs = {n: subprocess.Popen([sys.executable, "-c", RANK, n, str(tmp_path), ",".join(names)],
                                 start_new_session=True) for n in names}
    cluster, left = LocalCluster(tmp_path / "job"), []
    try:
        # group 0 as launcher="bare" runs it (a process per rank), group 1 a single process
        cluster.groups = {
            0: ReplicaGroupProcess("replica_group_0", procs["g0r0"], tmp_path / "g0.log",
                                   rank_procs={0: procs["g0r0"], 1: procs["g0r1"]}),
            1: ReplicaGroupProcess("replica_group_1", procs["g1r0"], tmp_path / "g1.log",
                                   replica_group=1)}
        wait_until(lambda: all((tmp_path / f"ready.{n}").exists() for n in names), 60,
                   what="the ranks' SIGTERM handlers")
        children = [int((tmp_path / f"child.{n}").read_text()) for n in names]
        left = stamped(children)
        cluster.stop()
        # each exited on its own once all were asked; asked one group after another, the first
        # group's ranks were still waiting for the second's when their grace ended (-SIGKILL)
        assert {n: p.returncode for n, p in procs.items()} == dict.fromkeys(names, 0)
        wait_until(lambda: all(_gone(c) for c in children), 10,
                   what="the ranks' children, SIGKILLed, gone")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
        signal_same(left, signal.SIGKILL)  # where the code under test left them
