"""Dumps as torch writes them, not as the WorkerServer does: pg_status keyed by a per-process
pg id (only groups that recorded an entry), onlyActive dumps of a TP x DP job and dumps that only
look so (cut by ?last=, without entries; the server's whole ones, which say it), a rank blocked in
one hang blamed for another, ranks with their recorder off, odd pg_status counts and a JSON file
with a byte order mark."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from lightkeeper.cli import main
from monitor.analysis import GroupKey, analyze
from monitor.analysis.engine import NOTHING_KEPT
from monitor.polling import FR_LAST_LEADERS
from tests.support.frgen import FRJob, write_dumps
from worker_server import flight_recorder
from worker_server.endpoints import filter_fr_dump, fr_trace_body


def torch_ids(dumps: dict[int, dict]) -> dict[int, dict]:
    """torch numbers a process's groups in the order it built them: pg_status keys and entries'
    pg_id are those numbers, not pg_config's names (rank 3 of a TP x DP job: {0,1,2} vs 0,2,4)."""
    for d in dumps.values():
        uid = {name: i for i, name in enumerate(d["pg_config"])}
        d["pg_status"] = {str(uid[k]): v for k, v in d["pg_status"].items()}
        for e in d["entries"]:
            e["pg_id"] = uid[e["process_group"][0]]
    return dumps


def only_active(dumps: dict[int, dict]) -> dict[int, dict]:
    for d in dumps.values():
        d["entries"] = [e for e in d["entries"] if e["state"] != "completed"]
    return dumps


def as_served(rank: int, dump: dict, **args: str) -> dict:
    """torch's ``dump`` as rank ``rank``'s WorkerServer answers ``/v1/fr_trace?<args>``."""
    who = SimpleNamespace(identity=SimpleNamespace(rank=rank, replica_group=None, group_rank=rank,
                                                   group_world_size=None, host="h", job="j"), replica_id=None)

    def torch_dump(only_active: bool = False) -> bytes:  # onlyActive: its unfinished entries
        kept = [e for e in dump.get("entries", []) if not only_active or e["state"] != "completed"]
        return json.dumps(dict(dump, entries=kept)).encode()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flight_recorder, "raw_dump_json", torch_dump)
        return json.loads(fr_trace_body(who, None, args))


def tp_dp_job(ahead: int = 1) -> dict[int, dict]:
    """TP 2 x DP 2 ("1" {0,1}, "2" {2,3}, "3" {0,2}, "4" {1,3}): rank 3 is stuck in compute
    before its TP all_reduce; rank 2 waits in it (``ahead``: TP collectives it enqueued past
    rank 3), rank 0 waits for rank 2 in DP, rank 1 for 3."""
    job = FRJob(4)
    for name, ranks in (("1", [0, 1]), ("2", [2, 3]), ("3", [0, 2]), ("4", [1, 3])):
        job.group(name, ranks)
    job.collective("0", "barrier")
    for _ in range(4):
        for g in ("1", "2", "3", "4"):
            job.collective(g)
    job.collective("1")
    for _ in range(ahead):
        job.collective("2", absent=[3])
    job.collective("3", absent=[2])
    job.collective("4", absent=[3])
    return torch_ids(job.dumps())


def hangs(result: Any) -> dict[str, tuple]:
    return {f.group.pg: (f.seq, f.culprit_ranks, f.waiting_ranks) for f in result.findings if f.kind == "hang"}


@pytest.mark.parametrize("ahead", [1, 2])
def test_a_rank_blocked_in_another_hang_is_no_culprit(ahead):
    result = analyze(tp_dp_job(ahead))
    # rank 2 never enqueued DP seq 5 because it waits in TP seq 5 for rank 3: its newest entry
    # is that one, or a later one its CPU enqueued before it blocked (NCCL runs ahead)
    assert hangs(result) == {"2": (5, [3], [2]), "3": (5, [], [0]), "4": (5, [3], [1])}
    [dp] = [f for f in result.findings if f.group == GroupKey("3")]
    assert dp.to_dict()["blocked_by"] == {"2": {"pg": "2", "replica_group": None, "quorum_id": None,
                                                "group_rank": None, "seq": 5}}
    assert "blocked" in dp.detail


def test_ranks_blocking_each_other_stay_culprits():
    # a deadlock: rank 0 waits in group 1 for rank 1, which waits in group 2 for rank 0
    job = FRJob(2)
    job.group("1", [0, 1])
    job.group("2", [0, 1])
    job.repeat(3, [("1", "all_reduce", [[8]]), ("2", "all_reduce", [[8]])])
    job.collective("1", absent=[1])
    job.collective("2", absent=[0])
    result = analyze(job.dumps())
    assert hangs(result) == {"1": (4, [1], [0]), "2": (4, [0], [1])}
    assert all(not f.to_dict()["blocked_by"] for f in result.findings)


def test_an_only_active_tp_dp_hang_is_found(tmp_path, capsys):
    # every pg_status count is dropped (its keys are no group names): a member without an entry of
    # the group finished all it enqueued there, so it never enqueued what a waiting rank holds
    write_dumps(only_active(tp_dp_job()), tmp_path)
    code = main(["analyze", "--format", "json", "--jobs", "1", str(tmp_path)])
    report = json.loads(capsys.readouterr().out)
    assert {f["pg"]: (f["seq"], f["culprit_ranks"], f["waiting_ranks"]) for f in report["findings"]} == \
        {"2": (5, [3], [2]), "3": (5, [], [0]), "4": (5, [3], [1])}
    assert code == 1


def test_an_only_active_hang_in_a_job_with_an_unused_group_is_found():
    # torch keys pg_status only by groups that recorded an entry: an unused mesh dimension's
    # group is in pg_config but not in pg_status
    job = FRJob(3)
    job.group("1", [0, 1, 2], desc="unused_mesh_dim")
    job.repeat(5, [("0", "all_reduce", [[8]])])
    job.collective("0", absent=[2])
    result = analyze(only_active(torch_ids(job.dumps())))
    assert hangs(result) == {"0": (6, [2], [0, 1])}


def test_a_dump_filtered_to_other_groups_is_not_read_as_only_active():
    dumps = only_active(tp_dp_job())
    dumps[3]["filter"] = {"pg": "4", "last": 64, "entries_total": 0, "only_active": True}
    result = analyze(dumps)
    assert 3 not in hangs(result).get("2", (None, []))[1]
    assert hangs(result)["4"] == (5, [3], [1])


def test_a_worker_servers_fetch_says_whether_it_is_only_active():
    # ?onlyactive=true&last=N: the filter says torch dumped it so; without the flag (an older
    # server) the dumps are read as whole ones: rank 2's as one whose buffer wrapped, no word on
    # DP ("3"), and stuck rank 3's, with no entry, as a recorder reset: no word at all
    who = SimpleNamespace(identity=SimpleNamespace(rank=0, replica_group=None, group_rank=0, group_world_size=1,
                                                   host="h", job="j"), replica_id=None)

    def fetch(dump: dict, **args: str) -> dict:
        return json.loads(fr_trace_body(who, None, args, lambda *_, only_active: json.dumps(dump).encode()))

    asked = {r: fetch(d, onlyactive="true", last="64") for r, d in only_active(tp_dp_job()).items()}
    assert asked[3]["filter"]["only_active"] is True
    assert hangs(analyze(asked)) == {"2": (5, [3], [2]), "3": (5, [], [0]), "4": (5, [3], [1])}
    plain = {r: fetch(d, last="64") for r, d in only_active(tp_dp_job()).items()}
    assert "only_active" not in plain[3]["filter"]
    assert hangs(analyze(plain)) == {}


def test_an_unfiltered_worker_server_dump_says_whether_it_is_only_active():
    # no ?pg= nor ?last= (an incident bundle's fetch, a curl): no filter, but incarnations (the
    # server always adds them): whole unless the server says torch was asked for onlyActive
    whole = {r: as_served(r, d) for r, d in tp_dp_job().items()}
    asked = {r: as_served(r, d, onlyactive="true") for r, d in tp_dp_job().items()}
    assert "filter" not in asked[3] and asked[3]["only_active"] is True and "only_active" not in whole[3]
    assert not any(e["state"] == "completed" for d in asked.values() for e in d.get("entries", []))
    for dumps in (whole, asked):
        assert hangs(analyze(dumps)) == {"2": (5, [3], [2]), "3": (5, [], [0]), "4": (5, [3], [1])}


def test_torchfts_cross_group_groups_are_not_read_as_only_active():
    # torch's own dumps (no incarnations) of torchft 0.2's per-group-rank groups list them by
    # replica rank ([0, 1]): rank 1 only seems a member of torchft_quorum_2_rank_0
    f0, f1 = "torchft_quorum_2_rank_0", "torchft_quorum_2_rank_1"
    job = FRJob(4)
    for name, ranks in (("a0", [0, 1]), ("a1", [2, 3]), (f0, [0, 2]), (f1, [1, 3])):
        job.group(name, ranks)
    job.repeat(3, [(g, "all_reduce", [[8]]) for g in ("a0", "a1", f0, f1)])
    job.collective("a0")
    job.collective("a1")
    job.collective(f0, absent=[2])
    job.collective(f1, absent=[3])
    job.collective("a0", complete=False)
    dumps = only_active(job.dumps())
    for d in dumps.values():
        for c in d["pg_config"].values():
            if c["name"] in (f0, f1):
                c["ranks"] = "[0, 1]"
    assert hangs(analyze(dumps)) == {}


@pytest.mark.parametrize("asked_only_active", [False, True])
def test_a_dump_cut_by_last_is_not_read_as_only_active(asked_only_active):
    # rank 1 is stuck in H (rank 2 never came) with G's seq 6 queued behind, and its CPU keeps
    # enqueuing H: a ?last=N fetch (the monitor's, or one asking for onlyActive) keeps only
    # unfinished H entries, which is no sign that it never enqueued G's seq 6
    job = FRJob(3)
    job.group("1", [0, 1])
    job.group("2", [1, 2])
    job.repeat(5, [("1", "all_reduce", [[8]]), ("2", "all_reduce", [[8]])])
    job.collective("2", absent=[2])
    job.collective("1", complete=False)
    for _ in range(20):
        job.collective("2", absent=[2])
    dumps = torch_ids(job.dumps())
    one = only_active({1: dumps[1]})[1] if asked_only_active else dumps[1]
    dumps[1] = json.loads(filter_fr_dump(json.dumps(one).encode(), None, 10, asked_only_active))
    assert hangs(analyze(dumps)) == {"2": (6, [2], [1])}


def test_a_dump_without_entries_among_full_ones_is_not_read_as_only_active():
    # rank 1 waits in seq 6 like rank 0, but was dumped with includeCollectives=False (torch's
    # JSON then has no "entries"); the others' completed entries show theirs are full dumps
    job = FRJob(3)
    job.group("1", [0, 1, 2], desc="unused_mesh_dim")
    job.repeat(5, [("0", "all_reduce", [[8]])])
    job.collective("0", absent=[2])
    dumps = torch_ids(job.dumps())
    del dumps[1]["entries"]
    result = analyze(dumps)
    assert hangs(result) == {"0": (6, [2], [0])}
    assert result.findings[0].unknown_ranks == [1]


def test_a_count_of_other_digits_costs_one_rank_not_the_analysis():
    dumps = tp_dp_job()
    for raw in ("²", "--5"):
        dumps[1]["pg_status"]["1"]["last_enqueued_collective"] = raw
        assert hangs(analyze(dumps))["2"] == (5, [3], [2])


def test_a_json_dump_with_a_byte_order_mark_is_read(tmp_path, capsys):
    for rank, dump in tp_dp_job().items():
        (tmp_path / f"rank{rank}.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(dump).encode())
    code = main(["analyze", "--format", "json", "--jobs", "1", str(tmp_path)])
    report = json.loads(capsys.readouterr().out)
    assert (report["ranks"], report["errors"], code) == ([0, 1, 2, 3], [], 1)


def test_dumps_without_collectives_name_include_collectives():
    # _dump_nccl_trace(includeCollectives=False): pg_status, no entries
    dumps = tp_dp_job()
    for d in dumps.values():
        del d["entries"]
    assert analyze(dumps).notes == [NOTHING_KEPT]
    assert "includeCollectives=False" in NOTHING_KEPT and "buffer" not in NOTHING_KEPT


@pytest.mark.parametrize("flavour", ["nccl", "gloo"])
@pytest.mark.parametrize("served", [False, True])
def test_a_rank_with_its_flight_recorder_off_testifies_nothing(served, flavour):
    """A rank run with TORCH_FR_BUFFER_SIZE=0 (a spare launched with another environment) dumps
    no groups, no counts, no entries: no evidence that it never enqueued the collective the
    others wait in. It was named the culprit (gloo) or hid the hang (NCCL)."""
    job = FRJob(3, flavour=flavour)
    job.group("1", [0, 1, 2])
    job.repeat(5, [("1", "all_reduce", [[8]])])
    job.collective("1", absent=[1])  # rank 1 stuck before it; 0 and 2 wait
    dumps = job.dumps()
    dumps[2] = {"version": dumps[2]["version"], "comm_lib_version": "", "pg_config": {},
                "pg_status": {}, "entries": [], "rank": 2}
    if served:  # as the WorkerServer serves the monitor
        dumps = {r: json.loads(filter_fr_dump(json.dumps(d).encode(), None, 256))
                 for r, d in dumps.items()}
    [hang] = [f for f in analyze(dumps).findings if f.kind == "hang"]
    assert (hang.culprit_ranks, hang.waiting_ranks) == ([1], [0])
    # gloo's members are the ranks whose entries show them: rank 2 is none of the group's
    assert hang.unknown_ranks == ([2] if flavour == "nccl" else [])


def recorder_off_hangs(flavour: str, fetch: str, absent: list[int], reached: int) -> dict:
    """Three replica groups of two; ``absent`` never enter quorum 2's all_reduce; group 1's ranks
    (leader 2) run with TORCH_FR_BUFFER_SIZE=0: their WorkerServer still lists torchft's
    incarnations, up to quorum ``reached`` (none resolved: no entry names them), no group, no
    count, no entry. Read whole (an incident bundle) or as the monitor asks leaders
    (?pg=torchft&last=). Hangs by group rank."""
    job = FRJob(6, replica_group_size=2, flavour=flavour)
    for g in range(3):
        job.group(f"a{g}", [2 * g, 2 * g + 1])
    job.quorum(1, [0, 1, 2])
    for _ in range(4):
        for g in range(3):
            job.collective(f"a{g}")
        job.ft_collective()
    job.quorum(2, [0, 1, 2])
    for g in range(3):
        job.collective(f"a{g}")
    job.ft_collective(absent=absent)
    dumps = job.dumps(ranks=None if fetch == "whole" else [0, 2, 4])
    for r in set(dumps) & {2, 3}:
        dumps[r].update(pg_config={}, pg_status={}, entries=[])
        dumps[r]["incarnations"] = [dict(i, pg_id=None, pg_name=None, first_record_id=0)
                                    for i in dumps[r]["incarnations"] if i["quorum_id"] <= reached]
    if fetch == "leaders":
        dumps = {r: json.loads(filter_fr_dump(json.dumps(d).encode(), "torchft", FR_LAST_LEADERS))
                 for r, d in dumps.items()}
    return {f.group.group_rank: (f.group.quorum_id, f.culprit_ranks, f.waiting_ranks, f.unknown_ranks)
            for f in analyze(dumps).findings if f.kind == "hang"}


@pytest.mark.parametrize("flavour", ["nccl", "gloo"])
@pytest.mark.parametrize("fetch", ["whole", "leaders"])
def test_a_leader_with_its_flight_recorder_off_is_no_culprit_across_groups(fetch, flavour):
    # group 2's leader (rank 4) never enters quorum 2's all_reduce; rank 2 did, its recorder
    # off: it was named
    want = {0: (2, [4], [0], [2]), 1: (2, [5], [1], [3])}
    assert recorder_off_hangs(flavour, fetch, [4, 5], 2) == (want if fetch == "whole" else {0: want[0]})


@pytest.mark.parametrize("flavour", ["nccl", "gloo"])
@pytest.mark.parametrize("fetch", ["whole", "leaders"])
def test_a_leader_with_its_flight_recorder_off_short_of_the_quorum_is_named(fetch, flavour):
    # rank 2 hangs in quorum 2's configure: its incarnations (recorded once configure returns)
    # stop at quorum 1, so it has not reached quorum 2, recorder or not; the hang was missed
    want = {0: (2, [2], [0, 4], []), 1: (2, [3], [1, 5], [])}
    assert recorder_off_hangs(flavour, fetch, [2, 3], 1) == (want if fetch == "whole" else {0: want[0]})


@pytest.mark.parametrize("flavour", ["nccl", "gloo"])
def test_a_rank_stuck_before_its_first_collective_is_named(flavour):
    """Its recorder is on and lists the default group (gloo names it '' in pg_config, '0' in
    its entries): holding no entry, it enqueued none."""
    job = FRJob(3, flavour=flavour)
    job.collective("0", "all_reduce", [[8]], absent=[1])
    [hang] = [f for f in analyze(job.dumps()).findings if f.kind == "hang"]
    assert (hang.culprit_ranks, hang.waiting_ranks) == ([1], [0, 2])
