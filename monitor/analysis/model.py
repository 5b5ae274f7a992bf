"""One rank's Flight Recorder dump (format 2.x), normalized into what cross-rank analysis needs:
per process group, collectives by ``collective_seq_id``; torchft incarnations keyed by quorum.
"""

from __future__ import annotations

import json
import marshal
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import repeat
from operator import itemgetter
from typing import Any, NamedTuple

NAN = float("nan")
SCHEDULED, STARTED, COMPLETED = 0, 1, 2
_STATE_CODES = {"scheduled": SCHEDULED, "started": STARTED, "completed": COMPLETED}

# Ops whose sizes legitimately differ between ranks (variable splits, root-only buffers):
# only op and dtypes are compared for them.
SIZES_MAY_DIFFER = frozenset({
    "all_to_all", "all_to_all_single", "all_to_all_v_single", "alltoall", "alltoall_base", "gather",
    "scatter", "all_gather_v", "reduce_scatter_v", "split", "new_window",
})
_P2P_OPS = frozenset({"send", "recv"})


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
        if self.parts:
            out["parts"] = [p.to_dict() for p in self.parts]
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

    @property
    def wrapped(self) -> bool:
        # record ids start at 0 per process
        return bool(self.oldest_record_id)


_CORE_KEYS = ("process_group", "profiling_name", "record_id")
_FAST_KEYS = ("process_group", "collective_seq_id", "profiling_name", "input_sizes", "output_sizes",
              "input_dtypes", "output_dtypes", "state", "time_created_ns", "record_id", "pg_id", "is_p2p")
_fast_get = itemgetter(*_FAST_KEYS)


def _slow_get(e: Mapping[str, Any]) -> tuple:  # older versions leave optional keys out
    return (e["process_group"], e.get("collective_seq_id", e.get("seq_id")), e["profiling_name"],
            e.get("input_sizes") or [], e.get("output_sizes") or [], e.get("input_dtypes") or [],
            e.get("output_dtypes") or [], e.get("state", "scheduled"), e.get("time_created_ns") or 0,
            e["record_id"], e.get("pg_id"), e.get("is_p2p"))


def _check_version(dump: Mapping[str, Any]) -> None:
    version = dump.get("version")
    if not isinstance(version, str):
        raise DumpFormatError("no 'version' string: not a Flight Recorder dump")
    major, _, minor = version.partition(".")
    if major != "2" or not minor.isdigit():
        raise DumpFormatError(f"unsupported Flight Recorder format version {version!r} (need 2.x)")


def _parse_ranks(raw: Any) -> tuple[int, ...]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return ()
    if isinstance(raw, list | tuple) and (set(map(type, raw)) <= _INT_ONLY or all(isinstance(r, int) for r in raw)):
        return tuple(raw)
    return ()


_INT_ONLY = frozenset({int})


def _members_of(raw: Any, offset: int) -> tuple[int, ...]:
    if type(raw) is str:
        return _members_of_text(raw, offset)
    return tuple(map(offset.__add__, _parse_ranks(raw)))  # r + offset, at C speed


@lru_cache(maxsize=4096)  # every dump of a job repeats pg_config's rank lists
def _members_of_text(raw: str, offset: int) -> tuple[int, ...]:
    return tuple(map(offset.__add__, _parse_ranks(raw)))


def normalize(dump: Mapping[str, Any], rank: int | None = None) -> RankTrace:
    """The dump's trace (``rank``: when it has no ``rank`` key); raises :class:`DumpFormatError`."""
    if not isinstance(dump, Mapping):
        raise DumpFormatError(f"expected a dict, got {type(dump).__name__}")
    _check_version(dump)
    entries = dump.get("entries")
    entries = [] if entries is None else entries
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
            if isinstance(cfg, Mapping) and (ranks := _members_of(cfg.get("ranks"), offset)):
                members[GroupKey(str(cfg.get("name", key)), scope)] = ranks

    raw_incarnations = dump.get("incarnations") or []
    incarnations, by_pg_id, ranged = _incarnations(raw_incarnations, members)

    builder = _Builder()
    oldest: int | None = None
    last_entry: dict[str, Any] | None = None
    if entries:
        first_entry = entries[0]
        if not isinstance(first_entry, Mapping) or any(k not in first_entry for k in _CORE_KEYS):
            raise DumpFormatError("entries lack process_group/profiling_name/record_id")
        try:
            rows = list(map(_fast_get, entries))
        except (KeyError, TypeError):
            try:
                rows = list(map(_slow_get, entries))
            except (KeyError, TypeError, AttributeError) as exc:
                raise DumpFormatError(f"malformed entry: {exc!r}") from exc
        # torch leaves the key out of unfinished entries: the oldest kept entry may be a stuck
        # collective (a wrapped ring buffer) while later ones carry their durations
        if "duration_ms" in first_entry or any("duration_ms" in e for e in entries):
            durations: list[Any] = [e.get("duration_ms") for e in entries]
        else:
            durations = [None] * len(rows)
        pgs, seqs, pnames, ins, outs, idts, odts, states, created, rids, pg_ids, p2ps = zip(*rows, strict=True)
        try:
            names = list(map(itemgetter(0), pgs))
            op_of = {n: n.rpartition(":")[2].partition(" ")[0] for n in set(pnames)}
            ops = list(map(op_of.__getitem__, pnames))
            oldest = min(rids)
        except (TypeError, IndexError, AttributeError) as exc:
            raise DumpFormatError(f"malformed entry: {exc!r}") from exc
        if any(p2ps) or not _P2P_OPS.isdisjoint(ops):
            keep = [i for i, (flag, op) in enumerate(zip(p2ps, ops, strict=True)) if not (flag or op in _P2P_OPS)]
        else:
            keep = None
        kept_seqs = seqs if keep is None else [seqs[i] for i in keep]
        if not all(type(q) is int for q in kept_seqs):
            raise DumpFormatError("an entry has no integer collective_seq_id")
        # one C-level marshal per entry, Python work per distinct signature only
        sig_keys = list(map(marshal.dumps, zip(pnames, ins, outs, idts, odts, strict=True), repeat(0)))
        for key, i in dict(zip(sig_keys, range(len(sig_keys)), strict=True)).items():
            if key not in builder.sig_ids:
                builder.sig_ids[key] = len(builder.signatures)
                builder.signatures.append(_make_signature(ops[i], ins[i], outs[i], idts[i], odts[i]))
        sig_col = list(map(builder.sig_ids.__getitem__, sig_keys))
        state_col = list(map(_STATE_CODES.get, states, repeat(SCHEDULED)))
        dur_col = list(map(_NONE_TO_NAN.get, durations, durations))
        key_col: list[GroupKey]
        if by_pg_id or ranged:
            key_col = [
                _incarnation_key(name, pg_id, rid, by_pg_id, ranged) or GroupKey(str(name), scope)
                for name, pg_id, rid in zip(names, pg_ids, rids, strict=True)
            ]
        else:
            plain = {name: GroupKey(str(name), scope) for name in set(names)}
            key_col = list(map(plain.__getitem__, names))
        by_group: dict[GroupKey, list[int]] = {}
        for i in keep if keep is not None else range(len(rows)):
            by_group.setdefault(key_col[i], []).append(i)
        for key, idx in by_group.items():
            builder.add_group(key, idx, seqs, sig_col, state_col, created, dur_col)
        last_entry = {"pg": str(names[-1]), "seq": seqs[-1], "op": ops[-1], "state": str(states[-1])}
        if key_col[-1].quorum_id is not None:
            last_entry["quorum_id"] = key_col[-1].quorum_id
    signatures, groups = builder.signatures, builder.groups
    flavour = "nccl" if (entries and _looks_nccl(entries)) else "gloo"
    host = dump.get("host")
    return RankTrace(rank=own_rank, flavour=flavour, host=str(host) if host else None,
                     oldest_record_id=oldest, signatures=signatures, groups=groups, members=members,
                     incarnations=incarnations, last_entry=last_entry, is_torchft=bool(raw_incarnations),
                     dump_time_ns=_int_or_none(dump.get("dump_time_ns")))


Ranged = list[tuple[int, float, str, "GroupKey"]]  # (first record id, end, pg name, incarnation)


def _incarnations(raw: Any, members: dict[GroupKey, tuple[int, ...]]) -> tuple[dict[GroupKey, int], dict[int, GroupKey], Ranged]:
    """``(key -> first record id, pg_id -> key, record-id ranges of those without a pg_id)``;
    their member lists are added to ``members``."""
    if not isinstance(raw, list):
        raise DumpFormatError("'incarnations' is not a list")
    incarnations: dict[GroupKey, int] = {}
    by_pg_id: dict[int, GroupKey] = {}
    starts: list[tuple[int, str, GroupKey, Any]] = []
    for inc in raw:
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
    ranged: Ranged = []
    for i, (first, pg_name, key, pg_id) in enumerate(starts):
        if pg_id is None:
            ranged.append((first, starts[i + 1][0] if i + 1 < len(starts) else math.inf, pg_name, key))
    return incarnations, by_pg_id, ranged


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


_NONE_TO_NAN = {None: NAN}


def _incarnation_key(name: str, pg_id: Any, record_id: int, by_pg_id: Mapping[int, GroupKey],
                     ranged: Ranged) -> GroupKey | None:
    key = by_pg_id.get(pg_id)
    if key is None:
        for first, end, inc_pg, inc_key in ranged:
            if first <= record_id < end and inc_pg == name:
                return inc_key
    return key


class _Builder:
    def __init__(self) -> None:
        self.signatures: list[Signature] = []
        self.sig_ids: dict[Any, int] = {}
        self.groups: dict[GroupKey, GroupTrace] = {}

    def add_group(self, key: GroupKey, idx: list[int], seqs: tuple, sigs: list[int], states: list[int],
                  created: tuple, durations: list[float]) -> None:
        gather = itemgetter(*idx) if len(idx) > 1 else (lambda col: (col[idx[0]],))
        g_seqs = gather(seqs)
        first = g_seqs[0]
        if g_seqs[-1] - first == len(g_seqs) - 1 and g_seqs == tuple(range(first, first + len(g_seqs))):
            self.groups[key] = GroupTrace(first, list(gather(sigs)), list(gather(states)), list(gather(created)),
                                          list(gather(durations)))
            return
        self._add_irregular(key, g_seqs, gather(sigs), gather(states), gather(created), gather(durations))

    def _add_irregular(self, key: GroupKey, seqs: tuple, sigs: tuple, states: tuple, created: tuple, durations: tuple) -> None:
        # coalesced collectives (one seq, several entries), gaps, restarted sequence ids
        trace = GroupTrace(first_seq=seqs[0])
        prev_seq = None
        for seq, sig, state, when, dur in zip(seqs, sigs, states, created, durations, strict=True):
            pos = seq - trace.first_seq
            n = len(trace.sigs)
            if seq == prev_seq:
                before = trace.sigs[pos]
                combo = ("coalesced", before, sig)
                cid = self.sig_ids.get(combo)
                if cid is None:
                    cid = self.sig_ids[combo] = len(self.signatures)
                    self.signatures.append(_combine(self.signatures[before], self.signatures[sig]))  # type: ignore[index]
                trace.sigs[pos] = cid
                trace.states[pos] = min(trace.states[pos], state)
                if dur == dur:
                    trace.duration_ms[pos] = dur
                continue
            if pos < n:
                # sequence ids went back: a new group reused the name; keep the newest run only
                trace = GroupTrace(first_seq=seq)
            elif pos > n:
                gap = pos - n
                trace.sigs.extend([None] * gap)
                trace.states.extend([SCHEDULED] * gap)
                trace.created_ns.extend([0] * gap)
                trace.duration_ms.extend([NAN] * gap)
            trace.sigs.append(sig)
            trace.states.append(state)
            trace.created_ns.append(when)
            trace.duration_ms.append(dur)
            prev_seq = seq
        self.groups[key] = trace


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
