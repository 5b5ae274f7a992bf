"""One rank's Flight Recorder dump (format 2.x) normalized into a :class:`~.model.RankTrace`,
column by column: one path for every dump, whether Python or the C reader decoded it.
A dump that is not one raises :class:`~.model.DumpFormatError`.
"""

from __future__ import annotations

import json
import marshal
import math
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from itertools import repeat
from operator import itemgetter
from typing import Any, NamedTuple

from rank_wire import INT64_MAX

from .model import (
    COMPLETED,
    NAN,
    SCHEDULED,
    STARTED,
    DumpFormatError,
    GroupKey,
    GroupTrace,
    RankTrace,
    Signature,
    looks_nccl,
    make_signature,
    status_fields,
)
from .wire import Packed, pack_group, single_type

_STATE_CODES = {"scheduled": SCHEDULED, "started": STARTED, "completed": COMPLETED}
_P2P_OPS = frozenset({"send", "recv"})
_NONE_TO_NAN = {None: NAN}
_CORE_KEYS = ("process_group", "profiling_name", "record_id")
# the entries' fields read, in the order of the columns (the C reader is asked for these)
_KEYS = ("process_group", "collective_seq_id", "profiling_name", "input_sizes", "output_sizes",
         "input_dtypes", "output_dtypes", "state", "time_created_ns", "record_id", "is_p2p")
_MAX_PERIOD = 64  # longest repeating pattern of groups looked for (collectives per step)
_MAX_RANK = 1 << 31  # torch keeps a rank in a C int
_MAX_GAP = 1 << 16  # a gap in a group's sequence ids filled with empty slots, at most
_NUMBERS = (int, float)

Take = Callable[[Sequence[Any]], Sequence[Any]]
Ranged = list[tuple[int, float, str, GroupKey]]  # (first record id, end, pg name, incarnation)
# a group's columns -> what the trace holds for it: (first seq, signature ids, state codes,
# enqueue times, durations, the value columns' one type each or None)
Build = Callable[[int, list, list, Sequence[Any], Sequence[Any], tuple], Any]


def normalize(dump: Any, rank: int | None = None) -> RankTrace:
    """The dump's trace (``rank``: when it has no ``rank`` key); raises :class:`DumpFormatError`."""
    return _normalize(dump, rank, _group_trace)


def normalize_packed(dump: Any, rank: int | None = None) -> Packed:
    """What the loader's workers send: the trace with each group packed as it is built."""
    return Packed(_normalize(dump, rank, pack_group))


def normalize_parsed(doc: Any, rank_of: Callable[[Any], int], packed: bool) -> RankTrace | Packed:
    """The C reader's parsed pickle ``doc`` normalized (``packed``: as :func:`normalize_packed`);
    raises ``_frpickle.DumpRefused`` when the reader cannot build it."""
    build = pack_group if packed else _group_trace
    got = doc.columns(_KEYS, "duration_ms")
    # incarnations are told apart by pg_id, which is not among the columns: the whole dump
    if got is None or got[0].get("incarnations"):
        dump = doc.load()
        trace = _normalize(dump, rank_of(dump), build)
    else:
        top, cols, first, last = got
        trace, keys = _header(top, rank_of(top))
        durations = cols[11] if len(cols) > 11 else None
        _entries(trace, cols[:11], durations, None, keys, build)
        trace.flavour = _flavour(first, last, durations)
    return Packed(trace) if packed else trace


def _normalize(dump: Any, rank: int | None, build: Build) -> RankTrace:
    trace, keys = _header(dump, rank)
    entries = dump.get("entries")
    if entries:
        cols, durations, pg_ids = _entry_columns(entries, bool(keys.by_pg_id))
        _entries(trace, cols, durations, pg_ids, keys, build)
        trace.flavour = _flavour(entries[0], entries[-1], durations)
    return trace


def _flavour(first: Mapping[str, Any], last: Mapping[str, Any], durations: Sequence | None) -> str:
    """``nccl`` when the first or last entry looks timed, or any entry has a duration: a rank's
    dump of both its recorders (rank_wire.recorders) may begin and end with gloo's untimed
    entries."""
    timed = looks_nccl(first, last) or (durations is not None and any(d is not None and d == d for d in durations))
    return "nccl" if timed else "gloo"


def rank_value(value: Any) -> int | None:
    """A dump's ``rank`` (an int, or ASCII digits); None for none. Raises DumpFormatError for a
    value that is no rank."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or not 0 <= value < _MAX_RANK):
        raise DumpFormatError(f"'rank' is {value!r}: not a rank (an integer from 0)")
    return value


def _header(dump: Any, rank: int | None) -> tuple[RankTrace, _Keys]:
    """The trace of the dump without its entries, and how its entries map to group keys."""
    if not isinstance(dump, Mapping):
        raise DumpFormatError(f"expected a dict, got {type(dump).__name__}")
    version = dump.get("version")
    if not isinstance(version, str):
        raise DumpFormatError("no 'version' string: not a Flight Recorder dump")
    major, _, minor = version.partition(".")
    if major != "2" or not minor.isdigit():
        raise DumpFormatError(f"unsupported Flight Recorder format version {version!r} (need 2.x)")
    if not isinstance(dump.get("entries") or [], list):
        raise DumpFormatError("'entries' is not a list")
    own_rank = rank_value(dump.get("rank"))
    if own_rank is None:  # no key, or null: the caller's (the file name's)
        own_rank = rank_value(rank)
    if own_rank is None:
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
    host = dump.get("host")
    trace = RankTrace(rank=own_rank, flavour="gloo", host=str(host) if host else None, oldest_record_id=None,
                      signatures=[], groups={}, members=members, incarnations=incarnations, last_entry=None,
                      is_torchft=bool(raw_incarnations), dump_time_ns=_int_or_none(dump.get("dump_time_ns")),
                      **status_fields(dump))
    return trace, _Keys(scope, by_pg_id, ranged)


def _parse_ranks(raw: Any) -> tuple[int, ...]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return ()
    if isinstance(raw, list | tuple) and all(isinstance(r, int) for r in raw):
        return tuple(raw)
    return ()


def _members_of(raw: Any, offset: int) -> tuple[int, ...]:
    if type(raw) is str:
        return _members_of_text(raw, offset)
    return tuple(map(offset.__add__, _parse_ranks(raw)))  # r + offset, at C speed


@lru_cache(maxsize=4096)  # every dump of a job repeats pg_config's rank lists
def _members_of_text(raw: str, offset: int) -> tuple[int, ...]:
    return tuple(map(offset.__add__, _parse_ranks(raw)))


def _incarnations(raw: Any, members: dict[GroupKey, tuple[int, ...]]) -> tuple[dict[GroupKey, int], dict[int, GroupKey], Ranged]:
    """``(key -> first record id, pg_id -> key, record-id ranges of those without a pg_id)``;
    their member lists are added to ``members``, and pg_config's lists of their groups dropped."""
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
            pg_id = None if inc.get("pg_id") is None else int(inc["pg_id"])
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise DumpFormatError(f"malformed incarnation {inc!r}"[:300]) from exc
        incarnations[key] = first
        if global_ranks:
            members[key] = global_ranks
        starts.append((first, key.pg, key, pg_id))
        if pg_id is not None:
            by_pg_id[pg_id] = key
    # pg_config lists torchft's group (gloo: '') by replica rank, not global rank, as if a group
    # inside this replica group: its members are the incarnations' global_ranks
    names = {key.pg for key in incarnations}
    for key in [k for k in members if k.quorum_id is None and k.pg in names]:
        del members[key]
    starts.sort(key=lambda s: s[0])
    ends = [s[0] for s in starts[1:]] + [math.inf]  # each runs until the next one starts
    ranged = [(first, end, pg, key) for (first, pg, key, pg_id), end in zip(starts, ends, strict=False) if pg_id is None]
    return incarnations, by_pg_id, ranged


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _entry_columns(entries: list, with_pg_id: bool) -> tuple[list, Sequence | None, Sequence | None]:
    """``(columns of _KEYS, durations, pg ids)``; durations None when no entry has one, pg ids
    None unless asked for."""
    first = entries[0]
    if not isinstance(first, Mapping) or any(k not in first for k in _CORE_KEYS):
        raise DumpFormatError("entries lack process_group/profiling_name/record_id")
    timed = "duration_ms" in first
    keys = _KEYS + (("duration_ms",) if timed else ()) + (("pg_id",) if with_pg_id else ())
    own = {k: k for k in first}  # the dump's own key objects: lookups match by identity
    try:
        cols = list(zip(*map(itemgetter(*(own.get(k, k) for k in keys)), entries), strict=True))
    except (KeyError, TypeError):
        cols = None  # older versions leave optional keys out: the slow path below
    if cols is not None and (timed or not any("duration_ms" in e for e in entries)):
        return cols[:11], cols[11] if timed else None, cols[-1] if with_pg_id else None
    # torch leaves duration_ms out of unfinished entries: the oldest kept entry may be a stuck
    # collective (a wrapped ring buffer) while later ones carry their durations
    try:
        cols = list(zip(*map(_slow_row, entries), strict=True))
        durations = [e.get("duration_ms") for e in entries]
    except (KeyError, TypeError, AttributeError) as exc:
        raise DumpFormatError(_malformed(entries, exc)) from exc
    return cols[:11], durations, cols[11]


def _slow_row(e: Mapping[str, Any]) -> tuple:
    # a missing signature field is an error, not []: it would be blamed as a size mismatch
    return (e["process_group"], e.get("collective_seq_id", e.get("seq_id")), e["profiling_name"],
            e["input_sizes"] or [], e["output_sizes"] or [], e["input_dtypes"] or [],
            e["output_dtypes"] or [], e.get("state", "scheduled"), e.get("time_created_ns") or 0,
            e["record_id"], e.get("is_p2p"), e.get("pg_id"))


def _malformed(entries: list, exc: Exception) -> str:
    """The error of an entry the slow path could not read: a missing field by name and entry."""
    field = exc.args[0] if isinstance(exc, KeyError) and exc.args else None
    for i, e in enumerate(entries):
        if isinstance(field, str) and isinstance(e, Mapping) and field not in e:
            rid = e.get("record_id")
            return f"entry {i}{'' if rid is None else f' (record_id {rid!r})'} has no {field!r} field"[:300]
    return f"malformed entry: {exc!r}"


class _Keys(NamedTuple):
    """How a dump's entries map to group keys: scoped by a torchft replica group, or to torchft
    incarnations by pg_id or by record-id range."""

    scope: int | None
    by_pg_id: dict[int, GroupKey]
    ranged: Ranged

    @property
    def by_incarnation(self) -> bool:
        return bool(self.by_pg_id or self.ranged)

    def of(self, name: Any, pg_id: Any, record_id: int) -> GroupKey:
        if (key := self.by_pg_id.get(pg_id)) is not None:
            return key
        for first, end, inc_pg, inc_key in self.ranged:
            if first <= record_id < end and inc_pg == name:
                return inc_key
        return GroupKey(str(name), self.scope)


def _op(profiling_name: str) -> str:
    return profiling_name.rpartition(":")[2].partition(" ")[0]  # "nccl:all_reduce" -> "all_reduce"


def _entries(trace: RankTrace, cols: Sequence, durations: Sequence | None, pg_ids: Sequence | None,
             keys: _Keys, build: Build) -> None:
    """Fills ``trace`` from its entries' columns; any malformed value raises DumpFormatError."""
    try:
        pgs, seqs, pnames, _, _, _, _, states, _, rids, p2ps = cols
        n = len(seqs)
        trace.oldest_record_id = min(rids)
        trace.last_entry = {"pg": str(pgs[-1][0]), "seq": seqs[-1], "op": _op(pnames[-1]), "state": str(states[-1])}
        if keys.by_incarnation:
            last_key = keys.of(pgs[-1][0], pg_ids[-1] if pg_ids else None, rids[-1])
            if last_key.quorum_id is not None:
                trace.last_entry["quorum_id"] = last_key.quorum_id
        if durations is None:
            durations, duration_kind = [NAN] * n, float
        else:  # None -> NaN, without hashing every float
            duration_kind = single_type(durations)
            if duration_kind is not float and None in durations:
                durations = list(map(_NONE_TO_NAN.get, durations, durations))
                duration_kind = single_type(durations)
        if any(p2ps) or not _groups(trace, cols, durations, duration_kind, pg_ids, keys, build):
            # point-to-point entries are not numbered in their group's collectives: left out
            op_of = {p: _op(p) for p in set(pnames)}
            keep = [i for i in range(n) if not (p2ps[i] or op_of[pnames[i]] in _P2P_OPS)]
            if keep:
                take = _gather(keep)
                _groups(trace, [take(c) for c in cols], take(durations), duration_kind, pg_ids and take(pg_ids), keys, build)
    except DumpFormatError:
        raise
    except (TypeError, ValueError, AttributeError, IndexError, KeyError, OverflowError) as exc:
        raise DumpFormatError(f"malformed entry: {exc!r}"[:300]) from exc


def _groups(trace: RankTrace, cols: Sequence, durations: Sequence, duration_kind: type | None,
            pg_ids: Sequence | None, keys: _Keys, build: Build) -> bool:
    """Fills the trace's signatures and groups; False, leaving them as they were, when some
    entry is a point-to-point one."""
    pgs, seqs, pnames, ins, outs, idts, odts, states, created, rids = cols[:10]
    n = len(seqs)
    period: int | None = None
    if keys.by_incarnation:
        names: Sequence[Any] = list(map(keys.of, map(itemgetter(0), pgs), pg_ids or repeat(None), rids))
    elif pgs.count(pgs[0]) == n:  # one process group (equal lists: the same name throughout)
        names, period = (pgs[0][0],), 1
    else:
        # a fixed order of groups (one step after another): only one period's names are taken
        period = _period(pgs, 2)
        names = [pg[0] for pg in pgs[:period]] if period else list(map(itemgetter(0), pgs))
    order = list(dict.fromkeys(names))
    if not keys.by_incarnation and any(type(name) is not str for name in order):
        names = list(map(str, names))  # groups are keyed by str(name): 0 and "0" are one group
        order = list(dict.fromkeys(names))

    # signatures are numbered in the order their keys first occur: keep each key's first index
    firsts: dict[bytes, int] = {}
    plans: list[tuple[GroupKey, Take, tuple, bytes | list[bytes]]] = []
    pname_set: set[str] = set()  # from the groups' columns, not hashed once per entry
    for name, take, index_of in _split(names, order, period, n):
        g_seqs = take(seqs)
        count = len(g_seqs)
        sig_cols = [take(pnames), take(ins), take(outs), take(idts), take(odts)]
        keyed: bytes | list[bytes]
        if all(c.count(c[0]) == count for c in sig_cols):
            keyed = marshal.dumps(tuple(c[0] for c in sig_cols), 0)
            local_first = {keyed: 0}
            pname_set.add(sig_cols[0][0])
        else:
            keyed = list(map(marshal.dumps, zip(*sig_cols, strict=True), repeat(0)))
            local_first = dict(zip(reversed(keyed), range(count - 1, -1, -1), strict=True))
            pname_set.update(sig_cols[0])
        for key, local in local_first.items():
            at = index_of(local)
            if firsts.get(key, n) > at:
                firsts[key] = at
        plans.append((name if keys.by_incarnation else GroupKey(name, keys.scope), take, g_seqs, keyed))
    op_of = {p: _op(p) for p in pname_set}
    if not _P2P_OPS.isdisjoint(op_of.values()):
        return False
    if set(map(type, seqs)) != {int} or min(seqs) < 0 or max(seqs) > INT64_MAX:
        raise DumpFormatError("an entry has no integer collective_seq_id in [0, 2**63)")

    sig_ids: dict[Any, int] = {}
    signatures = trace.signatures
    for key, i in sorted(firsts.items(), key=itemgetter(1)):
        sig_ids[key] = len(signatures)
        signatures.append(make_signature(op_of[pnames[i]], ins[i], outs[i], idts[i], odts[i]))
        hash(signatures[-1])  # sizes nested deeper than a list of lists: TypeError
    kinds = (single_type(created), duration_kind)
    for kind, col in zip(kinds, (created, durations), strict=True):
        if kind not in _NUMBERS and not all(type(v) in _NUMBERS for v in col):
            raise DumpFormatError("an entry's time_created_ns or duration_ms is not a number")
    for key, take, g_seqs, keyed in plans:
        g_states = take(states)
        count = len(g_states)
        if g_states.count(g_states[0]) == count:
            codes = [_STATE_CODES.get(g_states[0], SCHEDULED)] * count
        else:
            codes = list(map(_STATE_CODES.get, g_states, repeat(SCHEDULED)))
        sigs = [sig_ids[keyed]] * count if isinstance(keyed, bytes) else list(map(sig_ids.__getitem__, keyed))
        first_seq = g_seqs[0]
        if g_seqs[-1] - first_seq == count - 1 and g_seqs == tuple(range(first_seq, first_seq + count)):
            g_created, g_durations, g_kinds = take(created), take(durations), kinds
        else:
            g = _irregular(g_seqs, sigs, codes, take(created), take(durations), signatures, sig_ids)
            first_seq, sigs, codes = g.first_seq, g.sigs, g.states
            g_created, g_durations, g_kinds = g.created_ns, g.duration_ms, (None, None)
        if trace.wrapped and sigs[0] is not None and signatures[sigs[0]].op == "coalesced":
            # the ring buffer may have overwritten this coalesced collective's first parts (its
            # parts and closing entry share one seq): what is left of it does not testify
            sigs[0] = None
            g_created, g_durations, g_kinds = [0, *g_created[1:]], [NAN, *g_durations[1:]], (None, None)
        trace.groups[key] = build(first_seq, sigs, codes, g_created, g_durations, g_kinds)
    return True


def _irregular(seqs: Sequence[int], sigs: list, states: list, created: Sequence, durations: Sequence,
               signatures: list, sig_ids: dict[Any, int]) -> GroupTrace:
    """A group with coalesced collectives (one seq, several entries), gaps or restarted
    sequence ids; a coalesced one gets a new signature of its parts."""
    trace = GroupTrace(first_seq=seqs[0])
    prev_seq = None
    run: list[int] = []  # the signature ids of the entries at prev_seq, the newest collective
    for seq, sig, state, when, dur in zip(seqs, sigs, states, created, durations, strict=True):
        pos = seq - trace.first_seq
        n = len(trace.sigs)
        if seq == prev_seq:
            run.append(sig)
            trace.states[pos] = min(trace.states[pos], state)
            if dur == dur:
                trace.duration_ms[pos] = dur
            continue
        if len(run) > 1:
            trace.sigs[-1] = _coalesced(run, signatures, sig_ids)
        run = [sig]
        if pos < n:
            # sequence ids went back: a new group reused the name; keep the newest run only
            trace = GroupTrace(first_seq=seq)
        elif pos > n + _MAX_GAP:  # ids jumped past any ring buffer: kept as a new run
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
    if len(run) > 1:
        trace.sigs[-1] = _coalesced(run, signatures, sig_ids)
    return trace


def _coalesced(run: list[int], signatures: list, sig_ids: dict[Any, int]) -> int:
    """The id of the coalesced signature of a run's parts, built once for the whole run (one
    per prefix would cost n**2), keyed by its parts' ids: equal runs share it."""
    if signatures[run[0]].op == "coalesced":
        run = run[1:]  # a bare closing entry first has no parts of its own to give
    key = ("coalesced", *run)
    cid = sig_ids.get(key)
    if cid is None:
        cid = sig_ids[key] = len(signatures)
        signatures.append(Signature("coalesced", None, None, (), (), tuple(map(signatures.__getitem__, run))))
    return cid


def _group_trace(first_seq: int, sigs: list, states: list, created: Sequence[Any], durations: Sequence[Any],
                 kinds: tuple) -> GroupTrace:
    return GroupTrace(first_seq=first_seq, sigs=sigs, states=states, created_ns=list(created),
                      duration_ms=list(durations))


def _split(names: Sequence[Any], order: list[Any], period: int | None,
           n: int) -> list[tuple[Any, Take, Callable[[int], int]]]:
    """Per group name, in order: a function taking its entries out of a column of ``n``, and
    one mapping a position in the group back to the entry's index."""
    if len(order) == 1:
        return [(order[0], lambda col: col, lambda i: i)]
    if period is None:
        buckets: dict[Any, list[int]] = {name: [] for name in order}
        for i, name in enumerate(names):
            buckets[name].append(i)
        return [(name, _gather(buckets[name]), buckets[name].__getitem__) for name in order]
    out: list[tuple[Any, Take, Callable[[int], int]]] = []
    for name in order:
        at = [j for j in range(period) if names[j] == name]
        if len(at) == 1:  # once per period: every period-th entry from its first
            start = at[0]
            out.append((name, itemgetter(slice(start, None, period)), lambda i, s=start: s + i * period))
        else:
            idx = sorted(i for j in at for i in range(j, n, period))
            out.append((name, _gather(idx), idx.__getitem__))
    return out


def _period(column: Sequence[Any], shortest: int) -> int | None:
    """The shortest p >= ``shortest`` with column[i] == column[i + p] everywhere, up to
    _MAX_PERIOD; None if none."""
    for p in range(shortest, min(_MAX_PERIOD, len(column) // 2) + 1):
        if column[p : 2 * p] == column[:p] and column[p:] == column[:-p]:
            return p
    return None


def _gather(idx: list[int]) -> Take:
    if len(idx) == 1:
        only = idx[0]
        return lambda col: (col[only],)
    return itemgetter(*idx)
