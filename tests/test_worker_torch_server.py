"""Lightkeeper's read-only endpoints as handlers on torch's own ``_WorkerServer`` (real torch
server, real waitress, real HTTP; no training job): the same bytes as the Flask server's, torch's
own handlers beside them, the monitor's poller reading a ``torch+http://`` target as it reads an
``http://`` one, and the fallback to Flask where torch has no ``_register_handler`` (that torch
cannot be installed beside this one, so the call is removed from the module for the test)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import requests

from monitor.act.actions import RankCalls
from monitor.poll.discovery import Discovery, normalize_url
from monitor.poll.poller import Poller
from monitor.poll.torch_target import base_url, handler_path
from worker_server import RankIdentity, RankState, WorkerServer
from worker_server.torch_server import unavailable


@pytest.fixture(scope="module", autouse=True)
def _torchs_server_can_serve():
    """Skips the module where torch's server cannot carry the handlers: checked here, not at
    collection, where it imports torch (a second of CPU for every pytest-xdist worker)."""
    if (why := unavailable()) is not None:
        pytest.skip(why)


FR = json.dumps({"version": "2.10", "entries": [
    {"record_id": i, "pg_id": 0, "process_group": ["0", "default_pg"], "profiling_name":
     "gloo:all_reduce", "collective_seq_id": i + 1} for i in range(5)]}).encode()


def fr_dumper(tracker, identity, only_active=False):
    return FR


@pytest.fixture(scope="module")
def servers():
    """One rank's state served by both servers at once."""
    state = RankState(RankIdentity(job="unit", replica_group=2, group_rank=1, group_world_size=2,
                                   lighthouse="http://127.0.0.1:1"))
    for step in range(1, 6):
        state.step_started()
        state.set_quorum(5, 3, True)
        state.step_finished(step, committed=True, loss=2.5)
    flask = WorkerServer(state, fr_dumper=fr_dumper).serve()
    torch = WorkerServer(state, fr_dumper=fr_dumper, server="torch").serve()
    yield flask, torch, base_url(torch.url)
    torch.stop()
    flask.stop()


def post(base: str, name: str, query: str = "") -> requests.Response:
    return requests.post(f"{base}/handler/{name}{query}", timeout=5)


def test_lightkeeper_handlers_answer_what_flask_answers(servers):
    flask, torch, base = servers
    assert torch.server == "torch" and torch.url.startswith("torch+http://127.0.0.1:")
    names = requests.get(base + "/handler/", timeout=5).json()
    assert {"ping", "fr_trace_json", "dump_traceback", "lightkeeper_state", "lightkeeper_metrics",
            "lightkeeper_stacks", "lightkeeper_fr_trace"} <= set(names)
    assert post(base, "ping").text == "pong"  # torch's own, beside Lightkeeper's
    for path, name, query in (("/v1/state", "lightkeeper_state", ""),
                              ("/v1/state", "lightkeeper_state", "?recent=2&since=3"),
                              ("/v1/state", "lightkeeper_state", "?packed=true"),
                              ("/v1/fr_trace", "lightkeeper_fr_trace", "?last=2")):
        want = requests.get(flask.url + path + query, timeout=5)
        got = post(base, name, query)
        assert (got.status_code, got.headers["content-type"]) == (200, "application/json")
        assert got.content == want.content, (path, query)  # same bytes
    assert len(post(base, "lightkeeper_state", "?recent=2").json()["recent_step_seconds"]) == 2
    stacks = post(base, "lightkeeper_stacks", "?format=json").json()
    assert stacks["rank"] == 5 and any(t["is_main"] for t in stacks["threads"])
    assert "MainThread" in post(base, "lightkeeper_stacks").text
    metrics = post(base, "lightkeeper_metrics")
    assert metrics.headers["content-type"].startswith("text/plain; version=")
    assert 'lightkeeper_step{group_rank="1",job="unit",rank="5",replica_group="2"} 5.0' \
        in metrics.text
    served = [line for line in metrics.text.splitlines()
              if line.startswith("lightkeeper_worker_server_requests_total")]
    assert served and float(served[0].split()[-1]) >= 5  # counted as on Flask


def test_bad_arguments_are_400_and_unknown_handlers_404(servers):
    _, _, base = servers
    bad = post(base, "lightkeeper_state", "?recent=x")
    assert bad.status_code == 400
    assert bad.json() == {"error": "recent must be an integer in [0, 1048576], got 'x'",
                          "status": 400, "path": "/handler/lightkeeper_state"}
    assert post(base, "lightkeeper_fr_trace", "?last=0").status_code == 400
    assert post(base, "lightkeeper_exit").status_code == 404  # nothing that acts is registered
    assert requests.get(base + "/handler/lightkeeper_state", timeout=5).status_code == 404


def test_the_monitor_polls_a_torch_target_as_an_http_one(servers, tmp_path):
    flask, torch, _ = servers
    assert normalize_url(torch.url + "/") == torch.url
    # Prometheus scrapes with GET, torch's handlers answer POST: not in the file_sd it reads
    Discovery(static=[torch.url, flask.url]).write_file_sd(str(tmp_path / "sd.json"))
    sd = json.loads((tmp_path / "sd.json").read_text())
    assert [g["targets"] for g in sd] == [[flask.url.split("://", 1)[1]]]
    assert handler_path("/v1/fr_trace?last=2") == "/handler/lightkeeper_fr_trace?last=2"
    poller = Poller(timeout_s=5)
    try:
        for _ in range(2):  # the second sweep reuses (or reopens) the kept connection
            polls = poller.sweep([flask.url, torch.url], queries=["?recent=3", "?recent=3"])
            assert polls[torch.url].ok, polls[torch.url]
            assert polls[torch.url].data == polls[flask.url].data
        fr = poller.sweep([torch.url], "/v1/fr_trace?last=1")[torch.url]
        assert fr.ok and [e["record_id"] for e in fr.data["entries"]] == [4]
        missing = poller.sweep([torch.url], "/healthz")[torch.url]
        assert (missing.ok, missing.reason, missing.status) == (False, "http_status", 404)
    finally:
        poller.close()
    # no /v1/exit there
    assert not RankCalls("token").exit(SimpleNamespace(url=torch.url, state=None), "test").sent


def test_without_register_handler_flask_serves_and_says_so(monkeypatch, capfd):
    from torch._C import _distributed_c10d as c10d

    monkeypatch.delattr(c10d, "_register_handler")
    monkeypatch.setenv("LIGHTKEEPER_WORKER_SERVER", "torch")
    server = WorkerServer.start(replica_group=0, group_rank=0, group_world_size=1)
    try:
        err = capfd.readouterr().err
        lines = [line for line in err.splitlines() if "torch's server" in line]
        assert len(lines) == 1 and "_register_handler" in lines[0] and "Flask" in lines[0], err
        assert server.server == "flask" and server.url.startswith("http://127.0.0.1:")
        assert requests.get(server.url + "/v1/state", timeout=5).json()["worker_url"] == server.url
    finally:
        server.stop()
    with pytest.raises(ValueError, match="one of flask, torch"):
        WorkerServer(RankState(RankIdentity(job="j", replica_group=0)), server="nginx")
    monkeypatch.setenv("LIGHTKEEPER_WORKER_SERVER", "bogus")  # the variable named
    with pytest.raises(ValueError, match="LIGHTKEEPER_WORKER_SERVER='bogus': one of flask"):
        WorkerServer.start(replica_group=0)


def test_actions_are_not_served_on_torchs_server(monkeypatch, capfd):
    monkeypatch.setenv("LIGHTKEEPER_EXIT_TOKEN", "secret")
    server = WorkerServer.start(replica_group=0, group_rank=0, group_world_size=1,
                                server="torch")
    try:
        assert server.server == "torch"
        err = capfd.readouterr().err
        assert err.count("[lightkeeper] WorkerServer: on torch's server only the read-only") == 1
        base = base_url(server.url)
        assert post(base, "lightkeeper_state").json()["worker_url"] == server.url
    finally:
        server.stop()


def test_lightkeeper_run_passes_the_choice_on():
    out = subprocess.run([sys.executable, "-m", "lightkeeper.cli", "run", "--worker-server",
                          "torch", "--print-env"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "LIGHTKEEPER_WORKER_SERVER=torch" in out.stdout.splitlines()


STOP_WHILE_ANSWERING = """
import threading, time
import requests
from monitor.poll.torch_target import base_url
from worker_server import RankIdentity, RankState, WorkerServer, torch_server

answering = threading.Event()
real = torch_server.state_body

def slow(state, args):  # a poll still being answered when the rank stops its server
    answering.set()
    time.sleep(0.5)
    return real(state, args)

torch_server.state_body = slow
state = RankState(RankIdentity(job="unit", replica_group=0, group_rank=0, group_world_size=1,
                               lighthouse="http://127.0.0.1:1"))
ws = WorkerServer(state, server="torch").serve()
url = base_url(ws.url) + "/handler/lightkeeper_state"
poll = threading.Thread(target=lambda: requests.post(url, timeout=10), daemon=True)
poll.start()
assert answering.wait(10)
ws.stop()
print("stopped", flush=True)
"""


def test_the_server_stops_while_a_handler_is_answering():
    """torch's shutdown() keeps the GIL while it waits for its server's threads: called while a
    Lightkeeper handler runs, neither ever ended (a finished job that never exits). The stop
    waits for the handlers first. In a process of its own: the failure is a hang."""
    out = subprocess.run([sys.executable, "-c", STOP_WHILE_ANSWERING], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0 and "stopped" in out.stdout, out.stderr[-2000:]


def test_a_dump_while_another_runs_is_503_and_a_failure_one_log_line(caplog):
    # A dump that never returns is faked: torch offers no way to wedge its own dump on demand.
    entered, release = threading.Event(), threading.Event()

    def wedged(*_a, **_k) -> bytes:
        entered.set()
        release.wait(30)
        return FR

    def failing(*_a, **_k) -> bytes:
        raise RuntimeError("the dump broke")

    state = RankState(RankIdentity(job="unit"))
    srv = WorkerServer(state, fr_dumper=wedged, server="torch").serve()
    base = base_url(srv.url)
    pool = ThreadPoolExecutor(2)
    try:
        first = pool.submit(post, base, "lightkeeper_fr_trace")
        assert entered.wait(10)
        busy = post(base, "lightkeeper_fr_trace")  # as on Flask (there with Retry-After: 1)
        assert busy.status_code == 503 and "another" in busy.json()["error"], busy.text
        release.set()
        assert first.result(timeout=10).status_code == 200
    finally:
        release.set()
        pool.shutdown(wait=True)
        srv.stop()
    srv = WorkerServer(state, fr_dumper=failing, server="torch").serve()
    try:
        with caplog.at_level(logging.ERROR, logger="worker_server.torch_server"):
            r = post(base_url(srv.url), "lightkeeper_fr_trace")
        assert r.status_code == 500 and "the dump broke" in r.json()["error"]
        # one line, no traceback: a monitor polling a failing handler must not fill the log
        assert [(rec.getMessage(), rec.exc_info) for rec in caplog.records] == [
            ("handler lightkeeper_fr_trace failed: RuntimeError: the dump broke", None)]
    finally:
        srv.stop()
