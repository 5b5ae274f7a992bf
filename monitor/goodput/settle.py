"""Badput runs from booking to settlement: counted at once when their cause is sure, else held
open to a later incident's claim, settled in time order; apart from the accounting that books."""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from typing import Any

import numpy as np

from .columns import key_of
from .incidents import UNSTOPPING
from .model import PENDING, UNSEEN, Incident, Interval, Run, SweepAccount


class GoodputSettlement:
    """The settling half of :class:`monitor.goodput.ledger.GoodputLedger` (mixed into it)."""

    def _provisional(self, r: Run) -> bool:
        """Idle time booked to what cannot stop commits (the drag of a fault that cannot, a
        recovery: its kill acted on its fault), with no commit since: maybe the start of a
        later fault's stall, open to its claim."""
        if not r.idle or r.cause not in ("straggler_drag", "recovery"):
            return False
        inc = self.incidents.get(r.incident)
        return (r.cause == "recovery" or inc is None or inc.kind in UNSTOPPING) and (
            self.last_commit_at is None or self.last_commit_at < r.t1 - 1e-9)

    def _unsure(self, r: Run) -> bool:
        return r.cause == "recovery" and r.eviction_id in self.unsure_kills

    def _run(self, t0: float, t1: float, slots: np.ndarray, seconds: list[float], cause: str,
             **kw: Any) -> Run:
        """Badput of ``slots``, with their groups and world sizes."""
        S = self.slots
        return Run(t0, t1, slots, list(map(S.gids.__getitem__, slots.tolist())), seconds,
                   [n or None for n in S.gpus[slots].tolist()], cause, **kw)

    def _book(self, r: Run, inc: Incident | None, acct: SweepAccount) -> None:
        """Counted now unless its cause may still change (then once settled)."""
        _link(r, inc)
        self.runs.append(r)
        if r.cause != PENDING and not self._provisional(r) and not self._unsure(r):
            acct.badput[r.cause] = sum(r.seconds, acct.badput[r.cause])
            r.counted = True

    def _settle(self, now: float, acct: SweepAccount) -> None:
        """Badput nothing can change any more becomes final: tied to an incident, startup or
        unseen at once, the rest after the horizon (pending as unattributed), in time order."""
        cutoff = now - self.job.horizon
        keep: list[Run] = []
        blocked = np.zeros(len(self.slots), bool)  # an earlier run of the slot is open
        for r in self.runs:
            sure = r.cause != PENDING and not self._provisional(r) and not self._unsure(r) and (
                r.incident is not None or r.cause == "startup" or r.groups[0] is None)
            if not (sure or r.t1 <= cutoff):
                blocked[r.slots] = True
                keep.append(r)
                continue
            if sure and not r.counted:  # its cause is final: counted now, settled in order
                acct.badput[r.cause] = sum(r.seconds, acct.badput[r.cause])
                r.counted = True
            held = blocked[r.slots]
            if held.any():
                if held.all():
                    keep.append(r)
                    continue
                keep.append(r.part(held))
                r = r.part(~held)
            if r.cause == PENDING:
                r.cause = "unattributed"
            if not r.counted:
                acct.badput[r.cause] = sum(r.seconds, acct.badput[r.cause])
                r.counted = True
            self._settle_run(r)
        self.runs = keep
        # an interval that neither this sweep nor an open run continues is over
        continued = defaultdict(partial(np.zeros, len(self.slots), bool))  # start -> slots
        for r in keep:
            continued[round(r.t0, 6)][r.slots] = True
        for key, iv in list(self.open_intervals.items()):
            if iv.end < now - 1e-6:
                at = continued.get(round(iv.end, 6))
                if at is None or not at[0 if key == UNSEEN else self.slots.index[int(key)]]:
                    self._close_interval(self.open_intervals.pop(key))

    def _settle_run(self, r: Run) -> None:
        self.slots.add_bad(r.slots, r.cause, r.seconds, r.gpus)
        inc = self.incidents.get(r.incident)
        if inc is not None:
            inc.charge(r)
            self.incidents.dirty.add(inc.id)
        for g, x, m in zip(r.groups, r.seconds, r.gpus, strict=True):
            key = key_of(g)
            cur = self.open_intervals.get(key)
            if cur is None or not cur.extend(r, x, m):
                if cur is not None:
                    self._close_interval(cur)
                self.open_intervals[key] = Interval.of(r, g, x, m)

    def _close_interval(self, iv: Interval) -> None:
        self.intervals.append(iv)
        self._closed_intervals.append(iv)


def _link(r: Run, inc: Incident | None) -> None:
    if inc is None:
        return
    r.incident = inc.id
    r.finding_id = inc.finding_ids[0] if inc.finding_ids else None
    r.eviction_id = inc.eviction_id if inc.evicted_at is not None \
        and inc.evicted_at < r.t1 else None
