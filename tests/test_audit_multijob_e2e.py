"""Two real torchft jobs side by side as docs/monitor.md (Several jobs on the same machines) and
docs/dashboards.md (Setting it up) describe them: each its own Lighthouse, gloo rank and
monitor, one file_sd folder and one Prometheus (Debian's) scraping both monitors and the
folder with the shipped rules. One group of one rank a job: enough to tell the jobs apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import requests

from dashboards.build import PROMETHEUS_DIR
from dashboards.promconfig import prometheus_config
from lightkeeper.cluster import (
    SAFE_PATH,
    LocalCluster,
    start_monitor_process,
    stop_process,
    wait_until,
)
from tests.conftest import require_binary
from tests.support import prometheus

pytestmark = pytest.mark.e2e

JOBS = ("alpha", "beta")


def _monitor(tmp_path, job, lighthouse, sd_out):
    return [sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0", "--job", job,
            "--lighthouse", lighthouse, "--state", str(tmp_path / job / "m.sqlite"),
            "--sd-out", str(sd_out), "--interval", "0.5"]


def test_two_jobs_stay_apart_in_their_monitors_and_in_prometheus(tmp_path):
    require_binary("prometheus")
    file_sd = tmp_path / "file_sd"
    clusters: dict[str, LocalCluster] = {}
    monitors: dict[str, tuple[subprocess.Popen, str]] = {}
    prom = None
    try:
        for job in JOBS:
            c = clusters[job] = LocalCluster(tmp_path / job / "cluster", num_groups=1,
                                             steps=100_000, job=job, step_pause_s=0.2)
            c.start_lighthouse()
            monitors[job] = start_monitor_process(
                _monitor(tmp_path, job, c.lighthouse_url, file_sd / f"{job}.json"),
                tmp_path / f"{job}.out", tmp_path / f"{job}.log")
            c.extra_env["LIGHTKEEPER_MONITOR"] = monitors[job][1]
            c.start_group(0)
        ranks = {job: clusters[job].wait_for_workers(0, timeout=120)[0] for job in JOBS}
        prom = prometheus.start(prometheus_config(
            file_sd_files=[str(file_sd / "*.json")],
            monitor_targets=[url.split("://", 1)[1] for _, url in monitors.values()],
            rule_files=[str(PROMETHEUS_DIR / "rules.yml")], scrape_interval="1s"),
            tmp_path / "prometheus")

        def by_job(expr):
            return {r["metric"].get("job"): float(r["value"][1]) for r in prom.query(expr)}

        want = {"alpha": 1.0, "beta": 1.0}
        wait_until(lambda: by_job("count by (job) (lightkeeper_step)") == want, 60,
                   what="both jobs' ranks scraped, each under its own job label")
        wait_until(lambda: by_job("lightkeeper_monitor_ranks_verified") == want, 60,
                   what="each monitor verifying its own job's one rank")
        assert by_job("count by (job) (lightkeeper_monitor_sweeps_total)") == want

        # alpha's rank pointed at beta's monitor: refused, counted, never a target there
        beta_url = monitors["beta"][1]
        r = requests.post(beta_url + "/v1/targets", timeout=5,
                          json={"url": ranks["alpha"], "job": "alpha", "replica_group": 0,
                                "rank": 0})
        assert r.status_code == 409, r.text
        assert 'outcome="other_job"' in requests.get(beta_url + "/metrics", timeout=5).text
        assert [t["url"] for t in requests.get(beta_url + "/v1/targets", timeout=5).json()] \
            == [ranks["beta"]]

        # beta's monitor given alpha's --sd-out by mistake: refused; alpha's file stays whole
        before = (file_sd / "alpha.json").read_text()
        third = subprocess.run(
            _monitor(tmp_path / "third", "beta", clusters["beta"].lighthouse_url,
                     file_sd / "alpha.json"), capture_output=True, text=True, timeout=60,
            env={**os.environ, **SAFE_PATH})
        assert third.returncode == 2 and "--sd-out" in third.stderr, third.stderr
        assert (file_sd / "alpha.json").read_text() == before
        assert [g["labels"]["job"] for g in json.loads(before)] == ["alpha"]

        # beta's monitor gone: the missing-monitor alert's expression names beta, not alpha
        stop_process(monitors.pop("beta")[0], grace=5)
        missing = next(a["query"] for g in prom.api("rules")["groups"] for a in g["rules"]
                       if a["name"] == "LightkeeperMonitorMissing")
        wait_until(lambda: by_job(missing) == {"beta": 1.0}, 30,
                   what="LightkeeperMonitorMissing's expression to name job beta")
    finally:
        if prom is not None:
            prom.stop()
        for proc, _ in monitors.values():
            stop_process(proc, grace=5)
        for c in clusters.values():
            c.stop()
