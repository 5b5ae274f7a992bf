"""A sweep's audit-log writes and failures at scale: thousands of ranks that stop answering at
once are kept in one transaction (a restarted monitor finds them all), a sweep that raises (a
full ``--state``) leaves Python's collector on, and the rows it could not write are written by
the next sweep. The ranks are a poller of the test's own (no sockets)."""

from __future__ import annotations

import gc
import sqlite3
import time

import pytest

from monitor.config import MonitorConfig
from monitor.poll.poller import STATE_PATH, RankPoll
from monitor.service import Monitor
from monitor.store import Store
from tests.support.monitor_sim import rank_state

SIZE = 8  # ranks a replica group


class Ranks:
    """A poller whose ranks all answer a ``/v1/state``, or (``down``) all refuse."""

    def __init__(self) -> None:
        self.down = False
        self.max_idle = 0

    def sweep(self, urls, path=STATE_PATH, timeout_s=None, max_bytes=None, queries=None):
        now = time.time()
        out = {}
        for u in urls:
            if self.down or path != STATE_PATH:
                out[u] = RankPoll(u, False, reason="connection", error="refused", at=now)
                continue
            r = int(u.rsplit("/", 1)[1])
            state = rank_state(r, r // SIZE, now=now)
            state.update(group_rank=r % SIZE, group_world_size=SIZE)
            out[u] = RankPoll(u, True, state, at=now)
        return out

    def close(self) -> None:
        pass


def monitor(path: str, n: int) -> tuple[Monitor, Ranks]:
    urls = [f"http://127.0.0.1:1/r/{r}" for r in range(n)]
    mon = Monitor(MonitorConfig(port=0, targets=urls, state_path=path, leader_polling="off",
                                max_targets=n))
    ranks = Ranks()
    mon.polling.poller.close()
    mon.polling.poller = ranks
    return mon, ranks


@pytest.fixture
def statements(monkeypatch) -> list[str]:
    """Every SQL statement the monitor's database connections run, COMMITs included."""
    seen: list[str] = []
    connect = sqlite3.connect

    class Traced(sqlite3.Connection):
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            self.set_trace_callback(seen.append)

    monkeypatch.setattr(sqlite3, "connect", lambda *a, **k: connect(*a, **k, factory=Traced))
    return seen


def commits_keeping(statements: list[str]) -> int:
    """Commits of transactions that kept an unreachable rank."""
    n, keeping = 0, False
    for s in statements:
        if "INTO unreachable_ranks" in s:
            keeping = True
        elif s.strip().upper() == "COMMIT" and keeping:
            n, keeping = n + 1, False
    return n


def test_thousands_of_ranks_lost_at_once_are_kept_in_one_commit(tmp_path, statements):
    n = 2000
    path = str(tmp_path / "state.sqlite")
    mon, ranks = monitor(path, n)
    try:
        mon.sweep_once()
        ranks.down = True
        statements.clear()
        view = mon.sweep_once()
        assert sum(not r.reachable for r in view.ranks.values()) == n
        assert commits_keeping(statements) == 1
    finally:
        mon.stop()
    store = Store(path)  # as a restarted monitor reads it
    try:
        kept = store.unreachable()
    finally:
        store.close()
    assert sorted(kept) == sorted(view.ranks)
    since, state, trust = kept["http://127.0.0.1:1/r/9"]
    assert (state["replica_group"], state["group_rank"], state["rank"]) == (1, 1, 9)
    assert since is not None and trust["reason"] == "no_lighthouse"


def test_a_failed_sweep_at_scale_leaves_the_collector_on(tmp_path, monkeypatch):
    """From 10,000 targets the collector is off during a sweep; a sweep that raises (the state
    file full: every sweep raises, the monitor goes on) turns it on again, and what it could
    not keep is kept by the next sweep that can."""
    path = str(tmp_path / "state.sqlite")
    mon, ranks = monitor(path, 2 * SIZE)
    was_enabled = gc.isenabled()
    try:
        mon.sweep_once()
        mon.polling.end_sweep(10_000, time.perf_counter())  # a sweep of 10,000 ended: frozen
        assert gc.isenabled()
        ranks.down = True
        keep = mon.store.keep_unreachable

        def full(*a, **k):
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(mon.store, "keep_unreachable", full)
        for _ in range(2):
            with pytest.raises(sqlite3.OperationalError):
                mon.sweep_once()
            assert gc.isenabled()
        assert mon.store.unreachable() == {}
        monkeypatch.setattr(mon.store, "keep_unreachable", keep)  # the disk has room again
        mon.sweep_once()
        assert gc.isenabled()
        assert len(mon.store.unreachable()) == 2 * SIZE
    finally:
        mon.stop()
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def test_a_sweep_ending_after_the_monitor_stopped_leaves_nothing_frozen(tmp_path):
    """stop() waits 30 s for the loop, then closes the poller (which thaws the collector); a
    sweep still running then ends after it and must not freeze its survivors again."""
    mon, _ = monitor(str(tmp_path / "state.sqlite"), 2 * SIZE)
    was_enabled = gc.isenabled()
    try:
        mon.sweep_once()
        mon.polling.end_sweep(10_000, time.perf_counter())  # frozen from now on
        mon.polling.collect(mon.view)  # the loop's next sweep begins: the collector off
        assert not gc.isenabled()
        mon.polling.close()  # stop() gave up waiting for the loop
        assert gc.isenabled() and gc.get_freeze_count() == 0
        mon.polling.end_sweep(10_000, time.perf_counter())  # that sweep ends after
        assert gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        mon.stop()
        gc.unfreeze()
        if was_enabled:
            gc.enable()
