"""Evicting a group out of the Lighthouse's quorum (``stuck_starting``'s left-out shape): torchft's
kill looks the replica up only in its last quorum's participants and answers 500 "failed to find
replica", killing nothing (monitor/act/actions.py, monitor/act/enforcer.py).

Real parts: a torchft Lighthouse (``SimJob``, tests/support/monitor_sim.py) the monitor sends the
kill to directly, not through the sim's front, so the answer is torchft's own; simulated ranks,
whose ``POST /v1/exit`` is a fake that records what it was told.
"""

from __future__ import annotations

import logging
import time

import pytest

from monitor.act.actions import NOT_IN_QUORUM
from monitor.api.app import create_app
from monitor.cli import warn_about_tokens
from monitor.config import BundleConfig, MonitorConfig, RailsConfig
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob

TOKEN = "s3cret"
EXIT_TOKEN = "exit-tok"


@pytest.fixture
def job():
    """Groups 0 and 1 in the newest quorum; group 2, left out of it, still heartbeats (its
    ranks report the quorum before, as a group hung past the others' timeout does)."""
    j = SimJob(3, ranks_per_group=2, join_timeout_ms=300)
    try:
        j.alive.discard(2)
        j.requorum()
        client = j._client()
        j.sim.probe_token = EXIT_TOKEN
        for r in j.sim.group(2):
            r.exits = []
        # its hung process heartbeats on (the sim's loop beats only for the groups in quorum)
        client.heartbeat(j.replica_ids[2], timeout=j._timedelta(seconds=5))
        yield j
    finally:
        j.stop()


def evict_group_2(tmp_path, job: SimJob, caplog, **kw) -> dict:
    """A monitor on the real Lighthouse evicts group 2 by hand, then sweeps: its audit row."""
    mon = Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "state.sqlite"),
                                targets=job.sim.urls, job="sim", lighthouse=job.lighthouse_url,
                                token=TOKEN, rails=RailsConfig(min_replicas=1, cooldown_s=0),
                                bundles=BundleConfig(enabled=False), **kw), clock=time.time)
    try:
        client = create_app(mon).test_client()
        mon.sweep_once()
        r = client.post("/v1/evict", json={"replica_group": 2, "reason": "left out"},
                        headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.get_json()["sent"] is True, r.get_data(as_text=True)
        assert r.get_json()["detail"].startswith(NOT_IN_QUORUM)
        with caplog.at_level(logging.INFO):
            mon.sweep_once()
        (row,) = client.get("/v1/evictions").get_json()
        return row
    finally:
        mon.stop()


def test_a_kill_that_cannot_reach_a_group_out_of_the_quorum_tells_every_rank_to_exit(
        tmp_path, job, caplog):
    """With --rank-exit-token every rank, group rank 0 included, is told at once (no grace:
    no kill is under way)."""
    row = evict_group_2(tmp_path, job, caplog, rank_exit_token=EXIT_TOKEN, orphan_grace_s=30.0)
    assert [r.exits for r in job.sim.group(2)] == [
        [{"reason": f"replica {job.replica_ids[2]} was evicted by the monitor"}]] * 2
    assert [r.exits for g in (0, 1) for r in job.sim.group(g)] == [None] * 4
    assert row["status"] == "sent" and row["http_status"] == 500
    assert f"kill: {NOT_IN_QUORUM} (HTTP 500: Something went wrong: failed to find replica)" \
        in row["detail"]
    assert "told every rank of the group, which the Lighthouse's kill cannot reach out of its " \
           "quorum, to exit (POST /v1/exit)" in row["detail"]
    assert all(r.url in row["detail"] for r in job.sim.group(2))
    assert "reaches only group rank 0" not in row["detail"]


def test_without_the_exit_token_only_its_operator_can_end_the_group(tmp_path, job, caplog):
    row = evict_group_2(tmp_path, job, caplog)
    assert [r.exits for r in job.sim.group(2)] == [[], []]
    rank0, rank1 = job.sim.group(2)
    assert ("the Lighthouse's kill cannot reach a group out of its quorum and no "
            "--rank-exit-token is set: nothing but its operator can end it; stop rank(s) "
            "rank ") in row["detail"]
    assert f"rank 2 (group rank 0, host sim, pid 1002, {rank0.url})" in row["detail"]
    assert f"rank 5 (group rank 1, host sim, pid 1005, {rank1.url})" in row["detail"]
    assert "reaches only group rank 0" not in row["detail"]
    assert "left the Lighthouse's quorum" not in caplog.text  # it was never in it
    # said in the log too, once, not only in the audit row
    said = [m for m in caplog.messages if "nothing but its operator can end it" in m]
    assert len(said) == 1 and said[0].startswith(f"eviction of {job.replica_ids[2]}: "), said


def test_evicting_stuck_starting_without_the_exit_token_is_warned_at_start_up(caplog):
    with caplog.at_level(logging.WARNING):
        warn_about_tokens(MonitorConfig(rails=RailsConfig(evict_kinds=("hang",))))
        warn_about_tokens(MonitorConfig(rails=RailsConfig(evict_kinds=("stuck_starting",)),
                                        rank_exit_token=EXIT_TOKEN))
        assert caplog.messages == []
        warn_about_tokens(MonitorConfig(rails=RailsConfig(evict_kinds=("stuck_starting",))))
    assert caplog.messages == [
        "--evict-on stuck_starting without --rank-exit-token: the Lighthouse's kill cannot reach "
        "a group out of its quorum, so such an eviction ends nothing (docs/monitor.md)"]
