"""A drain's second pod: with leader polling (the monitor's default from 2,000 ranks) a
non-leader rank is read every ``--member-interval`` (10 s), so a SIGTERMed one that waited at
most the clean end's 3 s for the next read usually went unread, and the monitor, seeing it
gone unsaid, counted it lost (``LightkeeperRanksLost``) and ``dead_rank`` against its host: an
LWS group's worker pod drained, or local ranks 1-7 of a pod. The rank now waits up to two of
its reader's intervals (at most ``STOP_WAIT_S``, 20 s, under the kill grace of 30 s).

A real WorkerServer and a reader polling as the monitor does (its User-Agent); the intervals
are scaled down (the reader every 0.5 s, the clean end's cap set to 0.1 s) so the test takes
about two seconds; no kubelet runs here, the SIGTERM path's call (``stopped()``) is made directly."""

from __future__ import annotations

import threading
import time

import requests

from lightkeeper.processes import wait_until
from rank_wire import MONITOR_AGENT
from worker_server import WorkerServer
from worker_server import server as server_module


def test_a_stop_waits_for_a_reader_slower_than_the_clean_ends_cap(monkeypatch):
    monkeypatch.setattr(server_module, "FINISH_WAIT_S", 0.1)
    ws = WorkerServer.start(replica_group=1, group_rank=1, group_world_size=2, job="j")
    answers: list[dict] = []
    done = threading.Event()

    def read():
        with requests.Session() as s:
            while not done.is_set():
                try:
                    answers.append(s.get(ws.url + "/v1/state", timeout=2,
                                         headers={"User-Agent": MONITOR_AGENT}).json())
                except requests.RequestException:
                    pass
                done.wait(0.5)  # the member interval, scaled down: not a synchronization

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_until(lambda: len(answers) >= 3, 10, what="three reads (the reader's interval)")
        n = len(answers)
        wait_until(lambda: len(answers) > n, 10, what="a fresh read")  # the stop just after it
        t0 = time.monotonic()
        assert ws.stopped() is True  # the next read came, and said it
        assert time.monotonic() - t0 < 2.0
        # sent when stopped() returned; the reader's thread parses it a moment later
        wait_until(lambda: answers[-1]["finished"] is True, 5, what="the reader got it")
        assert answers[-1]["stopped_by"] == "SIGTERM"
    finally:
        done.set()
        reader.join(5)
        ws.stop()
