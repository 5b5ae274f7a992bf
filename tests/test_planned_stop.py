"""A planned stop said before the rank goes (``worker_server.stop_signal``): SIGTERM marks the
rank's ``/v1/state`` stopped, then ends the process by SIGTERM as before.

Each test runs a real process with a real WorkerServer whose main thread is blocked in C (a
``select`` on nothing, as a rank blocked in a collective), and sends it a real SIGTERM; a
thread polls ``/v1/state`` as the monitor's poller does (its ``User-Agent``). A real monitor
counting such a rank ended, not dead, on a real job: tests/test_planned_stop_e2e.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

from lightkeeper.cluster import stop_process, wait_until
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


class Rank:
    def __init__(self, mode: str = "") -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode], text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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
    yield lambda mode="": made.append(Rank(mode)) or made[-1]
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
