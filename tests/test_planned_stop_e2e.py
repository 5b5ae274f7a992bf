"""A planned stop is not a dead group: a real job, a real Lighthouse and a real monitor.

Three replica groups of one ``lightkeeper train`` rank, each on its own host (``NODE_NAME``),
register with a ``lightkeeper monitor`` process (default host quarantine: one ``dead`` counts
against a host). At the same moment group 1 is stopped as a rolling restart stops it (SIGTERM)
and group 2 crashes (SIGKILL). Once the monitor has found group 2 dead and held it against its
host (so it had the time and the means to judge group 1 the same way), group 1 must have no
finding and its host no offence: its rank said it stopped on request before it went.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest
import requests

from lightkeeper.cluster import Host, LocalCluster, stop_process, wait_until

pytestmark = pytest.mark.e2e


def _start_monitor(d, lighthouse: str) -> tuple[subprocess.Popen, str]:
    log = d / "monitor.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "lightkeeper.cli", "monitor", "--lighthouse", lighthouse,
             "--port", "0", "--interval", "0.5", "--state", str(d / "monitor.sqlite"),
             "--min-replicas", "1", "--dead-sweeps", "2"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def url():
        if proc.poll() is not None:
            raise RuntimeError(f"monitor exited with {proc.returncode}: {log.read_text()[-3000:]}")
        m = re.search(r"monitor=(\S+)", log.read_text())
        return m.group(1) if m else None

    return proc, wait_until(url, 30, what="the monitor to listen")


def test_a_group_stopped_on_purpose_is_not_held_against_its_host(tmp_path):
    cluster = LocalCluster(tmp_path / "job", num_groups=3, steps=100_000, step_pause_s=0.1,
                           launcher="bare")
    monitor = None
    try:
        monitor, url = _start_monitor(tmp_path, cluster.start_lighthouse())
        cluster.extra_env["LIGHTKEEPER_MONITOR"] = url

        def get(path):
            return requests.get(url + path, timeout=5).json()

        for g, node in enumerate(("host-a", "host-b", "host-c")):
            cluster.start_group(g, host=Host(node))
        for g in range(3):
            cluster.wait_for_workers(g, timeout=120)
        wait_until(lambda: len({r["replica_group"] for r in get("/v1/ranks")
                                if (r.get("step") or 0) > 3}) == 3,
                   120, interval=0.5, what="every group stepping, as the monitor sees it")
        planned, crashed = cluster.groups[1].processes()[0], cluster.groups[2].processes()[0]
        planned.send_signal(signal.SIGTERM)
        crashed.send_signal(signal.SIGKILL)
        # the planned stop ends the rank by SIGTERM, as before (its state said first)
        assert planned.wait(timeout=20) == -signal.SIGTERM
        crashed.wait(timeout=20)

        wait_until(lambda: any(f["kind"] == "dead" and f["replica_group"] == 2
                               for f in get("/v1/findings")), 60, interval=0.5,
                   what="group 2 found dead")
        # group 1 stopped as long ago as group 2 crashed, and judged as many sweeps
        poll_after = get("/v1/cluster")["sweeps"] + 4
        wait_until(lambda: get("/v1/cluster")["sweeps"] >= poll_after, 30, interval=0.5,
                   what="4 more sweeps")
        findings = get("/v1/findings")
        assert {f["replica_group"] for f in findings} == {2}, findings

        def host_c_held():
            hosts = {h["host"]: h for h in get("/v1/hosts")["hosts"]}
            return "host-c" in hosts and any(o["kind"] == "dead"
                                              for o in hosts["host-c"]["offences"])
        # (with group 1 dead too, 2 of 3 groups gone would read as the job's end, not a host's)
        wait_until(host_c_held, 60, interval=0.5, what="the crash held against host-c")
        hosts = {h["host"] for h in get("/v1/hosts")["hosts"]}
        assert "host-b" not in hosts, hosts
        # a registered rank that ended is forgotten (Prometheus stops scraping it); the
        # crashed one is still polled, unreachable
        ranks = get("/v1/ranks")
        assert {r["replica_group"] for r in ranks} == {0, 2}, ranks
        url_1 = cluster.groups[1].worker_urls[0]
        assert f"forgot {url_1}: stopped by SIGTERM" in (tmp_path / "monitor.log").read_text()
    finally:
        if monitor is not None:
            stop_process(monitor)
        cluster.stop()
