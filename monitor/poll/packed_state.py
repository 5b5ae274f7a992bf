"""A ``/v1/state`` answer as the monitor keeps it: its two lists of numbers packed into bytes.

A rank's answer carries two lists of numbers the monitor reads only in bulk: ``timing.recent``
(a dict per step: the step and its four seconds) and ``recent_step_seconds`` (floats). Parsed
from JSON they are most of an answer's Python objects (a member's: ~80 of ~120), and at 100,000
ranks the monitor reads ~15,000 answers a sweep and keeps the last of every rank
(docs/scaling.md). The poller packs each into one ``bytes`` as it parses the answer
(:func:`pack_state`, from :func:`monitor.poll.poller.judge_body`; with the poller process, where the
monitor reads its answers, :meth:`monitor.poll.poll_process.PollHandle.result`). Packing costs
about what the smaller answers save the view and the detectors downstream; what it buys is
memory: 27 % less at 100,000 ranks (docs/scaling.md, round 14).

- ``timing.recent`` (a non-empty list): one :data:`TIMING_ROW` per row, in the order served:
  the step (``int64``), then ``step_s``, ``compute_s``, ``wait_cross_s`` and ``wait_group_s``
  (``float64``). A row that is not an object, or whose step is not an integer (``true``/
  ``false`` are not), is left out; a row whose four seconds are not all finite numbers >= 0
  keeps its step and has NaN for all four (``monitor.detect.detectors.timing_rows`` skips its seconds
  and still knows its step was served, as it does reading the JSON row).
- ``recent_step_seconds`` (a list): the values that are numbers >= 0, in order, a ``float64``
  each (what :meth:`monitor.evidence.view.RankView.recent_steps` keeps of the list).

A list that cannot be packed (a step beyond ``int64``, a number beyond a float) is left as
served. Every reader takes both forms, so an answer packed and one as served (a test's state, a
poll of another path) read the same; nothing else in the answer changes, and nothing here raises
on a rank's answer.

A WorkerServer asked ``?packed=1`` packs the two lists itself, in this same format, and serves
each as a base64 string (worker_server/packed.py; the answer says ``"packed": 1``): the monitor
then only decodes the two strings into bytes, ~5 us less per answer than parsing the lists and
packing them (docs/scaling.md, round 15). A served string is decoded only in those two places,
and only in an answer that says ``"packed": 1``; one that is not strict base64 of whole records
is left as served, a string, which every reader skips as it skips any malformed list. So bytes
in the answer are only ever where the monitor put them: nowhere else can a rank place any.
"""

from __future__ import annotations

import binascii
import math
import struct
import sys
from array import array
from collections.abc import Mapping
from typing import Any

# one packed timing row: the step, then its four seconds in TIMING_KEYS' order
TIMING_ROW = struct.Struct("<q4d")
TIMING_KEYS = ("step_s", "compute_s", "wait_cross_s", "wait_group_s")
_NAN = math.nan
_INF = math.inf
_FLOATS = {float}
_SWAP = sys.byteorder != "little"  # array's floats are the machine's order
PACKED_FORMAT = 1  # an answer's "packed" value for the lists served packed (worker_server/packed.py)
_A2B = binascii.a2b_base64


def served_packed(value: str, record: int) -> bytes | None:
    """A list a rank served packed (base64 of ``record``-byte records) as bytes; None where it
    is not strict base64 of whole records."""
    try:
        out = _A2B(value, strict_mode=True)
    except (binascii.Error, ValueError):  # not base64; a non-ASCII character
        return None
    return out if len(out) % record == 0 else None


def pack_timing_rows(rows: list) -> bytes | None:
    """``timing.recent`` packed (see the module docstring); None: leave it as served."""
    pack = TIMING_ROW.pack
    out = []
    try:
        for row in rows:
            if type(row) is not dict and not isinstance(row, Mapping):
                continue
            step = row.get("step")
            if type(step) is not int:
                continue
            a, b, c, d = (row.get("step_s"), row.get("compute_s"), row.get("wait_cross_s"),
                          row.get("wait_group_s"))
            if type(a) is float and type(b) is float and type(c) is float and type(d) is float:
                if 0 <= a < _INF and 0 <= b < _INF and 0 <= c < _INF and 0 <= d < _INF:
                    out.append(pack(step, a, b, c, d))
                    continue
            elif all(type(v) in (int, float) and 0 <= v < _INF for v in (a, b, c, d)):
                out.append(pack(step, float(a), float(b), float(c), float(d)))
                continue
            out.append(pack(step, _NAN, _NAN, _NAN, _NAN))  # malformed seconds: step kept
    except (struct.error, OverflowError):  # a step beyond int64, an int beyond a float
        return None
    return b"".join(out)


def kept_step_seconds(values: list) -> list[float]:
    """The step times a served ``recent_step_seconds`` list counts: its numbers >= 0, as floats,
    in order (OverflowError: an integer beyond a float). Packed (:func:`pack_step_seconds`) or
    read as served (:meth:`monitor.evidence.view.RankView.recent_steps`), the same values."""
    if values and set(map(type, values)) == _FLOATS and min(values) >= 0 \
            and (total := sum(values)) == total:
        # the usual list: JSON floats, none negative and none NaN (a NaN in the sum fails the
        # equality; min() alone can miss it), kept as they are
        return list(values)
    return [float(v) for v in values if isinstance(v, (int, float)) and v >= 0]


def pack_step_seconds(values: list) -> bytes | None:
    """``recent_step_seconds`` packed (see the module docstring); None: leave it as served."""
    try:
        packed = array("d", kept_step_seconds(values))
    except OverflowError:  # an integer beyond a float
        return None
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def pack_state(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (a parsed ``/v1/state`` answer) with its number lists packed, in place: lists
    packed here, strings a rank served packed (``"packed": 1``) decoded."""
    served = doc.get("packed")
    served = type(served) is int and served == PACKED_FORMAT  # not True: a bool is no format
    timing = doc.get("timing")
    if type(timing) is dict:
        rows = timing.get("recent")
        if type(rows) is str:
            if served and (packed := served_packed(rows, TIMING_ROW.size)) is not None:
                # none served: the empty list, which readers read as the JSON one (last_step)
                timing["recent"] = packed or []
        elif type(rows) is list and rows:
            packed = pack_timing_rows(rows)
            if packed is not None:
                timing["recent"] = packed
    values = doc.get("recent_step_seconds")
    if type(values) is str:
        if served and (packed := served_packed(values, 8)) is not None:
            doc["recent_step_seconds"] = packed
    elif type(values) is list:
        packed = pack_step_seconds(values)
        if packed is not None:
            doc["recent_step_seconds"] = packed
    return doc


def step_seconds(packed: bytes) -> list[float]:
    """A packed ``recent_step_seconds`` as its floats (those >= 0: checked again, as a JSON
    list's reader does)."""
    values = array("d", packed[:len(packed) - len(packed) % 8])
    if _SWAP:
        values.byteswap()
    out = values.tolist()
    if out and (min(out) < 0 or (total := sum(out)) != total):
        out = [v for v in out if v >= 0]
    return out
