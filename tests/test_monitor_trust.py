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

from lightkeeper.cluster import wait_until
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
        r = requests.post(srv.url + "/v1/faults", data=b"{" + b" " * (1 << 20) + b"}",
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
        big = b'{"url": "127.0.0.1:1", "pad": "' + b"x" * (1 << 20) + b'"}'
        assert requests.post(mon.url + "/v1/targets", data=big, headers=auth,
                             timeout=10).status_code == 413

        def chunks():  # no Content-Length: waitress counts the chunks
            for _ in range(64):
                yield b"x" * 4096

        assert requests.post(mon.url + "/v1/targets", data=chunks(), headers=auth,
                             timeout=10).status_code == 413
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


def test_allow_targets_networks_names_and_patterns():
    """The rule itself, with a stand-in resolver (no DNS server to control here)."""
    from monitor.admission import AllowList, NotAllowed

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
    from monitor.poller import Poller

    sim = hostile_sim
    p = Poller(timeout_s=1.0, max_bytes=64 * 1024)
    try:
        for _ in range(2):  # twice: pooled connections to the good ranks stay usable
            start = time.monotonic()
            polls = p.sweep(sim.urls)
            took = time.monotonic() - start
            assert all(polls[r.url].ok for r in sim.ranks[:3])
            for rank, (mode, (reason, words)) in zip(sim.ranks[3:], HOSTILE_MODES.items()):
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
        for rank, (mode, (reason, _)) in zip(sim.ranks[3:], HOSTILE_MODES.items()):
            assert ranks[rank.url]["reachable"] is False and ranks[rank.url]["reason"] == reason
        bad = ranks[sim.ranks[-1].url]
        assert bad["reason"] == "bad_response" and "bad /v1/state" in bad["error"]
        assert c["sweep_seconds"] < 0.5 + 1.5 and c["last_error"] is None
        text = requests.get(mon.url + "/metrics", timeout=5).text
        assert 'lightkeeper_monitor_ranks_up{job="unit"} 3.0' in text
    finally:
        mon.stop()
