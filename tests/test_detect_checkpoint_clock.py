"""A group's checkpoint save is aged on the monitor's clock, from when the monitor first saw it
(docs/monitor.md, hang and stuck_starting): the rank's ``phase_since`` is its own wall clock, which
may be off from the monitor's by any amount; a new ``phase_since`` is a new save."""

from __future__ import annotations

import logging
import random

import pytest

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from monitor.evidence.view import ViewBuilder
from monitor.poll.poller import RankPoll
from tests.support.views import job_ranks
from tests.test_monitor_detectors import T0, Job, sweep
from tests.test_monitor_stuck_starting import TIMEOUT
from tests.test_monitor_stuck_starting import sweep as left_out_sweep


def saving_group_0(phase_since: float, timeout_s: float, until: float = 12.0) -> list:
    """A 3 x 2 job (3 s hang threshold) whose group 0 writes a checkpoint from T0 + 1 on (as the
    monitor sees it) while groups 1 and 2 wait for it in the cross-group all_reduce; group 0's
    ranks say the save began at ``phase_since`` by their own clock. The findings up to ``until``."""
    job = Job()
    det = Detectors(DetectorConfig(hang_floor_s=3.0, hang_factor=3.0,
                                   checkpoint_timeout_s=timeout_s))
    job.steps(20, now=T0)
    sweep(det, job, T0)
    job.fr.ft_collective("all_reduce", [[1000]], absent=[0, 1])
    found, t = [], 1.0
    while t <= until:
        for r in (2, 3, 4, 5):
            job.wait(r, "cross", t - 0.2, phase="allreduce")
        for r in (0, 1):
            job.wait(r, None)
            job.states[r].update(phase="checkpoint", phase_since=phase_since)
        found += sweep(det, job, T0 + t)
        t += 1.0
    return found


def test_a_save_just_begun_on_a_host_an_hour_behind_is_held(caplog):
    caplog.set_level(logging.WARNING)
    found = saving_group_0(phase_since=T0 - 3600, timeout_s=1800.0)
    assert found == []
    held = [r.getMessage() for r in caplog.records if "hang held" in r.getMessage()]
    assert len(held) == 1 and "write a checkpoint (" in held[0], held


def test_a_save_past_the_timeout_on_the_monitors_clock_is_judged_though_the_host_is_ahead():
    found = saving_group_0(phase_since=T0 + 3600, timeout_s=5.0)
    assert [(f.kind, f.replica_group, f.ranks) for f in found] == [("hang", 0, [0, 1])]
    # first seen at T0 + 1: held while younger than the timeout by the monitor's clock
    assert found[0].confirmed_at == pytest.approx(T0 + 6.0)


def test_a_second_save_holds_a_hang_afresh_and_is_said_again(caplog):
    """Group 0 saves from T0 + 1, then saves again from T0 + 6 (5 s timeout) while groups 1 and
    2 wait for it in the cross-group all_reduce: judged 5 s after the second save was seen."""
    caplog.set_level(logging.WARNING, logger="monitor.detect.hang")
    job = Job()
    det = Detectors(DetectorConfig(hang_floor_s=3.0, hang_factor=3.0, checkpoint_timeout_s=5.0))
    job.steps(20, now=T0)
    sweep(det, job, T0)
    job.fr.ft_collective("all_reduce", [[1000]], absent=[0, 1])
    found = []
    for t in range(1, 14):
        for r in (2, 3, 4, 5):
            job.wait(r, "cross", t - 0.2, phase="allreduce")
        for r in (0, 1):
            job.wait(r, None)
            # by the ranks' own clock, an hour behind the monitor's
            job.states[r].update(phase="checkpoint", phase_since=T0 - 3600 + (1 if t < 6 else 6))
        found += sweep(det, job, T0 + t)
    assert [(f.kind, f.replica_group, f.ranks) for f in found] == [("hang", 0, [0, 1])]
    assert found[0].confirmed_at == pytest.approx(T0 + 11.0)
    held = [r.getMessage() for r in caplog.records if "hang held" in r.getMessage()]
    assert len(held) == 2 and all("write a checkpoint (" in m for m in held), held


def test_a_second_save_holds_a_left_out_group_afresh():
    """Group 1, out of the quorums, saves from T0, then again from T0 + 20 (40 s timeout): held
    until T0 + 60, not T0 + 40."""
    job = Job(groups=3, ranks=2)
    det = Detectors(DetectorConfig(starting_timeout_s=TIMEOUT, checkpoint_timeout_s=40.0))
    for t in range(0, 60, 5):
        since = T0 - 3600 + (0 if t < 20 else 20)
        assert left_out_sweep(det, job, t, phase="checkpoint", phase_since=since) == [], t
    found = left_out_sweep(det, job, 60, phase="checkpoint", phase_since=T0 - 3580)
    assert [(f.kind, f.replica_group, f.ranks) for f in found] == [("stuck_starting", 1, [2, 3])]


def test_a_groups_held_ranks_over_incremental_views_equal_them_read_afresh():
    """Leader polling over an incremental view (a moved group's next GroupView reads only its
    moved ranks' phases): each group's ranks in a held phase are those a fresh read of its ranks
    finds, as ranks enter and leave saves, go dark, come back and change shape."""
    rng = random.Random(5)
    groups, size = 4, 3
    targets, states = job_ranks(groups, size, T0)
    vb, now, down, seen_held = ViewBuilder(), T0, set(), 0
    for sweep_no in range(200):
        now += 1.0
        for s in states:
            s["step"] += rng.choice([0, 1])
            if rng.random() < 0.2:
                s.update(phase=rng.choice(["forward", "checkpoint", "busy", "allreduce"]),
                         phase_since=now)
        if rng.random() < 0.1:
            down = {rng.randrange(len(states))} if not down else set()
        if rng.random() < 0.05:  # a new shape: the group is grouped afresh
            states[rng.randrange(len(states))]["num_participants"] = rng.choice([groups, 3])
        polled = {t.url for r, t in enumerate(targets)
                  if rng.random() < (0.9 if r % size == 0 else 0.3)}
        polls = {t.url: RankPoll(t.url, True, data=dict(states[r])) if r not in down
                 else RankPoll(t.url, False, reason="connection", error="refused")
                 for r, t in enumerate(targets) if t.url in polled}
        view = vb.update(targets, polls, now=now, polled=polled)
        for g, gv in view.groups.items():
            fresh = {r.url: r for r in gv.ranks
                     if r.state and r.state["phase"] in ("checkpoint", "busy")}
            assert gv.held == fresh, (sweep_no, g)
            seen_held += len(fresh)
    assert seen_held > 100
