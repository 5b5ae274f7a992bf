"""What the detectors read of the ranks' answers: collective waits (each rank's own clock), who
a rank is and its group, which groups changed since a consumer last looked, held phases' age."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from monitor.evidence.group import in_held_phase
from monitor.evidence.rank import RankView
from monitor.evidence.view import ClusterView, GroupView
from monitor.poll.torch_target import is_torch


def torch_step_seconds(view: ClusterView) -> float | None:
    """The median step time of the view's torch-only ranks, read from the Lighthouse's step
    counter (they serve no step times of their own), or None."""
    vals = [s for r in view.polled_ranks if r.reachable and r.fresh and r.state
            and isinstance(s := (r.state.get("torch_only") or {}).get("step_s"), float)]
    return statistics.median(vals) if vals else None


def current_wait(state: Mapping[str, Any] | None) -> tuple[str | None, float | None]:
    """(scope, seconds) of the wait the rank is blocked in now; (None, None) if none."""
    if type(state) is dict:
        timing = state.get("timing")
        if timing is None or type(timing) is dict and timing.get("waiting") is None:
            return None, None  # most answers, told without the Mapping checks
    timing = state.get("timing") if isinstance(state, Mapping) else None
    w = timing.get("waiting") if isinstance(timing, Mapping) else None
    if not isinstance(w, Mapping):
        return None, None
    scope, secs = w.get("scope"), w.get("seconds")
    if not isinstance(scope, str) or not isinstance(secs, (int, float)) or not math.isfinite(secs):
        return None, None
    return scope, float(secs)


def collective_wait(state: Mapping[str, Any] | None) -> tuple[str | None, float]:
    """("group" or "cross", seconds) the rank has been blocked inside a collective (not a
    quorum), from its ``timing.waiting``, or (None, 0.0): every rank state (torch-only ones
    too, monitor.evidence.torch_rank) carries its own wait."""
    scope, secs = current_wait(state)
    if scope == "group" or (scope == "cross" and state.get("phase") == "allreduce"):
        return scope, secs
    return None, 0.0


def describe_ranks(view: ClusterView, ranks: list[int]) -> list[dict[str, Any]]:
    """Who the ranks are and where they run, from their last ``/v1/state``."""
    out = []
    for rank in ranks:
        rv = view.rank_view(rank)
        s = (rv.state if rv else None) or {}
        scope, secs = current_wait(s)
        out.append({"rank": rank, "group_rank": s.get("group_rank"), "host": s.get("host"),
                    "node": s.get("node") or s.get("host"), "device": s.get("device"),
                    "slurm_job_id": s.get("slurm_job_id"),
                    "local_rank": s.get("local_rank"), "pid": s.get("pid"),
                    "url": rv.url if rv else None, "reachable": bool(rv and rv.reachable),
                    "phase": s.get("phase"), "step": s.get("step"),
                    "waiting": None if scope is None else {"scope": scope,
                                                           "seconds": round(secs or 0.0, 3)},
                    # a rank on torch's debug server: the handler that serves them (POST)
                    "stacks": s.get("stacks_url") or (f"{rv.url}/v1/stacks" if rv and not
                                                      is_torch(rv.url) else None)})
    return out


def phases(view: ClusterView, ranks: list[int]) -> dict[str, Any]:
    return {str(d["rank"]): {k: d[k] for k in ("phase", "reachable", "step", "host", "waiting")}
            for d in describe_ranks(view, ranks) if d["phase"] is not None}


def rank_groups(view: ClusterView, dumps: Mapping[int, dict]) -> Callable[[int], int | None]:
    """rank -> its replica group: its RankView's when it answered, else its dump's claim."""
    claimed = {int(r): d["replica_group"] for r, d in dumps.items()
               if isinstance(d, Mapping) and isinstance(d.get("replica_group"), int)}

    def group_of(rank: int) -> int | None:
        rv = view.rank_view(rank)
        return rv.replica_group if rv is not None and rv.state is not None else claimed.get(rank)
    return group_of


class SeenGroups:
    """Which groups changed since this consumer's last call: a view keeps an unchanged group's
    GroupView object, so identity tells."""

    def __init__(self) -> None:
        self.groups: Mapping[int, GroupView] = {}

    def changed(self, view: ClusterView) -> tuple[list[int], set[int]]:
        """(groups new or changed, in view order; groups gone)."""
        seen, groups = self.groups, view.groups
        changed = [g for g, gv in groups.items() if seen.get(g) is not gv]
        gone = seen.keys() - groups.keys() if len(seen) > len(groups) - len(changed) else set()
        self.groups = groups
        return changed, gone


class SaveClock:
    """When the monitor first saw each rank (by URL) of a group in a held phase, kept while its
    ``phase_since`` stays: a save is aged on the monitor's clock, a rank's may be off."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s  # --checkpoint-timeout
        self._seen: dict[int, dict[str, tuple[Any, float]]] = {}

    def note(self, gv: GroupView, now: float, reachable: bool = True) -> tuple[float, bool] | None:
        """Note ``gv``'s ranks in a held phase now (``reachable``: its reachable ones, else all),
        forgetting its others; then :meth:`held` of those ranks."""
        was, seen, first = self._seen.pop(gv.replica_group, None) or {}, {}, now
        for url, r in gv.held.items():  # the held ranks alone: every group is noted each sweep
            if reachable and not r.reachable:
                continue
            since, got = r.state.get("phase_since"), was.get(url)
            seen[url] = got = got if got and got[0] == since else (since, now)
            first = min(first, got[1])
        if seen:
            self._seen[gv.replica_group] = seen
        if len(seen) < len(gv.reachable if reachable else gv.ranks):
            return None  # one of them is not held
        return first, now - first < self.timeout_s

    def forget(self, g: int) -> None:
        """Group ``g`` is gone: its next spell is seen afresh."""
        self._seen.pop(g, None)

    def held(self, g: int, ranks: Iterable[RankView | None],
             now: float) -> tuple[float, bool] | None:
        """None unless every one of ``ranks`` answered (None: not now) in a held phase; else (when
        the monitor first saw the oldest of these spells (``now``: not noted), whether under the
        timeout ago)."""
        seen, first = self._seen.get(g, {}), now
        for r in ranks:
            st = r.state if r is not None else None
            if not in_held_phase(st):
                return None
            got = seen.get(r.url)
            if got and got[0] == st.get("phase_since"):
                first = min(first, got[1])
        return first, now - first < self.timeout_s
