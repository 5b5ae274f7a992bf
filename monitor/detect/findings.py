"""Findings and their lifecycle: opened once confirmed (one per kind, replica group and torchft
``replica_id``), then resolved; the evidence names the culprits and where they run. A job-wide
finding (:data:`JOB_KINDS`) has no group: its ``replica_group`` and ``replica_id`` are None."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from monitor.evidence.view import ClusterView, GroupView

from .rank_state import describe_ranks

log = logging.getLogger(__name__)

KINDS = ("straggler", "hang", "mismatch", "dead_rank", "dead", "stuck_starting",
         "quarantined_host",  # opened by monitor.act.hosts
         "job_stall", "job_slow", "network")
JOB_KINDS = ("job_stall", "job_slow")  # the whole job, no group named (monitor.detect.jobwide)


@dataclass
class Finding:
    kind: str
    replica_group: int | None  # None: the whole job (JOB_KINDS)
    replica_id: str | None
    ranks: list[int]
    evidence: dict[str, Any]
    first_seen: float
    confirmed_at: float | None = None
    resolved_at: float | None = None
    resolution: str | None = None
    # confirms again the episode a previous run left open (Detectors.restarted), counted then:
    # the id of its first finding (set by the Enforcer as it records it)
    reconfirms: int | None = None

    @property
    def key(self) -> tuple[str, int, str | None]:
        return (self.kind, self.replica_group, self.replica_id)

    def to_dict(self) -> dict[str, Any]:
        return {**vars(self), "ranks": list(self.ranks)}


class Findings:
    """The open findings by key, and the last 200 resolved."""

    def __init__(self) -> None:
        self.open: dict[tuple, Finding] = {}
        self.resolved: deque[Finding] = deque(maxlen=200)

    def groups(self, *kinds: str) -> set[int]:
        return {k[1] for k in self.open if k[0] in kinds}

    def confirm(self, kind: str, gv: GroupView | None, ranks: list[int], ev: dict[str, Any],
                first_seen: float, now: float, view: ClusterView,
                replica_id: Any = ...) -> Finding | None:
        """The finding opened, or None when one was open (its evidence refreshed); ``gv`` None:
        a job-wide one (no group, no culprit)."""
        g = gv.replica_group if gv is not None else None
        rid = (gv.replica_id if gv is not None else None) if replica_id is ... else replica_id
        culprits = describe_ranks(view, ranks)
        ev = {**ev, "culprit_ranks": list(ranks),
              "culprit_hosts": [c["host"] for c in culprits], "culprits": culprits}
        key = (kind, g, rid)
        f = self.open.get(key)
        if f is not None:
            # kept: the stacks read at confirmation, a job-wide finding's probe round
            read = {c["url"]: c["stacks_text"] for c in f.evidence.get("culprits") or ()
                    if "stacks_text" in c}
            for c in culprits:
                if c["url"] in read:
                    c["stacks_text"] = read[c["url"]]
            if kind in JOB_KINDS and "probe" in f.evidence:
                ev["probe"] = f.evidence["probe"]
            f.evidence, f.ranks = ev, list(ranks)
            return None
        f = self.open[key] = Finding(kind, g, rid, ranks, ev, first_seen, now)
        if gv is None:
            log.warning("confirmed %s: %s", kind, ev.get("summary", ""))
        else:
            log.warning("confirmed %s in replica group %d: rank(s) %s on %s", kind, g, ranks,
                        ", ".join(sorted({str(c["host"]) for c in culprits})))
        return f

    def report(self, f: Finding) -> bool:
        if f.key in self.open:
            return False
        self.open[f.key] = f
        return True

    def resolve(self, key: tuple, how: str, now: float) -> None:
        f = self.open.pop(key, None)
        if f is not None:
            f.resolved_at, f.resolution = now, how
            self.resolved.append(f)

    def resolve_where(self, how: str, now: float, kinds: tuple[str, ...] | None = None,
                      group: int | None = None, keep: tuple[str, ...] = ()) -> None:
        for key in [k for k in self.open if (kinds is None or k[0] in kinds)
                    and (group is None or k[1] == group) and k[0] not in keep]:
            self.resolve(key, how, now)

    def resolve_gone(self, view: ClusterView, full: ClusterView, now: float,
                     dead_sweeps: int = 1, blind: bool = False) -> None:
        """Resolve the group findings whose group left the view (``gone``; ``dead`` and
        ``stuck_starting``: the full view) or had no rank
        reachable for ``dead_sweeps`` sweeps (``left_job``, but ``dead`` and ``stuck_starting``;
        none while ``blind``: the monitor may be the one cut off)."""
        for key in list(self.open):
            kind, g, _rid = key
            if kind in JOB_KINDS:
                continue
            # a dead rank never verified: its group may have no verified rank left
            gv = (full if kind in ("dead", "stuck_starting") else view).groups.get(g)
            if gv is None:
                self.resolve(key, "gone", now)
            elif not blind and kind not in ("dead", "stuck_starting") and not gv.reachable \
                    and all(r.ended or r.failures >= dead_sweeps for r in gv.ranks):
                # one missed sweep is no leaving: closing then would reopen the same episode
                self.resolve(key, "left_job", now)


def engine_findings(result: Any) -> list[dict[str, Any]]:
    """An analysis result's findings as the detectors read them (the engine's JSON: ``raw``)."""
    out = []
    for f in result.findings:
        d = f.to_dict()
        out.append({"kind": d["kind"], "culprits": sorted(d["culprit_ranks"]),
                    "quorum_id": d["quorum_id"], "replica_group": d["replica_group"],
                    "has_majority": d.get("has_majority", True),
                    "waiting": list(d.get("waiting_ranks") or []), "seq": d["seq"], "raw": d})
    return out
