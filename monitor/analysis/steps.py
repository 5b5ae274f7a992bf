"""A rank's own repeating per-step pattern of collectives: training issues the same collectives
every step, so the participant of a majority-less mismatch whose collective breaks its pattern,
while another's follows its own, is the likely culprit. Shared by the engine (the finding's
``departs_from_step_pattern``, and whether a rank's own history holds whole steps) and the
monitor's mismatch detector.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .model import GroupKey, GroupTrace, RankTrace

# A pattern is trusted only over this many collectives besides the one judged: inside a job's
# (or a quorum's) first step, a few layers of one size (or two alternating) look like a short
# period, and the step's next collective would "break" it.
_MIN_SEEN = 8


def _period(sigs: list[int | None], skip: int, max_period: int = 128) -> int | None:
    """The shortest period of a rank's collectives (one step's pattern) without position
    ``skip``; None when none holds for 9 in 10 over three periods and ``_MIN_SEEN`` collectives."""
    n = len(sigs)
    if sum(1 for i, s in enumerate(sigs) if s is not None and i != skip) < _MIN_SEEN:
        return None
    for p in range(1, min(max_period, n // 3) + 1):
        same = total = 0
        allowed = 0.1 * (n - p)  # give up on this period once too many positions disagree
        for i in range(p, n):
            if i == skip or i - p == skip or sigs[i] is None or sigs[i - p] is None:
                continue
            total += 1
            if sigs[i] == sigs[i - p]:
                same += 1
            elif total - same > allowed:
                break
        if total >= 2 * p and same >= 0.9 * total:
            return p
    return None


def _expected(sigs: list[int | None], i: int, p: int) -> int | None:
    for k in range(1, 4):
        for j in (i - k * p, i + k * p):
            if 0 <= j < len(sigs) and sigs[j] is not None:
                return sigs[j]
    return None


def step_pattern_departures(traces: Mapping[int, RankTrace], key: GroupKey, seq: int,
                            ranks: Iterable[int]) -> list[int]:
    """Those of ``ranks`` whose collective at ``seq`` of group ``key`` breaks their own per-step
    pattern, when another of them follows its own; else none."""
    departs, conforms = [], []
    for rank in ranks:
        t = traces.get(rank)
        row = t.groups.get(key) if t is not None else None
        if row is None or not row.first_seq <= seq <= row.last_seq:
            continue
        sigs, i = _around(row, seq)
        p = _period(sigs, i)
        expected = None if p is None else _expected(sigs, i, p)
        if expected is None:
            continue
        (conforms if expected == sigs[i] else departs).append(rank)
    return sorted(departs) if departs and conforms else []


def has_step_pattern(row: GroupTrace | None, seq: int) -> bool:
    """Whether ``row`` shows a repeating per-step pattern around ``seq`` (its steps seen whole)."""
    if row is None or not row.first_seq <= seq <= row.last_seq:
        return False
    return _period(*_around(row, seq)) is not None


def _around(row: GroupTrace, seq: int) -> tuple[list[int | None], int]:
    """The row's collectives around ``seq`` and its index among them: the steps around it are
    enough to see the pattern (and keep this cheap)."""
    lo = max(0, seq - row.first_seq - 600)
    return row.sigs[lo:seq - row.first_seq + 300], seq - row.first_seq - lo


def departs_from_step_pattern(traces: Mapping[int, RankTrace], raw: Mapping[str, Any]) -> list[int]:
    """:func:`step_pattern_departures` of a mismatch finding's dict (its ``variants`` ranks)."""
    seq = raw.get("seq")
    if not isinstance(seq, int):
        return []
    key = GroupKey(raw.get("pg"), raw.get("replica_group"), raw.get("quorum_id"),
                   raw.get("group_rank"))
    return step_pattern_departures(traces, key, seq,
                                   [r for v in raw.get("variants") or [] for r in v.get("ranks") or []])
