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
