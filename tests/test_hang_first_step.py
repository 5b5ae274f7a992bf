"""A group still on its first step (torch.compile: minutes) while the others, done with theirs,
wait for it in the cross-group all_reduce is not hung until --starting-timeout (docs/monitor.md,
hang): no rank of it has timed a step, so the hang threshold of a median step time means
nothing yet."""

from __future__ import annotations

import pytest

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from tests.test_monitor_detectors import T0, Job, sweep


def first_step_job(in_dumps: bool) -> tuple[Job, Detectors]:
    """A 3 x 2 job at step 0 of its first quorum, no step timed by any rank; ``in_dumps``: the
    Flight Recorder holds the all_reduce groups 0 and 2 entered and group 1 never did."""
    job = Job(groups=3, ranks=2, step_s=1.0)
    for s in job.states:
        s["recent_step_seconds"], s["last_step_seconds"] = [], None
    if in_dumps:
        job.fr.ft_collective("all_reduce", [[1000]], absent=[2, 3])
    return job, Detectors(DetectorConfig())


def waited_for(job: Job, det: Detectors, at: list[float], group: int, phase: str,
               others: str) -> list:
    """``group`` in ``phase`` (in no wait), the others wait across groups in ``others`` from T0
    on: the (time, finding)s of a sweep at each of ``at``."""
    found = []
    for t in at:
        for r in range(job.world):
            if job.group_of(r) == group:
                job.wait(r, None, phase=phase)
            else:
                job.wait(r, "cross", t, phase=others)
        found += [(t, f) for f in sweep(det, job, T0 + t)]
    return found


def compiling_group_1(job: Job, det: Detectors, at: list[float]) -> list:
    """Group 1 compiles (in no wait), the others wait in the all_reduce."""
    return waited_for(job, det, at, 1, "forward", "allreduce")


@pytest.mark.parametrize("in_dumps", [False, True], ids=["quorum", "cross_group"])
def test_a_group_compiling_its_first_step_is_waited_for_until_the_starting_timeout(in_dumps):
    job, det = first_step_job(in_dumps)
    assert compiling_group_1(job, det, [float(t) for t in range(1, 11)] + [299.0]) == []
    assert det.last_error is None  # judged, not failed
    found = compiling_group_1(job, det, [301.0])
    assert [(t, f.kind, f.replica_group, f.ranks) for t, f in found] == [
        (301.0, "hang", 1, [2, 3])]
    ev = found[0][1].evidence
    assert ev["level"] == ("cross_group" if in_dumps else "quorum")
    assert ev["threshold_s"] == pytest.approx(300.0)


def test_the_first_step_hold_is_said_once(caplog):
    job, det = first_step_job(in_dumps=False)
    with caplog.at_level("WARNING", logger="monitor.detect.hang"):
        compiling_group_1(job, det, [float(t) for t in range(1, 8)])
    held = [r.getMessage() for r in caplog.records if "hang held" in r.getMessage()]
    assert len(held) == 1 and "have timed no step since the monitor first saw them" in held[0], held


def test_a_group_restarted_into_a_running_job_is_held_while_it_compiles():
    """A restarted group compiles its first step too while the others, who know their step
    time, wait for it: evicted at the usual threshold, its replacement would compile again and
    be evicted again (a restart loop). Held like the job's start."""
    job = Job(groups=3, ranks=2, step_s=1.0)
    det = Detectors(DetectorConfig())
    for r in range(job.world):  # group 1's new incarnation: no step of its own timed yet
        if job.group_of(r) == 1:
            job.states[r]["recent_step_seconds"], job.states[r]["last_step_seconds"] = [], None
    assert compiling_group_1(job, det, [float(t) for t in range(1, 31)]) == []
    found = compiling_group_1(job, det, [301.0])
    assert [(f.kind, f.replica_group) for _, f in found] == [("hang", 1)]
