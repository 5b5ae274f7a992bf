"""The poller's sweeps turned into one picture of the job: replica groups x ranks.

:class:`ViewBuilder` remembers, per target, the last good ``/v1/state`` and how long the target has
been unreachable, and builds a :class:`ClusterView` after every sweep. A rank that answers
something that is not a ``/v1/state`` document (missing keys, wrong types) counts as unreachable
with reason ``bad_response``: the detectors only ever see well-formed states.

Every rank also carries the verdict on its claims (``trust``, set by :mod:`monitor.evidence.verification`
after each sweep and kept while the rank does not answer). The full view is what the monitor
shows; :meth:`ClusterView.evidence` is the view the detectors and the rails get: only the ranks
whose answers count as evidence.
"""

from __future__ import annotations

import operator
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from typing import Any

import numpy as np

from monitor.poll.discovery import Target
from monitor.poll.poller import RankPoll
from rank_wire import unpack_seconds

REQUIRED = {"replica_group": int, "rank": int, "group_rank": int, "step": int,
            "quorum_id": int, "phase": str, "phase_since": (int, float)}
COMPUTE_PHASES = ("quorum", "forward", "backward")
# the step times a view reads of each rank: the newest of its ``recent_step_seconds`` (a
# WorkerServer keeps 64); the monitor asks ``/v1/state?recent=`` this many
# (Detectors.state_queries) and the medians below read no more
STEP_TIMES_READ = 16


def valid_state(data: Any) -> str | None:
    """None when ``data`` looks like a /v1/state document, else what is wrong with it."""
    if _plain_shape(data) is not None:
        return None
    if not isinstance(data, dict):
        return "not an object"
    for key, typ in REQUIRED.items():
        v = data.get(key)
        if not isinstance(v, typ) or isinstance(v, bool):
            return f"{key} is {v!r}"
    return None


def _plain_shape(data: Any) -> tuple | None:
    """``data``'s _shape when it is a valid /v1/state with JSON's own types, told by one
    comparison a value; None: valid_state's general check decides."""
    if type(data) is not dict:
        return None
    try:
        if type(data["replica_group"]) is int and type(data["rank"]) is int \
                and type(data["group_rank"]) is int and type(data["step"]) is int \
                and type(data["quorum_id"]) is int and type(data["phase"]) is str \
                and type(data["phase_since"]) in (float, int):
            return _shape(data)
    except KeyError:
        pass
    return None


_new = object.__new__


@dataclass(slots=True)
class RankView:
    """One target as the last sweeps saw it. Slotted: ~21,000 are made and as many freed each
    sweep at 100,000 ranks, and a slotted one is ~150 bytes against ~530 with its own
    ``__dict__`` (3-5x cheaper to make and to free, and less memory for every later pass to
    walk through)."""

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
    trust: Any = None  # monitor.evidence.verification.Trust: the verdict on its claims (None: none yet)
    # polled this sweep; False: not due (leader polling, monitor/schedule.py), everything above
    # is carried from its last poll at ``polled_at``
    fresh: bool = True
    polled_at: float | None = None
    # when its last good answer came, on the poller's clock (RankPoll.at, the monitor's
    # time.time): compared only with another answer's, how far apart two answers really are
    # (a sweep's answers are asked ahead and arrive over ~0.5-1 s; its ``now`` is later)
    answered_at: float | None = None
    # recent_steps' value, computed once (the state never changes in a RankView)
    _recent: list[float] | None = field(default=None, repr=False, compare=False)

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
        c = _new(RankView)
        c.url, c.reachable, c.state, c.reason, c.error, c.failures = \
            self.url, self.reachable, self.state, self.reason, self.error, self.failures
        c.unreachable_since, c.last_ok_at, c.target, c.superseded, c.trust = \
            self.unreachable_since, self.last_ok_at, self.target, self.superseded, self.trust
        c.fresh, c.polled_at, c._recent = self.fresh, self.polled_at, self._recent
        c.answered_at = self.answered_at
        return c

    def recent_steps(self) -> list[float]:
        cached = self._recent
        if cached is not None:
            return cached
        vals = self.state.get("recent_step_seconds") if self.state else None
        out = unpack_seconds(vals) if type(vals) is bytes else []  # as the poller keeps it
        self._recent = out
        return out


class _cached:
    """functools.cached_property without its lock (Python 3.11 takes a lock shared by every
    instance on each first computation; a value computed twice by two threads is the same)."""

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
    """The values a GroupView's next generation inherits (GroupView._progressed)."""
    d = gv.__dict__
    c = d.get("_carry")
    if c is None:
        c = d["_carry"] = {}
    return c


class _kept(_cached):
    """A cached value that progress alone leaves as it is (see ViewBuilder: a moved group's
    next GroupView inherits it)."""

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        v = obj.__dict__[self.name] = _carry(obj)[self.name] = self.func(obj)
        return v


@dataclass
class GroupView:
    """One replica group's ranks. Its derived values (reachable ranks, replica id, step, quorum
    id) are computed once, on first use, after the view is built: a view is not changed after
    that (each sweep builds a new one), and recomputing them per caller made a 10,000-rank
    sweep quadratic."""

    replica_group: int
    ranks: list[RankView] = field(default_factory=list)
    superseded: list[RankView] = field(default_factory=list)  # its ranks' old processes

    @_cached
    def answered(self) -> list[RankView]:
        """Ranks that ever answered a valid /v1/state (the others are known by hints only)."""
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
        steps = [int(r.state["step"]) for r in self.reachable if r.state]
        return max(steps) if steps else None

    @_kept
    def quorum_id(self) -> int | None:
        q = [int(r.state["quorum_id"]) for r in self.reachable if r.state]
        return max(q) if q else None

    def median_step_seconds(self, last: int = STEP_TIMES_READ) -> float | None:
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

    @_kept
    def reported_replica_ids(self) -> frozenset[str | None]:
        """The replica ids its reachable ranks report (None: a rank reporting none)."""
        return frozenset(r.replica_id for r in self.reachable)

    @_kept
    def hosts(self) -> set[str]:
        return {r.state["host"] for r in self.ranks if r.state and r.state.get("host")}

    @_kept
    def quorums(self) -> dict[int, int]:
        """quorum_id -> the most participants a reachable rank reports at it; only ranks that
        take part (``participating``) are in ``taking_part``."""
        out: dict[int, int] = {}
        for r in self.reachable:
            if r.state:
                q = r.state["quorum_id"]
                out[q] = max(out.get(q, 0), int(r.state.get("num_participants", 0)))
        return out

    @_kept
    def taking_part(self) -> frozenset[int]:
        return frozenset(r.state["quorum_id"] for r in self.reachable
                         if r.state and r.state.get("participating", True))

    @_kept
    def trust_counts(self) -> dict[tuple[str, str] | None, int]:
        """(trust state, reason) -> ranks (None: no verdict yet), over its ranks."""
        out: dict[tuple[str, str] | None, int] = {}
        for r in self.ranks:
            k = (r.trust.state, r.trust.reason) if r.trust is not None else None
            out[k] = out.get(k, 0) + 1
        return out

    def _progressed(self, ranks: list[RankView],
                    moved: list[tuple[RankView, RankView]]) -> GroupView:
        """This group after progress only (a moved group, see ViewBuilder): ``ranks`` are its
        ranks in the same slots, ``moved`` the (last sweep's, this sweep's) RankViews swapped
        in, each the same process answering with the same identity, quorum, host and verdict.
        What those alone decide is carried over from this GroupView if it was computed; the
        group's step is updated from the moved ranks' (recomputed if one went back); the rest
        (the median step time) is computed again on demand."""
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
    """One sweep's picture. Built by ViewBuilder, a group that did not change since the
    previous sweep's view is the very same GroupView object, derived values and all (never
    changed once built): a consumer tells what to read again by identity
    (monitor.detect.rank_state.SeenGroups)."""

    at: float
    ranks: dict[str, RankView]
    sweep_seconds: float = 0.0
    groups: dict[int, GroupView] = field(default_factory=dict)
    # built incrementally by ViewBuilder (None: derived from ``ranks`` here): the ranks of no
    # group, the URLs polled this sweep (those answered first, in the order they answered),
    # and the evidence view of the same sweep
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

    def median_step_seconds(self, last: int = STEP_TIMES_READ) -> float | None:
        """Median of the reachable ranks' recent step times, from the ranks polled this sweep
        (all of them without leader polling); once per view and ``last``."""
        cache = self.__dict__.setdefault("_median_steps", {})
        if last not in cache:
            ranks = self.ranks.values() if self.polled is None else \
                [r for r in map(self.ranks.get, self.polled) if r is not None]
            cache[last] = _median(chain.from_iterable(
                r.recent_steps()[-last:] for r in ranks if r.reachable and r.fresh))
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


def _median(values: Iterable[float]) -> float | None:
    """statistics.median of ``values`` (None when empty), by numpy's partition for many: the
    same value (the middle one, or the mean of the two middle ones), without sorting ~300,000
    step times a sweep at 100,000 ranks."""
    arr = np.fromiter(values, dtype=float)
    if not len(arr):
        return None
    if len(arr) < 64:
        return statistics.median(arr.tolist())
    return float(np.median(arr))


def _in_answer_order(polls: dict[str, RankPoll], polled: set[str]
                     ) -> Iterable[tuple[str, RankPoll | None]]:
    """(URL, its poll or None) for every URL of ``polled``: those answered in the order the
    answers came (``polls``' order, the order their documents were made in memory), then the
    others. Reading ~21,000 fresh documents in a set's order instead was a cache miss for
    nearly every key looked up in them: ~3x the view's per-answer time at 100,000 ranks."""
    if len(polls) == len(polled) and polls.keys() <= polled:
        return polls.items()  # the usual sweep: an answer (or a failed poll) for each
    return chain(((u, p) for u, p in polls.items() if u in polled),
                 ((u, None) for u in polled - polls.keys()))


def _rank_order(r: RankView) -> tuple:
    return (r.rank if r.rank is not None else 1 << 62, r.url)


def _answered(url: str, prev: RankView | None, state: dict[str, Any], now: float,
              target: Any = _NOT_SEEN, at: float | None = None) -> RankView:
    """The RankView of a valid answer (``target``: the previous one's by default; ``at``: when
    it came, default ``now``); all of it is known from the answer (ViewBuilder._polled's other
    cases keep the previous one's)."""
    rv = _new(RankView)
    rv.url, rv.reachable, rv.state, rv.reason, rv.error, rv.failures = \
        url, True, state, None, None, 0
    rv.unreachable_since, rv.last_ok_at, rv.superseded, rv.fresh, rv.polled_at = \
        None, now, False, True, now
    rv.target = prev.target if target is _NOT_SEEN else target
    rv.trust = prev.trust if prev is not None else None
    rv._recent = None
    rv.answered_at = now if at is None else at
    return rv


def _shape(s: dict[str, Any]) -> tuple:
    """What of an answered state the view's groups and a verdict rest on, besides progress:
    identity claims (monitor.evidence.verification.claims), quorum, participation, host, node and
    device (the host ledger's claim). A rank answering again with the same shape and verdict
    moved on only (ViewBuilder: a moved group; not in ``ViewBuilder.reshaped``); one whose
    shape is the same is not judged again (its verdict's inputs are the same)."""
    g = s.get
    return (s["replica_group"], s["rank"], s["group_rank"], s["quorum_id"], g("replica_id"),
            g("group_world_size"), g("num_participants"), g("participating", True), g("host"),
            g("node"), g("device"))


class _Sums:
    """Sums over a view's groups, kept as its groups are replaced (a moved group adds what it
    replaces): ranks known and reachable, ranks by verdict, groups by quorum id. What
    ClusterView.counts and quorum_id would sum over every group."""

    __slots__ = ("known", "up", "trust", "quorums")

    def __init__(self) -> None:
        self.known = self.up = 0
        self.trust: dict[tuple[str, str] | None, int] = {}
        self.quorums: dict[int, int] = {}

    def add(self, gv: GroupView, sign: int) -> None:
        self.known += sign * len(gv.ranks)
        self.up += sign * len(gv.reachable)
        trust = self.trust
        for k, n in gv.trust_counts.items():
            trust[k] = trust.get(k, 0) + sign * n
        q = gv.quorum_id
        if q is not None:
            self.quorums[q] = self.quorums.get(q, 0) + sign

    def fill(self, view: ClusterView) -> None:
        """Set ``view``'s counts and quorum id (ClusterView's cached values) from the sums."""
        ungrouped = view.ungrouped or ()
        trust = {k: n for k, n in self.trust.items() if n}
        for r in ungrouped:
            k = (r.trust.state, r.trust.reason) if r.trust is not None else None
            trust[k] = trust.get(k, 0) + 1
        view.__dict__["counts"] = (self.known + len(ungrouped), self.up, trust)
        qs = [q for q, n in self.quorums.items() if n]
        view.__dict__["quorum_id"] = max(qs) if qs else None


class ViewBuilder:
    """Folds sweeps into ClusterViews, keeping per-target memory across sweeps.

    With leader polling (``polled`` given) and the same targets as the last sweep, a view is
    built from the last one: a rank not asked keeps its RankView object (no copy), and only
    the groups with a rank that changed (asked, its verdict changed, or it stopped being
    fresh) are grouped again; the others keep their GroupView and its derived values, and
    their evidence. The work of a sweep is then proportional to the ranks asked, not to the
    ranks known (docs/scaling.md). A view is never changed once built: a RankView shared with
    the last view is copied before anything in it changes.

    With verdicts (``judge``), a group whose changed ranks only progressed (a *moved* group:
    the usual leader sweep, every leader one step further) is not grouped again: its new
    GroupView has the same slots with the new RankViews in them and carries what progress
    leaves as it was; the view's counts and quorum id are sums kept per group.

    A moved group's ranks that changed are each the same process answering again (reachable
    at both sweeps, not superseded) with the same identity claims (replica id, replica group,
    group rank, world size, global rank), quorum id, ``num_participants``, ``participating``,
    host and verdict (the same ``Trust`` object); what moved is its step, phase, timings and
    other state, or whether it was polled this sweep (``fresh``). So the group's ranks are
    the same URLs in the same slots, and its replica id, quorum id, quorums, ``taking_part``,
    hosts, reported replica ids, verdict counts, reachable ranks (by URL), ``fresh_failed``,
    leader slot and status are those of its previous GroupView; its step and median step
    time may differ. A group any of whose ranks did more is grouped again.
    """

    def __init__(self) -> None:
        self._ranks: dict[str, RankView] = {}
        self._targets: list[Target] = []
        # the URLs the last sweep polled, in its answer order (its RankViews were made in it)
        self._fresh: list[str] = []
        self._group_of: dict[str, int | None] = {}  # url -> the group it is in (None: none)
        self._members: dict[int | None, dict[str, RankView]] = {}  # superseded ones too
        self._groups: dict[int, GroupView] = {}
        self._ev_groups: dict[int, GroupView] = {}
        self._ev_ranks: dict[str, RankView] = {}
        self._slot: dict[str, int] = {}  # url -> its index in its GroupView's ranks
        self._shapes: dict[str, tuple] = {}  # url -> _shape of its last answer
        self._sums, self._ev_sums = _Sums(), _Sums()
        self.changed: set[str] = set()  # URLs whose RankView the last update made anew
        # those of them that did more than progress (not a moving rank: its shape, node and
        # device, reachability, verdict and ``superseded`` are the last view's)
        self.reshaped: set[str] = set()
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
        rank and the URLs whose RankView is new, less those whose reachability and claims
        (all a verdict rests on, see ``_shape``) are the last ones: a rank that only stopped
        being fresh, or answered again with the same shape (monitor.evidence.verification.Verifier). With it the view comes with its evidence view
        (:meth:`ClusterView.evidence`) built alongside; without it the caller sets ``trust``
        and the evidence view is derived on demand."""
        now = time.time() if now is None else now
        prev = self._ranks
        same = (polled is not None and bool(prev) and len(targets) == len(self._targets)
                and (judge is not None) == self._judged
                and all(map(operator.is_, targets, self._targets)))
        # group -> the (last sweep's, this sweep's) RankViews of its ranks answering again with
        # the same shape (_shape): the same process moving on, if its verdict stands (a moved
        # group). Bucketed here, as each answer is read, not in a pass of its own; only with
        # verdicts (without, every changed rank is grouped again)
        moved: dict[int, list[tuple[RankView, RankView]]] = {}
        # URLs whose verdict may change: a new RankView whose reachability or shape (all a
        # verdict rests on) is not the last one's
        rejudge: set[str] = set()
        rest: set[str] = set()  # the changed URLs not moving: their groups are grouped again
        if same:
            current = dict(prev)
            # asked last sweep, not now: carried from now on (read in the order they were made)
            carried = [u for u in self._fresh if u not in polled]
            changed = polled.union(carried)
            group_of, bucket = self._group_of, judge is not None
            for url in carried:
                was = prev[url]
                rv = current[url] = was.clone()
                rv.fresh = False
                if bucket and was.reachable and not was.superseded:  # its state: the same
                    g = group_of[url]
                    pairs = moved.get(g)
                    if pairs is None:
                        moved[g] = [(was, rv)]
                    else:
                        pairs.append((was, rv))
                else:
                    rest.add(url)
            polled_rank, shapes = self._polled, self._shapes
            for url, p in _in_answer_order(polls, polled):
                old = prev.get(url)
                if old is None:
                    same = False  # not a target: rebuild from the targets below
                    break
                shape = _plain_shape(p.data) if p is not None and p.ok else None
                if shape is not None:
                    rv = current[url] = _answered(url, old, p.data, now, at=p.at)
                else:
                    rv = current[url] = polled_rank(url, old, old.target, p, now)
                    if rv.reachable:
                        shape = _shape(rv.state)
                if shape is not None:
                    was_shape = shapes.get(url)
                    shapes[url] = shape  # the new tuple: made now, next to the others read next
                    if old.reachable and not old.superseded and was_shape == shape:
                        if bucket:
                            g = group_of[url]
                            pairs = moved.get(g)
                            if pairs is None:
                                moved[g] = [(old, rv)]
                            else:
                                pairs.append((old, rv))
                        else:
                            rest.add(url)
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
            self._shapes = {u: _shape(r.state) for u, r in current.items() if r.reachable}
            self._group_of, self._members, self._slot = {}, {}, {}
            self._groups, self._ev_groups, self._ev_ranks = {}, {}, {}
            self._sums, self._ev_sums = _Sums(), _Sums()
            self._unreachable = {}
        self._targets = list(targets)
        self._judged = judge is not None
        if polled is None:
            self._fresh, polled_list = list(current), None
        elif same:  # every URL polled is a target
            # in answer order: every consumer's pass over this sweep's answers (the detectors',
            # the ledgers') then reads the documents in the order they lie in memory
            polled_list = list(polls) if len(polls) == len(polled) and polls.keys() <= polled \
                else [u for u, _ in _in_answer_order(polls, polled)]
            self._fresh = polled_list
        else:
            polled_list = [u for u, _ in _in_answer_order(polls, polled) if u in current]
            self._fresh = polled_list
        if judge is not None:
            for url, trust in judge(current, rejudge).items():
                rv = current[url]
                if url not in changed:
                    rv = current[url] = rv.clone()
                    changed.add(url)
                rv.trust = trust
                rest.add(url)
        groups = self._regroup(current, changed, moved, rest, judge is not None)
        self._ranks = current
        self.changed = changed
        self.reshaped = rest
        # ``current`` is not changed after this: the next update starts from a copy
        view = ClusterView(at=now, ranks=current, sweep_seconds=sweep_seconds,
                           groups=groups, ungrouped=list(self._members.get(None, {}).values()),
                           polled=polled_list)
        if judge is not None:
            self._sums.fill(view)
            view.evidence_view = ev = ClusterView(
                at=now, ranks=dict(self._ev_ranks), sweep_seconds=sweep_seconds,
                groups=dict(self._ev_groups), ungrouped=[], polled=polled_list)
            self._ev_sums.fill(ev)
            if len(self._ev_groups) == len(groups) and all(
                    map(operator.is_, self._ev_groups.values(), groups.values())):
                # every group's ranks are evidence, the same objects: so are the medians
                ev.__dict__["_median_steps"] = view.__dict__.setdefault("_median_steps", {})
        return view

    @staticmethod
    def _polled(url: str, prev: RankView | None, target: Target | None, p: RankPoll | None,
                now: float) -> RankView:
        if p is not None and p.ok and valid_state(p.data) is None:
            return _answered(url, prev, p.data, now, target, p.at)
        if p is not None and p.reason == "monitor" and not p.ok:
            # the monitor could not ask (its own file descriptors, monitor/poll/fd_budget.py): no
            # evidence of the rank either way. Carried as a rank not asked this sweep: its
            # last answer, no failure counted (a rank is dead after failed polls, not these)
            if prev is not None:
                rv = prev.clone()
                rv.fresh, rv.target = False, target
                return rv
            return RankView(url, False, None, reason=p.reason, error=p.error, target=target,
                            polled_at=now)
        rv = RankView(url, False, prev.state if prev else None, target=target,
                      failures=prev.failures if prev else 0,
                      unreachable_since=prev.unreachable_since if prev else None,
                      last_ok_at=prev.last_ok_at if prev else None,
                      trust=prev.trust if prev else None, polled_at=now,
                      answered_at=prev.answered_at if prev else None)
        if p is None:
            rv.reason, rv.error = "connection", "not polled"
        elif not p.ok:
            rv.reason, rv.error = p.reason, p.error
        else:
            rv.reason, rv.error = "bad_response", f"bad /v1/state: {valid_state(p.data)}"
        rv.failures += 1
        if rv.unreachable_since is None:
            rv.unreachable_since = now
        return rv

    def _regroup(self, current: dict[str, RankView], changed: set[str],
                 moved: dict[int, list[tuple[RankView, RankView]]], rest: set[str],
                 with_evidence: bool) -> dict[int, GroupView]:
        """Move the changed ranks into their groups and group again only the groups touched;
        with verdicts, a group whose changed ranks only progressed (``moved``: by group, the
        ranks answering with the last shape; those whose verdict changed since are in
        ``rest`` too) is made from its last GroupView instead (GroupView._progressed);
        ``rest``: the other changed URLs. Returns the groups."""
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
            if with_evidence:
                ev_ranks.pop(url, None)
        groups = dict(self._groups)
        sums, slot = self._sums, self._slot
        ev_groups = self._ev_groups
        ev_apart: list[int] = []  # moved groups whose evidence is not the full group
        for g, pairs in moved.items():
            members = members_of[g]
            for _, rv in pairs:
                members[rv.url] = rv
            if g in dirty:
                # another of its ranks did more than progress, or its verdict changed (then
                # it is in ``rest``): grouped again below
                continue
            last = groups[g]
            ranks = last.ranks.copy()
            for _, rv in pairs:
                ranks[slot[rv.url]] = rv
            gv = groups[g] = last._progressed(ranks, pairs)
            if ev_groups.get(g) is last:  # every rank evidence: the same GroupView
                ev_groups[g] = gv
                for _, rv in pairs:
                    ev_ranks[rv.url] = rv
            else:
                ev_apart.append(g)
        for g in ev_apart:
            before = ev_groups.get(g)
            self._evidence_group(g, members_of[g], groups[g])
            self._ev_resum(before, ev_groups.get(g))
        added = False
        for g in dirty:
            if g is None:
                continue
            before = groups.get(g)
            members = members_of.get(g)
            if not members:
                members_of.pop(g, None)
                groups.pop(g, None)
                if with_evidence:
                    if before is not None:
                        sums.add(before, -1)
                    ev_before = self._ev_groups.pop(g, None)
                    self._ev_resum(ev_before, None)
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
                    rest.add(url)
                (old if sup else ranks).append(r)
            gv = None
            if not ranks:
                groups.pop(g, None)
            else:
                ranks.sort(key=_rank_order)
                for i, r in enumerate(ranks):
                    slot[r.url] = i
                added = added or g not in groups
                gv = groups[g] = GroupView(g, ranks, old)
            if with_evidence:
                if before is not None:
                    sums.add(before, -1)
                if gv is not None:
                    sums.add(gv, 1)
                ev_before = self._ev_groups.get(g)
                self._evidence_group(g, members, gv)
                self._ev_resum(ev_before, self._ev_groups.get(g))
        if added:
            groups = dict(sorted(groups.items()))
        if with_evidence and any(g not in self._ev_groups for g in dirty if g is not None):
            self._ev_groups = dict(sorted(self._ev_groups.items()))
        self._groups = groups
        return groups

    def _ev_resum(self, before: GroupView | None, after: GroupView | None) -> None:
        """The evidence view's sums, one of its groups replaced."""
        if before is after:
            return
        if before is not None:
            self._ev_sums.add(before, -1)
        if after is not None:
            self._ev_sums.add(after, 1)

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
