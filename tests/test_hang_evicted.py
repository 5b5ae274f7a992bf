"""A group the monitor evicted holds the others in the cross-group collective until torchft
drops it from the quorum (about a second after the kill): that wait is the monitor's own doing,
not a hang of the group. Named, it would count as a second offence against the group's host
(a straggler's host quarantined for its kill).

Each sweep is built as the service builds it: the real Verifier against a Lighthouse status
made here (torchft lists a killed group until it drops it), the detectors reading the evidence
view with the whole view beside it."""

from __future__ import annotations

import pytest

from monitor.evidence.lighthouse_status import LighthouseStatus, QuorumMember
from tests.test_monitor_detectors import T0, group_1_never_arrives

KILLED = "replica_group_1:sim"


def _hangs(inside: list[int], killed: set[str], with_dumps: bool = True,
           peer_id: str | None = None) -> tuple[list, list[int]]:
    """The hangs found while groups 0 and 2 wait 4.3 s across groups for group 1, in which rank
    3 never entered the all-gather rank 2 waits in (``inside`` [3]) or both finished theirs
    ([]); ``peer_id``: the replica id rank 2 reports, listed by the Lighthouse beside the
    others. Also group 1's ranks in the last sweep's evidence."""
    job, det = group_1_never_arrives(absent_in_group=inside)
    if peer_id is not None:
        job.states[2]["replica_id"] = peer_id
    ids = {s["replica_id"] for s in job.states}
    lighthouse = LighthouseStatus(3, {i: QuorumMember(i, 20, "", 2) for i in ids},
                                  {i: 0.1 for i in ids})
    found, evidence = [], None
    for t in (1.0, 2.0, 3.5, 4.5):
        for r in (0, 1, 4, 5):
            job.wait(r, "cross", t - 0.2, phase="allreduce")
        job.wait(2, "group" if inside else None, t - 0.1)
        job.wait(3, None)
        view = job.view(T0 + t, job.verified_by(lighthouse, T0 + t))
        evidence = view.evidence()
        dumps = job.dumps() if with_dumps and det.fr_wanted(evidence, T0 + t) else None
        found += det.update(evidence, dumps, T0 + t, full_view=view, evicted=killed)
    group_1 = sorted(r.rank for r in evidence.ranks.values() if r.replica_group == 1)
    return [(f.kind, f.replica_group) for f in found if f.kind == "hang"], group_1


@pytest.mark.parametrize(("inside", "with_dumps"), [([3], True), ([], True), ([], False)],
                         ids=["in_group", "cross_group", "states_alone"])
def test_no_hang_is_named_on_a_group_whose_kill_was_sent(inside, with_dumps):
    # the same evidence names the group while it is not the one being killed
    assert _hangs(inside, set(), with_dumps) == ([("hang", 1)], [2, 3])
    assert _hangs(inside, {KILLED}, with_dumps) == ([], [2, 3])


@pytest.mark.parametrize("peer_id", [KILLED, "replica_group_1:new"])
@pytest.mark.parametrize(("inside", "with_dumps"), [([3], True), ([], False)],
                         ids=["in_group", "states_alone"])
def test_the_killed_incarnation_is_told_by_its_ranks_not_by_a_vote(peer_id, inside,
                                                                     with_dumps):
    """Group 1's rank 2 may already report its replacement's id (a spare up under a new id,
    listed by the Lighthouse) while rank 3 still reports the killed one: one each, the group's
    majority id is a coin toss. The verifier takes such a group out of the evidence (its ranks
    disagree); with one id, the named rank's own id says the wait is the kill's. No hang is
    named on the group either way."""
    hangs, group_1 = _hangs(inside, {KILLED}, with_dumps, peer_id=peer_id)
    assert hangs == []
    assert group_1 == ([2, 3] if peer_id == KILLED else [])
