"""Incident bundles: what the monitor keeps before a kill (monitor/act/bundles.py),
the API that lists and serves them, and ``lightkeeper analyze <bundle>``.

The ranks are simulated WorkerServers (tests/support/monitor_sim.py) serving Flight Recorder
dumps made by tests/support/frgen.py; the eviction test runs a live monitor against a real torchft
Lighthouse (``SimJob``, whose front records the kill instead of ending a process that does not
exist). The real job's bundle is checked in tests/test_monitor_e2e.py (the hang's eviction).
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import threading
import time
from pathlib import Path

import pytest
import requests

from lightkeeper.cli import main
from lightkeeper.processes import wait_until
from monitor.act.bundles import Bundles, BundleStore
from monitor.analysis.bundle import open_bundle
from monitor.config import BundleConfig, MonitorConfig, RailsConfig
from monitor.evidence.rank import RankView
from monitor.service import Monitor
from monitor.store import Store
from tests.support.frgen import FRJob
from tests.support.http_stub import HttpStub
from tests.support.monitor_sim import SimJob, SimRank, SimRanks
from tests.support.views import scratch_view

TOKEN = "s3cret"


def hang_dumps(world: int, absent: int, steps: int = 6) -> dict[int, dict]:
    """JSON dumps of ``world`` ranks where ``absent`` never enqueued the last all_reduce."""
    job = FRJob(world, flavour="gloo")
    job.repeat(steps, [("0", "all_reduce", [[1024]])])
    job.collective("0", "all_reduce", [[1024]], absent=[absent])
    return job.dumps()


def view_of(sim: SimRanks):
    ranks = {r.url: RankView(r.url, True, dict(r.state)) for r in sim.ranks}
    return scratch_view(time.time(), ranks)


def finding(group: int, ranks: list[int], **evidence) -> dict:
    return {"kind": "hang", "replica_group": group, "replica_id": f"replica_group_{group}:sim",
            "ranks": ranks, "evidence": {"culprit_hosts": ["sim"], **evidence},
            "first_seen": time.time(), "confirmed_at": time.time()}


def bundles_for(tmp_path, **kw) -> tuple[Bundles, Store]:
    store = Store(str(tmp_path / "state.sqlite"))
    cfg = MonitorConfig(state_path=str(tmp_path / "state.sqlite"), job="t",
                        bundles=BundleConfig(**kw))
    return Bundles(cfg, store), store


def members(path: str) -> dict[str, bytes]:
    with tarfile.open(path, "r:gz") as tar:
        return {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar if m.isfile()}


def test_manifest_names_what_could_not_be_fetched_and_the_wait_is_bounded(tmp_path):
    """4 single-rank groups: the culprit (group 3) and a healthy peer answer, one peer answers
    garbage, one does not answer at all; the bundle comes back within the fetch timeout (the
    silent rank would take 30 s) and its manifest says which answer is missing and why."""
    sim = SimRanks.start(4)
    dumps = hang_dumps(4, absent=3)
    for r in sim.ranks:
        r.fr = dumps[r.state["rank"]]
    view = view_of(sim)  # taken while every rank answers
    sim.ranks[1].fr = b"<html>not json"
    sim.ranks[2].set_mode("slow", delay=30)
    bundles, store = bundles_for(tmp_path, timeout_s=1.0)
    try:
        t0 = time.monotonic()
        got = bundles.capture("evict", view, view, finding(3, [3]), 7,
                              {"id": 1, "decision": "evict", "status": "sending"}, [])
        took = time.monotonic() - t0
        assert got is not None and took < 1.0 + 2.0, took  # the timeout, plus writing
        [row] = bundles.store.list()
        assert row["id"] == got["id"] and row["decision_id"] == 1 and row["finding_id"] == 7
        files = members(bundles.store.path(got["id"]))
        m = json.loads(files["manifest.json"])
        assert m["written_before_kill"] and m["culprit_ranks"] == [3] and m["replica_group"] == 3
        by_rank = {r["rank"]: r for r in m["ranks"]}
        assert by_rank[3]["role"] == "culprit" and by_rank[0]["role"] == "peer"
        assert by_rank[3]["stacks"] == by_rank[3]["fr_trace"] == "ok"
        assert by_rank[0]["stacks"] == by_rank[0]["fr_trace"] == "ok"
        assert by_rank[1]["stacks"] == "ok" and by_rank[1]["fr_trace"].startswith("bad_response")
        assert by_rank[2]["stacks"].startswith("timeout") \
            and by_rank[2]["fr_trace"].startswith("timeout")
        assert {"fr/rank0.json", "fr/rank3.json", "stacks/rank3.json", "findings.json",
                "view.json"} <= set(files)
        assert "fr/rank1.json" not in files and "fr/rank2.json" not in files
        assert json.loads(files["findings.json"])["finding"]["id"] == 7
        view_doc = json.loads(files["view.json"])
        assert [g["replica_group"] for g in view_doc["groups"]] == [0, 1, 2, 3]
        # no Lighthouse status given: said, never an empty quorum
        assert view_doc["lighthouse"] == {"error": "not read"}
        assert all(g["heartbeat_age_s"] is None for g in view_doc["groups"])
        assert row["summary"]["ranks_complete"] == 2 and len(row["summary"]["not_fetched"]) == 2
    finally:
        bundles.close()
        store.close()
        sim.stop()


def test_a_rank_dumping_for_someone_else_is_asked_again_within_the_timeout(tmp_path):
    """A rank's WorkerServer answers 503 while it dumps for another client (a sweep's fetch):
    the bundle asks it once more, within the fetch timeout, and keeps its dump."""
    sim = SimRanks.start(2)
    dumps = hang_dumps(2, absent=1)
    for r in sim.ranks:
        r.fr = dumps[r.state["rank"]]
    view = view_of(sim)
    sim.ranks[1].set_mode("fr_busy_once")
    bundles, store = bundles_for(tmp_path, timeout_s=2.0)
    try:
        got = bundles.capture("evict", view, view, finding(1, [1]), 7,
                              {"id": 1, "decision": "evict", "status": "sending"}, [])
        m = json.loads(members(bundles.store.path(got["id"]))["manifest.json"])
        assert {r["rank"]: r["fr_trace"] for r in m["ranks"]} == {0: "ok", 1: "ok"}
    finally:
        bundles.close()
        store.close()
        sim.stop()


def test_a_busy_rank_whose_retry_cannot_start_ends_the_bundle_by_its_timeout(tmp_path,
                                                                            monkeypatch):
    """No thread to spare (a pids limit) for a 503's retry: the 503 is kept and the bundle
    ends by ``--bundle-timeout``; raised on the poller's loop, the sweep never ended."""
    sim = SimRanks.start(2)
    dumps = hang_dumps(2, absent=1)
    for r in sim.ranks:
        r.fr = dumps[r.state["rank"]]
    view = view_of(sim)
    rank, plain = sim.ranks[1], sim.ranks[1].respond

    def respond(path, mode):
        if path.startswith("/v1/fr_trace"):
            return "503 Service Unavailable", "application/json", b'{"error": "busy"}'
        return plain(path, mode)
    rank.respond = respond
    rank.set_mode("slow", delay=0.3)  # the sweep's last answer
    bundles, _ = bundles_for(tmp_path, timeout_s=1.0)
    real = threading.Thread.start

    def start(self):
        if self.name == "lightkeeper-bundles-busy":
            raise RuntimeError("can't start new thread")
        return real(self)
    monkeypatch.setattr(threading.Thread, "start", start)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("got", bundles.capture(
        "evict", view, view, finding(1, [1]), 7, {"id": 1, "decision": "evict"}, [])),
        daemon=True)
    real(t)
    t.join(8)
    try:
        assert not t.is_alive(), "the bundle still blocked 8 s after a 1 s --bundle-timeout"
        assert out["got"] is not None
    finally:
        sim.stop()


def test_a_busy_rank_is_asked_again_until_it_answers_whatever_the_others_do(tmp_path):
    """A bundle's culprit does not answer its dump (wedged, the usual case for a bundle): a rank
    busy dumping for others for its first two asks is still asked again, every
    ``BUSY_RETRY_S``, and its dump kept; one busy throughout is named busy; all by the
    timeout."""
    sim = SimRanks.start(4)
    dumps = hang_dumps(4, absent=3)
    for r in sim.ranks:
        r.fr = dumps[r.state["rank"]]
    view = view_of(sim)
    busy = {1: 2, 2: 10**6}  # rank -> its next dump asks answered 503
    asked = {1: 0, 2: 0}

    def busy_for(rank: SimRank):
        plain = rank.respond

        def respond(path, mode):
            n = rank.state["rank"]
            if path.startswith("/v1/fr_trace"):
                asked[n] += 1
                if busy[n] > 0:
                    busy[n] -= 1
                    return "503 Service Unavailable", "application/json", b'{"error": "busy"}'
            return plain(path, mode)
        return respond

    for n in busy:
        sim.ranks[n].respond = busy_for(sim.ranks[n])
    sim.ranks[3].set_mode("fr_silent")
    bundles, store = bundles_for(tmp_path, timeout_s=2.5)
    try:
        t0 = time.monotonic()
        got = bundles.capture("evict", view, view, finding(3, [3]), 7,
                              {"id": 1, "decision": "evict", "status": "sending"}, [])
        took = time.monotonic() - t0
        m = json.loads(members(bundles.store.path(got["id"]))["manifest.json"])
        fr = {r["rank"]: r["fr_trace"] for r in m["ranks"]}
        assert fr[0] == fr[1] == "ok", fr
        assert fr[2] == "http_status: HTTP 503 Service Unavailable", fr
        assert fr[3].startswith("timeout"), fr
        assert asked[1] == 3 and asked[2] >= 3, asked
        assert took < 2.5 + 2.0, took  # the timeout, plus writing
    finally:
        bundles.close()
        store.close()
        sim.stop()


class _TracebackServer(HttpStub):
    """Answers ``POST`` with a traceback's text, as torch's ``dump_traceback`` handler does."""

    TEXT = b'Thread 0x00007f (most recent call first):\n  File "job.py", line 9 in <module>\n'

    def __init__(self) -> None:
        super().__init__({"POST": (200, self.TEXT, {"Content-Type": "text/plain"})})

    def __enter__(self) -> str:
        return f"{self.url}/handler/dump_traceback"


def test_torch_only_ranks_keep_torchs_traceback_and_the_monitors_dump(tmp_path):
    """Ranks read through torch's debug server alone have no /v1/stacks nor /v1/fr_trace: their
    stacks are torch's traceback (text, asked at the bundle's time), their dump the one the
    monitor last read; a rank with no such dump is said, and the Lightkeeper rank is as ever."""
    sim = SimRanks.start(3)
    dumps = hang_dumps(3, absent=1)
    for r in sim.ranks:
        r.fr = dumps[r.state["rank"]]
    with _TracebackServer() as stacks1, _TracebackServer() as stacks2:
        ranks, urls = {}, {}
        for r in sim.ranks:
            state, urls[r.state["rank"]] = dict(r.state), r.url
            if state["rank"] in (1, 2):  # as monitor/evidence/torch_rank.py makes it: a handler
                stacks_url = stacks1 if state["rank"] == 1 else stacks2  # of its own server
                urls[state["rank"]] = "torch+" + stacks_url.split("/handler/")[0]
                state.update(torch_only={"flight_recorder": "none; dump_nccl_trace_json: "
                                         "timeout"}, stacks_url=stacks_url)
            ranks[urls[state["rank"]]] = RankView(urls[state["rank"]], True, state)
        view = scratch_view(time.time(), ranks)
        monitors = {urls[1]: {**dumps[1], "rank": 1, "dump_time_ns": 1_795_000_000 * 10**9}}
        store = Store(str(tmp_path / "state.sqlite"))
        cfg = MonitorConfig(state_path=str(tmp_path / "state.sqlite"), job="t")
        bundles = Bundles(cfg, store, torch_dumps=lambda: monitors)
        try:
            got = bundles.capture("evict", view, view, finding(1, [1]), 3, {"id": 5}, [])
            files = members(bundles.store.path(got["id"]))
        finally:
            bundles.close()
            store.close()
            sim.stop()
    by_rank = {r["rank"]: r for r in json.loads(files["manifest.json"])["ranks"]}
    assert by_rank[1]["torch_only"] and by_rank[1]["fr_trace_at"] == 1_795_000_000
    assert by_rank[1]["stacks"] == by_rank[1]["fr_trace"] == "ok", by_rank[1]
    assert files["stacks/rank1.txt"] == _TracebackServer.TEXT
    assert json.loads(files["fr/rank1.json"]) == monitors[urls[1]]
    assert by_rank[2]["stacks"] == "ok" and "fr/rank2.json" not in files
    assert by_rank[2]["fr_trace"] == ("none read from its torch server in the monitor's last "
                                      "sweep (none; dump_nccl_trace_json: timeout)")
    assert "torch_only" not in by_rank[0] and by_rank[0]["stacks"] == by_rank[0]["fr_trace"] == "ok"
    assert {"stacks/rank0.json", "fr/rank0.json"} <= set(files)
    assert got["ranks_complete"] == 2 and [x["rank"] for x in got["not_fetched"]] == [2]


def test_a_huge_stacks_answer_is_not_parsed_before_the_kill(tmp_path):
    """A rank answering /v1/stacks with 6 MB of garbage JSON: decoded (twice: strict, then
    lenient) on the kill's path, 64 MiB each from up to 32 ranks was seconds and gigabytes."""
    sim = SimRanks.start(2)
    dumps = hang_dumps(2, absent=1)
    for r in sim.ranks:
        r.fr = dumps[r.state["rank"]]
    huge = b'{"threads":[' + b",".join([b"{}"] * 2_000_000) + b'],"x":tru}'
    real = sim.ranks[1].respond
    sim.ranks[1].respond = lambda path, mode: ("200 OK", "application/json", huge) \
        if path.startswith("/v1/stacks") else real(path, mode)
    view = view_of(sim)
    bundles, store = bundles_for(tmp_path, timeout_s=5.0)
    try:
        got = bundles.capture("evict", view, view, finding(1, [1]), 3, {"id": 5}, [])
        by_rank = {r["rank"]: r for r in json.loads(
            members(bundles.store.path(got["id"]))["manifest.json"])["ranks"]}
    finally:
        bundles.close()
        store.close()
        sim.stop()
    assert by_rank[1]["stacks"] == f"bad_response: {len(huge)} bytes of stacks, over 4 MiB: " \
        "not read", by_rank[1]
    assert by_rank[1]["fr_trace"] == "ok" and by_rank[0]["stacks"] == "ok"


H100_BUNDLE = Path(__file__).parent / "fixtures" / "torch-debug-server-h100" / \
    "bundle-evict-hang.tar.gz"


def test_a_cuda_jobs_torch_only_bundle_is_read_to_the_monitors_culprit(capsys):
    """Kept on an H100 (docs/gpu.md, 4): a torchft job on CUDA read through torch's debug server
    alone, group 1 stopped before its all-reduce. Each rank's dump holds both recorders, NCCL's
    in-group all-reduces beside torchft's gloo ones, and analyze names the monitor's culprit."""
    files = members(str(H100_BUNDLE))
    for rank in (0, 1):
        ops = {e["profiling_name"] for e in json.loads(files[f"fr/rank{rank}.json"])["entries"]}
        assert ops == {"nccl:all_reduce", "gloo:all_reduce"}, ops
        assert b"torch_debug_server_job.py" in files[f"stacks/rank{rank}.txt"]
    code = main(["analyze", "--format", "json", str(H100_BUNDLE)])
    [b] = json.loads(capsys.readouterr().out)["bundles"]
    assert code == 1 and (b["culprit_ranks"], b["analysis_agrees"]) == ([1], True), b


def test_size_cap_leaves_peers_out_first_and_rank_cap_is_said(tmp_path):
    sim = SimRanks.start(3)
    dumps = hang_dumps(3, absent=2, steps=200)
    for r in sim.ranks:
        r.fr = dumps[r.state["rank"]]
    view = view_of(sim)
    one = len(json.dumps(dumps[2]))  # as the rank serves it, kept as it came
    assert one > 20_000
    # room for the head, every stack and one dump: the culprit's
    bundles, store = bundles_for(tmp_path, max_ranks=2, max_bytes=one + 8_000)
    try:
        got = bundles.capture("confirm", view, view, finding(2, [2]), None, None, [])
        m = json.loads(members(bundles.store.path(got["id"]))["manifest.json"])
        assert [r["rank"] for r in m["ranks"]] == [2, 0]  # the culprit first
        assert [r["rank"] for r in m["not_asked"]] == [1]
        assert "over --bundle-ranks 2" in m["not_asked"][0]["why"]
        assert "fr/rank2.json" in m["files"] and "fr/rank0.json" not in m["files"]
        assert [x["what"] for x in m["left_out"]] == ["fr/rank0.json"]
        assert not m["written_before_kill"]
    finally:
        bundles.close()
        store.close()
        sim.stop()


def test_retention_and_total_cap_delete_the_oldest(tmp_path):
    now = [1_000_000.0]
    store = Store(str(tmp_path / "s.sqlite"))
    bs = BundleStore(BundleConfig(keep_s=100, total_bytes=3000, max_bytes=3000),
                     str(tmp_path / "incidents"), store, clock=lambda: now[0])
    try:
        def write(i: int, size: int) -> str:
            bid = bs.new_id("evict", "hang", i)
            blob = os.urandom(size)  # incompressible
            assert bs.write(bid, {"format": "x"}, [("blob", blob)], {
                "at": now[0], "trigger": "evict", "summary": {}}) is not None
            return bid

        a = write(0, 1000)
        now[0] += 10
        b = write(1, 1000)
        now[0] += 10
        c = write(2, 1000)  # the three together exceed 3000 bytes compressed: a goes
        ids = [r["id"] for r in bs.list()]
        assert ids == [c, b] and not os.path.exists(tmp_path / "incidents" / f"{a}.tar.gz")
        now[0] += 95  # b is now older than keep_s
        assert bs.prune() == [b]
        assert [r["id"] for r in bs.list()] == [c]
        assert sorted(os.listdir(tmp_path / "incidents")) == [f"{c}.tar.gz"]
        assert bs.path("../s.sqlite") is None and bs.path(a) is None and bs.path(c)
    finally:
        store.close()


def test_an_older_audit_log_gains_the_bundle_column(tmp_path):
    """A --state file written before bundles existed opens, its decisions keep their rows."""
    import sqlite3

    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE decisions (id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, "
               "replica_group INTEGER, replica_id TEXT, decision TEXT NOT NULL, reason TEXT NOT "
               "NULL, detail TEXT, finding_id INTEGER, finding TEXT, status TEXT, http_status "
               "INTEGER, confirmed_at REAL, source TEXT NOT NULL DEFAULT 'auto')")
    db.execute("INSERT INTO decisions (at, decision, reason) VALUES (1, 'evict', 'hang')")
    db.commit()
    db.close()
    store = Store(str(path))
    try:
        [d] = store.decisions()
        assert d["reason"] == "hang" and d["bundle"] is None
        store.update_decision(d["id"], bundle="b1")
        assert store.decisions()[0]["bundle"] == "b1"
    finally:
        store.close()


def test_analyze_reads_a_bundle_and_names_the_monitors_culprit(tmp_path, capsys):
    sim = SimRanks.start(3)
    dumps = hang_dumps(3, absent=1)
    for r in sim.ranks:
        r.fr = dumps[r.state["rank"]]
    view = view_of(sim)
    bundles, store = bundles_for(tmp_path)
    try:
        got = bundles.capture("evict", view, view, finding(1, [1]), 3, {"id": 5}, [])
        path = bundles.store.path(got["id"])
    finally:
        bundles.close()
        store.close()
        sim.stop()
    code = main(["analyze", "--format", "json", path])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["ranks"] == [0, 1, 2]
    assert [f["culprit_ranks"] for f in report["findings"]] == [[1]]
    [b] = report["bundles"]
    assert (b["id"], b["culprit_ranks"], b["analysis_agrees"]) == (got["id"], [1], True)
    [host] = b["culprit_hosts"]  # the on-call reads where, not only which rank
    main(["analyze", path])
    out = capsys.readouterr().out
    assert f"incident bundle {got['id']}: the monitor named rank(s) 1 on {host} of replica group 1" \
        in out
    assert "the analysis agrees" in out
    # unpacked by hand, the folder is a bundle too
    with tarfile.open(path) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    assert main(["analyze", "--format", "json", str(tmp_path / "unpacked" / got["id"])]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["bundles"][0]["analysis_agrees"] is True and report["ranks"] == [0, 1, 2]
    # a broken archive is an error entry, not a crash
    bad = tmp_path / "broken.tar.gz"
    bad.write_bytes(b"not gzip")
    assert main(["analyze", "--format", "json", str(bad)]) == 2
    assert "not an incident bundle" in json.loads(capsys.readouterr().out)["errors"][0]["error"]
    # ... and so is a bundle's folder whose manifest is broken
    unpacked = tmp_path / "unpacked" / got["id"]
    (unpacked / "manifest.json").write_text("{not json")
    assert main(["analyze", "--format", "json", str(unpacked)]) == 2
    [error] = json.loads(capsys.readouterr().out)["errors"]
    assert error["path"] == str(unpacked) and error["error"].startswith("manifest.json: "), error


def test_analyze_says_what_a_dump_cannot_show_and_the_monitors_evidence(tmp_path, capsys):
    """A network fault leaves every rank's dump alike: analyze does not call that a
    disagreement, and prints the monitor's own evidence kept in the bundle."""
    sim = SimRanks.start(3)
    job = FRJob(3, flavour="gloo")  # every rank in the same collective: alike
    job.repeat(6, [("0", "all_reduce", [[1024]])])
    for r in sim.ranks:
        r.fr = job.dumps()[r.state["rank"]]
    view = view_of(sim)
    bundles, store = bundles_for(tmp_path)
    net = {**finding(1, [1], summary="every link of h1 failed (4): the network of host h1 is "
                                     "the fault"), "kind": "network"}
    try:
        got = bundles.capture("evict", view, view, net, 3, {"id": 5}, [])
        path = bundles.store.path(got["id"])
    finally:
        bundles.close()
        store.close()
        sim.stop()
    main(["analyze", "--format", "json", path])
    [b] = json.loads(capsys.readouterr().out)["bundles"]
    assert (b["kind"], b["analysis_agrees"], b["flight_recorder_shows"]) == ("network", None, False)
    assert b["summary"].startswith("every link of h1 failed")
    main(["analyze", path])
    out = capsys.readouterr().out
    assert "(network, kept before the kill); a network fault does not show in Flight " \
           "Recorder dumps" in out
    assert "  the monitor's evidence: every link of h1 failed (4)" in out


def test_archive_members_never_become_paths(tmp_path):
    """A hand-made archive with ``../`` and absolute names: only manifest and fr/rank<N>.json
    members are read, each under its own name in a fresh folder."""
    path = tmp_path / "evil.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in (("x/manifest.json", json.dumps({"format": "lightkeeper-incident-bundle",
                                                            "id": "x"}).encode()),
                           ("x/../../escaped.json", b"{}"), ("/tmp/abs.json", b"{}"),
                           ("x/fr/rank1.json", b"{}")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    b = open_bundle(path)
    try:
        assert sorted(os.listdir(b.fr_dir)) == ["rank1.json"]
        assert not (tmp_path.parent / "escaped.json").exists()
    finally:
        b.close()


def test_torchft_quorum_folders_newest_by_default(tmp_path, capsys):
    """torchft's ``<TORCH_FR_DUMP_TEMP_FILE>_quorum_<id>/<global_rank>`` layout: the newest
    quorum's folder unless ``--quorum``; given the prefix or the parent folder."""
    for q, absent in ((3, 0), (4, 2)):
        folder = tmp_path / f"fr_quorum_{q}"
        folder.mkdir()
        for rank, dump in hang_dumps(3, absent=absent).items():
            (folder / str(rank)).write_text(json.dumps(dump))
    for arg in (tmp_path / "fr", tmp_path):
        assert main(["analyze", "--format", "json", str(arg)]) == 1
        report = json.loads(capsys.readouterr().out)
        assert [f["culprit_ranks"] for f in report["findings"]] == [[2]]
        assert [(q["quorum_id"], q["read"]) for q in report["torchft_quorums"]] == [
            (3, False), (4, True)]
    assert main(["analyze", "--format", "json", "--quorum", "3", str(tmp_path)]) == 1
    assert [f["culprit_ranks"] for f in json.loads(capsys.readouterr().out)["findings"]] == [[0]]
    assert main(["analyze", "--format", "json", "--quorum", "9", str(tmp_path)]) == 2
    assert "no torchft folder of quorum 9" in capsys.readouterr().out
    # files beside the quorum folders are not read, and the report says so
    (tmp_path / "rank0").write_text(json.dumps(hang_dumps(3, absent=0)[0]))
    assert main(["analyze", "--format", "json", str(tmp_path)]) == 1
    [error] = json.loads(capsys.readouterr().out)["errors"]
    assert "1 file(s) beside its torchft quorum folders not read" in error["error"], error
    # --quorum where there are no quorum folders: read as given, and said
    assert main(["analyze", "--format", "json", "--quorum", "3", str(tmp_path / "fr_quorum_4")]) == 1
    [error] = json.loads(capsys.readouterr().out)["errors"]
    assert error["error"] == "--quorum 3: no torchft quorum folders here", error


@pytest.fixture
def job():
    j = SimJob(3)
    yield j
    j.stop()


def test_manual_eviction_bundle_listed_downloadable_and_linked(tmp_path, job):
    """A live monitor: the eviction's bundle is written before the kill is sent, named on the
    decision, listed, downloadable, 404 for an unknown or traversing id, linked from the page."""
    dumps = hang_dumps(3, absent=1)
    for r in job.sim.ranks:
        r.fr = dumps[r.state["rank"]]
    cfg = MonitorConfig(port=0, interval_s=0.2, state_path=str(tmp_path / "state.sqlite"),
                        targets=job.sim.urls, sd_out=str(tmp_path / "t.json"), job="sim",
                        lighthouse=job.url, token=TOKEN,
                        rails=RailsConfig(min_replicas=1, cooldown_s=0))
    mon = Monitor(cfg).start()
    kills_seen = []
    original = mon.lighthouse.kill

    def kill(rid):  # what was on disk when the kill went out
        kills_seen.append([r["id"] for r in mon.bundles.store.list()])
        return original(rid)

    mon.lighthouse.kill = kill
    try:
        wait_until(lambda: mon.evidence and 1 in mon.evidence.groups, 10, what="group 1 verified")
        r = requests.post(mon.url + "/v1/evict", json={"replica_group": 1, "reason": "test"},
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert r.status_code == 200, r.text
        bid = r.json()["bundle"]
        assert kills_seen == [[bid]] and job.kills == [job.replica_ids[1]]
        [d] = requests.get(mon.url + "/v1/evictions?decision=evict", timeout=5).json()
        assert d["bundle"] == bid and f"bundle {bid}" in d["detail"]
        listing = requests.get(mon.url + "/v1/incidents", timeout=5).json()
        assert listing["enabled"] and listing["dir"] == str(tmp_path / "incidents")
        [row] = listing["bundles"]
        assert (row["id"], row["trigger"], row["decision_id"], row["replica_group"]) == (
            bid, "evict", d["id"], 1)
        got = requests.get(mon.url + row["download"], timeout=5)
        assert got.status_code == 200 and got.headers["content-type"] == "application/gzip"
        saved = tmp_path / "dl.tar.gz"
        saved.write_bytes(got.content)
        m = json.loads(members(str(saved))["manifest.json"])
        assert m["decision"]["id"] == d["id"] and m["decision"]["status"] == "sending"
        assert sorted(r["rank"] for r in m["ranks"]) == [0, 1, 2]  # the group and its peers
        # the Lighthouse as the monitor last read it: whether torchft still heard the group
        view_doc = json.loads(members(str(saved))["view.json"])
        lh = view_doc["lighthouse"]
        assert lh["error"] is None and lh["quorum_id"] is not None
        assert set(lh["members"]) == set(lh["heartbeat_age_s"]) == set(job.replica_ids.values())
        [g1] = [g for g in view_doc["groups"] if g["replica_group"] == 1]
        assert g1["replica_id"] == job.replica_ids[1]
        assert 0 <= g1["heartbeat_age_s"] < 2.0  # heartbeats every 0.2 s; the timeout is 2 s
        for bad in ("nope", "..%2Fstate.sqlite", "..%2F..%2Fetc%2Fpasswd", "%2Fetc%2Fpasswd"):
            resp = requests.get(f"{mon.url}/v1/incidents/{bad}/bundle", timeout=5)
            assert resp.status_code == 404, bad
        assert f'href="/v1/incidents/{bid}/bundle"' in requests.get(mon.url + "/", timeout=5).text
        store = mon.bundles.store  # pruned between its lookup and its download: 404, not 500
        store.path = lambda _id: str(tmp_path / "pruned.tar.gz")
        assert requests.get(mon.url + row["download"], timeout=5).status_code == 404
        del store.path
        # the goodput ledger's incident of this eviction names its bundle, and the other way
        [inc] = wait_until(lambda: [i for i in requests.get(mon.url + "/v1/goodput", timeout=5)
                                    .json()["incidents"] if i["eviction_id"] == d["id"]], 10,
                           what="the eviction's goodput incident")
        assert inc["bundles"] == [bid]
        [row] = requests.get(mon.url + "/v1/incidents", timeout=5).json()["bundles"]
        assert row["goodput_incident"] == inc["id"]
    finally:
        mon.stop()
