"""The periodic Flight Recorder look comes before an entry leaves the newest ones it reads.

A look reads each rank's newest FR_LAST entries (``/v1/fr_trace?last=256``). A mismatch that
stalls nothing (a same-width dtype mismatch in FSDP's all-gather: training goes on) is seen in
the Flight Recorder only, so if the next look comes later than those entries span, its entry is
never read. The demo's job enqueues ~9 entries a step at ~0.3 s a step: 256 span ~9 s, while
``--fr-interval`` is 15 s (up to 30 s while held), so a live in-group mismatch was detected in
1.8 s or 5.2 s when a look happened to be near, and never when it was not. The look now comes at
least every third of the span the last look measured (Detectors.fr_interval); with leader polling,
whose looks read torchft's group only from most ranks, it does not.

The jobs are tests/test_monitor_detectors.py's (3 replica groups x 2 ranks, gloo dumps), each
dump cut by the WorkerServer's own filter as the monitor asks it.
"""

from __future__ import annotations

import json

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from monitor.detect.detectors import FR_MIN_INTERVAL_S
from monitor.polling import FR_LAST
from tests.test_monitor_detectors import IN_GROUP_STEP, T0, Job
from worker_server.app import filter_fr_dump

SWEEP_S = 0.5  # the demo's --interval
STEPS_A_SWEEP = 2  # frgen: ~35 ms a collective on the ranks' clocks, 9 a step: ~0.3 s a step


def cut(job: Job) -> dict[int, dict]:
    return {r: json.loads(filter_fr_dump(json.dumps(d).encode(), None, FR_LAST))
            for r, d in job.dumps().items()}


def sweep(det: Detectors, job: Job, now: float):
    """One sweep as monitor.service runs it: (findings, whether it looked)."""
    view = job.view(now)
    evidence = view.evidence()
    wanted = det.fr_wanted(evidence, now)
    return det.update(evidence, cut(job) if wanted else None, now, full_view=view), bool(wanted)


def healthy(det: Detectors, job: Job, now: float, sweeps: int,
            until_look: bool = False) -> tuple[float, float | None]:
    """``sweeps`` healthy sweeps, or fewer ending with a look: (now, when the last look was)."""
    looked = None
    for _ in range(sweeps):
        now += SWEEP_S
        job.steps(STEPS_A_SWEEP, now=now)
        found, did = sweep(det, job, now)
        assert found == []
        looked = now if did else looked
        if did and until_look:
            break
    return now, looked


def test_a_live_in_group_mismatch_is_read_before_it_leaves_the_newest_entries():
    job = Job(step_s=0.03)  # frgen: each collective ~30 ms (+ jitter) on the ranks' clocks
    det = Detectors(DetectorConfig())  # --fr-interval 15, the demo's
    job.steps(40, now=T0)
    now, looked = healthy(det, job, T0, 40)
    # what FR_LAST entries span was measured from the dumps: well under --fr-interval
    assert det.fr_window_s is not None and 4.0 < det.fr_window_s < 15.0, det.fr_window_s
    assert det.fr_interval() == max(FR_MIN_INTERVAL_S, det.fr_window_s / 3)
    # right after a look: the worst case, the next one as far as it gets
    now, looked = healthy(det, job, now, 60, until_look=True)
    assert looked == now
    # group 2's rank 5 issues its first all-gather of a step as integers; training goes on
    for g in range(3):
        for i, (op, sizes) in enumerate(IN_GROUP_STEP):
            job.fr.collective("0", op, sizes, members=job.members(g),
                              dtypes={5: "Int"} if g == 2 and i == 0 else None)
    job.fr.ft_collective("all_reduce", [[1000]])
    struck, found = now, []
    while not found and now - struck < 60:
        now += SWEEP_S
        job.steps(STEPS_A_SWEEP, now=now)
        found = sweep(det, job, now)[0]
    assert [(f.kind, f.replica_group, f.ranks) for f in found] == [("mismatch", 2, [5])], \
        f"not detected within {now - struck:.1f}s (looks every {det.fr_interval():.1f}s)"
    assert found[0].evidence["attributed_by"] == "step_pattern"
    assert now - struck <= det.fr_interval() + SWEEP_S


def test_with_leader_polling_the_window_does_not_hasten_the_look():
    """With leader polling most ranks' looks are torchft's group only (an in-group entry is not
    read at any interval): looking more often would only cost, so --fr-interval holds."""
    job = Job(step_s=0.03)
    det = Detectors(DetectorConfig())
    job.steps(40, now=T0)
    healthy(det, job, T0, 4)
    assert det.fr_interval() < 15.0
    det.fr_window_adapts = False  # as monitor.polling sets it while leader polling is on
    assert det.fr_interval() == 15.0
    job.steps(2, now=T0 + 3)
    sweep(det, job, T0 + 30)  # a look: the window is not measured from it
    assert det.fr_window_s is None and det.fr_interval() == 15.0
