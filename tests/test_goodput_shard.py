"""Sharded monitors (docs/scaling.md, "Beyond one machine"): each shard's goodput ledger expects
the replica groups of its own slice of ``--expected-groups`` (the job's count, as the shipped
manifests pass it to every shard), so a healthy slice loses no capacity to the groups that are
other shards'. The monitor is built, never started: no etcd, no HTTP, no loop."""

from __future__ import annotations

import pytest

from monitor.config import MonitorConfig, ShardConfig
from monitor.service import Monitor
from monitor.shard import shard_of
from tests.support.views import scratch_view
from tests.test_goodput import ModelJob


def _monitor(tmp_path, **kw) -> Monitor:
    return Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "m.sqlite"), job="sim",
                                 expected_groups=4, **kw))


def _run_slice(mon: Monitor, groups: list[int], seconds: int) -> dict:
    """``seconds`` healthy sweeps of ``groups`` through the monitor's goodput account; its
    ``GET /v1/goodput`` body."""
    job = ModelJob(0)
    job.groups = {g: {"rid": f"replica_group_{g}:a", "commits": 0, "in": True, "joined": 0.0,
                      "struck": {}, "phase": "forward", "reach": True} for g in groups}
    led = mon.goodput
    for _ in range(seconds):
        job.t += 1.0
        job.progress += 1.0 / 0.2
        for s in job.groups.values():
            s["commits"], s["joined"] = int(job.progress), job.progress
        led.account(scratch_view(job.t, ranks=job.ranks()), [], job.t)
    return led.to_json()


def test_a_shards_ledger_expects_only_its_slice_of_the_expected_groups(tmp_path):
    mine = [g for g in range(4) if shard_of(g, 2) == 0]
    assert 0 < len(mine) < 4  # the slice is part of the job
    mon = _monitor(tmp_path, shard=ShardConfig(shards=2, index=0, etcd="http://127.0.0.1:9"))
    try:
        out = _run_slice(mon, mine, 60)
    finally:
        mon.stop()
    assert out["expected_groups"] == len(mine)
    assert out["job"]["badput_seconds"]["capacity_lost"] == 0
    assert [g["replica_group"] for g in out["groups"]] == mine  # no slot for another shard's
    j = out["job"]
    assert {c for c, v in j["badput_seconds"].items() if v} == {"startup"}
    assert j["goodput_seconds"] + j["badput_seconds"]["startup"] == pytest.approx(
        len(mine) * 59, abs=0.01)


def test_an_unsharded_monitor_still_expects_every_group(tmp_path):
    mon = _monitor(tmp_path)
    try:
        out = _run_slice(mon, [0, 2], 60)
    finally:
        mon.stop()
    assert out["expected_groups"] == 4
    assert out["job"]["badput_seconds"]["capacity_lost"] == pytest.approx(
        2 * 59 - sum(g["badput_seconds"]["startup"] for g in out["groups"]
                     if g["replica_group"] is None), abs=0.01)
