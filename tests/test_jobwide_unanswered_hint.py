"""A rank the monitor knows only from its file_sd hint (a ``replica_group`` label, never
answered: no state) while the Lighthouse's quorum membership is unknown (no ``--lighthouse``):
the job-wide detector looks for joiners among every group, that rank's included, and must still
judge the job, here a stall of the two groups that answer (monitor/detect/jobwide.py). A single
in-process monitor over simulated ranks (tests/support/monitor_sim.py)."""

from __future__ import annotations

import json
import logging
import time

import requests

from lightkeeper.processes import free_port, wait_until
from monitor.config import DetectorConfig, MonitorConfig
from monitor.service import Monitor
from tests.support.monitor_sim import SimRanks


def test_a_hinted_rank_that_never_answered_leaves_the_job_stall_judged(tmp_path, caplog):
    sim = SimRanks.start(4, 2)  # groups 0 and 1, two ranks each, in quorum 1
    for r in sim.ranks:  # every rank blocked in the cross-group all_reduce, no step moving
        r.update(phase="allreduce", phase_since=time.time() - 5.0,
                 timing={"waiting": {"scope": "cross", "seconds": 5.0}})
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: group 2's rank, known by its label
    sd = [{"targets": [r.url.split("//")[1]], "labels": {"replica_group": str(g)}}
          for g in (0, 1) for r in sim.group(g)]
    (tmp_path / "ranks.json").write_text(json.dumps(
        sd + [{"targets": [dead], "labels": {"replica_group": "2"}}]))
    caplog.set_level(logging.ERROR, logger="monitor.detect")
    mon = Monitor(MonitorConfig(port=0, interval_s=0.2, job="sim",
                                detectors=DetectorConfig(hang_floor_s=1.0),
                                targets_file=str(tmp_path / "ranks.json"),
                                state_path=str(tmp_path / "s.sqlite"),
                                sd_out=str(tmp_path / "sd.json"))).start()
    try:
        def stalls() -> list[dict]:
            return [f for f in requests.get(mon.url + "/v1/findings?open=1", timeout=5).json()
                    if f["kind"] == "job_stall"]

        def cluster() -> dict:
            return requests.get(mon.url + "/v1/cluster", timeout=5).json()

        wait_until(lambda: {(g["replica_group"], g["status"]) for g in cluster()["groups"]}
                   == {(0, "up"), (1, "up"), (2, "unreachable")}, 10, what="group 2 hinted")
        wait_until(lambda: stalls(), 15, what="the job stall judged")
        n = mon.sweeps
        wait_until(lambda: mon.sweeps >= n + 2, 10, what="two sweeps more")
        assert cluster()["last_error"] is None, cluster()["last_error"]
        assert not [r for r in caplog.records if "failed" in r.getMessage()], caplog.text
    finally:
        mon.stop()
        sim.stop()
