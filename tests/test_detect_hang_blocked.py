"""The hang detector inside a replica group of more than one process group: a DeviceMesh
("dp", "tp") of 2 x 2 ranks in each replica group, its DP groups created before its TP groups
(``"1"`` {0, 2}, ``"2"`` {1, 3} DP; ``"3"`` {0, 1}, ``"4"`` {2, 3} TP), so the engine lists the
DP hangs first.

Rank 3 is stuck in compute: its TP peer 2 waits in TP ``"4"``, DP peer 1 in DP ``"2"``, and
rank 0 waits in DP ``"1"`` for rank 2, which is blocked, not a culprit: that hang names none.
"""

from __future__ import annotations

import pytest

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from tests.test_monitor_detectors import T0, Job, sweep

DP_TP = (("1", (0, 2)), ("2", (1, 3)), ("3", (0, 1)), ("4", (2, 3)))  # creation order


@pytest.mark.parametrize("ahead", [0, 1])
@pytest.mark.parametrize("groups", [1, 2])
def test_a_replica_groups_hang_naming_a_culprit_is_taken_before_a_blocked_one(groups, ahead):
    """One replica group (no cross-group hang to fall back on), and two (the other waits in
    the cross-group all_reduce): rank 3 is named inside its group, in a collective its peers
    wait in; also where rank 2's CPU ran ``ahead`` (NCCL) and enqueued more TP collectives that
    wait for rank 3 before it blocked."""
    job = Job(groups=groups, ranks=4)
    det = Detectors(DetectorConfig(hang_floor_s=3.0, hang_factor=3.0))
    for g in range(groups):
        for name, ranks in DP_TP:
            job.fr.group(name, [4 * g + r for r in ranks])

    def mesh(g: int, absent: dict[str, list[int]] | None = None) -> None:
        for name, ranks in (DP_TP[2], DP_TP[3], DP_TP[0], DP_TP[1]):  # a step: TP, then DP
            job.fr.collective(name, "all_reduce", [[1000]], members=[4 * g + r for r in ranks],
                              absent=(absent or {}).get(name, ()))

    job.steps(20, now=T0)
    for _ in range(4):
        for g in range(groups):
            mesh(g)
    sweep(det, job, T0)
    mesh(0, absent={"4": [3], "1": [2], "2": [3]})
    for _ in range(ahead):
        job.fr.collective("4", "all_reduce", [[1000]], members=[2, 3], absent=[3])
    if groups == 2:
        mesh(1)
        job.fr.ft_collective("all_reduce", [[1000]], absent=[0, 1, 2, 3])
    found = []
    for t in (1.0, 2.0, 3.5, 4.5):
        for r in range(4, 4 * groups):
            job.wait(r, "cross", t - 0.2, phase="allreduce")
        for r in (0, 1, 2):
            job.wait(r, "group", t - 0.1)
        job.wait(3, None)
        found += sweep(det, job, T0 + t)
    assert [(f.kind, f.replica_group, f.ranks) for f in found] == [("hang", 0, [3])]
    ev = found[0].evidence
    assert ev["level"] == "in_group" and ev["never_arrived"] == [3]
    assert ev["culprit_hosts"] == ["host-g0"]
    assert ev["pending"]["replica_group"] == 0 and ev["pending"]["pg"] in ("2", "4")
    assert ev["waiting_ranks"] and set(ev["waiting_ranks"]) <= {1, 2}
