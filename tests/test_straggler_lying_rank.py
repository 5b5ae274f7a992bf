"""One lying rank must not get healthy groups confirmed as stragglers: a verified rank of group 0
serving a cross-group wait of 5 s while its steps took ~0.1 s, or a self-consistent but false
5 s longer step. The cross-group all_reduce keeps a quorum's groups in lockstep, so the straggler
detector cuts each rank's cross wait to the ranks' median step less its own compute; a real
straggler (one group computing 0.6 s longer) is still found beside the liar.

Views are built as the service builds them (monitor/service.py): real /v1/state documents of
tests/test_monitor_detectors.py's synthetic job kept as the poller keeps them, a ViewBuilder
with every rank verified, its evidence view to the detectors; every rank polled, or after the
first sweep only the group leaders."""

from __future__ import annotations

import pytest

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from monitor.poll.poller import RankPoll
from tests.test_monitor_detectors import T0, Job, kept

LIAR = 0  # group 0's first rank: its leader, so polled under leader polling too
SLOW_S = 0.6


def steps(job: Job, n: int, now: float, lie: str | None, slow: int | None = None,
          slow_s: float = SLOW_S, noise: float = 0.03) -> None:
    """``n`` lockstep steps: group ``slow`` (if any) computes SLOW_S longer and every other
    rank waits that much longer at the cross-group all_reduce; the liar then rewrites its rows
    (``wait``: a 5 s wait in its real step; ``step``: a 5 s wait in a step 5 s longer)."""
    job.steps(n, now=now, noise=noise)
    for r, s in enumerate(job.states):
        for row in s["timing"]["recent"][-n:]:
            if slow is not None:
                key = "compute_s" if job.group_of(r) == slow else "wait_cross_s"
                row[key] += slow_s
                row["step_s"] += slow_s
            if r == LIAR and lie is not None:
                row["wait_cross_s"] = 5.0 + row["wait_cross_s"] * (lie == "step")
                row["step_s"] += 5.0 * (lie == "step")
        s["recent_step_seconds"] = [row["step_s"] for row in s["timing"]["recent"]]


def sweep(det: Detectors, job: Job, now: float, leaders: bool) -> list:
    polled = {t.url for r, t in enumerate(job.targets) if not leaders or r % job.ranks == 0}
    polls = {t.url: RankPoll(t.url, True, data=kept(s))
             for t, s in zip(job.targets, job.states, strict=True) if t.url in polled}
    full = job.vb.update(job.targets, polls, now=now, polled=polled,
                         judge=job.verified_by(job.lighthouse(job.targets), now))
    view = full.evidence()
    dumps = job.dumps() if det.fr_wanted(view, now) else None
    return det.update(view, dumps, now, full_view=full)


def run(ranks: int, lie: str | None, leaders: bool, slow: int | None = None, groups: int = 3,
        **kw) -> tuple[Detectors, list[int]]:
    """Twelve sweeps of three steps; the groups confirmed as stragglers, in order. ``kw``:
    Job's ``step_s``, steps()'s ``slow_s`` and ``noise``."""
    job = Job(groups=groups, ranks=ranks, seed=3, step_s=kw.pop("step_s", 0.25))
    det, now, found = Detectors(DetectorConfig()), T0, []
    steps(job, 8, now, lie, slow, **kw)
    for i in range(13):  # the first sweep asks every rank
        steps(job, 3, now, lie, slow, **kw)
        found += [f.replica_group for f in sweep(det, job, now, leaders and i > 0)
                  if f.kind == "straggler"]
        now += 1.0
    assert set(det.last_lags) == set(range(groups))  # every group judged at the last sweep
    return det, found


@pytest.mark.parametrize("leaders", [False, True], ids=["all_ranks", "leaders"])
@pytest.mark.parametrize("lie", ["wait", "step"])
@pytest.mark.parametrize("ranks", [2, 1], ids=["3x2", "3x1"])
def test_a_lying_rank_gets_no_group_confirmed_as_straggler(ranks, lie, leaders):
    det, found = run(ranks, lie, leaders)
    assert found == [] and det.open_findings() == []
    assert max(det.last_lags.values()) < det.lag_floor  # no group is waited for


@pytest.mark.parametrize("leaders", [False, True], ids=["all_ranks", "leaders"])
@pytest.mark.parametrize("lie", [None, "wait", "step"])
@pytest.mark.parametrize("ranks", [2, 1], ids=["3x2", "3x1"])
def test_a_real_straggler_is_still_found_beside_a_lying_rank(ranks, lie, leaders):
    det, found = run(ranks, lie, leaders, slow=2)
    assert found == [2]
    assert [(f.kind, f.replica_group) for f in det.open_findings()] == [("straggler", 2)]
    assert det.last_lags[2] == pytest.approx(SLOW_S, abs=0.05)
    assert det.last_lags[0] == det.last_lags[1] == 0.0


@pytest.mark.parametrize("lie", ["wait", "step"])
@pytest.mark.parametrize("groups,ranks,leaders", [(2, 1, False), (2, 2, False), (2, 2, True),
                                                  (3, 1, False), (3, 2, True)],
                         ids=["2x1", "2x2", "2x2_leaders", "3x1", "3x2_leaders"])
def test_a_lying_rank_does_not_move_the_floor_over_a_short_step_straggler(groups, ranks,
                                                                           leaders, lie):
    # steps of ~20 ms: the floor is the groups' own work a step (~5 ms), not the fixed 0.1 s;
    # the liar's own work counted from its served wait or step would be negative (the floor
    # back at 0.1 s) or seconds long (the floor at the straggler's own work), either way
    # hiding a group 15 ms late (the job ~2x slower)
    det, found = run(ranks, lie, leaders, slow=1, groups=groups, step_s=0.0167, slow_s=0.015,
                     noise=0.002)
    assert found == [1] and det.lag_floor < 0.015
    (f,) = det.open_findings()
    assert f.evidence["cross_wait_cut_ranks"] == [LIAR]  # the rank whose waits were not believed
