"""arrival_lags on generated torchft dumps: which collectives count, and each rank's lag."""

from __future__ import annotations

import pytest

from monitor.analysis import GroupKey, arrival_lags, normalize_dumps
from tests.support.frgen import FRJob


def ft_job(groups: int = 3, group_size: int = 1) -> FRJob:
    """torchft replica groups whose ranks compute in exactly 20 ms (no jitter): lags are exact."""
    return FRJob(groups * group_size, flavour="gloo", replica_group_size=group_size, jitter_ms=0)


def lags_of(dumps, last: int = 4):
    traces, errors = normalize_dumps(dumps)
    assert errors == []
    return arrival_lags(traces, last=last)


def test_lags_come_from_the_current_incarnation_only():
    job = ft_job()
    job.quorum(3, [0, 1, 2])
    for _ in range(5):
        job.ft_collective("all_reduce", [[1000]], delay_ms={2: 300})
    job.quorum(4, [0, 1, 2])
    for _ in range(6):
        job.ft_collective("all_reduce", [[1000]], delay_ms={1: 200})
    lags = lags_of(job.dumps())
    assert [(x.quorum_id, x.seq) for x in lags] == [(4, 3), (4, 4), (4, 5), (4, 6)]
    for x in lags:
        assert x.group == GroupKey("", None, 4, 0)
        assert x.lags_s == pytest.approx({0: 0.0, 1: 0.2, 2: 0.0})


def test_only_collectives_every_participant_enqueued_count():
    job = ft_job()
    job.quorum(3, [0, 1, 2])
    for _ in range(5):
        job.ft_collective("all_reduce", [[1000]], delay_ms={0: 50})
    job.ft_collective("all_reduce", [[1000]], absent=[1])  # pending on 0 and 2
    lags = lags_of(job.dumps(), last=3)
    assert [x.seq for x in lags] == [3, 4, 5]
    assert lags[-1].lags_s == pytest.approx({0: 0.05, 1: 0.0, 2: 0.0})


def test_a_participant_without_entries_of_the_current_incarnation_gives_no_lags():
    job = ft_job()
    job.quorum(3, [0, 1, 2])
    for _ in range(5):
        job.ft_collective("all_reduce", [[1000]])
    job.quorum(4, [0, 1, 2])
    for _ in range(3):
        job.ft_collective("all_reduce", [[1000]], absent=[2])  # 2 joined quorum 4, enqueued nothing
    # the ranks cannot all be compared yet, and quorum 3's collectives are stale
    assert lags_of(job.dumps()) == []


def test_a_rank_without_a_dump_is_left_out_not_waited_for():
    job = ft_job()
    job.quorum(3, [0, 1, 2])
    for _ in range(4):
        job.ft_collective("all_reduce", [[1000]], delay_ms={1: 100})
    dumps = job.dumps()
    del dumps[0]  # unreachable this sweep
    lags = lags_of(dumps)
    assert [x.seq for x in lags] == [1, 2, 3, 4]
    assert all(x.lags_s == pytest.approx({1: 0.1, 2: 0.0}) for x in lags)


def test_each_group_rank_is_its_own_incarnation():
    job = ft_job(groups=2, group_size=2)  # group rank 0: ranks 0, 2; group rank 1: ranks 1, 3
    job.quorum(7, [0, 1])
    for _ in range(2):
        job.ft_collective("all_reduce", [[1000]], delay_ms={3: 100})
    lags = lags_of(job.dumps())
    assert [(x.group.group_rank, x.seq, x.lags_s) for x in lags] == [
        (0, 1, {0: 0.0, 2: 0.0}),
        (0, 2, {0: 0.0, 2: 0.0}),
        (1, 1, {1: 0.0, 3: pytest.approx(0.1)}),
        (1, 2, {1: 0.0, 3: pytest.approx(0.1)}),
    ]


def test_collectives_without_timestamps_are_skipped():
    job = ft_job(groups=2)
    job.quorum(3, [0, 1])
    for _ in range(3):
        job.ft_collective("all_reduce", [[1000]])
    dumps = job.dumps()
    for e in dumps[1]["entries"][:2]:
        e["time_created_ns"] = 0
    assert [x.seq for x in lags_of(dumps)] == [3]


def test_groups_other_than_torchfts_give_nothing():
    job = FRJob(4, flavour="nccl")
    job.group("1", [0, 1])
    for _ in range(5):
        job.collective("0", "all_reduce", [[1024]], delay_ms={3: 100})
        job.collective("1", "all_gather", [[64]])
    assert lags_of(job.dumps()) == []
