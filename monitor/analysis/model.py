"""What cross-rank analysis needs of one rank's Flight Recorder dump (columnar.normalize makes
it): per process group, collectives by ``collective_seq_id``; torchft incarnations keyed by quorum.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

NAN = float("nan")
SCHEDULED, STARTED, COMPLETED = 0, 1, 2

# Ops whose sizes legitimately differ between ranks (variable splits, root-only buffers):
# only op and dtypes are compared for them.
SIZES_MAY_DIFFER = frozenset({
    "all_to_all", "all_to_all_single", "all_to_all_v_single", "alltoall", "alltoall_base", "gather",
    "scatter", "all_gather_v", "reduce_scatter_v", "split", "new_window",
})


class DumpFormatError(ValueError):
    """The input is not a Flight Recorder dump this analyzer understands."""


class GroupKey(NamedTuple):
    """One process group across ranks: ``replica_group`` for a group inside a torchft replica
    group; ``quorum_id`` and ``group_rank`` for one torchft cross-group incarnation."""

    pg: str
    replica_group: int | None = None
    quorum_id: int | None = None
    group_rank: int | None = None

    def label(self) -> str:
        name = repr(self.pg) if self.pg == "" else self.pg
        if self.quorum_id is not None:
            return f"{name} (torchft quorum {self.quorum_id}, group_rank {self.group_rank})"
        if self.replica_group is not None:
            return f"{name} (replica group {self.replica_group})"
        return name

    def order(self) -> tuple:
        """A sort key: the name, then replica group, quorum and group rank (None first)."""
        return (self.pg, *(-1 if v is None else v for v in self[1:]))


MAX_LISTED_PARTS = 64


class Signature(NamedTuple):
    """What a rank enqueued at one sequence id (sizes None where they may differ between ranks;
    op ``"coalesced"`` with its ``parts``)."""

    op: str
    input_sizes: tuple | None
    output_sizes: tuple | None
    input_dtypes: tuple
    output_dtypes: tuple
    parts: tuple = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.op, "input_sizes": _lists(self.input_sizes),
                               "output_sizes": _lists(self.output_sizes), "input_dtypes": list(self.input_dtypes),
                               "output_dtypes": list(self.output_dtypes)}
        if self.parts:  # the first parts, with their count: a run can have thousands
            out["parts"] = [p.to_dict() for p in self.parts[:MAX_LISTED_PARTS]]
            out["parts_total"] = len(self.parts)
        return out


def _lists(sizes: tuple | None) -> list | None:
    return None if sizes is None else [list(s) for s in sizes]


@dataclass
class GroupTrace:
    """One rank's collectives in one group, dense from ``first_seq`` (holes: ``None`` sigs);
    ``created_ns`` on the rank's own clock (0: unknown), ``duration_ms`` NaN when unknown."""

    first_seq: int
    sigs: list[int | None] = field(default_factory=list)
    states: list[int] = field(default_factory=list)
    created_ns: list[int] = field(default_factory=list)
    duration_ms: list[float] = field(default_factory=list)

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.sigs) - 1


@dataclass
class RankTrace:
    """Everything the engine needs from one rank's dump."""

    rank: int
    flavour: str  # "nccl" (timing filled in) or "gloo"
    host: str | None
    oldest_record_id: int | None  # None when the buffer holds no entries
    signatures: list[Signature]
    groups: dict[GroupKey, GroupTrace]
    members: dict[GroupKey, tuple[int, ...]]  # declared membership (pg_config, incarnations)
    incarnations: dict[GroupKey, int]  # torchft incarnation -> its first_record_id on this rank
    last_entry: dict[str, Any] | None  # the newest entry: what the rank was last doing
    is_torchft: bool = False
    dump_time_ns: int | None = None  # when the dump was taken, its own clock (the WorkerServer's)
    # pg_status (:func:`status_fields`): NCCL's last enqueued sequence id by group name, where
    # its keys (pg ids) are pg_config's names; whether it shows any collective enqueued, and
    # (NCCL) completed
    enqueued: dict[str, int] = field(default_factory=dict)
    status_enqueued: bool = False
    status_completed: bool = False
    kept_pg: str | None = None  # a filtered dump's ``filter.pg``: only that group's entries kept
    cut: bool = False  # a ``?last=`` dump that may have left older entries out
    pg_listed: bool = True  # pg_config lists a group: its recorder was on (off: none listed)
    # a WorkerServer's dump (``filter`` or ``incarnations``): torch was asked for onlyActive, as
    # it says (one with no entry at all is a recorder reset, unfinished entries too: not
    # onlyActive); None: torch's own, read by its shape
    only_active: bool | None = None

    @property
    def wrapped(self) -> bool:
        # record ids start at 0 per process
        return bool(self.oldest_record_id)


def status_fields(dump: Mapping[str, Any]) -> dict[str, Any]:
    """:class:`RankTrace`'s fields read from a dump's ``pg_status`` and ``filter``. pg_status is
    keyed by pg id: read by group name only where those ids are pg_config's names (NCCL names
    its groups by a count of them), and only on NCCL (``comm_lib_version``): gloo's counts
    more than the collectives it records."""
    status = dump.get("pg_status")
    last: dict[str, int] = {}
    completed = False
    if isinstance(status, Mapping):
        for key, st in status.items():
            if isinstance(st, Mapping):
                if (n := _count(st.get("last_enqueued_collective"))) is not None:
                    last[str(key)] = n
                completed = completed or (_count(st.get("last_completed_collective")) or 0) > 0
    nccl = isinstance(lib := dump.get("comm_lib_version"), str) and bool(lib)
    config = dump.get("pg_config")
    names = {str(c.get("name", k)) if isinstance(c, Mapping) else str(k) for k, c in config.items()} \
        if isinstance(config, Mapping) else set()
    filt = dump.get("filter")
    # the WorkerServer's (it always adds incarnations): onlyActive only where it says so
    own = isinstance(filt, Mapping) or isinstance(dump.get("incarnations"), list)
    filt = filt if isinstance(filt, Mapping) else {}
    kept = filt.get("pg")
    # ?last=N keeps the newest N: where entries_total (every group's) counts more, older ones may
    # be left out (read from the filter alone: the C reader's header holds no entries)
    cap, total = _count(filt.get("last")), _count(filt.get("entries_total"))
    return {"enqueued": last if nccl and last and set(last) == names else {},
            "status_enqueued": any(n > 0 for n in last.values()), "status_completed": nccl and completed,
            "kept_pg": None if kept is None else str(kept),
            "cut": cap is not None and (total is None or total > cap),
            # adapted_dump drops torchft's groups from pg_config, gloo's only one ('') too
            "pg_listed": bool(names) or filt.get("pg_listed") is True,
            # without the flag: not asked for, or an older server's
            "only_active": (filt.get("only_active") is True or dump.get("only_active") is True)
            if own else None}


def _count(raw: Any) -> int | None:
    # torch writes them as strings in JSON, as ints in pickles
    # ASCII only: str.isdigit() also passes "²", which int() refuses
    if isinstance(raw, str) and raw.isascii() and raw.removeprefix("-").isdigit():
        return int(raw)
    return raw if isinstance(raw, int) and not isinstance(raw, bool) else None


def looks_nccl(first: Mapping[str, Any], last: Mapping[str, Any]) -> bool:
    """From a dump's first and last entries: gloo leaves every entry "scheduled" with zero
    timestamps, NCCL fills them in."""
    return any(e.get("state") != "scheduled" or e.get("time_discovered_started_ns") for e in (first, last))


def _sizes(raw: Any) -> tuple:
    return tuple(tuple(s) if isinstance(s, list | tuple) else (s,) for s in (raw or ()))


def make_signature(op: str, ins: Any, outs: Any, idt: Any, odt: Any) -> Signature:
    if op in SIZES_MAY_DIFFER:
        return Signature(op, None, None, tuple(idt or ()), tuple(odt or ()))
    return Signature(op, _sizes(ins), _sizes(outs), tuple(idt or ()), tuple(odt or ()))
