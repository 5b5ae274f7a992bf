"""The goodput ledger's saves on a thread of their own: a sweep never waits for SQLite's fsync.
A failed write is kept and tried again with the next save.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from monitor.store import Store

log = logging.getLogger("lightkeeper.monitor")


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
    """Writes saves to ``store`` in order, on a daemon thread started with the first one."""

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
            log.error("goodput ledger save not written at stop: %s",
                      self.error or "timed out")
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
                    self.error, self.write_s = None, time.perf_counter() - t
                else:
                    if error != self.error:
                        log.warning("goodput ledger save failed (kept, tried again with the "
                                    "next): %s", error)
                    self.error = error
                    # tried again at once if a save came meanwhile
                    self._held = self._pending is None
                    self._pending = save if self._pending is None else save.then(self._pending)
                self._cv.notify_all()
