"""What each replica group committed since the last sweep, read from the view's ranks."""

from __future__ import annotations

from functools import partial
from itertools import chain, compress, repeat
from operator import attrgetter, eq, is_not, ne

import numpy as np

from monitor.evidence.view import ClusterView

from .columns import Slots
from .model import HUGE, as_int

_POSITIONS = range(1 << 30)  # flat rank positions for compress()
_READ = attrgetter("replica_id", "reachable", "step")  # what is read of a GroupView


class CommitReader:
    """A group's commit count is the most any reachable rank of its replica id reports, its world
    size the one most report. A hot loop: only the ranks whose state is new are read."""

    def __init__(self) -> None:
        self._last: tuple | None = None  # what the last read saw
        self.quorum_steps: list[int] = []  # the last read's in-quorum groups' steps

    def read(self, view: ClusterView, in_quorum: set[int], S: Slots, born: int, now: float,
             first: bool) -> np.ndarray:
        """Update ``S`` (new groups born at history sample ``born``) and return the commits
        each slot made since the last sweep."""
        groups = view.groups
        keys = list(groups)
        rd = self._last
        if rd is None or rd[0] != keys:
            new = [g for g in keys if g not in S.index]
            if new:
                S.add(new, born)
            vslots = np.fromiter(map(S.index.__getitem__, keys), np.int64, len(keys))
        else:
            vslots = rd[1]
        rows = list(map(_READ, groups.values()))
        rids, reaches, steps = zip(*rows, strict=True) if rows else ((), (), ())
        rids, lens = list(rids), list(map(len, reaches))
        inq = list(map(in_quorum.__contains__, keys))
        self.quorum_steps = list(filter(partial(is_not, None), compress(steps, inq)))
        flat = list(chain.from_iterable(reaches))
        if rd is not None and rd[0] == keys and rd[3] == lens:
            owner, commits, sizes, states = rd[5], rd[6], rd[7], rd[8]
            todo = compress(_POSITIONS, map(is_not, flat, rd[4]))
            if rd[2] != rids:  # a new incarnation: every rank of that group again
                again = set(compress(_POSITIONS, map(ne, rids, rd[2])))
                todo = sorted(set(todo).union(i for i, o in enumerate(owner) if o in again))
                states = [None] * len(flat)
        else:
            owner = list(chain.from_iterable(map(repeat, range(len(lens)), lens)))
            commits, sizes = np.full(len(flat), -1, np.int64), np.full(len(flat), -1, np.int64)
            states = [None] * len(flat)
            todo = range(len(flat))
        read, counts, of_size = [], [], []
        for i in todo:  # -1: not of the group's incarnation, or not a count
            st = flat[i].state
            if st is states[i]:
                continue
            states[i] = st
            read.append(i)
            if not st or st.get("replica_id") != rids[owner[i]]:
                counts.append(-1)
                of_size.append(-1)
                continue
            c = st.get("commits")
            if type(c) is not int:  # JSON's ints pass as they are
                c = as_int(c)
            n = st.get("group_world_size")
            if type(n) is not int:
                n = as_int(n)
            counts.append(c if c is not None and 0 <= c < HUGE else -1)
            of_size.append(n if n is not None and 1 <= n < HUGE else -1)
        commits[read] = counts
        sizes[read] = of_size
        self._last = (keys, vslots, rids, lens, flat, owner, commits, sizes, states)
        # per group with a reachable rank: the most commits, the world sizes
        has = np.asarray(lens) > 0
        offsets = np.cumsum(lens) - lens
        starts = offsets[has]
        c = np.full(len(keys), -1, np.int64)
        c[has] = np.maximum.reduceat(commits, starts) if len(starts) else []
        most = np.full(len(keys), -1, np.int64)
        least = np.full(len(keys), -1, np.int64)
        if len(starts):
            most[has] = np.maximum.reduceat(sizes, starts)
            least[has] = np.minimum.reduceat(np.where(sizes < 0, 1 << 62, sizes), starts)
        sized = most >= 1
        S.gpus[vslots[sized & (least == most)]] = most[sized & (least == most)]
        for i in np.flatnonzero(sized & (least != most)).tolist():  # the majority's
            o = int(offsets[i])
            vals = [v for v in sizes[o:o + lens[i]].tolist() if v >= 1]
            S.gpus[vslots[i]] = max(set(vals), key=vals.count)
        # what each group committed since the last sweep (a new incarnation: all its commits)
        got = c >= 0
        vs = vslots[got]
        c = c[got]
        was = S.commits[vs]
        old_rids = list(map(S.rid.__getitem__, vs.tolist()))
        rid_got = list(compress(rids, got))
        same = np.fromiter(map(eq, rid_got, old_rids), bool, len(vs))
        d = np.where(was < 0, np.where(same | first, 0, c),
                     np.where(same, np.maximum(0, c - was), c))
        for i in np.flatnonzero(~same).tolist():
            S.rid[vs[i]] = rid_got[i]
        S.commits[vs] = c
        S.cum[vs] += d
        S.last_in_quorum_at[vs[np.asarray(inq, bool)[got]]] = now
        deltas = np.zeros(len(S), np.int64)
        deltas[vs] = d
        return deltas
