"""Hangs only on evidence the dumps hold: a replica group that restarted (its groups count from 1
again), a rank dumped earlier than the others, dumps of unfinished collectives only (onlyActive)
and dumps filtered to one process group (the monitor's ``?pg=torchft``)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

from lightkeeper.cli import main
from monitor.analysis import GroupKey, analyze
from monitor.analysis.engine import NOTHING_KEPT, NOTHING_RECORDED
from tests.support.frgen import TP_STEP, tp_job


def run_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["analyze", "--format", "json", "--jobs", "1", *map(str, argv)])
    return code, json.loads(capsys.readouterr().out)


def _entry(rid: int, pg: str, seq: int, t: int, completed: bool) -> dict[str, Any]:
    e = {"record_id": rid, "pg_id": 0, "process_group": (pg, "default_pg" if pg == "0" else pg),
         "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": "nccl:all_reduce",
         "time_created_ns": t, "input_sizes": [[1024]], "input_dtypes": ["Float"], "output_sizes": [[1024]],
         "output_dtypes": ["Float"], "state": "scheduled", "time_discovered_started_ns": 0,
         "time_discovered_completed_ns": 0, "retired": False, "timeout_ms": 600000, "is_p2p": False, "frames": []}
    if completed:
        e.update(state="completed", duration_ms=1.0, time_discovered_started_ns=t + 1,
                 time_discovered_completed_ns=t + 2, retired=True)
    return e


def write_restarted_quorum(folder: Path, completed: bool = True) -> None:
    """torchft's quorum folder of 2 replica groups x 2 ranks, torch's pickles (no rank key): group
    1 restarted, so its own group "0" counts from 1 while group 0's is at 5001-5010."""
    folder.mkdir(parents=True)
    for rg in (0, 1):
        for gr in (0, 1):
            base = 5000 if rg == 0 else 0
            ft = f"torchft_quorum_5_rank_{gr}"
            entries, rid, t = [], 0, 10**18
            for step in range(10):
                entries.append(_entry(rid, "0", base + step + 1, t, completed))
                entries.append(_entry(rid + 1, ft, step + 1, t + 10**7, completed))
                rid, t = rid + 2, t + 2 * 10**7
            dump = {"version": "2.10", "comm_lib_version": "2.28.9" if completed else "", "pg_status": {},
                    "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"},
                                  ft: {"name": ft, "desc": ft, "ranks": "[]"}},
                    "entries": entries}
            (folder / str(rg * 2 + gr)).write_bytes(pickle.dumps(dump, protocol=2))


def test_a_restarted_replica_group_is_no_hang(tmp_path, capsys):
    # ranks 0, 1 keep seq 5001-5010 of their "0", all completed: they said nothing of seq 11, yet
    # were reported as having enqueued it and waiting in it, ranks 2, 3 as never arriving
    write_restarted_quorum(tmp_path / "trace_quorum_5")
    code, report = run_json(capsys, tmp_path / "trace")
    assert report["findings"] == []
    assert code == 0


def test_a_hang_no_dump_holds_does_not_say_what_is_waited_in(tmp_path, capsys):
    # gloo-like: nothing completed, so nothing says everyone enqueued seq 11; but no dump holds it
    write_restarted_quorum(tmp_path / "trace_quorum_5", completed=False)
    code, report = run_json(capsys, tmp_path / "trace")
    [hang] = [f for f in report["findings"] if f["kind"] == "hang"]
    assert (hang["seq"], hang["culprit_ranks"], hang["op"]) == (11, [2, 3], None)
    assert "wait in" not in hang["detail"].replace("what they wait in (if anything) is not shown", "")
    assert "no dump holds seq 11" in hang["detail"]
    assert code == 1


def test_a_rank_dumped_earlier_than_the_others_is_no_hang():
    job = tp_job()
    job.repeat(5, TP_STEP)
    early = job.dumps(ranks=[1])  # an earlier dump of rank 1 left in the folder
    job.repeat(20, TP_STEP)
    # the others' buffers no longer reach back to seq 6 of group "1", but later ones completed
    dumps = {**job.dumps(buffer_size=12), **early}
    assert analyze(dumps).findings == []


def _active_dump(entries: list[dict], nccl: bool = True) -> dict[str, Any]:
    # what _dump_nccl_trace_json(onlyActive=True) gives: completed collectives left out
    status = {"0": (8, 8), "1": (12, 13), "2": (12, 12)}
    return {"version": "2.10", "comm_lib_version": "2.28.9" if nccl else "", "nccl_comm_state": {},
            "pg_config": {g: {"name": g, "desc": d, "ranks": "[0, 1]"} for g, d in (("0", "default_pg"), ("1", "tp"), ("2", "dp"))},
            "pg_status": {g: {"last_completed_collective": str(c), "last_enqueued_collective": str(e),
                              "last_started_collective": str(c)} for g, (c, e) in status.items()},
            "entries": entries}


def _stuck_entry() -> dict[str, Any]:
    e = _entry(36, "1", 13, 1_795_385_200_074_414_244, completed=False)
    e["process_group"] = ["1", "tp"]
    return e


def test_an_only_active_dump_without_entries_testifies_by_pg_status():
    # rank 1 finished everything, so its dump holds no entry: read as having enqueued nothing,
    # it was "never enqueued collective seq 1" of group 1
    result = analyze({0: _active_dump([_stuck_entry()]), 1: _active_dump([])})
    assert [f.kind for f in result.findings] == []
    assert result.last_seq[GroupKey("1")] == {0: 13, 1: 13}
    assert result.last_seq[GroupKey("0")] == {0: 8, 1: 8}


def test_a_pg_status_count_alone_never_blames_a_rank():
    # NCCL counts a group's send/recv in last_enqueued_collective when its last work was one
    # (seqP2P): rank 1's 7 is no collective's seq, so it is not "stopped at seq 7"
    behind = _active_dump([])
    behind["pg_status"]["1"] = {"last_completed_collective": "7", "last_enqueued_collective": "7",
                                "last_started_collective": "7"}
    result = analyze({0: _active_dump([_stuck_entry()]), 1: behind})
    assert [f.kind for f in result.findings] == []


def test_a_rank_stuck_after_its_last_collective_completed_is_found_by_its_pg_status():
    # the commonest hang, read from onlyActive dumps: rank 1 finished seq 12 and is stuck in
    # compute (its dump keeps no entry of the group), rank 0 waits in seq 13
    behind = _active_dump([])
    behind["pg_status"]["1"] = {"last_completed_collective": "12",
                                "last_enqueued_collective": "12", "last_started_collective": "12"}
    result = analyze({0: _active_dump([_stuck_entry()]), 1: behind})
    assert [(f.kind, f.seq, f.culprit_ranks) for f in result.findings] == [("hang", 13, [1])]


def test_a_gloo_dump_without_entries_testifies_nothing():
    # gloo's pg_status counts more than the collectives it records: not a count of seq ids, but
    # it shows the rank did enqueue work, so no entry is no "enqueued none"
    result = analyze({0: _active_dump([_stuck_entry()], nccl=False), 1: _active_dump([], nccl=False)})
    assert result.findings == []
    assert 1 not in result.last_seq.get(GroupKey("1"), {})


def test_all_empty_dumps_whose_pg_status_shows_work_say_so(tmp_path, capsys):
    for r in (0, 1):
        (tmp_path / f"rank{r}.json").write_text(json.dumps(_active_dump([])))
    code, report = run_json(capsys, tmp_path)
    assert NOTHING_KEPT in report["notes"] and NOTHING_RECORDED not in report["notes"]
    assert "Flight Recorder off?" not in " ".join(report["notes"])
    assert code == 2
    # where pg_status shows nothing either, the buffer is off
    empty = {r: {**_active_dump([]), "pg_status": {}} for r in (0, 1)}
    assert analyze(empty).notes == [NOTHING_RECORDED]


def test_a_dump_filtered_to_one_group_testifies_nothing_of_the_others():
    # the monitor reads some ranks' dumps filtered (?pg=...&last=64): a group filtered out holds
    # no entry in them, which is no "enqueued none", though the first record id kept is 0
    job = tp_job()
    job.repeat(3, TP_STEP)
    dumps = job.dumps()
    filtered = dict(dumps[0])
    del filtered["pg_status"]  # a merged dump's keys are no group names: not read by name
    filtered["entries"] = [e for e in filtered["entries"] if e["process_group"][0] == "0"]
    filtered["filter"] = {"pg": "0", "last": 64, "entries_total": len(dumps[0]["entries"])}
    assert filtered["entries"][0]["record_id"] == 0
    result = analyze({**dumps, 0: filtered})
    assert result.findings == []
    assert result.last_seq[GroupKey("1")] == {1: 3}
    assert result.last_seq[GroupKey("0")] == {0: 3, 1: 3, 2: 3, 3: 3}
