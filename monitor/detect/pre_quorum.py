"""``straggler`` found before the quorum: a rank slow before its torchft quorum call (data
loading, logging) keeps its own group's peers waiting in that call like every other group, so
its group shows no arrival lag and only ``job_slow`` fires, naming it in ``quorum_late``. Named
there for --straggler-windows windows, and the rise of the rank's own work (its compute a step
over the other ranks', against its own at pace) explaining LATE_SHARE of its group's rise in
lag, the group is a straggler like any other (evicted, its host's offence counted). A failure
of this check is logged and skipped for the sweep by Detectors; the rule: docs/detectors.md."""

from __future__ import annotations

import statistics
from typing import Any

from monitor.config import DetectorConfig
from monitor.evidence.view import ClusterView

from .findings import Finding, Findings
from .jobwide import LATE_SHARE, JobWide
from .straggler import Window


class PreQuorum:
    def __init__(self, cfg: DetectorConfig, findings: Findings,
                 jobwide: JobWide | None = None) -> None:
        self.cfg, self.findings = cfg, findings
        self._newest: int | None = None  # the newest step of the last window judged
        self._streak: tuple[int, int, int] | None = None  # (group, rank, windows in a row)
        # a group found here: its incarnation then and the next one, held as one, so the group
        # restarted still slow (its host's trouble stays) is held against its lag at pace before
        self._carried: dict[int, set[str]] = {}
        self._awaited: set[int] = set()  # groups found whose next incarnation is not seen yet
        if jobwide is not None:
            jobwide.same = self.same

    def same(self, members: frozenset) -> frozenset:
        """``members``, (group, replica id) of a quorum, with a carried group's incarnations as
        one."""
        return frozenset((g, None if rid in self._carried.get(g, ()) else rid)
                         for g, rid in members)

    def _carry(self, view: ClusterView) -> None:
        for gv in view.in_quorum():
            g, rid = gv.replica_group, gv.replica_id
            if g in self._awaited and rid is not None and rid not in self._carried[g]:
                self._carried[g].add(rid)  # one restart only: a later one is learned afresh
                self._awaited.discard(g)

    def judge(self, w: Window | None, view: ClusterView, now: float,
              slow: Finding | None, base_step_s: float | None = None) -> list[Finding]:
        """``base_step_s``: the job's healthy step (job_slow's baseline), None before it has one."""
        self._carry(view)
        if w is None or w.newest == self._newest:
            return []  # no newer steps: nothing new to judge
        self._newest = w.newest
        self._resolve(w, view, now, base_step_s)
        # job_slow judged this window (its evidence is not an older window's)
        q = slow.evidence.get("quorum_late") if slow is not None \
            and slow.evidence.get("steps") == [w.first, w.newest] else None
        got = self._explains(w, q)
        if got is None:
            self._streak = None
            return []
        g, r = q["group"], q["rank"]
        n = self._streak[2] + 1 if self._streak is not None and self._streak[:2] == (g, r) else 1
        self._streak = (g, r, n)
        gv = view.groups.get(g)
        if n < self.cfg.straggler_windows or gv is None:
            return []
        own, over = got
        ev = {"summary": f"rank {r} on host {q['host']} is slow before its quorum call (data "
                         f"loading, logging): replica group {g} arrives at torchft's quorum "
                         f"{q['lag_s']:.3f}s after the others ({q['baseline_lag_s']:.3f}s at "
                         f"pace), and the rank's own work a step rose by {own:.3f}s over the "
                         f"other ranks', {own / over:.0%} of that; its peers wait for it inside "
                         f"the quorum call, so the group shows no arrival lag",
              "cause": "before_quorum", "lag_s": q["lag_s"],
              "baseline_lag_s": q["baseline_lag_s"], "extra_work_s": q["extra_s"],
              "baseline_extra_work_s": q["baseline_extra_s"],
              "threshold_s": round(w.lag_threshold_s, 4), "steps": [w.first, w.newest],
              "job_slow_ratio": slow.evidence.get("ratio"), "quorum_id": view.quorum_id,
              # the job_slow it explains: the goodput ledger counts from that onset
              "job_findings": ["job_slow"]}
        f = self.findings.confirm("straggler", gv, [r], ev, slow.first_seen, now, view)
        if f is not None and f.replica_id is not None:
            self._carried.setdefault(g, set()).add(f.replica_id)
            self._awaited.add(g)
        return [f] if f else []

    def _explains(self, w: Window, q: dict[str, Any] | None) -> tuple[float, float] | None:
        """(the named rank's rise in extra work a step over its at-pace extra, its group's lag
        over its lag at pace) when ``job_slow``'s ``quorum_late`` names a group late by the
        straggler threshold and that rise explains LATE_SHARE of the lag's; else None. Work the
        rank always did (rank 0 logging) explains no rise: another group's work ending, or the
        network, moved the lag."""
        if q is None or q["rank"] is None or q.get("baseline_extra_s") is None:
            return None
        own, over = q["extra_s"] - q["baseline_extra_s"], q["lag_s"] - q["baseline_lag_s"]
        if q["lag_s"] < w.lag_threshold_s or over <= 0 or own < LATE_SHARE * over:
            return None
        return own, over

    def _resolve(self, w: Window, view: ClusterView, now: float,
                 base_step_s: float | None) -> None:
        """Its findings whose group's median quorum lag is back under the straggler threshold, or,
        with no lag to read (a rank serving no quorum waits, one out of reach), the job's step
        back at pace (half way to --job-slow-factor, as job_slow's back_at_pace): ``caught_up``.
        Held open unread, a rail lifting later would evict a group that recovered. A group gone
        or replaced: Findings' lifecycle."""
        # the step's rise bounds any group's lag: under the threshold, none is late (half way
        # to a --job-slow-factor over ~1.67 alone would allow a rank still late)
        factor = self.cfg.job_slow_factor
        at_pace = base_step_s is not None and base_step_s > 0 \
            and w.step_s / base_step_s <= (1 + factor) / 2 \
            and w.step_s - base_step_s < w.lag_threshold_s
        for key, f in list(self.findings.open.items()):
            if key[0] != "straggler" or f.evidence.get("cause") != "before_quorum":
                continue
            x = (w.quorum_lags or {}).get(key[1])
            if x is None and key[1] not in view.groups:
                continue  # a group gone (evicted): Findings' lifecycle says so
            if at_pace if x is None else statistics.median(x["step_lags_s"]) < w.lag_threshold_s:
                self.findings.resolve(key, "caught_up", now)
