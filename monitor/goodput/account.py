"""The monitor's goodput ledger, resumed from ``--state``, accounted every sweep and saved by a
:class:`GoodputWriter`. A failure is logged once per new error and shown in ``/v1/goodput``;
it never stops the sweep.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..evidence.view import ClusterView
from ..store import Store
from .ledger import GoodputConfig, GoodputLedger
from .writer import GoodputWriter

log = logging.getLogger(__name__)

SAVE_S = 5.0  # the state is written at least this often (what a crash loses)


class GoodputAccount:
    """``metrics``: the monitor's MonitorMetrics."""

    def __init__(self, store: Store, expected_groups: int | None, interval_s: float,
                 metrics: Any) -> None:
        self.store, self.metrics = store, metrics
        self.error: str | None = None
        self._lock = threading.Lock()  # the loop updates the ledger, the API reads it
        self.ledger = self._restore(GoodputConfig(expected_groups=expected_groups,
                                                  max_gap_s=max(30.0, 10 * interval_s)))
        self._saved_at = float("-inf")
        self._save_s = 0.0  # the last save's seconds (snapshot and write)
        self._writer = GoodputWriter(store)

    def _restore(self, gcfg: GoodputConfig) -> GoodputLedger:
        """The ledger as the last run left it (a fresh one, logged, if unreadable)."""
        try:
            return GoodputLedger.restore(gcfg, *self.store.load_goodput())
        except (ValueError, TypeError, KeyError) as e:
            log.warning("goodput ledger not resumed from %s (%s: %s): starting afresh",
                        self.store.path, type(e).__name__, e)
            return GoodputLedger(gcfg)

    def account(self, evidence: ClusterView, findings: list[dict[str, Any]], now: float) -> None:
        """Split this sweep's wall time; never raises."""
        try:
            with self._lock:
                acct = self.ledger.update(evidence, findings,
                                          self.store.decisions(limit=100, evictions_only=True),
                                          now)
                self._save(now)
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
            self._writer.submit(self.ledger.snapshot(), incidents, intervals, now)
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
