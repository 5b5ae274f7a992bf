"""A planned stop said before the rank goes (``worker_server.stop_signal``): SIGTERM marks the
rank's ``/v1/state`` stopped, then ends the process by SIGTERM as before.

Each test runs a real process with a real WorkerServer whose main thread is blocked in C (a
``select`` on nothing, as a rank blocked in a collective), and sends it a real SIGTERM; a
thread polls ``/v1/state`` as the monitor's poller does (its ``User-Agent``). A real monitor
counting such a rank ended, not dead, on a real job: tests/test_planned_maintenance_e2e.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

from lightkeeper.processes import stop_process, wait_until
from rank_wire import MONITOR_AGENT

SCRIPT = """
import select, sys, threading
from worker_server.stop_signal import watch_sigterm
if sys.argv[1] == "thread-first":
    threading.Thread(target=threading.Event().wait, daemon=True).start()
print("unarmed:", watch_sigterm(), flush=True)
from worker_server import WorkerServer
server = WorkerServer.start(replica_group=0)
print("url:", server.url, flush=True)
select.select([], [], [])
"""


# a job's own script under ``lightkeeper run --planned-stops`` (the hook armed it at start);
# "handler": the script handles SIGTERM itself
RUN_SCRIPT = """
import select, signal, sys, time
if sys.argv[1] == "handler":
    signal.signal(signal.SIGTERM, lambda *_: (print("handled", flush=True), sys.exit(0)))
if sys.argv[1] == "again":  # as lightkeeper train arms it itself: the hook did already
    from worker_server.stop_signal import watch_sigterm
    print("unarmed:", watch_sigterm(), flush=True)
else:
    print("unarmed: -", flush=True)
from worker_server import WorkerServer
server = WorkerServer.start(replica_group=0)
print("url:", server.url, flush=True)
if sys.argv[1] == "handler":  # a training loop: back in Python between its steps
    while True:
        time.sleep(0.05)
select.select([], [], [])
"""


class Rank:
    def __init__(self, mode: str = "", run_env: dict | None = None) -> None:
        env = None
        if run_env is not None:  # as `lightkeeper run --planned-stops` starts the command
            import argparse
            import os

            from lightkeeper.run import add_arguments, hook_env
            p = argparse.ArgumentParser()
            add_arguments(p)
            env = {**os.environ, **hook_env(p.parse_args(["--planned-stops", "--", "x"]),
                                            dict(os.environ)), **run_env}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SCRIPT if run_env is None else RUN_SCRIPT, mode], text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        self.unarmed = self.proc.stdout.readline().strip()
        line = self.proc.stdout.readline().strip()
        assert line.startswith("url: "), (self.unarmed, line, self.proc.stdout.read())
        self.url = line.split()[1]
        self.answers: list[dict] = []

    def poll_as_the_monitor(self) -> None:
        """Read /v1/state every 0.2 s, as a monitor's poller, until the process is gone."""
        def run():
            with requests.Session() as s:
                while self.proc.poll() is None:
                    try:
                        self.answers.append(s.get(self.url + "/v1/state", timeout=2, headers={
                            "User-Agent": MONITOR_AGENT}).json())
                    except requests.RequestException:
                        pass
                    time.sleep(0.2)  # the poll interval, not a synchronization
        threading.Thread(target=run, daemon=True).start()
        wait_until(lambda: len(self.answers) >= 2, 10, what="two reads")

    def sigterm(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=20)


@pytest.fixture
def rank():
    made: list[Rank] = []
    yield lambda mode="", **kw: made.append(Rank(mode, **kw)) or made[-1]
    for r in made:
        stop_process(r.proc, grace=0)


def test_sigterm_is_said_to_a_polling_monitor_then_ends_the_process(rank):
    r = rank()
    assert r.unarmed == "unarmed: None"
    r.poll_as_the_monitor()
    assert r.answers[-1]["finished"] is False and r.answers[-1]["stopped_by"] is None
    # the main thread never leaves C: the stop is said and the process ends all the same
    assert r.sigterm() == -signal.SIGTERM
    last = r.answers[-1]
    assert last["finished"] is True and last["stopped_by"] == "SIGTERM", last
    assert last["phase"] == "stopped"


def test_sigterm_unread_ends_the_process_at_once(rank):
    r = rank()  # nothing ever read /v1/state: nothing to wait for
    assert r.sigterm() == -signal.SIGTERM
    assert "Traceback" not in r.proc.stdout.read()


def test_a_thread_started_first_leaves_sigterm_as_it_was(rank):
    r = rank("thread-first")
    assert r.unarmed == "unarmed: 1 other thread(s) already run and could take SIGTERM unmarked"
    r.poll_as_the_monitor()
    assert r.sigterm() == -signal.SIGTERM
    assert r.answers[-1]["stopped_by"] is None


def test_lightkeeper_run_planned_stops_arms_a_rank(rank):
    r = rank("again", run_env={"RANK": "0"})
    assert r.unarmed == "unarmed: None"  # armed by the hook, not refused for its thread
    r.poll_as_the_monitor()
    assert r.sigterm() == -signal.SIGTERM
    assert r.answers[-1]["stopped_by"] == "SIGTERM", r.answers[-1]


def test_lightkeeper_run_planned_stops_leaves_a_process_that_is_no_rank_alone(rank):
    r = rank(run_env={})  # no RANK, no LOCAL_RANK: torchrun's agent, a tool
    r.poll_as_the_monitor()
    assert r.sigterm() == -signal.SIGTERM
    assert r.answers[-1]["stopped_by"] is None


def test_the_jobs_own_sigterm_handler_still_runs_after_the_stop_is_said(rank):
    r = rank("handler", run_env={"LOCAL_RANK": "0"})
    r.poll_as_the_monitor()
    assert r.sigterm() == 0  # its handler's sys.exit(0)
    assert r.answers[-1]["stopped_by"] == "SIGTERM", r.answers[-1]
    assert "handled" in r.proc.stdout.read()


def test_a_stop_while_the_server_module_still_imports_says_nothing(monkeypatch):
    """torchrun may SIGTERM a rank within its first second, while worker_server.server is
    still being imported (in sys.modules, without its names yet): nothing serves, so nothing
    is said, and no AttributeError line reads like a crash of Lightkeeper's."""
    import types

    from worker_server import stop_signal

    monkeypatch.setitem(sys.modules, "worker_server.server", types.ModuleType("partial"))
    stop_signal._servers_stopped()  # raised AttributeError before
