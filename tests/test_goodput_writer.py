"""The goodput ledger's saves written beside the sweep (monitor/goodput/account.py), into the
monitor's real store (an SQLite file). A slow or failing disk is played by a Store subclass whose
write waits on an event or raises (SQLite cannot be made slow or full here on demand); what is
stored is read back by a new Store on the same file, as a restarted monitor reads it."""

from __future__ import annotations

import sqlite3
import threading
import time

from monitor.goodput import GoodputWriter
from monitor.store import Store


class GatedStore(Store):
    """A real store whose goodput writes wait for ``gate`` and can be made to fail."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_next = 0
        self.calls = 0

    def save_goodput(self, *args, **kwargs) -> None:
        self.calls += 1
        self.entered.set()
        assert self.gate.wait(30)
        if self.fail_next:
            self.fail_next -= 1
            raise sqlite3.OperationalError("database or disk is full")
        super().save_goodput(*args, **kwargs)


def state(n: int) -> dict:
    return {"version": 3, "sweep": n}


def interval(n: int) -> dict:
    return {"start": float(n), "end": n + 1.0, "replica_group": n, "cause": "stall",
            "replica_seconds": 1.0, "gpu_seconds": None, "incident": 1, "finding_id": None,
            "eviction_id": None, "settled": True}


def incident(n: int, closed: bool = False) -> dict:
    return {"id": 1, "kind": "hang", "sweep": n, "closed_at": 9.0 if closed else None}


def failed_first(writer: GoodputWriter, timeout_s: float = 10.0) -> None:
    """Wait (polling, with a deadline) until the writer's first write has failed."""
    deadline = time.monotonic() + timeout_s
    while writer.error is None:
        assert time.monotonic() < deadline, "the first write did not fail"
        time.sleep(0.01)


def stored(path: str) -> tuple:
    store = Store(path)
    try:
        return store.load_goodput(intervals=100)
    finally:
        store.close()


def test_saves_made_while_one_is_written_are_merged_in_order(tmp_path):
    path = str(tmp_path / "m.sqlite")
    store = GatedStore(path)
    writer = GoodputWriter(store)
    store.gate.clear()  # the disk is slow: the first write waits
    writer.submit(state(1), [incident(1)], [interval(1)], at=1.0)
    assert store.entered.wait(10)
    # two more sweeps save meanwhile; submit returns at once
    writer.submit(state(2), [incident(2)], [interval(2), interval(3)], at=2.0)
    writer.submit(state(3), [incident(3, closed=True)], [interval(4)], at=3.0)
    store.gate.set()
    assert writer.flush(10) and writer.error is None
    assert store.calls == 2  # the first, then the other two as one
    assert writer.close(10)
    got_state, incs, ivs = stored(path)
    assert got_state == state(3)  # the newest state
    assert [i["sweep"] for i in incs] == [3] and incs[0]["closed_at"] == 9.0
    assert [iv["start"] for iv in ivs] == [1.0, 2.0, 3.0, 4.0]  # every interval, in order


def test_a_failed_write_is_kept_and_written_with_the_next_save(tmp_path):
    path = str(tmp_path / "m.sqlite")
    store = GatedStore(path)
    writer = GoodputWriter(store)
    store.fail_next = 1
    writer.submit(state(1), [incident(1)], [interval(1)], at=1.0)
    # failed: kept, not tried again until something new comes (a flush would try it again,
    # and whether it ran before or after the failure was a race: this test failed once)
    failed_first(writer)
    assert "disk is full" in writer.error and store.calls == 1
    assert stored(path) == (None, [], [])
    writer.submit(state(2), [], [interval(2)], at=2.0)
    assert writer.flush(10) and writer.error is None and store.calls == 2
    got_state, incs, ivs = stored(path)
    assert got_state == state(2) and [i["sweep"] for i in incs] == [1]
    assert [iv["start"] for iv in ivs] == [1.0, 2.0]
    assert writer.close(10)


def test_close_writes_what_is_pending_and_refuses_more(tmp_path):
    path = str(tmp_path / "m.sqlite")
    store = GatedStore(path)
    writer = GoodputWriter(store)
    store.fail_next = 2  # the first write and the flush's try again
    writer.submit(state(1), [], [interval(1)], at=1.0)
    # the first write has failed before the flush: else the flush's wait would see that failure
    # and return, and the try again would fall to close (a failing run of this test, once)
    failed_first(writer)
    assert not writer.flush(10) and store.calls == 2
    assert writer.close(10)  # the stop's last try writes it
    assert stored(path)[0] == state(1) and [iv["start"] for iv in stored(path)[2]] == [1.0]
    try:
        writer.submit(state(2), [], [], at=2.0)
    except RuntimeError as e:
        assert "closed" in str(e)
    else:
        raise AssertionError("a closed writer took a save")


def test_a_write_that_keeps_failing_is_reported_at_close(tmp_path, caplog):
    store = GatedStore(str(tmp_path / "m.sqlite"))
    writer = GoodputWriter(store)
    store.fail_next = 5
    writer.submit(state(1), [], [interval(1)], at=1.0)
    failed_first(writer)
    assert not writer.flush(10) and store.calls == 2  # the first try and the flush's
    assert not writer.close(10)
    assert store.calls == 3  # and the close's: no loop in between
    assert "not written at stop" in caplog.text and "disk is full" in caplog.text
