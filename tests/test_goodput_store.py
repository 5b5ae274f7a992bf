"""The goodput ledger's state through the monitor's real store (monitor/store.py, an SQLite file
reopened as a restarted monitor reopens its ``--state``): the snapshot (version 3: columns and
runs, msgspec-encoded) resumes to the same ledger, and files written before the runs (version 2:
one dict per unsettled slice) and before the columns (version 1: per-group dicts, ``json.dumps``
text, as an older store wrote it) still resume to it.

The ledger comes from test_goodput_columns' random job (groups joining and leaving, incidents,
evictions, gaps, pending slow time), checked there against the per-group reference ledger."""

from __future__ import annotations

import json
import sqlite3

import pytest

from monitor.goodput import GoodputConfig, GoodputLedger, snapshot_rows
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


def test_a_state_file_written_before_the_columns_still_resumes(ledger, tmp_path):
    path = str(tmp_path / "old.sqlite")
    stored(path, ledger)
    # the state row as the store wrote it before: version 1's per-group dicts, json.dumps
    old = snapshot_rows(ledger.snapshot())
    assert old["version"] == 1 and isinstance(old["groups"], dict) and old["groups"]
    db = sqlite3.connect(path)
    with db:
        db.execute("UPDATE goodput_state SET data=? WHERE id=1", (json.dumps(old),))
    db.close()
    store = Store(path)
    state, incidents, intervals = store.load_goodput()
    store.close()
    assert state == json.loads(json.dumps(old))
    resumed = GoodputLedger.restore(GoodputConfig(**CFG), state, incidents, intervals)
    assert resumed.to_json() == ledger.to_json()
    # the same state; its unsettled slices, stored one by one, are runs of one now
    assert snapshot_rows(resumed.snapshot()) == snapshot_rows(ledger.snapshot())


def test_a_state_written_before_the_runs_still_resumes(ledger, tmp_path):
    """Version 2 (the previous store's): the columns, but each unsettled slice a dict."""
    state, incidents, intervals = stored(str(tmp_path / "v2.sqlite"), ledger)
    assert any(len(r["groups"]) > 1 for r in state["unsettled"])  # a run to take apart
    v2 = {**state, "version": 2, "unsettled": snapshot_rows(state)["unsettled"]}
    resumed = GoodputLedger.restore(GoodputConfig(**CFG), v2, incidents, intervals)
    assert resumed.to_json() == ledger.to_json()
    assert snapshot_rows(resumed.snapshot()) == snapshot_rows(ledger.snapshot())
    assert len(resumed.snapshot()["unsettled"]) == len(v2["unsettled"])  # runs of one


def test_a_snapshot_of_an_unknown_version_starts_afresh(ledger):
    state = {**ledger.snapshot(), "version": 4}
    resumed = GoodputLedger.restore(GoodputConfig(**CFG), state, [], [])
    assert resumed.to_json() == GoodputLedger(GoodputConfig(**CFG)).to_json()


def test_an_empty_ledger_round_trips(tmp_path):
    led = GoodputLedger(GoodputConfig(**CFG))
    state, incidents, intervals = stored(str(tmp_path / "m.sqlite"), led)
    resumed = GoodputLedger.restore(GoodputConfig(**CFG), state, incidents, intervals)
    assert resumed.snapshot() == led.snapshot() and resumed.to_json() == led.to_json()
