"""Both ends of the signed calls (rank_wire.auth): a WorkerServer's ``POST /v1/exit``,
``/v1/abort`` and ``/v1/probe`` take a signature for their own rank only (and, deprecated, the
bearer token); the monitor's exit, abort and probe calls carry a signature for the rank they are
for and never the token, unless run with ``--rank-auth bearer``.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time

import pytest

from http_serving import BackgroundWSGIServer
from monitor.act.actions import Orphans, RankCalls
from monitor.cli import add_arguments, config_from_args
from monitor.config import ConfigError, MonitorConfig, ProbeConfig
from monitor.evidence.probes import ProbeMesh
from monitor.evidence.view import RankView, ViewBuilder
from monitor.poll.discovery import Target
from monitor.poll.packed_state import pack_state
from monitor.poll.poller import RankPoll
from rank_wire import auth
from tests.support.fake_rank import FakeRanks
from worker_server.app import create_app
from worker_server.state import RankIdentity, RankState

TOKEN = "s3cret-exit-token"
RID = "replica_group_2:abc"


# --- the rank's side: a WorkerServer's routes -------------------------------------------------

def rank_app(replica_id: str | None = RID):
    """Group 2, group rank 1 (global rank 5 of groups of 2)."""
    state = RankState(RankIdentity(replica_group=2, group_rank=1, group_world_size=2))
    state.replica_id = replica_id
    exits, aborts = [], []
    app = create_app(state, exit_handler=exits.append, exit_token=TOKEN,
                     abort_handler=lambda *a: aborts.append(a) or {"aborted": True})
    return app.test_client(), state, exits, aborts


def signed(c, path: str, ident: str, body: dict, token: str = TOKEN, sent: bytes | None = None):
    data = json.dumps(body).encode()
    return c.post(path, data=data if sent is None else sent,
                  headers={"Authorization": auth.header(token, "POST", path, ident, data),
                           "Content-Type": "application/json"})


def test_a_rank_takes_a_signature_for_itself_only():
    c, _, exits, aborts = rank_app()
    mine = f"2/1/{RID}"
    for stranger in ("2/5/" + RID, "2/0/" + RID, "3/1/" + RID, "2/1/replica_group_2:old",
                     "2/1/"):
        assert signed(c, "/v1/exit", stranger, {"reason": "x"}).status_code == 401
        assert signed(c, "/v1/abort", stranger, {"reason": "x"}).status_code == 401
        assert signed(c, "/v1/probe", stranger, {}).status_code == 401
    assert signed(c, "/v1/exit", mine, {"reason": "x"}, token="other").status_code == 401
    # signed for another body than the one sent
    assert signed(c, "/v1/exit", mine, {"reason": "x"}, sent=b'{"reason": "y"}').status_code == 401
    # a signature for /v1/probe replayed to /v1/exit
    data = b"{}"
    r = c.post("/v1/exit", data=data, headers={
        "Authorization": auth.header(TOKEN, "POST", "/v1/probe", mine, data)})
    assert r.status_code == 401 and "signature" in r.get_json()["error"]
    assert exits == [] and aborts == []

    assert signed(c, "/v1/abort", mine, {"reason": "peer gone"}).status_code == 202
    assert aborts == [("peer gone", None, None)]
    assert signed(c, "/v1/probe", mine, {}).status_code == 400  # past the signature: a bad body
    r = signed(c, "/v1/exit", mine, {"reason": "evicted"})
    assert r.status_code == 202 and r.get_json()["rank"] == 5 and exits == ["evicted"]


def test_a_rank_still_takes_the_bearer_token():
    """A monitor of an older Lightkeeper, mid-upgrade (deprecated)."""
    c, _, exits, _ = rank_app()
    assert c.post("/v1/exit", json={"reason": "x"},
                  headers={"Authorization": "Bearer nope"}).status_code == 401
    assert c.post("/v1/exit", json={"reason": "old"},
                  headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 202
    assert exits == ["old"]


def test_a_rank_without_a_replica_id_yet_is_callable():
    c, state, exits, _ = rank_app(replica_id=None)
    assert signed(c, "/v1/exit", "2/1/", {"reason": "early"}).status_code == 202
    state.replica_id = RID  # its first quorum: the empty id is another identity now
    assert signed(c, "/v1/exit", "2/1/", {"reason": "late"}).status_code == 401
    assert exits == ["early"]


def test_a_signature_on_a_rank_without_the_token_is_403():
    state = RankState(RankIdentity(replica_group=2, group_rank=1, group_world_size=2))
    c = create_app(state, exit_handler=lambda r: None).test_client()
    assert signed(c, "/v1/exit", "2/1/", {"reason": "x"}).status_code == 403


# --- the monitor's side: a fake of a rank records what it is sent -----------------------------

@pytest.fixture
def fake_ranks():
    ranks = FakeRanks(2)
    yield ranks
    ranks.stop()


def state_of(url: str, g: int) -> dict:
    """What the rank at ``url`` served: group ``g`` rank 0 on host h<g>, in quorum 1."""
    s = RankState(RankIdentity(job="auth", replica_group=g, group_rank=0, group_world_size=1,
                               host=f"h{g}")).snapshot()
    s.update(replica_id=f"replica_group_{g}:auth", worker_url=url, quorum_id=1,
             participating=True, num_participants=2)
    return s


def verified(url: str, g: int) -> RankView:
    return RankView(url, True, state_of(url, g))


def check_signed(seen, idents: dict[str, str]) -> None:
    """Each call carried a signature for its rank (verified as a rank would) and no token."""
    assert seen
    for path, authorization, body in seen:
        assert TOKEN not in (authorization or "") and not authorization.startswith("Bearer")
        ident = idents[path]
        assert auth.verify(TOKEN, "POST", path, ident, body, auth.signature_of(authorization))


def test_exit_and_abort_are_signed_for_their_rank_never_the_token(fake_ranks):
    url = fake_ranks.urls[0]
    calls = RankCalls(TOKEN, timeout_s=5)
    try:
        rank = verified(url, 3)
        assert calls.exit(rank, "evicted").sent
        assert calls.abort(rank, "peer gone", 7, 1).sent
    finally:
        calls.close()
    ident = "3/0/replica_group_3:auth"
    check_signed(fake_ranks.posts, {"/v1/exit": ident, "/v1/abort": ident})
    assert [json.loads(b) for _, _, b in fake_ranks.posts] == [
        {"reason": "evicted"}, {"reason": "peer gone", "decision": 7, "quorum_id": 1}]


def probe_round(mesh: ProbeMesh, urls: list[str]):
    view = ViewBuilder().update([Target(u, "static") for u in urls],
                                {u: RankPoll(u, True, data=pack_state(state_of(u, g)))
                                 for g, u in enumerate(urls)}, now=time.time())
    mesh.ask(view, True, None, time.time())
    assert mesh.wait(10)
    return mesh.take()


def test_probes_are_signed_for_their_rank_never_the_token(fake_ranks):
    rnd = probe_round(ProbeMesh(ProbeConfig(), TOKEN), fake_ranks.urls)
    assert rnd is not None and rnd.missing() == {}
    assert len(fake_ranks.posts) == 2
    # each rank's call verifies for that rank's identity, and for no other's
    for path, authorization, body in fake_ranks.posts:
        url = json.loads(body)["peers"][0]  # the other host's rank
        mine = 1 - fake_ranks.urls.index(url)
        assert path == "/v1/probe" and TOKEN not in authorization
        sig = auth.signature_of(authorization)
        for g in (0, 1):
            assert auth.verify(TOKEN, "POST", path, f"{g}/0/replica_group_{g}:auth", body,
                               sig) is (g == mine)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--state", "/tmp/lk-rank-auth.sqlite", *argv])


def test_rank_auth_bearer_sends_the_token(fake_ranks, monkeypatch):
    """For an operator mid-upgrade whose ranks are older (they take only the bearer)."""
    monkeypatch.setenv("LIGHTKEEPER_EXIT_TOKEN", TOKEN)
    assert config_from_args(parse()).rank_auth == "hmac"
    cfg = config_from_args(parse("--rank-auth", "bearer"))
    assert cfg.rank_auth == "bearer"
    fake_ranks.bearer_only(TOKEN)
    # as monitor/act/enforcer.py and monitor/service.py build them from the config
    calls = RankCalls(cfg.rank_exit_token, cfg.kill_timeout_s, cfg.rank_auth)
    try:
        assert calls.exit(verified(fake_ranks.urls[0], 0), "evicted").sent
        assert calls.abort(verified(fake_ranks.urls[0], 0), "gone", 1).sent
    finally:
        calls.close()
    rnd = probe_round(ProbeMesh(cfg.probes, cfg.rank_exit_token, auth=cfg.rank_auth),
                      fake_ranks.urls)
    assert rnd is not None and rnd.missing() == {}
    assert [a for _, a, _ in fake_ranks.posts] == [f"Bearer {TOKEN}"] * 4
    with pytest.raises(SystemExit):
        parse("--rank-auth", "basic")
    with pytest.raises(ConfigError, match="--rank-auth must be one of hmac, bearer"):
        MonitorConfig(rank_auth="basic").validate()


def test_an_older_rank_refusing_the_signature_is_said_once(fake_ranks, caplog):
    fake_ranks.bearer_only(TOKEN)
    calls = RankCalls(TOKEN, timeout_s=5)
    rank = verified(fake_ranks.urls[0], 0)
    try:
        with caplog.at_level(logging.WARNING):
            first = calls.exit(rank, "evicted")
            again = calls.exit(rank, "evicted")
    finally:
        calls.close()
    assert not first.sent and first.http_status == 401
    assert "older Lightkeeper" in first.detail and "--rank-auth bearer" in first.detail
    lines = [r.getMessage() for r in caplog.records if r.name == "monitor.act.actions"]
    assert len(lines) == 1 and "older Lightkeeper" in lines[0] and "restart it" in lines[0]
    assert TOKEN not in lines[0] and not again.sent
    # a probe refused alike names why in its round
    rnd = probe_round(ProbeMesh(ProbeConfig(), TOKEN), fake_ranks.urls)
    assert all("older Lightkeeper" in why for why in rnd.missing().values())


# --- a target behind a prefix, the rank's settings, the 401's advice, claimed identities -------

def under_prefix(app, prefix: str):
    """A proxy's path routing in front of the rank: ``prefix`` moved to SCRIPT_NAME."""
    def wsgi(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if not path.startswith(prefix + "/"):
            start_response("404 Not Found", [("Content-Length", "0")])
            return [b""]
        environ["SCRIPT_NAME"], environ["PATH_INFO"] = prefix, path[len(prefix):]
        return app(environ, start_response)
    return wsgi


def test_a_call_to_a_target_behind_a_prefix_is_signed_for_the_route():
    """A target http://host:port/rank5 (normalize_url, file_sd's __metrics_path__): the rank
    checks the route it serves, /v1/exit, so that is what the monitor signs."""
    state = RankState(RankIdentity(job="auth", replica_group=2, group_rank=1,
                                   group_world_size=2))
    state.replica_id = RID
    exits, aborts = [], []
    app = create_app(state, exit_handler=exits.append, exit_token=TOKEN,
                     abort_handler=lambda *a: aborts.append(a) or {"aborted": True})
    server = BackgroundWSGIServer(under_prefix(app, "/rank5"), threads=2).start()
    calls = RankCalls(TOKEN, timeout_s=5)
    rank = RankView(f"{server.url}/rank5", True, state.snapshot())
    try:
        aborted = calls.abort(rank, "peer gone", 7, None)
        exited = calls.exit(rank, "evicted")
    finally:
        calls.close()
        server.stop()
    assert (aborted.sent, aborted.http_status) == (True, 202), aborted.detail
    assert (exited.sent, exited.http_status) == (True, 202), exited.detail
    assert exits == ["evicted"] and aborts == [("peer gone", 7, None)]


def test_exit_auth_hmac_refuses_the_bearer_naming_the_setting(caplog):
    state = RankState(RankIdentity(replica_group=2, group_rank=1, group_world_size=2))
    exits = []
    c = create_app(state, exit_handler=exits.append, exit_token=TOKEN,
                   exit_auth="hmac").test_client()
    with caplog.at_level(logging.WARNING):
        r = c.post("/v1/exit", json={"reason": "old"},
                   headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 401 and "LIGHTKEEPER_EXIT_AUTH=hmac" in r.get_json()["error"]
        assert c.post("/v1/probe", json={},
                      headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 401
        assert signed(c, "/v1/exit", "2/1/", {"reason": "signed"}).status_code == 202
    assert exits == ["signed"]
    assert not [rec for rec in caplog.records if "bearer" in rec.getMessage()]
    with pytest.raises(ValueError, match="one of any, hmac"):
        create_app(state, exit_token=TOKEN, exit_auth="bearer")


def test_a_rank_taking_the_bearer_says_so_once(caplog):
    """LIGHTKEEPER_EXIT_AUTH unset (``any``): the deprecated bearer works, and the rank's log
    says once to set hmac and rotate the token an older monitor sent everywhere."""
    c, _, exits, _ = rank_app()
    with caplog.at_level(logging.WARNING):
        assert signed(c, "/v1/exit", f"2/1/{RID}", {"reason": "signed"}).status_code == 202
        for _ in range(3):
            assert c.post("/v1/exit", json={"reason": "old"},
                          headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 202
    lines = [rec.getMessage() for rec in caplog.records if "bearer" in rec.getMessage()]
    assert len(lines) == 1 and "LIGHTKEEPER_EXIT_AUTH=hmac" in lines[0]
    assert "rotate" in lines[0] and TOKEN not in lines[0]
    assert exits == ["signed", "old", "old", "old"]


def test_worker_server_reads_lightkeeper_exit_auth(monkeypatch):
    from worker_server import WorkerServer

    monkeypatch.setenv("LIGHTKEEPER_EXIT_TOKEN", TOKEN)
    monkeypatch.setenv("LIGHTKEEPER_EXIT_AUTH", "HMAC ")
    monkeypatch.delenv("LIGHTKEEPER_MONITOR", raising=False)
    server = WorkerServer.start(replica_group=2, group_rank=1, group_world_size=2)
    try:
        r = server.app.test_client().post("/v1/abort", json={"reason": "x"},
                                          headers={"Authorization": f"Bearer {TOKEN}"})
    finally:
        server.stop()
    assert r.status_code == 401 and "LIGHTKEEPER_EXIT_AUTH" in r.get_json()["error"]
    monkeypatch.setenv("LIGHTKEEPER_EXIT_AUTH", "bearer")
    with pytest.raises(ValueError, match="one of any, hmac"):
        WorkerServer.start(replica_group=2, group_rank=1, group_world_size=2)


def test_the_401_advice_names_a_restart_and_is_said_per_identity(fake_ranks, caplog):
    """A 401 may mean the rank at that URL restarted (a new replica id): the signature then
    spares the new process; a refusal for another identity at the same URL is said again."""
    fake_ranks.bearer_only(TOKEN)
    calls = RankCalls(TOKEN, timeout_s=5)
    old = verified(fake_ranks.urls[0], 0)
    new = RankView(old.url, True, {**old.state, "replica_id": "replica_group_0:new"})
    try:
        with caplog.at_level(logging.WARNING):
            first = calls.exit(old, "evicted")
            calls.exit(old, "evicted")
            calls.exit(new, "evicted")
    finally:
        calls.close()
    assert not first.sent and first.http_status == 401
    assert "restarted at the same port" in first.detail and "last resort" in first.detail
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "monitor.act.actions"]
    assert len(lines) == 2 and all("identity changed" in line for line in lines)
    assert "\n" not in lines[0] and TOKEN not in "".join(lines)


def test_a_probe_while_another_runs_is_429(monkeypatch):
    """A signed probe replayed many times must not tie up the rank's four threads."""
    import worker_server.app as app_module

    running, release = threading.Event(), threading.Event()

    def slow_probe(req, token, control_url):
        running.set()
        assert release.wait(10)
        return [], None

    monkeypatch.setattr(app_module, "probe_peers", slow_probe)
    c, *_ = rank_app()
    mine, body = f"2/1/{RID}", {"peers": ["http://127.0.0.1:9"]}
    first: list = []
    t = threading.Thread(target=lambda: first.append(signed(c, "/v1/probe", mine, body)))
    t.start()
    try:
        assert running.wait(5), first and first[0].get_json()
        r = signed(c, "/v1/probe", mine, body)
        assert r.status_code == 429 and "another probe" in r.get_json()["error"]
    finally:
        release.set()
        t.join(5)
    assert first[0].status_code == 200
    assert signed(c, "/v1/probe", mine, body).status_code == 200  # the next one runs


def stranger_view(urls: list[str]):
    """The fake rank at urls[0] claims group 0's rank, whose real process (urls[2], unreachable
    now) served the very same identity; urls[1] is group 1's rank."""
    real = urls[2]
    polls = {urls[0]: RankPoll(urls[0], True, data=pack_state(state_of(urls[0], 0))),
             urls[1]: RankPoll(urls[1], True, data=pack_state(state_of(urls[1], 1)))}
    b = ViewBuilder()
    targets = [Target(u, "static") for u in urls]
    b.update(targets, {**polls, real: RankPoll(real, True, data=pack_state(state_of(real, 0)))},
             now=time.time() - 5)
    return b.update(targets, {**polls, real: RankPoll(real, False, error="refused")},
                    now=time.time())


def test_no_call_is_signed_for_an_identity_two_targets_claim(fake_ranks, caplog):
    """A stranger copying an unreachable rank's public /v1/state: a call signed for it would
    be valid at the real rank (replayable there), so none is sent, to either."""
    urls = [*fake_ranks.urls, "http://127.0.0.1:9"]
    view = stranger_view(urls)
    calls = RankCalls(TOKEN, timeout_s=5)
    try:
        with caplog.at_level(logging.WARNING):
            outcomes = [calls.exit(view.ranks[urls[0]], "evicted", view),
                        calls.abort(view.ranks[urls[0]], "gone", 1, 1, view),
                        calls.exit(view.ranks[urls[0]], "evicted", view)]
            other = calls.exit(view.ranks[urls[1]], "evicted", view)
    finally:
        calls.close()
    assert [o.sent for o in outcomes] == [False] * 3
    assert all(urls[2] in o.detail for o in outcomes)
    assert other.sent and [p for p, _, _ in fake_ranks.posts] == ["/v1/exit"]
    lines = [rec.getMessage() for rec in caplog.records if urls[2] in rec.getMessage()]
    assert len(lines) == 1 and urls[0] in lines[0]
    # an eviction's orphans, as the enforcer follows them with the sweep's view
    orphans = Orphans(RankCalls(TOKEN, timeout_s=5), grace_s=0)
    note = orphans.follow(1, "replica_group_0:auth", [view.ranks[urls[0]]], 1.0, view)
    orphans.exits.close()
    assert "not sent" in note and urls[2] in note and len(fake_ranks.posts) == 1


def test_no_probe_is_signed_for_an_identity_two_targets_claim(fake_ranks, caplog):
    urls = [*fake_ranks.urls, "http://127.0.0.1:9"]
    view = stranger_view(urls)
    mesh = ProbeMesh(ProbeConfig(), TOKEN)
    with caplog.at_level(logging.WARNING, logger="monitor.evidence.claims"):
        mesh.ask(view, True, None, time.time(), known=view)
    assert mesh.wait(10) and mesh.take() is None  # one host left: no round
    assert fake_ranks.posts == [] and "two hosts" in mesh.note
    lines = [rec.getMessage() for rec in caplog.records if urls[2] in rec.getMessage()]
    assert len(lines) == 1 and urls[0] in lines[0]
    # without the real rank known, the same view probes both
    rnd = probe_round(ProbeMesh(ProbeConfig(), TOKEN), fake_ranks.urls)
    assert rnd is not None and len(fake_ranks.posts) == 2


def test_an_orphan_not_told_is_said_once_in_its_own_words(fake_ranks, caplog):
    """An orphan whose identity another target claims: no "told ... to exit" every 5 s, one
    line saying it was not told and why; told once the claim is gone."""
    urls = [*fake_ranks.urls, "http://127.0.0.1:9"]
    view = stranger_view(urls)
    orphans = Orphans(RankCalls(TOKEN, timeout_s=5), grace_s=0)
    try:
        with caplog.at_level(logging.WARNING, logger="monitor.act.actions"):
            notes = [orphans.follow(1, "replica_group_0:auth", [view.ranks[urls[0]]], t, view)
                     for t in (1.0, 7.0, 13.0)]
        lines = [r.getMessage() for r in caplog.records if r.name == "monitor.act.actions"]
        assert len(lines) == 1 and lines[0].startswith("did not tell") and urls[2] in lines[0]
        assert notes[0].startswith("not told to exit yet") and notes[1:] == [None, None]
        assert fake_ranks.posts == []
        alone = ViewBuilder().update([Target(urls[0], "static")], {urls[0]: RankPoll(
            urls[0], True, data=pack_state(state_of(urls[0], 0)))}, now=time.time())
        note = orphans.follow(1, "replica_group_0:auth", [alone.ranks[urls[0]]], 14.0, alone)
        assert note.startswith("told rank(s)") and [p for p, _, _ in fake_ranks.posts] == [
            "/v1/exit"]
    finally:
        orphans.exits.close()


def test_a_refusal_said_is_forgotten_once_its_url_leaves_the_view(fake_ranks, caplog):
    fake_ranks.bearer_only(TOKEN)
    url = fake_ranks.urls[0]
    calls = RankCalls(TOKEN, timeout_s=5)
    with_it = ViewBuilder().update([Target(url, "static")], {url: RankPoll(
        url, True, data=pack_state(state_of(url, 0)))}, now=time.time())
    without = ViewBuilder().update([], {}, now=time.time())
    try:
        with caplog.at_level(logging.WARNING, logger="monitor.act.actions"):
            for view in (with_it, with_it, without, with_it):
                calls.keep(view)  # what the enforcer does each sweep
                calls.exit(with_it.ranks[url], "evicted")
    finally:
        calls.close()
    lines = [r.getMessage() for r in caplog.records if "refused a signed" in r.getMessage()]
    assert len(lines) == 2  # said again once the URL came back


def test_a_body_nested_too_deeply_is_400_not_a_500():
    """json's parser recurses: ``[[[...]]]`` 5,000 deep raised RecursionError through
    werkzeug's silent get_json, a 500 and an ERROR line in the job's log."""
    c, _, exits, aborts = rank_app()
    deep = b"[" * 5000 + b"]" * 5000
    mine = f"2/1/{RID}"
    for path in ("/v1/abort", "/v1/probe", "/v1/exit"):
        r = c.post(path, data=deep, headers={
            "Authorization": auth.header(TOKEN, "POST", path, mine, deep),
            "Content-Type": "application/json"})
        assert r.status_code == 400 and "nested too deeply" in r.get_json()["error"], path
    assert exits == [] and aborts == []
