"""Where incident bundles are kept (monitor/act/bundles.py, BundleStore): a folder shared by
two monitors' audit logs, and a relative ``--bundle-dir`` read after a restart elsewhere."""

from __future__ import annotations

import os
import sqlite3
import tarfile

from monitor.act.bundles import BundleStore
from monitor.config import BundleConfig
from monitor.store import Store

NOW = 1_800_000_000.0


def write(bs: BundleStore, payload: bytes) -> str:
    bid = bs.new_id("evict", "hang", 1)
    assert bs.write(bid, {"format": "x"}, [("blob", payload)],
                    {"at": NOW, "trigger": "evict", "summary": {}}) is not None
    return bid


def blob(path: str) -> bytes:
    with tarfile.open(path) as tar:
        [m] = [m for m in tar if m.name.endswith("/blob")]
        return tar.extractfile(m).read()


def test_two_monitors_sharing_a_folder_never_overwrite_each_others_bundle(tmp_path):
    """Two jobs' --state files side by side share incidents/; the same eviction in the same
    second (group 1, hang) must not take the same file."""
    stores = [Store(str(tmp_path / f"job{i}.sqlite")) for i in (0, 1)]
    try:
        a, b = (BundleStore(BundleConfig(), str(tmp_path / "incidents"), s, clock=lambda: NOW)
                for s in stores)
        ida, idb = write(a, b"job0 evidence"), write(b, b"job1 evidence")
        assert ida != idb
        assert blob(a.path(ida)) == b"job0 evidence" and blob(b.path(idb)) == b"job1 evidence"
    finally:
        for s in stores:
            s.close()


def test_a_relative_bundle_dir_still_serves_after_a_restart_elsewhere(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    (tmp_path / "other").mkdir()
    state = str(tmp_path / "state.sqlite")
    monkeypatch.chdir(tmp_path / "run")
    store = Store(state)
    try:
        bid = write(BundleStore(BundleConfig(), "incidents", store, clock=lambda: NOW),
                    b"kept")
    finally:
        store.close()
    monkeypatch.chdir(tmp_path / "other")  # the same audit log, started from another folder
    store = Store(state)
    try:
        bs = BundleStore(BundleConfig(), str(tmp_path / "run" / "incidents"), store,
                         clock=lambda: NOW)
        path = bs.path(bid)
        assert path is not None and blob(path) == b"kept"
    finally:
        store.close()


def test_a_bundle_the_audit_log_cannot_index_leaves_no_file_behind(tmp_path):
    """The audit log cannot be written (here its table is moved away by another connection; a
    full disk, or a write lock held past the store's 10 s wait, does the same, slower): the
    bundle is not kept as a file nobody lists or prunes, and the error is said."""
    state = str(tmp_path / "state.sqlite")
    store = Store(state)
    other = sqlite3.connect(state, isolation_level=None)
    try:
        bs = BundleStore(BundleConfig(), str(tmp_path / "incidents"), store, clock=lambda: NOW)
        bid = bs.new_id("evict", "hang", 1)
        other.execute("ALTER TABLE bundles RENAME TO bundles_away")
        assert bs.write(bid, {"format": "x"}, [("blob", b"x")],
                        {"at": NOW, "trigger": "evict", "summary": {}}) is None
        assert os.listdir(tmp_path / "incidents") == []
        assert bs.error.startswith(f"cannot write bundle {bid}: no such table"), bs.error
        other.execute("ALTER TABLE bundles_away RENAME TO bundles")
        bid = write(bs, b"kept")
        assert os.listdir(tmp_path / "incidents") == [f"{bid}.tar.gz"] and bs.error is None
    finally:
        other.close()
        store.close()


def test_a_bundle_alone_over_the_total_cap_is_not_deleted_as_it_is_written(tmp_path):
    """--bundle-total-bytes below one bundle: the older ones go, the one just written (its
    eviction's decision names it) stays and downloads."""
    store = Store(str(tmp_path / "state.sqlite"))
    try:
        bs = BundleStore(BundleConfig(total_bytes=1000), str(tmp_path / "incidents"), store,
                         clock=lambda: NOW)
        first = write(bs, os.urandom(3000))
        second = write(bs, os.urandom(3000))
        assert [r["id"] for r in bs.list()] == [second] and bs.path(first) is None
        assert len(blob(bs.path(second))) == 3000
    finally:
        store.close()
