"""The monitor trusts no stranger (README, "Trust model").

Over real HTTP on 127.0.0.1 with ephemeral ports: tokens on the WorkerServer and the monitor,
bounded request bodies, registration limited to allowed addresses, misbehaving ranks (slow, huge,
garbage, wrong types, impostors) that never stop the sweep, and ranks whose claims are checked
against a real torchft Lighthouse before they count as evidence.
"""

from __future__ import annotations

import hmac
import time

import pytest
import requests

from lightkeeper.processes import wait_until
from monitor.config import MonitorConfig
from monitor.service import Monitor
from worker_server import RankIdentity, RankState, WorkerServer

TOKEN = "s3cret-token"


# --- tokens ---------------------------------------------------------------------------------
@pytest.fixture
def compare_spy(monkeypatch):
    """Records every hmac.compare_digest call (the constant-time comparison)."""
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    return calls


def worker(fault_token: str | None, injected: list[str]) -> WorkerServer:
    state = RankState(RankIdentity(job="unit", replica_group=0, group_rank=0, group_world_size=1))
    srv = WorkerServer(state, fault_handler=injected.append, fault_token=fault_token)
    return srv.serve()


@pytest.mark.parametrize("token", [None, ""])
def test_worker_faults_route_is_off_without_a_token(token):
    injected: list[str] = []
    srv = worker(token, injected)
    try:
        for header in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer x"}):
            r = requests.post(srv.url + "/v1/faults", json={"spec": "hang:at_step=1"},
                              headers=header, timeout=5)
            assert r.status_code == 403 and "disabled" in r.json()["error"]
        assert injected == []
    finally:
        srv.stop()


def test_worker_token_is_compared_in_constant_time(compare_spy):
    injected: list[str] = []
    srv = worker(TOKEN, injected)
    try:
        url = srv.url + "/v1/faults"
        body = {"spec": "hang:at_step=3"}
        for header in ("Bearer " + TOKEN[:-1], "Bearer " + TOKEN + "x", "Basic " + TOKEN,
                       "Bearer s3cret-tokén", TOKEN, ""):
            r = requests.post(url, json=body, headers={"Authorization": header.encode()},
                              timeout=5)
            assert r.status_code == 401, (header, r.text)  # never 500, even for non-ASCII
        # a prefix and an extension of the token went through compare_digest, whole, as bytes
        assert (TOKEN[:-1].encode(), TOKEN.encode()) in compare_spy
        assert (TOKEN.encode() + b"x", TOKEN.encode()) in compare_spy
        assert all(isinstance(a, bytes) and b == TOKEN.encode() for a, b in compare_spy)
        assert injected == []
        r = requests.post(url, json=body, headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=5)
        assert r.status_code == 200 and injected == ["hang:at_step=3"]
    finally:
        srv.stop()


def test_worker_refuses_a_huge_body():
    injected: list[str] = []
    srv = worker(TOKEN, injected)
    try:
        # past the route's 16 KiB (a size the socket buffers take whole: the server answers
        # before reading the rest, and a larger upload may see a reset instead of the 413)
        r = requests.post(srv.url + "/v1/faults", data=b"{" + b" " * (20 << 10) + b"}",
                          headers={"Authorization": f"Bearer {TOKEN}",
                                   "Content-Type": "application/json"}, timeout=10)
        assert r.status_code == 413
        assert requests.get(srv.url + "/healthz", timeout=5).ok and injected == []
    finally:
        srv.stop()


def bare_monitor(tmp_path, **kw) -> Monitor:
    cfg = MonitorConfig(port=0, interval_s=0.2, state_path=str(tmp_path / "state.sqlite"),
                        sd_out=str(tmp_path / "targets.json"), job="unit", **kw)
    return Monitor(cfg).start()


def test_monitor_token_is_compared_in_constant_time(tmp_path, compare_spy):
    mon = bare_monitor(tmp_path, token=TOKEN)
    try:
        for header in ("Bearer " + TOKEN[:-1], "Bearer " + TOKEN + "x", "Bearer s3cret-tokén",
                       "bearer", ""):
            r = requests.post(mon.url + "/v1/evict", json={"replica_group": 1},
                              headers={"Authorization": header.encode()}, timeout=5)
            assert r.status_code == 401, (header, r.text)
            r = requests.post(mon.url + "/v1/targets", json={"url": "127.0.0.1:1"},
                              headers={"Authorization": header.encode()}, timeout=5)
            assert r.status_code == 401, (header, r.text)
        assert (TOKEN[:-1].encode(), TOKEN.encode()) in compare_spy
        assert (TOKEN.encode() + b"x", TOKEN.encode()) in compare_spy
        assert all(isinstance(a, bytes) and b == TOKEN.encode() for a, b in compare_spy)
        assert mon.discovery.targets() == []
        r = requests.post(mon.url + "/v1/targets", json={"url": "127.0.0.1:1"},
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
        assert r.status_code == 200
    finally:
        mon.stop()


def test_monitor_evict_is_off_without_a_token(tmp_path):
    mon = bare_monitor(tmp_path)
    try:
        r = requests.post(mon.url + "/v1/evict", json={"replica_group": 1},
                          headers={"Authorization": "Bearer "}, timeout=5)
        assert r.status_code == 403
    finally:
        mon.stop()


def test_monitor_refuses_a_huge_body(tmp_path):
    mon = bare_monitor(tmp_path, token=TOKEN)
    try:
        auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        big = b'{"url": "127.0.0.1:1", "pad": "' + b"x" * (66 << 10) + b'"}'  # > 64 KiB

        def refused(body) -> bool:
            """413, or the connection closed under a client still sending (the server answers
            413 and closes as soon as it has read past the limit; a client that is still
            writing then gets a reset instead of the answer: a race, both are refusals)."""
            try:
                return requests.post(mon.url + "/v1/targets", data=body, headers=auth,
                                     timeout=10).status_code == 413
            except requests.ConnectionError as e:
                return "reset" in str(e).lower() or "aborted" in str(e).lower()

        assert refused(big)

        def chunks():  # no Content-Length: waitress counts the chunks
            for _ in range(17):
                yield b"x" * 4096

        assert refused(chunks())
        assert mon.discovery.targets() == []
        wait_until(lambda: requests.get(mon.url + "/healthz", timeout=5).json()["sweeps"] > 1,
                   10, what="sweeps after the refused bodies")
    finally:
        mon.stop()


# --- registration: who may add a target -------------------------------------------------------
def register(mon: Monitor, url: str, token: str | None = None, **fields):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.post(mon.url + "/v1/targets", json={"url": url, **fields}, headers=headers,
                         timeout=10)


def test_registration_without_token_is_limited_to_loopback_and_static_hosts(tmp_path):
    mon = bare_monitor(tmp_path, targets=["192.0.2.10:9000"])
    try:
        assert register(mon, "127.0.0.1:4001").status_code == 200
        assert register(mon, "http://[::1]:4002").status_code == 200
        assert register(mon, "192.0.2.10:9001").status_code == 200  # a static target's host
        for url in ("10.1.2.3:80", "192.0.2.11:9000", "169.254.169.254:80", "0.0.0.0:80",
                    "http://[::ffff:10.1.2.3]:80"):
            r = register(mon, url)
            assert r.status_code == 403, (url, r.text)
            assert "--allow-targets" in r.json()["error"]
        # a name is judged on what it resolves to (real DNS: localhost is in /etc/hosts), and
        # the target is polled at the checked address, not by name
        r = register(mon, "http://localhost:4003")
        assert r.status_code == 200, r.text
        assert r.json()["url"] in ("http://127.0.0.1:4003", "http://[::1]:4003")
        assert r.json()["registered_as"] == "http://localhost:4003"
        assert register(mon, "http://no-such-host.invalid:80").status_code == 403
        urls = {t.url for t in mon.discovery.targets()}
        assert urls == {"http://192.0.2.10:9000", "http://127.0.0.1:4001", "http://[::1]:4002",
                        "http://192.0.2.10:9001", r.json()["url"]}
        text = requests.get(mon.url + "/metrics", timeout=5).text
        assert 'lightkeeper_monitor_registrations_total{job="unit",outcome="accepted"} 4.0' in text
        assert 'lightkeeper_monitor_registrations_total{job="unit",outcome="not_allowed"} 6.0' \
            in text
    finally:
        mon.stop()


def test_token_admits_any_address_and_is_required_when_set(tmp_path):
    mon = bare_monitor(tmp_path, token=TOKEN)
    try:
        assert register(mon, "127.0.0.1:4001").status_code == 401  # even from loopback
        assert register(mon, "10.1.2.3:80", token=TOKEN).status_code == 200
        assert {t.url for t in mon.discovery.targets()} == {"http://10.1.2.3:80"}
    finally:
        mon.stop()


REGISTER_TOKEN = "r3gister-only"


def test_register_token_admits_registrations_and_never_changes_state(tmp_path):
    mon = bare_monitor(tmp_path, token=TOKEN, register_token=REGISTER_TOKEN)
    try:
        assert register(mon, "127.0.0.1:4001").status_code == 401
        assert register(mon, "10.1.2.3:80", token="wrong").status_code == 401
        assert register(mon, "10.1.2.3:80", token=REGISTER_TOKEN).status_code == 200
        assert register(mon, "10.1.2.4:80", token=TOKEN).status_code == 200  # admin: anything
        assert {t.url for t in mon.discovery.targets()} == {"http://10.1.2.3:80",
                                                           "http://10.1.2.4:80"}

        def post(path, token, body):
            return requests.post(mon.url + path, json=body, timeout=10,
                                 headers={"Authorization": f"Bearer {token}"})

        # what every rank holds is known, and refused on the routes that change state
        for path, body in (("/v1/evict", {"replica_group": 1}),
                           ("/v1/hosts/node-a/release", {"reason": "x"})):
            r = post(path, REGISTER_TOKEN, body)
            assert r.status_code == 403, (path, r.text)
            assert "registration token" in r.json()["error"]
            assert post(path, "wrong", body).status_code == 401
        assert mon.store.decisions(limit=10) == []  # nothing was decided on its say-so
        # the admin token passes the check: the eviction reaches the rails (no such group
        # here: held), the release reaches the ledger (no such host: 404)
        r = post("/v1/evict", TOKEN, {"replica_group": 1})
        assert r.status_code in (200, 409) and r.json()["decision"] in ("evict", "hold"), r.text
        assert len(mon.store.decisions(limit=10)) == 1
        assert post("/v1/hosts/node-a/release", TOKEN, {}).status_code == 404
    finally:
        mon.stop()


def test_register_token_alone_admits_registrations_and_leaves_eviction_off(tmp_path):
    mon = bare_monitor(tmp_path, register_token=REGISTER_TOKEN)
    try:
        assert register(mon, "127.0.0.1:4001").status_code == 401  # a token is set: required
        assert register(mon, "10.1.2.3:80", token=REGISTER_TOKEN).status_code == 200
        r = requests.post(mon.url + "/v1/evict", json={"replica_group": 0}, timeout=10,
                          headers={"Authorization": f"Bearer {REGISTER_TOKEN}"})
        assert r.status_code == 403 and "disabled" in r.json()["error"]
    finally:
        mon.stop()


def test_token_warning_says_when_pods_hold_the_admin_token():
    from monitor.poll.admission import token_warning

    assert "--register-token" in token_warning(None, TOKEN)
    assert "refused" in token_warning(None, TOKEN)  # a rank without the token is shut out
    assert "equals" in token_warning(TOKEN, TOKEN)
    assert token_warning(REGISTER_TOKEN, TOKEN) is None
    assert token_warning(REGISTER_TOKEN, None) is None and token_warning(None, None) is None


def test_monitor_start_warns_once_when_ranks_must_hold_the_admin_token(caplog):
    from monitor.cli import warn_about_tokens

    with caplog.at_level("WARNING", logger="monitor.cli"):
        warn_about_tokens(MonitorConfig(token=TOKEN))
        warn_about_tokens(MonitorConfig(token=TOKEN, register_token=REGISTER_TOKEN))
    (record,) = caplog.records
    assert "--register-token" in record.getMessage() and "\n" not in record.getMessage()


def test_monitor_cli_reads_both_tokens_from_flags_or_environment(monkeypatch):
    import argparse

    from monitor.cli import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    monkeypatch.setenv("LIGHTKEEPER_TOKEN", "adm")
    monkeypatch.setenv("LIGHTKEEPER_REGISTER_TOKEN", "reg")
    cfg = config_from_args(p.parse_args(["--port", "0"]))
    assert (cfg.token, cfg.register_token) == ("adm", "reg")
    cfg = config_from_args(p.parse_args(["--port", "0", "--register-token", "r2"]))
    assert (cfg.token, cfg.register_token) == ("adm", "r2")
    monkeypatch.delenv("LIGHTKEEPER_REGISTER_TOKEN")
    assert config_from_args(p.parse_args(["--port", "0"])).register_token is None


@pytest.mark.parametrize("flag", ["--register-token", "--token"])
def test_lightkeeper_run_hands_the_ranks_the_registration_token(flag):
    import argparse

    from lightkeeper.run import add_arguments, hook_env

    p = argparse.ArgumentParser()
    add_arguments(p)
    env = hook_env(p.parse_args(["--monitor", "http://m:19400", flag, "r3g", "--", "true"]), {})
    assert env["LIGHTKEEPER_REGISTER_TOKEN"] == "r3g" and "LIGHTKEEPER_TOKEN" not in env


def test_worker_registers_with_the_register_token_from_its_environment(tmp_path, monkeypatch):
    """WorkerServer.start (what the trainer, autostart and the demo's ranks call) sends
    LIGHTKEEPER_REGISTER_TOKEN; LIGHTKEEPER_TOKEN is only the fallback of older deployments."""
    from worker_server.server import registration_token

    assert registration_token({"LIGHTKEEPER_REGISTER_TOKEN": "r", "LIGHTKEEPER_TOKEN": "a"}) == "r"
    assert registration_token({"LIGHTKEEPER_TOKEN": "a"}) == "a"
    assert registration_token({"LIGHTKEEPER_REGISTER_TOKEN": ""}) is None
    mon = bare_monitor(tmp_path, token=TOKEN, register_token=REGISTER_TOKEN)
    monkeypatch.setenv("LIGHTKEEPER_REGISTER_TOKEN", REGISTER_TOKEN)
    monkeypatch.setenv("LIGHTKEEPER_TOKEN", "not-the-admin-token")
    srv = None
    try:
        srv = WorkerServer.start(replica_group=0, group_rank=0, group_world_size=1, job="unit",
                                 monitor_url=mon.url)
        wait_until(lambda: srv.url in {t.registered_as or t.url
                                       for t in mon.discovery.targets()},
                   15, what="the rank registered with its registration token")
    finally:
        if srv is not None:
            srv.stop()
        mon.stop()


def test_allow_targets_networks_names_and_patterns():
    """The rule itself, with a stand-in resolver (no DNS server to control here)."""
    from monitor.poll.admission import AllowList, NotAllowed

    dns = {"rank-1.train.example": ["10.0.0.5"], "evil.train.example": ["169.254.169.254"],
           "split.train.example": ["10.0.0.6", "127.0.0.1"], "trainer-a": ["172.16.0.9"],
           "rebind.example": ["172.16.0.9", "8.8.8.8"], "outside": ["8.8.4.4"]}

    def resolver(host):
        import ipaddress
        try:
            return [ipaddress.ip_address(host)]
        except ValueError:
            if host not in dns:
                raise NotAllowed(f"{host} does not resolve") from None
            return [ipaddress.ip_address(a) for a in dns[host]]

    allow = AllowList.parse(["192.168.0.0/16", "*.train.example", "trainer-a"],
                            resolver=resolver)
    assert allow.admit("http://192.168.3.4:80") == "http://192.168.3.4:80"
    assert allow.admit("http://rank-1.train.example:80") == "http://10.0.0.5:80"
    assert allow.admit("http://trainer-a:81") == "http://172.16.0.9:81"
    # an IP that an allowed name resolves to is allowed as such
    assert allow.admit("http://172.16.0.9:82") == "http://172.16.0.9:82"
    refused = ["http://evil.train.example:80",  # matches the pattern, resolves to link-local
               "http://split.train.example:80",  # one address is loopback: refused
               "http://rebind.example:80",  # one of its addresses is outside
               "http://outside:80", "http://10.0.0.5:80", "http://127.0.0.1:80",
               "http://unknown.example:80"]
    for url in refused:
        with pytest.raises(NotAllowed):
            allow.admit(url)
    for bad in ("http://x", "not a host!", "*"):
        with pytest.raises(ValueError):
            AllowList.parse([bad])


def test_too_many_targets_and_bad_bodies_are_refused(tmp_path):
    mon = bare_monitor(tmp_path, max_targets=3, targets=["127.0.0.1:4000"])
    try:
        assert register(mon, "127.0.0.1:4001").status_code == 200
        assert register(mon, "127.0.0.1:4002").status_code == 200
        r = register(mon, "127.0.0.1:4003")
        assert r.status_code == 429 and "--max-targets 3" in r.json()["error"]
        assert register(mon, "127.0.0.1:4002", rank=2).status_code == 200  # known: refreshed
        for body in ({"url": 5}, {"url": "127.0.0.1:4001", "rank": "two"},
                     {"url": "127.0.0.1:4001", "rank": True},
                     {"url": "127.0.0.1:4001", "replica_group": 1.5},
                     {"url": "127.0.0.1:4001", "job": {"a": 1}},
                     {"url": "127.0.0.1:4001", "job": "j" * 300},
                     {"url": "http://127.0.0.1:" + "1" * 3000}, [1, 2], "x"):
            r = requests.post(mon.url + "/v1/targets", json=body, timeout=5)
            assert r.status_code == 400, (body, r.text)
        r = requests.post(mon.url + "/v1/targets", data=b"\xff\xfe not json", timeout=5,
                          headers={"Content-Type": "application/json"})
        assert r.status_code == 400
        assert len(mon.discovery.targets()) == 3
        assert {t.rank for t in mon.discovery.targets()} == {None, 2}
    finally:
        mon.stop()


def test_bad_allow_targets_flag_exits_2(tmp_path, capsys):
    import argparse

    from monitor import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--allow-targets", "10.0.0.0/8,bad host", "--state",
                         str(tmp_path / "s.db")])
    assert cli.run(args) == 2
    assert "bad host" in capsys.readouterr().err
    # a mistyped address or a range is no host name (they allowed nothing, silently)
    for typo in ("127.0.0.300", "10.0.0.0-10.0.0.255"):
        args = p.parse_args(["--allow-targets", typo, "--state", str(tmp_path / "s.db")])
        assert cli.run(args) == 2
        assert f"{typo!r} is neither a network" in capsys.readouterr().err
    args = p.parse_args(["--allow-targets", "10.0.0.0/8,*.example", "--max-targets", "5",
                         "--state", str(tmp_path / "s.db")])
    cfg = cli.config_from_args(args)
    assert cfg.allow_targets == ["10.0.0.0/8", "*.example"] and cfg.max_targets == 5


# --- bounded polling: misbehaving ranks -------------------------------------------------------
HOSTILE_MODES = {"huge": ("bad_response", "out of range"),
                 "huge_chunked": ("bad_response", "larger than"),
                 "huge_unframed": ("bad_response", "larger than"),
                 "dribble": ("timeout", "no answer"),
                 "slow": ("timeout", "no answer"),
                 "many_headers": ("bad_response", "header lines"),
                 "long_header": ("bad_response", "limit"),
                 "deep_json": ("bad_response", "Recursion"),
                 "garbage": ("bad_response", "not JSON")}


@pytest.fixture
def hostile_sim():
    from tests.support.monitor_sim import SimRanks

    sim = SimRanks.start(3 + len(HOSTILE_MODES) + 1)
    for rank, mode in zip(sim.ranks[3:], [*HOSTILE_MODES, "wrongtypes"], strict=True):
        rank.set_mode(mode, delay=60.0)
    yield sim
    sim.stop()


def test_poller_bounds_every_answer(hostile_sim):
    from monitor.poll.poller import Poller

    sim = hostile_sim
    p = Poller(timeout_s=1.0, max_bytes=64 * 1024)
    try:
        for _ in range(2):  # twice: pooled connections to the good ranks stay usable
            start = time.monotonic()
            polls = p.sweep(sim.urls)
            took = time.monotonic() - start
            assert all(polls[r.url].ok for r in sim.ranks[:3])
            for rank, (mode, (reason, words)) in zip(sim.ranks[3:-1], HOSTILE_MODES.items(),
                                                     strict=True):
                got = polls[rank.url]
                assert (got.ok, got.reason) == (False, reason), (mode, got)
                assert words in got.error, (mode, got.error)
            assert polls[sim.ranks[-1].url].ok  # wrong types: valid JSON, judged by the view
            assert took < 1.0 + 1.5, took  # the timeout, not the 60 s of the slow rank
        # a Flight Recorder answer gets its own bound
        sim.ranks[0].fr = {"entries": ["x" * 1000] * 100}
        fr = p.sweep([sim.ranks[0].url], "/v1/fr_trace", 2.0, max_bytes=50_000)
        assert fr[sim.ranks[0].url].reason == "bad_response"
        fr = p.sweep([sim.ranks[0].url], "/v1/fr_trace", 2.0, max_bytes=200_000)
        assert fr[sim.ranks[0].url].ok
    finally:
        p.close()


def test_monitor_keeps_sweeping_past_misbehaving_ranks(tmp_path, hostile_sim):
    sim = hostile_sim
    mon = bare_monitor(tmp_path, targets=sim.urls, poll_timeout_s=0.5, max_state_bytes=65536)
    try:
        wait_until(lambda: mon.sweeps >= 4, 30, what="sweeps past misbehaving ranks")
        c = requests.get(mon.url + "/v1/cluster", timeout=10).json()
        ranks = {r["url"]: r for g in c["groups"] for r in g["ranks"]}
        ranks.update({r["url"]: r for r in c["ungrouped"]})
        assert all(ranks[r.url]["reachable"] for r in sim.ranks[:3])
        for rank, (reason, _) in zip(sim.ranks[3:-1], HOSTILE_MODES.values(), strict=True):
            assert ranks[rank.url]["reachable"] is False and ranks[rank.url]["reason"] == reason
        bad = ranks[sim.ranks[-1].url]
        assert bad["reason"] == "bad_response" and "bad /v1/state" in bad["error"]
        assert c["sweep_seconds"] < 0.5 + 1.5 and c["last_error"] is None
        text = requests.get(mon.url + "/metrics", timeout=5).text
        assert 'lightkeeper_monitor_ranks_up{job="unit"} 3.0' in text
    finally:
        mon.stop()


# --- verification against a real Lighthouse ---------------------------------------------------
def test_lighthouse_status_page_is_parsed_and_other_shapes_are_refused():
    """The page of a real torchft Lighthouse that simulated groups joined for real."""
    from monitor.evidence.lighthouse_status import StatusFormatError, parse_status
    from tests.support.monitor_sim import SimJob

    job = SimJob(2, ranks_per_group=2)
    try:
        page = requests.get(job.lighthouse_url + "/status", timeout=5).text
        st = parse_status(page)
        assert st.quorum_id == job.quorum_id == 1
        assert set(st.members) == set(job.replica_ids.values())
        assert all(m.world_size == 2 and m.step == 100 for m in st.members.values())
        assert all(st.heartbeating(rid) for rid in job.replica_ids.values())
        assert "participants" in st.next_status  # quorum_compute's reason for the next quorum
        job.kill(job.replica_ids[1])  # its heartbeats stop: "old" after the 2 s timeout
        wait_until(lambda: not parse_status(requests.get(
            job.lighthouse_url + "/status", timeout=5).text).heartbeating(job.replica_ids[1]),
            10, what="the killed group's heartbeat to go old")
    finally:
        job.stop()
    for bad in ("<html>Lighthouse</html>", "", page.replace("World size", "World"),
                page.replace("<h2>Heartbeats</h2>", ""), page.replace(" ago", "")):
        with pytest.raises(StatusFormatError):
            parse_status(bad)


def impostor(sim_ranks, base: dict, **claims):
    """A simulated rank (a real HTTP server on 127.0.0.1) serving a copied /v1/state with
    ``claims`` changed."""
    r = sim_ranks.ranks[len(impostor.used.setdefault(id(sim_ranks), []))]
    impostor.used[id(sim_ranks)].append(r)
    r.update(**{**base, **claims, "worker_url": r.url})
    return r


impostor.used = {}


@pytest.fixture
def job():
    from tests.support.monitor_sim import SimJob

    j = SimJob(3, ranks_per_group=2)
    yield j
    j.stop()


@pytest.fixture
def strangers():
    from tests.support.monitor_sim import SimRanks

    s = SimRanks.start(8)
    yield s
    s.stop()


DEAD = ("dead", "dead_rank")  # a whole group / one rank of a group gone: evicted here


def job_monitor(tmp_path, job, extra_urls=(), **kw) -> Monitor:
    from monitor.config import DetectorConfig, RailsConfig

    kw.setdefault("rails", RailsConfig(min_replicas=1, cooldown_s=0, evict_kinds=DEAD))
    kw.setdefault("port", 0)
    cfg = MonitorConfig(interval_s=0.2, state_path=str(tmp_path / "state.sqlite"),
                        sd_out=str(tmp_path / "targets.json"), job="sim", lighthouse=job.url,
                        targets=[*job.sim.urls, *extra_urls], kill_timeout_s=2.0,
                        detectors=DetectorConfig(dead_sweeps=2), **kw)
    mon = Monitor(cfg)
    try:
        return mon.start()
    except OSError:  # as `lightkeeper monitor` does (exit 1)
        mon.stop()
        raise


def verdicts(mon: Monitor) -> dict[str, dict]:
    return {r["url"]: r["verification"] for r in
            requests.get(mon.url + "/v1/ranks", timeout=5).json()}


def test_claims_are_checked_against_the_lighthouse_and_the_group(tmp_path, job, strangers):
    g1 = job.sim.group(1)[1].state  # group 1, group_rank 1
    imps = {
        "unknown_replica_id": impostor(strangers, g1, replica_id="replica_group_1:made-up",
                                       rank=101),
        "no_replica_id": impostor(strangers, g1, replica_id=None, rank=102),
        "quorum_ahead": impostor(strangers, g1, quorum_id=99, rank=103),
        "world_size_mismatch": impostor(strangers, g1, group_world_size=3, group_rank=2,
                                        rank=104),
        "group_rank_out_of_range": impostor(strangers, g1, group_rank=5, rank=105),
        # another group: group 0's replica id claimed for replica group 2
        "replica_id_conflict": impostor(strangers, job.sim.group(0)[0].state, replica_group=2,
                                        rank=106),
        # a copy of group 1's rank 1, under another global rank: its slot is taken twice
        "group_rank_taken": impostor(strangers, g1, rank=107),
    }
    mon = job_monitor(tmp_path, job, [r.url for r in imps.values()])
    try:
        wait_until(lambda: mon.sweeps >= 3, 15, what="sweeps")
        v = verdicts(mon)
        for reason, r in imps.items():
            assert (v[r.url]["state"], v[r.url]["reason"], v[r.url]["evidence"]) == \
                ("unverified", reason, False), (reason, v[r.url])
        # no telling which of two claimants of one slot (or one replica id) is real: neither
        # counts; every other real rank is verified
        ambiguous = {job.sim.group(1)[1].url: "group_rank_taken",
                     **{r.url: "replica_id_conflict" for r in job.sim.group(0)}}
        for r in job.sim.ranks:
            want = ambiguous.get(r.url)
            assert v[r.url]["state"] == ("unverified" if want else "verified"), (r.url, v[r.url])
            assert v[r.url]["reason"] == (want or "ok")
        text = requests.get(mon.url + "/metrics", timeout=5).text
        assert 'lightkeeper_monitor_ranks_verified{job="sim"} 3.0' in text
        assert 'lightkeeper_monitor_ranks_unverified{job="sim",reason="replica_id_conflict"} 3.0' \
            in text
        assert 'lightkeeper_monitor_lighthouse_up{job="sim"} 1.0' in text
        # shown everywhere: the overview marks each rank
        page = requests.get(mon.url + "/", timeout=5).text
        assert page.count("unverified: ") == 3 + len(imps)
        assert page.count('class="trust verified"') == 3
    finally:
        mon.stop()


def findings(mon: Monitor) -> list[dict]:
    return requests.get(mon.url + "/v1/findings", timeout=5).json()


def decisions(mon: Monitor) -> list[dict]:
    return requests.get(mon.url + "/v1/evictions", timeout=5).json()


def found_total(mon: Monitor, kind: str) -> float:
    """``lightkeeper_monitor_findings_total`` of ``kind`` as the monitor's /metrics says."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(mon.url + "/metrics", timeout=5).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "lightkeeper_monitor_findings_total" and s.labels["kind"] == kind)


def dead_rank(mon: Monitor) -> list[dict]:
    return [f for f in findings(mon) if f["kind"] == "dead_rank" and f["open"]]


def offences(mon: Monitor) -> list[tuple]:
    """(counts, note) of the host ledger's dead_rank offences on the sim's host, newest first."""
    hosts = requests.get(mon.url + "/v1/hosts", timeout=5).json()["hosts"]
    return [(o["counts"], o["note"]) for h in hosts if h["host"] == "sim"
            for o in h["offences"] if o["kind"] == "dead_rank"]


def dead_rank_left_open(tmp_path, job, victim, dry: dict) -> None:
    """A monitor finds ``victim`` dead (counted once) and stops with the finding open."""
    mon = job_monitor(tmp_path, job, **dry)
    try:
        wait_until(lambda: mon.sweeps >= 2, 15, what="sweeps")
        victim.set_mode("down")
        wait_until(lambda: dead_rank(mon), 15, what="dead_rank")
        assert found_total(mon, "dead_rank") == 1
    finally:
        mon.stop()


def test_a_rank_dead_across_a_monitor_restart_is_found_again(tmp_path, job):
    """A dead rank in a live group is found; the monitor restarts (its findings closed as
    ``monitor_restarted``) while the rank stays down. The new monitor never hears it, yet knows
    whose it was (its last state and verdict, kept in the state file) and finds it again, not
    counted again in ``findings_total`` nor against its host (the same episode); once it
    answers, nothing of it is kept, and the rank's next death is a new finding, counted."""
    from monitor.config import RailsConfig

    victim = job.sim.group(1)[1]
    dry = {"rails": RailsConfig(dry_run=True)}
    dead_rank_left_open(tmp_path, job, victim, dry)
    mon = job_monitor(tmp_path, job, **dry)
    try:
        wait_until(lambda: dead_rank(mon), 15, what="dead_rank found again")
        [f] = dead_rank(mon)
        assert (f["replica_group"], f["ranks"]) == (1, [victim.state["rank"]]), f
        assert f["replica_id"] == victim.state["replica_id"]
        assert list(mon.store.unreachable()) == [victim.url]
        assert found_total(mon, "dead_rank") == 0  # the first life's, found before the restart
        assert offences(mon) == [(False, "re-confirmed after a monitor restart"), (True, None)]
        victim.set_mode("ok")
        wait_until(lambda: not mon.store.unreachable() and not dead_rank(mon), 15,
                   what="it answers: nothing kept, the finding resolved")
        victim.set_mode("down")
        wait_until(lambda: dead_rank(mon), 15, what="its next death")
        assert found_total(mon, "dead_rank") == 1
        assert offences(mon)[0] == (True, None)
    finally:
        mon.stop()


def test_a_fault_healed_while_the_monitor_was_down_counts_when_it_comes_back(tmp_path, job):
    """A dead rank left open in ``--state`` answers again before the monitor restarts. Once its
    group commits a step with every rank answering (that episode over), the rank's next death,
    the same incarnation, is a new finding, counted in ``findings_total`` and against its host.
    Before, the host ledger took any offence of an incarnation after one a restart closed for
    the same episode: recorded, not counted."""
    from monitor.config import RailsConfig

    victim = job.sim.group(1)[1]
    dry = {"rails": RailsConfig(dry_run=True)}
    dead_rank_left_open(tmp_path, job, victim, dry)
    victim.set_mode("ok")
    mon = job_monitor(tmp_path, job, **dry)
    try:
        wait_until(lambda: mon.sweeps >= 2, 15, what="sweeps")
        for r in job.sim.group(1):
            r.update(step=r.state["step"] + 5, commits=r.state["commits"] + 5)
        n = mon.sweeps
        wait_until(lambda: mon.sweeps >= n + 2, 15, what="sweeps past the step")
        assert not dead_rank(mon) and found_total(mon, "dead_rank") == 0
        victim.set_mode("down")
        wait_until(lambda: dead_rank(mon), 15, what="its next death")
        assert dead_rank(mon)[0]["replica_id"] == victim.state["replica_id"]
        assert found_total(mon, "dead_rank") == 1
        assert offences(mon) == [(True, None), (True, None)]
    finally:
        mon.stop()


def test_a_run_that_stops_before_it_confirms_an_episode_again_hands_it_on(tmp_path, job):
    """A dead rank left open in ``--state``; the next monitor on it fails to start (its
    ``--port`` taken: it had opened the state, closing the finding); the one after finds the
    rank dead again: the same episode, not counted again in ``findings_total`` nor against its
    host. Before, the failed run's restart marks were lost with it: counted twice."""
    import socket

    from monitor.config import RailsConfig

    victim = job.sim.group(1)[1]
    dry = {"rails": RailsConfig(dry_run=True)}
    dead_rank_left_open(tmp_path, job, victim, dry)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            job_monitor(tmp_path, job, port=taken.getsockname()[1], **dry)
    mon = job_monitor(tmp_path, job, **dry)
    try:
        wait_until(lambda: dead_rank(mon), 15, what="dead_rank found again")
        assert found_total(mon, "dead_rank") == 0
        assert offences(mon) == [(False, "re-confirmed after a monitor restart"), (True, None)]
        # the row found again names the episode's first finding (the one counted)
        again, first = [f for f in findings(mon) if f["kind"] == "dead_rank"]
        assert (first["reconfirms"], again["reconfirms"]) == (None, first["id"]), (first, again)
    finally:
        mon.stop()


def test_an_unverified_rank_is_shown_never_grounds_for_an_eviction(tmp_path, job, strangers):
    """A stranger claiming replica group 1 dies: no finding, no decision, no kill. A real rank
    of group 2 dying (the control) is evicted at once by the same monitor."""
    forged = impostor(strangers, job.sim.group(1)[0].state, replica_id="replica_group_1:forged",
                      group_rank=0, rank=201)
    mon = job_monitor(tmp_path, job, [forged.url])
    try:
        wait_until(lambda: verdicts(mon).get(forged.url, {}).get("reason")
                   == "unknown_replica_id", 15, what="the stranger judged")
        c = requests.get(mon.url + "/v1/cluster", timeout=5).json()
        g1 = next(g for g in c["groups"] if g["replica_group"] == 1)
        assert forged.url in [r["url"] for r in g1["ranks"]]  # shown in the group it claims
        assert g1["evidence_ranks"] == 2 and g1["replica_id"] == job.replica_ids[1]
        forged.set_mode("down")
        n = mon.sweeps
        wait_until(lambda: mon.sweeps >= n + 8, 20, what="sweeps with the stranger down")
        assert findings(mon) == [] and decisions(mon) == [] and job.kills == []
        r = {x["url"]: x for x in requests.get(mon.url + "/v1/ranks", timeout=5).json()}
        assert r[forged.url]["reachable"] is False
        assert r[forged.url]["verification"]["evidence"] is False

        real = job.sim.group(2)[1]
        real.set_mode("down")
        wait_until(lambda: job.kills, 20, what="the control: a verified rank's group evicted")
        assert job.kills == [job.replica_ids[2]]
        # the killed group's process exits, as torchft's does: its own `dead` finding may
        # follow the eviction's before this reads them; none is of the stranger's group 1
        assert {(f["kind"] in DEAD, f["replica_group"]) for f in findings(mon)} == {(True, 2)}
        # under load a sweep may see too few ranks answer in time (or the Lighthouse slow) and
        # hold as monitor_blind before the eviction: a rail working, not the stranger counted
        ds = decisions(mon)
        assert [d["decision"] for d in ds if d["reason"] != "monitor_blind"] == ["evict"], ds
        assert all(d["decision"] == "hold" for d in ds if d["reason"] == "monitor_blind"), ds
    finally:
        mon.stop()


def test_lighthouse_unreachable_blinds_evictions_and_everything_stays_shown(tmp_path, job,
                                                                           strangers):
    mon = job_monitor(tmp_path, job)
    try:
        wait_until(lambda: mon.sweeps >= 2 and all(
            v["state"] == "verified" for v in verdicts(mon).values()), 15, what="verified ranks")
        job.front_down()
        wait_until(lambda: requests.get(mon.url + "/v1/cluster", timeout=5).json()
                   ["verification"]["blind"], 15, what="the monitor to go blind")
        # what was verified with the same identity stays evidence; nothing new becomes it
        newcomer = impostor(strangers, job.sim.group(2)[0].state, group_rank=1, rank=301,
                            replica_group=0, replica_id=job.replica_ids[0])
        requests.post(mon.url + "/v1/targets", json={"url": newcomer.url},
                      timeout=5).raise_for_status()
        wait_until(lambda: newcomer.url in verdicts(mon), 15, what="the newcomer polled")
        v = verdicts(mon)
        assert v[newcomer.url]["state"] == "unverifiable" and not v[newcomer.url]["evidence"]
        for r in job.sim.ranks:
            assert (v[r.url]["state"], v[r.url]["reason"], v[r.url]["evidence"]) == \
                ("unverifiable", "lighthouse_unreadable", True)
        # a real rank dies: the finding is shown, the eviction held as monitor_blind
        job.sim.group(1)[0].set_mode("down")
        wait_until(lambda: [d["reason"] for d in decisions(mon)] == ["monitor_blind"], 20,
                   what="a monitor_blind hold")
        assert "cannot be verified" in decisions(mon)[0]["detail"] and job.kills == []
        assert [(f["kind"] in DEAD, f["replica_group"]) for f in findings(mon)] == [(True, 1)]
        c = requests.get(mon.url + "/v1/cluster", timeout=5).json()
        assert [g["replica_group"] for g in c["groups"]] == [0, 1, 2]
        assert sum(len(g["ranks"]) for g in c["groups"]) == 7
        assert 'lightkeeper_monitor_lighthouse_up{job="sim"} 0.0' in requests.get(
            mon.url + "/metrics", timeout=5).text
        assert 'id="blind"' in requests.get(mon.url + "/", timeout=5).text
        # the Lighthouse is back: verified again, the held eviction goes ahead
        job.front_up()
        wait_until(lambda: job.kills, 20, what="the eviction once the Lighthouse is back")
        assert job.kills == [job.replica_ids[1]]
        # the newcomer is judged again on the sweep that next polls it (possibly after the kill)
        wait_until(lambda: verdicts(mon)[newcomer.url]["reason"] == "group_rank_taken", 10,
                   what="the newcomer judged against the Lighthouse again")
    finally:
        mon.stop()


def test_a_dump_must_describe_the_rank_that_served_it(tmp_path, job):
    """Flight Recorder dumps are keyed by the verified rank's number, never the dump's claim."""
    mon = job_monitor(tmp_path, job)
    try:
        wait_until(lambda: mon.evidence and len(mon.evidence.ranks) == 6, 15,
                   what="verified ranks")
        honest, liar, other = job.sim.ranks[0], job.sim.ranks[1], job.sim.ranks[2]
        honest.fr = {"rank": honest.state["rank"], "replica_group": 0, "entries": []}
        liar.fr = {"rank": honest.state["rank"], "replica_group": 1, "entries": []}
        other.fr = {"rank": other.state["rank"], "replica_group": 0, "entries": []}  # its group is 2
        mon.detectors.fr_wanted = lambda view, now=None: [honest.url, liar.url, other.url]
        dumps = mon.polling.fr_dumps(mon.evidence, time.time())
        assert set(dumps) == {honest.state["rank"]}
        assert dumps[honest.state["rank"]]["replica_group"] == 0
    finally:
        mon.stop()
