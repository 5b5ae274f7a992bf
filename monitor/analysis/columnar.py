"""The loader's fast path: normalizing the common Flight Recorder dump column by column.

:func:`normalize_columnar` returns what :func:`~monitor.analysis.model.normalize` returns (an
equal :class:`~monitor.analysis.model.RankTrace`), at about half of its cost, for the dumps that
make up large jobs: entries that are dicts with every key torch writes, no point-to-point
entries, no torchft ``incarnations``, and in every group one entry per sequence id without gaps
or restarts. Everything else, malformed dumps included, goes to ``normalize`` itself, so the
errors are ``normalize``'s too (``tests/test_analysis_columnar.py`` compares the two on every
shape the generator makes).

Why it is cheaper, per dump of N entries:

- each needed field of every entry is read in one C-level pass (``itemgetter`` over the dump's
  own key objects, then one transpose) instead of being visited again per derived column;
- entries are split by group with slices when the job issues its groups in a fixed order (one
  training step after another: the group names repeat with a period), else in one loop;
- a group whose op, sizes and dtypes are the same in every entry (the usual case) gets its
  signature computed once instead of once per entry, and its state codes likewise.

One deliberate difference: within a group whose signature fields are equal (``==``) in every
entry but not of one type (sizes ``8`` and ``8.0``, or ``1`` and ``True``), ``normalize`` gives
each variant its own signature id and this gives the group one. The engine's shared signature
table compares signatures with ``==`` and merges such ids anyway, so no report differs.

The dump's top-level keys (version, rank, ``pg_config`` members, host, ...) are read by
``normalize`` itself, on the dump without its entries.
"""

from __future__ import annotations

import marshal
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from operator import eq, itemgetter
from typing import Any

from .model import (
    _FAST_KEYS,
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

__all__ = ["normalize_columnar"]

# the fields normalize reads from every entry, in its order: one list for both paths
_KEYS = _FAST_KEYS
_MAX_PERIOD = 64  # longest repeating pattern of groups looked for (collectives per step)

Take = Callable[[Sequence[Any]], Sequence[Any]]


def normalize_columnar(dump: Any, rank: int | None = None) -> RankTrace:
    """Normalize one rank's dump (same result and errors as ``normalize(dump, rank)``)."""
    if type(dump) is not dict:
        return normalize(dump, rank)
    entries = dump.get("entries")
    if not entries or type(entries) is not list or dump.get("incarnations"):
        return normalize(dump, rank)
    # top-level checks and fields first: an invalid dump raises here, before any entry is read
    trace = normalize({**dump, "entries": []}, rank)
    scope = None  # as normalize scopes groups inside a torchft replica group
    if isinstance(dump.get("replica_group"), int) and isinstance(dump.get("group_world_size"), int):
        scope = dump["replica_group"]
    try:
        body = _columns(entries, scope)
    except Exception:  # anything unusual: normalize decides, and raises what it raises
        body = None
    if body is None:
        return normalize(dump, rank)
    trace.oldest_record_id, trace.signatures, trace.groups, trace.last_entry = body
    trace.flavour = "nccl" if _looks_nccl(entries) else "gloo"
    return trace


def _columns(entries: list, scope: int | None) -> tuple | None:
    """``(oldest record id, signatures, groups, last entry)``, or None when not the common shape."""
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
    cols = list(zip(*map(itemgetter(*(own.get(k, k) for k in keys)), entries), strict=True))
    pgs, seqs, pnames, ins, outs, idts, odts, states, created, rids, _pg_ids, p2ps = cols[:12]
    n = len(entries)
    if any(p2ps):
        return None
    op_of = {p: p.rpartition(":")[2].partition(" ")[0] for p in set(pnames)}
    if not _P2P_OPS.isdisjoint(op_of.values()) or set(map(type, seqs)) != {int}:
        return None
    names = list(map(itemgetter(0), pgs))
    order = list(dict.fromkeys(names))
    if set(map(type, order)) != {str}:
        return None  # normalize keys groups by str(name): 0 and "0" would be one group
    oldest = min(rids)
    if len(cols) == 12:
        durations: Sequence[Any] = [NAN] * n
    elif None in cols[12]:
        durations = list(map(_NONE_TO_NAN.get, cols[12], cols[12]))
    else:  # what normalize's mapping leaves them, without hashing every float
        durations = cols[12]

    # normalize numbers signatures in the order their keys first occur in the dump: keep each
    # key's first index (the entry whose fields make its Signature)
    firsts: dict[bytes, int] = {}
    plans: list[tuple[GroupKey, Take, int, bytes | list[bytes]]] = []
    for name, take, index_of in _split(names, order):
        g_seqs = take(seqs)
        first_seq, count = g_seqs[0], len(g_seqs)
        if g_seqs[-1] - first_seq != count - 1 or g_seqs != tuple(range(first_seq, first_seq + count)):
            return None  # coalesced, gaps or restarts: normalize's irregular path
        sig_cols = [take(pnames), take(ins), take(outs), take(idts), take(odts)]
        keyed: bytes | list[bytes]
        if all(c.count(c[0]) == count for c in sig_cols):
            keyed = marshal.dumps(tuple(c[0] for c in sig_cols), 0)
            local_first = {keyed: 0}
        else:
            keyed = list(map(marshal.dumps, zip(*sig_cols, strict=True), repeat(0)))
            local_first = dict(zip(reversed(keyed), range(count - 1, -1, -1), strict=True))
        for key, local in local_first.items():
            at = index_of(local)
            if firsts.get(key, n) > at:
                firsts[key] = at
        plans.append((GroupKey(str(name), scope), take, first_seq, keyed))

    sig_ids: dict[bytes, int] = {}
    signatures = []
    for key, i in sorted(firsts.items(), key=itemgetter(1)):
        sig_ids[key] = len(signatures)
        signatures.append(_make_signature(op_of[pnames[i]], ins[i], outs[i], idts[i], odts[i]))
    groups: dict[GroupKey, GroupTrace] = {}
    for key, take, first_seq, keyed in plans:
        g_states = take(states)
        count = len(g_states)
        if g_states.count(g_states[0]) == count:
            codes = [_STATE_CODES.get(g_states[0], SCHEDULED)] * count
        else:
            codes = list(map(_STATE_CODES.get, g_states, repeat(SCHEDULED)))
        groups[key] = GroupTrace(
            first_seq=first_seq,
            sigs=[sig_ids[keyed]] * count if isinstance(keyed, bytes) else list(map(sig_ids.__getitem__, keyed)),
            states=codes,
            created_ns=list(take(created)),
            duration_ms=list(take(durations)),
        )
    last_entry = {"pg": str(names[-1]), "seq": seqs[-1], "op": op_of[pnames[-1]], "state": str(states[-1])}
    return oldest, signatures, groups, last_entry


def _split(names: list[str], order: list[str]) -> list[tuple[str, Take, Callable[[int], int]]]:
    """Per group name, in order of first appearance: a function taking the group's entries out
    of a column, and one mapping a position in the group back to the entry's index."""
    if len(order) == 1:
        return [(order[0], _whole, _same)]
    period = _period(names, len(order))
    if period is None:
        buckets: dict[str, list[int]] = {name: [] for name in order}
        for i, name in enumerate(names):
            buckets[name].append(i)
        return [(name, _gather(buckets[name]), buckets[name].__getitem__) for name in order]
    out: list[tuple[str, Take, Callable[[int], int]]] = []
    for name in order:
        at = [j for j in range(period) if names[j] == name]
        if len(at) == 1:  # once per period: every period-th entry from its first
            out.append((name, itemgetter(slice(at[0], None, period)), _stride(at[0], period)))
        else:
            idx = list(compress(range(len(names)), map(eq, names, repeat(name))))
            out.append((name, _gather(idx), idx.__getitem__))
    return out


def _period(names: list[str], distinct: int) -> int | None:
    """The shortest p with names[i] == names[i + p] everywhere (a fixed order of groups)."""
    for p in range(distinct, min(_MAX_PERIOD, len(names) // 2) + 1):
        if names[p : 2 * p] == names[:p] and names[p:] == names[:-p]:
            return p
    return None


def _gather(idx: list[int]) -> Take:
    if len(idx) == 1:
        only = idx[0]
        return lambda col: (col[only],)
    return itemgetter(*idx)


def _whole(col: Sequence[Any]) -> Sequence[Any]:
    return col


def _same(i: int) -> int:
    return i


def _stride(start: int, period: int) -> Callable[[int], int]:
    return lambda i: start + i * period

