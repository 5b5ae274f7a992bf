"""The monitor's goodput ledger, resumed from ``--state``, accounted every sweep and saved by a
:class:`GoodputWriter` on a thread of its own, so a sweep never waits for SQLite's fsync. A
failure is logged once per new error and shown in ``/v1/goodput``; it never stops the sweep."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..evidence.view import ClusterView
from ..store import Store
from .ledger import GoodputConfig, GoodputLedger
from .model import SNAPSHOT_VERSION

log = logging.getLogger(__name__)

SAVE_S = 5.0  # the state is written at least this often (what a crash loses)


class GoodputAccount:
    """The ledger the monitor keeps; each sweep's account goes to ``metrics`` (MonitorMetrics)."""

    def __init__(self, store: Store, expected_groups: int | None, interval_s: float,
                 metrics: Any) -> None:
        self.store, self.metrics = store, metrics
        self.error: str | None = None
        self._lock = threading.Lock()  # the loop updates the ledger, the API reads it
        gcfg = GoodputConfig(expected_groups=expected_groups, max_gap_s=max(30.0, 10 * interval_s))
        self.job = metrics.job  # the job its metrics name, kept in the snapshot
        try:
            state, *rows = store.load_goodput()
            version = (state or {}).get("version", SNAPSHOT_VERSION)
            job = (state or {}).get("job", self.job)  # an older snapshot's: this job's
            other = None  # an older or newer monitor's, or another job's: not read, replaced
            if version != SNAPSHOT_VERSION:
                other = f"version {version}, this monitor's {SNAPSHOT_VERSION}"
            elif job != self.job:
                other, state = f"job {job}'s, this monitor's {self.job}", None
            if other:
                log.warning("goodput ledger not resumed from %s: its snapshot is %s; totals and "
                            "ratios start afresh (its incidents and intervals stay), and the "
                            "next save replaces it", store.path, other)
            self.ledger = GoodputLedger.restore(gcfg, state, *rows)
            if job != self.job:  # its kills are no incidents of this job
                self.ledger.incidents.seen_evictions.update(
                    d["id"] for d in store.decisions(limit=100, decision="evict"))
        except Exception as e:  # a malformed saved state must not stop the monitor starting
            log.warning("goodput ledger not resumed from %s (%s: %s): starting afresh",
                        store.path, type(e).__name__, e)
            # the old rows stay: new incidents are numbered after them
            self.ledger = GoodputLedger.restore(gcfg, None, [{"id": store.last_goodput_incident()}], [])
        self._saved_at = float("-inf")
        self._save_s = 0.0  # the last save's seconds (snapshot and write)
        self._writer = GoodputWriter(store)

    def account(self, evidence: ClusterView, findings: list[dict[str, Any]], now: float,
                publish: bool = True) -> None:
        """Split this sweep's wall time; never raises. Without ``publish`` (a standby shard:
        another monitor exports the same slice) the metrics are left as they are."""
        try:
            with self._lock:
                acct = self.ledger.update(evidence, findings,
                                          self.store.decisions(limit=100, decision="evict"),
                                          now)
                self._save(now)
            if publish:
                self.metrics.add_goodput(acct)
            self.error = None
        except Exception as e:  # the ledger must never end monitoring
            error = f"{type(e).__name__}: {e}"
            if error != self.error:
                log.exception("goodput ledger failed")
            self.error = error

    def _save(self, now: float, force: bool = False) -> None:
        """Save when an incident changed, else every SAVE_S but at most once per 20 of a
        save's own durations (the snapshot grows with the groups)."""
        incidents, intervals = self.ledger.unsaved()
        every = max(SAVE_S, 20 * self._save_s)
        if force or incidents or now - self._saved_at >= every:
            t = time.perf_counter()
            self._writer.submit({**self.ledger.snapshot(), "job": self.job}, incidents,
                                intervals, now)
            self.ledger.saved()  # the writer keeps it until written
            self._saved_at = now
            self._save_s = time.perf_counter() - t + self._writer.write_s

    def to_json(self, incidents: int = 50, intervals: int = 200) -> dict[str, Any]:
        with self._lock:
            out = self.ledger.to_json(incidents=incidents, intervals=intervals)
        out["error"] = self.error or self._writer.error
        return out

    def close(self, now: float) -> None:
        """Save everything and wait for the writer (a failure is logged)."""
        try:
            with self._lock:
                self._save(now, force=True)
        except Exception:
            log.exception("could not save the goodput ledger")
        self._writer.close(timeout=30)


@dataclass
class _Save:
    state: dict[str, Any]
    incidents: dict[int, dict[str, Any]]  # id -> its newest row
    intervals: list[dict[str, Any]]
    at: float

    def then(self, later: _Save) -> _Save:
        return _Save(later.state, {**self.incidents, **later.incidents},
                     self.intervals + later.intervals, later.at)


class GoodputWriter:
    """Writes saves to ``store`` in order, on a daemon thread started with the first one; saves
    made meanwhile are merged, and a failed one is kept and tried again with the next."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._cv = threading.Condition()
        self._pending: _Save | None = None  # submitted, not written yet (merged)
        self._writing = False
        self._held = False  # the pending save failed: tried again on the next submit or flush
        self._closed = False
        self._thread: threading.Thread | None = None
        self.error: str | None = None  # why the last write failed
        self.write_s = 0.0  # the last successful write's wall seconds

    def submit(self, state: dict[str, Any], incidents: list[dict[str, Any]],
               intervals: list[dict[str, Any]], at: float) -> None:
        """Queue one save; raises RuntimeError once closed."""
        save = _Save(state, {i["id"]: i for i in incidents}, list(intervals), at)
        with self._cv:
            if self._closed:
                raise RuntimeError("the goodput writer is closed")
            self._pending = save if self._pending is None else self._pending.then(save)
            self._held = False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="lightkeeper-goodput-writer")
                self._thread.start()
            self._cv.notify_all()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every save is written, trying a failed one again: False if one failed
        again or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        with self._cv:
            self._held = False
            self._cv.notify_all()
            while (self._pending is not None and not self._held) or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            return self._pending is None and not self._writing

    def close(self, timeout: float = 30.0) -> bool:
        """Flush, then stop the thread: False (and logged) if a save was not written."""
        done = self.flush(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=max(1.0, timeout))
        if not done:
            log.error("goodput ledger save not written at stop: %s", self.error or "timed out")
        return done

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (self._pending is None or self._held):
                    self._cv.wait()
                if self._closed:
                    return
                save, self._pending, self._writing = self._pending, None, True
            t = time.perf_counter()
            error = None
            try:
                self.store.save_goodput(save.state, list(save.incidents.values()),
                                        save.intervals, at=save.at)
            except Exception as e:  # kept and tried again
                error = f"{type(e).__name__}: {e}"
            with self._cv:
                self._writing = False
                if error is None:
                    if self.error:
                        log.warning("goodput ledger saved again")
                    self.error, self.write_s = None, time.perf_counter() - t
                else:
                    if error != self.error:
                        log.warning("goodput ledger save failed (kept, tried again with the "
                                    "next): %s", error)
                    self.error = error
                    self._held = self._pending is None  # tried again at once if a save came
                    self._pending = save if self._pending is None else save.then(self._pending)
                self._cv.notify_all()
