"""``GET /v1/goodput``: the ledger as JSON, settled totals plus what is not settled yet."""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from operator import itemgetter
from typing import Any

from .columns import key_of
from .model import CAUSES, PENDING, UNSEEN, Incident, Interval

Rows = dict[str, dict[str, float]]


class GoodputReport:
    """The reading half of :class:`monitor.goodput.ledger.GoodputLedger` (mixed into it)."""

    def to_json(self, incidents: int = 50, intervals: int = 200) -> dict[str, Any]:
        """The job, each group, incidents and intervals (newest first)."""
        rows, gpu = self._live_totals()
        job = self._summary(list(rows.values()))
        job["gpu_seconds"] = self._summary(list(gpu.values())) if gpu else None
        if job["gpu_seconds"]:
            job["gpu_seconds"].pop("goodput_ratio", None)
        groups, S = [], self.slots
        for key in sorted(rows, key=lambda k: (k == UNSEEN, int(k) if k != UNSEEN else 0)):
            slot = 0 if key == UNSEEN else S.index[int(key)]  # slot 0: never seen
            at = float(S.last_in_quorum_at[slot])
            groups.append({**self._summary([rows[key]]), "replica_group": S.gids[slot],
                           "replica_id": S.rid[slot], "gpus": (int(S.gpus[slot]) or None) if slot else None,
                           "last_in_quorum_at": None if math.isnan(at) else at})
        incs = sorted(self.incidents.values(), key=lambda i: i.id, reverse=True)[:incidents]
        job_pace, baseline = self.job, self.baseline
        return {
            "since": self.since, "at": self.last_at,
            "wall_seconds": round(self.last_at - self.since, 3) if self.since is not None else 0.0,
            "unobserved_seconds": round(self.unobserved_s, 3),
            "gaps": self.gaps, "gap_seconds": round(self.gap_s, 3),
            "skipped_sweeps": self.skipped_sweeps,
            "expected_groups": self.expected_groups,
            "expected_groups_source": "flag" if self.cfg.expected_groups else "max_seen",
            "baseline": {"step_seconds": round(baseline, 4) if baseline else None,
                         "samples": len(job_pace.samples),
                         "window_samples": self.cfg.baseline_samples,
                         "frozen": job_pace.frozen(self.last_at, self.incidents.unsettled(
                             self.last_at or 0.0, job_pace.horizon))},
            "pace": {"ratio": round(job_pace.ratio, 3) if job_pace.ratio is not None else None,
                     "threshold": self.cfg.pace_threshold, "window_s": round(job_pace.window, 3)},
            "horizon_s": round(job_pace.horizon, 3),
            "job": job,
            "groups": groups,
            "incidents": [self.incident_json(i) for i in incs],
            "intervals": self.intervals_json(intervals),
        }

    def _live_totals(self) -> tuple[Rows, Rows]:
        rows, gpu = self.slots.totals_rows(0), self.slots.totals_rows(1)
        for r in self.runs:
            for g, x, m in zip(r.groups, r.seconds, r.gpus, strict=True):
                row = rows.setdefault(key_of(g), {})
                row[r.cause] = row.get(r.cause, 0.0) + x
                if m:
                    row = gpu.setdefault(key_of(g), {})
                    row[r.cause] = row.get(r.cause, 0.0) + x * m
        return rows, gpu

    @staticmethod
    def _summary(rows: list[dict[str, float]]) -> dict[str, Any]:
        expected = sum(r.get("expected", 0.0) for r in rows)
        good = sum(r.get("goodput", 0.0) for r in rows)
        return {"goodput_ratio": round(good / expected, 4) if expected > 0 else None,
                "goodput_seconds": round(good, 3),
                "expected_seconds": round(expected, 3),
                "badput_seconds": {c: round(sum(r.get(c, 0.0) for r in rows), 3) for c in CAUSES},
                "pending_seconds": round(sum(r.get(PENDING, 0.0) for r in rows), 3)}

    def incident_json(self, inc: Incident) -> dict[str, Any]:
        """An incident with its cost so far, settled and not."""
        live = replace(inc, cost=dict(inc.cost))
        for r in self.runs:
            if r.incident == inc.id:
                live.charge(r)
        total = sum(live.cost.values())
        gpu = None if total and not live.gpu_cost_known else round(live.gpu_cost, 3)

        def since_onset(t: float | None) -> float | None:
            return round(t - inc.onset_at, 3) if t is not None else None

        out = asdict(inc)
        del out["gpu_cost"], out["gpu_cost_known"], out["closed_step_s"]
        b = inc.closed_step_s if not inc.open and inc.closed_step_s else self.baseline
        return {
            **out, "open": inc.open,
            "back_to_pace": None if inc.back_to_pace_at is None
            else "superseded" if inc.superseded_by is not None
            else "settled" if inc.settled_pace is not None else "reached",
            "detect_s": since_onset(inc.detected_at), "evict_s": since_onset(inc.evicted_at),
            "recovery_s": since_onset(inc.back_to_pace_at),
            "rejoin_s": since_onset(inc.rejoined_at),
            "cost": {"replica_seconds": round(total, 3),
                     "by_cause": {k: round(v, 3) for k, v in sorted(live.cost.items())},
                     "gpu_seconds": gpu,
                     "group_steps": round(total / b, 1) if b else None},
        }

    def intervals_json(self, limit: int = 200) -> list[dict[str, Any]]:
        """Newest first, the unsettled badput merged on the fly."""
        merged: dict[str, Interval] = {}
        out: list[Interval] = []
        parts = sorted(((r.t0, key_of(g), r, g, x, m) for r in self.runs
                        for g, x, m in zip(r.groups, r.seconds, r.gpus, strict=True)),
                       key=itemgetter(0, 1))
        for _, key, r, g, x, m in parts:
            cur = merged.get(key)
            if cur is None or not cur.extend(r, x, m):
                cur = merged[key] = Interval.of(r, g, x, m, settled=False)
                out.append(cur)
        rows = list(self.intervals) + list(self.open_intervals.values()) + out
        rows.sort(key=lambda iv: (iv.end, iv.start), reverse=True)
        return [iv.to_dict() for iv in rows[:limit]]
