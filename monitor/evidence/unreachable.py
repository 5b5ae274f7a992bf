"""Ranks that stopped answering: their last state kept in the store (a restarted monitor still
finds them dead), and past ``--forget-after`` forgotten, each said ended, stopped or lost."""

from __future__ import annotations

import logging
from typing import Any

from monitor.poll.discovery import Discovery
from monitor.store import Store

from .lighthouse_status import LighthouseStatus
from .rank import DOWN_AT, answers_other_job, last_known
from .view import ClusterView, ViewBuilder

log = logging.getLogger(__name__)

# a job's end said (a rank finished or stopped) this long before its last ranks went quiet
# explains them: a rank not read within its finish() wait vanishes unsaid beside its peers
END_SAID_SLACK_S = 60.0


class Unreachable:
    def __init__(self, store: Store, views: ViewBuilder, discovery: Discovery,
                 kept: dict[str, tuple[Any, dict[str, Any], Any]], lost: Any) -> None:
        self.store, self.views, self.discovery, self.lost = store, views, discovery, lost
        # url -> the dead_rank mark kept with it (None: none); kept: the store's, at start
        self._kept = {u: st.get(DOWN_AT) for u, (_, st, _) in kept.items()}
        self._unkept: set[str] = set()  # unreachable, not kept yet (a failed write)
        self._end_said_at: float | None = None  # a forgotten rank last said it ended/stopped

    def keep(self, view: ClusterView, marks: dict[str, Any]) -> None:
        """Keep in the store the last state of ranks that stop answering, dropped once they
        answer or are no target; a failed write (a full disk) is tried again next sweep. Kept
        again once ``marks`` (liveness's down_at) marks one down anew (its Manager's commits
        then: a restarted monitor tells one that lived from a death)."""
        kept, keep = self._kept, self._unkept
        # no target any more, or answering again
        gone = [u for u in kept if (rv := view.ranks.get(u)) is None or rv.reachable]
        keep.update(u for u in self.views.reshaped if not view.ranks[u].reachable)
        if gone:
            self.store.drop_unreachable(gone)
            for u in gone:
                del kept[u]
        keep.update(u for u, m in marks.items() if u in kept and kept[u] != m and type(m) is int)
        rows = [(url, rv.unreachable_since, last_known(rv.state, marks.get(url)),
                 rv.trust.to_dict() if rv.trust else None) for url in keep
                if (rv := view.ranks.get(url)) is not None and not rv.reachable
                and rv.state is not None and not rv.superseded
                and (url not in kept or type(m := marks.get(url)) is int and kept[url] != m)]
        if rows:
            self.store.keep_unreachable(rows)
            kept.update((row[0], row[2].get(DOWN_AT)) for row in rows)
        keep.clear()

    def forget(self, view: ClusterView, now: float,
               lighthouse: LighthouseStatus | None) -> int:
        """Drop self-registered ranks gone for --forget-after (those that said they ended at
        once). One gone unsaid counts lost while others answer, or, when none does, if no rank
        said the job ended and ``lighthouse`` (a good read, else None) no longer hears it.
        Returns how many ended; ``lost`` (a counter) counts those lost."""
        unreachable = self.views.unreachable_since()
        ended = [u for u in unreachable if (rv := view.ranks.get(u)) is not None and rv.ended]
        self.discovery.answered_other_job(  # not scraped under this job's label
            {u: job for u in unreachable if (job := answers_other_job(view.ranks.get(u)))})
        forgotten = self.discovery.forget_unreachable(unreachable, now, ended)
        others_up = bool(forgotten) and any(rv.reachable for rv in view.ranks.values())
        if any(url in ended or (view.ranks[url].state or {}).get("phase") == "stopped"
               for url in forgotten if url in view.ranks):
            self._end_said_at = now
        told = self.store.told_to_go_replica_ids() if forgotten else set()
        answering: set | None = None  # the replica groups a reachable rank answers for
        for url in forgotten:
            rv = view.ranks.get(url)
            stopped = rv is not None and (rv.state or {}).get("phase") == "stopped"
            # read in this monitor's life: a restored rank of a job that ended meanwhile is not
            read = rv is not None and rv.state is not None
            job_end_said = self._end_said_at is not None and self._end_said_at \
                >= unreachable.get(url, now) - END_SAID_SLACK_S
            # re-adopted from --sd-out and never read: stopped while no monitor polled it (a
            # drain takes the monitor's pod too), so unsaid; lost only if its group is not back
            if not read and answering is None:  # once per sweep: every rank of a large job
                answering = {o.replica_group for o in view.ranks.values() if o.reachable}
            back = not read and rv is not None and rv.replica_group is not None \
                and rv.replica_group in answering
            # a replica this monitor evicted went because it was told to: not lost
            evicted = rv is not None and bool(rv.replica_id) and rv.replica_id in told
            # the Lighthouse no longer hears its replica: the job is gone, not just the
            # monitor cut off from its ranks (without a Lighthouse nobody can tell)
            lost = not stopped and not back and not evicted and (others_up or (
                read and not job_end_said and lighthouse is not None and bool(rv.replica_id)
                and not lighthouse.heartbeating(rv.replica_id)))
            if url in ended:
                by = (rv.state or {}).get("stopped_by")
                log.info("forgot %s: %s", url, f"stopped by {by}" if by else
                         "its training finished")
            else:
                why = ""
                if back:
                    why = " (re-adopted, never answered this run; its group answers again)"
                elif evicted:
                    why = " (its replica was evicted)"
                elif lost:
                    why = " (lost while the job goes on)" if others_up else \
                        " (lost: no rank answers, none said the job ended)"
                log.info("forgot %s: unreachable for %.0fs%s", url,
                         self.discovery.forget_after_s, why)
            if lost:
                self.lost.inc()
        return sum(1 for u in ended if not view.ranks[u].superseded)  # as view.counts counts
