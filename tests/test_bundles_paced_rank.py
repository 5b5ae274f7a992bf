"""An incident bundle against a rank that paces its reads (docs/worker_server.md, Overhead): the
bundle asks each rank its stacks and its dump at once, right before a kill. The monitor's
User-Agent had one unpaced read per address, so the second ask, behind two readers holding the
paced slots, was refused 429 (held 1 s) and the bundle lost the rank's stacks or its dump; both
when the readers shared the monitor's address or the sweep had just read the dump. A real
WorkerServer, the monitor's real Bundles and Poller."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest
import requests

from monitor.act.bundles import REFUSED_RETRY_S
from monitor.evidence.rank import RankView
from rank_wire import MONITOR_AGENT
from tests.support.monitor_sim import SimRank, SimRanks
from tests.support.views import scratch_view
from tests.test_bundles import bundles_for, finding, hang_dumps, members, view_of
from worker_server import RankIdentity, RankState, WorkerServer
from worker_server import metrics as worker_metrics


def _read(port: int, path: str, agent: str, source: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    try:
        conn.request("GET", path, headers={"User-Agent": agent})
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


@pytest.mark.parametrize("readers_from", ["127.0.0.2", "127.0.0.1"])  # .1: the monitor's too
# read just before by the monitor's agent from the bundle's address: nothing; the sweep's
# Flight Recorder read; another monitor on this host (a shard, a standby) twice the stacks (its
# 429, held HOLD_S by the rank, was the Retry-After: asked again on receipt, within 2 s)
@pytest.mark.parametrize("read_before", [(), ("/v1/fr_trace",), ("/v1/stacks", "/v1/stacks")])
def test_a_bundle_keeps_stacks_and_dump_behind_two_looping_readers(tmp_path, monkeypatch,
                                                                   readers_from, read_before):
    monkeypatch.setattr(worker_metrics, "MAX_PACE_S", 5.0)  # pace_s() > 0 all through the test
    dump = json.dumps(hang_dumps(1, absent=0)[0]).encode()
    state = RankState(RankIdentity(job="t", replica_group=0, group_rank=0, group_world_size=1))
    server = WorkerServer(state, fr_dumper=lambda *_a, **_k: dump).serve()
    rank_state = requests.get(server.url + "/v1/state", timeout=5).json()  # not paced yet
    view = scratch_view(time.time(), {server.url: RankView(server.url, True, rank_state)})
    waiting, let_go, holders = threading.Semaphore(0), threading.Event(), [0]

    def pace() -> None:  # the looping readers' waits are held until the bundle is written
        if holders[0] < worker_metrics.PACED_SLOTS:
            holders[0] += 1
            waiting.release()
            let_go.wait(10)

    monkeypatch.setattr(server.metrics, "pace", pace)
    statuses: list[int] = []
    loopers = [threading.Thread(target=lambda: statuses.append(
        _read(server.port, "/v1/stacks", "curl/8", readers_from)))
        for _ in range(worker_metrics.PACED_SLOTS)]
    bundles, store = bundles_for(tmp_path, timeout_s=2.0)
    try:
        server.metrics.served(10.0)
        for t in loopers:
            t.start()
        for _ in loopers:  # both paced slots taken
            assert waiting.acquire(timeout=5)
        for path in read_before:
            assert _read(server.port, path, MONITOR_AGENT + "/1", "127.0.0.1") == 200
        got = bundles.capture("evict", view, view, finding(0, [0]), 1,
                              {"id": 1, "decision": "evict", "status": "sending"}, [])
        m = json.loads(members(bundles.store.path(got["id"]))["manifest.json"])
        assert [(r["stacks"], r["fr_trace"]) for r in m["ranks"]] == [("ok", "ok")], m["ranks"]
    finally:
        let_go.set()
        for t in loopers:
            t.join(timeout=5)
        bundles.close()
        store.close()
        server.stop()
    assert statuses == [200] * worker_metrics.PACED_SLOTS


def test_a_refused_ask_is_asked_again_after_retry_after_within_the_timeout(tmp_path):
    """A rank that refuses a read (429, Retry-After: 1) was kept refused: the bundle asks it
    again once Retry-After has passed, within ``--bundle-timeout``, and keeps what it sends;
    one that refuses throughout is named refused by the timeout."""
    sim = SimRanks.start(2)
    dumps = hang_dumps(2, absent=1)
    for r in sim.ranks:
        r.fr = dumps[r.state["rank"]]
    view = view_of(sim)
    refusals = {0: 1, 1: 10**6}  # rank -> its next stacks asks answered 429
    asked: dict[int, list[float]] = {0: [], 1: []}

    def refusing(rank: SimRank):
        plain = rank.respond

        def respond(path, mode):
            n = rank.state["rank"]
            if path.startswith("/v1/stacks"):
                asked[n].append(time.monotonic())
                if refusals[n] > 0:
                    refusals[n] -= 1
                    return "429 Too Many Requests", "application/json", b'{"status": 429}'
            return plain(path, mode)
        return respond

    for rank in sim.ranks:
        rank.respond = refusing(rank)
    bundles, store = bundles_for(tmp_path, timeout_s=1.5)
    try:
        t0 = time.monotonic()
        got = bundles.capture("evict", view, view, finding(1, [1]), 7,
                              {"id": 1, "decision": "evict", "status": "sending"}, [])
        took = time.monotonic() - t0
        m = json.loads(members(bundles.store.path(got["id"]))["manifest.json"])
        stacks = {r["rank"]: r["stacks"] for r in m["ranks"]}
        assert stacks == {0: "ok", 1: "http_status: HTTP 429 Too Many Requests"}, stacks
        # Retry-After counted from the ask (an immediate 429 here: its answer's few ms less)
        assert len(asked[0]) == 2 and asked[0][1] - asked[0][0] >= REFUSED_RETRY_S - 0.05, asked
        assert took < 1.5 + 2.0, took  # the timeout, plus writing
    finally:
        bundles.close()
        store.close()
        sim.stop()


def _rank_with_slots_held(monkeypatch, pace_s: float):
    """A real WorkerServer whose reads are paced ``pace_s`` (its pace pushed forward), and two
    curl loops from 127.0.0.2 sleeping in both paced slots, as designed at worst."""
    monkeypatch.setattr(worker_metrics, "MAX_PACE_S", pace_s)
    dump = json.dumps(hang_dumps(1, absent=0)[0]).encode()
    state = RankState(RankIdentity(job="t", replica_group=0, group_rank=0, group_world_size=1))
    server = WorkerServer(state, fr_dumper=lambda *_a, **_k: dump).serve()
    server.metrics.served(100.0)
    loopers = [threading.Thread(target=_read, args=(server.port, "/v1/fr_trace", "curl/8",
                                                    "127.0.0.2")) for _ in range(2)]
    for t in loopers:
        t.start()
    return server, loopers


def test_spoofed_monitor_agents_never_hold_the_threads_the_monitors_polls_need(monkeypatch):
    """Any client may send the monitor's User-Agent: the read a named agent may have paced with
    no slot free takes the one thread beyond the slots, never more, so six such addresses at once
    leave the monitor's ``/v1/state`` poll answered within its 0.8 s timeout."""
    server, loopers = _rank_with_slots_held(monkeypatch, 3.0)
    spoofers: list[threading.Thread] = []
    try:
        for a in range(6):  # each: a first read (unpaced), then a second (the paced one)
            for _ in range(2):
                spoofers.append(threading.Thread(target=_read, args=(
                    server.port, "/v1/stacks", MONITOR_AGENT + "/1", f"127.0.0.{10 + a}")))
        for t in spoofers:
            t.start()
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=0.8)
        try:
            conn.request("GET", "/v1/state", headers={"User-Agent": MONITOR_AGENT + "/1"})
            assert conn.getresponse().status == 200
        finally:
            conn.close()
    finally:
        for t in loopers + spoofers:
            t.join(timeout=10)
        server.stop()

