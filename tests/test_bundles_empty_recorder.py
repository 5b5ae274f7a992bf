"""A rank that has run no collective yet serves a dump without ``entries`` (torch leaves the key
out of an empty recorder's dump: c10d FlightRecorderDetail.hpp, ``if (!entries.empty())``). An
incident bundle keeps it as a dump (monitor/act/bundles.py, ``looks_like_dump``), and still
refuses what is no dump at all.

The ranks are simulated WorkerServers (tests/support/monitor_sim.py)."""

from __future__ import annotations

import json
import tarfile
import time

from lightkeeper.cli import main
from monitor.act.bundles import Bundles
from monitor.config import BundleConfig, MonitorConfig
from monitor.evidence.rank import RankView
from monitor.store import Store
from tests.support.frgen import FRJob
from tests.support.monitor_sim import SimRanks
from tests.support.views import scratch_view

# a fresh process's /v1/fr_trace as torch 2.10 and the WorkerServer write it: no entries
EMPTY = (b'{"comm_lib_version":"","nccl_comm_state":{},"pg_config":{"0":{"desc":"default_pg",'
         b'"name":"0","ranks":"[0, 1, 2, 3, 4, 5]"}},"pg_status":{},"version":"2.10","rank":0,'
         b'"replica_group":0,"dump_time_ns":1795978242803979673,"incarnations":[]}')
NOT_DUMPS = {2: b"{}", 3: b"[]", 4: b"<html><body>502 Bad Gateway</body></html>",
             5: b'{"error": "no flight recorder", "status": 500}'}


def _capture(tmp_path, sim: SimRanks, kind: str) -> dict:
    """An eviction bundle of ``sim``'s ranks for a ``kind`` finding of group 0 (then stopped)."""
    view = scratch_view(time.time(), {r.url: RankView(r.url, True, dict(r.state))
                                      for r in sim.ranks})
    store = Store(str(tmp_path / "state.sqlite"))
    bundles = Bundles(MonitorConfig(state_path=str(tmp_path / "state.sqlite"), job="t",
                                    bundles=BundleConfig(timeout_s=2.0)), store)
    finding = {"kind": kind, "replica_group": 0, "replica_id": "replica_group_0:sim",
               "ranks": [0], "evidence": {}, "first_seen": time.time()}
    try:
        got = bundles.capture("evict", view, view, finding, 1, {"id": 1}, [])
        return {**got, "path": bundles.store.path(got["id"])}
    finally:
        bundles.close()
        store.close()
        sim.stop()


def test_an_empty_recorders_dump_is_kept_and_what_is_no_dump_is_not(tmp_path, capsys):
    sim = SimRanks.start(6)
    job = FRJob(6, flavour="gloo")
    job.repeat(3, [("0", "all_reduce", [[1024]])])
    for r in sim.ranks:
        rank = r.state["rank"]
        r.fr = EMPTY if rank == 0 else NOT_DUMPS.get(rank, job.dumps()[rank])
    got = _capture(tmp_path, sim, "stuck_starting")
    path = got["path"]
    with tarfile.open(path, "r:gz") as tar:
        files = {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar if m.isfile()}
    fr = {x["rank"]: x["fr_trace"] for x in json.loads(files["manifest.json"])["ranks"]}
    assert fr[0] == fr[1] == "ok", fr
    assert files["fr/rank0.json"] == EMPTY  # as the rank sent it
    for rank in NOT_DUMPS:
        assert fr[rank].startswith("bad_response: not a Flight Recorder dump"), (rank, fr)
        assert f"fr/rank{rank}.json" not in files
    assert [x["rank"] for x in got["not_fetched"]] == sorted(NOT_DUMPS)
    # analyze reads it as rank 0's dump: of the bundle's ranks, only the others are unread
    main(["analyze", "--format", "json", path])
    report = json.loads(capsys.readouterr().out)
    [b] = report["bundles"]
    assert report["ranks"] == [0, 1] and report["errors"] == [], report
    assert [x["rank"] for x in b["not_fetched"]] == sorted(NOT_DUMPS), b["not_fetched"]


def test_a_hang_bundle_of_empty_recorders_only_is_not_checked_against_the_monitor(tmp_path, capsys):
    """Flight Recorder off (older torch's default buffer size 0) or no collective run yet: the
    dumps can check nothing, so analyze gives no verdict, not one against the monitor."""
    sim = SimRanks.start(2)
    for r in sim.ranks:
        r.fr = EMPTY.replace(b'"rank":0', b'"rank":%d' % r.state["rank"])
    assert main(["analyze", "--format", "json", _capture(tmp_path, sim, "hang")["path"]]) == 2
    [b] = json.loads(capsys.readouterr().out)["bundles"]
    assert b["analysis_agrees"] is None, b
