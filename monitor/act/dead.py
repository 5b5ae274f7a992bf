"""When a ``dead`` finding counts against its host: once the Lighthouse agrees the group is gone.

A monitor cut off from a host, or a job that ended, also sees dead groups: a dead finding counts
only once the Lighthouse no longer hears the group, the monitor did not evict it, and at least
as many groups live on as are dead. A finding resolved first is never counted.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

from monitor.detect import Finding
from monitor.evidence.lighthouse_status import LighthouseStatus
from monitor.evidence.view import ClusterView


class DeadGroups:
    """Dead findings waiting for the Lighthouse to agree."""

    def __init__(self) -> None:
        self.pending: dict[tuple, Finding] = {}  # confirmed, not yet agreed

    def agreed(self, new: Iterable[Finding], open_keys: Collection[tuple],
               evicted: Callable[[], Collection[str]], view: ClusterView,
               lighthouse: LighthouseStatus | None) -> list[Finding]:
        """The dead findings (of ``new`` and those waiting) that now count, each with the
        Lighthouse's word added to its evidence (``lighthouse``); ``evicted()``: the replica
        ids the monitor sent a kill for."""
        for f in new:
            if f.kind == "dead":
                self.pending[f.key] = f
        if not self.pending:
            return []
        gone = evicted()
        for key in [k for k, f in self.pending.items() if k not in open_keys
                    or not f.replica_id or f.replica_id in gone]:
            del self.pending[key]
        if not self.pending or lighthouse is None:
            return []
        live = sorted(g for g, gv in view.groups.items() if gv.reachable and gv.replica_id
                      and lighthouse.heartbeating(gv.replica_id))
        dead = {k[1] for k in open_keys if k[0] == "dead"} - set(live)
        out = []
        for key, f in list(self.pending.items()):
            rid: Any = f.replica_id
            if lighthouse.heartbeating(rid) or len(live) < max(1, len(dead)):
                continue
            seen = lighthouse.heartbeats.get(rid)
            f.evidence["lighthouse"] = (
                f"the Lighthouse no longer hears {rid}"
                + (f" (last heartbeat {seen:.1f}s ago)" if seen is not None else "")
                + f"; {len(live)} group(s) live on, {len(dead)} dead")
            out.append(f)
            del self.pending[key]
        return out
