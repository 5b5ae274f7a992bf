"""Ranks on torch's own debug server: the poll adapter (monitor/poll/torch_server.py) and the
rank state made of its answers (monitor/evidence/torch_rank.py).

A real torch ``_WorkerServer`` and a real ``TCPStore`` run in this process. Answers a real
server never gives (garbage, wrong shapes, a 500) come from a small HTTP server of the test's
own that answers what each case sets; the real job is in tests/test_torch_debug_server_e2e.py.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import sys
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from monitor.act.actions import RankCalls
from monitor.analysis import analyze, normalize_dumps
from monitor.analysis.model import GroupKey
from monitor.api.views import ranks_json
from monitor.detect.findings import engine_findings
from monitor.evidence.lighthouse_status import LighthouseStatus, QuorumMember
from monitor.evidence.rank import plain_shape, valid_state
from monitor.evidence.torch_rank import (
    TorchRanks,
    adapted_dump,
    blocked_in,
    combined,
    torch_state,
)
from monitor.poll.admission import AllowList
from monitor.poll.discovery import BadTarget, Discovery, normalize_url
from monitor.poll.fr_bound import REST_S
from monitor.poll.poller import Poller, RankPoll
from monitor.poll.torch_server import (
    RAW_KEY,
    StoreReader,
    TorchAnswer,
    TorchIdentity,
    TorchPoller,
    replica_group_of,
)
from monitor.poll.torch_target import torch_url

NOW = 1_800_000_000.0
RID = {0: "job_0:aaaa", 1: "job_1:bbbb"}


def status(quorum_id: int = 4, groups=(0, 1), step: int = 17) -> LighthouseStatus:
    return LighthouseStatus(quorum_id, {RID[g]: QuorumMember(RID[g], step, f"s{g}:1", 1)
                                          for g in groups},
                            {RID[g]: 0.1 for g in groups})


def entry(rid: int, pg_id: int, seq: int, name: str = "", created_s: float = NOW - 60) -> dict:
    return {"record_id": rid, "pg_id": pg_id, "process_group": [name, ""],
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": "gloo:all_reduce", "time_created_ns": int(created_s * 1e9),
            "input_sizes": [[8]], "output_sizes": [[8]], "input_dtypes": ["Float"],
            "output_dtypes": ["Float"], "state": "scheduled", "retired": True, "is_p2p": False,
            "timeout_ms": 60000}


def torch_dump(last_seq: int, pending: bool, old_pg: bool = False) -> dict:
    """A gloo rank's dump in a torchft job: torchft's group ('') in its newest incarnation
    (pg_id 1), enqueued up to ``last_seq``; ``pending``: the last one not completed."""
    entries = [entry(i, 0, i + 1) for i in range(5)] if old_pg else []
    entries += [entry(100 + s, 1, s, created_s=NOW - 30 + s) for s in range(1, last_seq + 1)]
    done = last_seq - 1 if pending else last_seq
    return {"version": "2.10", "comm_lib_version": "", "entries": entries,
            "pg_config": {"": {"name": "", "desc": "", "ranks": "[0, 1]"}},
            "pg_status": {"1": {"last_enqueued_collective": str(last_seq),
                                "last_completed_collective": str(done),
                                "last_started_collective": "-1"}}}


def ident(g: int) -> TorchIdentity:
    return TorchIdentity(RID[g], g, 0, 1, f"s{g}:1")


# --- the rank state and the dump -------------------------------------------------------------

def test_state_and_dumps_of_torch_only_ranks_drive_the_engine_to_the_hang():
    lh = status()
    raws = {0: TorchAnswer(("fr_trace_json", "dump_traceback"), torch_dump(11, pending=True)),
            1: TorchAnswer(("fr_trace_json",), torch_dump(10, pending=False, old_pg=True))}
    states = {g: torch_state(f"torch+http://h{g}:1", ident(g), raws[g], lh, NOW, "job")
              for g in (0, 1)}
    for s in states.values():  # the one rank-state form: the view reads it as any answer
        assert valid_state(s) is None and plain_shape(s) is not None
        assert s["quorum_id"] == 4 and s["step"] == 17 and s["participating"]
        assert s["torch_only"]["cannot_show"]
    s0, s1 = states[0], states[1]
    assert s0["timing"]["waiting"] == {"scope": "cross", "seconds": pytest.approx(19.0)}
    assert s0["phase"] == "allreduce" and s0["phase_since"] == pytest.approx(NOW - 19, abs=1e-6)
    assert s0["stacks_url"] == "http://h0:1/handler/dump_traceback"
    assert s1["timing"]["waiting"] is None and s1["phase"] == "unknown"
    assert s1["stacks_url"] is None

    dumps = {s["rank"]: adapted_dump(raws[g].dump, s, lh, NOW) for g, s in states.items()}
    inc = dumps[1]["incarnations"]
    assert inc == [{"pg_id": 1, "pg_name": "", "quorum_id": 4, "group_rank": 0,
                    "replica_rank": 1, "replica_world_size": 2, "global_ranks": [0, 1],
                    "first_record_id": 101}]
    assert {e["pg_id"] for e in dumps[1]["entries"]} == {1}  # the older incarnation left out
    assert dumps[1]["pg_config"] == {} and dumps[1]["rank"] == 1
    hangs = [f for f in engine_findings(analyze(dumps)) if f["kind"] == "hang"]
    assert [(h["culprits"], h["waiting"], h["quorum_id"]) for h in hangs] == [([1], [0], 4)]


def test_a_group_left_out_of_the_quorum_has_no_incarnation_and_no_step():
    lh = status(groups=(0,))
    s = torch_state("torch+http://h:1", ident(1), TorchAnswer((), torch_dump(3, False)), lh, NOW,
                    "j")
    assert (s["quorum_id"], s["step"], s["participating"]) == (-1, -1, False)
    assert adapted_dump(torch_dump(3, False), s, lh, NOW)["incarnations"] == []
    blind = torch_state("torch+http://h:1", ident(1), TorchAnswer(()), None, NOW, "j")  # no LH
    assert valid_state(blind) is None and blind["quorum_id"] == -1


def test_in_group_and_stale_pending_collectives():
    d = torch_dump(4, pending=False, old_pg=True)
    d["entries"].append(entry(300, 7, 3, name="1", created_s=NOW - 5))  # an in-group group
    d["pg_status"]["7"] = {"last_enqueued_collective": "3", "last_completed_collective": "2"}
    d["pg_status"]["0"] = {"last_enqueued_collective": "5", "last_completed_collective": "1"}
    scope, secs, e = blocked_in(d, NOW)  # pg_id 0: an older torchft incarnation, not a wait
    assert (scope, e["pg_id"]) == ("group", 7) and secs == pytest.approx(5)


@pytest.mark.parametrize("dump", [
    {}, {"entries": "x", "pg_status": {}}, {"entries": [1, None, "e"], "pg_status": [1]},
    {"entries": [{"pg_id": "z", "process_group": 3}], "pg_status": {"z": {"x": 1}}},
    {"entries": [entry(0, 1, 2) | {"time_created_ns": "soon"}],
     "pg_status": {"1": {"last_enqueued_collective": "2", "last_completed_collective": "1"}}},
])
def test_garbage_dumps_give_a_state_without_waits(dump):
    assert blocked_in(dump, NOW) is None
    s = torch_state("torch+http://h:1", ident(0), TorchAnswer((), dump), status(), NOW, "j")
    assert valid_state(s) is None and s["timing"]["waiting"] is None
    adapted_dump(dump, s, status(), NOW)  # no exception


def _torch_only_view(groups=(0, 1, 2), torch_only=True, step_s=None):
    """The view of single-rank groups on torch's debug server only, verified against a
    Lighthouse that lists them in quorum 1."""
    from monitor.evidence.verification import Verifier
    from monitor.evidence.view import ViewBuilder
    from monitor.poll.discovery import Target

    rid = {g: f"job_{g}:u{g}" for g in groups}
    lh = LighthouseStatus(1, {rid[g]: QuorumMember(rid[g], 40, f"s{g}:1", 1)
                              for g in groups}, {rid[g]: 0.1 for g in groups})
    polls, targets = {}, []
    for g in groups:
        url = f"torch+http://h:{100 + g}"
        state = torch_state(url, TorchIdentity(rid[g], g, 0, 1, f"s{g}:1"), TorchAnswer(()), lh,
                            NOW, "j", step_s=step_s)
        if not torch_only:
            del state["torch_only"]
        polls[url] = RankPoll(url, True, state, at=NOW)
        targets.append(Target(url, "torch_store"))
    verifier = Verifier()
    return ViewBuilder().update(targets, polls, now=NOW, judge=lambda ranks, changed: (
        verifier.judge(ranks, changed, lh, None, True, NOW)))


def test_a_torch_only_straggler_lags_by_the_share_of_a_step_lightkeepers_ranks_must():
    """--straggler-rel-lag (25%) of the step the Lighthouse's step counter shows: a group 40 ms
    late is no straggler in a job of 0.35-s steps (one 11 ms late on a busy host was evicted),
    and is one in a job of 0.1-s steps."""
    from monitor.detect import Detectors
    from tests.support.frgen import FRJob

    job = FRJob(3, flavour="gloo", hosts={r: "h0" for r in range(3)}, replica_group_size=1,
                jitter_ms=1.0, compute_ms=20.0, seed=3)
    job.quorum(1, [0, 1, 2])
    for _ in range(60):
        job.ft_collective("all_reduce", [[4096]], delay_ms={2: 40.0})
    for step_s, found in ((0.35, []), (0.1, [(2, [2])])):
        view = _torch_only_view(step_s=step_s)
        new = Detectors().update(view.evidence(), job.dumps(), NOW, full_view=view)
        assert [(f.replica_group, f.ranks) for f in new if f.kind == "straggler"] == found


def test_straggler_of_torch_only_groups_from_their_dumps():
    """No step timing on torch's server: the engine's straggler (here enqueue times of ranks on
    one host) becomes the finding, only for torch-only groups, and resolves once gone."""
    from monitor.detect import Detectors
    from tests.support.frgen import FRJob

    job = FRJob(3, flavour="gloo", hosts={r: "h0" for r in range(3)}, replica_group_size=1,
                jitter_ms=1.0, compute_ms=20.0, seed=3)
    job.quorum(1, [0, 1, 2])
    for _ in range(60):
        job.ft_collective("all_reduce", [[4096]], delay_ms={2: 40.0})
    view = _torch_only_view()
    assert all(r.trust.state == "verified" for r in view.ranks.values())
    det = Detectors()
    new = det.update(view.evidence(), job.dumps(), NOW, full_view=view)
    found = [f for f in new if f.kind == "straggler"]
    assert [(f.replica_group, f.ranks) for f in found] == [(2, [2])], new
    ev = found[0].evidence
    assert ev["source"] == "flight_recorder" and ev["clock"] == "host_clock" and ev["z"] > 4
    healthy = FRJob(3, flavour="gloo", hosts={r: "h0" for r in range(3)},
                    replica_group_size=1, seed=3)
    healthy.quorum(1, [0, 1, 2])
    for _ in range(60):
        healthy.ft_collective("all_reduce", [[4096]])
    det.update(view.evidence(), healthy.dumps(), NOW + 20, full_view=view)
    assert not [f for f in det.open_findings() if f.kind == "straggler"]
    assert det.resolved_findings()[-1].resolution == "caught_up"
    # ranks with their own step timing: the timing detector's, not the Flight Recorder's
    lk = _torch_only_view(torch_only=False)
    assert not [f for f in Detectors().update(lk.evidence(), job.dumps(), NOW, full_view=lk)
                if f.kind == "straggler"]


# --- the poll adapter against a real torch _WorkerServer and a server answering garbage --------

@pytest.fixture(scope="module")
def torch_worker_server():
    c10d = pytest.importorskip("torch._C._distributed_c10d")
    server = c10d._WorkerServer("127.0.0.1", 0)
    yield f"torch+http://127.0.0.1:{server.port}"
    server.shutdown()


def test_real_torch_server_read_and_adapted(torch_worker_server):
    poller = TorchPoller(timeout_s=5, fr_timeout_s=5)
    try:
        p = poller.sweep([torch_worker_server])[torch_worker_server]
        assert p.ok, p.error
        raw = p.data[RAW_KEY]
        assert {"fr_trace_json", "dump_traceback", "ping"} <= set(raw.handlers)
        assert raw.error is None and raw.dump["version"]
        polls = {torch_worker_server: p}
        ranks = TorchRanks("j")
        ranks.adapt(polls, {torch_worker_server: ident(1)}, status(), NOW)
        s = polls[torch_worker_server].data
        assert valid_state(s) is None and s["rank"] == 1 and s["replica_id"] == RID[1]
        assert ranks.dumps[torch_worker_server]["replica_group"] == 1
        ranks.adapt(polls := {torch_worker_server: poller.sweep([torch_worker_server])[torch_worker_server]}, {},
                    status(), NOW)
        assert not polls[torch_worker_server].ok  # whose rank it is: unknown
        assert "--torch-stores" in polls[torch_worker_server].error
    finally:
        poller.close()


def test_a_rank_whose_server_went_away_is_unreachable_at_once():
    """The handler list is kept 30 s: a dead rank's next poll asks only its dump, and a dump
    refused was still an answered poll (its death, its kill's confirmation 30 s late)."""
    c10d = pytest.importorskip("torch._C._distributed_c10d")
    server = c10d._WorkerServer("127.0.0.1", 0)
    url = f"torch+http://127.0.0.1:{server.port}"
    poller = TorchPoller(timeout_s=5, fr_timeout_s=5)
    try:
        assert poller.sweep([url])[url].ok
        server.shutdown()
        p = poller.sweep([url])[url]
        # (read through fr_trace_json, or through lightkeeper_state where another test of this
        # process registered Lightkeeper's handlers in torch's server: both unreachable now)
        assert not p.ok and p.reason == "connection", p
    finally:
        poller.close()


class _Answers(BaseHTTPRequestHandler):
    routes: dict = {}
    asked: list = []

    def _answer(self) -> None:
        self.asked.append((self.command, self.path))
        got = self.routes.get((self.command, self.path), (404, b"no handler"))
        if isinstance(got, threading.Event):  # a rank gone dark: no answer until it is set
            got.wait(60)
            return
        status, body = got
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def garbage_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    t = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    t.start()
    yield f"torch+http://127.0.0.1:{server.server_address[1]}", _Answers.routes
    server.shutdown()
    server.server_close()
    t.join()


def _listing(*names: str) -> tuple[int, bytes]:
    return 200, json.dumps(list(names)).encode()


STATE = {"replica_group": 2, "rank": 4, "group_rank": 0, "group_world_size": 2, "step": 9,
         "quorum_id": 3, "phase": "forward", "phase_since": NOW, "replica_id": "x_2:c",
         "recent_step_seconds": [0.1, 0.2]}


@pytest.mark.parametrize("routes, ok, said", [
    ({("GET", "/handler/"): (200, b'{"not": "a list"}')}, False, "list of handler names"),
    ({("GET", "/handler/"): (200, b"<html>")}, False, "GET /handler/"),
    ({("GET", "/handler/"): (200, b"[" * 50_000)}, False, "recursion"),
    ({("GET", "/handler/"): (500, b"boom")}, False, "HTTP 500"),
    ({("GET", "/handler/"): _listing("ping")}, True, "no fr_trace_json handler"),
    ({("GET", "/handler/"): _listing("fr_trace_json"),
      ("POST", "/handler/fr_trace_json"): (200, b"nonsense")}, True, "not JSON"),
    ({("GET", "/handler/"): _listing("fr_trace_json"),
      ("POST", "/handler/fr_trace_json"): (200, b"[1, 2]")}, True, "a JSON object"),
    ({("GET", "/handler/"): _listing("fr_trace_json"),
      ("POST", "/handler/fr_trace_json"): (500, b"dump failed")}, True, "HTTP 500"),
    ({("GET", "/handler/"): _listing("fr_trace_json"),
      ("POST", "/handler/fr_trace_json"): (200, b"{" + b" " * 5000 + b"}")}, True,
     "at most 4096 bytes"),
    ({("GET", "/handler/"): _listing("fr_trace_json", "dump_nccl_trace_json"),
      ("POST", "/handler/fr_trace_json"): (200, b'{"version": "2.10", "entries": []}'),
      ("POST", "/handler/dump_nccl_trace_json"): (500, b"nccl dump failed")}, True,
     "dump_nccl_trace_json: HTTP 500"),
])
def test_a_rank_answering_garbage_is_said_never_raised(garbage_server, routes, ok, said):
    url, table = garbage_server
    table.clear()
    table.update(routes)
    poller = TorchPoller(timeout_s=2, fr_timeout_s=2, max_fr_bytes=4096)
    try:
        p = poller.sweep([url])[url]
    finally:
        poller.close()
    assert p.ok is ok
    if not ok:
        assert said in p.error and p.reason in ("bad_response", "http_status")
        return
    assert said in p.data[RAW_KEY].error
    polls = {url: p}
    TorchRanks("j").adapt(polls, {url: ident(0)}, status(), NOW)
    s = polls[url].data  # the rank answers: a state, its Flight Recorder said unreadable
    assert valid_state(s) is None and said in s["torch_only"]["flight_recorder"]


def test_handler_list_asked_again_after_a_404(garbage_server):
    """A handler that vanished (a restarted rank on the same port): its list is asked again."""
    url, table = garbage_server
    table.clear()
    _Answers.asked.clear()
    table[("GET", "/handler/")] = _listing("fr_trace_json")
    poller = TorchPoller(timeout_s=2)
    try:
        for _ in range(3):
            p = poller.sweep([url])[url]
            assert p.ok and "HTTP 404" in p.data[RAW_KEY].error
    finally:
        poller.close()
    assert _Answers.asked.count(("GET", "/handler/")) == 3


@contextlib.contextmanager
def dump_gone_dark(garbage_server, fr_timeout_s: float):
    """A torch rank whose dump answered once, at once, and then never comes: (url, poller)."""
    url, table = garbage_server
    table.clear()
    table[("GET", "/handler/")] = _listing("fr_trace_json")
    table[("POST", "/handler/fr_trace_json")] = (200, b'{"version": "2.10", "entries": []}')
    poller = TorchPoller(timeout_s=2, fr_timeout_s=fr_timeout_s)
    dark = threading.Event()
    try:
        p = poller.sweep([url])[url]
        assert p.ok and p.data[RAW_KEY].dump == {"version": "2.10", "entries": []}
        table[("POST", "/handler/fr_trace_json")] = dark
        yield url, poller
    finally:
        dark.set()
        poller.close()


def test_a_dump_that_stops_coming_holds_the_sweep_about_a_second(garbage_server):
    """``fr_timeout_s`` 30: a rank whose dump answered at once and then never comes is waited
    for as its last answer allows (monitor/poll/fr_bound.py), not 30 s; its state still comes,
    its Flight Recorder said unread."""
    with dump_gone_dark(garbage_server, 30) as (url, poller):
        p = poller.sweep([url])[url]
        assert p.ok and p.data[RAW_KEY].dump is None
        # 4x its first answer's time, at least 1 s (a busy machine may slow that answer)
        waited = re.search(r"no answer within ([0-9.]+)s", p.data[RAW_KEY].error)
        assert waited and 1.0 <= float(waited.group(1)) < 5.0, p.data[RAW_KEY].error


def test_a_dump_wedged_past_the_whole_timeout_is_not_asked_for_a_while(garbage_server):
    """Each sweep of a torch rank asks its dump: one that runs out of the whole ``fr_timeout_s``
    (2 s here) is not asked in the next sweeps (monitor/poll/fr_bound.py), its state saying so."""
    with dump_gone_dark(garbage_server, 2) as (url, poller):
        errors = [poller.sweep([url])[url].data[RAW_KEY].error for _ in range(3)]
        assert "no answer within" in errors[0] and "no answer within 2.00s" in errors[1], errors
        assert errors[2].startswith(f"its dump did not answer in 2 s; not asked for {REST_S:g} s")


def test_a_crashed_rank_whose_port_still_takes_connections_is_unreachable_at_once():
    """torch's rank-0 frontend, forked from the rank, keeps the rank's listening socket when the
    rank crashes: connections are taken, never answered. The next sweep, on the handler list it
    kept, finds the rank unreachable, not answering with its dump unread: a sweep later the
    Lighthouse may have dropped the group (a 1 s heartbeat timeout) and the rank be unverified."""
    answers = type("_Crashing", (_Answers,), {"routes": {
        ("GET", "/handler/"): _listing("fr_trace_json"),
        ("POST", "/handler/fr_trace_json"): (200, b'{"version": "2.10", "entries": []}')}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), answers)
    t = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    t.start()
    url = f"torch+http://127.0.0.1:{server.server_address[1]}"
    poller = TorchPoller(timeout_s=1, fr_timeout_s=30)
    try:
        assert poller.sweep([url])[url].ok
        server.shutdown()  # no more accept(); its listening socket stays open, as the fork's
        t.join()
        p = poller.sweep([url])[url]
        assert not p.ok and p.reason == "timeout", p
    finally:
        poller.close()
        server.server_close()


def test_lightkeeper_handlers_on_torch_server_read_as_the_full_state(garbage_server):
    url, table = garbage_server
    table.clear()
    table.update({("GET", "/handler/"): _listing("fr_trace_json", "lightkeeper_state",
                                                 "lightkeeper_stacks", "lightkeeper_fr_trace"),
                  ("POST", "/handler/lightkeeper_state?recent=16"):
                      (200, json.dumps(STATE).encode()),
                  ("POST", "/handler/lightkeeper_fr_trace?last=5"):
                      (200, b'{"version": "2.10", "entries": [], "rank": 4}')})
    poller, lk_poller = TorchPoller(timeout_s=2), Poller(timeout_s=2)
    try:
        p = poller.sweep([url], ["?recent=16"])[url]
        assert p.ok and p.data["rank"] == 4 and p.data["phase"] == "forward", p.error
        assert type(p.data["recent_step_seconds"]) is bytes  # kept packed, as /v1/state's
        assert p.data["stacks_url"].endswith("/handler/lightkeeper_stacks")
        polls = {url: p}
        TorchRanks("j").adapt(polls, {}, status(), NOW)  # a full state: left as it is
        assert polls[url] is p
        # a rank's JSON cannot pass for torch's answer: left for the view to refuse
        fake = RankPoll(url, True, {RAW_KEY: {"handlers": [], "dump": None}})
        TorchRanks("j").adapt(polls := {url: fake}, {url: ident(0)}, status(), NOW)
        assert polls[url] is fake and valid_state(fake.data) is not None
        fr = lk_poller.sweep([url], "/v1/fr_trace?last=5")[url]  # the monitor's poller
        assert fr.ok and fr.data["rank"] == 4
        table[("POST", "/handler/lightkeeper_state?recent=16")] = (200, b"{garbage")
        bad = poller.sweep([url], ["?recent=16"])[url]
        assert not bad.ok and bad.reason == "bad_response"
        # a culprit's stacks, read when its finding opens (POSTed; a missing handler said)
        table[("POST", "/handler/lightkeeper_stacks")] = (200, b"Thread 0x1 (most recent)")
        gone = p.data["stacks_url"].replace("lightkeeper_stacks", "dump_traceback")
        got = poller.stacks([p.data["stacks_url"], gone])
        assert got[p.data["stacks_url"]] == "Thread 0x1 (most recent)"
        assert got[gone].startswith("(no stacks: HTTP 404")
    finally:
        poller.close()
        lk_poller.close()


def test_monitor_sweep_reads_a_rank_through_lightkeeper_handlers(garbage_server, tmp_path):
    """The monitor's own loop: a static torch+http target whose server has Lightkeeper's
    handlers is polled through lightkeeper_state and its dump read through
    lightkeeper_fr_trace (no Lighthouse: nothing is verified, nothing acted on); an incident
    bundle reads its stacks and dump through those handlers too."""
    from monitor.config import MonitorConfig
    from monitor.service import Monitor

    url, table = garbage_server
    table.clear()
    _Answers.asked.clear()
    doc = json.dumps({**STATE, "phase_since": NOW, "quorum_id": 3}).encode()
    table.update({("GET", "/handler/"): _listing("lightkeeper_state", "lightkeeper_fr_trace"),
                  ("POST", "/handler/lightkeeper_fr_trace?last=256"): (
                      200, json.dumps({"version": "2.10", "entries": [], "rank": 4,
                                       "replica_group": 2}).encode())})
    for q in ("?recent=16&packed=1", "?recent=16", ""):
        table[("POST", "/handler/lightkeeper_state" + q)] = (200, doc)
    mon = Monitor(MonitorConfig(targets=[url], state_path=str(tmp_path / "m.sqlite"),
                                sd_out=None))
    try:
        mon.sweep_once()
        row = next(r for r in ranks_json(mon.view, mon.clock()) if r["url"] == url)
        assert row["reachable"] and row["rank"] == 4 and row["phase"] == "forward", row
        assert row["torch_only"] is None  # the full state: nothing it cannot show
        assert ("POST", "/handler/lightkeeper_fr_trace?last=256") in _Answers.asked
        assert mon.cluster_json()["torch_only"]["store_discovery"] is False
        # an incident bundle asks the same handlers for the rank's stacks and whole dump
        table[("POST", "/handler/lightkeeper_stacks?format=json")] = (200, b'{"threads": []}')
        table[("POST", "/handler/lightkeeper_fr_trace")] = (200, b'{"entries": [], "rank": 4}')
        got = mon.bundles.capture("evict", mon.view, mon.view, {"kind": "hang",
                                  "replica_group": 2, "ranks": [4]}, None, None, [])
        assert got["ranks_complete"] == 1 and not got["not_fetched"], got
    finally:
        mon.stop()


def test_unreachable_rank_is_a_connection_failure():
    poller = TorchPoller(timeout_s=1)
    try:
        url = f"torch+http://{CLOSED}"
        p = poller.sweep([url])[url]
    finally:
        poller.close()
    assert not p.ok and p.reason == "connection"


# --- finding the ranks: the groups' TCPStores, target spelling -------------------------------

def test_store_reader_finds_ranks_the_lighthouse_vouches_for():
    dist = pytest.importorskip("torch.distributed")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    addr = f"127.0.0.1:{store.port}"
    store.set("replica_id", "ft_3:uuid")
    store.set("debug_server/rank0", "http://node7:4100")
    reader = StoreReader(timeout_s=5, forget_after_s=30)  # what is found is checked, not when
    found = reader.read([("ft_3:uuid", addr, 2)], NOW)
    assert found == {"torch+http://node7:4100": TorchIdentity("ft_3:uuid", 3, 0, 2, addr)}
    assert found["torch+http://node7:4100"].rank == 6
    store.set("debug_server/rank1", "http://node8:4100")
    assert len(reader.read([("ft_3:uuid", addr, 2)], NOW + 1)) == 1  # asked again later
    assert len(reader.read([("ft_3:uuid", addr, 2)], NOW + 10)) == 2
    # a store that holds another replica id vouches for nobody
    assert reader.read([("ft_4:other", addr, 2)], NOW + 11) .keys() == found.keys() | {
        "torch+http://node8:4100"}
    assert "holds replica_id 'ft_3:uuid', not 'ft_4:other'" in reader.error
    # no group number in the replica id; a store nobody serves
    reader.read([("nodigits:uuid", addr, 1)], NOW + 12)
    assert "names no replica group number" in reader.error
    reader.read([("ft_5:u", CLOSED, 1)], NOW + 13)
    assert f"cannot read store {CLOSED}" in reader.error
    # the Lighthouse stopped listing them: forgotten
    assert reader.read([], NOW + 100) == {}


def test_a_group_whose_store_moved_keeps_only_the_ranks_of_its_new_store():
    """The Lighthouse lists a replica id at a new store address (its store's host restarted
    elsewhere, same id): the ranks found in the old store are no longer vouched for."""
    dist = pytest.importorskip("torch.distributed")
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                            timeout=timedelta(seconds=5)) for _ in range(2)]
    for store, node in zip(stores, ("node7", "node9"), strict=True):
        store.set("replica_id", "ft_3:uuid")
        store.set("debug_server/rank0", f"http://{node}:4100")
    old, new = (f"127.0.0.1:{s.port}" for s in stores)
    reader = StoreReader(timeout_s=5, forget_after_s=30)
    assert set(reader.read([("ft_3:uuid", old, 2)], NOW)) == {"torch+http://node7:4100"}
    assert set(reader.read([("ft_3:uuid", new, 2)], NOW + 1)) == {"torch+http://node9:4100"}


def test_a_read_of_the_old_store_ending_after_the_move_brings_no_old_rank_back(monkeypatch):
    """The old store's read is still running when the group moves to a new store; when it
    ends, its ranks are not vouched for again. The store reads are FAKED at StoreReader._start
    (a read held open by the test), since a real store cannot be held mid-answer on cue."""
    from monitor.poll import torch_server as ts

    gate, old_reads = threading.Event(), []

    def start(self, rid, store, ws):
        def fetch():
            if store == "old:1":
                gate.wait(10)
            host = store.split(":")[0]
            return ts._Got({f"torch+http://{host}:9": TorchIdentity(rid, 0, 0, 1, store)}, True)
        reading = ts._Reading(fetch)
        if store == "old:1":
            old_reads.append(reading)
        return reading

    monkeypatch.setattr(ts.StoreReader, "_start", start)
    reader = StoreReader(timeout_s=0.2)
    assert reader.read([("g0:abc", "old:1", 1)], NOW) == {}  # held open
    moved = [("g0:abc", "new:1", 1)]
    assert set(reader.read(moved, NOW + 1)) == {"torch+http://new:9"}
    gate.set()
    assert old_reads[0].done.wait(5), "the old read to end"
    assert set(reader.read(moved, NOW + 2)) == {"torch+http://new:9"}


CLOSED = "127.0.0.1:1"  # nothing listens there (a port bound and let go may be another test's)


@pytest.fixture
def unlistened():
    """A socket bound, not listening: its port refuses connections until the test listens and
    hands it to a store. Never let go, so no other test's can take that port meanwhile."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock


def test_a_gone_store_costs_no_torch_call_and_is_said_once(capfd, caplog):
    """A group that ended while the Lighthouse still lists it in its last quorum: its store's
    port is closed. torch's client would retry it for its whole timeout (~2 s a read) and write
    some 30 lines of C++ errors and stack frames to stderr a try, every 5 s."""
    pytest.importorskip("torch.distributed")
    dead = CLOSED
    reader = StoreReader()  # the monitor's: 1 s
    with caplog.at_level("WARNING", logger="monitor.poll.torch_server"):
        for i in range(4):
            t0 = time.monotonic()
            assert reader.read([("ft_5:u", dead, 1)], NOW + 100 * i) == {}
            took = time.monotonic() - t0
            assert took < 1.0, took  # docs: a store read blocks the sweep one second at most
    assert f"cannot read store {dead} of 'ft_5:u': ConnectionRefusedError" in reader.error
    assert len([r for r in caplog.records if "cannot read store" in r.getMessage()]) == 1
    err = capfd.readouterr().err
    assert "c10d" not in err and "socket.cpp" not in err, err[:400]


def test_a_store_that_cannot_be_read_is_read_less_and_less_often(monkeypatch, unlistened):
    dist = pytest.importorskip("torch.distributed")
    tries: list[float] = []
    connect, at = socket.create_connection, [0.0]

    def counted(addr, *args, **kwargs):
        if addr[1] == port:
            tries.append(at[0])
        return connect(addr, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", counted)
    port = unlistened.getsockname()[1]
    dead = f"127.0.0.1:{port}"
    reader = StoreReader(timeout_s=5)  # what is read and when, not how long it may take

    def sweeps(start: float, end: float, found: int = 0) -> None:
        for t in range(int(start), int(end) + 1, 5):  # the Lighthouse lists it every sweep
            at[0] = t
            assert len(reader.read([("ft_5:u", dead, 2)], NOW + t)) == found, t

    sweeps(0, 5)
    assert tries == [0, 5]
    sweeps(10, 240)  # 5 s, then twice as long after each further failure, up to 80 s
    assert tries == [0, 5, 15, 35, 75, 155, 235]
    # the store comes up, one rank's address in it: read at its turn, then every 5 s again
    unlistened.listen(16)
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5), master_listen_fd=unlistened.detach())
    store.set("replica_id", "ft_5:u")
    store.set("debug_server/rank0", "http://node7:4100")
    sweeps(240, 310)
    sweeps(315, 315, found=1)
    store.set("debug_server/rank1", "http://node8:4100")
    sweeps(316, 319, found=1)
    sweeps(320, 320, found=2)
    assert tries[-1] == 315  # read at 320 on the connection made at 315


class _Relay:
    """A TCP relay in front of a store: the connections its server is asked to take, and those
    still open. (torch's store server looks up every new client's name on the thread that
    serves the whole store: each connection can hold the job's own store calls.)"""

    def __init__(self, port: int) -> None:
        self.accepted, self.open = 0, []
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, args=(port,), daemon=True).start()

    def _accept(self, port: int) -> None:
        with contextlib.suppress(OSError):
            while True:
                pair = (self._server.accept()[0], socket.create_connection(("127.0.0.1", port)))
                with self._lock:
                    self.accepted += 1
                    self.open.append(pair)
                for src, dst in (pair, pair[::-1]):
                    threading.Thread(target=self._pump, args=(src, dst, pair),
                                     daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, pair: tuple) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        self._drop(pair)

    def _drop(self, pair: tuple) -> None:
        for sock in pair:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the other pump
            sock.close()
        with self._lock:
            if pair in self.open:
                self.open.remove(pair)

    def cut(self) -> None:
        """Every connection dropped, as when the store's process restarts on the same port."""
        for pair in list(self.open):
            self._drop(pair)

    def wait_open(self, n: int) -> int:
        deadline = time.monotonic() + 5
        while len(self.open) != n and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(self.open)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        self.cut()


def test_a_store_read_again_and_again_is_read_on_one_connection():
    """A group whose ranks have not all written their addresses is read every 5 s: on one
    connection, not a new one a read (each cost the store's server a name lookup, which stalled
    the reads and the job's own store calls for seconds at a time). Every read answers; the
    connection closes when its group is forgotten."""
    dist = pytest.importorskip("torch.distributed")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    store.set("replica_id", "ft_3:uuid")
    store.set("debug_server/rank0", "http://node7:4100")
    relay = _Relay(store.port)
    # what answers, not how soon: a read takes milliseconds, a connection's name lookup may not
    reader = StoreReader(timeout_s=10, forget_after_s=30)
    group, rank0 = [("ft_3:uuid", relay.addr, 2)], {"torch+http://node7:4100"}
    try:
        for i in range(40):
            assert reader.read(group, NOW + 5 * i).keys() == rank0, i
            assert reader.error is None, (i, reader.error)
            assert relay.accepted <= 2, (i, relay.accepted)  # the plain connect, torch's client
        assert relay.wait_open(1) == 1
        # its process restarts on the same port: the next read connects again, said nowhere
        relay.cut()
        assert reader.read(group, NOW + 200).keys() == rank0 and reader.error is None
        assert relay.accepted == 4 and relay.wait_open(1) == 1
        # forgotten: its connection closes; listed again, read on a new one
        assert reader.read([], NOW + 230) == {} and relay.wait_open(0) == 0
        assert reader.read(group, NOW + 240).keys() == rank0 and relay.accepted == 6
        # every rank found: read again every 30 s, on that same connection
        store.set("debug_server/rank1", "http://node8:4100")
        assert len(reader.read(group, NOW + 245)) == 2
        store.set("debug_server/rank1", "http://node8:4200")  # rank 1 restarted
        assert "torch+http://node8:4100" in reader.read(group, NOW + 274)
        assert "torch+http://node8:4200" in reader.read(group, NOW + 275)
        assert relay.accepted == 6 and reader.error is None
    finally:
        relay.close()


def test_a_group_restarted_on_its_kept_store_finds_its_new_ranks():
    """torchrun restarts a group's workers on its agent's store (TORCHELASTIC_USE_AGENT_STORE):
    the old ranks' keys survive, and the new Manager writes its replica id before every new rank
    has rewritten its address. The read that then holds every rank, one of them the old
    incarnation's, is not the last: the store is read again 30 s later and the new rank found."""
    dist = pytest.importorskip("torch.distributed")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    addr = f"127.0.0.1:{store.port}"
    store.set("replica_id", "ft_1:old")
    store.set("debug_server/rank0", "http://node7:1000")
    store.set("debug_server/rank1", "http://node8:1001")
    reader = StoreReader(timeout_s=5, forget_after_s=30)
    assert len(reader.read([("ft_1:old", addr, 2)], NOW)) == 2
    store.set("replica_id", "ft_1:new")  # the workers restarted; rank 1 not registered yet
    store.set("debug_server/rank0", "http://node7:2000")
    new = [("ft_1:new", addr, 2)]
    found = reader.read(new, NOW + 1)
    assert found["torch+http://node8:1001"].replica_id == "ft_1:new"  # its old address
    store.set("debug_server/rank1", "http://node8:2001")
    for t in range(2, 31):  # forget_after_s: the old incarnation's ranks are gone by now
        reader.read(new, NOW + t)
    found = reader.read(new, NOW + 31)
    assert {u: (i.replica_id, i.group_rank) for u, i in found.items()} == {
        "torch+http://node7:2000": ("ft_1:new", 0), "torch+http://node8:2001": ("ft_1:new", 1)}
    # restarted again: its old address stops answering, and the store is read again within
    # STORE_RETRY_S, not STORE_REFRESH_S (before the dead detector could name the new group)
    store.set("debug_server/rank1", "http://node8:3001")
    gone = ["torch+http://node8:2001"]
    assert "torch+http://node8:2001" in reader.read(new, NOW + 32, failed=gone)  # read at 31
    found = reader.read(new, NOW + 36, failed=gone)
    assert "torch+http://node8:3001" in found and "torch+http://node8:2001" not in found


def test_a_dead_store_whose_ranks_fail_every_sweep_backs_off(monkeypatch):
    """The store's host died with its ranks: their polls fail every sweep, and the store is
    still asked only as its back-off says (5 s doubling to 80 s), not every 5 s."""
    dist = pytest.importorskip("torch.distributed")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    store.set("replica_id", "ft_1:u")
    store.set("debug_server/rank0", "http://node7:1000")
    relay = _Relay(store.port)
    port = int(relay.addr.rsplit(":", 1)[1])
    tries: list[int] = []
    at = [0]
    connect = socket.create_connection

    def counted(address, *a, **k):
        if address[1] == port:
            tries.append(at[0])
        return connect(address, *a, **k)
    monkeypatch.setattr(socket, "create_connection", counted)
    reader = StoreReader(timeout_s=5)
    groups = [("ft_1:u", relay.addr, 1)]
    assert len(reader.read(groups, NOW)) == 1
    relay.close()  # refused from now on, and its rank too
    for at[0] in range(31, 300):  # a sweep a second
        reader.read(groups, NOW + at[0], failed=["torch+http://node7:1000"])
    assert len(tries) <= 8, tries


def test_a_store_that_never_answers_holds_the_sweep_its_timeout_only():
    """torch's client waits for its ping's reply without end on a port that takes connections
    and never answers (TCPStore's timeout does not cover it): the sweep waits the reader's
    timeout, the other stores are read meanwhile, and that store is not read again while its
    read is under way."""
    dist = pytest.importorskip("torch.distributed")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    store.set("replica_id", "ft_3:uuid")
    store.set("debug_server/rank0", "http://node7:4100")
    live = f"127.0.0.1:{store.port}"
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    mute = f"127.0.0.1:{silent.getsockname()[1]}"
    conns: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conns.append(silent.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    reader = StoreReader(timeout_s=0.3)
    groups = [("ft_3:uuid", live, 1), ("ft_4:u", mute, 1)]
    got: list = []

    def sweep(now: float) -> float:
        t0 = time.monotonic()
        got.clear()
        th = threading.Thread(target=lambda: got.append(reader.read(groups, now)), daemon=True)
        th.start()
        th.join(10)  # torch's client alone would wait forever
        return time.monotonic() - t0

    try:
        took = sweep(NOW)
        assert got and took < 1.0, took
        assert f"cannot read store {mute} of 'ft_4:u': no answer in 0.3 s" in reader.error
        deadline = time.monotonic() + 5  # the live store's read, late on a loaded machine
        while not got[0] and time.monotonic() < deadline:
            time.sleep(0.01)
            sweep(NOW + 1)
        assert got[0] == {"torch+http://node7:4100": TorchIdentity("ft_3:uuid", 3, 0, 1, live)}
        deadline = time.monotonic() + 5
        while len(conns) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        for now in (NOW + 10, NOW + 100):
            assert sweep(now) < 0.5 and got and len(got[0]) == 1
        time.sleep(0.1)
        assert len(conns) == 2  # the plain connect, torch's client; not read again meanwhile
    finally:
        silent.close()
        for c in conns:
            c.close()
    # torch's client gives up once the port closes: that read is taken, the store read again
    deadline = time.monotonic() + 10
    while "no answer" in reader.error and time.monotonic() < deadline:
        time.sleep(0.05)
        sweep(NOW + 200)
    assert "no answer" not in reader.error and f"cannot read store {mute}" in reader.error


def test_store_reader_without_torch_says_so_once(monkeypatch, caplog):
    """The monitor's own install has no torch: --torch-stores then finds nothing, said once."""
    monkeypatch.setitem(sys.modules, "torch.distributed", None)  # as if not installed
    reader = StoreReader(timeout_s=0.3)
    with caplog.at_level("WARNING", logger="monitor.poll.torch_server"):
        assert reader.read([("ft_1:u", "127.0.0.1:1", 1)], NOW) == {}
        assert reader.read([("ft_2:u", "127.0.0.1:2", 1)], NOW + 10) == {}
    assert "needs torch in the monitor's Python" in reader.error
    assert len([r for r in caplog.records if "needs torch" in r.getMessage()]) == 1


def test_target_spelling_and_discovery(tmp_path):
    assert normalize_url("torch+http://h:1/") == "torch+http://h:1"
    assert torch_url("h:1") == torch_url("http://h:1") == "torch+http://h:1"
    with pytest.raises(BadTarget):
        normalize_url("torch+https://h:1")
    assert replica_group_of("replica_group_12:abc") == 12 and replica_group_of("x:1") is None
    d = Discovery(["torch+http://h:1", "h:2"], job="j")
    d.set_torch({"torch+http://n:3": (1, 1)})
    assert {(t.url, t.source) for t in d.targets()} == {
        ("torch+http://h:1", "static"), ("http://h:2", "static"),
        ("torch+http://n:3", "torch_store")}
    assert d.write_file_sd(str(tmp_path / "sd.json"))
    sd = json.loads((tmp_path / "sd.json").read_text())
    assert [g["targets"] for g in sd] == [["h:2"]]  # torch's server: no /metrics
    # a WorkerServer serving on torch's server registers as torch+http, polled as it checked
    t = d.register({"url": "torch+http://localhost:5"}, admit=AllowList.default([]).admit)
    assert t.url in ("torch+http://127.0.0.1:5", "torch+http://[::1]:5")


def test_no_state_changing_call_to_a_torch_server():
    calls = RankCalls("token", timeout_s=0.5)
    out = calls.exit(SimpleNamespace(url="torch+http://127.0.0.1:1", state=None), "evicted")
    assert not out.sent and "torch's debug server" in out.detail


# --- a CUDA rank: torch's two Flight Recorders (answers recorded on an H100) ------------------

H100 = Path(__file__).parent / "fixtures" / "torch-debug-server-h100"


def _h100_routes(moment: str, nccl: bool = True) -> dict:
    folder = H100 / moment
    names = json.loads((folder / "handler_list").read_bytes())
    if not nccl:  # what a CPU build lists
        names = [n for n in names if "nccl" not in n]
    routes = {("GET", "/handler/"): (200, json.dumps(names).encode())}
    for h in ("fr_trace_json", "dump_nccl_trace_json"):
        if h in names:
            routes[("POST", f"/handler/{h}")] = (200, (folder / h).read_bytes())
    return routes


def _stuck_created_s() -> float:
    doc = json.loads((H100 / "inflight" / "dump_nccl_trace_json").read_bytes())
    return max(e["time_created_ns"] for e in doc["entries"] if e["state"] != "completed") / 1e9


@pytest.mark.parametrize("nccl", [True, False])
def test_a_cuda_rank_blocked_in_nccl_is_seen_through_torchs_nccl_recorder(garbage_server, nccl):
    """Recorded on an H100 (tests/fixtures/torch-debug-server-h100), served as torch served it:
    ``fr_trace_json`` holds gloo's collectives only, the NCCL all_reduce stuck behind a kernel is
    in ``dump_nccl_trace_json``. Read both, the rank is blocked in it; a build without the NCCL
    handler shows no wait."""
    url, table = garbage_server
    table.clear()
    table.update(_h100_routes("inflight", nccl))
    poller = TorchPoller(timeout_s=2, fr_timeout_s=2)
    try:
        polls = poller.sweep([url])
    finally:
        poller.close()
    ranks = TorchRanks("j")
    now = _stuck_created_s() + 30.0
    ranks.adapt(polls, {url: ident(0)}, status(), now)
    s = polls[url].data
    assert valid_state(s) is None
    if not nccl:
        assert s["phase"] == "unknown" and s["timing"]["waiting"] is None
        assert s["torch_only"]["flight_recorder"] == "8 entries"
        return
    assert s["phase"] == "collective"
    assert s["timing"]["waiting"] == {"scope": "group", "seconds": 30.0}
    assert s["torch_only"]["flight_recorder"] == "17 entries"
    dump = ranks.dumps[url]
    groups = {e["process_group"][0] for e in dump["entries"]}
    assert groups == {"0", "0:cpu", "1", "2"}  # the default group once per recorder


def test_two_recorders_default_group_not_read_as_one():
    """Both recorders number the default group's collectives 1..4: merged as one group they
    would be the same collective twice; the analysis finds nothing wrong with the rank."""
    answer = TorchAnswer((), *(json.loads((H100 / "healthy" / h).read_bytes())
                               for h in ("fr_trace_json",)), None,
                         json.loads((H100 / "healthy" / "dump_nccl_trace_json").read_bytes()))
    dump = combined(answer)
    seqs: dict = {}
    for e in dump["entries"]:
        key = (e["process_group"][0], e["pg_id"])
        seqs.setdefault(key, []).append(e["collective_seq_id"])
    assert all(len(v) == len(set(v)) for v in seqs.values()), seqs
    assert {k[0] for k in seqs} == {"0", "0:cpu", "1", "2"}
    assert len({k[1] for k in seqs}) == 4  # four groups, four pg_ids
    assert blocked_in(dump, _stuck_created_s()) is None  # healthy: nothing pending
    state = torch_state("torch+http://h:1", ident(0), answer, status(), NOW, "j")
    result = analyze({0: adapted_dump(dump, state, status(), NOW)})
    assert not result.findings


def test_a_rank_of_both_recorders_is_judged_on_nccls_durations():
    """Its dump may begin and end with gloo's untimed entries (a CPU collective before and
    after the NCCL ones): it is still read as NCCL's, so a straggler is judged on durations on
    every rank alike, not on host clocks where the first and last entries happen to be gloo's."""
    cpu, nccl = (json.loads((H100 / "healthy" / h).read_bytes())
                 for h in ("fr_trace_json", "dump_nccl_trace_json"))
    times = [e["time_created_ns"] for e in nccl["entries"]]
    gloo = cpu["entries"]
    gloo[0]["time_created_ns"], gloo[-1]["time_created_ns"] = min(times) - 1, max(times) + 1
    dump = {**combined(TorchAnswer((), cpu, None, nccl)), "rank": 0}
    assert [e["time_created_ns"] for e in (dump["entries"][0], dump["entries"][-1])] == \
        [min(times) - 1, max(times) + 1]
    assert all(e["profiling_name"].startswith("gloo:")
               for e in (dump["entries"][0], dump["entries"][-1]))
    traces, errors = normalize_dumps({0: dump})
    assert not errors and traces[0].flavour == "nccl"
    assert traces[0].groups[GroupKey("1")].duration_ms[0] > 0  # NCCL's own durations kept
    # the generic recorder's first entry (record id 0) is in it, NCCL's may have wrapped: the
    # dump is never read as a whole history, where a group's absence would prove a rank idle
    assert min(e["record_id"] for e in cpu["entries"]) == 0 and traces[0].wrapped
