"""Arrival lags at torchft's cross-replica-group collectives: the live straggler's evidence.

:func:`arrival_lags` reads normalized traces (:func:`~monitor.analysis.engine.normalize_dumps`)
and, for the newest collectives of torchft's *current* incarnation (the one
:func:`~monitor.analysis.engine.current_groups` names: entries matched by ``(quorum_id,
group_rank)`` and ``collective_seq_id``, as the engine matches them), says how long after the
first rank each rank enqueued it. The others wait at the all_reduce for the last one.

It compares ``time_created_ns`` of different hosts, so it assumes clocks synced well below the
lags that matter (NTP/PTP: ms). That is the one assumption the engine's own straggler rule avoids;
this query is kept apart so that clock-free evidence (each rank's own compute vs. wait time) can
replace it without touching alignment, mismatch or hang logic.

It never raises on what a dump holds: a collective some rank lacks, or enqueued without a usable
timestamp, is skipped; a current incarnation that a rank with a dump declared but has no entries
of yet gives no lags (the ranks cannot all be compared yet).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from .engine import current_groups
from .model import GroupKey, RankTrace

__all__ = ["ArrivalLags", "arrival_lags"]


class ArrivalLags(NamedTuple):
    """One collective of a torchft incarnation: each rank's lag (s) behind the first to enqueue it."""

    group: GroupKey
    seq: int
    lags_s: dict[int, float]

    @property
    def quorum_id(self) -> int | None:
        return self.group.quorum_id


def arrival_lags(traces: Mapping[int, RankTrace], last: int = 4) -> list[ArrivalLags]:
    """Lags at the newest ``last`` collectives every participant of torchft's current
    incarnation enqueued, oldest first, per incarnation (one per group rank).

    Participants are the ranks among ``traces`` that declare the incarnation or hold entries of
    it; at least two must have a timestamp for a collective to count.
    """
    out: list[ArrivalLags] = []
    for key in sorted(current_groups(traces), key=lambda k: (k.pg, k.group_rank or 0)):
        if key.quorum_id is None:
            continue  # not torchft's cross-group process group
        participants = {r: t.groups.get(key) for r, t in traces.items() if key in t.groups or key in t.incarnations}
        rows = {r: row for r, row in participants.items() if row is not None}
        if len(rows) < 2 or len(rows) < len(participants):
            continue
        lo = max(row.first_seq for row in rows.values())
        common: list[int] = []
        seq = min(row.last_seq for row in rows.values())
        while seq >= lo and len(common) < last:
            if all(row.sigs[seq - row.first_seq] is not None for row in rows.values()):
                common.append(seq)
            seq -= 1
        for seq in reversed(common):
            times = {}
            for r, row in rows.items():
                created = row.created_ns[seq - row.first_seq]
                if isinstance(created, int) and created > 0:
                    times[r] = created
            if len(times) < 2:
                continue
            first = min(times.values())
            out.append(ArrivalLags(key, seq, {r: (t - first) / 1e9 for r, t in times.items()}))
    return out
