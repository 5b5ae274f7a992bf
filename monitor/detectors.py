"""Detectors: from the cluster view (and live Flight Recorder dumps) to findings.

Each finding names a replica group (and its torchft ``replica_id``, i.e. one incarnation of the
group), the ranks involved, the evidence, when it was first seen and when it was confirmed. Only a
*confirmed* finding is handed on to the decisions; a candidate that does not persist is dropped
silently.

- ``straggler``: a group the others wait for at the cross-group all_reduce. Cheap trigger: a
  sweep where the group computes while a peer group already sits in ``allreduce``. Evidence, from
  Flight Recorder (:func:`monitor.analysis.arrival_lags`): over the newest ``straggler_steps``
  collectives of the current torchft incarnation the group enqueued last in at least 3 of 4, and
  its median lag behind the first group exceeds
  ``max(straggler_min_lag_s, straggler_rel_lag * median step time)``. Confirmed after
  ``straggler_windows`` consecutive windows, each with newer collectives than the last.
  Raw step time is *not* compared: with a slow group every group's step time rises (they wait
  for it); the lag is the time it spends outside the all_reduce beyond its peers.
- ``hang``: no step finished for ``max(hang_floor_s, hang_factor * median step time)``, peers wait
  in ``allreduce`` for that long, and the analysis engine finds a pending collective of the
  current incarnation that the group's ranks never enqueued (its ``culprit_ranks``).
- ``mismatch``: the analysis engine over live dumps finds members of one incarnation that
  enqueued different collectives at one sequence id; on a tie (e.g. two survivors) the culprit is
  the rank whose collective differs from its own history of that collective (the engine's
  ``departs_from_history``).
- ``dead``: a rank unreachable for ``dead_sweeps`` consecutive sweeps (not one replaced by a
  restart of its group).

Every sweep's dumps are normalized once (:func:`monitor.analysis.normalize_dumps`); the analyzer
and the arrival lags read the same traces. A dump that is not a Flight Recorder dump is left out
(and logged); the other ranks are still judged.

A group whose ``replica_id`` changes (torchft restarted it) starts from a clean slate: nothing
seen about the previous incarnation carries over. A detector that fails on odd input logs and
skips that sweep; it never takes the monitor down.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .analysis import RankTrace, analyze, arrival_lags, normalize_dumps
from .config import DetectorConfig
from .view import COMPUTE_PHASES, ClusterView, GroupView

log = logging.getLogger(__name__)

Analyzer = Callable[[Mapping[int, RankTrace]], Any]  # normalized traces -> result with .findings
KINDS = ("straggler", "hang", "mismatch", "dead")


@dataclass
class Finding:
    kind: str
    replica_group: int
    replica_id: str | None
    ranks: list[int]
    evidence: dict[str, Any]
    first_seen: float
    confirmed_at: float | None = None
    resolved_at: float | None = None
    resolution: str | None = None

    @property
    def key(self) -> tuple[str, int, str | None]:
        return (self.kind, self.replica_group, self.replica_id)

    @property
    def open(self) -> bool:
        return self.resolved_at is None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "replica_group": self.replica_group,
                "replica_id": self.replica_id, "ranks": list(self.ranks),
                "evidence": self.evidence, "first_seen": self.first_seen,
                "confirmed_at": self.confirmed_at, "resolved_at": self.resolved_at,
                "resolution": self.resolution}


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def engine_findings(result: Any) -> list[dict[str, Any]]:
    """Normalize an analyzer result's findings to dicts with kind, culprits and the engine JSON."""
    out = []
    for f in _get(result, "findings", None) or []:
        try:
            as_dict = f.to_dict() if hasattr(f, "to_dict") else dict(f) if isinstance(
                f, Mapping) else dict(vars(f))
            culprits = _get(f, "culprit_ranks", None) or []
            group = _get(f, "group", None)
            out.append({
                "kind": _get(f, "kind"),
                "culprits": sorted(int(r) for r in culprits),
                "quorum_id": as_dict.get("quorum_id", _get(group, "quorum_id")),
                "has_majority": as_dict.get("has_majority", True),
                "waiting": [int(r) for r in as_dict.get("waiting_ranks", [])],
                "seq": as_dict.get("seq"),
                "raw": as_dict,
            })
        except Exception as e:  # an engine finding of a shape we do not know: skip it
            log.warning("ignoring analysis finding %r: %s", f, e)
    return out


@dataclass
class _GroupMemory:
    replica_id: str | None
    lag_samples: deque = field(default_factory=lambda: deque(maxlen=8))
    straggler_windows: int = 0
    straggler_last_seq: tuple | None = None
    straggler_first_seen: float | None = None
    straggler_lags: list[float] = field(default_factory=list)
    hang_first_seen: float | None = None


class Detectors:
    """Stateful detectors; call :meth:`fr_wanted` then :meth:`update` once per sweep."""

    def __init__(self, cfg: DetectorConfig | None = None, analyzer: Analyzer | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg or DetectorConfig()
        self.analyzer = analyzer or analyze
        self.clock = clock
        self._groups: dict[int, _GroupMemory] = {}
        self._open: dict[tuple, Finding] = {}
        self._resolved: deque[Finding] = deque(maxlen=200)
        self._commit_failures: dict[str, int] = {}
        self._last_fr_at = 0.0
        self._fr_reason: str | None = None
        self._seen_mismatch: set[tuple] = set()
        self.last_lags: dict[int, float] = {}  # replica_group -> median arrival lag (s)
        self.last_error: str | None = None

    # --- public ----------------------------------------------------------------------
    def open_findings(self) -> list[Finding]:
        return sorted(self._open.values(), key=lambda f: (f.confirmed_at or 0, f.kind))

    def resolved_findings(self) -> list[Finding]:
        return list(self._resolved)

    def fr_wanted(self, view: ClusterView, now: float | None = None) -> list[str]:
        """URLs whose ``/v1/fr_trace`` this sweep needs (empty: no Flight Recorder this time)."""
        now = self.clock() if now is None else now
        reason = None
        try:
            self._remember_groups(view)
            if self._lag_candidates(view) or any(m.straggler_windows for m in
                                                 self._groups.values()):
                reason = "straggler"
            elif self._stall(view, now)[0]:
                reason = "hang"
            elif self._commit_failures_rose(view):
                reason = "commit_failures"
            elif now - self._last_fr_at >= self.cfg.fr_interval_s:
                reason = "periodic"
        except Exception as e:  # never let a trigger bug stop the sweep
            log.exception("Flight Recorder trigger failed")
            self.last_error = f"{type(e).__name__}: {e}"
        self._fr_reason = reason
        if reason is None:
            return []
        self._last_fr_at = now  # asked for, answered or not: the periodic clock restarts
        return [r.url for g in view.groups.values() for r in g.reachable]

    def update(self, view: ClusterView, dumps: Mapping[int, dict] | None = None,
               now: float | None = None) -> list[Finding]:
        """Fold one sweep (and the dumps :meth:`fr_wanted` asked for); returns newly confirmed."""
        now = self.clock() if now is None else now
        new: list[Finding] = []
        self._remember_groups(view)
        steps = [self._dead, self._hang, self._straggler, self._mismatch]
        traces: dict[int, RankTrace] = {}
        analysis = None
        if dumps:
            try:
                traces, errors = normalize_dumps(dumps)
                for err in errors:
                    log.warning("Flight Recorder dump of rank %s left out: %s", err["rank"], err["error"])
                analysis = engine_findings(self.analyzer(traces))
            except Exception as e:
                log.exception("Flight Recorder analysis failed")
                self.last_error = f"analysis: {type(e).__name__}: {e}"
        for step in steps:
            try:
                new.extend(step(view, dumps or {}, traces, analysis, now))
            except Exception as e:
                log.exception("detector %s failed", step.__name__)
                self.last_error = f"{step.__name__}: {type(e).__name__}: {e}"
        self._resolve_gone(view, now)
        self._commit_failures = {u: int(r.state.get("commit_failures") or 0)
                                 for u, r in view.ranks.items() if r.reachable and r.state}
        return new

    # --- bookkeeping -----------------------------------------------------------------
    def _remember_groups(self, view: ClusterView) -> None:
        for g, gv in view.groups.items():
            rid = gv.replica_id
            mem = self._groups.get(g)
            if mem is None or (rid is not None and mem.replica_id != rid):
                if mem is not None:
                    self._resolve_group(g, "replaced", self.clock(), keep_kind="dead")
                self._groups[g] = _GroupMemory(rid)

    def _open_or_get(self, kind: str, gv: GroupView, ranks: list[int], ev: dict[str, Any],
                     first_seen: float, now: float) -> Finding | None:
        """Open a confirmed finding unless one with the same key is already open."""
        key = (kind, gv.replica_group, gv.replica_id)
        if key in self._open:
            self._open[key].evidence = ev
            return None
        f = Finding(kind, gv.replica_group, gv.replica_id, ranks, ev, first_seen, now)
        self._open[key] = f
        log.warning("confirmed %s in replica group %d (ranks %s)", kind, gv.replica_group, ranks)
        return f

    def _resolve(self, key: tuple, how: str, now: float) -> None:
        f = self._open.pop(key, None)
        if f is not None:
            f.resolved_at, f.resolution = now, how
            self._resolved.append(f)

    def _resolve_group(self, g: int, how: str, now: float, keep_kind: str | None = None) -> None:
        for key in [k for k in self._open if k[1] == g and k[0] != keep_kind]:
            self._resolve(key, how, now)

    def _resolve_gone(self, view: ClusterView, now: float) -> None:
        for key in list(self._open):
            kind, g, rid = key
            gv = view.groups.get(g)
            if gv is None:
                self._resolve(key, "gone", now)
            elif kind != "dead" and not gv.reachable:
                self._resolve(key, "left_job", now)

    def _commit_failures_rose(self, view: ClusterView) -> bool:
        for u, r in view.ranks.items():
            if r.reachable and r.state:
                prev = self._commit_failures.get(u)
                if prev is not None and int(r.state.get("commit_failures") or 0) > prev:
                    return True
        return False

    def _rank_group(self, view: ClusterView, dumps: Mapping[int, dict]) -> dict[int, int]:
        out = {}
        for r in view.ranks.values():
            if r.state is not None and r.rank is not None:
                out[r.rank] = r.replica_group
        for rank, d in dumps.items():
            if isinstance(d, Mapping) and isinstance(d.get("replica_group"), int):
                out.setdefault(int(rank), d["replica_group"])
        return out

    # --- dead ------------------------------------------------------------------------
    def _dead(self, view, dumps, traces, analysis, now) -> list[Finding]:
        new = []
        dead_groups: dict[int, list] = {}
        for r in view.ranks.values():
            if r.superseded or r.replica_group is None:
                continue
            if not r.reachable and r.failures >= self.cfg.dead_sweeps:
                dead_groups.setdefault(r.replica_group, []).append(r)
        for g, gv in view.groups.items():
            key = ("dead", g, gv.replica_id)
            ranks = dead_groups.get(g)
            if not ranks:
                self._resolve(key, "reachable", now)
                continue
            ev = {"unreachable": {str(r.rank): {"url": r.url, "reason": r.reason,
                                                 "error": r.error, "sweeps": r.failures,
                                                 "since": r.unreachable_since} for r in ranks},
                  "group_ranks_unreachable": len(ranks), "group_ranks": len(gv.ranks)}
            f = self._open_or_get("dead", gv, sorted({r.rank for r in ranks if r.rank is not None}),
                                  ev, min(r.unreachable_since or now for r in ranks), now)
            if f:
                new.append(f)
        return new

    # --- hang ------------------------------------------------------------------------
    def _stall(self, view: ClusterView, now: float) -> tuple[bool, float, float]:
        """(stalled, seconds since the last finished step, threshold)."""
        groups = view.in_quorum()
        med = view.median_step_seconds() or 0.0
        threshold = max(self.cfg.hang_floor_s, self.cfg.hang_factor * med)
        last = [r.state.get("last_step_at") for g in groups for r in g.reachable]
        last = [float(t) for t in last if isinstance(t, (int, float))]
        if len(groups) < 2 or not last:
            return False, 0.0, threshold
        stall = now - max(last)
        waiting = [r for g in groups for r in g.reachable if r.state["phase"] == "allreduce"
                   and now - float(r.state["phase_since"]) >= threshold]
        return (stall >= threshold and bool(waiting)), stall, threshold

    def _hang(self, view, dumps, traces, analysis, now) -> list[Finding]:
        stalled, stall, threshold = self._stall(view, now)
        if not stalled:
            for key in [k for k in self._open if k[0] == "hang"]:
                self._resolve(key, "progress", now)
            return []
        if analysis is None:
            return []
        newest_q = view.quorum_id
        rank_group = self._rank_group(view, dumps)
        new = []
        for h in analysis:
            if h["kind"] != "hang" or h["quorum_id"] not in (None, newest_q):
                continue
            waiting_ok = [r for r in h["waiting"] if self._rank_waiting(view, r, now, threshold)]
            if not waiting_ok:
                continue  # nobody actually waits that long: not (yet) a hang
            by_group: dict[int, list[int]] = {}
            for r in h["culprits"]:
                g = rank_group.get(r)
                if g is not None:
                    by_group.setdefault(g, []).append(r)
            for g, ranks in by_group.items():
                gv = view.groups.get(g)
                if gv is None or not self._ranks_not_waiting(view, ranks):
                    continue
                ev = {"stalled_s": round(stall, 3), "threshold_s": round(threshold, 3),
                      "median_step_s": view.median_step_seconds(), "pending_seq": h["seq"],
                      "quorum_id": h["quorum_id"], "never_arrived": ranks,
                      "waiting_ranks": h["waiting"],
                      "phases": self._phases(view, ranks + waiting_ok, now),
                      "analysis": h["raw"]}
                f = self._open_or_get("hang", gv, ranks, ev, now - stall, now)
                if f:
                    new.append(f)
        return new

    @staticmethod
    def _rank_view(view: ClusterView, rank: int):
        for r in view.ranks.values():
            if r.rank == rank and not r.superseded:
                return r
        return None

    def _rank_waiting(self, view, rank, now, threshold) -> bool:
        r = self._rank_view(view, rank)
        return bool(r and r.reachable and r.state["phase"] == "allreduce"
                    and now - float(r.state["phase_since"]) >= threshold)

    def _ranks_not_waiting(self, view, ranks) -> bool:
        """True when no culprit rank is itself in the all_reduce (then it is not the one late)."""
        for rank in ranks:
            r = self._rank_view(view, rank)
            if r is not None and r.reachable and r.state["phase"] == "allreduce":
                return False
        return True

    def _phases(self, view, ranks, now) -> dict[str, Any]:
        out = {}
        for rank in ranks:
            r = self._rank_view(view, rank)
            if r is None or not r.state:
                continue
            out[str(rank)] = {"phase": r.state["phase"], "reachable": r.reachable,
                              "for_s": round(now - float(r.state["phase_since"]), 3),
                              "step": r.state["step"]}
        return out

    # --- straggler -------------------------------------------------------------------
    def _lag_candidates(self, view: ClusterView) -> list[int]:
        """Groups that compute while a peer group already waits in the all_reduce (one sample)."""
        groups = view.in_quorum()
        if len(groups) < 2:
            return []
        step = max((g.step or 0) for g in groups)
        at_step = [g for g in groups if g.step == step]
        waiting = {g.replica_group for g in at_step
                   if g.reachable and all(r.state["phase"] == "allreduce" for r in g.reachable)}
        if not waiting:
            return []
        lagging = [g.replica_group for g in at_step if g.replica_group not in waiting
                   and any(r.state["phase"] in COMPUTE_PHASES for r in g.reachable)]
        for g in groups:
            mem = self._groups.get(g.replica_group)
            if mem is not None:
                mem.lag_samples.append(g.replica_group in lagging)
        return lagging

    def _straggler(self, view, dumps, traces, analysis, now) -> list[Finding]:
        groups = {g.replica_group: g for g in view.in_quorum()}
        if len(groups) < 2:
            return []
        if not traces:
            return []
        rank_group = self._rank_group(view, dumps)
        lags = arrival_lags({r: t for r, t in traces.items() if rank_group.get(r) in groups},
                            last=self.cfg.straggler_steps)
        if not lags:
            return []
        newest_q = max((x.quorum_id for x in lags if x.quorum_id is not None), default=None)
        lags = [x for x in lags if x.quorum_id == newest_q]
        # per collective: each group's lag = its slowest rank's
        per_seq: list[dict[int, float]] = []
        for x in lags:
            gl: dict[int, float] = {}
            for rank, lag in x.lags_s.items():
                g = rank_group.get(rank)
                if g is not None:
                    gl[g] = max(gl.get(g, 0.0), lag)
            if len(gl) >= 2:
                per_seq.append(gl)
        if not per_seq:
            return []
        newest = (newest_q, max(x.seq for x in lags))
        med_step = view.median_step_seconds() or 0.0
        threshold = max(self.cfg.straggler_min_lag_s, self.cfg.straggler_rel_lag * med_step)
        need = max(1, math.ceil(0.75 * len(per_seq)))
        self.last_lags = {g: statistics.median(s.get(g, 0.0) for s in per_seq) for g in groups}
        new = []
        for g, gv in groups.items():
            mem = self._groups.get(g)
            if mem is None:
                continue
            last_count = sum(1 for s in per_seq if max(s, key=s.get) == g and s[g] >= threshold)
            med_lag = self.last_lags.get(g, 0.0)
            others = [v for k, v in self.last_lags.items() if k != g]
            passes = (len(per_seq) >= min(2, self.cfg.straggler_steps) and last_count >= need
                      and med_lag >= threshold
                      and med_lag > (statistics.median(others) if others else 0.0) + threshold)
            key = ("straggler", g, gv.replica_id)
            if mem.straggler_last_seq == newest:
                continue  # no new collectives since the last window: nothing new to judge
            mem.straggler_last_seq = newest
            if not passes:
                mem.straggler_windows = 0
                mem.straggler_first_seen = None
                mem.straggler_lags = []
                if key in self._open:
                    self._resolve(key, "caught_up", now)
                continue
            mem.straggler_windows += 1
            mem.straggler_lags.append(round(med_lag, 4))
            if mem.straggler_first_seen is None:
                mem.straggler_first_seen = now
            if mem.straggler_windows < self.cfg.straggler_windows:
                continue
            ranks = sorted(r for r, gg in rank_group.items() if gg == g and r in dumps)
            engine_says = [h["raw"] for h in analysis or [] if h["kind"] == "straggler"
                           and any(rank_group.get(r) == g for r in h["culprits"])]
            ev = {"median_lag_s": round(med_lag, 4), "threshold_s": round(threshold, 4),
                  "median_step_s": med_step, "last_in": f"{last_count}/{len(per_seq)}",
                  "windows": mem.straggler_windows, "window_lags_s": mem.straggler_lags[-10:],
                  "peer_lags_s": {str(k): round(v, 4) for k, v in self.last_lags.items()},
                  "quorum_id": newest_q, "newest_seq": newest[1],
                  "phases": self._phases(view, ranks, now), "analysis": engine_says}
            f = self._open_or_get("straggler", gv, ranks, ev, mem.straggler_first_seen, now)
            if f:
                new.append(f)
        return new

    # --- mismatch --------------------------------------------------------------------
    def _mismatch(self, view, dumps, traces, analysis, now) -> list[Finding]:
        if not analysis:
            return []
        rank_group = self._rank_group(view, dumps)
        new = []
        for m in analysis:
            if m["kind"] != "mismatch":
                continue
            culprits = list(m["culprits"])
            how = "majority"
            if not m["has_majority"]:
                culprits = [int(r) for r in m["raw"].get("departs_from_history") or []]
                how = "own_history"
            if not culprits:
                continue  # no way to tell who is wrong: report nothing we cannot back
            ident = (m["quorum_id"], m["raw"].get("group_rank"), m["seq"], tuple(culprits))
            by_group: dict[int, list[int]] = {}
            for r in culprits:
                g = rank_group.get(r)
                if g is not None:
                    by_group.setdefault(g, []).append(r)
            if len(by_group) * 2 > len({rank_group.get(r) for r in dumps}) and how != "majority":
                continue  # most groups "differ": the evidence does not single one out
            for g, ranks in by_group.items():
                gv = view.groups.get(g)
                if gv is None:
                    continue
                ev = {"quorum_id": m["quorum_id"], "seq": m["seq"], "culprit_ranks": ranks,
                      "attributed_by": how, "analysis": m["raw"]}
                f = self._open_or_get("mismatch", gv, ranks, ev, now, now)
                if f:
                    self._seen_mismatch.add(ident)
                    new.append(f)
        return new
