"""Detectors on synthetic views and Flight Recorder dumps: what counts as a finding, what not."""

from __future__ import annotations

import random

import pytest

from monitor.analysis import RankTrace, analyze
from monitor.config import DetectorConfig
from monitor.detectors import Detectors
from monitor.discovery import Target
from monitor.poller import RankPoll
from monitor.view import ViewBuilder
from tests.support.frgen import FRJob
from tests.support.monitor_sim import rank_state

T0 = 1_795_000_000.0


class Job:
    """Three single-rank replica groups: states for the view and an FRJob for the dumps."""

    def __init__(self, groups: int = 3, step_s: float = 0.2, seed: int = 0) -> None:
        self.n = groups
        self.step_s = step_s
        self.rng = random.Random(seed)
        self.fr = FRJob(world_size=groups, flavour="gloo", replica_group_size=1, jitter_ms=5,
                        compute_ms=step_s * 1000, seed=seed)
        self.fr.quorum(3, list(range(groups)))
        self.states = [rank_state(r, r, participants=groups, quorum_id=3, step=0, now=T0)
                       for r in range(groups)]
        self.vb = ViewBuilder()
        self.targets = [Target(f"http://127.0.0.1:{9000 + r}", "static") for r in range(groups)]
        self.down: set[int] = set()

    def steps(self, n: int, delay_ms: dict[int, float] | None = None, now: float = T0) -> None:
        for _ in range(n):
            self.fr.ft_collective("all_reduce", [[1000]], delay_ms=delay_ms)
        for s in self.states:
            s["step"] += n
            s["recent_step_seconds"] = [self.step_s * self.rng.uniform(0.8, 1.3)
                                        for _ in range(16)]
            s["last_step_at"] = now
            s["phase"], s["phase_since"] = "forward", now

    def view(self, now: float):
        polls = {t.url: (RankPoll(t.url, True, data=dict(s)) if r not in self.down
                         else RankPoll(t.url, False, reason="connection", error="refused"))
                 for r, (t, s) in enumerate(zip(self.targets, self.states, strict=True))}
        return self.vb.update(self.targets, polls, now=now)

    def dumps(self):
        return {r: d for r, d in self.fr.dumps().items() if r not in self.down}


def sweep(det: Detectors, job: Job, now: float):
    view = job.view(now)
    wanted = det.fr_wanted(view, now)
    return det.update(view, job.dumps() if wanted else None, now)


def test_healthy_noisy_job_has_no_findings():
    job = Job(seed=1)
    det = Detectors(DetectorConfig(fr_interval_s=1.0))
    now = T0
    for i in range(60):
        now += 1.0
        job.steps(5, delay_ms={r: random.Random(i * 7 + r).uniform(0, 60) for r in range(3)},
                  now=now - 0.05)
        job.states[i % 3]["phase"] = "backward"  # someone is always a little behind
        for r in range(3):
            if r != i % 3:
                job.states[r]["phase"] = "allreduce"
        assert sweep(det, job, now) == []
    assert det.open_findings() == []


def test_straggler_needs_consecutive_windows_then_confirms():
    job = Job()
    det = Detectors(DetectorConfig(straggler_windows=3))
    now = T0
    job.steps(10, now=now)
    sweep(det, job, now)
    confirmed = []
    for i in range(6):
        now += 1.0
        job.steps(2, delay_ms={2: 600}, now=now)
        job.states[2]["phase"] = "backward"
        job.states[0]["phase"] = job.states[1]["phase"] = "allreduce"
        new = sweep(det, job, now)
        confirmed += [(i, f) for f in new]
    assert len(confirmed) == 1
    i, f = confirmed[0]
    assert i >= 2  # not on the first window
    assert (f.kind, f.replica_group, f.ranks) == ("straggler", 2, [2])
    assert f.evidence["median_lag_s"] == pytest.approx(0.6, abs=0.05)
    assert f.evidence["windows"] >= 3
    assert f.first_seen < f.confirmed_at


def test_one_spike_is_not_a_straggler():
    job = Job()
    det = Detectors(DetectorConfig())
    now = T0
    job.steps(10, now=now)
    for i in range(8):
        now += 1.0
        job.steps(3, delay_ms={1: 900} if i == 2 else None, now=now)
        if i == 2:
            job.states[1]["phase"] = "backward"
            job.states[0]["phase"] = job.states[2]["phase"] = "allreduce"
        assert sweep(det, job, now) == []


def test_hang_confirmed_with_the_rank_that_never_arrived():
    job = Job()
    cfg = DetectorConfig(hang_floor_s=3.0, hang_factor=3.0)
    det = Detectors(cfg)
    now = T0
    job.steps(20, now=now)
    sweep(det, job, now)
    # group 1 hangs before its all_reduce; 0 and 2 enqueue theirs and wait
    job.fr.ft_collective("all_reduce", [[1000]], absent=[1])
    job.states[1].update(phase="backward", phase_since=now + 0.1)
    for r in (0, 2):
        job.states[r].update(phase="allreduce", phase_since=now + 0.15)
    found = []
    for t in (1.0, 2.0, 3.5, 4.5):
        found += sweep(det, job, now + t)
        if t < 3.0:
            assert found == []  # below the threshold: not yet
    assert [(f.kind, f.replica_group, f.ranks) for f in found] == [("hang", 1, [1])]
    ev = found[0].evidence
    assert ev["never_arrived"] == [1] and ev["waiting_ranks"] == [0, 2]
    assert ev["threshold_s"] == pytest.approx(3.0)
    # progress resumes: the hang is resolved
    job.steps(1, now=now + 6)
    sweep(det, job, now + 6.2)
    assert det.open_findings() == []
    assert det.resolved_findings()[-1].resolution == "progress"


def test_stall_without_pending_collective_is_not_a_hang():
    job = Job()
    det = Detectors(DetectorConfig())
    now = T0
    job.steps(20, now=now)
    for s in job.states:  # everyone waits for a quorum (torchft's business, not a hang)
        s.update(phase="quorum", phase_since=now)
    for t in range(1, 10):
        assert sweep(det, job, now + t) == []


def test_mismatch_attributed_to_the_minority():
    job = Job()
    det = Detectors(DetectorConfig())
    job.steps(10, now=T0)
    assert sweep(det, job, T0) == []  # remembers commit failures (and a first periodic look)
    job.fr.ft_collective("all_reduce", [[1000]], rank_sizes={1: [[1001]]})
    for s in job.states:
        s["commit_failures"] = 1
    found = sweep(det, job, T0 + 1)
    assert [(f.kind, f.replica_group, f.ranks) for f in found] == [("mismatch", 1, [1])]
    assert found[0].evidence["attributed_by"] == "majority"


def test_mismatch_between_two_survivors_uses_own_history():
    """The third group crashed on the mismatch: two dumps disagree, the odd one is the culprit."""
    job = Job()
    det = Detectors(DetectorConfig())
    job.steps(10, now=T0)
    assert sweep(det, job, T0) == []
    job.fr.ft_collective("all_reduce", [[1000]], rank_sizes={2: [[1001]]})
    job.down = {0}
    for s in job.states:
        s["commit_failures"] = 1
    found = sweep(det, job, T0 + 1)
    mism = [f for f in found if f.kind == "mismatch"]
    assert [(f.replica_group, f.ranks) for f in mism] == [(2, [2])]
    assert mism[0].evidence["attributed_by"] == "own_history"


def test_dead_after_n_sweeps_and_resolved_when_back():
    job = Job()
    det = Detectors(DetectorConfig(dead_sweeps=3))
    job.steps(5, now=T0)
    sweep(det, job, T0)
    job.down = {2}
    out = [sweep(det, job, T0 + i) for i in (1, 2, 3)]
    assert out[0] == [] and out[1] == []
    assert [(f.kind, f.replica_group) for f in out[2]] == [("dead", 2)]
    job.down = set()
    sweep(det, job, T0 + 4)
    assert det.open_findings() == []


def test_new_replica_id_starts_clean():
    job = Job()
    det = Detectors(DetectorConfig(straggler_windows=2))
    now = T0
    job.steps(10, now=now)
    for _ in range(3):
        now += 1
        job.steps(2, delay_ms={2: 600}, now=now)
        job.states[2]["phase"] = "backward"
        job.states[0]["phase"] = job.states[1]["phase"] = "allreduce"
        sweep(det, job, now)
    assert [f.kind for f in det.open_findings()] == ["straggler"]
    job.states[2]["replica_id"] = "replica_group_2:restarted"
    now += 1
    job.steps(2, now=now)
    sweep(det, job, now)
    assert det.open_findings() == []
    assert det.resolved_findings()[-1].resolution == "replaced"


def straggle(det: Detectors, job: Job, sweeps: int, now: float = T0) -> list:
    """Group 2 enqueues every all_reduce 0.6 s after the others, for ``sweeps`` sweeps."""
    found = []
    for _ in range(sweeps):
        now += 1.0
        job.steps(2, delay_ms={2: 600}, now=now)
        job.states[2]["phase"] = "backward"
        job.states[0]["phase"] = job.states[1]["phase"] = "allreduce"
        found += sweep(det, job, now)
    return found


def test_each_sweep_normalizes_every_dump_once_for_analysis_and_lags(monkeypatch):
    import monitor.analysis.engine as engine

    normalized: list[int] = []
    real_normalize = engine.normalize

    def counting_normalize(dump, rank=None):
        normalized.append(rank)
        return real_normalize(dump, rank)

    seen: list[dict] = []

    def analyzer(traces):
        seen.append(dict(traces))
        return analyze(traces)

    monkeypatch.setattr(engine, "normalize", counting_normalize)
    job = Job()
    det = Detectors(DetectorConfig(straggler_windows=3), analyzer=analyzer)
    job.steps(10, now=T0)
    found = straggle(det, job, 4)
    assert [(f.kind, f.replica_group) for f in found] == [("straggler", 2)]
    assert seen and all(isinstance(t, RankTrace) for traces in seen for t in traces.values())
    assert sorted(normalized) == sorted(r for traces in seen for r in traces)  # once per sweep


def test_a_foreign_dump_is_left_out_and_the_others_are_still_judged():
    job = Job()
    real_dumps = job.dumps
    job.dumps = lambda: {**real_dumps(), 0: {"not": "a Flight Recorder dump"}}
    det = Detectors(DetectorConfig(straggler_windows=3))
    job.steps(10, now=T0)
    found = straggle(det, job, 5)
    assert [(f.kind, f.replica_group, f.ranks) for f in found] == [("straggler", 2, [2])]
    assert found[0].evidence["median_lag_s"] == pytest.approx(0.6, abs=0.05)
    assert det.last_error is None


def test_analyzer_failure_does_not_raise():
    def broken(dumps):
        raise RuntimeError("engine bug")

    job = Job()
    det = Detectors(DetectorConfig(fr_interval_s=0.001), analyzer=broken)
    job.steps(5, now=T0)
    assert sweep(det, job, T0 + 1) == []
    assert "engine bug" in det.last_error
