"""One replica group's ranks in one sweep's view (:class:`GroupView`)."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .rank import STEP_TIMES_READ, RankView

# the phases a loop says it works outside the collectives on purpose (worker_server.checkpoint):
# a group in one is not hung while the others wait for it, up to --checkpoint-timeout
HELD_PHASES = ("checkpoint", "busy")


def in_held_phase(state: dict[str, Any] | None) -> bool:
    """The rank's answer says it is in a held phase (HELD_PHASES)."""
    return bool(state) and state.get("phase") in HELD_PHASES


class _cached:
    """functools.cached_property without Python 3.11's lock, which all instances share (two
    threads computing a value get the same value)."""

    def __init__(self, func: Callable) -> None:
        self.func, self.__doc__ = func, func.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        v = obj.__dict__[self.name] = self.func(obj)
        return v


def _carry(gv: GroupView) -> dict[str, Any]:
    """The values a GroupView's next generation inherits (GroupView.progressed)."""
    return gv.__dict__.setdefault("_carry", {})


class _kept(_cached):
    """A cached value progress alone leaves as it is: a moved group's next GroupView keeps it."""

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        v = obj.__dict__[self.name] = _carry(obj)[self.name] = self.func(obj)
        return v


def rank_order(r: RankView) -> tuple:
    return (r.rank if r.rank is not None else 1 << 62, r.url)


def newest_answers(members: Iterable[RankView]) -> dict[int | None, float]:
    """Rank -> when its newest process last answered (inf: one is live now)."""
    newest: dict[int | None, float] = {}
    for r in members:
        at = math.inf if r.reachable and r.state else r.answered_at
        if at is not None and at > newest.get(r.rank, -math.inf):
            newest[r.rank] = at
    return newest


def is_superseded(r: RankView, newest: dict[int | None, float]) -> bool:
    """Unreachable while another process holds its rank, live or heard from later: an old
    process of a restarted group, not a rank the monitor cannot reach (``newest``:
    :func:`newest_answers` of its group)."""
    at = r.answered_at if r.answered_at is not None else -math.inf
    return not r.reachable and newest.get(r.rank, -math.inf) > at


def grouped(g: int, members: list[RankView]) -> GroupView | None:
    """Group ``g`` of ``members``, setting each one's ``superseded`` (:func:`is_superseded`);
    None when none is current."""
    newest = newest_answers(members)
    ranks, old = [], []
    for r in members:
        r.superseded = is_superseded(r, newest)
        (old if r.superseded else ranks).append(r)
    if not ranks:
        return None
    ranks.sort(key=rank_order)
    return GroupView(g, ranks, old)


@dataclass
class GroupView:
    """One replica group's ranks; never changed once built, so each derived value is computed
    once, on first use."""

    replica_group: int
    ranks: list[RankView] = field(default_factory=list)
    superseded: list[RankView] = field(default_factory=list)  # its ranks' old processes

    @_cached
    def answered(self) -> list[RankView]:
        """Ranks that ever answered a valid /v1/state."""
        return [r for r in self.ranks if r.state is not None]

    @_kept
    def fresh_failed(self) -> bool:
        """A rank that answered before did not answer when polled this sweep."""
        return any(r.fresh and not r.reachable for r in self.answered)

    @_cached
    def reachable(self) -> list[RankView]:
        return [r for r in self.ranks if r.reachable]

    @_kept
    def replica_id(self) -> str | None:
        """The replica id most reachable ranks report (the current incarnation of the group)."""
        ids = [r.replica_id for r in self.reachable if r.replica_id]
        if not ids:
            ids = [r.replica_id for r in self.ranks if r.replica_id]
        return max(set(ids), key=ids.count) if ids else None

    @_cached
    def step(self) -> int | None:
        return max((int(r.state["step"]) for r in self.reachable if r.state), default=None)

    @_cached
    def step_at(self) -> float | None:
        """When its newest step committed, by the clock of a rank that made it (``last_step_at``);
        None where no rank says (e.g. torch's own server)."""
        times = [r.state.get("last_step_at") for r in self.reachable
                 if r.state and r.state.get("step") == self.step]
        return max((t for t in times if type(t) in (int, float) and math.isfinite(t)), default=None)

    @_kept
    def quorum_id(self) -> int | None:
        return max((int(r.state["quorum_id"]) for r in self.reachable if r.state), default=None)

    def median_step_seconds(self, last: int = STEP_TIMES_READ) -> float | None:
        """Median recent step time of its reachable ranks polled this sweep (else all reachable)."""
        cache = self.__dict__.setdefault("_median_steps", {})
        if last not in cache:
            ranks = [r for r in self.reachable if r.fresh] or self.reachable
            vals = [v for r in ranks for v in r.recent_steps()[-last:]]
            cache[last] = statistics.median(vals) if vals else None
        return cache[last]

    @_cached
    def leader(self) -> RankView | None:
        """Group rank 0 (the process running the group's Manager): a reachable one if any."""
        out, slot = None, -1
        for i, r in enumerate(self.ranks):
            if r.state is not None and r.state.get("group_rank") == 0 \
                    and (out is None or r.reachable):
                out, slot = r, i
        _carry(self)["_leader_slot"] = slot
        return out

    @_cached
    def held(self) -> dict[str, RankView]:
        """URL -> its ranks whose last answer is in a held phase (HELD_PHASES), reachable or not;
        a moved group's next GroupView updates it from the moved ranks alone (progressed)."""
        return {r.url: r for r in self.ranks if in_held_phase(r.state)}

    @_kept
    def reported_replica_ids(self) -> frozenset[str | None]:
        """The replica ids its reachable ranks report (None: a rank reporting none)."""
        return frozenset(r.replica_id for r in self.reachable)

    @_kept
    def hosts(self) -> set[str]:
        return {r.state["host"] for r in self.ranks if r.state and r.state.get("host")}

    @_kept
    def quorums(self) -> dict[int, int]:
        """quorum_id -> the most participants a reachable rank reports at it."""
        out: dict[int, int] = {}
        for r in self.reachable:
            if r.state:
                q = r.state["quorum_id"]
                out[q] = max(out.get(q, 0), int(r.state.get("num_participants", 0)))
        return out

    @_kept
    def taking_part(self) -> frozenset[int]:
        """The quorum ids its reachable ranks take part in (``participating``)."""
        return frozenset(r.state["quorum_id"] for r in self.reachable
                         if r.state and r.state.get("participating", True))

    @_kept
    def trust_counts(self) -> dict[tuple[str, str, bool] | None, int]:
        """RankView.verdict -> ranks (None: no verdict yet), over its ranks."""
        return dict(Counter(r.verdict for r in self.ranks))

    def progressed(self, ranks: list[RankView],
                   moved: list[tuple[RankView, RankView]]) -> GroupView:
        """This group after progress only: ``moved`` (last, new) RankViews swapped into their slots;
        the kept values and leader carry over, the rest is computed again on demand."""
        old = self.__dict__
        carry = old.get("_carry")
        if carry is not None:  # one dict shared by the generations: their values are equal
            d = carry.copy()
            d["_carry"] = carry
            slot = carry.get("_leader_slot")
            if slot is not None:
                d["leader"] = ranks[slot] if slot >= 0 else None
        else:
            d = {}
        d["replica_group"], d["ranks"], d["superseded"] = \
            self.replica_group, ranks, self.superseded
        new = object.__new__(GroupView)
        new.__dict__ = d
        n = len(ranks)
        for k in ("answered", "reachable"):  # the same ranks: every one of them, usually
            were = old.get(k)
            if were is not None and len(were) == n:
                d[k] = ranks
        held = old.get("held")
        if held is not None:  # every group is judged each sweep: its carried ranks not read
            held = d["held"] = held.copy()
            for was, rv in moved:
                st = rv.state
                if st is was.state and rv.url not in held:
                    continue  # carried, not held: still not
                if in_held_phase(st):
                    held[rv.url] = rv
                else:
                    held.pop(rv.url, None)
        step = old.get("step")
        if step is not None:
            for was, rv in moved:
                a, b = was.state["step"], rv.state["step"]
                if b < a:
                    break
                if b > step:
                    step = int(b)
            else:
                d["step"] = step
        return new

    @property
    def status(self) -> str:
        n = len(self.reachable)
        if n == 0:  # every rank said its training finished before it went: not lost, over
            return "ended" if self.ranks and all(r.ended for r in self.ranks) else "unreachable"
        if n < len(self.ranks):
            return "partial"
        return "up"
