"""A LIGHTKEEPER_MONITOR entry that is no URL: refused by WorkerServer.start before the rank
serves or registers anywhere (its callers say it in one line), and said in one line by a
registration thread given one directly, which lives on."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from lightkeeper.processes import wait_until
from worker_server import RankIdentity, RankState, WorkerServer
from worker_server import server as server_module
from worker_server.server import serving

BAD = "http://[fd00::5:9400"  # an unbalanced bracket: urlsplit raises ValueError


def test_a_bad_monitor_url_is_refused_before_anything_serves_or_registers(monkeypatch):
    """It raised after serve() and after the first monitor's registration began: the caller
    said "not started" of a rank that served and was registered with mon-a."""
    monkeypatch.setenv("LIGHTKEEPER_REGISTER_TOKEN", "s3cret")
    monkeypatch.setenv("LIGHTKEEPER_MONITOR", f"http://mon-a:9400,{BAD}")
    bound, posted = [], []
    real = server_module.BackgroundWSGIServer
    monkeypatch.setattr(server_module, "BackgroundWSGIServer",
                        lambda *a, **k: (bound.append(k["port"]), real(*a, **k))[1])
    monkeypatch.setattr(server_module.requests, "post",
                        lambda *a, **k: (posted.append(a), SimpleNamespace(status_code=200))[1])
    before = set(map(id, serving()))
    with pytest.raises(ValueError, match=r"LIGHTKEEPER_MONITOR 'http://\[fd00::5:9400' is not an "
                                         r"http\(s\)://host:port URL"):
        WorkerServer.start(replica_group=0, group_rank=0, group_world_size=1, port=0)
    assert bound == [] and posted == [] and set(map(id, serving())) == before
    with pytest.raises(ValueError, match="monitor_url 'http://host:99999'"):
        WorkerServer.start(replica_group=0, group_rank=0, group_world_size=1, port=0,
                           monitor_url="http://host:99999")
    # a password in the bad URL is not shown
    with pytest.raises(ValueError) as e:
        WorkerServer.start(replica_group=0, group_rank=0, group_world_size=1, port=0,
                           monitor_url="http://u:hunter2@[::1")
    assert "hunter2" not in str(e.value)
    assert bound == [] and posted == []


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
