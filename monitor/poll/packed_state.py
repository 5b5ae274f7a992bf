"""A ``/v1/state`` answer as the monitor keeps it: its two number lists as rank_wire bytes,
the bulk of every rank's kept answer (docs/scaling.md). Nothing here raises.
"""

from __future__ import annotations

from typing import Any

from rank_wire import PACKED_FORMAT, SECONDS_SIZE, TIMING_ROW, decode, pack_rows, pack_seconds


def _kept(value: Any, served_packed: bool, record: int, pack) -> bytes:
    if type(value) is list:
        return pack(value)
    if served_packed and type(value) is str:
        return decode(value, record) or b""  # not the format: nothing served
    return b""


def pack_state(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (a parsed ``/v1/state`` answer) with its two number lists as bytes, in place."""
    served = doc.get("packed")
    served = type(served) is int and served == PACKED_FORMAT  # not True: a bool is no format
    # the monitor's own keys of a torch-only rank: one claimed by a rank's answer would choose
    # the URL the monitor POSTs to for its stacks, or skip its Flight Recorder
    doc.pop("stacks_url", None)
    doc.pop("torch_only", None)
    timing = doc.get("timing")
    if type(timing) is dict:
        timing["recent"] = _kept(timing.get("recent"), served, TIMING_ROW.size, pack_rows)
    if "recent_step_seconds" in doc:
        doc["recent_step_seconds"] = _kept(doc["recent_step_seconds"], served, SECONDS_SIZE,
                                           pack_seconds)
    return doc
