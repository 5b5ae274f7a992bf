"""A rank's two Flight Recorders read as one dump: one rule for the WorkerServer that serves a
CUDA rank's ``/v1/fr_trace`` and the monitor that reads torch's own debug server.

torch keeps two recorders: the generic one (``_dump_fr_trace_json``: gloo, ...) and, on CUDA
builds, ProcessGroupNCCL's (``_dump_nccl_trace_json``). Each numbers its process groups and its
records from 0, and a group with both backends (the default group of ``cpu:gloo,cuda:nccl``)
records in both with sequence ids of its own. :func:`merge` makes one dump of them:

- the generic recorder's ``pg_id`` s, ``pg_status`` keys and record ids move up by
  :data:`SHIFT`, past NCCL's, and a generic group named like one of NCCL's is renamed
  ``<name>:cpu``;
- NCCL's record ids move up by one. The two recorders reach back differently far (NCCL's fills
  far faster): with a record id 0 the merged dump would pass for a whole history, one whose
  ring buffer never wrapped, and a group's absence from it would prove a rank never entered
  it. NCCL's ids keep their order and their distance from a torchft incarnation's first record
  (its recorder's, as :func:`moved_record_id` gives it), so what a GPU job's dump says of its
  NCCL groups is read as before;
- entries are in the order they were enqueued (``time_created_ns``), every other key NCCL's.

Imports no project package.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

SHIFT = 1 << 40  # the generic recorder's ids, moved past any of NCCL's
NCCL_RECORD_SHIFT = 1


# torchft's cross-group process group: '' for group rank 0 on gloo, torchft_quorum_<q>_rank_<r>
# in 0.2 and torchft_<q>_rank_<r> in nightly (<q>: the communicator id, which the Manager sets to
# the quorum)
_TORCHFT_PG = re.compile(r"(?:|torchft_(?:quorum_)?\d+_rank_\d+)")


def is_torchft_pg_name(name: str | None) -> bool:
    """Whether ``name`` is a process group torchft made across replica groups."""
    return name is not None and _TORCHFT_PG.fullmatch(name) is not None


def merge(generic: Mapping[str, Any] | None, nccl: Mapping[str, Any]) -> dict[str, Any]:
    """One dump of both recorders' (``generic`` None: NCCL's alone, its record ids moved all the
    same). Entries that are not objects are left out."""
    generic = _mapping(generic)
    config = _mapping(nccl.get("pg_config"))
    nccl_entries = [_moved(e, pg_name(e), 0, NCCL_RECORD_SHIFT) for e in _entries(nccl)]
    taken = set(map(str, config)) | {pg_name(e) for e in nccl_entries} - {None}
    generic_entries = []
    for e in _entries(generic):
        name = pg_name(e)
        generic_entries.append(_moved(e, f"{name}:cpu" if name in taken else name, SHIFT, SHIFT))
    out = {**generic, **{k: v for k, v in nccl.items()
                         if k not in ("entries", "pg_config", "pg_status")}}
    out["pg_config"] = {**{f"{k}:cpu" if str(k) in taken else k: v
                           for k, v in _mapping(generic.get("pg_config")).items()}, **config}
    out["pg_status"] = {**{_shifted(k, SHIFT): v
                           for k, v in _mapping(generic.get("pg_status")).items()},
                        **_mapping(nccl.get("pg_status"))}
    out["entries"] = sorted(generic_entries + nccl_entries, key=_created)
    return out


def moved_record_id(record_id: int, nccl: bool) -> int:
    """Where a recorder's record id stands in a merged dump."""
    return record_id + (NCCL_RECORD_SHIFT if nccl else SHIFT)


def _entries(dump: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    entries = dump.get("entries")
    return [e for e in entries if isinstance(e, Mapping)] if isinstance(entries, list) else []


def _moved(e: Mapping[str, Any], name: str | None, pg_shift: int,
           record_shift: int) -> dict[str, Any]:
    out = dict(e)
    if "pg_id" in e:
        out["pg_id"] = _shifted(e["pg_id"], pg_shift)
    if name is not None and name != pg_name(e):
        out["process_group"] = [name, *e["process_group"][1:]]
    if "record_id" in e:
        out["record_id"] = _shifted(e["record_id"], record_shift)
    return out


def pg_name(e: Mapping[str, Any]) -> str | None:
    """An entry's process group name (``process_group[0]``), None when it has none."""
    pg = e.get("process_group")
    if isinstance(pg, (list, tuple)) and pg and isinstance(pg[0], str):
        return pg[0]
    return None


def _shifted(value: Any, shift: int) -> Any:
    """``value`` (an int, or its decimal string as JSON keys are) moved by ``shift``; anything
    else as it is."""
    if isinstance(value, bool):
        return value
    try:
        moved = int(value) + shift
    except (TypeError, ValueError):
        return value
    return str(moved) if isinstance(value, str) else moved


def _created(e: Mapping[str, Any]) -> int:
    t = e.get("time_created_ns")
    return t if isinstance(t, int) and not isinstance(t, bool) else 0


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}
