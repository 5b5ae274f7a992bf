"""Poller and view: concurrent sweeps where broken ranks fail alone and fast."""

from __future__ import annotations

import functools
import importlib.util
import json
import time

import pytest

from monitor.evidence.view import ViewBuilder
from monitor.poll.discovery import Target
from monitor.poll.packed_state import TIMING_ROW
from monitor.poll.poll_process import ProcessPoller
from monitor.poll.poller import Poller
from tests.support.monitor_sim import SimRanks


@pytest.fixture
def sim():
    s = SimRanks.start(6, groups=3)
    yield s
    s.stop()


# the Poller on its thread, and in its own process (monitor/poll/poll_process.py): the same
# answers, failures and bounds; the child on its default loop (uvloop where installed:
# monitor/poll/poller.py new_event_loop) and on the stdlib's, as without uvloop
POLLERS = {"thread": Poller, "process": ProcessPoller,
           "process-asyncio": functools.partial(ProcessPoller, event_loop="asyncio")}


@pytest.fixture(params=list(POLLERS))
def poller(request):
    p = POLLERS[request.param](timeout_s=0.5)
    yield p
    p.close()


def test_sweep_returns_every_state(sim, poller):
    polls = poller.sweep(sim.urls)
    assert set(polls) == set(sim.urls)
    assert all(p.ok for p in polls.values())
    assert sorted(p.data["rank"] for p in polls.values()) == list(range(6))


def test_each_url_is_asked_with_its_own_query(sim, poller):
    """``queries``: one per URL, appended to the path for that URL alone (the monitor's
    ``/v1/state?since=N``, Detectors.state_queries); a URL given twice is asked once, with its
    last query; a query that would break the request line is refused before anything is sent."""
    queries = [f"?since={100 + i}" if i % 2 else "" for i in range(len(sim.urls))]
    polls = poller.sweep(sim.urls, queries=queries)
    assert all(p.ok for p in polls.values())
    assert [r.last_path for r in sim.ranks] == ["/v1/state" + q for q in queries]
    polls = poller.sweep(sim.urls[:2] + sim.urls[:1], queries=["?a=1", "?b=2", "?c=3"])
    assert list(polls) == sim.urls[:2]
    assert [r.last_path for r in sim.ranks[:2]] == ["/v1/state?c=3", "/v1/state?b=2"]
    asked = sum(r.requests for r in sim.ranks)
    for bad in (["?x"], ["?a b", "?c"], ["since=1", ""], ["?\r\n", ""], [7, ""]):
        with pytest.raises(ValueError):
            poller.sweep(sim.urls[:2], queries=bad)
    assert sum(r.requests for r in sim.ranks) == asked


@pytest.mark.parametrize("mode,reason", [("http500", "http_status"), ("garbage", "bad_response"),
                                         ("close", "connection"), ("down", "connection"),
                                         ("slow", "timeout")])
def test_broken_rank_fails_alone_with_reason(sim, poller, mode, reason):
    bad = sim.ranks[2]
    bad.set_mode(mode, delay=30.0)
    start = time.monotonic()
    polls = poller.sweep(sim.urls)
    took = time.monotonic() - start
    assert polls[bad.url].ok is False
    assert polls[bad.url].reason == reason
    assert all(p.ok for u, p in polls.items() if u != bad.url)
    # a rank that never answers costs the sweep its timeout, not its 30 s delay
    assert took < 0.5 + 1.5


@pytest.mark.parametrize("kind", ["thread", "process"])  # the waves are the loop's own logic
def test_slow_ranks_are_polled_concurrently_up_to_max_concurrency(kind):
    sim = SimRanks.start(40)
    wide, narrow = POLLERS[kind](timeout_s=3.0), POLLERS[kind](timeout_s=3.0, max_concurrency=20)
    try:
        for r in sim.ranks:
            r.set_mode("slow", delay=0.4)
        took = []
        for p in (wide, narrow):
            start = time.monotonic()
            polls = p.sweep(sim.urls)
            took.append(time.monotonic() - start)
            assert all(x.ok for x in polls.values())
        assert took[0] < 40 * 0.4 / 4  # sequential would take 16 s
        assert took[1] >= 2 * 0.4 - 0.05  # two waves of 20, not one of 40
    finally:
        wide.close()
        narrow.close()
        sim.stop()


def test_keepalive_connection_closed_by_server_is_retried(sim, poller):
    url = sim.ranks[0].url
    assert poller.sweep([url])[url].ok
    sim.ranks[0].set_mode("down")
    sim.ranks[0].set_mode("ok")  # same port again: the pooled connection is stale
    assert poller.sweep([url])[url].ok


def test_view_counts_unreachable_sweeps_and_rejects_bad_state(sim, poller):
    targets = [Target(u, "static") for u in sim.urls]
    vb = ViewBuilder()
    vb.update(targets, poller.sweep(sim.urls), now=99.0)
    sim.ranks[1].set_mode("badstate")
    sim.ranks[4].set_mode("down")
    for i in range(3):
        view = vb.update(targets, poller.sweep(sim.urls), now=100.0 + i)
    bad, down = view.ranks[sim.ranks[1].url], view.ranks[sim.ranks[4].url]
    assert not bad.reachable and bad.reason == "bad_response" and bad.failures == 3
    assert not down.reachable and down.reason == "connection"
    # since the first failed request was sent: that sweep's time less the request's latency
    assert 99.0 < down.unreachable_since <= 100.0
    assert view.reachable_fraction == pytest.approx(4 / 6)
    assert sorted(view.groups) == [0, 1, 2]  # the last good state still places them
    assert view.groups[1].status == "unreachable"
    sim.ranks[4].set_mode("ok")
    view = vb.update(targets, poller.sweep(sim.urls), now=104.0)
    assert view.ranks[sim.ranks[4].url].reachable
    assert view.ranks[sim.ranks[4].url].failures == 0


def test_a_rank_that_times_out_is_unreachable_since_it_was_asked(sim, poller):
    """A host that vanished is found when its request times out; the fault began no later than
    the request was sent, so the dead finding's onset (and the ledger's) is dated from then."""
    targets = [Target(u, "static") for u in sim.urls]
    vb = ViewBuilder()
    vb.update(targets, poller.sweep(sim.urls), now=99.0)
    sim.ranks[2].set_mode("slow", delay=30.0)
    view = vb.update(targets, poller.sweep(sim.urls), now=100.0)
    gone = view.ranks[sim.ranks[2].url]
    assert not gone.reachable and gone.reason == "timeout"
    assert gone.unreachable_since == pytest.approx(100.0 - 0.5, abs=0.2)  # the poll timeout


def test_restarted_rank_supersedes_its_old_address(poller):
    sim = SimRanks.start(3)
    targets = [Target(u, "static") for u in sim.urls]
    vb = ViewBuilder()
    vb.update(targets, poller.sweep(sim.urls))
    old = sim.ranks[0]
    old.set_mode("down")
    new = SimRanks.start(1)
    try:
        new.ranks[0].update(**{**old.state, "replica_id": "replica_group_0:new"})
        targets.append(Target(new.urls[0], "registered"))
        view = vb.update(targets, poller.sweep([t.url for t in targets]))
        assert view.ranks[old.url].superseded
        g0 = view.groups[0]
        assert old.url not in [r.url for r in g0.ranks]
        assert g0.replica_id == "replica_group_0:new"
        assert g0.status == "up"
    finally:
        new.stop()
        sim.stop()


def test_ranks_behind_one_address_are_polled_under_their_path_prefix():
    """Many ranks behind one host:port (a proxy; the 100,000-rank benchmark's virtual ranks):
    each polled at <prefix>/v1/state, pooled connections shared by the address."""
    import asyncio
    import threading

    from monitor.poll.discovery import normalize_url
    from tests.support.virtual_ranks import VirtualRanks

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    vr = VirtualRanks(16, 0, 8, 0.5)
    server = asyncio.run_coroutine_threadsafe(
        loop.create_server(vr.protocol, "127.0.0.1", 0), loop).result(10)
    port = server.sockets[0].getsockname()[1]
    p = Poller(timeout_s=2.0, max_concurrency=4)
    try:
        urls = [normalize_url(f"127.0.0.1:{port}/r/{r}/") for r in range(16)]
        assert urls[3] == f"http://127.0.0.1:{port}/r/3"
        for _ in range(2):
            polls = p.sweep(urls + [f"http://127.0.0.1:{port}/r/99"])
        assert [polls[u].data["rank"] for u in urls] == list(range(16))
        assert [polls[u].data["group_rank"] for u in urls[6:10]] == [6, 7, 0, 1]
        assert polls[f"http://127.0.0.1:{port}/r/99"].reason == "http_status"  # no such rank
        assert p._n_idle <= 4  # one address: the connections of 4 workers, reused
        assert vr.requests == 34
    finally:
        p.close()
        # in the loop's own thread: Server.close from this one races the loop (failed once in CI
        # with "'NoneType' object is not iterable" in asyncio's Server._wakeup)
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)


class RawAnswers:
    """A real TCP server on 127.0.0.1 that answers ``GET /<name>`` with the canned bytes of
    ``ANSWERS[name]``, written in the pieces given (to make the poller read an answer in several
    parts); it counts the connections it accepted."""

    ANSWERS = {
        "split": [b"HTTP/1.1 200 OK\r\nContent-Le", b"ngth: 8\r\n\r\n{\"a\":", b" 1}"],
        "chunked": [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"",
                    b"\r\n4;ext=1\r\n: 2}\r\n0\r\n", b"\r\n"],
        "bare_lf": [b"HTTP/1.1 200 OK\nContent-Length: 8\n\n{\"a\": 3}"],
        "close": [b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 8\r\n\r\n{\"a\": 4}"],
        "http10": [b"HTTP/1.0 200 OK\r\n\r\n{\"a\": 5}"],
        "extra": [b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n{\"a\": 6}HTTP/1.1 200"],
        "not_object": [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]"],
        "bad_chunk": [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"],
        "bad_length": [b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n{}"],
        "bad_status": [b"SPDY/9 200 OK\r\n\r\n"],
    }

    def __init__(self) -> None:
        import asyncio
        import threading

        self.connections = 0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader, writer) -> None:
        import asyncio

        self.connections += 1
        try:
            while line := await reader.readline():
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
                name = line.split()[1].decode().rsplit("/", 1)[-1]
                for piece in self.ANSWERS[name]:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.01)  # separate reads on the poller's side
                if name in ("close", "http10", "extra"):
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def stop(self) -> None:
        import asyncio

        async def shutdown() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_answers_framed_every_way_are_read_and_only_clean_ones_reuse_the_connection():
    raw = RawAnswers()
    p = Poller(timeout_s=2.0, max_concurrency=1)
    try:
        base = f"http://127.0.0.1:{raw.port}"
        expect = {"split": 1, "chunked": 2, "bare_lf": 3, "close": 4, "http10": 5, "extra": 6}
        for name, a in expect.items():
            got = p.sweep([f"{base}/{name}"], path="")[f"{base}/{name}"]
            assert got.ok and got.data == {"a": a}, (name, got)
        # split, chunked, bare_lf and close went over one connection (close ended it); http10
        # and extra each ended theirs (extra sent bytes past its answer: never reused)
        assert raw.connections == 3
        for name, words in (("not_object", "expected a JSON object"),
                            ("bad_chunk", "bad chunk size"),
                            ("bad_length", "bad Content-Length"),
                            ("bad_status", "bad status line")):
            got = p.sweep([f"{base}/{name}"], path="")[f"{base}/{name}"]
            assert (got.ok, got.reason) == (False, "bad_response") and words in got.error, got
            assert "SPDY" not in got.error  # another service's greeting is never shown
        assert p.sweep([f"{base}/split"], path="")[f"{base}/split"].data == {"a": 1}
    finally:
        p.close()
        raw.stop()


def test_a_sweep_leaves_no_reference_cycles(sim, poller):
    """From 20,000 targets the monitor sweeps with the cyclic GC off and then freezes what
    survived (monitor/service.py): a reference cycle left by the poller would be kept until its
    full collection every 100 sweeps, and with it every answer the cycle reaches. A sweep of
    good answers leaves none; failing, refused and timed-out polls leave only the closed
    connections' asyncio transports (a transport holds its own bound method), none of the
    poller's objects or answers."""
    import gc

    import monitor.poll.poller as poller_module

    poller.sweep(sim.urls)  # warm: connections pooled, caches filled
    gc.collect()
    gc.disable()
    try:
        poller.sweep(sim.urls)
        assert gc.collect() == 0
        for rank, mode in zip(sim.ranks[1:], ("http500", "garbage", "close", "down", "slow"),
                              strict=True):
            rank.set_mode(mode, delay=30.0)
        polls = poller.sweep(sim.urls)
        assert [p.reason for p in polls.values()] == [None, "http_status", "bad_response",
                                                      "connection", "connection", "timeout"]
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [type(o) for o in gc.garbage]
        assert not [t for t in left if t.__module__ == poller_module.__name__], left
        assert not [o for o in gc.garbage if isinstance(o, dict) and "rank" in o]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_answers_handed_on_as_rows_in_batches(sim):
    """The poller process's wire format (monitor/poll/poll_process.py): each target once, as a row
    naming its place in the URLs, in batches of per_batch and a shorter last one; a failure
    row has the reason and error a RankPoll would."""
    p = Poller(timeout_s=0.5)
    try:
        sim.ranks[2].set_mode("http500")
        sim.ranks[4].set_mode("down")
        batches: list = []
        urls = sim.urls + sim.urls[:2]  # a repeated URL is asked once
        assert p.sweep(urls, on_rows=batches.append, per_batch=4) == {}
        assert [len(b) for b in batches] == [4, 2]
        rows = {r[0]: r for b in batches for r in b}
        assert sorted(rows) == list(range(6))
        for place, ok, body, reason, error, status, latency, at in rows.values():
            assert ok == (place not in (2, 4)) and latency >= 0 and at > 0
            if ok:
                assert json.loads(body)["rank"] == place and reason is error is status is None
        assert rows[2][3:6] == ("http_status", rows[2][4], 500) and "HTTP 500" in rows[2][4]
        assert rows[4][2] is None and rows[4][3] == "connection"
    finally:
        p.close()


def test_event_loop_choice_falls_back_without_uvloop(monkeypatch):
    """``auto`` (the poller process's default) is uvloop where installed, else the stdlib's
    loop; an unknown loop is refused."""
    import sys

    from monitor.poll.poller import new_event_loop

    if importlib.util.find_spec("uvloop") is not None:
        loop = new_event_loop("auto")
        assert type(loop).__module__.startswith("uvloop")
        loop.close()
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed: import fails
    loop = new_event_loop("auto")
    assert type(loop).__module__.startswith("asyncio")
    loop.close()
    with pytest.raises(ValueError):
        new_event_loop("trio")


@pytest.fixture
def one_address():
    """64 virtual ranks behind one address (tests/support/virtual_ranks.py, as behind a proxy),
    stepping every 1,000 s from step 22: every rank stays at step 22 through the test."""
    import subprocess
    import sys

    root = __file__.rsplit("/tests/", 1)[0]
    epoch = time.monotonic() - 22.5 * 1000.0
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.virtual_ranks", "--ranks", "64",
                             "--offset", "0", "--group-size", "8", "--step-s", "1000",
                             "--epoch", repr(epoch)], cwd=root, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("VRANKS "), line
        yield [f"http://127.0.0.1:{int(line.split()[1])}/r/{r}" for r in range(64)]
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_queries_hold_when_a_connection_goes_on_to_the_next_rank_behind_its_address(
        one_address, kind):
    """Ranks behind one address (a proxy; the benchmarks' virtual ranks): a connection whose
    answer is in goes straight on to the sweep's next URL behind the same address. That request
    carries its own URL's query too: the hand-off sent the bare path, so after the first
    ``max_concurrency`` requests every rank was asked for all its rows (at 100,000 virtual
    ranks, 8 rows a leader instead of 1-2: 25 MB a sweep instead of ~16, docs/scaling.md)."""
    poller = POLLERS[kind](timeout_s=5.0, max_concurrency=2)
    try:
        # since = 21 - k: a rank at step 22 serves its newest k rows (virtual_ranks.state)
        queries = [f"?since={21 - r % 8}" for r in range(64)]
        for _ in range(2):  # the second sweep starts on the pooled connections
            polls = poller.sweep(one_address, queries=queries)
            assert all(p.ok for p in polls.values())
            # as the poller keeps them: packed, a TIMING_ROW each (none served: the empty list)
            served = [polls[u].data["timing"]["recent"] for u in one_address]
            rows = [len(r) // TIMING_ROW.size if type(r) is bytes else len(r) for r in served]
            assert rows == [r % 8 for r in range(64)]
            assert {polls[u].data["step"] for u in one_address} == {22}
    finally:
        poller.close()
