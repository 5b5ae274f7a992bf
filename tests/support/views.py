"""Cluster views built from scratch, every rank grouped at once."""

from __future__ import annotations

from monitor.evidence.cluster import ClusterView, Sums
from monitor.evidence.group import grouped
from monitor.evidence.rank import RankView


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
