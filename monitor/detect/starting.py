"""``stuck_starting``: ranks that never reach a quorum (their group never came up), on clocks of
their own, apart from monitor.detect.liveness's ranks that went down after they had."""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import Any

from monitor.config import DetectorConfig
from monitor.evidence.lighthouse_status import LighthouseStatus
from monitor.evidence.view import ClusterView, RankView

from .findings import Finding, Findings
from .hang import left_hung
from .left_out import LeftOut

# past start_quorum, before the first collective: a synchronous quorum call returns with the
# quorum's id, so a rank here without one asked asynchronously (its allreduce waits for it)
FIRST_STEP_PHASES = ("forward", "backward")


def _no_quorum_why(r: RankView) -> str:
    if "torch_only" in r.state:  # quorum id -1: out of the Lighthouse's newest quorum
        return ("not in the Lighthouse's newest quorum (torch's debug server: its ranks tell "
                "no quorum of their own)")
    if not r.replica_id:
        return "no torchft Manager yet (waiting for the group's store or rank 0)"
    if r.state.get("phase") in FIRST_STEP_PHASES:
        return ("asked for its quorum asynchronously and has not reached its first collective "
                "(its first step hangs, or compiles past --starting-timeout)")
    return ("the Manager exists but no quorum was formed (Lighthouse unreachable, or the "
            "group's other ranks never asked)")


class StuckStarting:
    """Mixed into :class:`monitor.detect.liveness.Liveness`."""

    def __init__(self, cfg: DetectorConfig, findings: Findings) -> None:
        self.cfg, self.findings = cfg, findings
        self._starting: dict[tuple, float] = {}  # (url, pid, started_at) -> first seen so
        self._left_out = LeftOut(cfg)  # stuck_starting's other shape: out of the job's quorums
        self._away: dict[tuple, int] = {}  # stuck_starting key -> sweeps its group was away
        self._no_quorum: dict[int, list[float]] = {}  # group -> [since when it answers without a
        # quorum, when a rank of it last answered]: a crash loop keeps its clock
        self._lh_read = False  # a Lighthouse status was read once (None since: a failed read)

    def _note_no_quorum(self, full: ClusterView, without: set[int], now: float) -> None:
        """Each group's memory of having no quorum: from when a rank of it (``without``) first
        answered without one, until one answers with one, or none has answered for
        --starting-timeout (it left)."""
        noq = self._no_quorum
        for g in without:
            noq.setdefault(g, [now, now])
        for g, m in list(noq.items()):
            up = full.groups[g].reachable if g in full.groups else ()
            if any(r.state and r.state.get("quorum_id", -1) >= 0 for r in up) \
                    or not up and now - m[1] >= self.cfg.starting_timeout_s:
                del noq[g]
            elif up:
                m[1] = now

    def stuck_starting(self, full: ClusterView, now: float, starting_urls: list[str] | None,
                       groups: Mapping[int, Any], view: ClusterView | None = None,
                       lighthouse: LighthouseStatus | None = None,
                       evicted: Container[str] = ()) -> list[Finding]:
        """``starting_urls``: the ranks without a quorum (None: read here); ``groups``: each
        verified group's memory; ``view``: the evidence, whose groups the job's quorums go on
        without are named too (monitor.detect.left_out; None: not judged)."""
        findings, starting, without = self.findings, {}, set()
        # one evicted is over, and so are its group's clocks: its restart, or a rank the kill did
        # not reach, is judged afresh, not named (and evicted again) at first sight
        for key in [k for k, f in findings.open.items() if k[0] == "stuck_starting"
                    and k[2] in evicted and f.evidence.get("shape") == "no_first_quorum"]:
            findings.resolve(key, "evicted", now)
            self._no_quorum.pop(key[1], None)
            for ident in [i for i in self._starting if getattr(
                    full.ranks.get(i[0]), "replica_group", None) == key[1]]:
                del self._starting[ident]
        # a hang names the group (its first step hung: with an asynchronous quorum its ranks
        # have no quorum id yet): that is its name, not a second finding beside it; but one the
        # others went on without is left out as well (--evict-on stuck_starting evicts it)
        hung = {k[1] for k, f in findings.open.items() if k[0] == "hang"
                and (view is None or not left_hung(view, f, now))}
        for key in [k for k in findings.open if k[0] == "stuck_starting" and k[1] in hung]:
            findings.resolve(key, "superseded", now)
        polled = full.polled_ranks if starting_urls is None else \
            [full.ranks[u] for u in starting_urls]
        for r in polled:  # a carried rank keeps what its last poll said
            s = r.state
            if not r.reachable or not s:
                continue
            if s["quorum_id"] >= 0 or r.replica_group is None or r.replica_id in evicted:
                continue  # most have a quorum; one told to go is going
            starting[r.url] = (r.url, s.get("pid"), s.get("started_at"))
            without.add(r.replica_group)
        self._note_no_quorum(full, without, now)
        noq = self._no_quorum
        # a rank not polled now, or that missed fewer than --dead-sweeps polls (a busy
        # process), or whose group is away with its finding open: its clock kept
        ds, new = self.cfg.dead_sweeps, []
        held = {k[1] for k in findings.open if k[0] == "stuck_starting"
                and k[1] in full.groups and not full.groups[k[1]].reachable}
        for ident in self._starting:
            r = full.ranks.get(ident[0])
            if r is not None and r.replica_group is not None and r.replica_id not in evicted and (
                    r.reachable and not r.fresh or not r.reachable and not r.superseded
                    and (r.failures < ds or r.replica_group in held)):
                starting.setdefault(r.url, ident)
        seen = set(starting.values())
        stuck: dict[int, list[RankView]] = {}
        for ident in seen:  # on its own clock, or its group's without a quorum if older
            r = full.ranks[ident[0]]
            if now - min(self._starting.setdefault(ident, now),
                         noq.get(r.replica_group, (now,))[0]) >= self.cfg.starting_timeout_s:
                stuck.setdefault(r.replica_group, []).append(r)
        for ident in [i for i in self._starting if i not in seen]:
            del self._starting[ident]
        left, still = self._left_out.judge(view, now, set(stuck) | hung, lighthouse) \
            if view is not None else ({}, set())
        # named until its group answers with a quorum; left_job only after --dead-sweeps sweeps
        # in which the monitor reached some group and the Lighthouse did not hear this one
        seen_any = any(v.reachable for v in full.groups.values())
        self._lh_read |= lighthouse is not None
        gone, self._away = self._away, {}
        for key, f in [(k, f) for k, f in findings.open.items() if k[0] == "stuck_starting"
                       and k[1] in full.groups]:
            g, left_out = key[1], f.evidence.get("shape") == "left_out"
            gv, fg = view.groups.get(g) if view is not None else None, full.groups[g]
            n, away = 0, seen_any and not fg.reachable
            if away and lighthouse is None and self._lh_read:
                if key in gone:
                    self._away[key] = gone[key]
            elif away and (lighthouse is None or not lighthouse.heartbeating(
                    key[2] or fg.replica_id or "")):
                n = self._away[key] = gone.get(key, 0) + 1
            if gv is not None and gv.replica_id not in (None, key[2]) and (left_out or key[2]):
                findings.resolve(key, "replaced", now)
                if not left_out and g in noq:  # the one replacing it goes on from its clock
                    noq[g][0] = min(noq[g][0], f.first_seen)
            elif n >= ds and (left_out or g not in noq) or n and all(r.ended for r in fg.ranks):
                findings.resolve(key, "left_job", now)
            elif g not in stuck and not (left_out and g in still) and any(
                    r.state and r.state.get("quorum_id", -1) >= 0 for r in fg.reachable):
                findings.resolve(key, "started", now)
        for lo in left.values():
            new.append(findings.confirm(
                "stuck_starting", lo.gv, sorted(r.rank for r in lo.gv.ranks if r.rank is not None),
                lo.evidence, lo.first_seen, now, view))
        for g, ranks in stuck.items():
            gv = full.groups.get(g)
            if gv is None or g in hung:
                continue
            mem = groups.get(g)
            rid = mem.replica_id if mem is not None else None
            # a survivor of an evicted incarnation (no replica id of its own) is not that one
            if rid in evicted or rid is not None and any(
                    r.replica_id not in (None, rid) for r in ranks):
                rid = None
            was = findings.open.get(("stuck_starting", g, rid))
            kept = [was.first_seen] if was else []
            if was is None:
                # one carried unanswered (crashed?) keeps its clock: its stale poll opens nothing
                ranks = [r for r in ranks if r.reachable]
                if not ranks:
                    continue
                # one named under another replica id (a restart, or its ranks now verified):
                # this one replaces it on its clock, so the group stays named throughout
                for key in [k for k, f in findings.open.items() if k[:2] == ("stuck_starting", g)
                            and f.evidence.get("shape") == "no_first_quorum"]:
                    kept.append(findings.open[key].first_seen)
                    findings.resolve(key, "replaced", now)
            # an open one keeps its clock through a restart, and so does the group's memory
            first = min([self._starting[(r.url, r.state.get("pid"), r.state.get("started_at"))]
                         for r in ranks] + kept + [noq.get(g, (now,))[0]])
            numbers = sorted(r.rank for r in ranks if r.rank is not None)
            ev = {"summary": f"rank(s) {numbers} without a quorum for {now - first:.0f}s (timeout "
                             f"{self.cfg.starting_timeout_s:g}s)",
                  "shape": "no_first_quorum", "starting_timeout_s": self.cfg.starting_timeout_s,
                  "for_s": round(now - first, 1),
                  "ranks": {str(r.rank): {
                      "phase": r.state.get("phase"), "replica_id": r.replica_id,
                      "verified": r.trust is None or r.trust.evidence,
                      "why": _no_quorum_why(r)} for r in ranks}}
            new.append(findings.confirm("stuck_starting", gv, numbers, ev, first, now, full,
                                        replica_id=rid))
        return [f for f in new if f]
