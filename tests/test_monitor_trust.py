"""The monitor trusts no stranger (README, "Trust model").

Over real HTTP on 127.0.0.1 with ephemeral ports: tokens on the WorkerServer and the monitor,
bounded request bodies, registration limited to allowed addresses, misbehaving ranks (slow, huge,
garbage, wrong types, impostors) that never stop the sweep, and ranks whose claims are checked
against a real torchft Lighthouse before they count as evidence.
"""

from __future__ import annotations

import hmac

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
