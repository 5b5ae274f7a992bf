"""The analysis engine on generated scenarios: each finding kind, and the jobs that must stay quiet."""

from __future__ import annotations

import json

import pytest

from lightkeeper.cli import main
from monitor.analysis import GroupKey, analyze, normalize, normalize_dumps
from monitor.analysis.model import DumpFormatError
from tests.support.frgen import (
    TP_STEP,
    FRJob,
    loaded_pair_job,
    three_group_job,
    tp_job,
    write_dumps,
)

STEP = TP_STEP


def kinds(result) -> list[tuple[str, str | None, list[int]]]:
    return [(f.kind, f.pg, f.culprit_ranks) for f in result.findings]


@pytest.mark.parametrize("flavour", ["nccl", "gloo"])
def test_healthy_job_with_differently_wrapped_buffers_has_no_findings(flavour):
    job = tp_job(flavour)
    job.repeat(40, STEP)
    # ranks wrap at very different points; record ids no longer line up across ranks
    result = analyze(job.dumps(buffer_size={0: 17, 1: 50, 2: 33, 3: 120}))
    assert result.findings == []
    assert result.ranks == [0, 1, 2, 3]
    assert result.unknown_ranks == []
    assert result.last_seq[GroupKey("0")] == {0: 40, 1: 40, 2: 40, 3: 40}


@pytest.mark.parametrize(
    ("override", "mismatch"),
    [
        ({"ops": {2: "broadcast"}}, "op"),
        ({"rank_sizes": {2: [[512]]}}, "size"),
        ({"dtypes": {2: "BFloat16"}}, "dtype"),
    ],
)
@pytest.mark.parametrize("flavour", ["nccl", "gloo"])
def test_mismatch_names_the_rank_that_differs_from_the_majority(flavour, override, mismatch):
    job = tp_job(flavour)
    job.repeat(10, STEP)
    job.collective("0", "all_reduce", [[1024]], **override)
    job.repeat(3, STEP)
    result = analyze(job.dumps(buffer_size={0: 30, 1: 40, 2: 45, 3: 60}))
    mismatches = [f for f in result.findings if f.kind == "mismatch"]
    assert len(mismatches) == 1
    found = mismatches[0]
    assert (found.pg, found.seq, found.mismatch, found.culprit_ranks) == ("0", 11, mismatch, [2])
    assert found.has_majority
    assert found.variants[0]["ranks"] == [0, 1, 3]
    assert found.to_dict()["mismatch"] == mismatch


def test_a_non_string_dtype_is_described_not_a_crash():
    job = tp_job()
    job.repeat(5, STEP)
    job.collective("0", "all_reduce", [[1024]], dtypes={2: 7})  # a rank serving garbage
    job.repeat(2, STEP)
    (found,) = [f for f in analyze(job.dumps()).findings if f.kind == "mismatch"]
    assert (found.mismatch, found.culprit_ranks) == ("dtype", [2])
    assert "7" in found.detail


def test_mismatch_without_majority_says_so_and_names_every_participant():
    job = tp_job()
    job.repeat(5, STEP)
    job.collective("1", "all_gather", [[64]], rank_sizes={1: [[32]]})
    result = analyze(job.dumps())
    (found,) = [f for f in result.findings if f.kind == "mismatch"]
    assert (found.pg, found.seq, found.has_majority, found.culprit_ranks) == ("1", 6, False, [0, 1])
    assert "no variant has a majority" in found.detail


def test_rank_that_skipped_a_collective_is_blamed_once_per_group():
    job = FRJob(4)
    for _ in range(5):
        job.collective("0", "all_reduce", [[1024]])
        job.collective("0", "broadcast", [[16]])
    # rank 3 skips one broadcast, so from there on its sequence ids are shifted against everyone's
    job.collective("0", "all_reduce", [[1024]])
    job.collective("0", "broadcast", [[16]], absent=[3], complete=True)
    for _ in range(3):
        job.collective("0", "all_reduce", [[1024]])
        job.collective("0", "broadcast", [[16]])
    mismatches = [f for f in analyze(job.dumps()).findings if f.kind == "mismatch"]
    assert len(mismatches) == 1
    assert mismatches[0].culprit_ranks == [3] and mismatches[0].seq == 12
    assert mismatches[0].later_mismatches > 0


@pytest.mark.parametrize("flavour", ["nccl", "gloo"])
def test_hang_blames_the_members_that_never_arrived(flavour):
    job = tp_job(flavour)
    job.repeat(12, STEP)
    job.collective("0", "all_reduce", [[1024]], absent=[1])
    # rank 1 went on to wait in its tp group where rank 0 never comes (0 waits in the default group)
    job.collective("1", "all_gather", [[64]], absent=[0])
    result = analyze(job.dumps(buffer_size={0: 20, 1: 25, 2: 31, 3: 40}))
    hangs = {f.pg: f for f in result.findings if f.kind == "hang"}
    assert set(hangs) == {"0", "1"}
    default = hangs["0"]
    assert (default.seq, default.op, default.culprit_ranks, default.waiting_ranks) == (13, "all_reduce", [1], [0, 2, 3])
    assert default.last_seq_by_rank == {0: 13, 1: 12, 2: 13, 3: 13}
    assert default.last_activity[1]["pg"] == "1" and default.last_activity[1]["op"] == "all_gather"
    assert hangs["1"].culprit_ranks == [0] and hangs["1"].seq == 13
    assert [f.kind for f in result.findings if f.kind == "mismatch"] == []
    assert json.loads(json.dumps(result.to_dict()))["findings"][0]["last_seq_by_rank"]["1"] == 12


def test_nccl_collective_completed_anywhere_is_not_a_hang():
    # rank 3's dump was taken before it enqueued seq 8, which everyone then completed
    job = FRJob(4)
    job.repeat(8, [("0", "all_reduce", [[1024]])])
    dumps = job.dumps()
    dumps[3]["entries"] = dumps[3]["entries"][:-1]
    assert [f.kind for f in analyze(dumps).findings] == []


@pytest.mark.parametrize("age_s, hung", [(0.2, False), (3.0, True)])
def test_gloo_collective_enqueued_just_before_the_dump_is_in_flight_not_hung(age_s, hung):
    # Dumps of a running gloo job are taken one after another: rank 3's was taken just before
    # it enqueued seq 8. With dump_time_ns (the WorkerServer's) the others' seq 8 has an age on
    # their own clocks; only one older than min_pending_s is a hang.
    job = FRJob(4, flavour="gloo")
    job.repeat(8, [("0", "all_reduce", [[1024]])])
    dumps = job.dumps()
    dumps[3]["entries"] = dumps[3]["entries"][:-1]
    for d in dumps.values():
        newest = max(e["time_created_ns"] for e in d["entries"])
        d["dump_time_ns"] = newest + int(age_s * 1e9)
    hangs = [f for f in analyze(dumps).findings if f.kind == "hang"]
    assert bool(hangs) == hung
    if hung:
        assert hangs[0].culprit_ranks == [3] and hangs[0].seq == 8
    # Without dump_time_ns there is no age to judge by: reported, as before.
    for d in dumps.values():
        del d["dump_time_ns"]
    assert [f.kind for f in analyze(dumps).findings] == ["hang"]


def test_missing_dump_is_unknown_not_a_culprit_unless_asked():
    job = tp_job()
    job.repeat(6, STEP)
    job.collective("0", "all_reduce", [[1024]], absent=[3])
    dumps = job.dumps(ranks=[0, 1, 2])
    result = analyze(dumps)
    assert result.unknown_ranks == [3]
    assert [f for f in result.findings if 3 in f.culprit_ranks] == []
    blamed = analyze(dumps, blame_missing=True)
    # rank 2 completed everything in group "2", so only the default group's pending seq 7 blames 3
    assert [(f.kind, f.pg, f.seq, f.culprit_ranks) for f in blamed.findings] == [("hang", "0", 7, [3])]
    # what rank 3 did is assumed, not read: it is no entry of the ranks' own seqs, and said so
    (hang,) = blamed.findings
    assert sorted(hang.last_seq_by_rank) == [0, 1, 2]
    assert "rank(s) 3 have no dump: taken as at seq 6 (--blame-missing)" in hang.detail


def test_blaming_a_missing_rank_reads_only_the_dumps_there_are():
    """--blame-missing assumes the missing rank 0 completed what rank 1 did (seq 6); rank 2's
    dump is older (seq 5). Seq 6 completed, so nobody hung: no finding, and no crash over the
    missing rank's absent rows."""
    job = FRJob(3, flavour="nccl")
    job.repeat(5, [("0", "all_reduce", [[8]])])
    older = job.dumps(ranks=[2])
    job.collective("0", "all_reduce", [[8]])
    dumps = {**job.dumps(ranks=[1]), **older}
    assert analyze(dumps, blame_missing=True).findings == []


def test_gloo_default_group_keyed_empty_in_pg_config_is_group_0():
    """torch 2.13's gloo dumps keep one ``""`` entry in ``pg_config``: the ranks of the last
    group built (the world's in a job of the default group only), while their entries say
    ``"0"`` (a real dump's shape): those ranks are members of group 0, so a rank without a dump
    is unknown, blamed only when asked, and no empty group is judged."""
    job = FRJob(3, flavour="gloo")
    job.repeat(5, [("0", "all_reduce", [[8]])])
    dumps = job.dumps(ranks=[0, 1])
    for d in dumps.values():
        d["pg_config"] = {"": {"name": "", "desc": "", "ranks": "[0, 1, 2]"}}
    result = analyze(dumps)
    assert (result.unknown_ranks, result.findings) == ([2], [])
    blamed = analyze(dumps, blame_missing=True)
    assert [(f.kind, f.pg, f.culprit_ranks) for f in blamed.findings] == [("hang", "0", [2])]
    assert list(blamed.last_seq) == [GroupKey("0")]


def test_gloo_world_is_inferred_from_rank_numbers_or_given():
    job = FRJob(4, flavour="gloo")
    job.repeat(5, [("0", "all_reduce", [[8]])])
    assert analyze(job.dumps(ranks=[0, 1, 3])).unknown_ranks == [2]
    assert analyze(job.dumps(ranks=[0, 1, 2]), world_size=4).unknown_ranks == [3]


def test_wrapped_rank_without_entries_of_a_group_cannot_testify():
    job = tp_job()
    job.repeat(5, STEP)
    job.repeat(30, [("0", "all_reduce", [[1024]])])
    # rank 0's buffer holds only default-group work: its entries say nothing about group "1"
    dumps = job.dumps(buffer_size={0: 10})
    result = analyze({r: {k: v for k, v in d.items() if k != "pg_status"} for r, d in dumps.items()})
    assert result.findings == []
    assert result.last_seq[GroupKey("1")] == {1: 5}
    # NCCL's pg_status does: its count of the group's collectives
    assert analyze(dumps).last_seq[GroupKey("1")] == {0: 5, 1: 5}


def test_straggler_found_from_durations_despite_clock_skew():
    job = FRJob(8, jitter_ms=1.0, skew_ms=50.0, seed=1)
    job.repeat(40, [("0", "all_reduce", [[4096]])], delay_ms={5: 4.0})
    (found,) = analyze(job.dumps()).findings
    assert (found.kind, found.culprit_ranks, found.evidence) == ("straggler", [5], "duration_ms")
    assert found.score > 0.9 and found.median_wait_ms > 3.0
    assert found.to_dict()["rank"] == 5


def test_two_equally_slow_ranks_are_both_stragglers():
    # they take turns being last, so neither is last most of the time; both are always late
    job = FRJob(8, jitter_ms=0.5, seed=5)
    job.repeat(40, [("0", "all_reduce", [[4096]])], delay_ms={2: 6.0, 6: 6.0})
    found = analyze(job.dumps()).findings
    assert [(f.kind, f.culprit_ranks) for f in found] == [("straggler", [2]), ("straggler", [6])]
    assert all(f.to_dict()["late_fraction"] > 0.9 for f in found)


def test_straggler_on_gloo_uses_arrival_order_within_a_host():
    hosts = {r: f"h{r // 4}" for r in range(8)}
    job = FRJob(8, flavour="gloo", hosts=hosts, jitter_ms=1.0, skew_ms=200.0, seed=2)
    job.repeat(40, [("0", "all_reduce", [[4096]])], delay_ms={6: 5.0})
    dumps = job.dumps()
    for rank, dump in dumps.items():
        dump["host"] = hosts[rank]
    result = analyze(dumps, world_size=8)
    (found,) = result.findings
    assert (found.kind, found.culprit_ranks, found.evidence) == ("straggler", [6], "host_clock")
    assert result.notes == []
    # without host information gloo clocks are never compared, and the report says so
    for dump in dumps.values():
        del dump["host"]
    result = analyze(dumps, world_size=8)
    assert result.findings == []
    assert result.notes == ["no straggler check in 1 group(s) (0): their dumps name no host and "
                            "carry no NCCL durations, so no two ranks' clocks can be compared "
                            "(--same-host if they come from one host)"]
    assert result.to_dict()["notes"] == result.notes
    assert analyze(dumps, same_host=True, world_size=8).notes == []
    # every rank on a host of its own (a cross-node group): --same-host would not help
    for rank, dump in dumps.items():
        dump["host"] = f"node{rank}"
    (note,) = analyze(dumps, world_size=8).notes
    assert "every rank is on a host of its own" in note and "--same-host" not in note
    # some name a host, some do not: --same-host may still pair the unnamed ones
    for rank, dump in dumps.items():
        if rank % 2:
            del dump["host"]
    (note,) = analyze(dumps, world_size=8).notes
    assert "--same-host" in note, note


@pytest.mark.parametrize("flavour", ["nccl", "gloo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_but_healthy_job_has_no_stragglers(flavour, seed):
    hosts = {r: "h0" for r in range(8)}
    job = FRJob(8, flavour=flavour, hosts=hosts, jitter_ms=4.0, seed=seed)
    job.group("1", [0, 1, 2, 3])
    job.group("2", [4, 5, 6, 7])
    # every rank does the same work (each is in one tp group) with exponential noise as large as
    # the delay the straggler tests detect; long tails make every rank last now and then
    job.repeat(150, [("0", "all_reduce", [[4096]]), ("1", "all_gather", [[64]]), ("2", "all_gather", [[64]])])
    assert analyze(job.dumps(), same_host=True).findings == []


def test_one_slow_collective_is_not_a_straggler():
    job = FRJob(4, jitter_ms=0.5)
    job.repeat(30, [("0", "all_reduce", [[4096]])])
    job.collective("0", "all_reduce", [[4096]], delay_ms={2: 500.0})
    job.repeat(30, [("0", "all_reduce", [[4096]])])
    assert analyze(job.dumps()).findings == []



# --- two groups: "who is late" has no majority (docs/analyze.md, Stragglers) -----------------
@pytest.mark.parametrize("seed", [0, 1, 4])
def test_two_healthy_groups_under_jittery_same_host_load_have_no_straggler(seed):
    # a 2 ms bias against a ~57 ms step: the second group is later a little more often than
    # not, which a coin-toss z-test (or "late" against the other rank's rate) calls significant
    result = analyze(loaded_pair_job(seed, bias_ms=2.0).dumps())
    assert result.findings == [] and result.lags == []


def test_a_persistent_lag_between_two_groups_is_a_lag_not_an_accusation():
    result = analyze(loaded_pair_job(0, bias_ms=10.0).dumps())
    assert result.findings == []
    (lag,) = result.lags
    assert (lag.kind, lag.culprit_ranks, lag.peers, lag.evidence) == ("lag", [1], [0], "host_clock")
    assert 7.0 < lag.median_wait_ms < 13.0 and lag.collectives == 200
    assert "no majority" in lag.detail
    assert lag.to_dict()["peers"] == [0]


def test_a_lag_behind_two_different_peers_is_a_straggler():
    """Replica groups of two ranks: rank 3 lags behind rank 1 (torchft's group for group rank 1)
    and behind rank 2 (its own replica group's process group): two peers agree."""
    job = FRJob(4, flavour="gloo", hosts={r: "h0" for r in range(4)}, replica_group_size=2,
                jitter_ms=2.0, compute_ms=30.0, seed=7)
    job.group("rg0", [0, 1])
    job.group("rg1", [2, 3])
    job.quorum(1, [0, 1])
    for _ in range(60):
        job.collective("rg0", "all_gather", [[64]])
        job.collective("rg1", "all_gather", [[64]], delay_ms={3: 8.0})
        job.ft_collective("all_reduce", [[4096]], delay_ms={3: 8.0})
    result = analyze(job.dumps())
    (found,) = result.findings
    assert (found.kind, found.culprit_ranks) == ("straggler", [3])
    assert len(found.groups) == 2 and "other evidence agrees" in found.detail
    assert [3] not in [f.culprit_ranks for f in result.lags]  # promoted, not also a lag


def test_a_lag_small_against_the_step_is_no_straggler():
    """3 ms late at every collective is a straggler at 20 ms a step, not at 200 ms a step."""
    for compute_ms, found in ((20.0, [[5]]), (200.0, [])):
        job = FRJob(8, jitter_ms=0.5, compute_ms=compute_ms, seed=1)
        job.repeat(40, [("0", "all_reduce", [[4096]])], delay_ms={5: 3.0})
        assert [f.culprit_ranks for f in analyze(job.dumps()).findings] == found, compute_ms


@pytest.mark.parametrize("shared", [False, True], ids=["own_groups", "one_group"])
@pytest.mark.parametrize("flavour", ["nccl", "gloo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_rank_late_into_one_of_three_collectives_is_a_straggler(flavour, seed, shared):
    """6 ms late into one of a step's three collectives: ~8 % of the ~72 ms step, ~25 % of the
    work before that collective. The wait is judged against the work before it, not against the
    group's own period (one collective per step on their own groups). Sharing one group, the
    rank is last at only ~40 % of its collectives: that collective's are judged on their own."""
    job = three_group_job(seed, flavour=flavour, shared=shared)
    (found,) = analyze(job.dumps(), same_host=True).findings
    assert (found.kind, found.culprit_ranks, found.pg) == ("straggler", [5], "0" if shared else "1")
    assert 4.5 < found.median_wait_ms < 7.5
    assert ("all_gather collectives" in found.detail) == shared, found.detail


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_rank_late_everywhere_and_most_into_one_collective_is_reported_by_that_one(seed):
    """3 ms late into every collective of its group and 9 ms into the all_gather: its group's
    whole tally and the all_gather's both flag it; the finding is one hit for the group, the
    one its peers waited longest in (the whole tally's median wait is ~4 ms)."""
    job = three_group_job(seed, shared=True, everywhere_ms=3.0)
    (found,) = analyze(job.dumps(), same_host=True).findings
    assert (found.culprit_ranks, found.groups) == ([5], ["0"]), found
    assert found.median_wait_ms > 7.5 and "all_gather collectives" in found.detail, found


@pytest.mark.parametrize("shared", [False, True], ids=["own_groups", "one_group"])
@pytest.mark.parametrize("flavour", ["nccl", "gloo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_three_collectives_with_jitter_only_have_no_straggler(flavour, seed, shared):
    job = three_group_job(seed, late_ms=0.0, flavour=flavour, shared=shared)
    result = analyze(job.dumps(), same_host=True)
    assert result.findings == [] and result.lags == []


def torchft_job() -> FRJob:
    """Replica groups of 2 ranks; quorum 3 = groups {0, 2}, quorum 4 = groups {0, 1, 2}."""
    job = FRJob(6, flavour="gloo", replica_group_size=2, seed=4)
    job.quorum(3, [0, 2])
    for _ in range(5):
        job.ft_collective("all_reduce", [[4096]])
    job.quorum(4, [0, 1, 2])
    return job


def test_torchft_incarnations_are_never_matched_across_quorums():
    job = torchft_job()
    for _ in range(4):
        job.ft_collective("all_reduce", [[2048]])  # different size than in quorum 3
    dumps = job.dumps()
    result = analyze(dumps)
    assert result.findings == []
    current = GroupKey("", None, 4, 0)
    assert result.last_seq[current] == {0: 4, 2: 4, 4: 4}
    assert GroupKey("", None, 3, 0) not in result.last_seq  # only the latest incarnation is current
    # without incarnation data the restarted '' group keeps only its newest run: still quiet
    for dump in dumps.values():
        del dump["incarnations"]
    assert analyze(dumps).findings == []


def test_torchft_mismatch_inside_a_quorum_is_found():
    job = torchft_job()
    job.ft_collective("all_reduce", [[2048]])
    job.ft_collective("all_reduce", [[2048]], rank_sizes={3: [[1024]]})
    (found,) = analyze(job.dumps()).findings
    assert (found.kind, found.group, found.seq, found.culprit_ranks) == ("mismatch", GroupKey("", None, 4, 1), 2, [3])
    assert found.to_dict()["quorum_id"] == 4 and found.to_dict()["group_rank"] == 1


def two_survivors(history: int, quorums: int = 1) -> FRJob:
    """3 single-rank groups, ``history`` good all_reduces per quorum, then rank 2's is larger."""
    job = FRJob(3, flavour="gloo", replica_group_size=1, seed=5)
    for q in range(quorums):
        job.quorum(3 + q, [0, 1, 2])
        for _ in range(history):
            job.ft_collective("all_reduce", [[1000]])
    job.ft_collective("all_reduce", [[1000]], rank_sizes={2: [[1001]]})
    return job


def test_mismatch_without_majority_names_the_rank_that_departs_from_its_own_history():
    dumps = two_survivors(history=10).dumps()
    del dumps[0]  # the mismatched all_reduce crashed gloo's neighbour: two dumps disagree
    (found,) = analyze(dumps).findings
    assert (found.kind, found.has_majority, found.culprit_ranks) == ("mismatch", False, [1, 2])
    assert found.departs_from_history == [2]
    assert found.to_dict()["departs_from_history"] == [2]
    assert "rank(s) 2 depart from their own history" in found.detail


def test_own_history_spans_the_torchft_incarnations_of_the_group():
    # the mismatch is the first collective of quorum 4: the history is quorum 3's
    dumps = two_survivors(history=0, quorums=1).dumps()
    del dumps[0]
    assert analyze(dumps).findings[0].departs_from_history == []  # no history: no evidence
    job = FRJob(3, flavour="gloo", replica_group_size=1, seed=5)
    job.quorum(3, [0, 1, 2])
    for _ in range(6):
        job.ft_collective("all_reduce", [[1000]])
    job.quorum(4, [0, 1, 2])
    job.ft_collective("all_reduce", [[1000]], rank_sizes={1: [[999]]})
    dumps = job.dumps()
    del dumps[2]
    (found,) = analyze(dumps).findings
    assert (found.group.quorum_id, found.has_majority, found.departs_from_history) == (4, False, [1])


def test_own_history_without_a_single_usual_variant_names_nobody():
    job = FRJob(3, flavour="gloo", replica_group_size=1, seed=5)
    job.quorum(3, [0, 1, 2])
    for size in [1000, 2000] * 4:  # two buffers, equally often
        job.ft_collective("all_reduce", [[size]])
    job.ft_collective("all_reduce", [[1000]], rank_sizes={2: [[2000]]})
    dumps = job.dumps()
    del dumps[0]
    (found,) = analyze(dumps).findings
    assert (found.has_majority, found.departs_from_history) == (False, [])


def test_mismatch_with_a_majority_needs_no_history():
    (found,) = analyze(two_survivors(history=10).dumps()).findings
    assert (found.has_majority, found.culprit_ranks, found.departs_from_history) == (True, [2], [])


def test_normalize_dumps_keeps_traces_and_reports_foreign_dumps():
    job = FRJob(3)
    job.repeat(3, [("0", "all_reduce", [[8]])])
    dumps = job.dumps()
    dumps[0] = normalize(dumps[0], 0)  # already normalized: taken as it is
    dumps[1] = {"entries": []}
    traces, errors = normalize_dumps(dumps)
    assert sorted(traces) == [0, 2] and traces[0] is dumps[0]
    assert [e["rank"] for e in errors] == [1] and "version" in errors[0]["error"]
    assert analyze(traces).findings == []


def test_torchft_hang_is_judged_from_the_latest_incarnation_only():
    job = torchft_job()
    job.ft_collective("all_reduce", [[2048]])
    job.ft_collective("all_reduce", [[2048]], group_ranks=[0], absent=[2])
    found = [f for f in analyze(job.dumps()).findings]
    assert [(f.kind, f.group, f.seq, f.culprit_ranks) for f in found] == [("hang", GroupKey("", None, 4, 0), 2, [2])]


def test_torchft_incarnation_without_pg_id_is_placed_by_record_id():
    job = torchft_job()
    job.ft_collective("all_reduce", [[2048]], rank_sizes={4: [[8]]})
    dumps = job.dumps()
    for dump in dumps.values():
        for inc in dump["incarnations"]:
            inc["pg_id"] = None
    (found,) = analyze(dumps).findings
    assert (found.kind, found.group.quorum_id, found.culprit_ranks) == ("mismatch", 4, [4])


def test_coalesced_collectives_compare_as_one():
    job = FRJob(3)
    job.repeat(3, [("0", "all_reduce", [[8]])])
    dumps = job.dumps()
    for rank, dump in dumps.items():
        tail = dict(dump["entries"][-1])
        # seq 4 is a coalesced group of two all_reduces; rank 1's second part is larger
        parts = []
        for i, size in enumerate([[8], [16] if rank != 1 else [32]]):
            part = dict(tail, record_id=tail["record_id"] + 1 + i, collective_seq_id=4, input_sizes=[size], output_sizes=[size])
            parts.append(part)
        parts.append(dict(tail, record_id=tail["record_id"] + 3, collective_seq_id=4, profiling_name="nccl:coalesced", input_sizes=[], output_sizes=[]))
        dump["entries"].extend(parts)
    (found,) = analyze(dumps).findings
    assert (found.kind, found.seq, found.op, found.mismatch, found.culprit_ranks) == ("mismatch", 4, "coalesced", "size", [1])


def test_p2p_entries_are_ignored():
    job = FRJob(2)
    job.repeat(3, [("0", "all_reduce", [[8]])])
    dumps = job.dumps()
    send = dict(dumps[0]["entries"][-1], profiling_name="nccl:send 0->1", is_p2p=True, collective_seq_id=3, p2p_seq_id=1, record_id=99)
    dumps[0]["entries"].append(send)
    result = analyze(dumps)
    assert result.findings == []


@pytest.mark.parametrize(
    "bad",
    [
        [],
        {"entries": []},
        {"version": "3.0", "entries": []},
        {"version": "2.10", "entries": "nope"},
        {"version": "2.10", "entries": [{"unrelated": 1}]},
        {"version": "2.10", "entries": [{"process_group": ["0", ""], "profiling_name": "nccl:all_reduce", "record_id": 0, "collective_seq_id": "x"}]},
    ],
)
def test_foreign_dumps_are_errors_and_the_rest_is_still_analyzed(bad):
    with pytest.raises(DumpFormatError):
        normalize(bad, 1)
    job = FRJob(3)
    job.repeat(3, [("0", "all_reduce", [[8]])])
    job.collective("0", "all_reduce", [[8]], absent=[2])
    dumps = job.dumps()
    dumps[1] = bad
    result = analyze(dumps)
    assert result.ranks == [0, 2]
    assert [e["rank"] for e in result.errors] == [1]
    assert result.unknown_ranks == [1]
    assert [(f.kind, f.culprit_ranks) for f in result.findings] == [("hang", [2])]


@pytest.mark.parametrize("version", ["2.4", "2.7", "2.10"])
def test_older_versions_without_optional_keys_are_read(version):
    job = FRJob(3, version=version)
    job.repeat(4, [("0", "all_reduce", [[8]])])
    job.collective("0", "all_reduce", [[8]], dtypes={0: "Half"})
    dumps = job.dumps()
    for dump in dumps.values():
        for e in dump["entries"]:
            for key in ("thread_name", "thread_id", "duration_ms", "is_p2p", "timeout_ms"):
                e.pop(key, None)
    (found,) = analyze(dumps).findings
    assert (found.mismatch, found.culprit_ranks) == ("dtype", [0])


@pytest.mark.parametrize(("field", "majority", "odd", "kind"), [
    # an all_gather_into_tensor apart only in its output: [8, 4] on two ranks, [16, 4] on one
    ("output_sizes", "_all_gather_base [[4, 4]] -> [[8, 4]] Float",
     "_all_gather_base [[4, 4]] -> [[16, 4]] Float", "size"),
    # a dtype swap: the set of dtypes is the same on both sides
    ("dtypes", "_all_gather_base [[4, 4]] -> [[8, 4]] BFloat16 -> Float",
     "_all_gather_base [[4, 4]] -> [[8, 4]] Float -> BFloat16", "dtype"),
])
def test_a_mismatch_detail_shows_what_tells_its_variants_apart(tmp_path, capsys, field, majority, odd,
                                                              kind):
    job = FRJob(3)
    job.repeat(3, [("0", "all_reduce", [[8]])])
    job.collective("0", "_all_gather_base", [[4, 4]])
    dumps = job.dumps(fmt="pickle")
    for rank, dump in dumps.items():
        e = dump["entries"][-1]
        e["output_sizes"] = [[16, 4]] if field == "output_sizes" and rank == 2 else [[8, 4]]
        if field == "dtypes":
            e["input_dtypes"], e["output_dtypes"] = (["Float"], ["BFloat16"]) if rank == 2 else \
                (["BFloat16"], ["Float"])
    write_dumps(dumps, tmp_path, fmt="pickle")
    assert main(["analyze", "--format", "json", str(tmp_path)]) == 1
    (found,) = json.loads(capsys.readouterr().out)["findings"]
    assert f"rank(s) 2 enqueued {odd} while 2 rank(s) enqueued {majority} ({kind} mismatch)" \
        in found["detail"], found["detail"]
