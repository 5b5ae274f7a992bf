"""A static ``--targets`` rank that said it stopped (a planned stop: ``finished``, ``stopped_by``)
and stays down ended: the monitor keeps polling it (it may start again) but no longer lists it in
``--sd-out``, so Prometheus stops scraping it and ``LightkeeperRankDown`` (``up == 0`` for 1 m)
does not fire for the rest of the job; a rank that dies unsaid stays listed. Simulated ranks:
tests/support/monitor_sim.py."""

from __future__ import annotations

import json

import requests

from lightkeeper.processes import wait_until
from monitor.config import MonitorConfig
from monitor.service import Monitor
from tests.support.monitor_sim import SimRanks


def test_a_static_rank_that_said_it_stopped_leaves_the_file_sd(tmp_path):
    sim = SimRanks.start(3)
    sd = tmp_path / "targets.json"
    mon = Monitor(MonitorConfig(port=0, interval_s=0.1, state_path=str(tmp_path / "s.sqlite"),
                                targets=sim.urls, sd_out=str(sd), job="sim")).start()

    def listed() -> set[str]:
        return {"http://" + t for g in json.loads(sd.read_text()) for t in g["targets"]}

    def gauge(name: str) -> float | None:
        for line in requests.get(mon.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith(f'lightkeeper_monitor_{name}{{job="sim"}}'):
                return float(line.split()[-1])
        return None

    try:
        wait_until(lambda: sd.exists() and listed() == set(sim.urls), 10, what="3 listed")
        stopped, dead = sim.ranks[0], sim.ranks[1]
        stopped.update(finished=True, stopped_by="SIGTERM", phase="stopped")
        wait_until(lambda: any(r["url"] == stopped.url and r["phase"] == "stopped" for r in
                               requests.get(mon.url + "/v1/ranks", timeout=5).json()),
                   10, what="the stop seen")
        stopped.set_mode("down")
        dead.set_mode("down")
        wait_until(lambda: listed() == {dead.url, sim.ranks[2].url}, 10, what="the stop unlisted")
        # the gauges are published after the sweep that wrote the file: polled, not read once
        wait_until(lambda: (gauge("ranks_unreachable"), gauge("ranks_finished")) == (1, 1), 10,
                   what="1 unreachable, 1 finished")
        # a group whose ranks all said they stopped ended; one whose rank died is unreachable
        status = {r["url"]: g["status"] for g in requests.get(mon.url + "/v1/cluster", timeout=5)
                  .json()["groups"] for r in g["ranks"]}
        assert (status[stopped.url], status[dead.url]) == ("ended", "unreachable"), status
        stopped.update(finished=False, stopped_by=None, phase="training")
        stopped.set_mode("ok")  # started again: scraped again
        wait_until(lambda: listed() == set(sim.urls), 10, what="the restarted rank listed")
    finally:
        mon.stop()
        sim.stop()
