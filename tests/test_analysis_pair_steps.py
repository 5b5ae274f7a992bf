"""Two ranks compared, one slow before each step's first collective (a slow data loader, a
throttled CPU): its peer waits in that collective only and the step's others run in sync, so its
median lag per collective is ~0. A pair is judged on its lag summed per step, which names it; too
few whole steps since a bundle's onset cannot clear it (docs/analyze.md, Stragglers: two ranks
compared). The demo's straggler eviction kept such a bundle (tests/data/demo_straggler_bundle.tar.gz:
its dumps cut by ``tests/data/nightly_bundle_trim.py BUNDLE OUT 48``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from monitor.analysis import analyze
from tests.support.frgen import FRJob
from tests.test_analyze_bundle_verdicts import bundle, run

DEMO_BUNDLE = Path(__file__).parent / "data" / "demo_straggler_bundle.tar.gz"
# the demo's step on its replica group's own group: 8 all_gathers, in 4 sizes
STEP = [[[4096]], *[[[512]]] * 4, *[[[256]]] * 2, [[128]]]


def pair_job(flavour: str, seed: int, late_ms: float, steps: int = 30, everywhere_ms: float = 0.0) -> FRJob:
    """Ranks 0 and 1 on one host: each step ~100 ms of compute before its first collective, ~6 ms
    before each of the other 7; rank 1 ``late_ms`` more before the first, ``everywhere_ms``
    before every one."""
    job = FRJob(2, flavour=flavour, hosts={0: "h0", 1: "h0"}, jitter_ms=1.0, compute_ms=5.0, seed=seed)
    for _ in range(steps):
        for i, sizes in enumerate(STEP):
            delay = {0: 100.0, 1: 100.0 + late_ms} if i == 0 else {0: 0.0, 1: 0.0}
            delay[1] += everywhere_ms
            job.collective("0", "all_gather", sizes, delay_ms=delay)
    return job


def dumps(job: FRJob) -> dict:
    """The job's dumps, each naming its host (gloo's enqueue times are compared within one)."""
    return {r: {**d, "host": job.host_of(r)} for r, d in job.dumps().items()}


@pytest.mark.parametrize("flavour", ["nccl", "gloo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_rank_late_into_the_first_collective_of_each_step_is_a_lag(flavour, seed):
    result = analyze(dumps(pair_job(flavour, seed, late_ms=60.0)))
    assert result.findings == []
    (lag,) = result.lags
    assert (lag.kind, lag.culprit_ranks, lag.peers, lag.collectives) == ("lag", [1], [0], 240)
    assert 55.0 < lag.median_wait_ms < 65.0, lag
    assert "a step (its 8 collectives' lags summed)" in lag.detail and "over 30 steps" in lag.detail


@pytest.mark.parametrize("flavour", ["nccl", "gloo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_healthy_pair_with_steps_of_several_collectives_has_no_lag(flavour, seed):
    result = analyze(dumps(pair_job(flavour, seed, late_ms=0.0)))
    assert result.findings == [] and result.lags == []


def test_a_lag_at_every_collective_of_a_step_is_still_a_lag():
    result = analyze(dumps(pair_job("gloo", 0, late_ms=0.0, everywhere_ms=3.0)))
    (lag,) = result.lags
    assert lag.culprit_ranks == [1] and 20.0 < lag.median_wait_ms < 28.0, lag  # 8 x 3 ms a step


def demo_shape_bundle(tmp_path: Path, steps_since: int) -> str:
    """A straggler bundle naming rank 1 of :func:`pair_job`, its onset ``steps_since`` steps
    before the dumps."""
    job = pair_job("gloo", 0, late_ms=600.0)
    onset = max(d["entries"][-len(STEP) * steps_since]["time_created_ns"] for d in job.dumps().values())
    return bundle(tmp_path / "demo", "straggler", [1], dumps(job), {"ranks": [1], "first_seen": onset / 1e9 - 0.001})


def test_a_bundle_of_the_demo_shape_agrees_with_the_monitor(tmp_path, capsys):
    code, report, _, text = run(capsys, demo_shape_bundle(tmp_path, steps_since=5))
    [b] = report["bundles"]
    assert (b["analysis_agrees"], b["unchecked"], code) == (True, False, 0), b
    assert "[lag] rank 1 behind rank 0" in text


def test_too_few_whole_steps_since_the_onset_is_unchecked_not_a_disagreement(tmp_path, capsys):
    """Two steps since the onset: 16 collectives, yet what a step waits for is seen twice only."""
    _, report, _, text = run(capsys, demo_shape_bundle(tmp_path, steps_since=2))
    [b] = report["bundles"]
    assert (b["analysis_agrees"], b["unchecked"]) == (None, True), b
    assert "does not name" not in text


def test_the_demo_straggler_bundle_names_the_rank_the_monitor_evicted(capsys):
    """Rank 3 enqueued ~0.6 s late into the first all_gather of each step of its replica group's
    own group, ~0 s late into the step's other 7."""
    code, report, _, text = run(capsys, str(DEMO_BUNDLE))
    [b] = report["bundles"]
    assert (b["culprit_ranks"], b["analysis_agrees"], b["unchecked"], code) == ([3], True, False, 0), b
    [lag] = report["lags"]
    assert (lag["culprit_ranks"], lag["peers"], lag["pg"]) == ([3], [2], "0"), lag
    assert 500.0 < lag["median_wait_ms"] < 700.0, lag
    assert "; the analysis agrees\n" in text
