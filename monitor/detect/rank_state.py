"""What the detectors read of the ranks' answers: collective waits, who a rank is, which
ranks this sweep polled, which group a Flight Recorder rank belongs to, which groups changed.

No clock of another host is compared: a rank's waits are on its own clock (``timing`` in
``/v1/state``); only a rank without ``timing`` is timed by its phase against the monitor's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from monitor.evidence.view import ClusterView, GroupView, RankView


def current_wait(state: Mapping[str, Any] | None) -> tuple[str | None, float | None]:
    """(scope, seconds) of the collective wait the rank is blocked in now, on its own clock;
    (None, None) when it is not waiting or does not say."""
    timing = state.get("timing") if isinstance(state, Mapping) else None
    w = timing.get("waiting") if isinstance(timing, Mapping) else None
    if not isinstance(w, Mapping):
        return None, None
    scope, secs = w.get("scope"), w.get("seconds")
    if not isinstance(scope, str) or not isinstance(secs, (int, float)) or not math.isfinite(secs):
        return None, None
    return scope, float(secs)


def collective_wait(state: Mapping[str, Any] | None, now: float) -> tuple[str | None, float]:
    """How long the rank has been blocked inside a *collective* (not a quorum): ("group" or
    "cross", seconds), or (None, 0.0). A rank without ``timing`` falls back to its phase
    (``allreduce`` since ``phase_since``: its own clock against the monitor's)."""
    if type(state) is dict:
        timing = state.get("timing")
        if type(timing) is dict and timing.get("waiting") is None:
            return None, 0.0  # not waiting (most answers): said without the general path
    elif not isinstance(state, Mapping):
        return None, 0.0
    if isinstance(state.get("timing"), Mapping):
        scope, secs = current_wait(state)
        if scope == "group" or (scope == "cross" and state.get("phase") == "allreduce"):
            return scope, secs or 0.0
        return None, 0.0
    if state.get("phase") == "allreduce" and isinstance(state.get("phase_since"), (int, float)):
        return "cross", max(0.0, now - float(state["phase_since"]))
    return None, 0.0


def _waiting(state: Mapping[str, Any]) -> dict[str, Any] | None:
    scope, secs = current_wait(state)
    return None if scope is None else {"scope": scope, "seconds": round(secs or 0.0, 3)}


def describe_ranks(view: ClusterView, ranks: list[int]) -> list[dict[str, Any]]:
    """Who the culprit ranks are and where they run, from their last ``/v1/state``."""
    out = []
    for rank in ranks:
        rv = view.rank_view(rank)
        s = (rv.state if rv else None) or {}
        out.append({"rank": rank, "group_rank": s.get("group_rank"), "host": s.get("host"),
                    "node": s.get("node") or s.get("host"), "device": s.get("device"),
                    "local_rank": s.get("local_rank"), "pid": s.get("pid"),
                    "url": rv.url if rv else None, "reachable": bool(rv and rv.reachable),
                    "phase": s.get("phase"), "step": s.get("step"), "waiting": _waiting(s),
                    "stacks": f"{rv.url}/v1/stacks" if rv else None})
    return out


def phases(view: ClusterView, ranks: list[int]) -> dict[str, Any]:
    """{rank: phase, reachable, step, host, waiting} of the ranks with an answer."""
    out = {}
    for rank in ranks:
        r = view.rank_view(rank)
        if r is not None and r.state:
            out[str(rank)] = {"phase": r.state["phase"], "reachable": r.reachable,
                              "step": r.state["step"], "host": r.state.get("host"),
                              "waiting": _waiting(r.state)}
    return out


class FreshRanks:
    """(url, RankView) of the ranks polled this sweep, listed once per view (the trigger and
    every detector walk it): with leader polling the others are carried unchanged, and what
    they said was read when they were polled."""

    def __init__(self) -> None:
        self._of: dict[int, tuple[ClusterView, list]] = {}  # the last two views' lists

    def __call__(self, view: ClusterView) -> list[tuple[str, RankView]]:
        got = self._of.get(id(view))
        if got is not None and got[0] is view:
            return got[1]
        if len(self._of) >= 2:
            self._of.clear()
        ranks = view.ranks
        out = list(ranks.items()) if view.polled is None else \
            [(u, ranks[u]) for u in view.polled if u in ranks]
        self._of[id(view)] = (view, out)
        return out


class RankGroups:
    """rank -> its replica group, for the ranks a Flight Recorder finding names: the group its
    RankView says when it answered (a live process's, never a superseded one's), else its
    dump's own claim. Looked up per rank named, not built for every rank."""

    __slots__ = ("view", "dumps", "claimed")

    def __init__(self, view: ClusterView, dumps: Mapping[int, dict]) -> None:
        self.view, self.dumps = view, dumps
        self.claimed: dict[int, int] | None = None  # the dumps' claims, made on first need

    def get(self, rank: int) -> int | None:
        rv = self.view.rank_view(rank)
        if rv is not None and rv.state is not None:
            return rv.replica_group
        if self.claimed is None:
            self.claimed = {int(r): d["replica_group"] for r, d in self.dumps.items()
                            if isinstance(d, Mapping) and isinstance(d.get("replica_group"), int)}
        return self.claimed.get(rank)


class SeenGroups:
    """Which groups' ``GroupView`` differs from the one a consumer saw at its last call.

    An incremental view keeps a group's GroupView *object* while nothing in the group changed
    and never changes a view once built, so identity tells what to read again. Each consumer
    keeps its own, so one that skipped a sweep still sees everything that changed since."""

    def __init__(self) -> None:
        self.groups: Mapping[int, GroupView] = {}

    def changed(self, view: ClusterView) -> tuple[list[int], set[int]]:
        """(groups of ``view`` new or changed since the last call, in view order; groups gone)."""
        seen, groups = self.groups, view.groups
        changed = [g for g, gv in groups.items() if seen.get(g) is not gv]
        gone = seen.keys() - groups.keys() if len(seen) > len(groups) - len(changed) else set()
        self.groups = groups
        return changed, gone
