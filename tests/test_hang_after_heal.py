"""A group restarted (on a spare) into a running job heals in its first step: that step's commit
gives its ranks a step time (``last_step_seconds``, commit to commit, the heal included), but the
new process's warm-up goes on past it (its first optimizer step, the next forward) while the
others wait for the next quorum. Until it has finished a step after the heal it is held like a
first step, until --starting-timeout (docs/monitor.md, hang); one step later it is timed and a
hang is named at the usual threshold."""

from __future__ import annotations

import pytest

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from tests.test_hang_first_step import waited_for
from tests.test_monitor_detectors import T0, Job, sweep


def healed_group_0(commits: int, heals: int = 1, failures: int = 0) -> tuple[Job, Detectors]:
    """A 3 x 2 job of 0.2 s steps (the demo's hang floor, 1 s) whose group 0 is a new
    incarnation that healed from a peer and has committed ``commits`` steps since (the first
    being the heal's, 1.5 s)."""
    job = Job(groups=3, ranks=2, step_s=0.2)
    det = Detectors(DetectorConfig(hang_floor_s=1.0))
    job.steps(20, now=T0)
    for r in job.members(0):
        times = [1.5] + [0.2] * (commits - 1)
        job.states[r].update(
            replica_id="replica_group_0:spare", pid=job.states[r]["pid"] + 100,
            started_at=T0 - 10, heals=heals, commits=commits, commit_failures=failures,
            last_step_seconds=times[-1], recent_step_seconds=times,
            timing={"recent": [], "waiting": None, "last_step": None, "window": None})
    sweep(det, job, T0)
    return job, det


def unasked_group_0(job: Job, det: Detectors, at: list[float]) -> list:
    """Group 0 in its optimizer step (in no wait); the others wait for the next quorum."""
    return waited_for(job, det, at, 0, "optimizer", "quorum")


@pytest.mark.parametrize("commits, heals, failures",
                         [(1, 1, 0), (1, 2, 1), (1, 3, 2), (0, 3, 3), (1, 4, 3)])
def test_a_group_that_only_healed_is_held_as_on_its_first_step(commits, heals, failures):
    """(1, 2, 1): its heal's commit failed and it healed again (its warm-up is still ahead), or
    its next commit failed and it healed again: the counters cannot tell, so it is held; so is
    a warm-up whose heals failed more than once (another group dying each time)."""
    job, det = healed_group_0(commits, heals, failures)
    assert unasked_group_0(job, det, [0.5, 1.0, 1.5, 2.0, 3.0, 10.0, 299.0]) == []
    assert det.last_error is None  # judged, not failed
    found = unasked_group_0(job, det, [301.0])
    assert [(f.kind, f.replica_group, f.ranks) for _, f in found] == [("hang", 0, [0, 1])]
    assert found[0][1].evidence["threshold_s"] == pytest.approx(300.0)


@pytest.mark.parametrize("commits, heals, failures", [(2, 1, 0), (50, 50, 0), (10, 50, 40)])
def test_a_group_that_trained_a_step_after_its_heal_is_named_at_the_hang_threshold(
        commits, heals, failures):
    """(50, 50, 0): a group late to every quorum, healing back in each step; (10, 50, 40): one
    whose commit fails after each heal: past its warm-up either way, not held for ever."""
    job, det = healed_group_0(commits, heals, failures)
    found = unasked_group_0(job, det, [0.5, 1.0, 1.5, 2.0])
    assert [(t, f.kind, f.replica_group, f.ranks) for t, f in found] == [
        (1.0, "hang", 0, [0, 1])]
    ev = found[0][1].evidence
    assert (ev["level"], ev["threshold_s"]) == ("quorum", pytest.approx(1.0))
