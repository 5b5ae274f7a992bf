"""A monitor that cannot reach a group does not call it ``dead`` while it may be the one cut off
(it reaches no group), nor while the Lighthouse still hears the group's replica id: only the
monitor misses it (docs/monitor.md, "it may be the one cut off").

A real Monitor (real HTTP, SQLite, sweep loop) against a real torchft Lighthouse that simulated
groups join and heartbeat to (``SimJob``, tests/support/monitor_sim.py). A rank made ``silent``
reads every request and answers none: to the monitor its host is out of reach.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import requests

from lightkeeper.processes import wait_until
from monitor.config import DetectorConfig, MonitorConfig, RailsConfig
from monitor.detect.liveness import _refused
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob

DEAD_SWEEPS = 2


@pytest.fixture
def job():
    j = SimJob(3, ranks_per_group=2, heartbeat_timeout_ms=1000)
    yield j
    j.stop()


@pytest.fixture
def mon(tmp_path, job):
    cfg = MonitorConfig(port=0, interval_s=0.2, poll_timeout_s=0.3, job="sim",
                        state_path=str(tmp_path / "state.sqlite"), lighthouse=job.url,
                        sd_out=str(tmp_path / "targets.json"), targets=job.sim.urls,
                        rails=RailsConfig(min_replicas=1, cooldown_s=0),
                        detectors=DetectorConfig(dead_sweeps=DEAD_SWEEPS))
    m = Monitor(cfg).start()
    yield m
    m.stop()


def get(mon: Monitor, path: str):
    return requests.get(mon.url + path, timeout=5).json()


def dead_groups(mon: Monitor) -> list[int]:
    return sorted(f["replica_group"] for f in get(mon, "/v1/findings") if f["kind"] == "dead")


def reachable(mon: Monitor) -> int:
    return sum(r["reachable"] for r in get(mon, "/v1/ranks"))


def sweeps_out_of_reach(mon: Monitor, ranks: int, n: int) -> None:
    """Wait until ``ranks`` ranks are out of reach, then ``n`` sweeps more."""
    wait_until(lambda: reachable(mon) == 6 - ranks, 15, what=f"{ranks} rank(s) out of reach")
    start = mon.sweeps
    wait_until(lambda: mon.sweeps >= start + n, 30, what=f"{n} sweeps")


def verified(mon: Monitor) -> None:
    wait_until(lambda: sum((r["verification"] or {}).get("state") == "verified"
                           for r in get(mon, "/v1/ranks")) == 6, 15, what="6 verified ranks")


@pytest.mark.parametrize("lighthouse_too", [False, True])
def test_a_monitor_cut_off_from_every_rank_confirms_no_group_dead(job, mon, caplog,
                                                                  lighthouse_too):
    """Only the monitor loses the ranks (the Lighthouse hears every group: training goes on),
    or the monitor and the Lighthouse together (on one network, cut off from the hosts):
    no group is confirmed ``dead``, none opens a goodput incident, and the log says why once.
    Back in reach, the groups train on with nothing found."""
    caplog.set_level(logging.INFO, logger="monitor.detect.liveness")
    verified(mon)
    if lighthouse_too:
        job.alive.clear()  # their heartbeats no longer reach the Lighthouse either
    for r in job.sim.ranks:
        r.set_mode("silent")
    sweeps_out_of_reach(mon, 6, 3 * DEAD_SWEEPS + 4)
    assert dead_groups(mon) == []
    assert get(mon, "/v1/goodput")["incidents"] == []
    said = [m for m in caplog.messages if m.startswith("not confirming dead")]
    assert len(said) == 1 and "cut off" in said[0], said
    for r in job.sim.ranks:
        r.set_mode("ok")
    job.alive.update(range(3))
    wait_until(lambda: reachable(mon) == 6, 15, what="every rank back in reach")
    start = mon.sweeps
    wait_until(lambda: mon.sweeps >= start + 2, 15, what="2 sweeps")
    assert dead_groups(mon) == []


def test_a_group_the_lighthouse_still_hears_is_not_dead_until_it_stops(job, mon, caplog):
    """The monitor reaches groups 0 and 1 but not group 2, whose Manager still heartbeats to
    the Lighthouse: group 2 is not ``dead``. Once its heartbeats stop too, it is."""
    caplog.set_level(logging.INFO, logger="monitor.detect.liveness")
    verified(mon)
    for r in job.sim.group(2):
        r.set_mode("silent")
    sweeps_out_of_reach(mon, 2, 3 * DEAD_SWEEPS + 4)
    assert dead_groups(mon) == []
    said = [m for m in caplog.messages if m.startswith("not confirming dead")]
    assert len(said) == 1 and job.replica_ids[2] in said[0], said
    job.alive.discard(2)  # now it is gone for the Lighthouse too
    wait_until(lambda: dead_groups(mon) == [2], 15, what="group 2 dead")


def test_a_lighthouse_hearing_a_hung_group_beside_it_proves_no_other_group_dead(job, mon):
    """The monitor and the Lighthouse sit on group 0's side of a cut: group 0's ranks hang (their
    WorkerServers silent) while its Manager heartbeats on; groups 1 and 2, healthy, are on the
    far side (neither hears them). Both observers may be the ones cut off: no group is dead."""
    verified(mon)
    for r in job.sim.group(0):
        r.set_mode("silent")
    job.go_dark(1)
    job.go_dark(2)
    sweeps_out_of_reach(mon, 6, 3 * DEAD_SWEEPS + 4)
    assert dead_groups(mon) == []


@pytest.mark.parametrize("error, refused", [
    ("ConnectionRefusedError: [Errno 111] Connect call failed ('127.0.0.1', 8000)", True),
    # a host name with IPv6 and IPv4 addresses (asyncio, Python 3.11): every one refused
    ("OSError: Multiple exceptions: [Errno 111] Connect call failed ('::1', 8000, 0, 0), "
     "[Errno 111] Connect call failed ('127.0.0.1', 8000)", True),
    ("OSError: Multiple exceptions: [Errno 101] Connect call failed ('::1', 8000, 0, 0), "
     "[Errno 111] Connect call failed ('127.0.0.1', 8000)", False),
    ("OSError: [Errno 113] Connect call failed ('127.0.0.1', 8000)", False),
])
def test_a_host_that_refused_on_every_address_refused(error, refused):
    rank = SimpleNamespace(reason="connection", error=error)
    assert _refused(rank) is refused
