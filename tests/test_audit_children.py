"""A rank's own children (DataLoader workers, multiprocessing, ``subprocess``) under Lightkeeper.

Each test runs a real process armed for planned stops (``watch_sigterm``, as ``lightkeeper run
--planned-stops`` and ``lightkeeper train`` arm a rank) or a real WorkerServer, and real children.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from lightkeeper.processes import stop_process, wait_until

# after arming, as the hook arms a rank at interpreter start: its children end on SIGTERM
SUBPROCESS_CHILDREN = """
from worker_server.stop_signal import watch_sigterm
print("unarmed:", watch_sigterm(), flush=True)
import subprocess, sys
for command in (["sleep", "30"], [sys.executable, "-I", "-c", "import time; time.sleep(30)"]):
    child = subprocess.Popen(command)  # -I: a Python child that does not load the hook
    child.terminate()
    try:
        print(command[0], child.wait(timeout=5), flush=True)
    except subprocess.TimeoutExpired:
        child.kill()
        print(command[0], "ignored SIGTERM", child.wait(), flush=True)
"""

# multiprocessing's spawn (a DataLoader with multiprocessing_context="spawn", a Pool, shared
# memory) starts its resource tracker from the rank's main thread
RESOURCE_TRACKER = """
from worker_server.stop_signal import watch_sigterm
print("unarmed:", watch_sigterm(on_stop=lambda: print("stop said", flush=True)), flush=True)
from multiprocessing import resource_tracker
resource_tracker.ensure_running()
print("tracker:", resource_tracker._resource_tracker._pid, flush=True)
import select
select.select([], [], [])
"""


def run_script(script: str, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args, "-c", script], text=True,
                            stdout=subprocess.PIPE, **popen)


def test_children_started_by_subprocess_end_on_sigterm():
    proc = run_script(SUBPROCESS_CHILDREN)
    try:
        out, _ = proc.communicate(timeout=30)
    finally:
        stop_process(proc, grace=0)
    assert out.splitlines() == ["unarmed: None", "sleep -15", f"{sys.executable} -15"], out


def test_a_spawn_contexts_resource_tracker_leaves_the_stop_said():
    proc = run_script(RESOURCE_TRACKER)
    tracker = None
    try:
        assert proc.stdout.readline().strip() == "unarmed: None"
        tracker = int(proc.stdout.readline().split()[1])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == -signal.SIGTERM
        assert proc.stdout.read() == "stop said\n"  # else the main thread took it, unsaid
    finally:
        stop_process(proc, grace=0)
        if tracker is not None:  # it ends when this process is gone; never left behind
            try:
                os.kill(tracker, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_sigterm_where_nothing_serves_ends_the_process_without_loading_the_server():
    # a spawn DataLoader worker or a tool under lightkeeper run --planned-stops: armed, no
    # WorkerServer; importing Flask and requests on SIGTERM delayed its end by 0.2-0.8 s
    script = ("from worker_server.stop_signal import watch_sigterm\n"
              "print(watch_sigterm(), flush=True)\nimport select\nselect.select([], [], [])\n")
    proc = run_script(script, "-X", "importtime", stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "None"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == -signal.SIGTERM
        assert "worker_server.server" not in proc.stderr.read()
    finally:
        stop_process(proc, grace=0)


def test_a_forked_child_does_not_keep_the_ranks_port():
    from worker_server import WorkerServer

    server = WorkerServer.start(replica_group=0)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker or a helper the job forked: it outlives the server
        try:
            os.close(write)
            os.read(read, 1)
        finally:
            os._exit(0)
    os.close(read)
    try:
        server.stop()  # as the rank's end: the port must be free though the child lives

        def bindable() -> bool:  # EADDRINUSE for as long as the child held it
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", server.port))
                except OSError:
                    return False
                return True

        # polled: another thread of this test process may fork (then exec) at any moment,
        # holding the port for that instant
        wait_until(bindable, 5, interval=0.05, what="the rank's port free")
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
    finally:
        os.close(write)  # the child's read returns: it exits
        deadline = time.monotonic() + 5
        while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


@pytest.mark.parametrize("planned_stops", ["", "1"])
def test_the_hook_costs_a_python_child_no_heavy_import(planned_stops):
    # every Python process of the job loads the hook: a spawn DataLoader worker, a compile
    # worker, a tool run with subprocess; typing, re, pathlib and importlib.util cost it 15 ms
    from worker_server.autostart import SITE_DIR

    root = str(SITE_DIR.parents[1])
    script = (f"import sys; before = set(sys.modules); sys.path[:0] = [{str(SITE_DIR)!r}, {root!r}]"
              "; import sitecustomize; print(' '.join(sorted(set(sys.modules) - before)))")
    env = {**os.environ, "LIGHTKEEPER_AUTOSTART": "1", "LIGHTKEEPER_PLANNED_STOPS": planned_stops,
           "LOCAL_RANK": "0"}
    out = subprocess.run([sys.executable, "-S", "-c", script], env=env, capture_output=True,
                         text=True, timeout=30)
    loaded = set(out.stdout.split())
    assert "worker_server.autostart" in loaded, out
    assert ("worker_server.stop_signal" in loaded) == bool(planned_stops), out
    assert not loaded & {"typing", "re", "pathlib", "importlib.util"}, out
    assert out.stderr == ""


@pytest.mark.parametrize("rank_env", [{}, {"RANK": "0"}])
def test_planned_stops_say_when_a_rank_could_not_be_armed(tmp_path, rank_env):
    # a script that sets RANK itself (examples/torchft_two_groups.py) was left unarmed, unsaid
    from tests.support.hook import hooked_env

    env = {k: v for k, v in hooked_env(tmp_path).items() if k not in ("RANK", "LOCAL_RANK")}
    env.update(LIGHTKEEPER_PLANNED_STOPS="1", **rank_env)
    script = ("import os; os.environ['RANK'] = '0'\n"
              "from torchft.manager import Manager\nManager(replica_id='train_1')\n")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stderr.splitlines() if "planned-stops" in line]
    assert "worker_server=http://127.0.0.1:" in out.stderr
    assert said == ([] if rank_env else [
        "[lightkeeper] --planned-stops: not armed in this rank, which had neither RANK nor "
        "LOCAL_RANK set when it started: SIGTERM ends it unsaid (start it with RANK set)"]), said
