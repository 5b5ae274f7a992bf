"""Live Flight Recorder evidence across replica groups, incarnation-aware.

torchft rebuilds its cross-group process group at every quorum change, so a live dump holds
several *incarnations* whose ``collective_seq_id`` each restart at 1 (docs/CONTRACTS.md). This
module aligns entries only within one incarnation: the torchft group's entries of a rank's
*current* (last) incarnation are keyed by ``(quorum_id, group_rank)`` and matched across ranks by
``collective_seq_id``. On that alignment it measures what the monitor's detectors need:

- :func:`arrival_lags`: per collective, how long after the first rank each rank enqueued it
  (the others wait for the last one: a straggler's evidence);
- :func:`pending`: the newest collective of the current incarnation and the members that never
  enqueued it (a hang's evidence);
- :func:`analyze`: a small stand-in for the analysis engine (``monitor.analysis``), with the same
  ``analyze(dumps) -> result.findings`` shape, used when that engine is not installed. It reports
  ``mismatch`` (input sizes, dtypes or op differ at the same sequence id; the culprit is the
  minority, or on a tie the rank that departs from its own history of that collective) and
  ``hang`` (from :func:`pending`).

A dump that lacks ``incarnations`` or entries simply contributes nothing; nothing here raises on
a malformed dump (bad entries are skipped).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


def _is_torchft_name(name: Any) -> bool:
    return name == "" or (isinstance(name, str) and name.startswith("torchft_quorum_"))


def _pg_name(entry: dict[str, Any]) -> Any:
    pg = entry.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return pg[0]
    return pg


def current_incarnation(dump: Mapping[str, Any]) -> dict[str, Any] | None:
    incs = dump.get("incarnations")
    if not isinstance(incs, list) or not incs or not isinstance(incs[-1], dict):
        return None
    return incs[-1]


def incarnation_entries(dump: Mapping[str, Any], index: int = -1) -> list[dict[str, Any]]:
    """The torchft group's collective entries of incarnation ``index`` (default: current)."""
    incs = dump.get("incarnations")
    entries = dump.get("entries")
    if not isinstance(incs, list) or not incs or not isinstance(entries, list):
        return []
    if index < 0:
        index += len(incs)
    if not 0 <= index < len(incs):
        return []
    inc = incs[index]
    nxt = incs[index + 1] if index + 1 < len(incs) else None
    out = []
    for e in entries:
        if not isinstance(e, dict) or e.get("is_p2p"):
            continue
        if not _is_torchft_name(_pg_name(e)):
            continue
        try:
            rid = int(e.get("record_id", -1))
            seq = int(e.get("collective_seq_id", 0))
        except (TypeError, ValueError):
            continue
        if seq <= 0:
            continue
        if inc.get("pg_id") is not None and e.get("pg_id") is not None:
            if e.get("pg_id") != inc["pg_id"]:
                continue
        else:
            first = int(inc.get("first_record_id") or 0)
            end = int(nxt["first_record_id"]) if nxt and nxt.get("first_record_id") is not None \
                else None
            if rid < first or (end is not None and rid >= end):
                continue
        out.append(e)
    return out


@dataclass
class Aligned:
    """One incarnation of one torchft group across the ranks that report it as current."""

    quorum_id: Any
    group_rank: Any
    members: list[int]  # expected global ranks (ordered by replica rank)
    by_rank: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)  # rank->seq->e

    def common_seqs(self) -> list[int]:
        if not self.by_rank:
            return []
        sets = [set(s) for s in self.by_rank.values()]
        return sorted(set.intersection(*sets))

    def newest_seq(self) -> int | None:
        seqs = [max(s) for s in self.by_rank.values() if s]
        return max(seqs) if seqs else None


def align(dumps: Mapping[int, Mapping[str, Any]], current_only: bool = True) -> list[Aligned]:
    """Group ranks by incarnation ``(quorum_id, group_rank)``, newest quorum first: each rank's
    current incarnation only (default), or every incarnation its dump still holds."""
    groups: dict[tuple, Aligned] = {}
    for rank, dump in dumps.items():
        incs = dump.get("incarnations") if isinstance(dump, Mapping) else None
        if not isinstance(incs, list) or not incs:
            continue
        indices = [len(incs) - 1] if current_only else range(len(incs))
        for i in indices:
            inc = incs[i]
            if not isinstance(inc, dict):
                continue
            key = (inc.get("quorum_id"), inc.get("group_rank"))
            a = groups.get(key)
            members = inc.get("global_ranks")
            if a is None:
                a = groups[key] = Aligned(key[0], key[1], list(members)
                                          if isinstance(members, list) else [])
            elif isinstance(members, list) and len(members) > len(a.members):
                a.members = list(members)
            seqs: dict[int, dict[str, Any]] = {}
            for e in incarnation_entries(dump, i):
                seqs[int(e["collective_seq_id"])] = e
            if seqs or current_only:
                a.by_rank[int(rank)] = seqs
    return sorted(groups.values(), key=lambda a: (a.quorum_id is None, -(a.quorum_id or 0)))


def arrival_lags(dumps: Mapping[int, Mapping[str, Any]], last: int = 4
                 ) -> list[dict[str, Any]]:
    """For the newest ``last`` collectives every member enqueued: each rank's lag (s) behind the
    first one to enqueue it. One item per collective: ``{"quorum_id", "group_rank", "seq",
    "lags": {rank: seconds}}``. Needs ``time_created_ns`` (host clocks in sync to well under the
    lags that matter)."""
    out = []
    for a in align(dumps):
        if len(a.by_rank) < 2:
            continue
        for seq in a.common_seqs()[-last:]:
            times = {}
            for r, seqs in a.by_rank.items():
                t = seqs[seq].get("time_created_ns")
                if isinstance(t, (int, float)) and t > 0:
                    times[r] = t
            if len(times) < 2:
                continue
            first = min(times.values())
            out.append({"quorum_id": a.quorum_id, "group_rank": a.group_rank, "seq": seq,
                        "lags": {r: (t - first) / 1e9 for r, t in times.items()}})
    return out


def pending(dumps: Mapping[int, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The newest collective of each current incarnation that some members never enqueued.

    ``{"quorum_id", "group_rank", "seq", "op", "arrived": [ranks], "missing": [ranks]}``;
    members without a dump (unreachable) count as missing. Only the newest quorum is judged.
    """
    out = []
    aligned = align(dumps)
    if not aligned:
        return out
    newest_q = aligned[0].quorum_id
    for a in aligned:
        if a.quorum_id != newest_q:
            continue
        seq = a.newest_seq()
        if seq is None:
            continue
        members = a.members or sorted(a.by_rank)
        arrived = sorted(r for r, s in a.by_rank.items() if seq in s)
        missing = sorted(r for r in members if r not in arrived)
        if missing:
            e = a.by_rank[arrived[0]][seq]
            out.append({"quorum_id": a.quorum_id, "group_rank": a.group_rank, "seq": seq,
                        "op": e.get("profiling_name"), "arrived": arrived, "missing": missing})
    return out


def _signature(e: Mapping[str, Any]) -> tuple:
    def t(v):
        return tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) \
            else v
    return (e.get("profiling_name"), t(e.get("input_sizes")), t(e.get("input_dtypes")))


def _usual(dump: Mapping[str, Any], op: Any, exclude: dict[str, Any]) -> tuple | None:
    """The most common signature of collective ``op`` in a rank's whole dump, without ``exclude``."""
    counts: Counter = Counter()
    for e in dump.get("entries") or []:
        if isinstance(e, dict) and e is not exclude and e.get("profiling_name") == op \
                and _is_torchft_name(_pg_name(e)):
            counts[_signature(e)] += 1
    return counts.most_common(1)[0][0] if counts else None


def mismatches(dumps: Mapping[int, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Collectives of one incarnation whose signature differs across ranks, with the culprits."""
    out = []
    for a in align(dumps, current_only=False):
        for seq in a.common_seqs():
            sigs = {r: _signature(a.by_rank[r][seq]) for r in a.by_rank}
            if len(set(sigs.values())) < 2:
                continue
            counts = Counter(sigs.values())
            ranked = counts.most_common()
            culprits: list[int] = []
            how = "minority"
            if len(ranked) > 1 and ranked[0][1] > ranked[1][1]:
                majority = ranked[0][0]
                culprits = sorted(r for r, s in sigs.items() if s != majority)
            else:
                how = "own_history"
                for r, s in sigs.items():
                    usual = _usual(dumps[r], s[0], a.by_rank[r][seq])
                    if usual is not None and usual != s:
                        culprits.append(r)
                culprits.sort()
            out.append({"quorum_id": a.quorum_id, "group_rank": a.group_rank, "seq": seq,
                        "op": sigs[next(iter(sigs))][0],
                        "sizes": {r: a.by_rank[r][seq].get("input_sizes") for r in sigs},
                        "culprits": culprits, "how": how})
    return out


@dataclass
class FRFinding:
    kind: str  # "mismatch" or "hang"
    ranks: list[int]  # culprits (mismatch) / ranks that never arrived (hang)
    evidence: dict[str, Any]


@dataclass
class FRResult:
    findings: list[FRFinding]


def analyze(dumps: Mapping[int, Mapping[str, Any]]) -> FRResult:
    """Stand-in for ``monitor.analysis.analyze`` over live dumps (see the module docstring)."""
    findings = []
    for m in mismatches(dumps):
        if m["culprits"]:
            findings.append(FRFinding("mismatch", m["culprits"], m))
    for p in pending(dumps):
        findings.append(FRFinding("hang", p["missing"], p))
    return FRResult(findings)
