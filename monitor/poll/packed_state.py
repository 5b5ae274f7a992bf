"""A ``/v1/state`` answer as the monitor keeps it: its two number lists as rank_wire bytes.

``timing.recent`` and ``recent_step_seconds`` are most of an answer's Python objects, and at
100,000 ranks the monitor keeps the last answer of every rank (docs/scaling.md). The poller
converts both once, where it parses the answer (:func:`monitor.poll.poller.judge_body`): a
list is packed (its valid numbers, rank_wire's rule), a string a rank served packed (the answer
says ``"packed": 1``) is decoded, anything else becomes empty bytes. Every reader downstream
(the view's step times, the detectors' step memory) reads that one form; nothing here raises
on a rank's answer, and nothing else in the answer changes.
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
    timing = doc.get("timing")
    if type(timing) is dict:
        timing["recent"] = _kept(timing.get("recent"), served, TIMING_ROW.size, pack_rows)
    if "recent_step_seconds" in doc:
        doc["recent_step_seconds"] = _kept(doc["recent_step_seconds"], served, SECONDS_SIZE,
                                           pack_seconds)
    return doc
