"""The audit rows of aborts (monitor/act/survivors.py: survivors told to abort a collective a
gone group holds them in) on the real state file: one a stopped monitor left ``sending`` is
``interrupted`` at the restart, and sent ones are pruned like any finished decision."""

from __future__ import annotations

import sqlite3

from monitor.api.app import create_app
from monitor.config import MonitorConfig
from monitor.service import Monitor
from monitor.store import Store


def _abort(store: Store, sent: bool) -> int:
    """An abort row as Survivors._abort writes it: ``sending``, then ``sent`` once told."""
    did = store.add_decision(replica_group=1, replica_id="gone", decision="abort",
                             reason="peer_gone", detail="told", status="sending")
    if sent:
        store.update_decision(did, status="sent")
    return did


def test_an_abort_left_sending_by_a_stopped_monitor_is_interrupted_at_restart(tmp_path):
    """Before: only kills were turned ``interrupted``; the abort stayed ``sending`` for good."""
    state = str(tmp_path / "state.sqlite")
    store = Store(state)
    _abort(store, sent=False)  # the monitor stopped while telling the survivors
    store.close()
    mon = Monitor(MonitorConfig(port=0, state_path=state, job="sim"))
    try:
        rows = create_app(mon).test_client().get("/v1/evictions?decision=abort").get_json()
        assert [r["status"] for r in rows] == ["interrupted"]
    finally:
        mon.stop()


def test_sent_aborts_are_pruned_and_unjudged_kills_kept(tmp_path, monkeypatch):
    """Before: an abort row marked ``sent`` was never dropped (the retention rule kept every
    ``sent`` row, whatever its decision), so a long job's aborts grew the file for good.
    Driven with a bound of 2 rows (``AUDIT_KEPT``) instead of 20,000."""
    import monitor.store
    monkeypatch.setattr(monitor.store, "AUDIT_KEPT", 2)
    state = str(tmp_path / "state.sqlite")
    store = Store(state)
    try:
        kill = store.add_decision(replica_group=2, replica_id="k", decision="evict",
                                  reason="dead_rank", status="sending")
        store.update_decision(kill, status="sent")  # not judged yet: kept
        for _ in range(5):
            _abort(store, sent=True)
    finally:
        store.close()
    with sqlite3.connect(state) as db:
        rows = db.execute("SELECT decision, status FROM decisions ORDER BY id").fetchall()
    assert rows == [("evict", "sent"), ("abort", "sent"), ("abort", "sent")]
