"""Disk and filesystem trouble under a running monitor (docs/monitor.md, ``--state``): the
audit log's folder deleted, its file replaced. In-process, with the real SQLite ``Store``."""

from __future__ import annotations

import os
import shutil
import sqlite3

import pytest

from monitor.store import StateInUse, Store, hold_state


def evict(store: Store, replica_id: str) -> int:
    return store.add_decision(replica_group=1, replica_id=replica_id, decision="evict",
                              reason="hang", status="sent")


def test_a_state_folder_deleted_while_in_use_is_written_back_with_its_lock(tmp_path):
    """The state's folder removed under a running monitor (a cleanup job, a volume emptied):
    the next write puts the whole audit log back at its path, with its lock, so a restart
    still knows every kill and a second monitor is still refused. Before, the monitor wrote
    on into the deleted file: a restart forgot every eviction (and evicted again) and a
    second monitor could take the same state."""
    folder = tmp_path / "state"
    path = str(folder / "monitor.sqlite")
    lock = hold_state(path)
    store = Store(path)
    try:
        evict(store, "replica_group_1:a")
        shutil.rmtree(folder)
        evict(store, "replica_group_2:b")
        assert store.evicted_replica_ids() == {"replica_group_1:a", "replica_group_2:b"}
        with pytest.raises(StateInUse):
            hold_state(path)
        assert (folder / "monitor.sqlite.lock").read_text() == str(os.getpid())
    finally:
        store.close()
        os.close(lock)
    again = Store(path)
    try:
        assert again.evicted_replica_ids() == {"replica_group_1:a", "replica_group_2:b"}
    finally:
        again.close()


def test_a_state_file_replaced_under_the_monitor_is_not_written_over(tmp_path):
    """Another file put in the state's place (a backup restored by hand) is not overwritten
    by the running monitor: its writes fail and say why, and that file stays as it was."""
    path = str(tmp_path / "monitor.sqlite")
    store = Store(path)
    try:
        evict(store, "replica_group_1:a")
        os.rename(path, str(tmp_path / "moved.sqlite"))
        other = sqlite3.connect(path)
        other.execute("CREATE TABLE mine (x)")
        other.commit()
        other.close()
        with pytest.raises(sqlite3.OperationalError, match="replaced by another file"):
            evict(store, "replica_group_2:b")
        tables = sqlite3.connect(path).execute("SELECT name FROM sqlite_master").fetchall()
        assert tables == [("mine",)]
    finally:
        store.close()
