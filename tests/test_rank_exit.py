"""Finishing an eviction on the ranks the Lighthouse's kill does not reach.

torchft 0.2.0's kill ends only group rank 0's process (the Manager server lives there). A rank of
an evicted group that is hung outside any collective lives on; the monitor tells it to exit
through the WorkerServer's ``POST /v1/exit``, which a process opts in to with
``LIGHTKEEPER_EXIT_TOKEN`` (403 otherwise, 401 with a wrong token). Real processes here: a
WorkerServer whose main thread is stuck forever, ended through the route; the whole loop on a real
3x2 job is in tests/test_monitor_e2e_multirank.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import requests

from lightkeeper.processes import stop_process, wait_until
from monitor.act.actions import Orphans, RankCalls
from worker_server.app import create_app
from worker_server.state import RankIdentity, RankState

TOKEN = "exit-test-token"


def app_client(**kwargs):
    state = RankState(RankIdentity(replica_group=1, group_rank=1, group_world_size=2))
    return create_app(state, **kwargs).test_client()


def test_exit_route_is_off_without_opt_in_and_needs_the_token():
    calls = []
    assert app_client().post("/v1/exit").status_code == 403
    assert app_client(exit_handler=calls.append).post("/v1/exit").status_code == 403  # no token
    c = app_client(exit_handler=calls.append, exit_token=TOKEN)
    assert c.post("/v1/exit").status_code == 401
    assert c.post("/v1/exit", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert c.get("/v1/exit").status_code == 405  # never a GET
    assert calls == []
    r = c.post("/v1/exit", json={"reason": "evicted"},
               headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 202 and r.get_json()["exiting"] is True and r.get_json()["rank"] == 3
    assert calls == ["evicted"]


HUNG_RANK = textwrap.dedent("""
    import sys, threading
    from worker_server import WorkerServer
    server = WorkerServer.start(replica_group=1, group_rank=1, group_world_size=2)
    print("URL", server.url, flush=True)
    threading.Event().wait()  # the training thread hung outside any collective
""")


@pytest.fixture
def hung_rank(tmp_path):
    env = {**os.environ, "LIGHTKEEPER_EXIT_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
    env.pop("LIGHTKEEPER_MONITOR", None)
    log = tmp_path / "rank.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", HUNG_RANK], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = wait_until(lambda: next((line.split()[1] for line in log.read_text().splitlines()
                                       if line.startswith("URL ")), None), 30,
                         what="the rank's WorkerServer")
        yield proc, url, log
    finally:
        stop_process(proc, grace=0)


def test_a_hung_rank_exits_when_told(hung_rank):
    proc, url, log = hung_rank
    rank = FakeRank(url, 3)  # group 1, group rank 1: as the hung rank serves itself
    assert RankCalls("wrong").exit(rank, "x").http_status == 401
    assert RankCalls(TOKEN).exit(FakeRank(url, 2), "x").http_status == 401  # another rank's
    assert proc.poll() is None
    res = RankCalls(TOKEN).exit(rank, "replica r was evicted")
    assert res.sent and res.http_status == 202
    wait_until(lambda: proc.poll() is not None, 10, what="the hung rank to exit")
    assert proc.returncode == 1
    assert "exiting (status 1): replica r was evicted" in log.read_text()
    with pytest.raises(requests.ConnectionError):  # its port is free again
        requests.get(url + "/healthz", timeout=2)


def test_a_rank_whose_output_pipe_is_gone_still_exits_when_told():
    # `python train.py | head`: the reader is gone, every write to stdout/stderr fails (EPIPE)
    env = {**os.environ, "LIGHTKEEPER_EXIT_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
    env.pop("LIGHTKEEPER_MONITOR", None)
    proc = subprocess.Popen([sys.executable, "-c", HUNG_RANK], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = proc.stdout.readline().split()[1].decode()
        proc.stdout.close()
        res = RankCalls(TOKEN).exit(FakeRank(url, 3), "evicted")
        assert res.http_status == 202
        wait_until(lambda: proc.poll() is not None, 10, what="the rank to exit")
        assert proc.returncode == 1
    finally:
        stop_process(proc, grace=0)


class FakeRank:
    def __init__(self, url: str, rank: int) -> None:
        self.url, self.rank = url, rank
        self.state = {"replica_group": rank // 2, "group_rank": rank % 2, "replica_id": None,
                      "host": "node-a", "pid": 100 + rank}


def test_orphans_reported_without_a_token_after_the_grace():
    o = Orphans(RankCalls(None), grace_s=5)
    ranks = [FakeRank("http://127.0.0.1:1", 3)]
    assert o.follow(1, "rid", ranks, since_kill_s=2) is None  # within the grace
    note = o.follow(1, "rid", ranks, since_kill_s=6)
    assert "rank 3 (group rank 1, host node-a, pid 103" in note and "stop them" in note
    assert o.follow(1, "rid", ranks, since_kill_s=7) is None  # said once
    assert o.follow(1, "rid", [], since_kill_s=8) is None


def test_orphans_told_once_then_again_if_still_there(hung_rank):
    proc, url, _ = hung_rank
    o = Orphans(RankCalls(TOKEN), grace_s=0)
    rank = FakeRank(url, 3)
    note = o.follow(7, "rid", [rank], since_kill_s=0.5)
    assert "told rank(s)" in note and "exiting" in note
    wait_until(lambda: proc.poll() is not None, 10, what="the orphan to exit")
    assert o.follow(7, "rid", [rank], since_kill_s=1.0) is None  # told 0.5 s ago: not again
    again = o.follow(7, "rid", [rank], since_kill_s=6.0)  # still listed 5 s later: told again
    assert "unreachable" in again
