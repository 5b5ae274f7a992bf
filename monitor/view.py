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

import statistics
import time
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
        cheaper than dataclasses.replace; one per rank per sweep)."""
        c = object.__new__(RankView)
        c.__dict__.update(self.__dict__)
        c.superseded = False
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
        vals = [v for r in self.reachable for v in r.recent_steps()[-last:]]
        return statistics.median(vals) if vals else None

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

    def __post_init__(self) -> None:
        if not self.groups:
            live = {(r.replica_group, r.rank) for r in self.ranks.values()
                    if r.reachable and r.state}
            for rv in self.ranks.values():
                g = rv.replica_group
                if not rv.reachable and g is not None and (g, rv.rank) in live:
                    rv.superseded = True  # an old process of a restarted group
                if g is None or rv.superseded:
                    continue
                self.groups.setdefault(g, GroupView(g)).ranks.append(rv)
            for gv in self.groups.values():
                gv.ranks.sort(key=lambda r: (r.rank if r.rank is not None else 1 << 62, r.url))
            self.groups = dict(sorted(self.groups.items()))

    @cached_property
    def reachable_fraction(self) -> float:
        ranks = [r for r in self.ranks.values() if not r.superseded]
        return sum(r.reachable for r in ranks) / len(ranks) if ranks else 0.0

    @cached_property
    def quorum_id(self) -> int | None:
        q = [g.quorum_id for g in self.groups.values() if g.quorum_id is not None]
        return max(q) if q else None

    def quorum_participants(self) -> int | None:
        q = self.quorum_id
        vals = [int(r.state.get("num_participants", 0)) for r in self.ranks.values()
                if r.reachable and r.state and r.state["quorum_id"] == q]
        return max(vals) if vals else None

    def in_quorum(self) -> list[GroupView]:
        """Groups with a reachable rank in the newest quorum that take part in it."""
        return list(self._in_quorum)

    @cached_property
    def _in_quorum(self) -> list[GroupView]:
        q = self.quorum_id
        return [g for g in self.groups.values()
                if any(r.state and r.state["quorum_id"] == q and r.state.get("participating", True)
                       for r in g.reachable)]

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
            vals = [v for r in self.ranks.values() if r.reachable and r.fresh
                    for v in r.recent_steps()[-last:]]
            cache[last] = statistics.median(vals) if vals else None
        return cache[last]

    def evidence(self) -> ClusterView:
        """The same sweep with only the ranks whose answers count as evidence (``trust``)."""
        ranks = {u: r.copy() for u, r in self.ranks.items()
                 if r.trust is not None and r.trust.evidence}
        return ClusterView(at=self.at, ranks=ranks, sweep_seconds=self.sweep_seconds)


class ViewBuilder:
    """Folds sweeps into ClusterViews, keeping per-target memory across sweeps."""

    def __init__(self) -> None:
        self._ranks: dict[str, RankView] = {}

    def update(self, targets: list[Target], polls: dict[str, RankPoll],
               sweep_seconds: float = 0.0, now: float | None = None,
               polled: set[str] | None = None) -> ClusterView:
        """``polled``: the URLs this sweep asked (default: every target). A target outside it
        that was seen before keeps its last RankView (``fresh`` False): not being due is not
        a failure."""
        now = time.time() if now is None else now
        current: dict[str, RankView] = {}
        for t in targets:
            prev = self._ranks.get(t.url)
            if polled is not None and prev is not None and t.url not in polled:
                carried = prev.copy()
                carried.fresh, carried.target = False, t
                current[t.url] = carried
                continue
            p = polls.get(t.url)
            rv = RankView(t.url, False, prev.state if prev else None, target=t,
                          failures=prev.failures if prev else 0,
                          unreachable_since=prev.unreachable_since if prev else None,
                          last_ok_at=prev.last_ok_at if prev else None,
                          trust=prev.trust if prev else None, polled_at=now)
            problem = None
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
            current[t.url] = rv
        self._ranks = current
        return ClusterView(at=now, ranks=dict(current), sweep_seconds=sweep_seconds)

    def unreachable_since(self) -> dict[str, float]:
        return {u: r.unreachable_since for u, r in self._ranks.items()
                if r.unreachable_since is not None}
