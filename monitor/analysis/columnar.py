"""The loader's fast path: the common dump normalized column by column, as ``normalize`` would.
Anything uncommon or malformed goes to ``normalize``, so the errors are its errors.
"""

from __future__ import annotations

import marshal
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import itemgetter
from typing import Any

from .model import (
    _FAST_KEYS,
    _INT_ONLY,
    _NONE_TO_NAN,
    _P2P_OPS,
    _STATE_CODES,
    NAN,
    SCHEDULED,
    GroupKey,
    GroupTrace,
    RankTrace,
    _looks_nccl,
    _make_signature,
    normalize,
)
from .wire import Packed, pack, pack_group

# normalize's fields but pg_id, which only tells torchft incarnations apart (left to normalize)
_KEYS = tuple(k for k in _FAST_KEYS if k != "pg_id")
_MAX_PERIOD = 64  # longest repeating pattern of groups looked for (collectives per step)

Take = Callable[[Sequence[Any]], Sequence[Any]]


def normalize_columnar(dump: Any, rank: int | None = None) -> RankTrace:
    trace = _fast(dump, rank, _group_trace)
    return normalize(dump, rank) if trace is None else trace


def normalize_packed(dump: Any, rank: int | None = None) -> Packed:
    """``wire.pack(normalize(dump, rank))``, built from the dump's columns."""
    trace = _fast(dump, rank, pack_group)
    return pack(normalize(dump, rank)) if trace is None else _as_packed(trace)


def normalize_parsed(doc: Any, rank_of: Callable[[Any], int], packed: bool) -> RankTrace | Packed:
    """The C reader's parsed pickle ``doc`` normalized (``packed``: as :func:`normalize_packed`);
    raises ``_frpickle.DumpRefused`` when the reader cannot build it."""
    build = pack_group if packed else _group_trace
    got = doc.columns(_KEYS, "duration_ms")
    if got is not None:
        top, cols, first, last = got
        rank = rank_of(top)
        if not top.get("incarnations"):
            trace = _from_parts(top, rank, build, lambda: cols, (first, last))
            if trace is not None:
                return _as_packed(trace) if packed else trace
    dump = doc.load()
    rank = rank_of(dump)
    return normalize_packed(dump, rank) if packed else normalize_columnar(dump, rank)


def _as_packed(trace: RankTrace) -> Packed:
    columns, trace.groups = trace.groups, {}
    return Packed(trace, columns)


def _fast(dump: Any, rank: int | None, build: Build) -> RankTrace | None:
    """The trace, its groups made by ``build``; None when not the common shape."""
    if type(dump) is not dict:
        return None
    entries = dump.get("entries")
    if not entries or type(entries) is not list or dump.get("incarnations"):
        return None
    return _from_parts(dump, rank, build, lambda: _entry_columns(entries), (entries[0], entries[-1]))


def _from_parts(top: dict, rank: int | None, build: Build, columns: Callable[[], Sequence | None],
                ends: tuple[Any, Any]) -> RankTrace | None:
    """:func:`_fast` on a dump's top-level dict, its entries' columns and first and last entry."""
    # an invalid dump raises here, before any entry is read
    trace = normalize({**top, "entries": []}, rank)
    scope = None  # as normalize scopes groups inside a torchft replica group
    if isinstance(top.get("replica_group"), int) and isinstance(top.get("group_world_size"), int):
        scope = top["replica_group"]
    try:
        cols = columns()
        body = None if cols is None else _columns(cols, scope, build)
    except Exception:  # anything unusual: normalize decides, and raises what it raises
        body = None
    if body is None:
        return None
    trace.oldest_record_id, trace.signatures, trace.groups, trace.last_entry = body
    trace.flavour = "nccl" if _looks_nccl(ends) else "gloo"
    return trace


def _entry_columns(entries: list) -> list | None:
    """One tuple per field :func:`_columns` reads (``duration_ms`` last, when there), or None."""
    first = entries[0]
    if type(first) is not dict:
        return None
    if "duration_ms" in first:
        keys = _KEYS + ("duration_ms",)  # an entry without it raises KeyError: normalize's path
    elif any("duration_ms" in e for e in entries):
        return None  # the oldest entry unfinished, later ones timed: normalize keeps durations
    else:
        keys = _KEYS
    own = {k: k for k in first}  # the dump's own key objects: lookups match by identity
    return list(zip(*map(itemgetter(*(own.get(k, k) for k in keys)), entries), strict=True))


def _columns(cols: Sequence, scope: int | None, build: Build) -> tuple | None:
    """``(oldest record id, signatures, groups, last entry)``, or None when not the common shape."""
    pgs, seqs, pnames, ins, outs, idts, odts, states, created, rids, p2ps = cols[:11]
    n = len(seqs)
    if any(p2ps) or set(map(type, seqs)) != _INT_ONLY:
        return None
    period: int | None
    if pgs.count(pgs[0]) == n:  # one process group (equal lists: the same name throughout)
        names: Sequence[Any] = (pgs[0][0],)
        period = 1
    else:
        # a fixed order of groups (one step after another): only one period's names are taken
        period = _period(pgs, 2)
        names = [pg[0] for pg in pgs[:period]] if period else list(map(itemgetter(0), pgs))
    order = list(dict.fromkeys(names))
    if set(map(type, order)) != {str}:
        return None  # normalize keys groups by str(name): 0 and "0" would be one group
    oldest = min(rids)
    durations: Sequence[Any]
    if len(cols) == 11:
        durations, duration_kind = [NAN] * n, float
    else:  # what normalize's mapping leaves them (None -> NaN), without hashing every float
        durations = cols[11]
        duration_kind = _one_type(durations)
        if duration_kind is not float and None in durations:  # floats only: no None to look for
            durations = list(map(_NONE_TO_NAN.get, durations, durations))
            duration_kind = _one_type(durations)
    kinds = (_one_type(created), duration_kind)
    pname_set: set[str] = set()

    # normalize numbers signatures in the order their keys first occur: keep each key's first index
    firsts: dict[bytes, int] = {}
    plans: list[tuple[GroupKey, Take, int, bytes | list[bytes]]] = []
    for name, take, index_of in _split(names, order, period, n):
        g_seqs = take(seqs)
        first_seq, count = g_seqs[0], len(g_seqs)
        if g_seqs[-1] - first_seq != count - 1 or g_seqs != tuple(range(first_seq, first_seq + count)):
            return None  # coalesced, gaps or restarts: normalize's irregular path
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
        plans.append((GroupKey(str(name), scope), take, first_seq, keyed))

    # each distinct profiling name from the groups' columns, not hashed once per entry
    op_of = {p: p.rpartition(":")[2].partition(" ")[0] for p in pname_set}
    if not _P2P_OPS.isdisjoint(op_of.values()):
        return None
    sig_ids: dict[bytes, int] = {}
    signatures = []
    for key, i in sorted(firsts.items(), key=itemgetter(1)):
        sig_ids[key] = len(signatures)
        signatures.append(_make_signature(op_of[pnames[i]], ins[i], outs[i], idts[i], odts[i]))
    groups = {}
    for key, take, first_seq, keyed in plans:
        g_states = take(states)
        count = len(g_states)
        if g_states.count(g_states[0]) == count:
            codes = [_STATE_CODES.get(g_states[0], SCHEDULED)] * count
        else:
            codes = list(map(_STATE_CODES.get, g_states, repeat(SCHEDULED)))
        sigs = [sig_ids[keyed]] * count if isinstance(keyed, bytes) else list(map(sig_ids.__getitem__, keyed))
        groups[key] = build(first_seq, sigs, codes, take(created), take(durations), kinds)
    last_entry = {"pg": str(pgs[-1][0]), "seq": seqs[-1], "op": op_of[pnames[-1]], "state": str(states[-1])}
    return oldest, signatures, groups, last_entry


# a group's columns -> what the trace holds for it: (first seq, signature ids, state codes,
# enqueue times, durations, the value columns' one type each or None)
Build = Callable[[int, list, list, Sequence[Any], Sequence[Any], tuple], Any]


def _group_trace(first_seq: int, sigs: list, states: list, created: Sequence[Any], durations: Sequence[Any],
                 kinds: tuple) -> GroupTrace:
    return GroupTrace(first_seq=first_seq, sigs=sigs, states=states, created_ns=list(created),
                      duration_ms=list(durations))


def _one_type(values: Sequence[Any]) -> type | None:
    kinds = set(map(type, values))
    return kinds.pop() if len(kinds) == 1 else None


def _split(names: Sequence[str], order: list[str], period: int | None,
           n: int) -> list[tuple[str, Take, Callable[[int], int]]]:
    """Per group name, in order: a function taking its entries out of a column of ``n``, and
    one mapping a position in the group back to the entry's index."""
    if len(order) == 1:
        return [(order[0], lambda col: col, lambda i: i)]
    if period is None:
        buckets: dict[str, list[int]] = {name: [] for name in order}
        for i, name in enumerate(names):
            buckets[name].append(i)
        return [(name, _gather(buckets[name]), buckets[name].__getitem__) for name in order]
    out: list[tuple[str, Take, Callable[[int], int]]] = []
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

