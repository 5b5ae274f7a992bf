"""A ``/v1/state`` answer as the monitor keeps it: only the fields docs/CONTRACTS.md lists, each
bounded, its two number lists as rank_wire bytes. Nothing here raises. :data:`STATE_DECODER`
builds no other key (1 MiB of ``{}`` would parse to tens of MB of objects); an answer it refuses
is parsed as JSON and cut to the same fields and sizes by :func:`bounded_state`.
"""

from __future__ import annotations

from itertools import islice
from typing import Annotated, Any, TypedDict

import msgspec

from rank_wire import (
    PACKED_FORMAT,
    QUORUM_KEY,
    QUORUM_RECORD,
    RECENT_STEPS,
    SECONDS_SIZE,
    TIMING_ROW,
    TIMING_ROWS,
    decode,
    pack_quorum,
    pack_rows,
    pack_seconds,
)

NAME_CHARS = 256  # a host, job, replica id, version, phase or fault spec (DNS names: 253)
TEXT_CHARS = 1024  # a URL, an error
MAX_FAULTS = 64  # entries of ``faults`` and ``faults_struck_at``
_SHOWN = 8  # items kept of a value of the wrong shape: enough for valid_state to say what it is


def _b64_chars(n: int) -> int:
    return 4 * -(-n // 3)


_Name = Annotated[str, msgspec.Meta(max_length=NAME_CHARS)]
_Text = Annotated[str, msgspec.Meta(max_length=TEXT_CHARS)]
# compared whole with what the monitor knows (its --job, the Lighthouse's replica ids, a
# signature's identity): never cut short of a name torchft or a scheduler may make
_Ident = _Text
IDENTITY = ("job", "replica_id", "host", "node", "hostname", "slurm_job_id")
_Num = int | float


class _Row(TypedDict, total=False):
    step: int
    steps: int  # ``window``'s
    step_s: _Num
    compute_s: _Num
    wait_cross_s: _Num
    wait_group_s: _Num


class _Quorum(TypedDict, total=False):
    step: int
    wait_quorum_s: _Num


class _Waiting(TypedDict, total=False):
    scope: _Name
    seconds: _Num


class _Timing(TypedDict, total=False):
    last_step: _Row | None
    window: _Row | None
    waiting: _Waiting | None
    recent: (Annotated[list[_Row], msgspec.Meta(max_length=TIMING_ROWS)]
             | Annotated[str, msgspec.Meta(max_length=_b64_chars(TIMING_ROWS * TIMING_ROW.size))])
    recent_quorum: (
        Annotated[list[_Quorum], msgspec.Meta(max_length=TIMING_ROWS)]
        | Annotated[str, msgspec.Meta(max_length=_b64_chars(TIMING_ROWS * QUORUM_RECORD.size))])
    since: int
    clock: _Name


class _Device(TypedDict, total=False):
    type: _Name
    index: int | None
    uuid: _Name | None
    error: _Text | None


class _State(TypedDict, total=False):
    """The docs/CONTRACTS.md ``/v1/state`` table: a field added there is added here, or the
    monitor never sees it."""

    job: _Ident
    replica_group: int
    replica_id: _Ident | None
    group_rank: int
    group_world_size: int | None
    rank: int
    host: _Ident | None
    pid: int | None
    local_rank: int | None
    node: _Ident | None
    hostname: _Ident | None
    slurm_job_id: _Ident | None
    device: _Device | None
    worker_url: _Text | None
    step: int
    quorum_id: int
    num_participants: int
    participating: bool
    phase: _Name
    phase_since: _Num
    finished: bool
    stopped_by: _Name | None
    last_step_seconds: _Num | None
    last_step_at: _Num | None
    recent_step_seconds: (
        Annotated[list[_Num], msgspec.Meta(max_length=RECENT_STEPS)]
        | Annotated[str, msgspec.Meta(max_length=_b64_chars(RECENT_STEPS * SECONDS_SIZE))])
    commits: int
    commit_failures: int | None
    heals: int
    quorum_changes: int
    loss: _Num | None
    lighthouse: _Text | None
    torch_version: _Name | None
    torchft_version: _Name | None
    started_at: _Num | None
    faults: Annotated[list[_Name], msgspec.Meta(max_length=MAX_FAULTS)]
    faults_struck_at: Annotated[dict[_Name, _Num], msgspec.Meta(max_length=MAX_FAULTS)]
    timing: _Timing | None
    packed: int


# an answer of the contract's types and sizes; anything else raises msgspec.DecodeError
STATE_DECODER = msgspec.json.Decoder(_State)
STATE_FIELDS = frozenset(_State.__annotations__)
_TIMING_FIELDS = frozenset(_Timing.__annotations__)
_ROW_FIELDS = frozenset(_Row.__annotations__) | frozenset(_Waiting.__annotations__) \
    | frozenset(_Quorum.__annotations__)
_DEVICE_FIELDS = frozenset(_Device.__annotations__)
_LISTS = ("recent", QUORUM_KEY)  # timing's packed lists


def _scalar(v: Any) -> Any:
    """``v`` if a number, bool or null; a string cut to TEXT_CHARS; a list or object empty."""
    t = type(v)
    if t is str:
        return v[:TEXT_CHARS]
    return t() if t in (list, dict) else v


def _small(v: Any) -> Any:
    """``v`` cut to a bounded size: a string to TEXT_CHARS, a list or object to its first
    items, each a scalar."""
    t = type(v)
    if t is list:
        return [_scalar(x) for x in v[:_SHOWN]]
    if t is dict:
        return {k[:NAME_CHARS]: _scalar(x) for k, x in islice(v.items(), _SHOWN)}
    return _scalar(v)


def _fields(v: Any, keep: frozenset[str]) -> Any:
    """An object's ``keep`` fields, each bounded; anything else :func:`_small`."""
    if type(v) is not dict:
        return _small(v)
    return {k: _small(x) for k, x in v.items() if k in keep}


def bounded_state(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` cut to the contract's fields and sizes; a value of the wrong type is kept,
    shortened, for ``valid_state`` to name (the number lists are :func:`pack_state`'s)."""
    out: dict[str, Any] = {}
    for key, v in doc.items():
        if key not in STATE_FIELDS:
            continue
        if key == "timing" and type(v) is dict:
            v = {k: (x if k in _LISTS else _fields(x, _ROW_FIELDS))
                 for k, x in v.items() if k in _TIMING_FIELDS}
            for k in _LISTS:
                if type(v.get(k)) is list:  # rows of the wrong shape pack to nothing
                    v[k] = [_fields(r, _ROW_FIELDS) for r in v[k][-TIMING_ROWS:]]
        elif key == "device":
            v = _fields(v, _DEVICE_FIELDS)
        elif key == "faults" and type(v) is list:
            # the newest: the strikes a finding is timed from
            v = [x[:NAME_CHARS] if type(x) is str else _scalar(x) for x in v[-MAX_FAULTS:]]
        elif key == "faults_struck_at" and type(v) is dict:
            v = {k[:NAME_CHARS]: _scalar(x) for k, x in list(v.items())[-MAX_FAULTS:]}
        elif key == "recent_step_seconds" and type(v) is list:
            v = [_scalar(x) for x in v[-RECENT_STEPS:]]
        elif key != "recent_step_seconds":  # a packed string: pack_state keeps its newest
            v = _small(v)
            if type(v) is str and key not in ("worker_url", "lighthouse", *IDENTITY):
                v = v[:NAME_CHARS]
        out[key] = v
    return out


def _kept(value: Any, served_packed: bool, record: int, pack, most: int) -> bytes:
    if type(value) is list:
        return pack(value[-most:])
    if served_packed and type(value) is str:
        return (decode(value, record) or b"")[-most * record:]  # not the format: nothing served
    return b""


def pack_state(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (a parsed ``/v1/state`` answer) with its number lists as bytes (the newest the
    monitor keeps of each), in place."""
    served = doc.get("packed")
    served = type(served) is int and served == PACKED_FORMAT  # not True: a bool is no format
    # the monitor's own keys of a torch-only rank: one claimed by a rank's answer would choose
    # the URL the monitor POSTs to for its stacks, or skip its Flight Recorder
    doc.pop("stacks_url", None)
    doc.pop("torch_only", None)
    timing = doc.get("timing")
    if type(timing) is dict:
        timing["recent"] = _kept(timing.get("recent"), served, TIMING_ROW.size, pack_rows,
                                 TIMING_ROWS)
        if QUORUM_KEY in timing:  # an older rank's answer has none: NaN to the detectors
            timing[QUORUM_KEY] = _kept(timing[QUORUM_KEY], served,
                                            QUORUM_RECORD.size, pack_quorum, TIMING_ROWS)
    if "recent_step_seconds" in doc:
        doc["recent_step_seconds"] = _kept(doc["recent_step_seconds"], served, SECONDS_SIZE,
                                           pack_seconds, RECENT_STEPS)
    return doc
