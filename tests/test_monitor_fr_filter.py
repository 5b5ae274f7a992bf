"""The monitor asks ranks for the newest entries of their Flight Recorder only
(``/v1/fr_trace?last=N``, monitor.polling.FR_LAST), so a drill-down fetches kilobytes.

That is only sound if the analysis engine reaches the same verdicts on cut dumps as on whole
ones: here the detector scenarios of tests/test_monitor_detectors.py (gloo dumps from
tests/support/frgen.py: an in-group hang, a cross-group hang, mismatches attributed by
majority, by own history and by the step pattern) run again with every dump cut by the
WorkerServer's own filter, at FR_LAST and at 64 entries (the fewest at which every verdict
still holds: at 32 the step-pattern attribution no longer names the rank), and must give the
same findings; the cross-group ones also from torchft's group alone (``pg=torchft``, what the
leaders of undrilled groups are asked for) at FR_LAST_LEADERS and 16 entries. Then the fallback: a rank whose server refuses the filter (400) is asked for
its whole dump; one that does not know it (older server, query ignored) sends it anyway.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import pytest

import tests.test_monitor_detectors as scenarios
from monitor.analysis import analyze
from monitor.config import MonitorConfig
from monitor.evidence.torch_rank import adapted_dump
from monitor.evidence.view import ViewBuilder
from monitor.polling import FR_LAST, FR_LAST_LEADERS
from monitor.service import Monitor
from rank_wire.recorders import merge
from tests.support.fake_rank import FakeRank
from tests.support.frgen import FRJob
from tests.support.monitor_sim import SimRanks, rank_state
from tests.test_analysis_foreign_dumps import as_served, hangs, torch_ids
from worker_server.app import filter_fr_dump

SCENARIOS = [
    "test_in_group_hang_names_the_rank_that_never_entered_the_collective",
    "test_cross_group_hang_of_single_rank_groups_names_the_missing_group",
    "test_mismatch_attributed_to_the_minority",
    "test_mismatch_between_two_survivors_uses_own_history",
    "test_in_group_mismatch_of_two_ranks_is_attributed_by_the_step_pattern",
]


# leaders of undrilled groups are asked for torchft's cross-group group only: the scenarios
# judged on it (groups of one rank: every rank a leader)
CROSS = [n for n in SCENARIOS if "cross_group" in n or "mismatch_attributed_to_the_minority" in n
         or "own_history" in n]
CUTS = [(n, None, last) for n in SCENARIOS for last in (FR_LAST, 64)] + \
    [(n, "torchft", last) for n in CROSS for last in (FR_LAST_LEADERS, 16)]


@pytest.mark.parametrize(("name", "pg", "last"), CUTS)
def test_the_same_verdicts_from_cut_dumps(monkeypatch, name, pg, last):
    whole = scenarios.Job.dumps
    cut = {"dumps": 0, "shorter": 0, "bytes": 0, "whole_bytes": 0}

    def dumps(self):
        out = {}
        for r, d in whole(self).items():
            body = json.dumps(d).encode()
            doc = json.loads(filter_fr_dump(body, pg, last))
            cut["dumps"] += 1
            cut["shorter"] += doc["filter"]["entries_total"] > len(doc["entries"])
            cut["whole_bytes"] += len(body)
            cut["bytes"] += len(json.dumps(doc))
            out[r] = doc
        return out

    monkeypatch.setattr(scenarios.Job, "dumps", dumps)
    getattr(scenarios, name)()  # its own assertions: the exact findings, culprits, evidence
    assert cut["dumps"] > 0
    if (last == 64 and "in_group" in name) or (last == 16 and "cross_group" in name):  # cut
        assert cut["shorter"] > 0 and cut["bytes"] < cut["whole_bytes"]


@pytest.mark.parametrize("recorder", ["gloo", "reset", "reset, nothing since"])
def test_a_late_leader_is_named_from_torchfts_group_alone(recorder):
    """Replica group 1's leader joined quorum 2 but never enters its cross-group all_reduce. Its
    ``?pg=torchft`` answer keeps no entry that completed, though pg_status counts its inner NCCL
    group's: the cross-group group is on gloo (never completed), or NCCL's recorder was reset at
    the quorum change (and held nothing since). None is onlyActive: it enqueued none of quorum 2's."""
    job = FRJob(4, replica_group_size=2)
    job.group("a0", [0, 1])
    job.group("a1", [2, 3])
    job.quorum(1, [0, 1])
    job.repeat(4, [("a0", "all_reduce", [[8]]), ("a1", "all_reduce", [[8]])])
    for _ in range(4):
        job.ft_collective()
    job.quorum(2, [0, 1])
    before = {r: len(d["entries"]) for r, d in job.dumps().items()}
    job.collective("a0")
    job.collective("a1")
    job.ft_collective(absent=[2, 3])
    leaders = {}
    for r, d in job.dumps(ranks=[0, 2]).items():
        if recorder != "gloo":
            d["entries"] = [dict(e, record_id=i + 1) for i, e in enumerate(d["entries"][before[r]:])
                            if r == 0 or recorder == "reset"]
        else:
            for e in d["entries"]:
                if e["process_group"][0] == "":
                    e.update(state="scheduled", time_discovered_started_ns=0, time_discovered_completed_ns=0)
        leaders[r] = json.loads(filter_fr_dump(json.dumps(d).encode(), "torchft", FR_LAST_LEADERS))
    found = {(f.group.quorum_id, f.group.group_rank): (f.seq, f.culprit_ranks, f.waiting_ranks)
             for f in analyze(leaders).findings if f.kind == "hang"}
    assert found == {(2, 0): (1, [2], [0])}


def test_a_torch_only_dump_cut_to_its_newest_entries_is_not_read_as_only_active():
    # rank 1 waits in "2" (rank 2 never came) with "1"'s seq 6 queued behind, and its CPU ran on
    # in "2": the newest FR_LAST entries adapted_dump keeps are unfinished ones of "2"
    job = FRJob(3)
    job.group("1", [0, 1])
    job.group("2", [1, 2])
    job.repeat(5, [("1", "all_reduce", [[8]]), ("2", "all_reduce", [[8]])])
    job.collective("2", absent=[2])
    job.collective("1", complete=False)
    for _ in range(FR_LAST + 20):
        job.collective("2", absent=[2])
    dumps = {r: adapted_dump(d, {"rank": r, "replica_group": None, "group_rank": r, "group_world_size": 3},
                             None, 1.8e9) for r, d in torch_ids(job.dumps()).items()}
    assert hangs(analyze(dumps)) == {"2": (6, [2], [1])}


@pytest.mark.parametrize("flavour", ["gloo", "nccl"])
def test_a_torch_only_rank_stuck_before_its_first_collective_is_named(flavour):
    """gloo lists its groups as one '' pg_config entry, which adapted_dump leaves out as
    torchft's: the rank's recorder was on all the same, so holding no entry it enqueued none."""
    job = FRJob(3, flavour=flavour)
    job.collective("0", "all_reduce", [[8]], absent=[1])
    dumps = {r: adapted_dump(d, {"rank": r, "replica_group": None, "group_rank": r, "group_world_size": 3},
                             None, 1.8e9) for r, d in job.dumps().items()}
    [hang] = [f for f in analyze(dumps).findings if f.kind == "hang"]
    assert (hang.culprit_ranks, hang.waiting_ranks) == ([1], [0, 2])


@pytest.mark.parametrize("query", [{"last": str(FR_LAST)}, {}])
def test_a_rank_whose_recorder_was_reset_is_no_evidence(query):
    # torchft resets NCCL's recorder at a quorum change, unfinished entries too (torch's
    # reset_all: a new epoch): rank 1 answers no entry at all (pg_status keeps its counts), stuck
    # before its first collective since, or past the reset with seq 6 enqueued: which, no dump
    # says. Rank 0 waits in "1"'s seq 6; ranks 2 and 3, another replica group, have theirs in
    # flight: no dump keeps an entry completed since the reset. Named once, an innocent rank
    # whose reset landed after it enqueued was named too; so was it from a whole dump (no
    # query, so no filter: an incident bundle's fetch), read as onlyActive by its shape.
    job = FRJob(4)
    job.group("1", [0, 1])
    job.group("2", [2, 3])
    job.repeat(5, [("1", "all_reduce", [[8]]), ("2", "all_reduce", [[8]])])
    before = {r: len(d["entries"]) for r, d in job.dumps().items()}
    job.collective("2", complete=False)
    job.collective("1", absent=[1])
    dumps = {}
    for r, d in torch_ids(job.dumps()).items():
        d["entries"] = [dict(e, record_id=i) for i, e in enumerate(d["entries"][before[r]:])]
        dumps[r] = as_served(r, merge(None, d), **query)
    assert ("filter" in dumps[1]) == bool(query)
    assert hangs(analyze(dumps)) == {}


def test_a_rank_that_refuses_the_filter_is_asked_for_its_whole_dump():
    """Each look: its quick 400 says nothing of how long its whole dump takes (1.3 s here, past
    the 1 s a fetch of quick answers waits): that one is given the whole ``--fr-timeout``."""
    job = scenarios.Job(groups=2, ranks=1)
    job.steps(5)
    dumps = job.dumps()

    def refusing(path):  # a stricter or proxied server: 400 to any query
        if "?" in path:
            return 400, {"error": "unknown parameter"}
        if path != "/v1/state":
            time.sleep(1.3)  # how long its whole dump takes to make (a big one)
            return 200, dumps[0]
        return None

    strict = FakeRank(rank_state(0, 0, participants=2), get=refusing)
    sim = SimRanks.start(1)  # an older server: the query is ignored
    try:
        sim.ranks[0].update(**rank_state(1, 1, participants=2))
        sim.ranks[0].fr = dumps[1]
        urls = [strict.url, sim.ranks[0].url]
        with tempfile.TemporaryDirectory() as d:
            mon = Monitor(MonitorConfig(port=0, targets=urls, state_path=os.path.join(d, "m.db")))
            try:
                targets = mon.discovery.targets()
                view = ViewBuilder().update(targets, mon.polling.poller.sweep(urls))
                for r in view.ranks.values():
                    r.trust = type("T", (), {"evidence": True})()
                first = mon.polling.fr_dumps(view, 100.0)  # the periodic look is due
                got = mon.polling.fr_dumps(view, 200.0)  # and again, the 400 known quick
            finally:
                mon.stop()
    finally:
        strict.stop()
        sim.stop()
    assert sorted(first) == sorted(got) == [0, 1]
    assert len(got[0]["entries"]) == len(dumps[0]["entries"])  # the whole dump, after the 400
    assert strict.gets.count("/v1/fr_trace") == 2
    assert f"/v1/fr_trace?last={FR_LAST}" in strict.gets


def test_with_leader_polling_the_first_sweep_asks_leaders_only_for_flight_recorder():
    """The first sweep polls every rank; its Flight Recorder look still goes to the leaders
    (group rank 0) only, for torchft's group only: at 100,000 ranks a dump from every rank
    at once was gigabytes."""
    job = scenarios.Job(groups=2, ranks=1)
    job.steps(3)
    sim = SimRanks.start(8, groups=2)  # group g: ranks g, g + 2, ...; group rank r // 2
    asked: list[tuple[str, str]] = []
    try:
        for r in sim.ranks:
            r.fr = job.dumps()[0]
        with tempfile.TemporaryDirectory() as d:
            mon = Monitor(MonitorConfig(port=0, targets=sim.urls, leader_polling="on",
                                        state_path=os.path.join(d, "m.db")))
            sweep = mon.polling.poller.sweep

            def spy(urls, path="/v1/state", *a, **k):
                urls = list(urls)
                asked.extend((u, path) for u in urls)
                return sweep(urls, path, *a, **k)

            mon.polling.poller.sweep = spy
            try:
                view = mon.sweep_once()
            finally:
                mon.stop()
    finally:
        sim.stop()
    fr = {(u, p) for u, p in asked if p.startswith("/v1/fr_trace")}
    leaders = {r.url for r in view.ranks.values() if r.state["group_rank"] == 0}
    assert len(leaders) == 2 and len([p for u, p in asked if p == "/v1/state"]) == 8
    assert fr == {(u, f"/v1/fr_trace?pg=torchft&last={FR_LAST_LEADERS}") for u in leaders}
