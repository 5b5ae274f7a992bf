"""Cluster views built from scratch, every rank grouped at once, and the ranks of a job whose
incremental views are checked against them."""

from __future__ import annotations

from typing import Any

from monitor.evidence.cluster import ClusterView, Sums
from monitor.evidence.group import grouped
from monitor.evidence.rank import RankView
from monitor.poll.discovery import Target
from tests.support.monitor_sim import rank_state


def job_ranks(groups: int, size: int, now: float, **extra: Any
              ) -> tuple[list[Target], list[dict[str, Any]]]:
    """``groups`` replica groups of ``size`` ranks at step 0 of quorum 2: their targets and the
    states they answer (``extra``: set in each)."""
    targets = [Target(f"http://127.0.0.1:{9100 + r}", "static") for r in range(groups * size)]
    states = []
    for r in range(groups * size):
        s = rank_state(r, r // size, step=0, quorum_id=2, participants=groups, now=now)
        s.update(group_rank=r % size, group_world_size=size, **extra)
        states.append(s)
    return targets, states


def scratch_view(at: float, ranks: dict[str, RankView],
                 polled: list[str] | None = None) -> ClusterView:
    """The view of ``ranks`` grouped from scratch, as ViewBuilder groups a first sweep: the
    reference its incremental sweeps are checked against, and a view of ranks a test made."""
    members: dict[int | None, list[RankView]] = {}
    for rv in ranks.values():
        members.setdefault(rv.replica_group, []).append(rv)
    ungrouped = [r for r in members.pop(None, []) if not r.superseded]
    view = ClusterView(at=at, ranks=ranks, ungrouped=ungrouped, polled=polled)
    sums = Sums()
    for g in sorted(members):
        gv = grouped(g, members[g])
        if gv is not None:
            view.groups[g] = gv
            sums.add(gv, 1)
    sums.fill(view)
    return view
