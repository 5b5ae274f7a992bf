"""The goodput ledger's state through the monitor's real store (monitor/store.py, an SQLite file
reopened as a restarted monitor reopens its ``--state``): the snapshot (version 3: columns and
runs, msgspec-encoded) resumes to the same ledger; another version starts a fresh one.

The ledger comes from test_goodput_columns' random job (groups joining and leaving, incidents,
evictions, gaps, pending slow time), checked there against the per-group reference ledger."""

from __future__ import annotations

import json
import sqlite3

import pytest

from monitor.goodput import GoodputConfig, GoodputLedger
from monitor.store import Store
from tests.test_goodput_columns import run

CFG = {"baseline_min_samples": 3, "horizon_s": 6.0, "pace_window_s": 1.5, "expected_groups": 7}


@pytest.fixture(scope="module")
def ledger() -> GoodputLedger:
    led, covered = run(1, 150, **CFG)
    assert covered["incidents"] and covered["paced"], covered  # something to resume
    assert led.open_intervals and led.incidents
    return led


def stored(path: str, led: GoodputLedger) -> tuple[dict, list, list]:
    """What a monitor stores of ``led`` (everything: its incidents and intervals unsaved so
    far), read back by a new Store on the same file."""
    store = Store(path)
    incidents = [i.to_store() for i in led.incidents.values()]
    intervals = [dict(vars(iv)) for iv in led.intervals]
    store.save_goodput(led.snapshot(), incidents, intervals, at=led.last_at)
    store.close()
    store = Store(path)
    try:
        return store.load_goodput()
    finally:
        store.close()


def test_a_restarted_ledger_equals_the_one_saved(ledger, tmp_path):
    state, incidents, intervals = stored(str(tmp_path / "m.sqlite"), ledger)
    assert state["version"] == 3
    resumed = GoodputLedger.restore(GoodputConfig(**CFG), state, incidents, intervals)
    assert resumed.to_json() == ledger.to_json()
    assert resumed.snapshot() == ledger.snapshot()
    # the row stays JSON text, as the previous store wrote it
    db = sqlite3.connect(str(tmp_path / "m.sqlite"))
    [(kind, data)] = db.execute("SELECT typeof(data), data FROM goodput_state").fetchall()
    db.close()
    assert kind == "text" and json.loads(data) == state


def test_a_snapshot_of_an_unknown_version_starts_afresh(ledger):
    for version in (2, 4):
        state = {**ledger.snapshot(), "version": version}
        resumed = GoodputLedger.restore(GoodputConfig(**CFG), state, [], [])
        assert resumed.to_json() == GoodputLedger(GoodputConfig(**CFG)).to_json()


def test_an_empty_ledger_round_trips(tmp_path):
    led = GoodputLedger(GoodputConfig(**CFG))
    state, incidents, intervals = stored(str(tmp_path / "m.sqlite"), led)
    resumed = GoodputLedger.restore(GoodputConfig(**CFG), state, incidents, intervals)
    assert resumed.snapshot() == led.snapshot() and resumed.to_json() == led.to_json()


@pytest.mark.parametrize("version", [2, 999])
def test_a_snapshot_of_another_version_is_said_not_dropped_in_silence(tmp_path, caplog, version):
    """An older monitor's snapshot (an upgrade) or a newer one's (a rollback) is not read: the
    totals and ratio start afresh, which was documented as a warning but said nothing."""
    import logging

    from monitor.api.metrics import MonitorMetrics
    from monitor.goodput.account import GoodputAccount

    store = Store(str(tmp_path / "state.sqlite"))
    try:
        store.save_goodput({"version": version, "since": 1.0}, [], [], at=2.0)
        with caplog.at_level(logging.WARNING, logger="monitor.goodput.account"):
            GoodputAccount(store, None, 1.0, MonitorMetrics("j"))
    finally:
        store.close()
    said = [r.getMessage() for r in caplog.records]
    assert any(f"its snapshot is version {version}, this monitor's 3" in m for m in said), said
