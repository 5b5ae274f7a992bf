"""Semi-synchronous training (torchft's LocalSGD and DiLoCo) as the monitor and a rank see it.

Each replica group trains alone for ``sync_every`` inner steps; the groups meet only at a sync: a
quorum (``start_quorum``), then the all_reduce of parameters or pseudo-gradients, then
``should_commit``. So a torchft step is a sync. The views are built as the service builds them
(tests/test_monitor_detectors.py's Job: /v1/state documents through ViewBuilder, gloo dumps); the
rank side is a WorkerServer attached to a stand-in Manager called as LocalSGD calls it (torch is
not needed to call four methods in order). Measured on real LocalSGD and DiLoCo jobs (3 groups of
1 rank, gloo, a real Lighthouse): docs/monitor.md, Semi-synchronous training.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from tests.test_monitor_detectors import T0, Job, sweep
from worker_server import WorkerServer
from worker_server.state import RankIdentity, RankState

SYNC_S = 10.0  # seconds between syncs: sync_every inner steps


def hung_between_syncs(phase: str) -> tuple[Detectors, Job, float]:
    """Three groups of one rank, 20 syncs done; then group 1 stops in its inner steps and the
    others wait for the next quorum (LocalSGD: inside ``allreduce``, whose ``wait_quorum`` comes
    first; DiLoCo's synchronous quorum: in ``start_quorum``, phase ``quorum``)."""
    job = Job(groups=3, ranks=1, step_s=SYNC_S)
    det = Detectors(DetectorConfig())
    job.steps(20, now=T0)
    assert sweep(det, job, T0) == []
    return det, job, det.hang.threshold(job.view(T0))


@pytest.mark.parametrize("phase", ["allreduce", "quorum"])
def test_a_group_hung_between_syncs_is_a_hang_once_the_others_waited_the_threshold(phase):
    """The Flight Recorder holds nothing here: the others' all_reduce waits for a quorum that
    the hung group never asks for, so the engine finds no collective it never entered. Before,
    nothing was found and the Lighthouse dropped the group at its join timeout, hung for good."""
    det, job, threshold = hung_between_syncs(phase)
    assert threshold > 2 * det.cfg.hang_floor_s  # scales with the step: the sync's period
    found = []
    for t in (1.0, threshold / 2, threshold - 0.5, threshold + 0.5, threshold + 1.5):
        for r in (0, 2):
            job.wait(r, "cross", t, phase=phase)
        found.append(sweep(det, job, T0 + 1 + t))
    assert found[:3] == [[], [], []]  # late by less than the threshold: a healthy sync's jitter
    [f] = found[3]
    assert (f.kind, f.replica_group, f.ranks) == ("hang", 1, [1])
    assert f.evidence["level"] == "quorum" and f.evidence["waiting_ranks"] == [0, 2]
    assert f.evidence["summary"].startswith("rank(s) [1] never asked for the quorum of step 21")
    assert found[4] == [] and [x.kind for x in det.open_findings()] == ["hang"]
    # torchft drops the group at the Lighthouse's join timeout: the others commit again
    job.steps(1, now=T0 + threshold + 3)
    assert sweep(det, job, T0 + threshold + 3) == []
    assert [(x.kind, x.resolution) for x in det.resolved_findings()] == [("hang", "progress")]


def test_every_group_waiting_for_the_quorum_is_still_no_hang():
    det, job, threshold = hung_between_syncs("allreduce")
    for t in (threshold + 1, threshold + 2):
        for r in range(3):
            job.wait(r, "cross", t, phase="quorum")
        assert sweep(det, job, T0 + 1 + t) == []


class StandInManager:
    """torchft's Manager as LocalSGD calls it once a sync."""

    def __init__(self) -> None:
        self._quorum_id, self._step = 1, 0

    def start_quorum(self):
        pass

    def wait_quorum(self):
        pass

    def allreduce(self, tensor):
        return SimpleNamespace(wait=lambda: tensor)

    def should_commit(self):
        self._step += 1
        return True

    def current_step(self):
        return self._step

    def num_participants(self):
        return 3

    def is_participating(self):
        return True


def test_a_step_is_a_sync_and_its_time_runs_commit_to_commit():
    """``last_step_seconds`` and ``recent_step_seconds`` (the hang threshold's median) measured
    the sync alone, from ``start_quorum`` to ``should_commit`` (milliseconds), while
    ``timing.step_s`` ran commit to commit: a healthy job's threshold was the 3 s floor whatever
    its sync period. Now both run commit to commit."""
    manager, state = StandInManager(), RankState(RankIdentity())
    WorkerServer(state).attach(manager)
    inner_s = 0.03  # the inner steps' compute between syncs (sync_every x an inner step)
    for _ in range(3):
        manager.start_quorum()
        manager.allreduce(1).wait()
        manager.should_commit()
        time.sleep(inner_s)
    snap = state.snapshot()
    assert snap["step"] == 3 and snap["phase"] == "optimizer"
    steps, rows = snap["recent_step_seconds"], snap["timing"]["recent"]
    assert len(steps) == 3 and min(steps[1:]) >= inner_s, steps
    for own, row in zip(steps, rows, strict=True):
        assert own == pytest.approx(row["step_s"], abs=2e-3)


def test_a_job_whose_steps_take_seconds_leaves_goodput_startup(monkeypatch):
    """The goodput baseline needs 3 steps in its pace window, 3 s until a baseline exists: a job
    whose steps (LocalSGD's syncs) took over about a second stayed in ``startup`` for good,
    goodput 0. The window now stretches to 3 steps until then."""
    from monitor.goodput import GoodputLedger
    from tests import test_goodput

    monkeypatch.setattr(test_goodput, "STEP", 2.0)  # a sync every 2 s (the real job's)
    job, led = test_goodput.ModelJob(3, 1), GoodputLedger()
    job.run(led, 60)
    out = led.to_json()
    assert out["baseline"]["step_seconds"] == pytest.approx(2.0, rel=0.2)
    j = out["job"]
    assert {c for c, v in j["badput_seconds"].items() if v} == {"startup"}
    assert j["badput_seconds"]["startup"] < 3 * 25 and j["goodput_seconds"] > 3 * 30, j


def test_a_step_that_did_not_commit_is_one_row_with_its_retry():
    """torchft runs a step whose ``should_commit`` said False again under the same number. Its
    attempt and the retry are one ``timing.recent`` row: before, each wrote a row for that
    step, and a monitor that had read the first (``?since=N``) never saw the retry."""
    manager, state = StandInManager(), RankState(RankIdentity())
    votes = iter([True, False, True, True])

    def should_commit():
        ok = next(votes)
        manager._step += ok
        return ok

    manager.should_commit = should_commit
    WorkerServer(state).attach(manager)
    for _ in range(4):
        manager.start_quorum()
        manager.allreduce(1).wait()
        manager.should_commit()
        time.sleep(0.01)
    snap = state.snapshot()
    rows = snap["timing"]["recent"]
    assert [r["step"] for r in rows] == [0, 1, 2], rows
    assert rows[1]["step_s"] >= 0.02 - 1e-3, rows  # both attempts of step 1
    assert (snap["commits"], snap["commit_failures"]) == (3, 1), snap
