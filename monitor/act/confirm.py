"""Whether a sent kill landed (confirmed, unconfirmed, failed), its orphans told to exit: kept
apart from deciding, it judges past kills by what the ranks and the Lighthouse say now."""

from __future__ import annotations

import logging
from typing import Any

from ..evidence.lighthouse_status import LighthouseStatus
from ..evidence.view import ClusterView
from .actions import NOT_IN_QUORUM, rank_name

log = logging.getLogger("monitor.act.enforcer")  # the Enforcer's log, as its other lines


def reporting(view: ClusterView, replica_id: str | None) -> list:
    """The reachable ranks reporting ``replica_id``, in the targets' order (rank hint, URL)."""
    found = [r for gv in view.groups.values() if replica_id in gv.reported_replica_ids
             for r in gv.reachable if r.replica_id == replica_id]
    return sorted(found, key=lambda r: (r.target.rank if r.target is not None
                                        and r.target.rank is not None else 1 << 62, r.url))


class Confirmations:
    """The Enforcer's confirmation of its kills (a mixin: its store, orphans and config)."""

    def confirm_evictions(self, view: ClusterView, evidence: ClusterView, now: float,
                          lighthouse: LighthouseStatus | None = None) -> None:
        """Confirmed once no reachable rank reports the replica id nor ``lighthouse`` (if given)
        hears it, in a sweep not blind; unconfirmed after ``confirm_timeout_s``; ranks the kill
        missed told to exit (or named). A standby judges none until it holds its slice."""
        pending = self.store.pending_confirmations()
        self.orphans.keep({d["id"] for d in pending})
        # a pending eviction's group as verified before its kill: only those ranks get the exit
        # token, never a stranger that registered claiming the evicted replica id
        groups = {gv.replica_id: gv for gv in evidence.groups.values()}
        groups.update((d["replica_id"], self._vouched[d["replica_id"]]) for d in pending
                      if d["replica_id"] in self._vouched)
        self._vouched = groups  # kept by a standby too: the ranks it may tell once it holds
        if self.standby:  # the monitor holding the slice confirms them and tells their orphans
            return
        blind = self.blind_to_kills(view, lighthouse) if pending else None
        for d in pending:
            rid = d["replica_id"]
            still = reporting(view, rid)
            landed = None
            if d["status"] == "interrupted":  # a previous run stopped while sending it
                if blind:
                    continue  # judged once the ranks can be seen: unseen is not gone
                landed = _landed(rid, still, lighthouse) if still else None
                if landed:  # the ranks still reporting are orphans, followed as a sent kill's
                    d["detail"] = f"{d['detail']}; the monitor stopped while sending: {landed}"
                    self.store.update_decision(d["id"], status="sent", detail=d["detail"])
                elif still:  # a killed Manager exits within a second
                    self.store.update_decision(d["id"], status="failed", detail=(
                        f"{d['detail']}; the monitor stopped while sending and the replica "
                        "still answers: the kill never landed"))
                    continue
            # a dry run (perhaps restarted to stop acting) tells no rank to exit
            urls = {r.url for r in groups[rid].ranks} \
                if rid in groups and not self.cfg.rails.dry_run else ()
            # as the audit row says (a restarted monitor, a shard's copy of the leader's kill)
            unreached = f"kill: {NOT_IN_QUORUM}" in (d["detail"] or "")
            note = self.orphans.follow(d["id"], rid, [r for r in still if r.url in urls],
                                       now - d["at"], view, unreached)
            if note:
                d["detail"] = f"{d['detail']}; {note}"
                self.store.update_decision(d["id"], detail=d["detail"])
            # ranks the monitor cannot reach are not gone while the Lighthouse hears the replica
            # (a killed Manager's heartbeat turns old after the Lighthouse's timeout)
            heard = lighthouse is not None and lighthouse.heartbeating(rid)
            if still or heard:
                if now - d["at"] > self.cfg.confirm_timeout_s and not landed:
                    # not one judged landed this sweep: its orphans were told only now
                    self._not_gone(d, still)
                continue
            if blind:
                continue  # unseen by a monitor that may be the one cut off is not gone
            lh = "" if lighthouse is None else "; the Lighthouse no longer hears it"
            if unreached:  # out of the quorum before the kill
                gone = "no rank reports it any more"
            elif lighthouse is not None and lighthouse.quorum_id is not None \
                    and rid not in lighthouse.members:  # the quorum that dropped it
                gone = (f"left the quorum (the Lighthouse's quorum {lighthouse.quorum_id}: "
                        f"{len(lighthouse.members)} participants without it)")
            else:  # the ranks' word: they may not be in the quorum that dropped it yet
                gone = (f"left the quorum (the survivors last said quorum_id {view.quorum_id}, "
                        f"{view.quorum_participants()} participants)")
            self.store.update_decision(d["id"], status="confirmed", confirmed_at=now,
                                       detail=f"{d['detail']}; {gone}{lh}"
                                       + _dark(rid, groups.get(rid)))
            log.info("eviction of %s confirmed after %.1fs", rid, now - d["at"])

    def _not_gone(self, d: dict[str, Any], still: list) -> None:
        """Still there ``confirm_timeout_s`` after the kill: unconfirmed (interrupted: failed)."""
        why = "still reporting" if still else "the Lighthouse still hears it"
        if d["status"] == "interrupted":
            self.store.update_decision(d["id"], status="failed", detail=(
                f"{d['detail']}; the monitor stopped while sending and {why} after "
                f"{self.cfg.confirm_timeout_s:g}s: the kill never landed"))
        else:
            self.store.update_decision(d["id"], status="unconfirmed", detail=(
                f"{d['detail']}; {why} after {self.cfg.confirm_timeout_s:g}s"))


def _dark(replica_id: str, group: Any) -> str:
    """The note (logged too) naming the ranks of an evicted group that did not answer before its
    kill: no call reached them, so "confirmed" says nothing of whether they still run."""
    dark = [rank_name(r) for r in (group.ranks if group is not None else ()) if not r.reachable]
    if not dark:
        return ""
    note = (f"; not stopped: {', '.join(dark)}: did not answer before the kill, and neither the "
            "Lighthouse's kill (group rank 0's Manager, if it runs) nor a call of the monitor "
            "reaches such a rank: if it still runs (stopped, hung), stop it")
    log.warning("eviction of %s: %s", replica_id, note[2:])
    return note


def _landed(replica_id: str, still: list, lighthouse: LighthouseStatus | None) -> str | None:
    """Why an interrupted kill landed although ``still`` report its replica id, or None: it hits
    only the Manager (group rank 0), so landed once that is gone and the Lighthouse (if read)
    no longer hears the replica."""
    if any((r.state or {}).get("group_rank") == 0 for r in still):
        return None  # the Manager's process answers: the kill never reached it
    if lighthouse is None:
        return "the group's rank 0 (its Manager) no longer answers: the kill landed"
    if lighthouse.heartbeating(replica_id):
        return None
    return "the group's rank 0 (its Manager) no longer answers and the Lighthouse no longer " \
           "hears the replica: the kill landed"

