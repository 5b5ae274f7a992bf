"""One sweep's picture of the job (:class:`ClusterView`): replica groups x ranks.

The full view is what the monitor shows; :meth:`ClusterView.evidence` is what the detectors and
the rails get: only the ranks whose answers count as evidence (monitor.evidence.verification).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain

import numpy as np

from .group import GroupView
from .rank import STEP_TIMES_READ, RankView


def median(values: Iterable[float]) -> float | None:
    """The median of ``values`` (statistics.median's value), None when empty."""
    arr = np.fromiter(values, dtype=float)
    return float(np.median(arr)) if len(arr) else None


class Sums:
    """Ranks known and reachable, ranks by verdict and groups by quorum id, summed over groups
    (ViewBuilder keeps them as groups are replaced)."""

    __slots__ = ("known", "up", "trust", "quorums")

    def __init__(self) -> None:
        self.known = self.up = 0
        self.trust: dict[tuple[str, str, bool] | None, int] = {}
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
        """Set ``view``'s ``counts`` and ``quorum_id`` from the sums."""
        ungrouped = view.ungrouped
        trust = {k: n for k, n in self.trust.items() if n}
        for r in ungrouped:
            trust[r.verdict] = trust.get(r.verdict, 0) + 1
        view.counts = (self.known + len(ungrouped), self.up, trust)
        view.quorum_id = max((q for q, n in self.quorums.items() if n), default=None)


@dataclass
class ClusterView:
    """One sweep's picture, never changed once built. An unchanged group is the very same GroupView
    object as the sweep before, so consumers tell what to read again by identity."""

    at: float
    ranks: dict[str, RankView]
    sweep_seconds: float = 0.0
    groups: dict[int, GroupView] = field(default_factory=dict)
    # given by ViewBuilder: the ranks of no group, the URLs polled this sweep in answer order,
    # the evidence view
    ungrouped: list[RankView] = field(default_factory=list)
    polled: list[str] | None = None
    evidence_view: ClusterView | None = field(default=None, repr=False)
    # set by Sums.fill: (known ranks (not superseded), reachable ones, (trust state, reason) ->
    # ranks), and the newest quorum id a group reports
    counts: tuple[int, int, dict[tuple[str, str] | None, int]] = field(init=False, repr=False)
    quorum_id: int | None = field(init=False, repr=False)

    @cached_property
    def reachable_fraction(self) -> float:
        known, up, _ = self.counts
        return up / known if known else 0.0

    def quorum_participants(self) -> int | None:
        q = self.quorum_id
        return max((g.quorums[q] for g in self.groups.values() if q in g.quorums), default=None)

    def in_quorum(self) -> list[GroupView]:
        """Groups with a reachable rank in the newest quorum that take part in it."""
        return list(self._in_quorum)

    def newest_step(self) -> int | None:
        """The newest step of the groups in the newest quorum; None: none reports one."""
        return max((g.step for g in self._in_quorum if g.step is not None), default=None)

    @cached_property
    def _in_quorum(self) -> list[GroupView]:
        q = self.quorum_id
        return [g for g in self.groups.values() if q in g.taking_part]

    def rank_view(self, rank: int) -> RankView | None:
        """The rank's RankView (not superseded), a reachable one if any; None: none."""
        return self._by_rank.get(rank)

    @cached_property
    def _by_rank(self) -> dict[int, RankView]:
        out: dict[int, RankView] = {}
        for r in self.ranks.values():
            k = r.rank
            if r.superseded or k is None:
                continue
            have = out.get(k)
            if have is None or (r.reachable and not have.reachable):
                out[k] = r
        return out

    @cached_property
    def polled_ranks(self) -> list[RankView]:
        """The ranks polled this sweep, in answer order (leader polling carries the others)."""
        if self.polled is None:
            return list(self.ranks.values())
        ranks = self.ranks
        return [ranks[u] for u in self.polled if u in ranks]

    def median_step_seconds(self, last: int = STEP_TIMES_READ) -> float | None:
        """Median of the recent step times of the reachable ranks polled this sweep."""
        cache = self.__dict__.setdefault("_median_steps", {})
        if last not in cache:
            cache[last] = median(chain.from_iterable(
                r.recent_steps()[-last:] for r in self.polled_ranks if r.reachable and r.fresh))
        return cache[last]

    def evidence(self) -> ClusterView:
        """The same sweep with only the ranks whose answers count as evidence (``trust``); a
        view not built by ViewBuilder has none (AssertionError)."""
        assert self.evidence_view is not None, "a view not built by ViewBuilder"
        return self.evidence_view
