"""Let the survivors out of a collective whose peer group is gone: ``POST /v1/abort``.

Gone: in the newest quorum, unheard by the Lighthouse and reported by no reachable rank. Every
verified rank blocked with it in the cross-group collective is told to abort it, once (a request
that failed, up to ABORT_TRIES times); nothing while the monitor is blind (docs/monitor.md,
Cutting the survivors' wait).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..detect import collective_wait
from ..evidence.lighthouse_status import LighthouseStatus
from ..evidence.view import ClusterView, RankView
from .actions import RankCalls, rank_name

log = logging.getLogger(__name__)

ABORT_TRIES = 3  # a survivor whose abort request failed (busy, unreachable) is asked again
# quorums whose members are kept: a survivor may still be blocked in an older quorum's
# collective once the others formed a newer one without it (a spare replaced the gone group)
KEEP_QUORUMS = 8


@dataclass(frozen=True)
class Gone:
    """A group of the newest quorum that neither the Lighthouse nor the monitor hears."""

    replica_group: int | None
    replica_id: str
    quorum_id: int
    why: str


Elsewhere = Callable[[], tuple[set[str], bool]]


def gone_groups(view: ClusterView, status: LighthouseStatus,
                evicted: set[str] | frozenset[str] = frozenset(),
                elsewhere: Elsewhere | None = None) -> list[Gone]:
    """Participants of the Lighthouse's newest quorum it no longer hears that no reachable rank
    reports, or that the monitor sent a kill for (``evicted``). ``elsewhere`` (a shard): the
    replica ids the other shards' ranks report, and whether every shard said; without every
    shard's word, only a group this view held (or evicted) is gone."""
    if status.quorum_id is None:
        return []
    unheard = [rid for rid in sorted(status.members) if not status.heartbeating(rid)]
    if not unheard:
        return []
    reported = {rid for gv in view.groups.values() for rid in gv.reported_replica_ids if rid}
    complete = True
    if elsewhere is not None:
        more, complete = elsewhere()
        reported |= more
    gone = [rid for rid in unheard if rid not in reported or rid in evicted]
    if not gone:
        return []
    # the group by the id its ranks report, or any of them last reported: a replacement of the
    # gone incarnation may report a new one by now, its old processes superseded
    by_rid: dict[str | None, int] = {}
    for g, gv in view.groups.items():
        for rid in (gv.replica_id, *gv.reported_replica_ids,
                    *(r.replica_id for r in (*gv.ranks, *gv.superseded))):
            if rid:
                by_rid.setdefault(rid, g)
    if not complete:
        gone = [rid for rid in gone if rid in by_rid or rid in evicted]
    out = []
    for rid in gone:
        seen = status.heartbeats.get(rid)
        out.append(Gone(by_rid.get(rid), rid, status.quorum_id,
                        "the Lighthouse no longer hears it"
                        + (f" (last heartbeat {seen:.1f}s ago)" if seen is not None else "")
                        + (" and the monitor evicted it" if rid in evicted
                           else " and no rank the monitor reaches reports it")))
    return out


def blocked_survivors(evidence: ClusterView, gone: Gone) -> list[RankView]:
    """Verified ranks of the other groups, in ``gone``'s quorum, blocked in the cross-group
    collective now."""
    return [r for gv in evidence.groups.values() if gv.replica_id != gone.replica_id
            for r in gv.reachable
            if r.fresh and (r.state or {}).get("quorum_id") == gone.quorum_id
            and collective_wait(r.state or {})[0] == "cross"]


class Survivors:
    """Each sweep: :meth:`release` the survivors of groups that are gone. ``store``: the audit
    log; ``dry_run``: decide and record, send nothing."""

    def __init__(self, aborts: RankCalls, store: Any, metrics: Any, job: str,
                 dry_run: bool = False) -> None:
        self.aborts, self.store, self.metrics, self.job = aborts, store, metrics, job
        self.dry_run = dry_run
        self._told: set[tuple[str, int, str]] = set()  # (gone replica id, quorum id, url)
        self._failed: dict[tuple[str, int, str], int] = {}  # the failed requests of one not told
        # (gone replica id, quorum id) -> the survivors last named as not called (why_not), so
        # a skip is written once per gone group while it stays the same
        self._skipped: dict[tuple[str, int], frozenset[str]] = {}
        self._held: frozenset[str] = frozenset()  # gone replica ids said held while blind
        self._quorums: dict[int, frozenset[str]] = {}  # quorum id -> its members' replica ids

    def _gone(self, view: ClusterView, status: LighthouseStatus, evicted: set[str],
              elsewhere: Elsewhere | None) -> list[Gone]:
        """:func:`gone_groups` of the newest quorum and of the older ones seen: a group gone
        from quorum 5 still holds whoever is blocked in quorum 5's collective."""
        q = status.quorum_id
        if q is not None:
            if self._quorums and q not in self._quorums and q < max(self._quorums):
                self._quorums.clear()  # a restarted Lighthouse numbers its quorums from 1 again
            self._quorums[q] = frozenset(status.members)
            while len(self._quorums) > KEEP_QUORUMS:
                del self._quorums[min(self._quorums)]
        if elsewhere is not None:  # the other shards asked once a sweep (an etcd read)
            asked, said = elsewhere, []

            def elsewhere() -> tuple[set[str], bool]:
                if not said:
                    said.append(asked())
                return said[0]
        out = gone_groups(view, status, evicted, elsewhere)
        for q, members in sorted(self._quorums.items()):
            if q != status.quorum_id:
                older = replace(status, quorum_id=q, members=dict.fromkeys(members))
                out += gone_groups(view, older, evicted, elsewhere)
        return out

    def release(self, view: ClusterView, evidence: ClusterView,
                status: LighthouseStatus | None, blind: str | None, evicted: set[str],
                now: float, elsewhere: Elsewhere | None = None) -> list[dict]:
        """The abort decisions made this sweep (as recorded); ``elsewhere``: as
        :func:`gone_groups`."""
        if status is None or not self.aborts.token:
            return []
        if blind:
            self._say_held(view, evidence, status, blind, evicted, elsewhere)
            return []
        self._held = frozenset()
        made = []
        for gone in self._gone(view, status, evicted, elsewhere):
            ranks, skipped = [], []
            for r in blocked_survivors(evidence, gone):
                if (gone.replica_id, gone.quorum_id, r.url) in self._told:
                    continue
                # not called (Claims, torch's server): no try counted, checked again next sweep
                why = self.aborts.why_not(view, r)
                if why is None:
                    ranks.append(r)
                else:
                    skipped.append((r, why))
            urls = frozenset(r.url for r, _ in skipped)
            key = (gone.replica_id, gone.quorum_id)
            if not ranks and (not skipped or self._skipped.get(key) == urls):
                continue
            self._skipped[key] = urls
            made.append(self._abort(gone, ranks, now, view, skipped))
        live = set(status.members).union(*self._quorums.values())
        self._told = {k for k in self._told if k[0] in live}
        self._failed = {k: n for k, n in self._failed.items() if k[0] in live}
        self._skipped = {k: u for k, u in self._skipped.items() if k[0] in live}
        return made

    def _say_held(self, view: ClusterView, evidence: ClusterView, status: LighthouseStatus,
                  blind: str, evicted: set[str], elsewhere: Elsewhere | None) -> None:
        """One line when a gone group's survivors not told yet wait for the monitor to see."""
        held = frozenset(g.replica_id for g in self._gone(view, status, evicted, elsewhere)
                         if any((g.replica_id, g.quorum_id, r.url) not in self._told
                                for r in blocked_survivors(evidence, g)))
        if held - self._held:
            log.warning("not telling the survivors blocked with gone replica(s) %s to abort "
                        "while the monitor is blind: %s", ", ".join(sorted(held)), blind)
        self._held = held

    def _abort(self, gone: Gone, ranks: list[RankView], now: float, view: ClusterView,
               skipped: list[tuple[RankView, str]]) -> dict:
        """One decision: ``ranks`` told (or, in a dry run, not), ``skipped`` named with why no
        call was signed for them (status ``skipped`` when no rank is left to tell)."""
        reason = (f"replica group {gone.replica_group} ({gone.replica_id}) is gone from quorum "
                  f"{gone.quorum_id}: {gone.why}")
        did = self.store.add_decision(
            replica_group=gone.replica_group, replica_id=gone.replica_id, decision="abort",
            reason="peer_gone", detail=reason,
            status="dry_run" if self.dry_run else "sending" if ranks else "skipped", at=now)
        outcomes, sent, moved = [], 0, 0
        for r in ranks:
            key = (gone.replica_id, gone.quorum_id, r.url)
            if self.dry_run:
                self._told.add(key)
                outcomes.append(f"{rank_name(r)}: would abort (dry run)")
                continue
            # the quorum: a rank that moved on to the next one (its group rebuilt, or being
            # built) answers 409 and keeps its healthy step
            res = self.aborts.abort(r, reason, did, gone.quorum_id, view)
            failed = 0 if res.sent else self._failed.get(key, 0) + (not res.skipped)
            if res.sent or failed >= ABORT_TRIES or res.http_status == 409:
                self._told.add(key)
                self._failed.pop(key, None)
            else:
                self._failed[key] = failed
            sent += res.sent
            moved += res.http_status == 409
            outcomes.append(f"{rank_name(r)}: {res.detail}" + (
                f" (asked again next sweep, try {failed} of {ABORT_TRIES})"
                if key not in self._told else ""))
        detail = reason
        if outcomes:
            detail += "; survivors blocked in the cross-group collective told to abort it " \
                      "(POST /v1/abort): " + "; ".join(outcomes)
        if skipped:
            detail += "; not told (no call signed; checked again each sweep): " + "; ".join(
                f"{rank_name(r)}: {why}" for r, why in skipped)
        # 409: in another quorum by now (or no Manager): nothing left to abort there
        status = {} if self.dry_run or not ranks else {
            "status": "sent" if sent else "moved_on" if moved == len(ranks) else "failed"}
        self.store.update_decision(did, detail=detail, **status)
        self.metrics.decisions.labels(self.job, "abort", "peer_gone").inc()
        log.warning("%s", detail)
        return {"id": did, "replica_group": gone.replica_group, "replica_id": gone.replica_id,
                "ranks": [r.rank for r in ranks], "skipped": [r.rank for r, _ in skipped],
                "detail": detail}

    def close(self) -> None:
        self.aborts.close()
