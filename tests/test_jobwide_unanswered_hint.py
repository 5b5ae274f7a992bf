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


def test_a_joiner_whose_process_died_does_not_hold_the_job_stall(tmp_path):
    """Group 2 was joining (a cross wait under an older quorum id), then its process died: its
    last answer is kept after the failed poll, and read as a joiner's it held the others'
    job_stall for ever."""
    sim = SimRanks.start(3, 3)  # groups 0, 1, 2 of one rank each
    for r in sim.ranks[:2]:  # groups 0 and 1 in quorum 1, blocked in the cross all_reduce
        r.update(phase="allreduce", phase_since=time.time() - 5.0,
                 timing={"waiting": {"scope": "cross", "seconds": 5.0}})
    sim.ranks[2].update(quorum_id=0, phase="allreduce", phase_since=time.time() - 5.0,
                        timing={"waiting": {"scope": "cross", "seconds": 5.0}})
    mon = Monitor(MonitorConfig(port=0, interval_s=0.2, job="sim",
                                detectors=DetectorConfig(hang_floor_s=1.0),
                                targets=sim.urls, state_path=str(tmp_path / "s.sqlite"))).start()
    try:
        n = mon.sweeps
        wait_until(lambda: mon.sweeps >= n + 3, 10, what="sweeps with group 2 joining")
        sim.ranks[2].set_mode("down")

        def stalls():
            return [f for f in requests.get(mon.url + "/v1/findings?open=1", timeout=5).json()
                    if f["kind"] == "job_stall"]

        wait_until(stalls, 20, what="the job stall judged")
    finally:
        mon.stop()
        sim.stop()
