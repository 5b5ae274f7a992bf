"""The goodput ledger's tables (monitor.goodput): its state, incidents and settled intervals,
written a sweep at a time; a mixin of Store on its _lock, _db, _kept, _rows and _pruning."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec

GOODPUT_INTERVALS_KEPT = 100_000  # settled badput intervals kept in the file (oldest dropped)


def goodput_json_text(doc: dict[str, Any]) -> str:
    """A goodput row's JSON text; msgspec for speed (benchmarks/bench_goodput_snapshot.py)."""
    return msgspec.json.encode(doc).decode()


class GoodputTables:
    def save_goodput(self, state: dict[str, Any], incidents: list[dict[str, Any]],
                     intervals: list[dict[str, Any]], at: float | None = None) -> None:
        """The ledger's state, its changed incidents and its newly settled intervals, in one
        transaction (a crash keeps the previous sweep's consistent state)."""
        now = time.time() if at is None else at
        with self._lock:
            self._kept()
            with self._db:
                self._db.execute("INSERT OR REPLACE INTO goodput_state (id, at, data) "
                                 "VALUES (1, ?, ?)", (now, goodput_json_text(state)))
                self._db.executemany(
                    "INSERT OR REPLACE INTO goodput_incidents (id, updated_at, closed, data) "
                    "VALUES (?,?,?,?)",
                    [(i["id"], now, 1 if i.get("closed_at") is not None else 0,
                      goodput_json_text(i)) for i in incidents])
                if incidents:
                    self._db.execute(*self._pruning("goodput_incidents",
                                                    max(i["id"] for i in incidents)))
                if intervals:
                    self._db.executemany(
                        "INSERT INTO goodput_intervals (start, end, replica_group, cause, "
                        "incident, data) VALUES (?,?,?,?,?,?)",
                        [(iv["start"], iv["end"], iv.get("replica_group"), iv["cause"],
                          iv.get("incident"), goodput_json_text(iv)) for iv in intervals])
                    self._db.execute(
                        "DELETE FROM goodput_intervals WHERE id <= "
                        "(SELECT MAX(id) FROM goodput_intervals) - ?", (GOODPUT_INTERVALS_KEPT,))

    def load_goodput(self, incidents: int = 200, intervals: int = 2000
                     ) -> tuple[dict[str, Any] | None, list[dict[str, Any]], list[dict[str, Any]]]:
        """(state or None, every open incident plus the newest ``incidents`` closed ones, the
        newest ``intervals`` settled intervals oldest first)."""
        with self._lock:
            row = self._db.execute("SELECT data FROM goodput_state WHERE id=1").fetchone()
            incs = self._db.execute(
                "SELECT data FROM goodput_incidents WHERE closed=0 UNION ALL "
                "SELECT data FROM (SELECT data FROM goodput_incidents WHERE closed=1 "
                "ORDER BY id DESC LIMIT ?)", (incidents,)).fetchall()
            ivs = self._db.execute("SELECT data FROM goodput_intervals ORDER BY id DESC LIMIT ?",
                                   (intervals,)).fetchall()
        return (json.loads(row[0]) if row else None,
                sorted((json.loads(r[0]) for r in incs), key=lambda i: i["id"]),
                [json.loads(r[0]) for r in reversed(ivs)])

    def last_goodput_incident(self) -> int:
        return self._rows("SELECT MAX(id) FROM goodput_incidents")[0][0] or 0
