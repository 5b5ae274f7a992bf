"""Paced reads never hold all of the WorkerServer's threads: many clients reading back to back
(scrapers, watch loops) filled waitress' 4 threads with sleeping requests and the monitor's poll,
never paced itself, waited in waitress' queue behind them past its --poll-timeout (the rank read
as dead). Now at most PACED_SLOTS paced reads wait or run at once; any other is answered 429 with
Retry-After, sent HOLD_S later without holding a thread (real waitress, real HTTP, the clients
threads of this process)."""

from __future__ import annotations

import http.client
import json
import select
import threading
import time

import pytest

from http_serving import BackgroundWSGIServer
from http_serving.wsgi import HOLD_RESPONSE
from rank_wire import MONITOR_AGENT
from worker_server import RankIdentity, RankState, WorkerServer
from worker_server import metrics as worker_metrics
from worker_server.metrics import WorkerMetrics

READERS = 16


def _state() -> RankState:
    state = RankState(RankIdentity(job="unit", replica_group=0, group_rank=0, group_world_size=1))
    state.step_started()
    state.step_finished(1, committed=True, loss=1.0)
    return state


@pytest.fixture
def server():
    server = WorkerServer(_state()).serve()
    yield server
    server.stop()


class Readers:
    """``n`` clients asking ``/metrics`` back to back, each on its own kept-alive connection."""

    def __init__(self, port: int, n: int) -> None:
        self.port, self.stop = port, threading.Event()
        self.asked = threading.Semaphore(0)  # one release per request sent
        self.statuses: list[tuple[int, str | None]] = []
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _loop(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            while not self.stop.is_set():
                conn.request("GET", "/metrics")
                self.asked.release()
                r = conn.getresponse()
                r.read()
                self.statuses.append((r.status, r.getheader("Retry-After")))
        except (OSError, http.client.HTTPException):  # the server stopped under a held answer
            pass
        finally:
            conn.close()

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=5)


def _monitor_poll(port: int) -> tuple[int, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        t0 = time.monotonic()
        conn.request("GET", "/v1/state?recent=16", headers={"User-Agent": MONITOR_AGENT + "/1"})
        r = conn.getresponse()
        r.read()
        return r.status, time.monotonic() - t0
    finally:
        conn.close()


def test_the_monitors_poll_does_not_queue_behind_many_paced_readers(server, monkeypatch):
    # refusals come back within the test (raising=False: the same test runs on a server without)
    monkeypatch.setattr(worker_metrics, "HOLD_S", 0.02, raising=False)
    readers = Readers(server.port, READERS)
    try:
        deadline = time.monotonic() + 5
        for _ in range(2 * READERS):  # every reader has asked, most of them twice
            assert readers.asked.acquire(timeout=max(0.0, deadline - time.monotonic()))
        polls = [_monitor_poll(server.port) for _ in range(3)]
    finally:
        readers.stop.set()
        server.stop()  # ends the readers an answer still held waits for
        readers.end()
    assert [status for status, _ in polls] == [200, 200, 200]
    # queued behind four sleeping paced reads it took ~0.8 s (the monitor's --poll-timeout)
    assert max(took for _, took in polls) < 0.3, polls
    refused = [s for s in readers.statuses if s[0] == 429]
    assert refused and all(retry == str(worker_metrics.RETRY_AFTER_S) for _, retry in refused)
    assert {s for s, _ in readers.statuses} <= {200, 429}


def test_reads_within_the_slots_are_paced_not_refused(server):
    """One client reading back to back is slowed, never refused (as before)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        for _ in range(5):
            conn.request("GET", "/v1/state")
            r = conn.getresponse()
            r.read()
            assert r.status == 200
    finally:
        conn.close()


def test_a_read_that_would_wait_beyond_the_slots_is_refused_late(monkeypatch):
    """No slot left (none here): a read that would wait, from a client paced or refused lately,
    is answered 429 only HOLD_S later, its thread freed at once (a client looping on it asks once per HOLD_S), while the monitor's poll
    and /healthz are answered at once; a read that waited gives its slot back."""
    monkeypatch.setattr(worker_metrics, "MAX_PACE_S", 0.5)
    monkeypatch.setattr(worker_metrics, "HOLD_S", 0.2)

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    metrics = WorkerMetrics(_state())
    none_left = BackgroundWSGIServer(metrics.count_cpu(app, paced_slots=0)).start()
    one = BackgroundWSGIServer(metrics.count_cpu(app, paced_slots=1)).start()

    def get(server, agent: str = "curl/8", path: str = "/x"
            ) -> tuple[int, str | None, bytes, float]:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:
            t0 = time.monotonic()
            conn.request("GET", path, headers={"User-Agent": agent})
            r = conn.getresponse()
            return r.status, r.getheader("Retry-After"), r.read(), time.monotonic() - t0
        finally:
            conn.close()

    try:
        metrics.served(10.0)  # an expensive read: the next one waits MAX_PACE_S
        # a client not seen lately is answered at once; asking again, it reads in a loop
        status, _, _, took = get(none_left)
        assert status == 200 and took < 0.2
        metrics.served(10.0)
        status, retry, body, took = get(none_left)
        assert (status, retry) == (429, str(worker_metrics.RETRY_AFTER_S))
        assert json.loads(body)["status"] == 429 and json.loads(body)["path"] == "/x"
        assert took >= 0.2
        status, _, _, took = get(none_left, agent=MONITOR_AGENT + "/1", path="/v1/state")
        assert status == 200 and took < 0.2
        # a readiness probe is never paced nor refused (a rolling update would wait on it)
        status, _, _, took = get(none_left, path="/healthz")
        assert status == 200 and took < 0.2
        monkeypatch.setattr(worker_metrics, "MAX_PACE_S", 0.05)
        for _ in range(2):  # each waits in the one slot; the second finds it given back
            metrics.served(10.0)
            status, _, _, took = get(one)
            assert status == 200 and took >= 0.03
    finally:
        none_left.stop()
        one.stop()


def _get(port: int, agent: str, path: str = "/v1/state", source: str = "127.0.0.1"
         ) -> tuple[int, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    try:
        t0 = time.monotonic()
        conn.request("GET", path, headers={"User-Agent": agent})
        r = conn.getresponse()
        r.read()
        return r.status, time.monotonic() - t0
    finally:
        conn.close()


def test_a_scrape_and_a_one_off_read_are_answered_behind_two_looping_readers(monkeypatch):
    """Both slots held by two looping readers: a Prometheus scrape was refused (it ignores
    Retry-After: up=0, and LightkeeperRankDown blamed a healthy rank), and so was an operator's
    one-off curl. Both are answered at once now; a client paced or refused lately still is not."""
    monkeypatch.setattr(worker_metrics, "MAX_PACE_S", 5.0)  # pace_s() > 0 all through the test
    monkeypatch.setattr(worker_metrics, "HOLD_S", 0.25)

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    metrics = WorkerMetrics(_state())
    waiting, let_go = threading.Semaphore(0), threading.Event()

    def pace() -> None:  # a paced read's wait, held until the test is done
        waiting.release()
        let_go.wait(10)

    monkeypatch.setattr(metrics, "pace", pace)
    server = BackgroundWSGIServer(metrics.count_cpu(app)).start()
    loopers: list[tuple[int, float]] = []
    threads = [threading.Thread(target=lambda: loopers.append(_get(server.port, "curl/8")))
               for _ in range(worker_metrics.PACED_SLOTS)]
    try:
        metrics.served(10.0)
        for t in threads:
            t.start()
        for _ in threads:  # both slots taken, by readers from 127.0.0.1
            assert waiting.acquire(timeout=5)
        status, took = _get(server.port, "Prometheus/2.53.0", "/metrics")
        assert status == 200 and took < 0.3
        # an operator's curl, from an address not paced nor refused lately
        status, took = _get(server.port, "curl/8", "/v1/stacks", source="127.0.0.2")
        assert status == 200 and took < 0.3
        # asked again at once it reads in a loop: refused (one answer per HOLD_S, as before)
        assert _get(server.port, "curl/8", source="127.0.0.2")[0] == 429
    finally:
        let_go.set()
        for t in threads:
            t.join(timeout=5)
        server.stop()
    assert [status for status, _ in loopers] == [200, 200]


def _empty_dump(tracker, identity, only_active=False) -> bytes:
    return b'{"entries": []}'


def test_a_named_user_agent_skips_pacing_only_on_its_own_route(monkeypatch):
    """Any client may send the monitor's or Prometheus' User-Agent: with it, reads were never
    paced on any route (six curl loops of /v1/fr_trace sent as lightkeeper-monitor took a
    trainer from 9 to 2.7 steps/s). Now only the monitor's /v1/state and Prometheus' /metrics
    are; elsewhere such a client's first read is answered at once (the monitor's one dump per
    rank per look), and the reads it sends in a loop are paced as anyone's."""
    monkeypatch.setattr(worker_metrics, "MAX_PACE_S", 0.4)
    monitor, prometheus = MONITOR_AGENT + "/1", "Prometheus/2.53.0"
    server = WorkerServer(_state(), fr_dumper=_empty_dump).serve()

    def read(agent: str, path: str, source: str) -> tuple[int, float]:
        server.metrics.served(10.0)  # an expensive read just before: the next one waits 0.4 s
        return _get(server.port, agent, path, source)

    try:
        for _ in range(3):
            assert read(monitor, "/v1/state", "127.0.0.2")[1] < 0.2
            assert read(prometheus, "/metrics", "127.0.0.3")[1] < 0.2
        for source, agent, path in (("127.0.0.4", monitor, "/v1/fr_trace"),
                                    ("127.0.0.5", monitor, "/v1/stacks"),
                                    ("127.0.0.6", prometheus, "/v1/stacks"),
                                    ("127.0.0.7", "curl/8", "/v1/fr_trace")):
            answers = [read(agent, path, source) for _ in range(3)]
            assert 429 not in [status for status, _ in answers], (agent, path, answers)
            took = [t for _, t in answers]
            assert min(took[1:]) >= 0.3, (agent, path, took)  # paced as any client's
            if agent != "curl/8":
                assert took[0] < 0.2, (agent, path, took)
    finally:
        server.stop()


class _NoThreadLeft(threading.Timer):
    def start(self) -> None:
        raise RuntimeError("can't start new thread")


def test_a_held_refusal_is_sent_when_no_thread_is_left_for_its_waker(monkeypatch):
    """The hold's waker is a thread: out of threads, its start() raised inside the app (a 500,
    and a traceback in the job's log). The 429 is sent all the same, once the server's loop
    wakes after the hold (here: woken by other requests, as a busy rank's loop is)."""

    def app(environ, start_response):
        if environ["PATH_INFO"] == "/held":
            start_response("429 Too Many Requests", [("Content-Length", "0")])
            environ[HOLD_RESPONSE](0.05)
        else:
            start_response("200 OK", [("Content-Length", "0")])
        return [b""]

    server = BackgroundWSGIServer(app).start()
    monkeypatch.setattr(threading, "Timer", _NoThreadLeft)
    held = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        t0 = time.monotonic()
        held.request("GET", "/held")
        deadline = time.monotonic() + 5
        while not select.select([held.sock], [], [], 0.02)[0]:
            assert time.monotonic() < deadline, "the held answer never came"
            assert _get(server.port, "curl/8", "/other")[0] == 200
        assert held.getresponse().status == 429
        assert time.monotonic() - t0 >= 0.05  # held all the same
    finally:
        held.close()
        server.stop()



def test_a_named_agents_look_is_answered_and_a_loop_of_it_still_refused(monkeypatch):
    """No slot free: the monitor's stacks and dump asked at once, and a dump asked again right
    after the sweep's, are answered (the first on each route at once, the next paced on its
    own thread); any client can send that User-Agent, so a third on one route within HOLD_S is
    refused as anyone's, and a read of another route shares one allowance."""
    monkeypatch.setattr(worker_metrics, "MAX_PACE_S", 0.3)
    monkeypatch.setattr(worker_metrics, "HOLD_S", 2.0)  # every ask below within it

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    metrics = WorkerMetrics(_state())
    server = BackgroundWSGIServer(metrics.count_cpu(app, paced_slots=0)).start()
    monitor = MONITOR_AGENT + "/1"

    def read(path: str) -> tuple[int, float]:
        metrics.served(10.0)  # an expensive read just before: the next one waits 0.3 s
        return _get(server.port, monitor, path)

    try:
        stacks, dump = read("/v1/stacks"), read("/v1/fr_trace")
        assert stacks[0] == dump[0] == 200 and max(stacks[1], dump[1]) < 0.2, (stacks, dump)
        status, took = read("/v1/fr_trace")
        assert status == 200 and took >= 0.2, took
        assert read("/v1/fr_trace")[0] == 429
        status, took = read("/v1/ranks")
        assert status == 200 and took < 0.2, took
        status, took = read("/v1/other")  # no allowance of its own
        assert status == 200 and took >= 0.2, took
    finally:
        server.stop()


def test_a_named_agent_looping_on_a_slow_route_is_paced(monkeypatch):
    """The named agent's allowance was marked when its read arrived: a dump taking longer than
    HOLD_S let each read of a loop in as a first one, never paced. It is held from the answer
    now, so the loop's next reads are paced."""
    monkeypatch.setattr(worker_metrics, "MAX_PACE_S", 0.5)
    monkeypatch.setattr(worker_metrics, "HOLD_S", 0.2)

    def slow_dump(tracker, identity, only_active=False) -> bytes:
        time.sleep(0.3)  # longer than HOLD_S
        return b'{"entries": []}'

    server = WorkerServer(_state(), fr_dumper=slow_dump).serve()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    took = []
    try:
        for _ in range(3):
            server.metrics.served(10.0)  # an expensive read just before: the next waits 0.5 s
            t0 = time.monotonic()
            conn.request("GET", "/v1/fr_trace", headers={"User-Agent": MONITOR_AGENT + "/1"})
            r = conn.getresponse()
            r.read()
            assert r.status == 200
            took.append(time.monotonic() - t0)
    finally:
        conn.close()
        server.stop()
    assert took[0] < 0.3 + 0.4 and min(took[1:]) >= 0.3 + 0.4, took  # the dump, then paced
