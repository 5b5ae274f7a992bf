"""A client reading a rank's WorkerServer back to back is paced: the CPU the server spends
answering it (``lightkeeper_worker_server_cpu_seconds_total``, what it takes from the training
thread) stays within READ_SHARE of the time, on Flask and on torch's server, and the monitor's
own polls (its User-Agent) and a peer's probe payload never wait behind it (real waitress, real
torch server, real HTTP). The Flight Recorder is a stand-in that burns CPU: a real dump needs a
job's collectives."""

from __future__ import annotations

import http.client
import re
import threading
import time
from urllib.parse import urlsplit

import pytest
import requests

from lightkeeper.processes import wait_until
from rank_wire import MONITOR_AGENT, auth
from worker_server import RankIdentity, RankState, WorkerServer
from worker_server import metrics as worker_metrics
from worker_server.probe import PAYLOAD_PATH
from worker_server.torch_server import unavailable

HAMMER_S = 0.4


def burning(cpu_s: float):
    """A Flight Recorder dumper whose dump costs its thread ``cpu_s`` of CPU (a real one of
    ~1 MB takes ~26 ms)."""
    def dump(tracker, identity, only_active=False):
        until = time.thread_time() + cpu_s
        while time.thread_time() < until:
            pass
        return b'{"entries": []}'

    return dump


TOKEN = "readcost-token"  # a peer's probe payload is served only to a fetch signed with it


@pytest.fixture
def state():
    state = RankState(RankIdentity(job="unit", replica_group=0, group_rank=0, group_world_size=1))
    for step in range(1, 4):
        state.step_started()
        state.step_finished(step, committed=True, loss=1.0)
    return state


def served_cpu(text: str) -> float:
    m = re.search(r"^lightkeeper_worker_server_cpu_seconds_total\{[^}]*\} (\S+)$", text, re.M)
    assert m, text
    return float(m.group(1))


def hammer(url: str, method: str, paths: list[str], agent: str = "curl/8") -> tuple[float, int]:
    """Ask ``paths`` in turn, back to back, for HAMMER_S: (seconds it took, answers)."""
    u = urlsplit(url)
    conn, answers, started = None, 0, time.monotonic()
    while time.monotonic() - started < HAMMER_S:
        for path in paths:
            conn = conn or http.client.HTTPConnection(u.hostname, u.port, timeout=5)
            conn.request(method, path, headers={"User-Agent": agent})
            r = conn.getresponse()
            r.read()
            assert r.status == 200, (path, r.status)
            answers += 1
            if (r.getheader("Connection") or "").lower() == "close":
                conn.close()
                conn = None
    if conn is not None:
        conn.close()
    return time.monotonic() - started, answers


def test_a_client_reading_back_to_back_is_paced_on_flask(state):
    server = WorkerServer(state, fr_dumper=burning(0.004)).serve()
    try:
        before = served_cpu(requests.get(server.url + "/metrics", timeout=5).text)
        took, answers = hammer(server.url, "GET", ["/metrics", "/v1/state", "/v1/stacks",
                                                   "/v1/fr_trace", "/healthz"])
        spent = served_cpu(requests.get(server.url + "/metrics", timeout=5).text) - before
        # unpaced, the server's threads answered all the time (share ~0.3-0.9); a read
        # overdraws its own CPU at most (a read costing over MAX_PACE_S * READ_SHARE, 5 ms,
        # would pay less: the test's dumps cost 4 ms)
        assert spent <= worker_metrics.READ_SHARE * took + 0.01, (spent, took, answers)
    finally:
        server.stop()


@pytest.mark.parametrize("agent, path", [(MONITOR_AGENT + "/1", "/v1/state"),
                                         ("Prometheus/2.53.0", "/metrics"),
                                         ("curl/8", "/healthz")])
def test_a_client_looping_as_the_monitor_or_prometheus_is_paced_past_its_allowance(
        state, agent, path):
    """Any client may send the monitor's or Prometheus' User-Agent, and their routes (and
    /healthz) were never paced: four clients looping on them took a Python-bound loop to ~0.4x
    of its pace, a straggler the monitor would evict. Past ALLOWANCE reads a second per address
    they are paced as anyone's."""
    server = WorkerServer(state).serve()
    try:
        before = served_cpu(requests.get(server.url + "/metrics", timeout=5).text)
        took, answers = hammer(server.url, "GET", [path], agent=agent)
        spent = served_cpu(requests.get(server.url + "/metrics", timeout=5).text) - before
        # the allowance's reads are not paced: a burst, then ALLOWANCE a second
        allowed = worker_metrics.ALLOWANCE * (1 + took)
        bound = worker_metrics.READ_SHARE * took + allowed * spent / answers + 0.01
        assert spent <= bound, (spent, took, answers)
    finally:
        server.stop()


@pytest.mark.parametrize("agent, path, clients", [(MONITOR_AGENT + "/1", "/v1/state", 1),
                                                   ("curl/8", "/v1/stacks", 4)])
def test_a_client_asking_from_many_addresses_is_paced_all_the_same(state, agent, path, clients):
    """A client may ask from any address of 127/8: each address's allowance (the monitor's
    polls) or one-off read (a curl behind looping readers) answered unpaced took a rank to half
    its pace and got its healthy group evicted. Every unpaced read draws on one CPU budget."""
    server = WorkerServer(state, fr_dumper=burning(0.004)).serve()
    u = urlsplit(server.url)
    statuses: list[int] = []

    def loop(n: int) -> None:
        started, i = time.monotonic(), 0
        while time.monotonic() - started < HAMMER_S:
            i += 1  # a new address each time: 127.<n+1>.x.y
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=5, source_address=(
                f"127.{n + 1}.{i // 250}.{2 + i % 250}", 0))
            conn.request("GET", path, headers={"User-Agent": agent})
            r = conn.getresponse()
            r.read()
            conn.close()
            statuses.append(r.status)

    try:
        before = served_cpu(requests.get(server.url + "/metrics", timeout=5).text)
        started = time.monotonic()
        threads = [threading.Thread(target=loop, args=(n,)) for n in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        took = time.monotonic() - started
        spent = served_cpu(requests.get(server.url + "/metrics", timeout=5).text) - before
        assert set(statuses) <= {200, 429}, set(statuses)
        share = worker_metrics.READ_SHARE + worker_metrics.UNPACED_SHARE
        # a read may overdraw the budget by its own CPU (a few ms here)
        bound = share * took + worker_metrics.UNPACED_BURST_S + 0.02
        assert spent <= bound, (spent, took, len(statuses))
    finally:
        server.stop()


@pytest.mark.parametrize("method, path, headers", [
    ("POST", "/v1/probe", {"Authorization": "Lightkeeper-HMAC-SHA256 deadbeef",
                           "Content-Type": "application/json"}),
    ("GET", "/v1/probe/payload?bytes=4194304", {"Authorization": "Lightkeeper-HMAC-SHA256 00"}),
    ("OPTIONS", "/v1/state", {}),
    ("POST", "/metrics", {})])
def test_clients_looping_on_refused_requests_are_paced(state, method, path, headers):
    """Only reads were paced: four clients looping on a refused request (a bad signature's
    401, a 405, an OPTIONS) took a rank's loop to ~2x its step time, as the reads that got a
    healthy group evicted did. Every request is paced now but a peer's signed probe fetch."""
    server = WorkerServer(state, exit_token=TOKEN).serve()
    u = urlsplit(server.url)
    stop = threading.Event()

    def loop() -> None:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=5)
        while not stop.is_set():
            conn.request(method, path, body=b"{}" if method == "POST" else None,
                         headers=headers)
            r = conn.getresponse()
            r.read()
            if r.getheader("Connection", "").lower() == "close":
                conn.close()
                conn = http.client.HTTPConnection(u.hostname, u.port, timeout=5)
        conn.close()

    try:
        before = served_cpu(requests.get(server.url + "/metrics", timeout=5).text)
        started = time.monotonic()
        threads = [threading.Thread(target=loop) for _ in range(4)]
        for t in threads:
            t.start()
        wait_until(lambda: time.monotonic() - started >= 4 * HAMMER_S, 10, what="the loops")
        stop.set()
        for t in threads:
            t.join(timeout=10)
        took = time.monotonic() - started
        spent = served_cpu(requests.get(server.url + "/metrics", timeout=5).text) - before
        share = worker_metrics.READ_SHARE + worker_metrics.UNPACED_SHARE
        assert spent <= share * took + worker_metrics.UNPACED_BURST_S + 0.02, (spent, took)
    finally:
        stop.set()
        server.stop()


def test_a_read_after_an_expensive_one_waits_the_monitors_poll_does_not(state, monkeypatch):
    monkeypatch.setattr(worker_metrics, "MAX_PACE_S", 0.6)  # room between the two bounds
    server = WorkerServer(state, fr_dumper=burning(0.02), exit_token=TOKEN).serve()
    try:
        assert requests.get(server.url + "/v1/fr_trace", timeout=5).status_code == 200
        t0 = time.monotonic()
        polled = requests.get(server.url + "/v1/state?recent=16",
                              headers={"User-Agent": MONITOR_AGENT + "/1"}, timeout=5)
        monitor_s = time.monotonic() - t0
        assert polled.status_code == 200 and polled.json()["step"] == 3
        t0 = time.monotonic()  # a peer's probe times this fetch: it must not wait either
        path = PAYLOAD_PATH + "?bytes=1"
        assert requests.get(server.url + path, timeout=5, headers={
            "Authorization": auth.peer_authorization(TOKEN, path, server.url)}).content == b"\0"
        probe_s = time.monotonic() - t0
        t0 = time.monotonic()
        assert requests.get(server.url + "/v1/state", timeout=5).status_code == 200
        curl_s = time.monotonic() - t0
        # the dump charged 20 ms / READ_SHARE (1 s), capped at 0.6 s from its end
        assert curl_s >= 0.3 > max(monitor_s, probe_s), (curl_s, monitor_s, probe_s)
    finally:
        server.stop()


def test_a_client_reading_back_to_back_is_paced_on_torchs_server(state):
    # checked here, not in a skipif at collection: it imports torch, a second of CPU for every
    # pytest-xdist worker
    if (why := unavailable()) is not None:
        pytest.skip(why)
    server = WorkerServer(state, fr_dumper=burning(0.004), server="torch").serve()
    base = server.url.replace("torch+http", "http")
    try:
        assert server.server == "torch"
        ask = lambda: requests.post(base + "/handler/lightkeeper_metrics", timeout=5).text  # noqa: E731
        before = served_cpu(ask())
        took, answers = hammer(base, "POST", [f"/handler/lightkeeper_{n}" for n in
                                              ("metrics", "state", "stacks", "fr_trace")])
        spent = served_cpu(ask()) - before
        assert spent <= worker_metrics.READ_SHARE * took + 0.01, (spent, took, answers)
    finally:
        server.stop()


def test_a_streamed_body_is_counted_until_it_was_sent(state):
    """A probe payload is a generator: waitress makes its bytes after the app returned, on the
    same thread. Its CPU was missed (8x under for 4 MiB payloads); it is counted at close."""
    from prometheus_client import generate_latest

    metrics = WorkerServer(state).metrics

    def counted() -> float:
        return served_cpu(generate_latest(metrics.registry).decode())

    before = counted()

    def streaming(environ, start_response):
        start_response("200 OK", [("Content-Type", "application/octet-stream")])

        def chunks():
            end = time.thread_time() + 0.05
            while time.thread_time() < end:
                yield b"\0"

        return chunks()

    body = metrics.count_cpu(streaming)({"REQUEST_METHOD": "GET",
                                         "PATH_INFO": "/v1/probe/payload"}, lambda *a: None)
    assert counted() == before  # nothing sent yet
    for _ in body:
        pass
    body.close()  # as every WSGI server does once the body was sent
    assert counted() - before >= 0.05
