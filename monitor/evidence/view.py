"""Folds the poller's sweeps into :class:`ClusterView` s, keeping per-target memory.

:class:`ViewBuilder` remembers each target's last good ``/v1/state`` and how long it has been
unreachable; a sweep's work grows with the ranks asked, not the ranks known (docs/scaling.md).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

from monitor.poll.discovery import Target
from monitor.poll.poller import RankPoll

from .cluster import ClusterView, Sums
from .group import GroupView, grouped, is_superseded, newest_answers, rank_order
from .rank import STEP_TIMES_READ, RankView, answered, not_state, plain_shape, state_shape
from .verification import restored

__all__ = ["STEP_TIMES_READ", "ClusterView", "GroupView", "RankView", "ViewBuilder"]

_NOT_SEEN = object()


def _resum(sums: Sums, before: GroupView | None, after: GroupView | None) -> None:
    """``sums`` with group ``before`` replaced by ``after`` (None: none)."""
    if before is not after:
        if before is not None:
            sums.add(before, -1)
        if after is not None:
            sums.add(after, 1)


def _in_answer_order(polls: dict[str, RankPoll], polled: set[str]
                     ) -> Iterable[tuple[str, RankPoll | None]]:
    """(URL, its poll or None) for every URL of ``polled``, answered ones first in the order
    they came: their documents' order in memory, far fewer cache misses (docs/scaling.md)."""
    if len(polls) == len(polled) and polls.keys() <= polled:
        return polls.items()  # the usual sweep: an answer (or a failed poll) for each
    return chain(((u, p) for u, p in polls.items() if u in polled),
                 ((u, None) for u in polled - polls.keys()))


class ViewBuilder:
    """Folds sweeps into ClusterViews, from the last one when the targets are the same: only groups
    with a changed rank are grouped again, a group whose ranks only moved only progresses."""

    def __init__(self) -> None:
        self._ranks: dict[str, RankView] = {}
        self._targets: list[Target] = []
        self._fresh: list[str] = []  # the URLs the last sweep polled, in answer order
        self.changed: set[str] = set()  # URLs whose RankView the last update made anew
        self.reshaped: set[str] = set()  # those of them that did more than progress
        self._forget()

    def _forget(self) -> None:
        """Drop what is kept of the groups (the next update groups every rank again)."""
        self._group_of: dict[str, int | None] = {}  # url -> the group it is in (None: none)
        self._members: dict[int | None, dict[str, RankView]] = {}  # superseded ones too
        self._groups: dict[int, GroupView] = {}
        self._ev_groups: dict[int, GroupView] = {}
        self._ev_ranks: dict[str, RankView] = {}
        self._slot: dict[str, int] = {}  # url -> its index in its GroupView's ranks
        self._shapes: dict[str, tuple] = {}  # url -> state_shape of its last answer
        self._sums, self._ev_sums = Sums(), Sums()
        self._unreachable: dict[str, float] = {}

    def seed(self, unreachable: dict[str, tuple[float | None, dict[str, Any], dict | None]]
             ) -> None:
        """Before the first update: ranks an earlier run saw stop answering (url -> since, last
        state, its verdict then), so that a restarted monitor still knows whose they were."""
        for url, (since, state, trust) in unreachable.items():
            if not_state(state, None, None) is None:
                self._ranks[url] = RankView(url, False, state, unreachable_since=since,
                                            trust=restored(trust, state))

    def update(self, targets: list[Target], polls: dict[str, RankPoll],
               now: float | None = None, polled: set[str] | None = None,
               judge: Callable[[dict[str, RankView], set[str]], dict[str, Any]] | None = None
               ) -> ClusterView:
        """The sweep's view. ``polled``: the URLs asked (default: all), the rest keep their last
        RankView. ``judge`` (Verifier.judge): the verdicts that change (None: none)."""
        now = time.time() if now is None else now
        prev = self._ranks
        same = (polled is not None and bool(prev) and len(targets) == len(self._targets)
                and all(map(operator.is_, targets, self._targets)))
        # hot loops over every rank asked (benchmarks/bench_view.py): locals on purpose
        # group -> (last, new) RankView of its ranks answering again with the same shape
        moved: dict[int, list[tuple[RankView, RankView]]] = {}
        rejudge: set[str] = set()  # new RankViews whose reachability or shape changed
        rest: set[str] = set()  # the changed URLs not moving: their groups are grouped again
        if same:
            current = dict(prev)
            carried = [u for u in self._fresh if u not in polled]
            changed = polled.union(carried)
            group_of = self._group_of
            for url in carried:
                was = prev[url]
                rv = current[url] = was.clone()
                rv.fresh = False
                if was.reachable and not was.superseded:  # its state: the same
                    moved.setdefault(group_of[url], []).append((was, rv))
                else:
                    rest.add(url)
            polled_rank, shapes = self._polled, self._shapes
            for url, p in _in_answer_order(polls, polled):
                old = prev.get(url)
                if old is None:
                    same = False  # not a target: rebuild from the targets below
                    break
                shape = plain_shape(p.data) if p is not None and p.ok else None
                was_shape = shapes.get(url)
                if shape is not None and (shape == was_shape or not_state(
                        p.data, old.state, old.target) is None):
                    rv = current[url] = answered(url, old, p.data, old.target, p.at)
                else:
                    rv = current[url] = polled_rank(url, old, old.target, p, now)
                    shape = state_shape(rv.state) if rv.reachable else None
                if shape is not None:
                    shapes[url] = shape
                    if old.reachable and not old.superseded and was_shape == shape:
                        moved.setdefault(group_of[url], []).append((old, rv))
                        continue
                rejudge.add(url)
            rest |= rejudge
        if not same:
            current = {}
            for t in targets:
                old = prev.get(t.url)
                if polled is not None and old is not None and t.url not in polled:
                    carried = old.copy()
                    carried.fresh, carried.target = False, t
                    current[t.url] = carried
                else:
                    current[t.url] = self._polled(t.url, old, t, polls.get(t.url), now)
            changed, rejudge, moved, rest = set(current), set(current), {}, set(current)
            self._forget()
            self._shapes = {u: state_shape(r.state) for u, r in current.items() if r.reachable}
        self._targets = list(targets)
        if polled is None:
            self._fresh, polled_list = list(current), None
        else:  # in answer order: consumers read the documents in memory order
            polled_list = [u for u, _ in _in_answer_order(polls, polled) if u in current]
            self._fresh = polled_list
        for url, trust in (judge(current, rejudge) if judge is not None else {}).items():
            rv = current[url]
            if url not in changed:
                rv = current[url] = rv.clone()
                changed.add(url)
            rv.trust = trust
            rest.add(url)
        groups = self._regroup(current, changed, moved, rest)
        self._ranks = current
        self.changed = changed
        self.reshaped = rest
        view = ClusterView(at=now, ranks=current, groups=groups,
                           ungrouped=list(self._members.get(None, {}).values()), polled=polled_list)
        self._sums.fill(view)
        view.evidence_view = ev = ClusterView(
            at=now, ranks=dict(self._ev_ranks), groups=dict(self._ev_groups), ungrouped=[],
            polled=polled_list)
        self._ev_sums.fill(ev)
        if len(self._ev_groups) == len(groups) and all(
                map(operator.is_, self._ev_groups.values(), groups.values())):
            # every group's ranks are evidence, the same objects: so are the medians
            ev.__dict__["_median_steps"] = view.__dict__.setdefault("_median_steps", {})
        return view

    @staticmethod
    def _polled(url: str, prev: RankView | None, target: Target | None, p: RankPoll | None,
                now: float) -> RankView:
        bad = not_state(p.data, prev and prev.state, target) if p is not None and p.ok else None
        if p is not None and p.ok and bad is None:
            return answered(url, prev, p.data, target, p.at)
        if p is not None and p.reason == "monitor" and not p.ok:
            # the monitor could not ask (monitor/poll/fd_budget.py): carried as not asked
            if prev is not None:
                rv = prev.clone()
                rv.fresh, rv.target = False, target
                return rv
            return RankView(url, False, None, reason=p.reason, error=p.error, target=target)
        rv = prev.copy() if prev is not None else RankView(url, False, None)
        rv.reachable, rv.target, rv.fresh = False, target, True
        if p is None:
            rv.reason, rv.error = "connection", "not polled"
        elif not p.ok:
            rv.reason, rv.error = p.reason, p.error
        else:
            rv.reason, rv.error = "bad_response", f"bad /v1/state: {bad}"
        rv.failures += 1
        if rv.unreachable_since is None:  # since the failed request was sent, not answered
            rv.unreachable_since = now if p is None else now - p.latency_s
        return rv

    def _regroup(self, current: dict[str, RankView], changed: set[str],
                 moved: dict[int, list[tuple[RankView, RankView]]], rest: set[str]
                 ) -> dict[int, GroupView]:
        """Move the changed ranks into their groups; group again only those touched by ``rest``
        (the changed URLs not only moving), progress the other ``moved`` ones."""
        dirty: set[int | None] = set()
        members_of, group_of, unreachable = self._members, self._group_of, self._unreachable
        ev_ranks = self._ev_ranks
        for url in rest:
            rv = current[url]
            g = rv.replica_group
            if rv.unreachable_since is None:
                unreachable.pop(url, None)
            else:
                unreachable[url] = rv.unreachable_since
            old = group_of.get(url, _NOT_SEEN)
            if old == g:
                members_of[g][url] = rv
            else:
                if old is not _NOT_SEEN:
                    members_of[old].pop(url, None)
                    dirty.add(old)
                group_of[url] = g
                members_of.setdefault(g, {})[url] = rv
            dirty.add(g)
            ev_ranks.pop(url, None)
        groups = dict(self._groups)
        sums, slot = self._sums, self._slot
        ev_groups = self._ev_groups
        ev_apart: list[int] = []  # moved groups whose evidence is not the full group
        for g, pairs in moved.items():
            members = members_of[g]
            for _, rv in pairs:
                members[rv.url] = rv
            if g in dirty:  # another of its ranks did more than progress: grouped again below
                continue
            last = groups[g]
            ranks = last.ranks.copy()
            for _, rv in pairs:
                ranks[slot[rv.url]] = rv
            gv = groups[g] = last.progressed(ranks, pairs)
            if ev_groups.get(g) is last:  # every rank evidence: the same GroupView
                ev_groups[g] = gv
                for _, rv in pairs:
                    ev_ranks[rv.url] = rv
            else:
                ev_apart.append(g)
        for g in ev_apart:
            before = ev_groups.get(g)
            self._evidence_group(g, members_of[g], groups[g])
            _resum(self._ev_sums, before, ev_groups.get(g))
        added = False
        for g in dirty:
            if g is None:
                continue
            before = groups.get(g)
            members = members_of.get(g) or {}
            newest = newest_answers(members.values())
            ranks, old = [], []
            for url, r in members.items():
                sup = is_superseded(r, newest)
                if sup != r.superseded:
                    if url not in changed:
                        r = current[url] = members[url] = r.clone()
                        changed.add(url)
                    r.superseded = sup
                    rest.add(url)
                (old if sup else ranks).append(r)
            gv = None
            if not members:
                members_of.pop(g, None)
            if not ranks:
                groups.pop(g, None)
            else:
                ranks.sort(key=rank_order)
                for i, r in enumerate(ranks):
                    slot[r.url] = i
                added = added or g not in groups
                gv = groups[g] = GroupView(g, ranks, old)
            _resum(sums, before, gv)
            ev_before = self._ev_groups.get(g)
            self._evidence_group(g, members, gv)
            _resum(self._ev_sums, ev_before, self._ev_groups.get(g))
        if added:
            groups = dict(sorted(groups.items()))
        if any(g not in self._ev_groups for g in dirty if g is not None):
            self._ev_groups = dict(sorted(self._ev_groups.items()))
        self._groups = groups
        return groups

    def _evidence_group(self, g: int, members: dict[str, RankView],
                        full: GroupView | None) -> None:
        """Set the evidence view's group ``g``: ``full`` when every rank is evidence (the usual
        case), else a GroupView of copies of those that are."""
        ev = self._ev_ranks
        for url in members:
            ev.pop(url, None)
        kept = [r for r in members.values() if r.trust is not None and r.trust.evidence]
        if full is not None and len(kept) == len(members):
            ev.update((r.url, r) for r in kept)
            self._ev_groups[g] = full
            return
        copies = [r.copy() for r in kept]
        ev.update((r.url, r) for r in copies)
        gv = grouped(g, copies)
        if gv is not None:
            self._ev_groups[g] = gv
        else:
            self._ev_groups.pop(g, None)

    def unreachable_since(self) -> dict[str, float]:
        return dict(self._unreachable)

