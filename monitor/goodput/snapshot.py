"""The goodput ledger's resumable state: what the store keeps between monitor runs.

Version 3 is written (per-group columns, unsettled badput as runs); versions 1 (a dict per group,
row and slice) and 2 (a dict per slice) still resume, read through :func:`snapshot_rows`. Another
version starts a fresh ledger.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import numpy as np

from .columns import with_none
from .model import (
    CAUSE_COLUMN,
    CAUSES,
    HUGE,
    INTERVAL_FIELDS,
    PENDING,
    RUN_LISTS,
    SNAPSHOT_VERSION,
    UNSEEN,
    GoodputConfig,
    Incident,
    Interval,
    Run,
)


class GoodputSnapshot:
    """The persistence half of :class:`monitor.goodput.ledger.GoodputLedger` (mixed into it)."""

    def snapshot(self) -> dict[str, Any]:
        """The state a restarted monitor resumes from (incidents and settled intervals are
        stored apart: :meth:`unsaved`)."""
        job, S = self.job, self.slots
        return {
            "version": SNAPSHOT_VERSION, "since": self.since, "last_at": self.last_at,
            "groups": self._groups_snapshot(),
            "job_step": job.step, "job_history": list(job.history)[-1:],
            "baseline_samples": list(job.samples), "baseline": job.baseline,
            "pace": job.ratio, "slow_since": job.slow_since,
            "last_commit_at": self.last_commit_at,
            "steady": list(job.steady) if job.steady else None,
            "totals": S.totals_columns(), "gpu_totals": S.totals_columns(1),
            "expected_groups": self.expected_groups, "unobserved_s": self.unobserved_s,
            "gap_s": self.gap_s, "gaps": self.gaps, "skipped_sweeps": self.skipped_sweeps,
            "goodput_debt": self.goodput_debt,
            "unsettled": [{k: v for k, v in vars(r).items() if k != "slots"} for r in self.runs],
            "open_intervals": {"key": list(self.open_intervals), **{
                f: list(map(attrgetter(f), self.open_intervals.values()))
                for f in INTERVAL_FIELDS}},
            "next_incident": self.incidents.next_id,
            "seen_evictions": sorted(self.incidents.seen_evictions)[-1000:],
        }

    def _groups_snapshot(self) -> dict[str, Any]:
        """``history_cum``: each group's count at the history sample ``history_t`` (None: its
        history starts after)."""
        S, hist = self.slots, self.hist
        n = len(S)
        last_in = S.last_in_quorum_at[1:]
        newest = hist.cum[-1][1:n] if hist.cum else np.zeros(0, np.int64)
        sampled = S.born[1:1 + len(newest)] < hist.next
        return {
            "gid": S.gids[1:], "replica_id": S.rid[1:], "commits": S.commits[1:].tolist(),
            "cum": S.cum[1:].tolist(), "gpus": S.gpus[1:].tolist(),
            "last_in_quorum_at": with_none(last_in, np.isnan(last_in)),
            "history_t": hist.t[-1] if hist.t else None,
            "history_cum": with_none(newest, ~sampled) + [None] * (n - 1 - len(newest)),
        }

    def unsaved(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Incidents changed and intervals closed since :meth:`saved`."""
        return self.incidents.unsaved(), [dict(vars(iv)) for iv in self._closed_intervals]

    def saved(self) -> None:
        """What :meth:`unsaved` returned is stored: forget it."""
        self.incidents.dirty.clear()
        self._closed_intervals = []
        self.incidents.forget_old({r.incident for r in self.runs})

    @classmethod
    def restore(cls, cfg: GoodputConfig | None, state: dict[str, Any] | None,
                incidents: list[dict[str, Any]], intervals: list[dict[str, Any]]) -> Any:
        """A ledger resuming from what :meth:`snapshot` and :meth:`unsaved` stored; a fresh one
        for a snapshot of an unknown version."""
        led = cls(cfg)
        runs = state.get("unsettled") if state and state.get("version") == 3 else None
        state = snapshot_rows(state)
        if not state or state.get("version") != 1:
            return led
        led.since, led.last_at = state.get("since"), state.get("last_at")
        groups = state.get("groups") or {}
        S, hist, job = led.slots, led.hist, led.job
        S.add([int(g) for g in groups], 0)
        # a group stored without the newest history sample starts its history at the next sweep
        newest = {tuple(d["history"][-1]) for d in groups.values() if d.get("history")}
        t = max(x[0] for x in newest) if newest else None
        if t is not None:
            hist.t.append(t)
            hist.cum.append(np.zeros(len(S), np.int64))
        for slot, d in enumerate(groups.values(), 1):
            S.rid[slot] = d.get("replica_id")
            S.commits[slot] = _count(d.get("commits"), -1)
            S.cum[slot] = _count(d.get("cum"), 0)
            S.gpus[slot] = _count(d.get("gpus"), 0)
            at = d.get("last_in_quorum_at")
            S.last_in_quorum_at[slot] = np.nan if at is None else at
            h = d.get("history")
            if h and h[-1][0] == t:
                hist.cum[0][slot] = _count(h[-1][1], 0)
            else:
                S.born[slot] = hist.next
        job.step, job.baseline, job.slow_since, job.ratio, led.last_commit_at = map(
            state.get, ("job_step", "baseline", "slow_since", "pace", "last_commit_at"))
        job.history.extend(tuple(x) for x in state.get("job_history") or [])
        job.samples.extend(state.get("baseline_samples") or [])
        steady = state.get("steady")
        job.steady = (float(steady[0]), int(steady[1])) if steady else None
        for kind, rows in enumerate((state.get("totals"), state.get("gpu_totals"))):
            for key, row in (rows or {}).items():
                if key != UNSEEN and int(key) not in S.index:
                    S.add([int(key)], hist.next)
                slot = 0 if key == UNSEEN else S.index[int(key)]
                S.row(slot, key, kind)
                for cause, v in row.items():
                    if cause in CAUSE_COLUMN:
                        c = CAUSE_COLUMN[cause]
                        S.bad[kind, c, slot], S.has[kind, c, slot] = v, True
                S.good[kind, slot] = row.get("goodput", 0.0)
                S.exp[kind, slot] = row.get("expected", 0.0)
        for name, of in (("expected_groups", int), ("unobserved_s", float), ("gap_s", float),
                         ("gaps", int), ("skipped_sweeps", int), ("goodput_debt", float)):
            setattr(led, name, of(state.get(name) or 0))
        if runs is None:  # stored slice by slice (version 1 or 2): a run of one each
            runs = [{"counted": d.get("cause") != PENDING,
                     **{k: v for k, v in d.items() if k not in RUN_LISTS},
                     **{r: [d[f]] for f, r in RUN_LISTS.items()}}
                    for d in state.get("unsettled") or []]
        for d in runs:
            new = [g for g in d["groups"] if g is not None and g not in S.index]
            if new:
                S.add(list(dict.fromkeys(new)), hist.next)
            slots = np.fromiter((S.index[g] if g is not None else 0 for g in d["groups"]),
                                np.int64, len(d["groups"]))
            led.runs.append(Run(slots=slots, **d))
        led.open_intervals = {k: Interval(**v) for k, v in
                              (state.get("open_intervals") or {}).items()}
        led.incidents.next_id = int(state.get("next_incident") or 1)
        led.incidents.seen_evictions = set(state.get("seen_evictions") or [])
        for d in incidents:
            inc = Incident.from_store(d)
            led.incidents[inc.id] = inc
            led.incidents.next_id = max(led.incidents.next_id, inc.id + 1)
        led.intervals.extend(Interval(**iv) for iv in intervals)
        return led


def snapshot_rows(state: dict[str, Any]) -> dict[str, Any]:
    """A version 2 or 3 snapshot as version 1 had it; any other state as it is."""
    if not state or state.get("version") not in (2, 3):
        return state
    if state["version"] == 3:
        state = {**state, "unsettled": [
            {**{k: v for k, v in r.items() if k not in RUN_LISTS.values()},
             **dict(zip(RUN_LISTS, one, strict=True))}
            for r in state.get("unsettled") or []
            for one in zip(*(r[f] for f in RUN_LISTS.values()), strict=True)]}
    g = state.get("groups") or {}
    t = g.get("history_t")
    groups = {
        str(gid): {"replica_id": rid, "commits": c if c != -1 else None, "cum": cum,
                   "gpus": gpus or None, "last_in_quorum_at": at,
                   "history": [] if h is None else [(t, h)]}
        for gid, rid, c, cum, gpus, at, h in zip(
            g["gid"], g["replica_id"], g["commits"], g["cum"], g["gpus"],
            g["last_in_quorum_at"], g["history_cum"], strict=True)}
    iv = state.get("open_intervals") or {"key": []}
    open_intervals = {k: dict(zip(INTERVAL_FIELDS, row, strict=True))
                      for k, *row in zip(iv["key"], *(iv[f] for f in INTERVAL_FIELDS),
                                         strict=True)}
    return {**state, "version": 1, "groups": groups, "open_intervals": open_intervals,
            "totals": _totals_rows(state.get("totals")),
            "gpu_totals": _totals_rows(state.get("gpu_totals"))}


def _totals_rows(cols: dict[str, Any] | None) -> dict[str, dict[str, float]]:
    if not cols:
        return {}
    causes = [(c, cols[c]) for c in CAUSES if c in cols]
    rows = {}
    for i, key in enumerate(cols["key"]):
        row = {c: v[i] for c, v in causes if v[i] is not None}
        row["goodput"], row["expected"] = cols["goodput"][i], cols["expected"][i]
        rows[key] = row
    return rows


def _count(v: Any, missing: int) -> int:
    """A stored count as the int64 columns hold it (an older ledger stored any claim)."""
    return v if type(v) is int and 0 <= v < HUGE else missing
