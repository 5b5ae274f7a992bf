"""The wire form of a rank's per-step numbers: one spec for the WorkerServer that writes them
(worker_server/packed.py) and the monitor that reads them (monitor/poll/packed_state.py), which
never import each other. Imports no project package. :mod:`rank_wire.recorders` is another
shape both sides share: a rank's two Flight Recorders read as one dump; :mod:`rank_wire.auth`
how the monitor signs its calls to one rank.

``/v1/state`` carries two lists of numbers a monitor reads only in bulk: ``timing.recent`` (an
object per step: the step and its four seconds) and ``recent_step_seconds``. Asked
``?packed=1``, a WorkerServer serves each as one base64 string (RFC 4648, section 4) of
little-endian records and says ``"packed": PACKED_FORMAT``; the monitor keeps the records as
bytes (docs/scaling.md):

- ``timing.recent``: one :data:`TIMING_ROW` per row, oldest first: the step (int64), then
  :data:`TIMING_KEYS`' seconds (float64);
- ``recent_step_seconds``: one float64 per step time, in order.

Only valid numbers are packed, and a reader keeps only valid records of what it is served: a
row is valid when its step is an integer within int64 (not a bool) and its four seconds are
finite numbers >= 0 (:func:`valid_row`); a step time when it is such a number.

``timing.recent_quorum`` serves, beside the rows (whose record stays as it is, so an older
monitor reads an upgraded rank), each row's ``wait_quorum_s`` when the rank timed one: objects
``{"step", "wait_quorum_s"}``, packed one :data:`QUORUM_RECORD` each; a record is valid when
its step is as a row's and its seconds a valid number (:func:`valid_quorum`).
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
import sys
from array import array
from typing import Any

PACKED_FORMAT = 1  # the value of an answer's "packed" key
# the monitor's poller says it is one (a WorkerServer's finish() waits for a monitor's read)
MONITOR_AGENT = "lightkeeper-monitor"
TIMING_KEYS = ("step_s", "compute_s", "wait_cross_s", "wait_group_s")
TIMING_ROW = struct.Struct("<q4d")  # the step, then TIMING_KEYS' seconds
QUORUM_KEY = "recent_quorum"  # timing's key of the quorum waits
QUORUM_RECORD = struct.Struct("<qd")  # a step, then its wait_quorum_s
# per-step rows a rank serves (``recent``) and the monitor keeps per rank: with steps of ms,
# ranks polled a few steps apart still share the straggler's window
TIMING_ROWS = 32
RECENT_STEPS = 64  # step times of ``recent_step_seconds`` a rank serves and the monitor keeps
SECONDS_SIZE = 8  # one float64 step time
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_INF, _FLOAT_MAX = math.inf, sys.float_info.max
_SWAP = sys.byteorder != "little"  # array's floats are in the machine's order


def valid_seconds(value: Any) -> bool:
    """A finite number >= 0 that fits a float64 (not a bool, not NaN)."""
    if isinstance(value, float):
        return 0.0 <= value < _INF
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _FLOAT_MAX


def _valid_step(step: Any) -> bool:
    return isinstance(step, int) and not isinstance(step, bool) and INT64_MIN <= step <= INT64_MAX


def valid_row(step: Any, seconds: tuple | list) -> bool:
    """A timing row worth keeping: an int64 step (not a bool) and four valid seconds."""
    return _valid_step(step) and len(seconds) == len(TIMING_KEYS) \
        and all(map(valid_seconds, seconds))


def valid_quorum(step: Any, seconds: Any) -> bool:
    """A quorum wait worth keeping: an int64 step (not a bool) and valid seconds."""
    return _valid_step(step) and valid_seconds(seconds)


def pack_rows(rows: list) -> bytes:
    """The valid rows of a served ``timing.recent`` (objects), one TIMING_ROW each."""
    out = []
    for row in rows:
        if isinstance(row, dict):
            step, seconds = row.get("step"), [row.get(k) for k in TIMING_KEYS]
            if valid_row(step, seconds):
                out.append(TIMING_ROW.pack(step, *map(float, seconds)))
    return b"".join(out)


def pack_quorum(items: list) -> bytes:
    """The valid records of a served ``timing.recent_quorum`` (objects), one QUORUM_RECORD each."""
    out = []
    for item in items:
        if isinstance(item, dict):
            step, seconds = item.get("step"), item.get("wait_quorum_s")
            if valid_quorum(step, seconds):
                out.append(QUORUM_RECORD.pack(step, float(seconds)))
    return b"".join(out)


def pack_seconds(values: list) -> bytes:
    """The valid values of a served ``recent_step_seconds``, one float64 each."""
    kept = [float(v) for v in values if valid_seconds(v)]
    return struct.pack(f"<{len(kept)}d", *kept)


def unpack_seconds(blob: bytes) -> list[float]:
    """The valid step times of packed ``recent_step_seconds`` bytes, in order."""
    values = array("d", blob[:len(blob) - len(blob) % SECONDS_SIZE])
    if _SWAP:
        values.byteswap()
    out = values.tolist()
    # one check of the whole list, not one per value: the view reads ~15,000 of these a sweep
    # at 100,000 ranks (a NaN makes the sum fail the comparison)
    if out and not (min(out) >= 0 and sum(out) < _INF):
        out = [v for v in out if 0 <= v < _INF]
    return out


def encode(blob: bytes) -> str:
    """Records as served: base64, standard alphabet, padded."""
    return base64.b64encode(blob).decode("ascii")


def decode(text: str, record: int) -> bytes | None:
    """Served base64 back to records of ``record`` bytes; None when it is not strict base64 of
    whole records."""
    try:
        out = binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError):  # not base64; a non-ASCII character
        return None
    return out if len(out) % record == 0 else None
