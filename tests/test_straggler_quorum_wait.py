"""A slow rank's peers wait for it where torchft makes them, and its group is still found.

torchft's Manager asks the Lighthouse only once every rank of its group has called quorum, so a
rank slow *before* its quorum (data loading, a host stalled between steps) keeps its own group's
other ranks waiting inside the quorum, which the WorkerServer times as cross-group wait: the
slow group then shows one rank waiting as long as every rank of the healthy groups. A rank slow
*after* the quorum (forward/backward) keeps its peers in the commit vote instead (in-group), and
the healthy groups' ranks of its index at the all_reduce, the other index in their own vote. A
group slowed by its own in-group collectives waits in-group on every rank. Each shape names the
slow group (and the slow rank where there is one).

Views as tests/test_straggler_lying_rank.py builds them: the synthetic job's real /v1/state
documents, kept as the poller keeps them, through a ViewBuilder to the detectors."""

from __future__ import annotations

import pytest

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from tests.test_monitor_detectors import T0, Job, sweep

SLOW = 2  # the slow replica group
SLOW_RANK = 5  # its group rank 1
EXTRA_S = 0.3  # the slow rank's (or group's) extra seconds a step


def steps(job: Job, n: int, now: float, shape: str | None) -> None:
    """``n`` lockstep steps of the healthy noisy job, then the slow part's ``shape``:
    ``quorum``: rank SLOW_RANK computes EXTRA_S longer before its quorum, so its group peer
    and every rank of the other groups wait that much in the quorum (cross); ``allreduce``: it
    computes longer after the quorum, so its peer waits in the commit vote (group), the other
    groups' rank 1 at the all_reduce (cross) and their rank 0 in their own commit vote (group);
    ``in_group``: group SLOW's own collectives take EXTRA_S longer on both its ranks (group),
    and the other groups wait for it at the all_reduce (cross)."""
    job.steps(n, now=now, noise=0.03)
    if shape is None:
        return
    for r, s in enumerate(job.states):
        g, gr = job.group_of(r), r % job.ranks
        if shape == "quorum":
            key = "compute_s" if r == SLOW_RANK else "wait_cross_s"
        elif shape == "allreduce":
            key = ("compute_s" if r == SLOW_RANK else "wait_group_s" if g == SLOW or gr == 0
                   else "wait_cross_s")
        else:
            key = "wait_group_s" if g == SLOW else "wait_cross_s"
        for row in s["timing"]["recent"][-n:]:
            row[key] += EXTRA_S
            row["step_s"] += EXTRA_S
        s["recent_step_seconds"] = [row["step_s"] for row in s["timing"]["recent"]]


def run(shape: str | None, ranks: int = 2) -> tuple[Detectors, list]:
    job = Job(groups=3, ranks=ranks, seed=5)
    det, now, found = Detectors(DetectorConfig()), T0, []
    steps(job, 10, now, None)
    assert sweep(det, job, now) == []
    for _ in range(8):
        now += 1.0
        steps(job, 3, now, shape)
        found += [f for f in sweep(det, job, now) if f.kind == "straggler"]
    return det, found


@pytest.mark.parametrize("shape,ranks", [("quorum", [SLOW_RANK]), ("allreduce", [SLOW_RANK]),
                                         ("in_group", [4, 5])])
def test_a_slow_rank_names_its_group_wherever_its_peers_wait(shape, ranks):
    det, found = run(shape)
    assert [(f.replica_group, f.ranks) for f in found] == [(SLOW, ranks)]
    assert det.last_lags[SLOW] == pytest.approx(EXTRA_S, abs=0.06)
    assert det.last_lags[0] == det.last_lags[1] == 0.0


def test_a_slow_group_of_one_rank_is_found_and_a_healthy_job_has_none():
    job = Job(groups=3, ranks=1, seed=5)
    det, now, found = Detectors(DetectorConfig()), T0, []
    for i in range(12):
        now += 1.0
        job.steps(3, now=now, noise=0.03, late_group={SLOW: EXTRA_S} if i >= 4 else None)
        found += [(i, f.replica_group, f.ranks) for f in sweep(det, job, now)]
    assert [x[1:] for x in found] == [(SLOW, [SLOW])] and found[0][0] >= 4
    det, found = run(None)
    assert found == [] and det.open_findings() == []
