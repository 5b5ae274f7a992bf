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

import random

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


def shaped(groups: int, ranks: int, tweak, *, sweeps: int = 10, down=(), seed: int = 5,
           step_s: float = 0.25) -> list[tuple[int, list[int]]]:
    """Sweeps of a healthy noisy job whose newest three rows each sweep ``tweak(job, rank,
    row, k)`` reshapes (k: 1 the newest); the stragglers confirmed, (group, ranks)."""
    job = Job(groups=groups, ranks=ranks, seed=seed, step_s=step_s)
    job.down = set(down)
    det, now, found = Detectors(DetectorConfig()), T0, []
    job.steps(10, now=now, noise=0.03)
    sweep(det, job, now)
    for _ in range(sweeps):
        now += 1.0
        job.steps(3, now=now, noise=0.03)
        for r, s in enumerate(job.states):
            for k in (1, 2, 3):
                tweak(job, r, s["timing"]["recent"][-k], k)
            s["recent_step_seconds"] = [row["step_s"] for row in s["timing"]["recent"]]
        found += [(f.replica_group, f.ranks) for f in sweep(det, job, now)
                  if f.kind == "straggler"]
    return found


def untimed(job: Job, rank: int, clock: str | None = None) -> None:
    """``rank``'s quorum and all_reduce go untimed (its Manager's methods could not be wrapped)
    or, with ``clock``, its waits are timed on another kind of clock than its peers'."""
    t = job.states[rank]["timing"]
    if clock is None:
        t["untimed"] = ["start_quorum", "wait_quorum", "allreduce"]
    else:
        t["clock"] = clock


@pytest.mark.parametrize("groups,ranks,bad", [(3, 2, 2), (4, 2, 2), (5, 4, 5)])
@pytest.mark.parametrize("clock", [None, "device"])
def test_a_rank_whose_low_waits_are_not_comparable_is_not_one_its_peers_wait_for(
        groups, ranks, bad, clock):
    """Every rank waits EXTRA_S longer in the quorum (a slow Lighthouse: nobody is late), but
    rank ``bad`` serves its quorum wait as compute: it could not time it, or timed it on
    another clock. Its low wait says nothing of its peers waiting for it: no straggler; a real
    one in another group is still named, alone."""
    def slow_lighthouse(job, r, row, k):
        if r == bad:
            untimed(job, r, clock)
            row["compute_s"] += row["wait_cross_s"] + EXTRA_S
            row["wait_cross_s"] = 0.0
        else:
            row["wait_cross_s"] += EXTRA_S
        row["step_s"] += EXTRA_S

    assert shaped(groups, ranks, slow_lighthouse) == []
    slow = groups * ranks - 1  # the last group's last rank, slow before its quorum

    def and_a_straggler(job, r, row, k):
        if r == bad:
            untimed(job, r, clock)
            row["compute_s"] += row["wait_cross_s"] + EXTRA_S
            row["wait_cross_s"] = 0.0
        else:
            row["compute_s" if r == slow else "wait_cross_s"] += EXTRA_S
        row["step_s"] += EXTRA_S

    assert shaped(groups, ranks, and_a_straggler) == [(groups - 1, [slow])]


@pytest.mark.parametrize("big", [8, 16])
def test_hiccups_of_random_ranks_before_their_quorum_name_no_group(big):
    """Each rank stalls 0.15 s before its quorum in one step of ten (a data loader), the others
    waiting for it there: a group of ``big`` ranks beside four of one polled rank stalls in most
    steps, but no rank of it is slow: no straggler (no rank's median moves)."""
    rng = random.Random(1)
    live = set(range(big)) | {g * big for g in range(1, 5)}
    stalls: dict[tuple[int, int], dict[int, float]] = {}

    def hiccups(job, r, row, k):
        if r not in live:
            return
        key = (job.step, k)
        if key not in stalls:
            stalls[key] = {q: 0.15 if rng.random() < 0.1 else 0.0 for q in sorted(live)}
        stall = stalls[key]
        row["compute_s"] += stall[r]
        row["wait_cross_s"] += max(stall.values()) - stall[r]
        row["step_s"] += max(stall.values())

    assert shaped(5, big, hiccups, sweeps=20, down=set(range(5 * big)) - live, seed=1) == []
