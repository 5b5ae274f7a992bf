"""A monitor restarted from its saved ledger (snapshot -> restore, through JSON as the store keeps
it) accounts as if it had not restarted: a healthy job's goodput, an incident a restart held.
The model job of tests/test_goodput.py."""

from __future__ import annotations

import json
from functools import cache

import pytest

from monitor.goodput import GoodputLedger
from tests.test_goodput import ModelJob, check_invariant
from tests.test_goodput_blame import held_mismatch


def restarted(led: GoodputLedger, drop: tuple[str, ...] = ()) -> GoodputLedger:
    """``led`` resumed from all it stored; ``drop``: fields an older monitor's snapshot lacks
    ("groups.x": of its groups)."""
    state = json.loads(json.dumps(led.snapshot()))
    for name in drop:
        where, _, key = name.rpartition(".")
        (state[where] if where else state).pop(key)
    incidents = json.loads(json.dumps([i.to_store() for i in led.incidents.values()]))
    intervals = json.loads(json.dumps([dict(vars(iv)) for iv in led.intervals]))
    return GoodputLedger.restore(led.cfg, state, incidents, intervals)


@cache
def healthy_sweeps(restarts: frozenset[int], drop: tuple[str, ...] = ()) -> dict:
    """2 groups at 0.97x pace, swept every 0.13 s (shorter than a 0.2 s step)."""
    job, led = ModelJob(2), GoodputLedger()
    for n in range(220):
        if n in restarts:
            led = restarted(led, drop)
        job.sweep(led, dt=0.13, pace=0.97)
    return led.to_json()["job"]


def test_a_restart_costs_a_healthy_job_no_goodput():
    alone = healthy_sweeps(frozenset())
    assert alone["pending_seconds"] == 0 and alone["badput_seconds"]["unattributed"] == 0
    for restarts in ({150}, set(range(130, 220, 18))):
        j = healthy_sweeps(frozenset(restarts))
        assert j["goodput_seconds"] == pytest.approx(alone["goodput_seconds"], abs=1e-6)
        assert j["badput_seconds"] == alone["badput_seconds"] and j["pending_seconds"] == 0


def test_an_older_snapshot_without_the_pace_window_still_resumes():
    alone = healthy_sweeps(frozenset())
    j = healthy_sweeps(frozenset({150}), drop=("groups.window", "groups.carry", "held", "quorum_top"))
    assert j["expected_seconds"] == alone["expected_seconds"]
    # its groups' pace starts again from the newest sample: a few steps of each unsure
    assert j["goodput_seconds"] >= alone["goodput_seconds"] - 2 * 3 * 0.2


@pytest.mark.parametrize("drop", [(), ("held",)])
def test_an_incident_a_restart_held_resolves_a_horizon_after_it_whatever_restarts_follow(drop):
    """Held by a restart (its finding closed as ``monitor_restarted``), never confirmed again,
    then the monitor restarts again and again, each time before the horizon (10 s) is over.
    An older snapshot (no ``held``) holds it anew once."""
    job, led, _ = held_mismatch(horizon_s=10.0)
    first = job.t
    job.run(led, 1)  # the restarted monitor's first sweep holds it
    led = restarted(led, drop)
    second = job.t
    for _ in range(6):
        job.run(led, 5)
        assert led.to_json()["incidents"][0]["resolved_at"] is None or job.t > first + 10
        led = restarted(led)
        check_invariant(led)
    [inc] = led.to_json()["incidents"]
    assert inc["resolved_at"] is not None and not inc["open"]
    start = second if drop else first
    assert start + 10 <= inc["resolved_at"] <= start + 11
