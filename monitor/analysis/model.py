"""One rank's Flight Recorder dump, normalized into what cross-rank analysis needs.

:func:`normalize` turns a dump (a dict as ``_dump_fr_trace_json`` / ``_dump_nccl_trace_json`` /
``_dump_nccl_trace`` give it, format versions 2.x) into a :class:`RankTrace`: per process group,
the rank's collectives indexed by ``collective_seq_id`` (never by ``record_id``, which counts every
group's work on that rank), each reduced to a signature id (op, sizes, dtypes), a state code, the
enqueue time on the rank's own clock and, on NCCL, ``duration_ms``. Point-to-point entries are
skipped: they carry ``p2p_seq_id`` and are not matched here.

Process groups are keyed by :class:`GroupKey`. torchft's cross-replica-group process group is
rebuilt at every quorum with ``collective_seq_id`` restarting at 1; when the dump carries
``incarnations`` (docs/CONTRACTS.md), its entries are keyed by ``(quorum_id, group_rank)`` so that
entries of different incarnations are never matched. Groups inside a torchft replica group (dumps
with ``replica_group`` and ``group_world_size``) are scoped to that replica group and their
``pg_config`` ranks translated to global ranks. When a group's sequence ids restart without
incarnation data to tell the runs apart, only the newest run is kept, so that unrelated
collectives are not compared.

A dump that is not a Flight Recorder dump (not a dict, no ``entries`` list, an unknown major
version, entries without the keys every 2.x version writes) raises :class:`DumpFormatError`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, NamedTuple

__all__ = [
    "DumpFormatError",
    "GroupKey",
    "GroupTrace",
    "RankTrace",
    "Signature",
    "normalize",
    "NAN",
    "STATE_NAMES",
]

NAN = float("nan")
# state codes, ordered by progress
SCHEDULED, STARTED, COMPLETED = 0, 1, 2
STATE_NAMES = ("scheduled", "started", "completed")
_STATE_CODES = {"scheduled": SCHEDULED, "started": STARTED, "completed": COMPLETED}

# Ops whose sizes legitimately differ between ranks (variable splits, root-only buffers):
# only op and dtypes are compared for them.
SIZES_MAY_DIFFER = frozenset(
    {
        "all_to_all",
        "all_to_all_single",
        "all_to_all_v_single",
        "alltoall",
        "alltoall_base",
        "gather",
        "scatter",
        "all_gather_v",
        "reduce_scatter_v",
        "split",
        "new_window",
    }
)
_P2P_OPS = frozenset({"send", "recv"})


class DumpFormatError(ValueError):
    """The input is not a Flight Recorder dump this analyzer understands."""


class GroupKey(NamedTuple):
    """Identity of one process group across ranks.

    ``pg`` is the process-group name entries carry (``process_group[0]``); ``replica_group`` is
    set for groups local to a torchft replica group; ``quorum_id`` and ``group_rank`` are set for
    one incarnation of torchft's cross-replica-group process group.
    """

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


class Signature(NamedTuple):
    """What a rank enqueued at one sequence id; ranks of a group must agree on it.

    Sizes are ``None`` for ops whose sizes may legitimately differ between ranks. A coalesced
    collective's signature has op ``"coalesced"`` and its parts in ``parts``.
    """

    op: str
    input_sizes: tuple | None
    output_sizes: tuple | None
    input_dtypes: tuple
    output_dtypes: tuple
    parts: tuple = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "op": self.op,
            "input_sizes": _lists(self.input_sizes),
            "output_sizes": _lists(self.output_sizes),
            "input_dtypes": list(self.input_dtypes),
            "output_dtypes": list(self.output_dtypes),
        }
        if self.parts:
            out["parts"] = [p.to_dict() for p in self.parts]
        return out


def _lists(sizes: tuple | None) -> list | None:
    return None if sizes is None else [list(s) for s in sizes]


@dataclass
class GroupTrace:
    """One rank's collectives in one group, dense from ``first_seq`` (holes are ``None``).

    ``sigs[i]`` indexes the owning :class:`RankTrace`'s ``signatures`` table (after
    :func:`~monitor.analysis.engine.analyze` it indexes the shared table), ``states[i]`` is a state
    code, ``created_ns[i]`` the enqueue time on this rank's clock, ``duration_ms[i]`` NaN when
    unknown.
    """

    first_seq: int
    sigs: list[int | None] = field(default_factory=list)
    states: list[int] = field(default_factory=list)
    created_ns: list[int] = field(default_factory=list)
    duration_ms: list[float] = field(default_factory=list)
    restarted: bool = False  # sequence ids restarted; older runs were dropped

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.sigs) - 1


@dataclass
class RankTrace:
    """Everything the engine needs from one rank's dump, small enough to ship between processes."""

    rank: int
    version: str
    flavour: str  # "nccl" (timing filled in) or "gloo"
    host: str | None
    oldest_record_id: int | None  # None when the buffer holds no entries
    signatures: list[Signature]
    groups: dict[GroupKey, GroupTrace]
    members: dict[GroupKey, tuple[int, ...]]  # declared membership (pg_config, incarnations)
    incarnations: dict[GroupKey, int]  # torchft incarnation -> its first_record_id on this rank
    last_entry: dict[str, Any] | None  # the newest entry: what the rank was last doing
    p2p_entries: int = 0
    is_torchft: bool = False

    @property
    def wrapped(self) -> bool:
        """Whether the ring buffer has dropped entries (record ids start at 0 per process)."""
        return bool(self.oldest_record_id)


_CORE_KEYS = ("process_group", "profiling_name", "record_id")
_FAST_KEYS = (
    "process_group",
    "collective_seq_id",
    "profiling_name",
    "input_sizes",
    "output_sizes",
    "input_dtypes",
    "output_dtypes",
    "state",
    "time_created_ns",
    "record_id",
    "pg_id",
    "is_p2p",
)
_fast_get = itemgetter(*_FAST_KEYS)


def _slow_get(e: Mapping[str, Any]) -> tuple:
    seq = e.get("collective_seq_id", e.get("seq_id"))
    return (
        e["process_group"],
        seq,
        e["profiling_name"],
        e.get("input_sizes") or [],
        e.get("output_sizes") or [],
        e.get("input_dtypes") or [],
        e.get("output_dtypes") or [],
        e.get("state", "scheduled"),
        e.get("time_created_ns") or 0,
        e["record_id"],
        e.get("pg_id"),
        e.get("is_p2p"),
    )


def _version(dump: Mapping[str, Any]) -> str:
    version = dump.get("version")
    if not isinstance(version, str):
        raise DumpFormatError("no 'version' string: not a Flight Recorder dump")
    major, _, minor = version.partition(".")
    if major != "2" or not minor.isdigit():
        raise DumpFormatError(f"unsupported Flight Recorder format version {version!r} (need 2.x)")
    return version


def _parse_ranks(raw: Any) -> tuple[int, ...]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return ()
    if isinstance(raw, list | tuple) and all(isinstance(r, int) for r in raw):
        return tuple(raw)
    return ()


def _op_name(profiling_name: str) -> str:
    # "nccl:all_reduce", "gloo:send 0->1", "nccl:coalesced"
    name = profiling_name.rpartition(":")[2]
    return name.partition(" ")[0]


def normalize(dump: Mapping[str, Any], rank: int | None = None) -> RankTrace:
    """Normalize one rank's dump; ``rank`` is used when the dump has no ``rank`` key.

    Raises :class:`DumpFormatError` when ``dump`` is not a Flight Recorder dump.
    """
    if not isinstance(dump, Mapping):
        raise DumpFormatError(f"expected a dict, got {type(dump).__name__}")
    version = _version(dump)
    entries = dump.get("entries", [])
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise DumpFormatError("'entries' is not a list")
    own_rank = dump.get("rank", rank)
    if isinstance(own_rank, str) and own_rank.isdigit():
        own_rank = int(own_rank)
    if not isinstance(own_rank, int) or isinstance(own_rank, bool):
        raise DumpFormatError("no rank: the dump has no 'rank' key and none was given")

    scope: int | None = None
    offset = 0
    if isinstance(dump.get("replica_group"), int) and isinstance(dump.get("group_world_size"), int):
        scope = dump["replica_group"]
        offset = scope * dump["group_world_size"]

    members: dict[GroupKey, tuple[int, ...]] = {}
    pg_config = dump.get("pg_config") or {}
    if isinstance(pg_config, Mapping):
        for key, cfg in pg_config.items():
            if not isinstance(cfg, Mapping):
                continue
            ranks = _parse_ranks(cfg.get("ranks"))
            if ranks:
                name = str(cfg.get("name", key))
                members[GroupKey(name, scope)] = tuple(r + offset for r in ranks)

    # torchft incarnations: pg_id -> key, plus record-id ranges for those without a pg_id
    by_pg_id: dict[int, GroupKey] = {}
    ranged: list[tuple[int, str, GroupKey]] = []
    incarnations: dict[GroupKey, int] = {}
    raw_incarnations = dump.get("incarnations") or []
    if not isinstance(raw_incarnations, list):
        raise DumpFormatError("'incarnations' is not a list")
    starts: list[tuple[int, str, GroupKey, Any]] = []
    for inc in raw_incarnations:
        try:
            key = GroupKey(str(inc.get("pg_name", "")), None, int(inc["quorum_id"]), int(inc["group_rank"]))
            first = int(inc.get("first_record_id") or 0)
            global_ranks = _parse_ranks(inc.get("global_ranks"))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DumpFormatError(f"malformed incarnation {inc!r}") from exc
        incarnations[key] = first
        if global_ranks:
            members[key] = global_ranks
        starts.append((first, key.pg, key, inc.get("pg_id")))
        if inc.get("pg_id") is not None:
            by_pg_id[int(inc["pg_id"])] = key
    starts.sort(key=lambda s: s[0])
    for i, (first, pg_name, key, pg_id) in enumerate(starts):
        if pg_id is None:
            end = starts[i + 1][0] if i + 1 < len(starts) else math.inf
            ranged.append((first, end, pg_name, key))  # type: ignore[arg-type]

    signatures: list[Signature] = []
    sig_ids: dict[Any, int] = {}
    groups: dict[GroupKey, GroupTrace] = {}
    # per group: current trace plus the previous entry's seq, for coalescing and restarts
    p2p = 0
    oldest: int | None = None
    last_entry: dict[str, Any] | None = None
    plain_keys: dict[str, GroupKey] = {}

    if entries:
        first_entry = entries[0]
        if not isinstance(first_entry, Mapping) or any(k not in first_entry for k in _CORE_KEYS):
            raise DumpFormatError("entries lack process_group/profiling_name/record_id")
        getter = _fast_get if all(k in first_entry for k in _FAST_KEYS) else _slow_get
        try:
            rows = list(map(getter, entries))
        except (KeyError, TypeError, AttributeError):
            try:
                rows = list(map(_slow_get, entries))
            except (KeyError, TypeError, AttributeError) as exc:
                raise DumpFormatError(f"malformed entry: {exc!r}") from exc
        has_duration = "duration_ms" in first_entry
        durations = [e.get("duration_ms") for e in entries] if has_duration else None
        oldest = min(r[9] for r in rows) if rows else None
        cur_key: GroupKey | None = None
        for i, (pg, seq, pname, ins, outs, idt, odt, st, created, rid, pg_id, is_p2p) in enumerate(rows):
            try:
                pg_name = pg[0]
                op = pname.rpartition(":")[2].partition(" ")[0]
            except (TypeError, IndexError, AttributeError) as exc:
                raise DumpFormatError(f"malformed entry {i}: {exc!r}") from exc
            if is_p2p or op in _P2P_OPS:
                p2p += 1
                continue
            if not isinstance(seq, int):
                raise DumpFormatError(f"entry {i} has no integer collective_seq_id")
            key = by_pg_id.get(pg_id) if by_pg_id else None
            if key is None and ranged:
                for first, end, inc_pg, inc_key in ranged:
                    if first <= rid < end and inc_pg == pg_name:
                        key = inc_key
                        break
            if key is None:
                key = plain_keys.get(pg_name)
                if key is None:
                    key = plain_keys[pg_name] = GroupKey(str(pg_name), scope)
            # signature interning: repr of the raw values is the cheapest stable key
            raw_sig = (pname, ins, outs, idt, odt)
            try:
                sig_key = repr(raw_sig)
            except Exception as exc:  # pragma: no cover - repr of plain data does not fail
                raise DumpFormatError(f"malformed entry {i}") from exc
            sig = sig_ids.get(sig_key)
            if sig is None:
                sig = sig_ids[sig_key] = len(signatures)
                signatures.append(_make_signature(op, ins, outs, idt, odt))
            state = _STATE_CODES.get(st, SCHEDULED)
            dur = durations[i] if durations is not None else None
            dur = NAN if dur is None else float(dur)
            trace = groups.get(key)
            if trace is None:
                trace = groups[key] = GroupTrace(first_seq=seq)
            pos = seq - trace.first_seq
            n = len(trace.sigs)
            if pos == n:
                trace.sigs.append(sig)
                trace.states.append(state)
                trace.created_ns.append(created)
                trace.duration_ms.append(dur)
            elif pos == n - 1 and cur_key == key:
                # another entry of the same (coalesced) collective
                prev = trace.sigs[pos]
                combo = ("coalesced", prev, sig)
                cid = sig_ids.get(combo)
                if cid is None:
                    cid = sig_ids[combo] = len(signatures)
                    signatures.append(_combine(signatures[prev], signatures[sig]))
                trace.sigs[pos] = cid
                trace.states[pos] = min(trace.states[pos], state)
                if dur == dur:
                    trace.duration_ms[pos] = dur
            elif pos > n:
                gap = pos - n
                trace.sigs.extend([None] * gap)
                trace.states.extend([SCHEDULED] * gap)
                trace.created_ns.extend([0] * gap)
                trace.duration_ms.extend([NAN] * gap)
                trace.sigs.append(sig)
                trace.states.append(state)
                trace.created_ns.append(created)
                trace.duration_ms.append(dur)
            else:
                # sequence ids went back: a new group reused the name; keep the newest run only
                trace = groups[key] = GroupTrace(first_seq=seq, restarted=True)
                trace.sigs.append(sig)
                trace.states.append(state)
                trace.created_ns.append(created)
                trace.duration_ms.append(dur)
            cur_key = key
        last = entries[-1]
        last_entry = {
            "pg": str(last["process_group"][0]),
            "seq": last.get("collective_seq_id"),
            "op": _op_name(str(last.get("profiling_name", ""))),
            "state": str(last.get("state", "scheduled")),
        }
        if last_entry["pg"] == "" or by_pg_id or ranged:
            lk = by_pg_id.get(last.get("pg_id")) if by_pg_id else None
            if lk is not None and lk.quorum_id is not None:
                last_entry["quorum_id"] = lk.quorum_id
    flavour = "nccl" if (entries and _looks_nccl(entries)) else "gloo"
    host = dump.get("host")
    return RankTrace(
        rank=own_rank,
        version=version,
        flavour=flavour,
        host=str(host) if host else None,
        oldest_record_id=oldest,
        signatures=signatures,
        groups=groups,
        members=members,
        incarnations=incarnations,
        last_entry=last_entry,
        p2p_entries=p2p,
        is_torchft=bool(raw_incarnations),
    )


def _looks_nccl(entries: list[Mapping[str, Any]]) -> bool:
    # gloo leaves every entry "scheduled" with zero timestamps; NCCL fills them in
    for e in (entries[0], entries[-1]):
        if e.get("state") != "scheduled" or e.get("time_discovered_started_ns"):
            return True
    return False


def _sizes(raw: Any) -> tuple:
    return tuple(tuple(s) if isinstance(s, list | tuple) else (s,) for s in (raw or ()))


def _make_signature(op: str, ins: Any, outs: Any, idt: Any, odt: Any) -> Signature:
    if op in SIZES_MAY_DIFFER:
        return Signature(op, None, None, tuple(idt or ()), tuple(odt or ()))
    return Signature(op, _sizes(ins), _sizes(outs), tuple(idt or ()), tuple(odt or ()))


def _combine(first: Signature, nxt: Signature) -> Signature:
    parts = (first.parts if first.op == "coalesced" else (first,)) + (nxt,)
    return Signature("coalesced", None, None, (), (), parts)
