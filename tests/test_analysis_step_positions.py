"""Eight ranks, one slow before each step's first collective (a slow data loader, a throttled
CPU): the others wait in that collective only, the step's others run in sync. Where that
collective's signature repeats in the step (FSDP's all_gathers of identical blocks) the rank is
last at 1 of 8 of its signature's collectives, which no tally per signature names: a group's
collectives are also judged per position in its step (docs/analyze.md, Stragglers)."""

from __future__ import annotations

import random

import pytest

from monitor.analysis import analyze
from tests.support.frgen import FRJob
from tests.test_analyze_bundle_verdicts import bundle, run

LATE_RANK = 5


def fsdp_job(flavour: str, seed: int, late: bool, steps: int = 40, blocks: int = 8,
             last: tuple[str, int] = ("all_reduce", 1), world: int = 8, late_ranks: tuple[int, ...] = (LATE_RANK,),
             late_ms: tuple[float, float] = (30.0, 60.0)) -> FRJob:
    """``world`` ranks, 8 a host, one group: each step ~60 ms of loading and compute before its
    first collective, then ``blocks`` same-size all_gathers and ``last`` (op, how many) ~5 ms
    apart, every rank 0-4 ms of uniform jitter before each; ``late``: ``late_ranks`` ``late_ms``
    (uniform) later into the first all_gather."""
    job = FRJob(world, flavour=flavour, hosts={r: f"h{r // 8}" for r in range(world)}, jitter_ms=0.0,
                compute_ms=5.0, seed=seed)
    rng = random.Random(seed + 100)
    for _ in range(steps):
        for i in range(blocks + last[1]):
            delay = {r: rng.uniform(0.0, 4.0) + (55.0 if i == 0 else 0.0) for r in range(world)}
            for r in late_ranks if late and i == 0 else ():
                delay[r] += rng.uniform(*late_ms)
            op, sizes = ("all_gather", [[512]]) if i < blocks else (last[0], [[4096]])
            job.collective("0", op, sizes, delay_ms=delay)
    return job


def dumps(job: FRJob) -> dict:
    """The job's dumps, each naming its host (gloo's enqueue times are compared within one)."""
    return {r: {**d, "host": job.host_of(r)} for r, d in job.dumps().items()}


@pytest.mark.parametrize("flavour", ["nccl", "gloo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_rank_late_into_the_first_of_repeated_all_gathers_is_a_straggler(flavour, seed):
    result = analyze(dumps(fsdp_job(flavour, seed, late=True)))
    (found,) = result.findings
    assert (found.kind, found.culprit_ranks, found.pg, found.collectives) == ("straggler", [LATE_RANK], "0", 40), found
    assert 25.0 < found.median_wait_ms < 65.0, found
    assert "40 all_gather collectives, the same one of each step's 9" in found.detail, found.detail
    assert result.lags == []


@pytest.mark.parametrize("flavour", ["nccl", "gloo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_repeated_all_gathers_with_jitter_only_have_no_straggler(flavour, seed):
    result = analyze(dumps(fsdp_job(flavour, seed, late=False)))
    assert result.findings == [] and result.lags == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ten_steps_of_jitter_only_have_no_straggler(seed):
    """Nine positions of ten collectives each: one rank or another is last or late at half of
    one of them by chance, which a tally of so few must not call a straggler."""
    for flavour in ("nccl", "gloo"):
        result = analyze(dumps(fsdp_job(flavour, seed, late=False, steps=10)))
        assert result.findings == [] and result.lags == [], flavour


@pytest.mark.parametrize("late", [True, False])
def test_a_step_of_long_runs_of_one_signature_is_judged_per_position(late):
    """16 all_gathers then 16 reduce_scatters a step: period 1 holds for 30 of 32 collectives,
    yet the step repeats only whole."""
    result = analyze(dumps(fsdp_job("gloo", 3, late=late, blocks=16, last=("reduce_scatter", 16))))
    assert [f.culprit_ranks for f in result.findings] == ([[LATE_RANK]] if late else []), result.findings
    if late:
        assert "the same one of each step's 32" in result.findings[0].detail, result.findings[0].detail


@pytest.mark.parametrize(("steps", "seed"), [(14, 0), (10, 6), (14, 11)])
def test_a_healthy_group_over_eight_hosts_compared_by_enqueue_time_has_no_straggler(steps, seed):
    """64 ranks, 8 a host, gloo: enqueue times are compared within a host only, so a rank's
    chance of being last at a position is 1 in 8, not 1 in 64."""
    result = analyze(dumps(fsdp_job("gloo", seed, late=False, world=64, steps=steps)))
    assert result.findings == [] and result.lags == []


@pytest.mark.parametrize("flavour", ["nccl", "gloo"])
@pytest.mark.parametrize("seed", [1, 2])
def test_two_ranks_equally_late_into_the_first_all_gather_are_both_stragglers(flavour, seed):
    """Ranks 2 and 5 each 20 ms late: they take turns being last, so neither stands out by being
    last; both are late at every step."""
    job = fsdp_job(flavour, seed, late=True, steps=20, late_ranks=(2, 5), late_ms=(20.0, 20.0))
    found = analyze(dumps(job)).findings
    assert sorted(f.culprit_ranks for f in found) == [[2], [5]], found


@pytest.mark.parametrize("flavour", ["nccl", "gloo"])
@pytest.mark.parametrize(("late_ms", "named"), [((3.0, 6.0), []), ((30.0, 60.0), [[0]])])
def test_a_position_is_judged_against_the_step(flavour, late_ms, named):
    """Rank 0 (logging, say) a few ms late into each step's first all_gather: ~4 % of the
    ~120 ms step, so no straggler, though its peers wait for it at every step; 30-60 ms is."""
    job = fsdp_job(flavour, 0, late=True, late_ranks=(0,), late_ms=late_ms)
    assert [f.culprit_ranks for f in analyze(dumps(job)).findings] == named


@pytest.mark.parametrize(("steps_since", "verdict"), [(5, (None, True)), (15, (True, False))])
def test_a_bundle_of_too_few_steps_to_judge_per_position_is_unchecked(tmp_path, capsys, steps_since, verdict):
    """45 collectives since the onset, yet each position in the step was seen 5 times only."""
    job = fsdp_job("gloo", 0, late=True)
    onset = max(d["entries"][-9 * steps_since]["time_created_ns"] for d in job.dumps().values())
    path = bundle(tmp_path / "b", "straggler", [LATE_RANK], dumps(job),
                  {"ranks": [LATE_RANK], "first_seen": onset / 1e9 - 0.001})
    _, report, _, text = run(capsys, path)
    [b] = report["bundles"]
    assert (b["analysis_agrees"], b["unchecked"]) == verdict, b
    assert "does not name" not in text


def test_a_first_collective_taking_every_ranks_loader_jitter_names_nobody():
    """Every rank waits 0-10 ms on its data before the step's first collective (a one-off
    signature), the rest of the step in sync: that position's late rate is far above the
    group's, so a rank late there often by chance is no straggler (64 ranks, 8 hosts, gloo)."""
    j = FRJob(64, flavour="gloo", hosts={r: f"h{r // 8}" for r in range(64)}, jitter_ms=1.0,
              compute_ms=3.0, seed=17)
    rng = random.Random(24)
    for _ in range(20):
        ops = [("all_gather", [[1024]] if i == 0 else [[512]]) for i in range(8)]
        for i, (op, sizes) in enumerate(ops + [("reduce_scatter", [[512]])] * 8
                                        + [("all_reduce", [[16]])]):
            j.collective("0", op, sizes, delay_ms={r: 50.0 + rng.uniform(0, 10) if i == 0
                                                   else 0.0 for r in range(64)})
    res = analyze({r: {**d, "host": j.host_of(r)} for r, d in j.dumps().items()})
    assert [f.culprit_ranks for f in res.findings if f.kind == "straggler"] == []
