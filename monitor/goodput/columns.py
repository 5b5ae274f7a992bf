"""The goodput ledger's per-group state as numpy columns, and what each group committed read
into them from the view: one vector operation per sweep over every group, where a Python pass
per group does not keep up (benchmarks/bench_ledger_scale.py)."""

from __future__ import annotations

from collections import deque
from functools import partial
from itertools import chain, compress, repeat
from operator import attrgetter, eq, is_not, ne
from typing import Any, NamedTuple

import numpy as np

from monitor.evidence.view import ClusterView

from .model import CAUSES, HUGE, UNSEEN, as_int


def key_of(g: int | None) -> str:
    return UNSEEN if g is None else str(g)


def with_none(values: np.ndarray, none: np.ndarray) -> list[Any]:
    return [None if n else v for v, n in zip(values.tolist(), none.tolist(), strict=True)]


class Slots:
    """Every group ever seen, by slot (kept for good); slot 0 holds the totals of the slots
    never seen. The totals have a kind axis (0: replica-seconds, 1: GPU-seconds)."""

    FILL = {"commits": -1, "last_in_quorum_at": np.nan}  # every other column starts at 0

    def __init__(self) -> None:
        self.gids: list[int | None] = [None]  # slot -> replica group
        self.index: dict[int, int] = {}  # replica group -> slot
        self.rid: list[str | None] = [None]  # the incarnation its commits are of
        # commits: last count of rid (-1: none); cum: over its incarnations; gpus: world size
        # (0: not known); born: the history sample it began at
        self.commits = np.full(1, -1, np.int64)
        self.cum, self.gpus, self.born = (np.zeros(1, np.int64) for _ in range(3))
        self.carry = np.zeros(1)  # below pace: credit held beyond the sweep (at most b)
        self.last_in_quorum_at = np.full(1, np.nan)
        # settled totals, and whether a row has that cause (a slot with expected time has a row)
        self.good, self.exp = np.zeros((2, 1)), np.zeros((2, 1))
        self.bad = np.zeros((2, len(CAUSES), 1))
        self.has = np.zeros((2, len(CAUSES), 1), bool)

    def __len__(self) -> int:
        return len(self.gids)

    def add(self, groups: list[int], born: int) -> None:
        for g in groups:
            self.index[g] = len(self.gids)
            self.gids.append(g)
            self.rid.append(None)
        fill = {**self.FILL, "born": born}
        for name in ("commits", "cum", "gpus", "born", "carry", "last_in_quorum_at", "good",
                     "exp", "bad", "has"):
            col = getattr(self, name)
            more = np.full((*col.shape[:-1], len(groups)), fill.get(name, 0), col.dtype)
            setattr(self, name, np.concatenate([col, more], axis=-1))

    def size_unseen(self) -> None:
        """Give slot 0 (groups never seen) the most common known world size."""
        sizes = self.gpus[1:][self.gpus[1:] > 0].tolist()
        self.gpus[0] = max(set(sizes), key=sizes.count) if sizes else 0

    def add_good(self, slots: np.ndarray, good: np.ndarray, dt: float) -> None:
        self.good[0, slots] += good
        self.exp[0, slots] += dt
        gpus = self.gpus[slots]
        on = gpus > 0
        if on.any():
            self.good[1, slots[on]] += good[on] * gpus[on]
            self.exp[1, slots[on]] += dt * gpus[on]

    def add_bad(self, slots: np.ndarray, cause: str, seconds: list[float],
                gpus: list[int | None]) -> None:
        c, sec = CAUSES.index(cause), np.asarray(seconds)
        self.bad[0, c, slots] += sec
        self.has[0, c, slots] = True
        n = np.fromiter((x or 0 for x in gpus), np.int64, len(gpus))
        on = n > 0
        if on.any():
            self.bad[1, c, slots[on]] += sec[on] * n[on]
            self.has[1, c, slots[on]] = True

    def totals_columns(self, kind: int = 0) -> dict[str, Any]:
        """Per row (a slot that has accounted time): its key, goodput, expected and badput by
        cause (None where the row lacks the cause)."""
        order = np.flatnonzero(self.exp[kind] > 0)
        out: dict[str, Any] = {"key": [key_of(self.gids[s]) for s in order.tolist()],
                               "goodput": self.good[kind, order].tolist(),
                               "expected": self.exp[kind, order].tolist()}
        bad, has = self.bad[kind][:, order], self.has[kind][:, order]
        for c, cause in enumerate(CAUSES):
            if has[c].any():
                out[cause] = with_none(bad[c], ~has[c])
        return out

    def totals_rows(self, kind: int = 0) -> dict[str, dict[str, float]]:
        """:meth:`totals_columns` as key -> row (a row lacks the causes it never had)."""
        cols = self.totals_columns(kind)
        causes = [c for c in CAUSES if c in cols]
        return {key: {**{c: cols[c][i] for c in causes if cols[c][i] is not None},
                      "goodput": cols["goodput"][i], "expected": cols["expected"][i]}
                for i, key in enumerate(cols["key"])}

    def ratios(self) -> tuple[dict[int, float], float | None]:
        """Each seen group's goodput / expected seconds, and the job's."""
        rows = np.flatnonzero(self.exp[0] > 0)
        groups = rows[rows > 0]
        each = dict(zip(map(self.gids.__getitem__, groups.tolist()),
                        (self.good[0, groups] / self.exp[0, groups]).tolist(), strict=True))
        expected = sum(self.exp[0, rows].tolist(), 0.0)
        job = sum(self.good[0, rows].tolist(), 0.0) / expected if expected > 0 else None
        return each, job


class History:
    """Every slot's cumulative commits at each sweep over the pace window (from its ``born``
    sample on); one sample at or before the window's start is kept."""

    def __init__(self) -> None:
        self.t: deque[float] = deque()
        self.cum: deque[np.ndarray] = deque()
        self.first = 0  # the number of the oldest sample kept

    @property
    def next(self) -> int:
        return self.first + len(self.t)

    def append(self, now: float, cum: np.ndarray, window: float) -> None:
        self.t.append(now)
        self.cum.append(cum.copy())
        end = now - window
        while len(self.t) >= 2 and self.t[1] <= end:
            self.t.popleft()
            self.cum.popleft()
            self.first += 1

    def pace(self, slots: np.ndarray, born: np.ndarray, window: float, b: float) -> np.ndarray:
        """:func:`monitor.goodput.pace.pace_of` of each slot's history (nan: None, as over
        less than ``2 x b``: a group just seen, or a monitor just restarted from an older
        snapshot)."""
        out = np.full(len(slots), np.nan)
        if not self.t or not len(slots):
            return out
        ts = np.fromiter(self.t, float, len(self.t))
        t_end = ts[-1]
        first = np.maximum(born[slots], self.first) - self.first
        last = len(ts) - 1
        # the last sample at or before the window's start, else its first
        at = int(np.searchsorted(ts, t_end - window, side="right")) - 1
        start = np.maximum(first, at)
        v_end = self.cum[-1][slots]
        v_start = np.empty(len(slots), np.int64)
        for u in np.unique(start).tolist():
            if u > last:
                continue
            m = start == u
            v_start[m] = self.cum[u][slots[m]]
        span = t_end - ts[np.minimum(start, last)]
        ok = (first < last) & (span > 0) & (span >= 2 * b)  # as pace_of: shorter says nothing
        out[ok] = np.maximum(0, v_end[ok] - v_start[ok]) * b / span[ok]
        return out


class Sweep(NamedTuple):
    t0: float
    t1: float
    before: np.ndarray  # per slot: its cum before the sweep
    after: np.ndarray  # and after it
    credit: np.ndarray  # the credit beyond ``commits x b`` (nan: not judged in it)


class Judged(deque[Sweep]):
    """The sweeps over the horizon, kept for re-judging."""

    def drop_before(self, t: float) -> None:
        while self and self[0].t1 < t:
            self.popleft()

    def add(self, t0: float, t1: float, n: int, slots: np.ndarray, before: np.ndarray,
            after: np.ndarray, credit: np.ndarray) -> None:
        b, a, c = np.zeros(n, np.int64), np.zeros(n, np.int64), np.full(n, np.nan)
        b[slots], a[slots], c[slots] = before, after, credit
        self.append(Sweep(t0, t1, b, a, c))

    def dense(self, n: int) -> tuple[np.ndarray, ...]:
        """(t0, t1) per sweep, (before, after, credit) as sweeps x slots (a slot added since a
        sweep: not judged in it)."""
        k = len(self)
        before, after = np.zeros((k, n), np.int64), np.zeros((k, n), np.int64)
        credit = np.full((k, n), np.nan)
        for i, sweep in enumerate(self):
            m = len(sweep.credit)
            before[i, :m], after[i, :m], credit[i, :m] = sweep.before, sweep.after, sweep.credit
        times = np.array([(sweep.t0, sweep.t1) for sweep in self], float)
        return times[:, 0], times[:, 1], before, after, credit


_POSITIONS = range(1 << 30)  # flat rank positions for compress()
_NO_COUNT = object()  # a state without "commits"
_COUNTED = -2  # a rank's "step" read as a count: none, it reports "commits"
_READ = attrgetter("replica_id", "reachable", "step")  # what is read of a GroupView


class CommitReader:
    """A group's commit count is the most any reachable rank of its replica id reports, its world
    size the one most report. A group with no count (``--torch-stores``) counts its step's rise
    in its incarnation, never more in a sweep than the quorum's newest step rose (a healing group
    jumps to it). A hot loop: only the ranks whose state is new are read."""

    def __init__(self) -> None:
        self._last: tuple | None = None  # what the last read saw
        self.quorum_steps: list[int] = []  # the last read's in-quorum groups' steps
        self.step_at: float | None = None  # the newest of them committed at (the rank's clock)
        # the newest of quorum_steps (kept where none is): a step-counted group's rise is
        # clamped by its rise (a snapshot keeps it: a restart must not credit a heal's jump)
        self.top: int | None = None
        self.quorum_rids: list[str | None] = []
        self.rids: list[str | None] = []  # every group's in the view

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
        self.rids = rids
        inq = list(map(in_quorum.__contains__, keys))
        self.quorum_steps = list(filter(partial(is_not, None), compress(steps, inq)))
        self.quorum_rids = list(compress(rids, inq))  # their incarnations (and stepless ones')
        self.step_at = None  # when the furthest in-quorum group committed its newest step
        top = max(self.quorum_steps) if self.quorum_steps else None
        rise = None if top is None or self.top is None else max(0, top - self.top)
        self.top = top if top is not None else self.top
        if top is not None:
            self.step_at = next((gv.step_at for gv, s, q in zip(groups.values(), steps, inq,
                                                                  strict=True)
                                 if q and s == top), None)
        flat = list(chain.from_iterable(reaches))
        if rd is not None and rd[0] == keys and rd[3] == lens:
            owner, commits, sizes, states, stepc = rd[5], rd[6], rd[7], rd[8], rd[9]
            todo = compress(_POSITIONS, map(is_not, flat, rd[4]))
            if rd[2] != rids:  # a new incarnation: every rank of that group again
                again = set(compress(_POSITIONS, map(ne, rids, rd[2])))
                todo = sorted(set(todo).union(i for i, o in enumerate(owner) if o in again))
                states = [None] * len(flat)
        else:
            owner = list(chain.from_iterable(map(repeat, range(len(lens)), lens)))
            commits, sizes = np.full(len(flat), -1, np.int64), np.full(len(flat), -1, np.int64)
            stepc = np.full(len(flat), -1, np.int64)
            states = [None] * len(flat)
            todo = range(len(flat))
        read, counts, of_size, by_step = [], [], [], []
        for i in todo:  # -1: not of the group's incarnation, or not a count
            st = flat[i].state
            if st is states[i]:
                continue
            states[i] = st
            read.append(i)
            if not st or st.get("replica_id") != rids[owner[i]]:
                counts.append(-1)
                of_size.append(-1)
                by_step.append(-1)
                continue
            c = st.get("commits", _NO_COUNT)
            if c is _NO_COUNT:  # no count reported (torch's debug server): its step, if one
                s = st.get("step")
                s = s if type(s) is int else as_int(s)
                by_step.append(s if s is not None and 0 <= s < HUGE else -1)
                c = None
            else:
                by_step.append(_COUNTED)
                if type(c) is not int:  # JSON's ints pass as they are
                    c = as_int(c)
            n = st.get("group_world_size")
            if type(n) is not int:
                n = as_int(n)
            counts.append(c if c is not None and 0 <= c < HUGE else -1)
            of_size.append(n if n is not None and 1 <= n < HUGE else -1)
        commits[read] = counts
        sizes[read] = of_size
        stepc[read] = by_step
        self._last = (keys, vslots, rids, lens, flat, owner, commits, sizes, states, stepc)
        # per group with a reachable rank: the most commits, the world sizes
        has = np.asarray(lens) > 0
        offsets = np.cumsum(lens) - lens
        starts = offsets[has]
        c = np.full(len(keys), -1, np.int64)
        c[has] = np.maximum.reduceat(commits, starts) if len(starts) else []
        # no rank of the group's incarnation reports a count (a rank that does: _COUNTED, the
        # least), one reports a step: the group's count is its step
        stepped = np.full(len(keys), -1, np.int64)
        if len(starts):
            low = np.minimum.reduceat(np.where(stepc == -1, HUGE, stepc), starts)
            stepped[has] = np.where(low == _COUNTED, -1, np.maximum.reduceat(stepc, starts))
        stepped[c >= 0] = -1
        c = np.where(stepped >= 0, stepped, c)
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
        by = stepped[got] >= 0
        if by.any():  # a step reached before this incarnation was seen is no commit of it
            rose = np.where(same & (was >= 0), np.maximum(0, c - was), 0)
            d = np.where(by, rose if rise is None else np.minimum(rose, rise), d)
        for i in np.flatnonzero(~same).tolist():
            S.rid[vs[i]] = rid_got[i]
        S.commits[vs] = c
        S.cum[vs] += d
        S.last_in_quorum_at[vs[np.asarray(inq, bool)[got]]] = now
        deltas = np.zeros(len(S), np.int64)
        deltas[vs] = d
        return deltas
