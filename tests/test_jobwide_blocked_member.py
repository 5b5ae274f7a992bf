"""``job_stall`` with a group of the Lighthouse's quorum that does not take part in it but is
blocked in the cross-group all_reduce like the others (monitor/detect/jobwide.py): a replacement
that healed and joined the collective, or a torchft spare (``FIXED_WITH_SPARES``: it never takes
part, and all-reduces zeros). A network stall then blocks every group alike and is still found;
only a non-participating member outside the collective (healing) holds the others
(tests/test_jobwide_healing_member.py). Built and swept as that file's tests are."""

from __future__ import annotations

import pytest

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from tests.test_jobwide_healing_member import NEW, STARTING_S, Q, _lighthouse, sweeper
from tests.test_monitor_detectors import T0, Job


@pytest.mark.parametrize("member", ["healed", "spare"])
def test_a_network_stall_is_found_beside_a_member_blocked_without_taking_part(member):
    job = Job()
    det = Detectors(DetectorConfig(starting_timeout_s=STARTING_S))
    found: list = []
    sweep = sweeper(job, det, found)
    ids = {s["replica_id"] for s in job.states}
    if member == "spare":
        for r in (4, 5):
            job.states[r].update(participating=False)
        for s in job.states:
            s.update(num_participants=2)
    now = T0
    lh = _lighthouse(3, ids)
    for _ in range(6):
        now += 1.0
        job.steps(3, now=now)
        sweep(now, lh)
    evicted: frozenset = frozenset()
    if member == "healed":  # a replacement healed into quorum Q, not yet taking part
        evicted = frozenset({job.states[4]["replica_id"]})
        ids = {job.states[r]["replica_id"] for r in (0, 2)} | {NEW}
        job.fr.quorum(Q, [0, 1, 2])
        for r, s in enumerate(job.states):
            s.update(quorum_id=Q, num_participants=2)
            if r in (4, 5):
                s.update(replica_id=NEW, pid=s["pid"] + 100, started_at=now - 5.0,
                         participating=False, commits=0, heals=1)
        lh = _lighthouse(Q, ids)
    job.fr.ft_collective("all_reduce", [[1000]])  # every group enqueued it: none completes
    since = now
    while now - since < 2 * STARTING_S:
        now += 1.5
        for r in range(job.world):
            job.wait(r, "cross", now - since, phase="allreduce")
        sweep(now, lh, evicted)
    assert "job_stall" in [f.kind for f in found]
