"""A RankTrace as the loader's workers send it: compact columns that come back equal and of the
same type (a column an array cannot hold exactly travels as a list).
"""

from __future__ import annotations

import pickle
from array import array
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from .model import GroupTrace, RankTrace


class Packed:
    """A RankTrace whose groups are :func:`pack_group`'s columns, its groups and members taken
    out of it and kept here, the members packed."""

    __slots__ = ("trace", "columns", "members")

    def __init__(self, trace: RankTrace) -> None:
        self.trace, self.columns = trace, trace.groups
        self.members = {key: pack_ranks(ranks) for key, ranks in trace.members.items()}
        trace.groups, trace.members = {}, {}


def to_bytes(packed: Packed) -> bytes:
    """What a worker sends; the parent decodes them all once every worker is done
    (docs/analyze.md, Performance)."""
    return pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL)


def from_bytes(blob: bytes) -> RankTrace:
    """The trace :func:`to_bytes` sent (this process's own workers' pickles only)."""
    packed = pickle.loads(blob)
    trace = packed.trace
    trace.groups = {
        key: GroupTrace(first_seq, _as_list(sigs), _as_list(states), _as_sequence(created), _as_sequence(durations))
        for key, (first_seq, sigs, states, created, durations) in packed.columns.items()
    }
    trace.members = {key: _as_ranks(ranks) for key, ranks in packed.members.items()}
    return trace


def pack_ranks(ranks: tuple[int, ...]) -> Any:
    if single_type(ranks) is int:
        try:
            return array("q", ranks).tobytes()
        except OverflowError:
            pass
    return ranks


def _as_ranks(packed: Any) -> tuple[int, ...]:
    return _unpack_ranks(packed) if type(packed) is bytes else packed


@lru_cache(maxsize=4096)  # every dump repeats its groups' member lists: one shared tuple each
def _unpack_ranks(packed: bytes) -> tuple[int, ...]:
    return tuple(array("q", packed))


def pack_group(first_seq: int, sigs: list, states: list, created: Sequence[Any], durations: Sequence[Any],
               kinds: tuple) -> tuple:
    """A group's packed columns; ``kinds``: the value columns' one type each, if known."""
    # signature ids (None: a hole) and state codes are ints
    return (first_seq, pack_column(sigs, int), pack_column(states, int), pack_column(created, kinds[0]),
            pack_column(durations, kinds[1]))


def pack_column(values: Sequence[Any], one_type: type | None = None) -> Any:
    """One value and a count, a machine array, or a list; ``one_type``: every value's type if
    known (spares a pass)."""
    if not values:
        return _listed(values)
    kind = type(values[0])
    known = one_type is kind
    # first and last differ in nearly every column of enqueue times: the count is spared
    if values[-1] == values[0] and values.count(values[0]) == len(values):
        return ("same", values[0], len(values)) if known or single_type(values) is kind else _listed(values)
    if kind is not int and kind is not float:
        return _listed(values)
    try:
        packed = array("q" if kind is int else "d", values)
    except (TypeError, OverflowError):  # another type among them, or an int beyond 64 bits
        return _listed(values)
    # an array of ints also takes a bool, one of floats an int: the values must be of one type
    return packed if known or single_type(values) is kind else _listed(values)


def single_type(values: Sequence[Any]) -> type | None:
    """The type of every value, None when they are of several (or none)."""
    kinds = set(map(type, values))
    return kinds.pop() if len(kinds) == 1 else None


def _listed(values: Sequence[Any]) -> list:
    return values if type(values) is list else list(values)


def _as_list(packed: Any) -> list:
    if type(packed) is array:
        return packed.tolist()
    if type(packed) is tuple:
        _, value, count = packed
        return [value] * count
    return packed


def _as_sequence(packed: Any) -> Sequence[Any]:
    return packed if type(packed) is array else _as_list(packed)
