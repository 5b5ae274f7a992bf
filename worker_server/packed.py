"""``/v1/state?packed=1``: the answer's two lists of numbers served packed, base64 in the JSON.

A rank's answer carries two lists of numbers a monitor reads only in bulk: ``timing.recent``
(an object per step: the step and its four seconds) and ``recent_step_seconds``. At 100,000
ranks one monitor parses ~15,000 answers a second, and these lists are most of each answer's
JSON values (docs/scaling.md). Asked ``?packed=1``, the WorkerServer serves each as one base64
string of fixed-size little-endian records, which a JSON parser reads as one string and the
monitor turns into bytes in one call (monitor/poll/packed_state.py); the answer then says
``"packed": 1`` (this format). Everything else in the answer is as served without it, and a
rank that does not know the parameter (an older WorkerServer) ignores it and serves the lists.

- ``timing.recent``: one :data:`TIMING_ROW` per step, in the order the lists serve them (oldest
  first): the step (``int64``), then ``step_s``, ``compute_s``, ``wait_cross_s`` and
  ``wait_group_s`` (``float64``; NaN where a row has no number for it).
- ``recent_step_seconds``: one ``float64`` per step time, in order (NaN for one that is not a
  number).

Base64 is the standard alphabet with padding (RFC 4648, section 4). A curl of ``/v1/state``
(no parameter) stays readable: the packed form is only served to whoever asks for it.
"""

from __future__ import annotations

import math
import struct
from array import array
from base64 import b64encode
from sys import byteorder
from typing import Any

PACKED_FORMAT = 1  # the value of the answer's "packed" key
TIMING_ROW = struct.Struct("<q4d")  # the step, then TIMING_KEYS' seconds
TIMING_KEYS = ("step_s", "compute_s", "wait_cross_s", "wait_group_s")
_SWAP = byteorder != "little"  # array's floats are in the machine's order


def _number(value: Any) -> float:
    """``value`` as a float64; NaN for what is not a number or does not fit one."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            pass
    return math.nan


def pack_timing_rows(rows: list[dict[str, Any]]) -> str:
    """``timing.recent`` packed: a :data:`TIMING_ROW` per row (an object) whose step is an
    integer; struct.error for a step beyond ``int64``."""
    pack = TIMING_ROW.pack
    out = []
    for row in rows:
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            out.append(pack(step, *(_number(row.get(k)) for k in TIMING_KEYS)))
    return b64encode(b"".join(out)).decode("ascii")


def pack_step_seconds(values: list[float]) -> str:
    """``recent_step_seconds`` packed: a ``float64`` per value."""
    packed = array("d", map(_number, values))
    if _SWAP:
        packed.byteswap()
    return b64encode(packed.tobytes()).decode("ascii")


def state_packed(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (a ``/v1/state`` document) with its two number lists packed, in place, and
    ``"packed": PACKED_FORMAT`` added. A list that does not fit the format (a step beyond
    ``int64``) is left a list, which a monitor reads as it reads any answer's."""
    timing = doc.get("timing")
    if isinstance(timing, dict) and isinstance(timing.get("recent"), list):
        try:
            timing["recent"] = pack_timing_rows(timing["recent"])
        except struct.error:  # a step beyond int64: the rows stay a list
            pass
    if isinstance(doc.get("recent_step_seconds"), list):
        doc["recent_step_seconds"] = pack_step_seconds(doc["recent_step_seconds"])
    doc["packed"] = PACKED_FORMAT
    return doc
