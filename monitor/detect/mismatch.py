"""``mismatch``: members of one group that enqueued different collectives at one sequence id.
The culprit is the minority; without a majority the rank that breaks its own per-step pattern,
else its own history of that collective. Nothing singled out: no finding. Resolved
``no_longer_seen`` at a look that read its group's dumps and no longer finds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from monitor.analysis import RankTrace
from monitor.analysis.steps import departs_from_step_pattern
from monitor.evidence.view import ClusterView

from .findings import Finding, Findings
from .rank_state import collective_wait, rank_groups


def judge(view: ClusterView, dumps: Mapping[int, dict], traces: Mapping[int, RankTrace],
          analysis: list[dict] | None, now: float, findings: Findings) -> list[Finding]:
    if analysis is None:  # no look this sweep, or its analysis failed: nothing said
        return []
    rank_group = rank_groups(view, dumps)
    new = []
    seen: set[int] = set()  # the groups of every rank in a mismatch of this look
    for m in analysis:
        if m["kind"] != "mismatch":
            continue
        seen.update(g for r in _participants(m["raw"]) | set(m["culprits"])
                    if (g := rank_group(r)) is not None)
        culprits, how = list(m["culprits"]), "majority"
        if not m["has_majority"]:
            culprits, how = departs_from_step_pattern(traces, m["raw"]), "step_pattern"
            if not culprits:
                culprits = [int(r) for r in m["raw"].get("departs_from_history") or []]
                how = "own_history"
            participants = [r for v in m["raw"].get("variants") or [] for r in v["ranks"]]
            if len(culprits) >= len(participants):
                culprits = []  # everyone "departs": that singles nobody out
        if not culprits:
            continue
        by_group: dict[int, list[int]] = {}
        for r in culprits:
            g = rank_group(r)
            if g is not None:
                by_group.setdefault(g, []).append(r)
        if len(by_group) * 2 > len({rank_group(r) for r in dumps}) and how != "majority":
            continue  # most groups "differ": the evidence does not single one out
        # first seen when its participants began waiting in it (their own clocks), if they do
        waited = max((max(0.0, collective_wait(rv.state)[1])
                      for v in m["raw"].get("variants") or []
                      for r in v.get("ranks") or [] if (rv := view.rank_view(r)) is not None),
                     default=0.0)
        for g, ranks in by_group.items():
            gv = view.groups.get(g)
            if gv is None:
                continue
            ev = {"summary": f"rank(s) {ranks} enqueued a different collective than their "
                             f"peers at seq {m['seq']} of {m['raw'].get('pg')!r} (attributed by "
                             f"{how.replace('_', ' ')})",
                  "quorum_id": m["quorum_id"], "seq": m["seq"], "pg": m["raw"].get("pg"),
                  "level": "in_group" if m["replica_group"] is not None else "cross_group",
                  "attributed_by": how, "analysis": m["raw"],
                  "witnesses": _incarnations(view, _participants(m["raw"]))}
            new.append(findings.confirm("mismatch", gv, ranks, ev, now - waited, now, view))
    _no_longer_seen(view, dumps, traces, seen, now, findings)
    return [f for f in new if f]


def _participants(raw: Mapping[str, Any]) -> set[int]:
    return {int(r) for v in raw.get("variants") or [] for r in v.get("ranks") or []}


def _incarnations(view: ClusterView, ranks: set[int]) -> dict[str, list]:
    """rank -> [pid, started_at] of the process that took part: a peer that crashed on it comes
    back with an empty recorder, no witness until it has trained beside the culprit."""
    return {str(r): [rv.state.get("pid"), rv.state.get("started_at")] for r in sorted(ranks)
            if (rv := view.rank_view(r)) is not None and rv.state}


def _no_longer_seen(view: ClusterView, dumps: Mapping[int, dict],
                    traces: Mapping[int, RankTrace], seen: set[int], now: float,
                    findings: Findings) -> None:
    """Resolve the open mismatches this look could have seen and did not: it read whole dumps
    of the group's reachable ranks and culprits and one of another participant still answering,
    the same process that took part (both sides), no mismatch names the group, and the group
    committed a step since it was last seen (peers that crashed on it and came back empty would
    show nothing: a restarted one counts once it has committed a step beside the culprit)."""
    def read(r: int, whole: bool) -> bool:
        d = dumps.get(r)
        f = d.get("filter") if isinstance(d, dict) else None
        return r in traces and (not whole or not isinstance(f, dict) or f.get("pg") is None)

    for key, f in list(findings.open.items()):
        if key[0] != "mismatch" or key[1] in seen or (gv := view.groups.get(key[1])) is None:
            continue
        last = [c["step"] for c in f.evidence.get("culprits") or () if type(c.get("step")) is int]
        if last and (gv.step is None or gv.step <= max(last)):
            continue
        own = {r.rank for r in gv.reachable if r.rank is not None} | set(f.ranks)
        if not all(read(r, True) for r in own):
            continue
        # a leader's dump holds torchft's process group only: enough for a cross-group one
        whole = f.evidence.get("level") != "cross_group"
        named = _participants(f.evidence.get("analysis") or {}) - own
        took_part = f.evidence.get("witnesses") or {}
        # a witness: the process that took part, or one that has committed steps since (it
        # trained beside the culprit); a peer the fault restarts and crashes again commits none
        others = {r for r in named if (rv := view.rank_view(r)) is not None and rv.reachable
                  and (took_part.get(str(r)) == [rv.state.get("pid"), rv.state.get("started_at")]
                       or (rv.state.get("commits") or 0) > 0)}
        if named and not any(read(r, whole) for r in others):
            continue
        findings.resolve(key, "no_longer_seen", now)

