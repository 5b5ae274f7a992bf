"""``/v1/state?packed=1``: the answer's two number lists served packed, base64 in the JSON.

The format is rank_wire's (one spec with the monitor's reader): ``timing.recent`` as one
record per valid row, ``timing.recent_quorum`` as one per valid quorum wait,
``recent_step_seconds`` as one float64 per valid step time, and the answer says ``"packed": 1``. A monitor reads the lists in one call each instead of parsing
every number (docs/scaling.md). Everything else is as served without the parameter, so a curl
of plain ``/v1/state`` stays readable.
"""

from __future__ import annotations

from typing import Any

from rank_wire import (
    PACKED_FORMAT,
    QUORUM_KEY,
    TIMING_KEYS,
    encode,
    pack_quorum,
    pack_rows,
    pack_seconds,
)

__all__ = ["PACKED_FORMAT", "TIMING_KEYS", "pack_step_seconds", "pack_timing_rows",
           "state_packed"]


def pack_timing_rows(rows: list[dict[str, Any]]) -> str:
    """``timing.recent`` packed: its valid rows (rank_wire.valid_row), base64."""
    return encode(pack_rows(rows))


def pack_step_seconds(values: list[float]) -> str:
    """``recent_step_seconds`` packed: its valid step times, base64."""
    return encode(pack_seconds(values))


def state_packed(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (a ``/v1/state`` document) with its two number lists packed, in place, and
    ``"packed": PACKED_FORMAT`` added."""
    timing = doc.get("timing")
    if isinstance(timing, dict) and isinstance(timing.get("recent"), list):
        timing["recent"] = pack_timing_rows(timing["recent"])
    if isinstance(timing, dict) and isinstance(timing.get(QUORUM_KEY), list):
        timing[QUORUM_KEY] = encode(pack_quorum(timing[QUORUM_KEY]))
    if isinstance(doc.get("recent_step_seconds"), list):
        doc["recent_step_seconds"] = pack_step_seconds(doc["recent_step_seconds"])
    doc["packed"] = PACKED_FORMAT
    return doc
