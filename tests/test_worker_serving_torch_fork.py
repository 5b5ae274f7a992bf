"""A rank serving on torch's server (``server="torch"``) that forks (DataLoader workers) and then
dies while its children live: the children kept their copies of torch's listening socket, so the
port stayed bound (polls timed out instead of being refused) and a rank restarted on its fixed
port could not bind it; and a child that ended normally stopped its parent's server. Now a
fork's child closes its copy at once and stops nothing of its parent's."""

from __future__ import annotations

import http.client
import json
import os
import select
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from worker_server import RankIdentity, RankState, WorkerServer, torch_server
from worker_server.torch_server import unavailable

ROOT = Path(__file__).resolve().parent.parent
# each a rank that forks (a DataLoader worker) while serving on torch's server (_case_<name>)
CASES = ("a_dead_ranks_forked_child_does_not_keep_its_torch_port",
         "a_forked_child_that_exits_leaves_its_parents_torch_server_serving",
         "a_dead_ranks_forked_child_does_not_keep_a_connection_its_server_accepted")


@pytest.fixture(scope="module", autouse=True)
def _torchs_server_and_proc():
    """Skips the module without torch's server or /proc (the child's copy is found there):
    checked here, not at collection, where it imports torch (a second of CPU for every
    pytest-xdist worker)."""
    if why := unavailable() or (None if os.path.isdir("/proc/self/fd") else
                                "no /proc (the child's copy is found there)"):
        pytest.skip(why)


@pytest.fixture(scope="module")
def fresh() -> dict[str, str]:
    """Each case run in one fresh interpreter: a fork from pytest-xdist's worker, whose other
    threads may hold a lock at that moment (logging's, an import's), can hang its child.
    Case name -> "ok" or its traceback."""
    code = ("import json, traceback\n"
            "import tests.test_worker_serving_torch_fork as m\n"
            "out = {}\n"
            "for name in m.CASES:\n"
            "    try:\n"
            "        getattr(m, '_case_' + name)()\n"
            "        out[name] = 'ok'\n"
            "    except BaseException:\n"
            "        out[name] = traceback.format_exc()\n"
            "print('RESULTS ' + json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert lines, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.parametrize("case", CASES)
def test_a_forking_rank_on_torchs_server(fresh, case):
    assert fresh[case] == "ok", fresh[case]


def _read(fd: int, timeout_s: float = 10.0) -> bytes:
    ready, _, _ = select.select([fd], [], [], timeout_s)
    assert ready, "the rank never said its port"
    return os.read(fd, 64)


def _case_a_dead_ranks_forked_child_does_not_keep_its_torch_port():
    state = RankState(RankIdentity(job="unit", replica_group=0, group_rank=0, group_world_size=1))
    port_r, port_w = os.pipe()
    end_r, end_w = os.pipe()  # closed by the test: the grandchild (a DataLoader worker) ends
    rank = os.fork()
    if rank == 0:  # the rank: serves on torch's server, forks a worker, dies without stopping
        code = 1
        try:
            os.close(port_r)
            os.close(end_w)
            server = WorkerServer(state, server="torch").serve()
            assert server.server == "torch"
            other = socket.socket()  # the job's own listening socket: the worker keeps it
            other.bind(("127.0.0.1", 0))
            other.listen()
            ready_r, ready_w = os.pipe()
            if os.fork() == 0:
                os.close(port_w)
                os.write(ready_w, b"!")  # the fork is done, its at-fork hooks too
                os.read(end_r, 1)  # lives on after its parent, until the test is done
                os._exit(0)
            assert os.read(ready_r, 1) == b"!"
            os.write(port_w, f"{server.port} {other.getsockname()[1]}".encode())
            code = 0
        finally:
            os._exit(code)  # a crash, an OOM kill: torch's server is never shut down
    os.close(port_w)
    os.close(end_r)
    try:
        port, other_port = map(int, _read(port_r).split())
        _, status = os.waitpid(rank, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        # the rank restarted by torchrun binds its fixed port while the worker still runs
        with socket.socket() as restarted:
            restarted.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            restarted.bind(("127.0.0.1", port))
            restarted.listen()
        # nothing else was closed: the job's own socket is still there in the worker
        socket.create_connection(("127.0.0.1", other_port), timeout=5).close()
    finally:
        os.close(end_w)
        os.close(port_r)


def _case_a_forked_child_that_exits_leaves_its_parents_torch_server_serving():
    """A child ending normally ran the at-exit stop of the server it was forked with: torch's
    shutdown() on the copy shut the parent's listening socket, and the parent (the rank) was
    aborted by its server thread ("failed to listen", SIGABRT)."""
    state = RankState(RankIdentity(job="unit", replica_group=0, group_rank=0, group_world_size=1))
    rank = os.fork()
    if rank == 0:  # the rank, in a process of its own: its end is the test's to see
        code = 1
        try:
            server = WorkerServer(state, server="torch").serve()
            child = os.fork()
            if child == 0:
                try:
                    torch_server._stop_all()  # what its interpreter runs at a normal exit
                finally:
                    os._exit(0)
            os.waitpid(child, 0)
            base = server.url.replace("torch+http", "http")
            answer = requests.post(base + "/handler/lightkeeper_state", timeout=5)
            code = 0 if answer.status_code == 200 and answer.json()["job"] == "unit" else 2
            server.stop()
        finally:
            os._exit(code)
    _, status = os.waitpid(rank, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _case_a_dead_ranks_forked_child_does_not_keep_a_connection_its_server_accepted():
    """The monitor keeps its connection to a rank alive; a worker forked meanwhile kept its copy
    of the connection torch's server had accepted, so when the rank died the monitor read no
    close: its next poll waited out its timeout instead of failing at once."""
    state = RankState(RankIdentity(job="unit", replica_group=0, group_rank=0, group_world_size=1))
    port_r, port_w = os.pipe()
    go_r, go_w = os.pipe()  # written by the test once its connection is open
    end_r, end_w = os.pipe()  # closed by the test: the grandchild (a DataLoader worker) ends
    rank = os.fork()
    if rank == 0:  # the rank: serves, forks a worker while the connection is open, dies
        code = 1
        try:
            for fd in (port_r, go_w, end_w):
                os.close(fd)
            server = WorkerServer(state, server="torch").serve()
            os.write(port_w, str(server.port).encode())
            os.read(go_r, 1)
            ready_r, ready_w = os.pipe()
            if os.fork() == 0:
                os.write(ready_w, b"!")  # the fork is done, its at-fork hooks too
                os.read(end_r, 1)
                os._exit(0)
            assert os.read(ready_r, 1) == b"!"
            code = 0
        finally:
            os._exit(code)  # a crash: torch's server never closes the connection
    for fd in (port_w, go_r, end_r):
        os.close(fd)
    try:
        port = int(_read(port_r))
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/handler/lightkeeper_state")  # kept alive, as the monitor's
        answer = conn.getresponse()
        assert answer.status == 200 and answer.getheader("Connection") != "close"
        answer.read()
        os.write(go_w, b"!")
        _, status = os.waitpid(rank, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        conn.sock.settimeout(2)
        assert conn.sock.recv(1) == b""  # the close, at once
        conn.close()
    finally:
        for fd in (go_w, end_w, port_r):
            os.close(fd)
