"""The poller's sweeps turned into one picture of the job: replica groups x ranks.

:class:`ViewBuilder` remembers, per target, the last good ``/v1/state`` and how long the target has
been unreachable, and builds a :class:`ClusterView` after every sweep. A rank that answers
something that is not a ``/v1/state`` document (missing keys, wrong types) counts as unreachable
with reason ``bad_response``: the detectors only ever see well-formed states.

Every rank also carries the verdict on its claims (``trust``, set by :mod:`monitor.verification`
after each sweep and kept while the rank does not answer). The full view is what the monitor
shows; :meth:`ClusterView.evidence` is the view the detectors and the rails get: only the ranks
whose answers count as evidence.
"""

from __future__ import annotations

import operator
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from .discovery import Target
from .poller import RankPoll

REQUIRED = {"replica_group": int, "rank": int, "group_rank": int, "step": int,
            "quorum_id": int, "phase": str, "phase_since": (int, float)}
COMPUTE_PHASES = ("quorum", "forward", "backward")


def valid_state(data: Any) -> str | None:
    """None when ``data`` looks like a /v1/state document, else what is wrong with it."""
    if not isinstance(data, dict):
        return "not an object"
    for key, typ in REQUIRED.items():
        v = data.get(key)
        if not isinstance(v, typ) or isinstance(v, bool):
            return f"{key} is {v!r}"
    return None


@dataclass
class RankView:
    url: str
    reachable: bool
    state: dict[str, Any] | None  # last good /v1/state (possibly stale when unreachable)
    reason: str | None = None
    error: str | None = None
    failures: int = 0  # consecutive failed sweeps
    unreachable_since: float | None = None
    last_ok_at: float | None = None
    target: Target | None = None
    superseded: bool = False  # unreachable, and a live rank now holds its (group, rank)
    trust: Any = None  # monitor.verification.Trust: the verdict on its claims (None: none yet)
    # polled this sweep; False: not due (leader polling, monitor/schedule.py), everything above
    # is carried from its last poll at ``polled_at``
    fresh: bool = True
    polled_at: float | None = None

    @property
    def replica_group(self) -> int | None:
        s = self.state
        if s is not None:
            g = s["replica_group"]
            return g if type(g) is int else int(g)
        return self.target.replica_group if self.target else None

    @property
    def rank(self) -> int | None:
        s = self.state
        if s is not None:
            r = s["rank"]
            return r if type(r) is int else int(r)
        return self.target.rank if self.target else None

    @property
    def replica_id(self) -> str | None:
        return self.state.get("replica_id") if self.state else None

    def copy(self) -> RankView:
        """A shallow copy whose ``superseded`` the view it goes into decides afresh (~4x
        cheaper than dataclasses.replace)."""
        c = self.clone()
        c.superseded = False
        return c

    def clone(self) -> RankView:
        """A shallow copy, ``superseded`` included: a view changes a RankView it shares with
        the previous view only on a copy (the previous view may still be read)."""
        c = object.__new__(RankView)
        c.__dict__.update(self.__dict__)
        return c

    def recent_steps(self) -> list[float]:
        cached = self.__dict__.get("_recent")
        if cached is not None:
            return cached
        vals = (self.state.get("recent_step_seconds") or []) if self.state else []
        out = [float(v) for v in vals if isinstance(v, (int, float)) and v >= 0] \
            if isinstance(vals, list) else []
        self.__dict__["_recent"] = out
        return out


@dataclass
class GroupView:
    """One replica group's ranks. Its derived values (reachable ranks, replica id, step, quorum
    id) are computed once, on first use, after the view is built: a view is not changed after
    that (each sweep builds a new one), and recomputing them per caller made a 10,000-rank
    sweep quadratic."""

    replica_group: int
    ranks: list[RankView] = field(default_factory=list)
    superseded: list[RankView] = field(default_factory=list)  # its ranks' old processes

    @cached_property
    def answered(self) -> list[RankView]:
        """Ranks that ever answered a valid /v1/state (the others are known by hints only)."""
        return [r for r in self.ranks if r.state is not None]

    @cached_property
    def fresh_failed(self) -> bool:
        """A rank that answered before did not answer when polled this sweep."""
        return any(r.fresh and not r.reachable for r in self.answered)

    @cached_property
    def reachable(self) -> list[RankView]:
        return [r for r in self.ranks if r.reachable]

    @cached_property
    def replica_id(self) -> str | None:
        """The replica id most reachable ranks report (the current incarnation of the group)."""
        ids = [r.replica_id for r in self.reachable if r.replica_id]
        if not ids:
            ids = [r.replica_id for r in self.ranks if r.replica_id]
        return max(set(ids), key=ids.count) if ids else None

    @cached_property
    def step(self) -> int | None:
        steps = [int(r.state["step"]) for r in self.reachable if r.state]
        return max(steps) if steps else None

    @cached_property
    def quorum_id(self) -> int | None:
        q = [int(r.state["quorum_id"]) for r in self.reachable if r.state]
        return max(q) if q else None

    def median_step_seconds(self, last: int = 16) -> float | None:
        """Median of the recent step times of its reachable ranks polled this sweep (all
        of them without leader polling; with it, an undrilled group's leader: the others'
        carried times are older, and re-reading them for every group made each sweep's
        work grow with the ranks known); all reachable ones when none was polled."""
        cache = self.__dict__.setdefault("_median_steps", {})
        if last not in cache:
            ranks = [r for r in self.reachable if r.fresh] or self.reachable
            vals = [v for r in ranks for v in r.recent_steps()[-last:]]
            cache[last] = statistics.median(vals) if vals else None
        return cache[last]

    @cached_property
    def leader(self) -> RankView | None:
        """Group rank 0 (the process running the group's Manager): a reachable one if any."""
        out = None
        for r in self.ranks:
            if r.state is not None and r.state.get("group_rank") == 0 \
                    and (out is None or r.reachable):
                out = r
        return out

    @cached_property
    def hosts(self) -> set[str]:
        return {r.state["host"] for r in self.ranks if r.state and r.state.get("host")}

    @cached_property
    def quorums(self) -> dict[int, int]:
        """quorum_id -> the most participants a reachable rank reports at it; only ranks that
        take part (``participating``) are in ``taking_part``."""
        out: dict[int, int] = {}
        for r in self.reachable:
            if r.state:
                q = r.state["quorum_id"]
                out[q] = max(out.get(q, 0), int(r.state.get("num_participants", 0)))
        return out

    @cached_property
    def taking_part(self) -> frozenset[int]:
        return frozenset(r.state["quorum_id"] for r in self.reachable
                         if r.state and r.state.get("participating", True))

    @cached_property
    def trust_counts(self) -> dict[tuple[str, str] | None, int]:
        """(trust state, reason) -> ranks (None: no verdict yet), over its ranks."""
        out: dict[tuple[str, str] | None, int] = {}
        for r in self.ranks:
            k = (r.trust.state, r.trust.reason) if r.trust is not None else None
            out[k] = out.get(k, 0) + 1
        return out

    @property
    def status(self) -> str:
        if not self.ranks:
            return "unknown"
        n = len(self.reachable)
        if n == 0:
            return "unreachable"
        if n < len(self.ranks):
            return "partial"
        return "up"


@dataclass
class ClusterView:
    at: float
    ranks: dict[str, RankView]
    sweep_seconds: float = 0.0
    groups: dict[int, GroupView] = field(default_factory=dict)
    # built incrementally by ViewBuilder (None: derived from ``ranks`` here): the ranks of no
    # group, the URLs polled this sweep, and the evidence view of the same sweep
    ungrouped: list[RankView] | None = None
    polled: list[str] | None = None
    evidence_view: ClusterView | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.ungrouped is None:
            live = {(r.replica_group, r.rank) for r in self.ranks.values()
                    if r.reachable and r.state}
            for rv in self.ranks.values():
                g = rv.replica_group
                if not rv.reachable and g is not None and (g, rv.rank) in live:
                    rv.superseded = True  # an old process of a restarted group
                if g is None:
                    continue
                gv = self.groups.setdefault(g, GroupView(g))
                (gv.superseded if rv.superseded else gv.ranks).append(rv)
            for g in [g for g, gv in self.groups.items() if not gv.ranks]:
                del self.groups[g]
            for gv in self.groups.values():
                gv.ranks.sort(key=lambda r: (r.rank if r.rank is not None else 1 << 62, r.url))
            self.groups = dict(sorted(self.groups.items()))
            self.ungrouped = [r for r in self.ranks.values()
                              if r.replica_group is None and not r.superseded]

    @cached_property
    def counts(self) -> tuple[int, int, dict[tuple[str, str] | None, int]]:
        """(known ranks (not superseded), reachable ones, (trust state, reason) -> ranks),
        summed per group: a group the sweep did not touch keeps its counts."""
        known = len(self.ungrouped or ())
        up = 0
        trust: dict[tuple[str, str] | None, int] = {}
        for r in self.ungrouped or ():
            k = (r.trust.state, r.trust.reason) if r.trust is not None else None
            trust[k] = trust.get(k, 0) + 1
        for g in self.groups.values():
            known += len(g.ranks)
            up += len(g.reachable)
            for k, n in g.trust_counts.items():
                trust[k] = trust.get(k, 0) + n
        return known, up, trust

    @cached_property
    def reachable_fraction(self) -> float:
        known, up, _ = self.counts
        return up / known if known else 0.0

    @cached_property
    def quorum_id(self) -> int | None:
        q = [g.quorum_id for g in self.groups.values() if g.quorum_id is not None]
        return max(q) if q else None

    def quorum_participants(self) -> int | None:
        q = self.quorum_id
        vals = [g.quorums[q] for g in self.groups.values() if q in g.quorums]
        return max(vals) if vals else None

    def in_quorum(self) -> list[GroupView]:
        """Groups with a reachable rank in the newest quorum that take part in it."""
        return list(self._in_quorum)

    @cached_property
    def _in_quorum(self) -> list[GroupView]:
        q = self.quorum_id
        return [g for g in self.groups.values() if q in g.taking_part]

    def rank_view(self, rank: int) -> RankView | None:
        """The rank's RankView: a reachable one if any (not superseded), else the first
        found; None when the view has none. One index per view (a scan per call made the
        detectors' culprit descriptions quadratic at 10,000 ranks)."""
        return self._by_rank.get(rank)

    @cached_property
    def _by_rank(self) -> dict[int, RankView]:
        out: dict[int, RankView] = {}
        for r in self.ranks.values():
            if r.superseded:
                continue
            k = r.rank
            if k is None:
                continue
            have = out.get(k)
            if have is None or (r.reachable and not have.reachable):
                out[k] = r
        return out

    def median_step_seconds(self, last: int = 16) -> float | None:
        """Median of the reachable ranks' recent step times, from the ranks polled this sweep
        (all of them without leader polling); once per view and ``last``."""
        cache = self.__dict__.setdefault("_median_steps", {})
        if last not in cache:
            ranks = self.ranks.values() if self.polled is None else \
                [r for r in map(self.ranks.get, self.polled) if r is not None]
            vals = [v for r in ranks if r.reachable and r.fresh
                    for v in r.recent_steps()[-last:]]
            cache[last] = statistics.median(vals) if vals else None
        return cache[last]

    def evidence(self) -> ClusterView:
        """The same sweep with only the ranks whose answers count as evidence (``trust``)."""
        if self.evidence_view is not None:
            return self.evidence_view
        ranks = {u: r.copy() for u, r in self.ranks.items()
                 if r.trust is not None and r.trust.evidence}
        return ClusterView(at=self.at, ranks=ranks, sweep_seconds=self.sweep_seconds,
                           polled=self.polled)


_NOT_SEEN = object()


def _rank_order(r: RankView) -> tuple:
    return (r.rank if r.rank is not None else 1 << 62, r.url)


class ViewBuilder:
    """Folds sweeps into ClusterViews, keeping per-target memory across sweeps.

    With leader polling (``polled`` given) and the same targets as the last sweep, a view is
    built from the last one: a rank not asked keeps its RankView object (no copy), and only
    the groups with a rank that changed (asked, its verdict changed, or it stopped being
    fresh) are grouped again; the others keep their GroupView and its derived values, and
    their evidence. The work of a sweep is then proportional to the ranks asked, not to the
    ranks known (docs/scaling.md). A view is never changed once built: a RankView shared with
    the last view is copied before anything in it changes.
    """

    def __init__(self) -> None:
        self._ranks: dict[str, RankView] = {}
        self._targets: list[Target] = []
        self._fresh: set[str] = set()
        self._group_of: dict[str, int | None] = {}  # url -> the group it is in (None: none)
        self._members: dict[int | None, dict[str, RankView]] = {}  # superseded ones too
        self._groups: dict[int, GroupView] = {}
        self._ev_groups: dict[int, GroupView] = {}
        self._ev_ranks: dict[str, RankView] = {}
        self.changed: set[str] = set()  # URLs whose RankView the last update made anew
        self._unreachable: dict[str, float] = {}
        self._judged = False

    def update(self, targets: list[Target], polls: dict[str, RankPoll],
               sweep_seconds: float = 0.0, now: float | None = None,
               polled: set[str] | None = None,
               judge: Callable[[dict[str, RankView], set[str]], dict[str, Any]] | None = None
               ) -> ClusterView:
        """``polled``: the URLs this sweep asked (default: every target). A target outside it
        that was seen before keeps its last RankView (``fresh`` False): not being due is not
        a failure.

        ``judge(ranks, changed)``: the verdicts (``trust``) that change, by URL, given every
        rank and the URLs whose RankView is new (monitor.verification.Verifier). With it the
        view comes with its evidence view (:meth:`ClusterView.evidence`) built alongside;
        without it the caller sets ``trust`` and the evidence view is derived on demand."""
        now = time.time() if now is None else now
        prev = self._ranks
        same = (polled is not None and bool(prev) and len(targets) == len(self._targets)
                and (judge is not None) == self._judged
                and all(map(operator.is_, targets, self._targets)))
        if same:
            current = dict(prev)
            changed: set[str] = set()
            for url in self._fresh - polled:  # asked last sweep, not now: carried from now on
                rv = prev[url].clone()
                rv.fresh = False
                current[url] = rv
                changed.add(url)
            for url in polled:
                old = prev.get(url)
                if old is None:
                    same = False  # not a target: rebuild from the targets below
                    break
                current[url] = self._polled(url, old, old.target, polls.get(url), now)
                changed.add(url)
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
            changed = set(current)
            self._group_of, self._members = {}, {}
            self._groups, self._ev_groups, self._ev_ranks = {}, {}, {}
            self._unreachable = {}
        self._targets = list(targets)
        self._judged = judge is not None
        self._fresh = set(current) if polled is None else set(polled) & current.keys()
        if judge is not None:
            for url, trust in judge(current, changed).items():
                rv = current[url]
                if url not in changed:
                    rv = current[url] = rv.clone()
                    changed.add(url)
                rv.trust = trust
        groups = self._regroup(current, changed, judge is not None)
        self._ranks = current
        self.changed = changed
        polled_list = None if polled is None else [u for u in polled if u in current]
        view = ClusterView(at=now, ranks=dict(current), sweep_seconds=sweep_seconds,
                           groups=groups, ungrouped=list(self._members.get(None, {}).values()),
                           polled=polled_list)
        if judge is not None:
            view.evidence_view = ClusterView(at=now, ranks=dict(self._ev_ranks),
                                             sweep_seconds=sweep_seconds,
                                             groups=dict(self._ev_groups), ungrouped=[],
                                             polled=polled_list)
        return view

    @staticmethod
    def _polled(url: str, prev: RankView | None, target: Target | None, p: RankPoll | None,
                now: float) -> RankView:
        rv = RankView(url, False, prev.state if prev else None, target=target,
                      failures=prev.failures if prev else 0,
                      unreachable_since=prev.unreachable_since if prev else None,
                      last_ok_at=prev.last_ok_at if prev else None,
                      trust=prev.trust if prev else None, polled_at=now)
        if p is None:
            rv.reason, rv.error = "connection", "not polled"
        elif not p.ok:
            rv.reason, rv.error = p.reason, p.error
        else:
            problem = valid_state(p.data)
            if problem is None:
                rv.reachable, rv.state = True, p.data
            else:
                rv.reason, rv.error = "bad_response", f"bad /v1/state: {problem}"
        if rv.reachable:
            rv.failures, rv.unreachable_since, rv.last_ok_at = 0, None, now
        else:
            rv.failures += 1
            if rv.unreachable_since is None:
                rv.unreachable_since = now
        return rv

    def _regroup(self, current: dict[str, RankView], changed: set[str],
                 with_evidence: bool) -> dict[int, GroupView]:
        """Move the changed ranks into their groups and group again only the groups touched."""
        dirty: set[int | None] = set()
        for url in changed:
            rv = current[url]
            g = rv.replica_group
            if rv.unreachable_since is None:
                self._unreachable.pop(url, None)
            else:
                self._unreachable[url] = rv.unreachable_since
            old = self._group_of.get(url, _NOT_SEEN)
            if old is not _NOT_SEEN and old != g:
                self._members[old].pop(url, None)
                dirty.add(old)
            self._group_of[url] = g
            self._members.setdefault(g, {})[url] = rv
            dirty.add(g)
            if with_evidence:
                self._ev_ranks.pop(url, None)
        groups = dict(self._groups)
        added = False
        for g in dirty:
            if g is None:
                continue
            members = self._members.get(g)
            if not members:
                self._members.pop(g, None)
                groups.pop(g, None)
                self._ev_groups.pop(g, None)
                continue
            live = {r.rank for r in members.values() if r.reachable and r.state}
            ranks, old = [], []
            for url, r in members.items():
                sup = not r.reachable and r.rank in live  # an old process of a restarted group
                if sup != r.superseded:
                    if url not in changed:
                        r = current[url] = members[url] = r.clone()
                        changed.add(url)
                    r.superseded = sup
                (old if sup else ranks).append(r)
            if not ranks:
                groups.pop(g, None)
            else:
                ranks.sort(key=_rank_order)
                added = added or g not in groups
                groups[g] = GroupView(g, ranks, old)
            if with_evidence:
                self._evidence_group(g, members, groups.get(g))
        if added:
            groups = dict(sorted(groups.items()))
        if with_evidence and any(g not in self._ev_groups for g in dirty if g is not None):
            self._ev_groups = dict(sorted(self._ev_groups.items()))
        self._groups = groups
        return groups

    def _evidence_group(self, g: int, members: dict[str, RankView],
                        full: GroupView | None) -> None:
        """The evidence view's group ``g``: the full view's own GroupView when every rank of
        the group counts as evidence (the usual case), else one of copies of those that do
        (their ``superseded`` decided among them alone)."""
        ev = self._ev_ranks
        for url in members:
            ev.pop(url, None)
        kept = [r for r in members.values() if r.trust is not None and r.trust.evidence]
        if full is not None and len(kept) == len(members):
            ev.update((r.url, r) for r in kept)
            self._ev_groups[g] = full
            return
        copies = [r.copy() for r in kept]
        live = {r.rank for r in copies if r.reachable and r.state}
        ranks, old = [], []
        for r in copies:
            r.superseded = not r.reachable and r.rank in live
            ev[r.url] = r
            (old if r.superseded else ranks).append(r)
        if ranks:
            ranks.sort(key=_rank_order)
            self._ev_groups[g] = GroupView(g, ranks, old)
        else:
            self._ev_groups.pop(g, None)

    def unreachable_since(self) -> dict[str, float]:
        return dict(self._unreachable)
