"""A LIGHTKEEPER_MONITOR entry that is no URL: left out by WorkerServer.start in one line, the
rank still served and registered with the other monitors, and said in one line by a
registration thread given one directly, which lives on."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import requests

from lightkeeper.processes import wait_until
from worker_server import RankIdentity, RankState, WorkerServer
from worker_server import server as server_module
from worker_server.server import serving

BAD = "http://[fd00::5:9400"  # an unbalanced bracket: urlsplit raises ValueError


def _lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "regist" in line]


def test_a_bad_monitor_url_is_left_out_in_one_line_and_the_rank_still_serves(monkeypatch, capfd):
    """start() raised ValueError: ``lightkeeper train`` exited 1 on every rank and the autostart
    hook served nothing, for a typo in a monitor's address. The arguments are trainer/loop.py's."""
    monkeypatch.delenv("LIGHTKEEPER_MONITOR", raising=False)
    posted = []
    monkeypatch.setattr(server_module.requests, "post",
                        lambda *a, **k: (posted.append(a), SimpleNamespace(status_code=200))[1])
    srv = WorkerServer.start(replica_group=0, group_rank=0, group_world_size=1, job="j",
                             lighthouse="http://lh:29510", host="127.0.0.1", port=0, faults=[],
                             fault_handler=lambda spec: None, monitor_url="mon:19400")
    try:
        assert srv in serving()
        assert requests.get(srv.url + "/v1/state", timeout=2).json()["job"] == "j"
    finally:
        srv.stop()
    assert posted == [] and _lines(capfd.readouterr().err) == [
        "[lightkeeper] not registering with 'mon:19400' (monitor_url): not an "
        "http(s)://host:port URL; this rank is not registered there"]


def test_with_good_and_bad_entries_it_registers_with_the_good_ones(monkeypatch, capfd):
    """The env var as ``lightkeeper train`` under torchrun reads it, with a token: one line per
    bad entry (its password not shown, with or without a scheme), the good one registered."""
    good = "http://127.0.0.1:9"
    monkeypatch.setenv("LIGHTKEEPER_REGISTER_TOKEN", "s3cret")
    monkeypatch.setenv("LIGHTKEEPER_MONITOR",
                       f"{good}, http://mon:99999,{BAD},http://u:hunter2@[::1,v:pw22@mon:1")
    posted = []
    monkeypatch.setattr(server_module.requests, "post",
                        lambda *a, **k: (posted.append(a[0]), SimpleNamespace(status_code=200))[1])
    srv = WorkerServer.start(replica_group=0, group_rank=0, group_world_size=1, port=0)
    try:
        wait_until(lambda: posted, 5, interval=0.01, what="a registration")
        assert requests.get(srv.url + "/healthz", timeout=2).status_code == 200
    finally:
        srv.stop()
    assert set(posted) == {f"{good}/v1/targets"}
    err = capfd.readouterr().err
    assert "hunter2" not in err and "pw22" not in err
    tail = "(LIGHTKEEPER_MONITOR): not an http(s)://host:port URL; this rank is not registered there"
    assert _lines(err) == [f"[lightkeeper] not registering with {shown!r} {tail}" for shown in
                           ("http://mon:99999", BAD, "http://u:***@[::1", "v:***@mon:1")], err


@pytest.mark.parametrize("token", [None, "s3cret"])
def test_a_registration_thread_given_a_bad_url_says_one_line_and_lives(monkeypatch, capfd, token):
    """The thread died with a ValueError traceback (with a token, register_with itself raised):
    the rank was never registered, and nothing said why in a line."""
    monkeypatch.setattr(server_module, "REGISTER_INTERVAL_S", 0.01)
    died, tries = [], []
    monkeypatch.setattr(threading, "excepthook", lambda a: died.append(a.exc_type))
    real = server_module.loopback_for_remote
    monkeypatch.setattr(server_module, "loopback_for_remote",
                        lambda *a: (tries.append(threading.current_thread()), real(*a))[1])
    srv = WorkerServer(RankState(RankIdentity())).serve()
    try:
        srv.register_with(BAD, token=token)
        wait_until(lambda: len(tries) >= 3, 5, interval=0.01, what="three tries")
        assert tries[-1].is_alive() and died == []
    finally:
        srv.stop()
    err = capfd.readouterr().err
    assert [line for line in err.splitlines() if "monitor" in line] == [
        f"[lightkeeper] cannot register with monitor {BAD}: it is not an http(s)://host:port "
        "URL; this rank is not monitored"], err
