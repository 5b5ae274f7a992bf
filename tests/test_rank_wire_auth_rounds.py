"""The signed calls' edges (rank_wire.auth): a probe round completes though a rank is busy with
another monitor's probe (429), a standby shard asks no round, a rank known under two URLs of one
listener is still called, a skipped abort is no failed try, a bearer refusal says the rank's
words, and a POST without its JSON content type is told which header is missing.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from monitor.act.actions import RankCalls
from monitor.act.survivors import ABORT_TRIES, Survivors
from monitor.api.metrics import MonitorMetrics
from monitor.config import ProbeConfig
from monitor.evidence.claims import MAX_NAMES, Claims, Resolver
from monitor.evidence.lighthouse_status import LighthouseStatus, QuorumMember
from monitor.evidence.probes import ProbeMesh
from monitor.evidence.view import ViewBuilder
from monitor.poll.discovery import Target
from monitor.poll.packed_state import pack_state
from monitor.poll.poller import RankPoll
from monitor.store import Store
from worker_server.app import create_app
from worker_server.state import RankIdentity, RankState

TOKEN = "s3cret-exit-token"


class FakeRank(BaseHTTPRequestHandler):
    """A fake of a rank's WorkerServer: records each POST's path; answers with the server's
    ``answers`` queue (status, body) first, then as a rank that took the call."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.seen.append(self.path)
        if self.server.answers:
            status, out = self.server.answers.pop(0)
        elif self.path == "/v1/probe":
            status, out = 200, {"results": [], "control": None}
        else:
            status, out = 202, {"exiting": True, "mechanism": "fake"}
        data = json.dumps(out).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fakes():
    """Two fake ranks, each its own server (a probe round needs two hosts)."""
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), FakeRank) for _ in range(2)]
    for s in servers:
        s.seen, s.answers = [], []
        threading.Thread(target=s.serve_forever, args=(0.05,), daemon=True).start()
    yield servers
    for s in servers:
        s.shutdown()
        s.server_close()


def url_of(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def state_of(url: str, g: int, **more) -> dict:
    """Group ``g``'s rank 0 on host h<g>, in quorum 1."""
    s = RankState(RankIdentity(job="auth", replica_group=g, group_rank=0, group_world_size=1,
                               host=f"h{g}")).snapshot()
    s.update(replica_id=f"replica_group_{g}:auth", worker_url=url, quorum_id=1,
             participating=True, num_participants=2, **more)
    return s


def view_of(answering: dict[str, dict], unreachable: dict[str, dict] | None = None):
    """A sweep's view: ``answering`` (URL -> state) answered; ``unreachable``'s answered the
    sweep before (their last state is known) and not this one."""
    unreachable = unreachable or {}
    targets = [Target(u, "static") for u in (*answering, *unreachable)]
    polls = {u: RankPoll(u, True, data=pack_state(s)) for u, s in answering.items()}
    b = ViewBuilder()
    b.update(targets, {**polls, **{u: RankPoll(u, True, data=pack_state(s))
                                   for u, s in unreachable.items()}}, now=time.time() - 5)
    return b.update(targets, {**polls, **{u: RankPoll(u, False, error="refused")
                                          for u in unreachable}}, now=time.time())


# --- 1. a probe round with a rank busy with another monitor's probe ---------------------------

def test_a_rank_busy_with_another_probe_is_asked_again_and_the_round_is_whole(fakes):
    """Two monitors of one job probing the same ranks (a standby, a rolling update): the rank
    answers the second 429; asked again within the round, its row is there (a missing row names
    no network culprit)."""
    fakes[0].answers = [(429, {"error": "another probe is running on this rank"})]
    urls = [url_of(s) for s in fakes]
    mesh = ProbeMesh(ProbeConfig(timeout_s=0.1), TOKEN)
    view = view_of({u: state_of(u, g) for g, u in enumerate(urls)})
    mesh.ask(view, True, None, time.time())
    assert mesh.wait(10)
    rnd = mesh.take()
    assert rnd is not None and rnd.missing() == {}
    assert fakes[0].seen == ["/v1/probe"] * 2 and fakes[1].seen == ["/v1/probe"]
    # busy on every try: asked BUSY_RETRIES times more, then named busy
    fakes[0].answers = [(429, {"error": "busy"})] * 5
    mesh.ask(view, True, None, time.time() + 10)  # past --probe-interval
    assert mesh.wait(10)
    assert "busy" in mesh.take().missing()["h0"] and len(fakes[0].seen) == 2 + 3


def test_a_bearer_refusal_says_the_ranks_words(fakes):
    """--rank-auth bearer against a rank with LIGHTKEEPER_EXIT_AUTH=hmac: not only "the token
    differs"."""
    refusal = ("the bearer token is not taken on this rank (LIGHTKEEPER_EXIT_AUTH=hmac): the "
               "monitor must sign its calls")
    fakes[0].answers = [(401, {"error": refusal, "status": 401})]
    urls = [url_of(s) for s in fakes]
    mesh = ProbeMesh(ProbeConfig(timeout_s=0.1), TOKEN, auth="bearer")
    mesh.ask(view_of({u: state_of(u, g) for g, u in enumerate(urls)}), True, None, time.time())
    assert mesh.wait(10)
    why = mesh.take().missing()["h0"]
    assert "signed calls" in why and refusal[:100] in why and TOKEN not in why


# --- 1b. a standby shard asks no probe round -------------------------------------------------

class StandbyShard:
    """A fake of monitor.shard.Shards (no etcd) whose ``--shard`` another monitor holds: it
    keeps the targets, proposes nothing, hears nothing of the other shards."""

    holds = False
    sent_kills: set = set()

    def own_targets(self, targets, poller, now, version):
        return targets

    def after_sweep(self, view, evidence, now):
        pass

    def reported_elsewhere(self):
        return set(), False

    def to_json(self):
        return {"standby": not self.holds}

    def start(self):
        pass

    def stop(self):
        pass


def test_a_standby_shard_asks_no_probe_round(tmp_path):
    from tests.support.monitor_sim import SimJob
    from tests.test_monitor_network import TOKEN as SIM_TOKEN
    from tests.test_monitor_network import (
        Clock,
        Driver,
        Training,
        links,
        monitor,
        probes_asked,
        round_started,
    )

    job = SimJob(4, ranks_per_group=2, heartbeat_timeout_ms=1000)
    mon = None
    try:
        job.sim.probe_token, job.sim.links = SIM_TOKEN, links(job)
        clock = Clock()
        mon = monitor(tmp_path, job, clock, rank_exit_token=SIM_TOKEN)
        mon.shard = shard = StandbyShard()
        d = Driver(mon, Training(job), clock)
        d.sweeps(4)
        d.train.stall(0.6, d.clock.t)  # half way to a job stall: a round is wanted
        d.sweeps(3, steps=0)
        assert probes_asked(job) == 0 and not round_started(d)
        assert "stands by" in mon.probes.to_json()["note"]
        shard.holds = True  # the other monitor's lease ended: this one probes
        d.until(lambda: round_started(d), "a probe round", steps=0)
        assert mon.probes.wait(10) and probes_asked(job) > 0
    finally:
        if mon is not None:
            mon.stop()
        job.stop()


# --- 2. a rank known under two URLs of one listener; a skipped abort -------------------------

@pytest.fixture
def node7(monkeypatch):
    """A fake resolver: node7.test resolves to 127.0.0.1 (a listed host name for a rank that
    registered by its address), nowhere.test to nothing; counts node7's look-ups."""
    real = socket.getaddrinfo
    looked: list[str] = []

    def getaddrinfo(host, port, *args, **kw):
        if host == "nowhere.test":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if host == "node7.test":
            looked.append(host)
            host = "127.0.0.1"
        return real(host, port, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return looked


def test_a_rank_listed_by_name_and_registered_by_address_is_called(fakes, node7):
    """file_sd lists http://node7:PORT, the rank registered http://127.0.0.1:PORT: one process,
    both URLs claim its identity (the listed one unreachable, superseded). A signed call can
    only reach that one listener: it is sent. A URL of another port or path is still a
    stranger."""
    live = url_of(fakes[0])
    port = fakes[0].server_address[1]
    listed = f"http://node7.test:{port}"
    calls = RankCalls(TOKEN, timeout_s=5)
    try:
        view = view_of({live: state_of(live, 0)}, {listed: state_of(listed, 0)})
        # looked up off the caller's thread: this sweep's call waits for the answer
        res = calls.exit(view.ranks[live], "evicted", view)
        assert not res.sent and res.skipped and "could not resolve node7.test yet" in res.detail
        assert calls.claims.resolver.settle(5)
        assert calls.exit(view.ranks[live], "evicted", view).sent
        assert calls.abort(view.ranks[live], "gone", 1, 1, view).sent
        assert node7 == ["node7.test"]  # resolved once, kept a while
        for other in (f"http://127.0.0.1:{port + 1 if port < 65535 else port - 1}",
                      f"{live}/rank5"):
            view = view_of({live: state_of(live, 0)}, {other: state_of(other, 0)})
            res = calls.exit(view.ranks[live], "evicted", view)
            assert not res.sent and "claims the same rank" in res.detail
        # a name that does not resolve is no proof of one listener, nor blamed on a claim
        nowhere = f"http://nowhere.test:{port}"
        view = view_of({live: state_of(live, 0)}, {nowhere: state_of(nowhere, 0)})
        calls.exit(view.ranks[live], "evicted", view)
        assert calls.claims.resolver.settle(5)
        res = calls.exit(view.ranks[live], "evicted", view)
        assert not res.sent and "could not resolve nowhere.test yet" in res.detail
    finally:
        calls.close()
    assert fakes[0].seen == ["/v1/exit", "/v1/abort"]


def test_an_abort_skipped_for_a_claimed_identity_is_no_failed_try(fakes, tmp_path):
    """A survivor whose identity another target claims is not called, ABORT_TRIES sweeps and
    more: one decision says so (status skipped), it is not given up on, and is told once the
    claim is gone."""
    live, stranger = url_of(fakes[0]), "http://127.0.0.1:9"
    blocked = {"phase": "allreduce",
               "timing": {"waiting": {"scope": "cross", "seconds": 5.0}}}
    gone = "replica_group_1:auth"
    status = LighthouseStatus(
        quorum_id=1, members={r: QuorumMember(r, 10, "store", 1)
                              for r in ("replica_group_0:auth", gone)},
        heartbeats={"replica_group_0:auth": 0.1, gone: 30.0}, stale=frozenset({gone}))
    store = Store(str(tmp_path / "state.sqlite"))
    survivors = Survivors(RankCalls(TOKEN, timeout_s=5), store, MonitorMetrics("auth"), "auth")
    try:
        claimed = view_of({live: state_of(live, 0, **blocked)},
                          {stranger: state_of(stranger, 0, **blocked)})
        (skip,) = survivors.release(claimed, claimed, status, None, set(), time.time())
        for _ in range(ABORT_TRIES):
            assert survivors.release(claimed, claimed, status, None, set(), time.time()) == []
        assert skip["ranks"] == [] and skip["skipped"] == [0] and live in skip["detail"]
        assert [d["status"] for d in store.decisions(decision="abort")] == ["skipped"]
        assert fakes[0].seen == []
        alone = view_of({live: state_of(live, 0, **blocked)})
        (made,) = survivors.release(alone, alone, status, None, set(), time.time())
        assert fakes[0].seen == ["/v1/abort"]
        assert sorted(d["status"] for d in store.decisions(decision="abort")) == [
            "sent", "skipped"]
        assert made["replica_id"] == gone
    finally:
        survivors.close()
        store.close()


# --- 6. a POST without its JSON content type -------------------------------------------------

def test_a_post_without_the_json_content_type_is_told_the_header():
    """A plain ``curl -d`` sends valid JSON as a form: "body must be JSON" misled."""
    state = RankState(RankIdentity(replica_group=2, group_rank=1, group_world_size=2))
    aborts = []
    c = create_app(state, exit_token=TOKEN, fault_handler=lambda spec: None, fault_token="f",
                   abort_handler=lambda *a: aborts.append(a) or {}).test_client()
    for path, body, token in (("/v1/abort", {"reason": "x"}, TOKEN),
                              ("/v1/probe", {"peers": ["http://127.0.0.1:9"]}, TOKEN),
                              ("/v1/faults", {"spec": "hang:step=1"}, "f")):
        r = c.post(path, data=json.dumps(body), headers={"Authorization": f"Bearer {token}"},
                   content_type="application/x-www-form-urlencoded")
        assert r.status_code == 400, (path, r.get_json())
        assert "Content-Type: application/json" in r.get_json()["error"], path
    assert aborts == []


# --- 7. host names looked up off the sweep, once per name, bounded ----------------------------

@pytest.fixture
def slow_dns(monkeypatch):
    """A resolver that takes up to 1 s per name (until ``gate`` is set): node<N>.test resolves
    to 127.0.0.1; ``looked`` counts the look-ups by name."""
    real = socket.getaddrinfo
    gate, looked = threading.Event(), []

    def getaddrinfo(host, port, *args, **kw):
        if host.endswith(".test"):
            looked.append(host)
            gate.wait(1.0)
            host = "127.0.0.1"
        return real(host, port, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return gate, looked


@pytest.fixture
def many_fakes():
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), FakeRank) for _ in range(16)]
    for s in servers:
        s.seen, s.answers = [], []
        threading.Thread(target=s.serve_forever, args=(0.05,), daemon=True).start()
    yield servers
    for s in servers:
        s.shutdown()
        s.server_close()


def test_a_slow_resolver_holds_no_sweep_and_each_name_is_looked_up_once(many_fakes, slow_dns):
    """16 ranks on 2 hosts, each known at its address (verified) and listed by its host's name
    (unreachable now): while the names are looked up, a probe round and the survivors' aborts
    return at once and wait for a later sweep; each name is looked up once, for every caller
    (one Claims); once known, the calls go through."""
    gate, looked = slow_dns
    blocked = {"phase": "allreduce", "timing": {"waiting": {"scope": "cross", "seconds": 5.0}}}
    answering, listed = {}, {}
    for g, s in enumerate(many_fakes):
        port, host = s.server_address[1], f"h{g % 2}"
        answering[url_of(s)] = state_of(url_of(s), g, host=host, **blocked)
        name = f"http://node{g % 2}.test:{port}"
        listed[name] = state_of(name, g, host=host, **blocked)
    view = view_of(answering, listed)
    gone = "replica_group_99:auth"
    status = LighthouseStatus(
        quorum_id=1, members={r: QuorumMember(r, 10, "store", 1) for r in
                              (*(s["replica_id"] for s in answering.values()), gone)},
        heartbeats={**{s["replica_id"]: 0.1 for s in answering.values()}, gone: 30.0},
        stale=frozenset({gone}))
    claims = Claims()
    mesh = ProbeMesh(ProbeConfig(timeout_s=0.1), TOKEN, claims=claims)
    store = Store(":memory:")
    survivors = Survivors(RankCalls(TOKEN, timeout_s=5, claims=claims), store,
                          MonitorMetrics("auth"), "auth")
    try:
        t0 = time.monotonic()
        mesh.ask(view, True, None, time.time(), known=view)
        (skip,) = survivors.release(view, view, status, None, set(), time.time())
        assert time.monotonic() - t0 < 0.5
        assert not mesh.running() and "two hosts" in mesh.note
        assert skip["ranks"] == [] and len(skip["skipped"]) == 16
        assert "could not resolve node0.test yet" in skip["detail"]
        gate.set()
        assert claims.resolver.settle(5)
        assert sorted(looked) == ["node0.test", "node1.test"]
        mesh.ask(view, True, None, time.time() + 10, known=view)
        assert mesh.wait(10) and mesh.take().missing() == {}
        (made,) = survivors.release(view, view, status, None, set(), time.time())
        assert len(made["ranks"]) == 16 and made["skipped"] == []
        assert all("/v1/abort" in s.seen for s in many_fakes)
        assert sorted(looked) == ["node0.test", "node1.test"]
    finally:
        survivors.close()
        store.close()
        claims.close()


def test_a_failed_lookup_is_asked_again_after_5s_in_its_own_words(fakes, monkeypatch, caplog):
    """A resolver failing once (the network in trouble): the call waits, said once as a
    name not resolved (not a claim), and goes through once the name is asked again 5 s on."""
    real, looked = socket.getaddrinfo, []

    def getaddrinfo(host, port, *args, **kw):
        if host == "node7.test":
            looked.append(host)
            if len(looked) == 1:
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
            host = "127.0.0.1"
        return real(host, port, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    now = [1000.0]
    claims = Claims(clock=lambda: now[0])
    calls = RankCalls(TOKEN, timeout_s=5, claims=claims)
    live = url_of(fakes[0])
    listed = f"http://node7.test:{fakes[0].server_address[1]}"
    view = view_of({live: state_of(live, 0)}, {listed: state_of(listed, 0)})
    try:
        with caplog.at_level(logging.WARNING):
            for step in (0.0, 4.9):
                now[0] += step
                res = calls.exit(view.ranks[live], "evicted", view)
                assert claims.resolver.settle(5)
                assert not res.sent and "could not resolve node7.test yet" in res.detail
            assert looked == ["node7.test"]  # the failure kept 5 s, not asked every sweep
            now[0] += 0.2
            calls.exit(view.ranks[live], "evicted", view)  # asked again
            assert claims.resolver.settle(5)
            assert calls.exit(view.ranks[live], "evicted", view).sent
    finally:
        calls.close()
        claims.close()
    lines = [r.getMessage() for r in caplog.records if "node7.test" in r.getMessage()]
    assert lines == ["could not resolve node7.test yet: not signed"]
    assert fakes[0].seen == ["/v1/exit"]


def test_the_names_kept_are_bounded(monkeypatch):
    monkeypatch.setattr(socket, "getaddrinfo",
                        lambda host, port, *a, **kw: [(socket.AF_INET, socket.SOCK_STREAM, 6,
                                                       "", ("10.0.0.7", 0))])
    resolver = Resolver()
    try:
        for i in range(5000):
            resolver.addresses(f"n{i}.test")
        assert resolver.settle(10)
        assert len(resolver) <= MAX_NAMES == 4096
        assert resolver.addresses("n4999.test") == frozenset({"10.0.0.7"})
        assert resolver.addresses("10.0.0.8") == frozenset({"10.0.0.8"})  # no look-up
    finally:
        resolver.close()


def test_a_dual_stack_name_and_its_ipv4_address_are_one_listener(fakes, monkeypatch):
    """One process listens on one address and port: a name resolving to {v4, v6} and the
    rank's v4 address are one listener."""
    port, real = fakes[0].server_address[1], socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, p, *a, **kw: [
        (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::7", 0, 0, 0)),
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0))]
        if host == "node7.test" else real(host, p, *a, **kw))
    live, listed = url_of(fakes[0]), f"http://node7.test:{port}"
    view = view_of({live: state_of(live, 0)}, {listed: state_of(listed, 0)})
    calls = RankCalls(TOKEN, timeout_s=5)
    try:
        calls.exit(view.ranks[live], "evicted", view)
        assert calls.claims.resolver.settle(5)
        assert calls.exit(view.ranks[live], "evicted", view).sent
    finally:
        calls.close()
        calls.claims.close()


# --- 8. a skipped abort is said per gone group, a partial one names whom it left out ---------

def quorum_status(gone: str, live: tuple[str, ...]) -> LighthouseStatus:
    return LighthouseStatus(
        quorum_id=1, members={r: QuorumMember(r, 10, "store", 1) for r in (*live, gone)},
        heartbeats={**{r: 0.1 for r in live}, gone: 30.0}, stale=frozenset({gone}))


def test_a_skipped_abort_is_said_again_for_a_new_gone_group(fakes, caplog):
    live, other, stranger = url_of(fakes[0]), url_of(fakes[1]), "http://127.0.0.1:9"
    blocked = {"phase": "allreduce", "timing": {"waiting": {"scope": "cross", "seconds": 5.0}}}
    claims = Claims()
    store = Store(":memory:")
    survivors = Survivors(RankCalls(TOKEN, timeout_s=5, claims=claims), store,
                          MonitorMetrics("auth"), "auth")
    claimed = view_of({live: state_of(live, 0, **blocked)},
                      {stranger: state_of(stranger, 0, **blocked)})
    alone = view_of({live: state_of(live, 0, **blocked)})
    first, second = quorum_status("replica_group_1:auth", ("replica_group_0:auth",)), \
        quorum_status("replica_group_2:auth", ("replica_group_0:auth",))
    try:
        with caplog.at_level(logging.WARNING):
            for view, status in ((claimed, first), (alone, first), (claimed, second)):
                claims.keep(view)  # what the enforcer does each sweep
                survivors.release(view, view, status, None, set(), time.time())
        said = [r.getMessage() for r in caplog.records if r.name == "monitor.evidence.claims"]
        assert len(said) == 2 and all(live in m and stranger in m for m in said)
        rows = sorted(store.decisions(decision="abort"), key=lambda d: d["id"])
        assert [(d["replica_id"], d["status"]) for d in rows] == [
            ("replica_group_1:auth", "skipped"), ("replica_group_1:auth", "sent"),
            ("replica_group_2:auth", "skipped")]
        assert live in rows[2]["detail"] and "not told" in rows[2]["detail"]
        # a partial skip: the decision for the rank told names the one left out, and why
        both = view_of({live: state_of(live, 0, **blocked), other: state_of(other, 3, **blocked)},
                       {stranger: state_of(stranger, 0, **blocked)})
        third = quorum_status("replica_group_4:auth",
                              ("replica_group_0:auth", "replica_group_3:auth"))
        (made,) = survivors.release(both, both, third, None, set(), time.time())
        assert made["ranks"] == [3] and made["skipped"] == [0]
        assert f"{live})" in made["detail"] and "claims the same rank" in made["detail"]
        assert {d["id"]: d["status"] for d in store.decisions(decision="abort")}[made["id"]] \
            == "sent"
        assert survivors.release(both, both, third, None, set(), time.time()) == []
    finally:
        survivors.close()
        store.close()
        claims.close()
