"""The host ledger in a live monitor (real HTTP, real loop, a real torchft Lighthouse; ranks
simulated by tests/support/monitor_sim.py, kills recorded by its front): a dead rank in a live
group quarantines its host through a real exec hook; a group that then runs on that host is
reported as ``quarantined_host`` and evicted; a manual release runs the hook again."""

from __future__ import annotations

import json
import stat

import pytest
import requests

from lightkeeper.processes import wait_until
from monitor.config import DetectorConfig, MonitorConfig, QuarantineConfig, RailsConfig
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob

pytestmark = pytest.mark.e2e

TOKEN = "s3cret"


def test_dead_rank_quarantines_its_host_and_a_group_back_on_it_is_evicted(tmp_path):
    events = tmp_path / "events.jsonl"
    hook = tmp_path / "hook.sh"
    hook.write_text(f"#!/bin/sh\ncat >> {events}\necho >> {events}\n")
    hook.chmod(hook.stat().st_mode | stat.S_IEXEC)
    job = SimJob(4, ranks_per_group=2)
    for r in job.sim.ranks:
        g = r.state["replica_group"]
        r.update(host=f"h{g}", node=f"node-{g}", device={"type": "cpu"})
    cfg = MonitorConfig(port=0, interval_s=0.2, state_path=str(tmp_path / "state.sqlite"),
                        targets=job.sim.urls, sd_out=str(tmp_path / "targets.json"), job="sim",
                        lighthouse=job.url, token=TOKEN,
                        rails=RailsConfig(min_replicas=1, cooldown_s=0),
                        detectors=DetectorConfig(dead_sweeps=2),
                        quarantine=QuarantineConfig(actions=(f"exec:{hook}",),
                                                    max_quarantined=1))
    mon = Monitor(cfg).start()

    def hooked() -> list[dict]:
        return [json.loads(line) for line in events.read_text().splitlines() if line.strip()] \
            if events.exists() else []

    try:
        wait_until(lambda: mon.sweeps >= 2, 10, what="two sweeps")
        bad = job.sim.group(1)[-1]
        bad.set_mode("down")  # one rank of live group 1 dies: dead_rank, culprit on h1
        wait_until(lambda: "h1" in mon.hosts.quarantined(), 20, what="h1 quarantined")
        wait_until(lambda: hooked(), 10, what="the exec hook's quarantine event")
        (ev,) = hooked()
        assert (ev["event"], ev["host"], ev["node"], ev["kind"]) == ("quarantine", "h1",
                                                                     "node-1", "dead_rank")
        assert ev["finding"]["replica_group"] == 1
        wait_until(lambda: job.replica_ids[1] in job.kills, 10, what="group 1 evicted")
        # group 2 now runs on the quarantined host (as a scheduler ignoring the taint would)
        for r in job.sim.group(2):
            r.update(host="h1", node="node-1")
        wait_until(lambda: job.replica_ids[2] in job.kills, 15,
                   what="group 2 evicted for quarantined_host")
        findings = requests.get(mon.url + "/v1/findings", timeout=5).json()
        qh = [f for f in findings if f["kind"] == "quarantined_host"]
        assert qh and qh[0]["replica_group"] == 2 and qh[0]["evidence"]["culprit_hosts"][0] == "h1"
        body = requests.get(mon.url + "/v1/hosts", timeout=5).json()
        assert body["quarantined"] == ["h1"]
        h1 = body["hosts"][0]
        assert h1["state"] == "quarantined" and h1["last_action"]["status"] == "done"
        assert h1["offences"][0]["kind"] == "dead_rank"
        assert "h1" in requests.get(mon.url + "/", timeout=5).text
        r = requests.post(mon.url + "/v1/hosts/h1/release", timeout=5,
                          headers={"Authorization": f"Bearer {TOKEN}"}, json={"reason": "fixed"})
        assert r.status_code == 200, r.text
        wait_until(lambda: len(hooked()) == 2, 10, what="the exec hook's release event")
        assert hooked()[1]["event"] == "release"
    finally:
        mon.stop()
        job.stop()
    # a restarted monitor keeps the ledger
    again = Monitor(cfg)
    try:
        assert again.hosts.hosts["h1"]["state"] == "released"
        assert [d["decision"] for d in again.store.host_decisions()
                if d["host"] == "h1"][:2] == ["release", "quarantine"]
    finally:
        again.stop()
