"""A mismatch between two ranks, no majority: which one departs from its own history, and
what the incident bundle's verdict says of a monitor that named it; a dump missing a field
the comparison needs is an error, not a blamed rank."""

from __future__ import annotations

import pickle

import pytest

from monitor.analysis import analyze, loader
from monitor.analysis.bundle import FORMAT, monitor_verdict
from tests.support.frgen import FRJob

# FSDP's step in one replica group: one all-gather size four times, another once
FSDP_STEP = [("0", "all_gather", [[24992]])] * 4 + [("0", "all_gather", [[17536]])]


def two_rank_mismatch(**culprit) -> dict[int, dict]:
    job = FRJob(2, seed=7)
    job.repeat(20, FSDP_STEP)
    for pg, op, sizes in FSDP_STEP[:4]:
        job.collective(pg, op, sizes)
    job.collective("0", "all_gather", [[17536]], **culprit)  # rank 1 breaks the step here
    return job.dumps()


@pytest.mark.parametrize("culprit", [{"dtypes": {1: "Int"}}, {"rank_sizes": {1: [[17537]]}}])
def test_the_rank_with_a_variant_new_to_it_departs_not_its_peer_with_a_rarer_one(culprit):
    (found,) = analyze(two_rank_mismatch(**culprit)).findings
    assert (found.kind, found.has_majority, found.culprit_ranks) == ("mismatch", False, [0, 1])
    # rank 0's [[17536]] Float is its less common gather, yet one it issues every step
    assert found.departs_from_history == [1]
    assert "rank(s) 1 depart from their own history" in found.detail


def test_a_culprit_repeating_its_fault_still_departs():
    job = FRJob(2, seed=7)
    job.repeat(20, FSDP_STEP)
    job.repeat(3, FSDP_STEP, dtypes={1: "Int"})  # every collective from here on differs
    (found,) = analyze(job.dumps()).findings
    assert (found.has_majority, found.departs_from_history, found.later_mismatches) == (False, [1], 14)


def test_a_swap_of_two_variants_it_knows_is_not_told_apart():
    # rank 1 gathers its step's second size first: both variants are in both ranks' history
    job = FRJob(2, seed=7)
    job.repeat(20, FSDP_STEP)
    job.collective("0", "all_gather", [[24992]], rank_sizes={1: [[17536]]})
    (found,) = analyze(job.dumps()).findings
    assert (found.has_majority, found.departs_from_history) == (False, [])


def manifest(named: list[int]) -> dict:
    return {"format": FORMAT, "id": "inc-1", "trigger": "evict", "kind": "mismatch",
            "replica_group": 0, "culprit_ranks": named, "ranks": [], "left_out": []}


def test_the_bundle_verdict_agrees_with_a_monitor_that_named_the_departing_rank():
    findings = analyze(two_rank_mismatch(dtypes={1: "Int"})).to_dict()["findings"]
    assert monitor_verdict(manifest([1]), findings)["analysis_agrees"] is True
    assert monitor_verdict(manifest([0]), findings)["analysis_agrees"] is False
    # the monitor's order: the step pattern first, else its own history
    findings[0]["departs_from_step_pattern"] = [0]
    assert monitor_verdict(manifest([0]), findings)["analysis_agrees"] is True
    findings[0]["departs_from_step_pattern"] = []
    assert monitor_verdict(manifest([1]), findings)["analysis_agrees"] is True
    # nothing departs: the participants are the analysis's culprits, as before
    findings[0]["departs_from_history"] = []
    assert monitor_verdict(manifest([1]), findings)["analysis_agrees"] is False
    assert monitor_verdict(manifest([0, 1]), findings)["analysis_agrees"] is True


@pytest.mark.parametrize("field", ["input_sizes", "output_sizes", "input_dtypes", "output_dtypes"])
@pytest.mark.parametrize("pure", ["", "1"])  # the C reader, then Python's
def test_a_missing_signature_field_is_an_error_for_that_file_not_a_mismatch(tmp_path, monkeypatch, field, pure):
    job = FRJob(4, seed=3)
    job.repeat(10, [("0", "all_reduce", [[1024]])])
    dumps = job.dumps(fmt="pickle")
    del dumps[1]["entries"][6][field]
    for rank, dump in dumps.items():
        (tmp_path / f"rank{rank}").write_bytes(pickle.dumps(dump, protocol=2))
    monkeypatch.setenv(loader.PURE_PYTHON_ENV, pure)
    loaded = loader.load_paths([tmp_path], jobs=1)
    assert loaded.pickle_reader == ("python" if pure else "c")
    assert loaded.errors == [{"path": str(tmp_path / "rank1"),
                              "error": f"entry 6 (record_id 6) has no {field!r} field"}]
    result = analyze(loaded.traces)
    assert (result.ranks, [f.kind for f in result.findings]) == ([0, 2, 3], [])


def test_one_or_two_collectives_of_history_name_nobody():
    # the step's third gather: rank 0 issues it, rank 1 goes back to the first; neither has seen
    # a step whole, so rank 0's "new" size is no evidence against it
    job = FRJob(2, seed=7)
    job.collective("0", "all_gather", [[100]])
    job.collective("0", "all_gather", [[200]])
    job.collective("0", "all_gather", [[300]], rank_sizes={1: [[100]]})
    (found,) = analyze(job.dumps()).findings
    assert (found.has_majority, found.departs_from_history) == (False, [])
    assert found.departs_from_step_pattern == []


# the first step of a job: one gather size over a step's first layers, then another
FIRST_STEPS = [FSDP_STEP[:4], [("0", "all_gather", [[100]]), ("0", "all_gather", [[200]])] * 3]


def first_step_mismatch(first: list, steps: int = 0) -> dict[int, dict]:
    """``steps`` whole steps of ``first`` plus the next collective, then rank 0 issues the
    step's next collective (a size new to it) while rank 1 repeats the step's first."""
    job = FRJob(2, seed=7)
    step = [*first, ("0", "all_gather", [[17536]])]
    job.repeat(steps, step)
    for pg, op, sizes in first:
        job.collective(pg, op, sizes)
    job.collective("0", "all_gather", [[17536]], rank_sizes={1: first[0][2]})
    return job.dumps()


@pytest.mark.parametrize("first", FIRST_STEPS)
def test_a_mismatch_inside_the_first_step_names_nobody(first):
    # what came before repeats, but no step was seen whole: rank 0's new size may be its step's
    # next collective, and rank 1 the one that went wrong
    (found,) = analyze(first_step_mismatch(first)).findings
    assert (found.has_majority, found.culprit_ranks) == (False, [0, 1])
    assert (found.departs_from_step_pattern, found.departs_from_history) == ([], [])
    assert "break their own" not in found.detail and "depart from" not in found.detail


@pytest.mark.parametrize("first", FIRST_STEPS)
def test_the_same_fault_after_three_whole_steps_names_the_rank_that_broke_the_step(first):
    (found,) = analyze(first_step_mismatch(first, steps=3)).findings
    assert (found.has_majority, found.departs_from_step_pattern) == (False, [1])


# FSDP's step with its reduce-scatter: rank 1 issues another op where its peer gathers
STEP_RS = [*FSDP_STEP, ("0", "reduce_scatter", [[24992]])]


@pytest.mark.parametrize("culprit", [{"ops": {1: "reduce_scatter"}, "rank_sizes": {1: [[24992]]}},
                                     {"ops": {1: "broadcast"}}])
def test_the_bundle_verdict_agrees_with_a_monitor_that_named_the_rank_by_its_step_pattern(culprit):
    job = FRJob(2, seed=7)
    job.repeat(20, STEP_RS)
    for pg, op, sizes in STEP_RS[:4]:
        job.collective(pg, op, sizes)
    job.collective("0", "all_gather", [[17536]], **culprit)
    findings = analyze(job.dumps()).to_dict()["findings"]
    assert monitor_verdict(manifest([1]), findings)["analysis_agrees"] is True
    assert monitor_verdict(manifest([0]), findings)["analysis_agrees"] is False
    (found,) = findings
    # the monitor's first rule; its own history cannot tell (both ops are in both histories)
    assert (found["departs_from_step_pattern"], found["departs_from_history"]) == ([1], [])
    assert "rank(s) 1 break their own per-step pattern" in found["detail"]


def torchft_job(steps: int) -> FRJob:
    """Two replica groups of one rank on torchft's gloo group: ``steps`` good steps of two
    all-reduces in quorum 1."""
    job = FRJob(2, seed=7, flavour="gloo", replica_group_size=1)
    job.quorum(1, [0, 1])
    for _ in range(steps):
        job.ft_collective("all_reduce", [[1024]])
        job.ft_collective("all_reduce", [[512]])
    return job


def test_a_culprit_repeating_its_fault_after_a_quorum_change_departs_in_both():
    job = torchft_job(20)
    job.ft_collective("all_reduce", [[1024]], dtypes={1: "Int"})
    job.quorum(2, [0, 1])
    for _ in range(3):
        job.ft_collective("all_reduce", [[1024]])
        job.ft_collective("all_reduce", [[512]])
    job.ft_collective("all_reduce", [[1024]], dtypes={1: "Int"})
    found = analyze(job.dumps()).findings
    # each incarnation's disagreement is not the other's history
    assert [(f.group.quorum_id, f.has_majority, f.departs_from_history) for f in found] == \
        [(1, False, [1]), (2, False, [1])]


# torchft's group: '' on gloo; named per quorum on NCCL, in 0.2 and in nightly
NAMES = [None, "torchft_quorum_{q}_rank_{r}", "torchft_{q}_rank_{r}"]


def named(dumps: dict[int, dict], name: str | None) -> dict[int, dict]:
    """``dumps`` with torchft's group named ``name`` per quorum, as torchft names its NCCL group."""
    if name is None:
        return dumps
    for d in dumps.values():
        names = {}
        for inc in d["incarnations"]:
            inc["pg_name"] = names[inc["pg_id"]] = name.format(q=inc["quorum_id"], r=inc["group_rank"])
        for e in d["entries"]:
            if e.get("pg_id") in names:
                e["process_group"] = [names[e["pg_id"]], e["process_group"][1]]
    return dumps


@pytest.mark.parametrize("name", NAMES)
def test_own_history_spans_the_incarnations_of_torchft_groups_named_per_quorum(name):
    job = torchft_job(20)
    job.quorum(2, [0, 1])
    job.ft_collective("all_reduce", [[1024]])
    job.ft_collective("all_reduce", [[512]], dtypes={1: "Int"})
    (found,) = analyze(named(job.dumps(), name)).findings
    assert (found.group.quorum_id, found.departs_from_history) == (2, [1])


@pytest.mark.parametrize("name", NAMES)
def test_a_collective_abandoned_at_a_quorum_change_is_no_hang_whatever_the_group_name(name):
    job = FRJob(2, seed=7, flavour="gloo", replica_group_size=1)
    job.quorum(1, [0, 1])
    for _ in range(20):
        job.ft_collective("all_reduce", [[1024]])
    job.ft_collective("all_reduce", [[1024]], absent=[1])  # aborted by the quorum change
    job.quorum(2, [0, 1])
    for _ in range(20):
        job.ft_collective("all_reduce", [[1024]])
    result = analyze(named(job.dumps(), name))
    assert result.findings == []
    assert [k.quorum_id for k in result.last_seq] == [2]
