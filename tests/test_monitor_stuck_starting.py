"""A rank that never reaches its first quorum is reported as ``stuck_starting``, not evicted.

Real parts: a torchft Lighthouse the monitor verifies against, and a real trainer rank whose own
Lighthouse address is unreachable (torchft's Manager sits in its connect, for up to
``--connect-timeout``): its WorkerServer answers ``phase: starting``, ``quorum_id: -1``, no
replica id. Such a rank cannot be verified, so only the monitor's full view (not the evidence the
other detectors see) has it; the finding carries no replica id, so nothing could be evicted.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from lightkeeper.cluster import LocalCluster
from lightkeeper.processes import stop_process, wait_until
from monitor.config import DetectorConfig, MonitorConfig
from monitor.service import Monitor
from worker_server.state import node_name

pytestmark = pytest.mark.e2e


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_without_a_reachable_lighthouse_is_stuck_starting(tmp_path):
    cluster = LocalCluster(tmp_path / "cluster", num_groups=1)
    log = tmp_path / "rank.log"
    proc = None
    mon = None
    try:
        cluster.start_lighthouse()  # the monitor's; the rank is given another, dead address
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "lightkeeper.cli", "train", "--replica-group", "0",
                 "--num-replica-groups", "2", "--steps", "10", "--connect-timeout", "120",
                 "--lighthouse", f"http://127.0.0.1:{closed_port()}"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        url = wait_until(lambda: next((w.split("worker_server=")[1] for w in
                                       log.read_text().split() if "worker_server=" in w), None),
                         90, what="the rank's WorkerServer")
        mon = Monitor(MonitorConfig(port=0, interval_s=0.5, lighthouse=cluster.lighthouse_url,
                                    targets=[url], state_path=str(tmp_path / "m.sqlite"),
                                    detectors=DetectorConfig(starting_timeout_s=3)))
        mon.start(serve=False)
        f = wait_until(lambda: next((f for f in mon.store.findings()
                                     if f["kind"] == "stuck_starting"), None), 30,
                       what="the stuck_starting finding")
        assert (f["replica_group"], f["ranks"], f["replica_id"]) == (0, [0], None)
        rank = f["evidence"]["ranks"]["0"]
        assert rank["phase"] == "starting" and rank["verified"] is False
        assert rank["why"].startswith("no torchft Manager yet")
        assert f["evidence"]["culprit_hosts"] == [node_name()]
        assert f["confirmed_at"] - f["first_seen"] >= 3
        assert mon.store.decisions() == []  # reported only: nothing to decide
        assert proc.poll() is None  # still starting
    finally:
        if mon is not None:
            mon.stop()
        if proc is not None:
            stop_process(proc, grace=0)
        cluster.stop()
