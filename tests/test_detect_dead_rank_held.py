"""``dead_rank`` is confirmed only on evidence that its group waits for the rank: a live rank of
the group blocked in a collective or the commit vote, or the group's step unchanged for
``--hang-factor`` median steps since the rank went down. A rank the monitor merely cannot reach
for ``--dead-sweeps`` polls (a network blip, a starved WorkerServer) while its group steps slowly
is no finding: its group trains on.

3 replica groups x 2 ranks stepping every 4 sweeps (its ranks' step times say ~1.3 s), one sweep
a second.
"""

from __future__ import annotations

import pytest

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from tests.test_monitor_detectors import T0, Job, sweep


def commits(job: Job) -> None:
    """Every rank's ``commits`` at its step, as a WorkerServer counts them."""
    for s in job.states:
        s["commits"] = s["step"]


def slow_job(cfg: DetectorConfig | None = None) -> tuple[Job, Detectors, float]:
    job = Job(groups=3, ranks=2, step_s=4.0)
    det = Detectors(cfg or DetectorConfig())  # --dead-sweeps 3, --hang-factor 3
    now = T0
    for i in range(12):
        now += 1.0
        if i % 4 == 0:
            job.steps(1, now=now)
        assert sweep(det, job, now) == []
    return job, det, now


def kinds(found) -> list[tuple]:
    return [(f.kind, f.replica_group, f.ranks) for f in found]


def test_a_rank_unreachable_for_three_sweeps_between_slow_steps_is_no_dead_rank():
    """Rank 1 misses 3 polls while rank 0 computes (``forward``, no wait), then answers and its
    group commits: nothing was found, nothing is open or resolved."""
    job, det, now = slow_job()
    job.down = {1}
    for _ in range(3):
        now += 1.0
        assert sweep(det, job, now) == []
    job.down = set()
    now += 1.0
    job.steps(1, now=now)
    assert sweep(det, job, now) == []
    assert det.open_findings() == [] and det.resolved_findings() == []


@pytest.mark.parametrize("scope,phase", [("group", "commit"), ("group", "backward"),
                                         ("cross", "allreduce")])
def test_a_rank_whose_peer_blocks_waiting_for_it_is_dead_rank(scope, phase):
    """Rank 1 died: rank 0 blocks in the commit vote, an in-group collective or the cross-group
    all_reduce (each a wait longer than a median step), and the rank is ``dead_rank`` at
    ``--dead-sweeps``, the wait in its evidence."""
    job, det, now = slow_job()
    job.down = {1}
    found = []
    for i in range(3):
        now += 1.0
        job.wait(0, scope, 1.5 + i, phase=phase)
        found.append(sweep(det, job, now))
    assert found[:2] == [[], []]
    [f] = found[2]
    assert kinds([f]) == [("dead_rank", 0, [1])]
    assert f.first_seen == now - 2.0
    assert f.evidence["held"]["blocked"] == {"0": {"scope": scope, "seconds": 3.5,
                                                   "phase": phase}}


def test_a_momentary_wait_of_the_peer_is_not_held():
    """Rank 0 caught a few milliseconds into a collective, as any poll of a training rank can
    be: no evidence that its group waits for the unreachable rank."""
    job, det, now = slow_job()
    job.down = {1}
    for _ in range(3):
        now += 1.0
        job.wait(0, "group", 0.05, phase="commit")
        assert sweep(det, job, now) == []
    assert det.open_findings() == []


def test_a_group_that_stops_stepping_holds_the_rank_without_a_wait_shown():
    """No wait shown (none served), but the group commits nothing for 3 x its median step
    (~1.3 s) after rank 1 went down: ``dead_rank`` then, not before; it stays open while the
    rank is down and resolves when it answers."""
    job, det, now = slow_job()
    job.down = {1}
    went_down = now + 1.0
    found = []
    while not found and now - went_down < 10:
        now += 1.0
        found = sweep(det, job, now)
    [f] = found
    assert kinds([f]) == [("dead_rank", 0, [1])]
    held = f.evidence["held"]
    assert held["stalled_s"] == now - went_down >= held["threshold_s"] > now - went_down - 1
    assert held["threshold_s"] == pytest.approx(3 * held["median_step_s"], abs=1e-3)
    assert 3.0 < held["threshold_s"] < 5.0
    now += 1.0
    assert sweep(det, job, now) == [] and kinds(det.open_findings()) == [("dead_rank", 0, [1])]
    job.down = set()
    now += 1.0
    sweep(det, job, now)
    assert det.open_findings() == []
    assert [(f.kind, f.resolution) for f in det.resolved_findings()] == [("dead_rank", "reachable")]


def test_a_group_committing_again_restarts_the_stall():
    """The group commits one step while rank 1 is unreachable (torchft commits only with every
    rank, so it lived then): the stall is counted from that commit."""
    job, det, now = slow_job()
    job.down = {1}
    went_down = now + 1.0
    found = []
    for i in range(6):
        now += 1.0
        if i == 2:
            job.steps(1, now=now)
            stepped = now
        found += sweep(det, job, now)
    assert found == []  # 3 s since the commit: under the ~3.9 s threshold
    while not found:
        now += 1.0
        found = sweep(det, job, now)
    assert kinds(found) == [("dead_rank", 0, [1])] and found[0].first_seen == went_down
    assert found[0].evidence["held"]["stalled_s"] == now - stepped


@pytest.mark.parametrize("timeout,wait", [(1800.0, False), (6.0, False), (1800.0, True)])
def test_a_group_saving_holds_no_stall_within_the_checkpoint_timeout(timeout, wait):
    """Group 0 says phase ``checkpoint`` (a save: it commits nothing while it lasts) and rank 1
    cannot be reached (its WorkerServer starved by the save): no ``dead_rank`` within
    --checkpoint-timeout; past it the stall counts from then. Rank 0 blocked in a collective
    for a median step and more still shows the group waits for rank 1."""
    job, det, now = slow_job(DetectorConfig(checkpoint_timeout_s=timeout))
    for s in job.states[:2]:
        s["phase"], s["phase_since"] = "checkpoint", now
    job.down = {1}
    found, saved = [], now + 1.0
    while not found and now - saved < 15:
        now += 1.0
        if wait:
            job.wait(0, "group", 1.5 + now - saved)
        found = sweep(det, job, now)
    if timeout > 15 and not wait:
        assert found == [] and det.open_findings() == []
        return
    [f] = found
    assert kinds([f]) == [("dead_rank", 0, [1])]
    if wait:
        assert now - saved == 2.0 and list(f.evidence["held"]["blocked"]) == ["0"]
    else:  # seen held until the timeout; stalled for --hang-factor median steps from then
        held = f.evidence["held"]
        assert held["stalled_s"] >= held["threshold_s"]
        assert now - held["stalled_s"] >= saved + timeout


def test_a_rank_that_lived_is_no_dead_rank_on_a_slow_step_between_commits():
    """Rank 1 cannot be reached while its group commits past it (it lived); every other sweep
    the group is between commits and rank 0 is caught in an in-group collective for longer
    than a median step (a slow step). The group trains throughout: no ``dead_rank`` (a rank
    that lived and was re-judged at each sweep without a commit was confirmed, resolved and
    confirmed again, an eviction and a host offence each time). Left so: one that lived and
    dies later is not found until it answers again (docs/monitor.md)."""
    job, det, now = slow_job()

    commits(job)
    job.down = {1}
    for _ in range(5):
        now += 1.0
        job.steps(1, now=now)
        commits(job)
        assert sweep(det, job, now) == []
    for i in range(8):
        now += 1.0
        if i % 2:
            job.steps(1, now=now)
            commits(job)
        else:
            job.wait(0, "group", 1.5, phase="backward")
        assert sweep(det, job, now) == []
    assert det.resolved_findings() == []


def fast_job() -> tuple[Job, Detectors, float]:
    """3 groups x 2 ranks committing one step a sweep; rank 1 then cannot be reached for ten
    sweeps while group 0 commits on: it lived."""
    job, det, now = Job(groups=3, ranks=2, step_s=1.0), Detectors(DetectorConfig()), T0
    for i in range(22):
        now += 1.0
        job.steps(1, now=now)
        for s in job.states:
            s["commits"] = s["step"]
        if i == 12:
            job.down = {1}
        assert sweep(det, job, now) == []
    return job, det, now


@pytest.mark.parametrize("scope,phase", [("group", "backward"), ("cross", "allreduce")])
def test_a_rank_its_group_commits_past_every_sweep_stays_lived(scope, phase):
    """Group 0 commits a step every sweep past unreachable rank 1 while rank 0 is caught in a
    collective for a median step and more each sweep: rank 1 lives, so no ``dead_rank`` ever
    opens (none confirmed, resolved and reopened as the commits move)."""
    job, det, now = fast_job()
    for _ in range(10):
        now += 1.0
        job.steps(1, now=now)
        for s in job.states:
            s["commits"] = s["step"]
        job.wait(0, scope, 1.5, phase=phase)
        assert sweep(det, job, now) == []
    assert det.open_findings() == [] and det.resolved_findings() == []


def test_a_lived_rank_is_not_dead_rank_for_another_groups_crash():
    """Rank 1 lived unreachable; then rank 5 (group 2) crashes and the whole job stalls: ranks 0
    and 2 block in the cross all_reduce waiting for group 2, rank 4 in its commit vote. Only
    rank 5 is ``dead_rank``: a cross wait or a stall does not show group 0 waits for rank 1."""
    job, det, now = fast_job()
    job.down = {1, 5}
    found = []
    for i in range(15):
        now += 1.0
        for r in (0, 2):
            job.wait(r, "cross", 1.0 + i, phase="allreduce")
        job.wait(4, "group", 1.0 + i, phase="commit")
        found += sweep(det, job, now)
    assert kinds(found) == [("dead_rank", 2, [5])]
    assert kinds(det.open_findings()) == [("dead_rank", 2, [5])]

