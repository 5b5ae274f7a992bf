"""How long a SIGTERMed rank waits for its monitor's next read (``WorkerServer.stopped()``).

A monitor that reads every half second may still sweep seconds late (its cores shared with a
job, a sweep waiting on a Flight Recorder dump or a dead rank): a rank that waited only two of
its gaps ended unsaid, and the monitor counted it dead against its host and, forgotten, lost
(``LightkeeperRanksLost``). A reader gone for good (a monitor stopped with the job) holds the
rank's end no longer than that wait, counted from its last read.

A real WorkerServer read as the monitor reads (its User-Agent); the SIGTERM path's call is made
directly, on a thread of its own as the SIGTERM watcher makes it.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests

from rank_wire import MONITOR_AGENT
from worker_server import WorkerServer
from worker_server import server as server_module

PACE_S = 0.5  # the reader's interval, as the e2e tests run the monitor (--interval 0.5)


@pytest.fixture
def rank():
    ws = WorkerServer.start(replica_group=0, job="j")
    session = requests.Session()
    session.headers["User-Agent"] = MONITOR_AGENT
    try:
        yield ws, lambda: session.get(ws.url + "/v1/state", timeout=2).json()
    finally:
        session.close()
        ws.stop()


def read_at_pace(read, reads: int = 3) -> None:
    for i in range(reads):
        if i:
            time.sleep(PACE_S)  # the reader's pace, not a synchronization
        read()


def test_a_stop_is_said_to_a_fast_reader_whose_next_read_comes_late(rank):
    ws, read = rank
    read_at_pace(read)
    said: list[bool] = []
    stopping = threading.Thread(target=lambda: said.append(ws.stopped()))
    stopping.start()
    time.sleep(2 * PACE_S + 1.5)  # its next sweep, 2 s later than its interval
    answer = read()
    stopping.join(10)
    # the old wait (two gaps, 1 s) ended the rank before this read: the stop went unsaid
    assert said == [True]
    assert (answer["finished"], answer["stopped_by"]) == (True, "SIGTERM")


def test_a_stop_no_reader_reads_ends_at_the_floor_counted_from_the_last_read(rank, monkeypatch):
    monkeypatch.setattr(server_module, "STOP_FLOOR_S", 2.0)  # scaled down: the test takes 3 s
    ws, read = rank
    read_at_pace(read)
    last = time.monotonic()
    time.sleep(PACE_S)  # the stop comes between two reads; the reader is gone for good
    assert ws.stopped() is False
    waited = time.monotonic() - last
    assert 2.0 - 0.1 <= waited < 2.0 + 1.0, waited  # past two gaps (1 s), held no longer
