"""The goodput ledger's resumable state: what the store keeps between monitor runs, per-group
state and totals as columns and unsettled badput as runs. A snapshot of another version starts
a fresh ledger."""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import numpy as np

from .columns import with_none
from .model import (
    CAUSES,
    INTERVAL_FIELDS,
    PENDING,
    SNAPSHOT_VERSION,
    UNSEEN,
    GoodputConfig,
    Incident,
    Interval,
    Run,
)

COUNTS = ("expected_groups", "unobserved_s", "gap_s", "gaps", "skipped_sweeps", "goodput_debt")


def thinned(ts: list[float], b: float | None, first: int = 0) -> list[int]:
    """The samples of ``ts`` (ascending) from ``first`` on that a snapshot keeps: the first, the
    last, and between them the newest at least ``b`` apart (all before a baseline): a window
    start up to ``b`` early moves pace by a step at most."""
    if not ts:
        return []
    keep = [len(ts) - 1]
    for i in range(len(ts) - 2, first, -1):
        if not b or ts[keep[-1]] - ts[i] >= b:
            keep.append(i)
    if first < keep[-1]:
        keep.append(first)
    return keep[::-1]


class GoodputSnapshot:
    """The persistence half of :class:`monitor.goodput.ledger.GoodputLedger` (mixed into it)."""

    def snapshot(self) -> dict[str, Any]:
        """The state a restarted monitor resumes from (incidents and settled intervals are
        stored apart: :meth:`unsaved`)."""
        job, S = self.job, self.slots
        return {
            "version": SNAPSHOT_VERSION, "since": self.since, "last_at": self.last_at,
            "groups": self._groups_snapshot(),
            # the whole trailing window (trimmed to it): a restart just after the job resumed
            # still dates its return to pace from the commits before it
            "job_step": job.step, "job_history": list(job.history),
            "job_rids": None if job.rids is None else sorted(job.rids),
            "quorum_top": self.reader.top,
            "baseline_samples": list(job.samples), "baseline": job.baseline,
            "pace": job.ratio, "slow_since": job.slow_since,
            "last_commit_at": self.last_commit_at, "went_on_at": self.went_on_at,
            "committed_at": self.committed_at,
            "steady": list(job.steady) if job.steady else None,
            "totals": S.totals_columns(), "gpu_totals": S.totals_columns(1),
            **{name: getattr(self, name) for name in COUNTS},
            "unsettled": [{k: v for k, v in vars(r).items() if k != "slots"} for r in self.runs],
            "open_intervals": {"key": list(self.open_intervals), **{
                f: list(map(attrgetter(f), self.open_intervals.values()))
                for f in INTERVAL_FIELDS}},
            "next_incident": self.incidents.next_id, "first_incident": self.first_incident,
            "seen_evictions": sorted(self.incidents.seen_evictions)[-1000:],
            "held": sorted(map(list, self.incidents.held.items())),
        }

    def _groups_snapshot(self) -> dict[str, Any]:
        """Per-group columns; ``window``: the pace window's samples a step apart (:func:`thinned`;
        counts 0 before a group's ``born`` sample), so a restart judges pace as before within a
        step; ``history_cum``: counts at sample ``history_t`` (None: born after)."""
        S, hist = self.slots, self.hist
        n = len(S)
        last_in = S.last_in_quorum_at[1:]
        newest = hist.cum[-1][1:n] if hist.cum else np.zeros(0, np.int64)
        sampled = S.born[1:1 + len(newest)] < hist.next
        born = np.maximum(0, S.born[1:] - hist.first)
        keep = thinned(list(hist.t), self.job.baseline, int(born.min()) if n > 1 else 0)
        rows = np.zeros((len(keep), n - 1), np.int64)
        for j, i in enumerate(keep):
            c = hist.cum[i][1:n]
            rows[j, :len(c)] = c
        return {
            "gid": S.gids[1:], "replica_id": S.rid[1:], "commits": S.commits[1:].tolist(),
            "cum": S.cum[1:].tolist(), "gpus": S.gpus[1:].tolist(),
            "last_in_quorum_at": with_none(last_in, np.isnan(last_in)),
            "history_t": hist.t[-1] if hist.t else None,
            "history_cum": with_none(newest, ~sampled) + [None] * (n - 1 - len(newest)),
            # a group born at a sample left out starts at the next one kept
            "window": {"t": [hist.t[i] for i in keep], "cum": rows.tolist(),
                       "born": np.searchsorted(keep, born).tolist()},
            "carry": S.carry[1:].tolist(),
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
        """A ledger resuming from what :meth:`snapshot` and :meth:`unsaved` stored (fresh for other
        version); raises KeyError, TypeError or ValueError on a malformed one."""
        led = cls(cfg)
        if not state or state.get("version") != SNAPSHOT_VERSION:
            # the old rows stay: number after them, and never take them in on a later restart
            led.incidents.next_id = led.first_incident = 1 + max(
                (d["id"] for d in incidents if isinstance(d.get("id"), int)), default=0)
            return led
        led.first_incident = state.get("first_incident", 1)
        led.since, led.last_at = state["since"], state["last_at"]
        S, hist, job = led.slots, led.hist, led.job
        g = state["groups"]
        S.add(g["gid"], 0)
        S.rid[1:] = g["replica_id"]
        for name in ("commits", "cum", "gpus"):
            getattr(S, name)[1:] = g[name]
        S.last_in_quorum_at[1:] = [np.nan if t is None else t for t in g["last_in_quorum_at"]]
        if "carry" in g:  # an older snapshot's groups hold none
            S.carry[1:] = g["carry"]
        sampled = np.array([c is not None for c in g["history_cum"]], bool)
        if "window" in g:
            window = g["window"]
            hist.t.extend(window["t"])
            hist.cum.extend(np.array([0, *row], np.int64) for row in window["cum"])
            S.born[1:] = window["born"]
        elif sampled.any():  # the groups without it start their history at the next sweep
            hist.t.append(g["history_t"])
            hist.cum.append(np.zeros(len(S), np.int64))
            hist.cum[0][1:][sampled] = [c for c in g["history_cum"] if c is not None]
            S.born[1:][~sampled] = hist.next
        job.step, job.baseline, job.slow_since, job.ratio, led.last_commit_at = map(
            state.get, ("job_step", "baseline", "slow_since", "pace", "last_commit_at"))
        # an older snapshot's: its last commit, as that monitor judged "went on"
        led.went_on_at = state.get("went_on_at", led.last_commit_at)
        led.committed_at = state.get("committed_at", led.last_commit_at)  # an older one's: late
        job.history.extend(tuple(x) for x in state["job_history"])
        job.rids = set(state.get("job_rids") or ()) or None  # an older snapshot's: not known
        # an older snapshot's: the job's step (the quorum's newest when it last moved on)
        led.reader.top = state.get("quorum_top", job.step)
        job.samples.extend(state["baseline_samples"])
        steady = state["steady"]
        job.steady = (float(steady[0]), int(steady[1])) if steady else None
        for kind, cols in enumerate((state["totals"], state["gpu_totals"])):
            slots = [0 if key == UNSEEN else S.index[int(key)] for key in cols["key"]]
            S.good[kind, slots], S.exp[kind, slots] = cols["goodput"], cols["expected"]
            for cause, vals in cols.items():
                if cause in ("key", "goodput", "expected"):
                    continue
                # a cause another version wrote is unattributed here: its seconds stay counted
                c = CAUSES.index(cause if cause in CAUSES else "unattributed")
                has = [v is not None for v in vals]
                if any(has):
                    at = np.asarray(slots)[has]
                    S.bad[kind, c, at] += [v for v in vals if v is not None]
                    S.has[kind, c, at] = True
        for name in COUNTS:
            setattr(led, name, state[name])
        for d in state["unsettled"]:
            slots = np.fromiter((0 if g is None else S.index[g] for g in d["groups"]), np.int64,
                                len(d["groups"]))
            if d["cause"] not in (*CAUSES, PENDING):  # settling it would raise every sweep
                d = {**d, "cause": "unattributed"}
            led.runs.append(Run(slots=slots, **d))
        iv = state["open_intervals"]
        led.open_intervals = {k: Interval(*row) for k, *row in zip(
            iv["key"], *(iv[f] for f in INTERVAL_FIELDS), strict=True)}
        led.incidents.next_id = state["next_incident"]
        led.incidents.seen_evictions = set(state["seen_evictions"])
        # an older snapshot's: none (its restart holds every incident a restart closed)
        led.incidents.held = {int(i): float(until) for i, until in state.get("held", ())}
        for d in filter(lambda d: d["id"] >= led.first_incident, incidents):
            inc = Incident.from_store(d)
            if not inc.open and inc.closed_step_s is None:  # closed by an older monitor
                inc.closed_step_s = job.baseline  # its cost stays put from here on
                led.incidents.dirty.add(inc.id)  # and across the next restart
            led.incidents[inc.id] = inc
            led.incidents.next_id = max(led.incidents.next_id, inc.id + 1)
        led.intervals.extend(Interval(**iv) for iv in intervals)
        return led
