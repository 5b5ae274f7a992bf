"""A group healing from a peer of the same quorum is no hang culprit (docs/monitor.md, hang):
with a synchronous quorum (the FSDP trainer's) torchft receives the checkpoint inside
``start_quorum``, so its ranks say phase ``quorum`` and wait across groups while the others wait
for it in the all_reduce it has not entered yet."""

from __future__ import annotations

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from tests.test_monitor_detectors import T0, Job, sweep


def test_a_group_healing_inside_its_quorum_call_is_not_hung():
    job = Job(groups=3, ranks=2, step_s=1.0)
    det = Detectors(DetectorConfig())
    job.steps(20, now=T0)
    sweep(det, job, T0)
    # group 2 failed its last commit and heals from a peer: it never entered the all_reduce
    job.fr.ft_collective("all_reduce", [[1000]], absent=[4, 5])
    for r in (4, 5):
        job.states[r]["step"] -= 1
    found = []
    for t in (1.0, 2.0, 3.5, 4.5, 8.0, 20.0):
        for r in range(job.world):
            if job.group_of(r) == 2:
                job.wait(r, "cross", t, phase="quorum")
            else:
                job.wait(r, "cross", t - 0.2, phase="allreduce")
        found += sweep(det, job, T0 + t)
    assert found == [] and det.last_error is None  # judged, not failed
    assert det.open_findings() == []
