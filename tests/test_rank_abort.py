"""``POST /v1/abort`` and the function behind it, fast: the route's opt-in, token and body
checks; :func:`abort_cross_group` per torchft process-group type; the gloo connection recorder
on real sockets. A real job (Lighthouse, 3 groups, a SIGSTOPped peer) is in
tests/test_rank_abort_e2e.py.

The Manager here is a fake (``FakeManager``): a real one needs a Lighthouse and a store, and the
function reads only its process group, quorum id and step and calls ``report_error``. The
process groups are torchft's own classes, unconfigured (no peers); the Baby group's subprocess
is a real process, killed for real.
"""

from __future__ import annotations

import logging
import multiprocessing
import socket
import struct
import threading
import time
from datetime import timedelta

import pytest
import requests

from lightkeeper.processes import wait_until
from worker_server import RankIdentity, RankState, WorkerServer
from worker_server.abort import (
    GlooConnections,
    NothingToAbort,
    abort_cross_group,
    abort_request,
)
from worker_server.app import create_app

TOKEN = "abort-unit-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class FakeManager:
    """A stand-in for torchft's Manager (see the module doc)."""

    def __init__(self, pg, step: int = 7, quorum_id: int = 3) -> None:
        self._pg, self._step, self._quorum_id = pg, step, quorum_id
        self.reported: list[Exception] = []

    def current_step(self) -> int:
        return self._step

    def report_error(self, e: Exception) -> None:
        self.reported.append(e)


def client(**kwargs):
    state = RankState(RankIdentity(replica_group=1, group_rank=0, group_world_size=1))
    return create_app(state, **kwargs).test_client()


# --- the route ---------------------------------------------------------------------------

def test_route_is_off_without_the_exit_token_and_refuses_a_wrong_one():
    calls = []

    def handler(reason, decision, quorum_id):
        calls.append((reason, decision, quorum_id))
        return {"aborted": True}

    body = {"reason": "peer gone", "decision": 5}
    assert client().post("/v1/abort", json=body).status_code == 403
    assert client(abort_handler=handler).post("/v1/abort", json=body).status_code == 403
    c = client(abort_handler=handler, exit_token=TOKEN)
    assert c.post("/v1/abort", json=body).status_code == 401
    assert c.post("/v1/abort", json=body,
                  headers={"Authorization": "Bearer nope"}).status_code == 401
    assert c.get("/v1/abort").status_code == 405  # never a GET
    assert calls == []
    r = c.post("/v1/abort", json=body, headers=AUTH)
    assert r.status_code == 202 and r.get_json() == {"aborted": True}
    assert calls == [("peer gone", 5, None)]


@pytest.mark.parametrize("body", [None, [], {}, {"reason": ""}, {"reason": 3},
                                  {"reason": "x" * 1001}, {"reason": "r", "decision": "7"},
                                  {"reason": "r", "decision": True},
                                  {"reason": "r", "decision": 1.5},
                                  {"reason": "r", "quorum_id": "3"},
                                  {"reason": "r", "quorum_id": False}])
def test_bad_bodies_are_400_and_abort_nothing(body):
    calls = []
    c = client(abort_handler=lambda *a: calls.append(a), exit_token=TOKEN)
    r = c.post("/v1/abort", json=body, headers=AUTH)
    assert r.status_code == 400 and r.get_json()["error"], r.get_json()
    assert calls == []


def test_body_contract():
    assert abort_request({"reason": " peer gone "}) == ("peer gone", None, None)
    assert abort_request({"reason": "r", "decision": None}) == ("r", None, None)
    assert abort_request({"reason": "r", "decision": 12, "quorum_id": 4}) == ("r", 12, 4)


def test_an_abort_for_a_quorum_the_rank_has_left_aborts_nothing():
    """A survivor told late (torchft's timeout, or another survivor's abort, formed the next
    quorum first) kept its next, healthy group: it was failed too, and a good step lost."""
    class PG:
        pass

    manager = FakeManager(PG(), quorum_id=4)
    with pytest.raises(NothingToAbort, match="moved on: this rank is in quorum 4, the abort was "
                                             "for quorum 3"):
        abort_cross_group(manager, "peer gone", 1, for_quorum=3)
    assert manager.reported == []  # the Manager was not told: its step goes on


def test_a_rank_waiting_for_its_next_quorum_aborts_nothing():
    """torchft's allreduce waits for the step's quorum before any collective; an abort then was
    reported into the new quorum's step and failed it (its peers waited out the group's timeout).
    Once the quorum is reached, the collective is that quorum's: one the abort was not for is
    refused, whatever quorum the rank published last (it lags the Manager's for a moment)."""
    from concurrent.futures import Future

    class PG:
        pass

    manager = FakeManager(PG(), quorum_id=3)
    manager._quorum_future = Future()
    with pytest.raises(NothingToAbort, match=r"^waiting for its next quorum, in no collective "
                                             r"\(the abort was for quorum 3\)$"):
        abort_cross_group(manager, "peer gone", 1, for_quorum=3)
    assert manager.reported == []
    manager._quorum_future.set_result(None)
    manager._quorum_id = 4  # reached: the rank's collective is quorum 4's
    srv = WorkerServer(RankState(RankIdentity()), exit_token=TOKEN).serve()
    try:
        srv.attach(manager)
        srv.state.set_quorum(3, 2, True)  # published before the new quorum was reached
        srv.state.set_phase("allreduce")
        r = requests.post(srv.url + "/v1/abort", json={"reason": "peer gone", "quorum_id": 3},
                          headers=AUTH, timeout=5)
        assert r.status_code == 409, r.text
        assert "this rank is in quorum 4, the abort was for quorum 3" in r.json()["error"]
        assert manager.reported == []
        manager._quorum_id = 3  # blocked in quorum 3's collective: aborted
        r = requests.post(srv.url + "/v1/abort", json={"reason": "peer gone", "quorum_id": 3},
                          headers=AUTH, timeout=5)
        assert r.status_code == 202 and len(manager.reported) == 1, r.text
    finally:
        srv.stop()


def test_a_worker_server_without_a_manager_answers_409_over_http():
    srv = WorkerServer(RankState(RankIdentity()), exit_token=TOKEN).serve()
    try:
        r = requests.post(srv.url + "/v1/abort", json={"reason": "r"}, headers=AUTH, timeout=5)
        assert r.status_code == 409
        assert r.json()["error"] == ("nothing to abort: no torchft Manager is attached to this "
                                     "WorkerServer")
        # without LIGHTKEEPER_EXIT_TOKEN the route is off, as /v1/exit is
        off = WorkerServer(RankState(RankIdentity())).serve()
        try:
            r = requests.post(off.url + "/v1/abort", json={"reason": "r"}, headers=AUTH, timeout=5)
            assert r.status_code == 403 and "LIGHTKEEPER_EXIT_TOKEN" in r.json()["error"]
        finally:
            off.stop()
    finally:
        srv.stop()


@pytest.mark.parametrize("phase", ["optimizer", "quorum", "forward"])
def test_a_rank_told_after_its_collective_failed_aborts_nothing(phase):
    """The monitor tells survivors one after another; the first abort fails the others'
    collective within milliseconds, so one told later is already in its next step (its published
    quorum still the old one). Its abort failed that step: torchft skipped its allreduce and every
    peer waited out the group's timeout (20 s in the demo). Out of the collective: 409, no report."""
    class PG:
        pass

    manager = FakeManager(PG())
    srv = WorkerServer(RankState(RankIdentity()), exit_token=TOKEN).serve()
    try:
        srv.attach(manager)
        srv.state.set_phase(phase)
        r = requests.post(srv.url + "/v1/abort", json={"reason": "peer gone"}, headers=AUTH,
                          timeout=5)
        assert r.status_code == 409, r.text
        assert r.json()["error"] == (f"nothing to abort: moved on: this rank is in phase {phase}, "
                                     "not blocked in the cross-group collective")
        assert manager.reported == []
        srv.state.set_phase("allreduce")  # blocked in it: aborted
        r = requests.post(srv.url + "/v1/abort", json={"reason": "peer gone"}, headers=AUTH,
                          timeout=5)
        assert r.status_code == 202 and len(manager.reported) == 1, r.text
    finally:
        srv.stop()


# --- abort_cross_group per process-group type --------------------------------------------

def test_nothing_to_abort_without_a_manager_or_a_group():
    with pytest.raises(NothingToAbort, match="no torchft Manager"):
        abort_cross_group(None, "r")
    with pytest.raises(NothingToAbort, match="no process group"):
        abort_cross_group(FakeManager(None), "r")


def _sleeper():
    time.sleep(120)


def test_baby_group_its_subprocess_is_killed_through_a_wrapper(caplog):
    from torchft.process_group import ErrorSwallowingProcessGroupWrapper, ProcessGroupBabyGloo

    baby = ProcessGroupBabyGloo(timeout=timedelta(seconds=60))
    baby._p = multiprocessing.get_context("fork").Process(target=_sleeper, daemon=True)
    baby._p.start()
    try:
        manager = FakeManager(ErrorSwallowingProcessGroupWrapper(baby))
        with caplog.at_level(logging.WARNING, logger="worker_server.abort"):
            res = abort_cross_group(manager, "host of group 2 unreachable", 41)
        assert res.pg == "ProcessGroupBabyGloo" and res.mechanism == "baby_killed"
        assert f"pid {baby._p.pid}" in res.detail and "will not commit" in res.detail
        assert (res.quorum_id, res.step) == (3, 7)
        wait_until(lambda: not baby._p.is_alive(), 10, what="the baby to die")
        [err] = manager.reported
        assert str(err) == "aborted by Lightkeeper: host of group 2 unreachable (decision 41)"
        [line] = [r.getMessage() for r in caplog.records]
        assert "decision 41: host of group 2 unreachable: killed the group's subprocess" in line
        # nothing left to kill: the error is still reported
        again = abort_cross_group(manager, "again")
        assert again.mechanism == "report_only" and len(manager.reported) == 2
    finally:
        baby._p.kill()
        baby._p.join(10)


def test_gloo_group_whose_connections_are_unknown_reports_only():
    from torchft.process_group import ProcessGroupGloo

    manager = FakeManager(ProcessGroupGloo(timeout=timedelta(seconds=60)))
    res = abort_cross_group(manager, "r", connections=GlooConnections())
    assert res.mechanism == "report_only"
    assert "ends at the process group's timeout (60 s)" in res.detail
    assert len(manager.reported) == 1


def test_nccl_group_is_aborted_through_torchft(monkeypatch):
    import torch
    from torchft.process_group import ProcessGroupNCCL

    # a CPU build of torch has no NCCL: claim one recent enough to take torchft's abort path
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 26))
    monkeypatch.setenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", "60")
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=60))
    res = abort_cross_group(FakeManager(pg), "r")
    assert res.mechanism == "pg_abort" and res.pg == "ProcessGroupNCCL"
    assert isinstance(pg.errored(), RuntimeError)  # what torchft's should_commit reads


def test_another_group_type_reports_only_and_a_failing_report_is_said():
    from torchft.process_group import ProcessGroupDummy

    class Refusing(FakeManager):
        def report_error(self, e):
            raise RuntimeError("manager shut down")

    res = abort_cross_group(Refusing(ProcessGroupDummy(0, 1)), "r")
    assert res.mechanism == "report_only" and "ProcessGroupDummy cannot be aborted" in res.detail
    assert "reporting to the Manager failed (RuntimeError: manager shut down)" in res.detail


# --- the gloo connection recorder, on real sockets ---------------------------------------

def gloo_record(listener: socket.socket) -> bytes:
    """One rank's record in a gloo group's store, as gloo's tcp transport writes it: hostname,
    the device's listening sockaddr_storage and a sequence number, then pair ids."""
    ip, port = listener.getsockname()[:2]
    head = struct.pack("=H", listener.family) + struct.pack("!H", port)
    if listener.family == socket.AF_INET:
        sockaddr = head + socket.inet_pton(socket.AF_INET, ip)
    else:
        sockaddr = head + bytes(4) + socket.inet_pton(socket.AF_INET6, ip) + bytes(4)
    address = sockaddr.ljust(128, b"\0") + struct.pack("=q", 1)
    return (struct.pack("@N", 2) + b"vm" + struct.pack("@N", len(address)) + address
            + struct.pack("=2q", 0, 1))


class FakeStore:
    """The c10d store calls the recorder makes (it never waits on a key)."""

    def __init__(self, **records: bytes) -> None:
        self.records = {k.lstrip("_").replace("_", "/"): v for k, v in records.items()}

    def check(self, keys):
        return all(k in self.records for k in keys)

    def get(self, key):
        return self.records[key]


class FakeGlooGroup:
    """Stands in for torchft's ProcessGroupGloo, whose ``_create_pg`` opens a listener,
    publishes it in the group's store and connects the group (a real gloo group is below).
    Meanwhile another server of the process accepts a connection on a listener that was there
    before."""

    def __init__(self, peer: socket.socket, other_server: socket.socket) -> None:
        self.peer, self.other_server = peer, other_server
        self.opened: dict[str, socket.socket] = {}

    def _create_pg(self, store, rank, world_size):
        o = self.opened
        o["listener"] = socket.create_server(("127.0.0.1", 0))
        store.records[f"0/{rank}"] = gloo_record(o["listener"])
        o["out"] = socket.create_connection(self.peer.getsockname())
        o["in_client"] = socket.create_connection(o["listener"].getsockname())
        o["in"], _ = o["listener"].accept()
        o["other"], _ = self.other_server.accept()  # a WorkerServer poll, say
        return "the c10d group"


def test_connections_opened_by_create_pg_are_shut_down_and_nothing_else():
    peer = socket.create_server(("127.0.0.1", 0))
    other_server = socket.create_server(("127.0.0.1", 0))
    other_client = socket.create_connection(other_server.getsockname())
    group = FakeGlooGroup(peer, other_server)
    conns = GlooConnections()
    assert conns.hook(group) and conns.hook(group)  # hooked once
    assert not conns.recorded
    assert group._create_pg(FakeStore(_0_1=gloo_record(peer)), 0, 2) == "the c10d group"
    assert conns.recorded
    o = group.opened
    peer_side, _ = peer.accept()
    o["in_client"].close()  # closed since: its descriptor is not touched again

    assert conns.shutdown() == 2  # "out" and "in"
    peer_side.settimeout(5)
    assert peer_side.recv(1) == b""  # the peer sees the connection end
    o["in"].settimeout(5)
    assert o["in"].recv(1) == b""
    other_client.sendall(b"x")  # the other server's connection lives on
    o["other"].settimeout(5)
    assert o["other"].recv(1) == b"x"
    probe = socket.create_connection(o["listener"].getsockname())  # the listener too
    accepted, _ = o["listener"].accept()
    for s in (peer, other_server, other_client, peer_side, probe, accepted, *o.values()):
        s.close()


def test_a_store_without_every_ranks_address_records_nothing():
    """Unsure which connections are the group's (a rank's record is missing or unreadable):
    nothing is cut, and the abort says so."""
    from torchft.process_group import ProcessGroupGloo

    for records in ({}, {"_0_1": b"not a gloo record"}):
        peer = socket.create_server(("127.0.0.1", 0))
        other = socket.create_server(("127.0.0.1", 0))
        other_client = socket.create_connection(other.getsockname())
        group = FakeGlooGroup(peer, other)
        conns = GlooConnections()
        conns.hook(group)
        group._create_pg(FakeStore(**records), 0, 2)
        assert not conns.recorded and conns.shutdown() == 0
        res = abort_cross_group(FakeManager(ProcessGroupGloo()), "r", None, conns)
        assert res.mechanism == "report_only" and "could not be read" in res.detail
        peer_side, _ = peer.accept()
        group.opened["out"].sendall(b"x")  # untouched
        peer_side.settimeout(5)
        assert peer_side.recv(1) == b"x"
        for s in (peer, other, other_client, peer_side, *group.opened.values()):
            s.close()


def test_a_real_gloo_group_loses_its_mesh_and_another_threads_connection_lives_on():
    """Two ranks of torchft's ProcessGroupGloo in this process. While rank 0's ``_create_pg``
    runs, another thread connects to a server that was there before (an object store, NCCL's
    bootstrap): the abort fails the group's collectives at once and leaves that connection."""
    import torch
    import torch.distributed as dist
    from torch.distributed import AllreduceOptions
    from torchft.process_group import ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    server = socket.create_server(("127.0.0.1", 0))
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=10)) for _ in range(2)]
    theirs: dict[str, socket.socket] = {}
    real = pgs[0]._create_pg

    def create_pg_while_another_thread_connects(*args):
        t = threading.Thread(target=lambda: theirs.setdefault(
            "client", socket.create_connection(server.getsockname())))
        t.start()
        try:
            return real(*args)
        finally:
            t.join()

    pgs[0]._create_pg = create_pg_while_another_thread_connects
    conns = GlooConnections()
    assert conns.hook(pgs[0])
    ranks = [threading.Thread(target=pgs[i].configure,
                              args=(f"127.0.0.1:{store.port}/q1", f"r{i}", i, 2))
             for i in range(2)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(30)
    accepted, _ = server.accept()
    try:
        sums = [torch.ones(2) for _ in range(2)]
        for work in [pgs[i].allreduce([sums[i]], AllreduceOptions()) for i in range(2)]:
            work.wait()
        assert sums[0].tolist() == [2.0, 2.0]  # the group works

        res = abort_cross_group(FakeManager(pgs[0]), "peer gone", None, conns)
        assert res.mechanism == "gloo_connections", res.detail
        assert not res.detail.startswith("shut down 0 ")
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            pgs[0].allreduce([torch.ones(2)], AllreduceOptions()).wait()
        assert time.monotonic() - started < 5  # at once, not at the group's 10 s timeout

        theirs["client"].sendall(b"x")  # the other thread's connection lives on
        accepted.settimeout(5)
        assert accepted.recv(1) == b"x"
        accepted.sendall(b"y")
        theirs["client"].settimeout(5)
        assert theirs["client"].recv(1) == b"y"
    finally:
        for pg in pgs:
            pg.abort(errored=False)
        for s in (server, accepted, *theirs.values()):
            s.close()


def test_recording_never_fails_the_group(monkeypatch):
    from worker_server import abort

    class Group:
        def _create_pg(self):
            return "pg"

    conns = GlooConnections()
    conns.hook(g := Group())
    monkeypatch.setattr(abort, "socket_fds", lambda: 1 / 0)
    assert g._create_pg() == "pg" and not conns.recorded
    assert not GlooConnections().hook(object())  # nothing to hook


def test_abort_of_a_gloo_group_shuts_its_recorded_connections(caplog):
    from torchft.process_group import ProcessGroupGloo

    peer = socket.create_server(("127.0.0.1", 0))
    other = socket.create_server(("127.0.0.1", 0))
    group = FakeGlooGroup(peer, other)
    other_client = socket.create_connection(other.getsockname())
    conns = GlooConnections()
    conns.hook(group)
    group._create_pg(FakeStore(_0_1=gloo_record(peer)), 0, 2)
    res = abort_cross_group(FakeManager(ProcessGroupGloo()), "peer gone", None, conns)
    assert res.mechanism == "gloo_connections"
    assert res.detail.startswith("shut down 3 connection(s) of the gloo group")
    for s in (peer, other, other_client, *group.opened.values()):
        s.close()


def test_watch_manager_hooks_a_gloo_group_once():
    from torchft.process_group import ProcessGroupDummy, ProcessGroupGloo

    from worker_server.abort import watch_manager

    manager = FakeManager(ProcessGroupGloo())
    first = watch_manager(manager)
    assert watch_manager(manager) is first  # attached twice: the recorder already watching
    assert manager._pg._create_pg._lightkeeper_conns is first
    other = watch_manager(FakeManager(ProcessGroupDummy(0, 1)))
    assert not other.recorded and other.shutdown() == 0
