"""A group hung mid-run whose eviction --min-replicas holds, then left out of the quorum the
others form without it (the evicted group's replacement rejoined): the job going on without it
is not its recovery. Its hang stays open while it stays at the step and quorum id it hung at,
its eviction goes once the rails allow, and it closes when the group moves. Built as
tests/test_hang_first_step_loop.py: 3 groups x 2 ranks, gloo dumps, the real Verifier against
the Lighthouse's status, a real Enforcer and Store (the Lighthouse's kill a recorder), swept as
the service does."""

from __future__ import annotations

import copy

import pytest

from monitor.evidence.lighthouse_status import LighthouseStatus, QuorumMember
from tests import test_monitor_detectors as detectors_test
from tests.support.frgen import _Rank
from tests.test_hang_first_step_loop import STARTING_S, _acted_on, _Slot
from tests.test_monitor_detectors import T0


def _status(q: int, members: list[str], heard: list[str], stale: list[str]) -> LighthouseStatus:
    return LighthouseStatus(q, {i: QuorumMember(i, 5, "", 2) for i in members},
                            dict.fromkeys(heard + stale, 0.1), frozenset(stale), at=T0)


class _Left(_Slot):
    """The demo's run (``--inject 1.1:slow_compute ... --inject 2.1:hang:where=group``): group 1
    evicted, its ranks gone; group 2's rank 5 hangs before its forward's all-gather, which rank 4
    is blocked in, while group 0 waits for the next quorum (torchft waits for group 2 to ask)."""

    def __init__(self) -> None:
        super().__init__()
        job = self.job
        self.rid = {g: job.states[2 * g]["replica_id"] for g in range(3)}
        self.evicted.add(self.rid[1])
        job.down = {2, 3}
        ids = list(self.rid.values())
        self.lh = _status(3, ids, [self.rid[0], self.rid[2]], [self.rid[1]])
        job.fr.collective("0", "all_gather", [[300]], members=job.members(2), absent=[5])
        self.since = self.now

    def hung(self) -> None:
        """Group 2 as it stays: rank 4 in the all-gather, rank 5 in its forward pass."""
        self.job.wait(4, "group", self.now - self.since, phase="forward")
        self.job.wait(5, None, phase="forward")

    def stall(self, sweeps: int) -> None:
        for _ in range(sweeps):
            self.advance(1.0)
            for r in (0, 1):
                self.job.wait(r, "cross", self.now - self.since, phase="quorum")
            self.hung()
            self.sweep()

    def rejoin(self) -> None:
        """Group 1's replacement heals into quorum 4 with group 0; group 2 never asked."""
        job, new = self.job, "replica_group_1:spare"
        job.down = set()
        for r in (2, 3):  # a new process: its recorder starts empty
            was = job.fr._ranks[r]
            job.fr._ranks[r] = _Rank(r, was.host, was.clock_offset_ns, was.now_ns,
                                     pg_ids={"0": 0}, next_pg_id=1)
            job.states[r].update(replica_id=new, pid=job.states[r]["pid"] + 100,
                                 started_at=self.now - 5.0)
        for r in range(4):
            job.states[r].update(quorum_id=4, num_participants=2)
        job.fr.quorum(4, [0, 1])
        self.lh = _status(4, [self.rid[0], new], [self.rid[0], new, self.rid[2]], [self.rid[1]])

    def train(self, sweeps: int) -> None:
        """Groups 0 and 1 commit steps; group 2 stays hung at its step and quorum id."""
        job = self.job
        for _ in range(sweeps):
            kept = [copy.deepcopy(job.states[r]) for r in job.members(2)]
            job.n = 2  # the in-group collectives of groups 0 and 1 only
            job.steps(2, now=self.advance(1.0))
            job.n = 3
            job.states[4:6] = kept
            self.hung()
            self.sweep()

    def hangs(self) -> list:
        return [f for f in [*self.det.open_findings(), *self.det.resolved_findings()]
                if f.kind == "hang"]


def test_a_hang_left_out_of_the_quorum_stays_open_and_is_evicted_once_the_rails_allow(tmp_path):
    slot = _Left()
    enf, kills, _ = _acted_on(slot, tmp_path, {"cooldown_s": 5.0})
    enf.store.add_decision(replica_group=1, replica_id=slot.rid[1], decision="evict",
                           reason="straggler", status="sent", at=slot.now)
    slot.stall(5)
    (f,) = slot.hangs()
    assert (f.replica_group, f.ranks, f.evidence["level"], f.resolved_at) == (2, [5], "in_group",
                                                                             None)
    holds = enf.store.decisions(decision="hold")
    assert [(d["replica_group"], d["reason"]) for d in holds] == [(2, "min_replicas")]
    assert kills.sent == []
    slot.rejoin()
    slot.train(8)
    # the others went on without it: not its recovery; its eviction went once two groups were
    # left in the quorum without it (and the cooldown since group 1's was over)
    assert kills.sent == [slot.rid[2]]
    (f,) = slot.hangs()
    assert f.resolved_at is None and f.replica_id == slot.rid[2]
    (kill,) = [d for d in enf.store.decisions(decision="evict") if d["replica_group"] == 2]
    assert kill["reason"] == "hang" and kill["finding_id"] == enf.finding_id(f.key)
    # the kill ends it; its supervisor restarts it under a new replica id: over, `replaced`
    slot.evicted.add(slot.rid[2])
    spare = "replica_group_2:spare"
    slot.lh = _status(4, list(slot.lh.members), [*slot.lh.heartbeats, spare], [slot.rid[1]])
    for r in slot.job.members(2):
        slot.job.states[r].update(replica_id=spare, quorum_id=-1, step=0,
                                  phase="quorum", pid=slot.job.states[r]["pid"] + 100,
                                  participating=False)
        slot.job.wait(r, None)
    slot.sweep()
    assert [(h.resolution, h.replica_id) for h in slot.hangs()] == [("replaced", slot.rid[2])]
    assert not any(f.kind == "stuck_starting" for f in slot.det.open_findings())
    enf.store.close()


@pytest.mark.parametrize("how", ["asks", "takes_part", "steps", "leaves"])
def test_a_hang_left_out_of_the_quorum_closes_once_its_group_moves(how):
    """It asks for a quorum again (its collective given up), heals into the newest quorum,
    commits a step, or stops answering (closed `left_job` after --dead-sweeps sweeps, as any
    finding of a group gone)."""
    slot = _Left()
    slot.stall(5)
    slot.rejoin()
    slot.train(4)
    (f,) = slot.hangs()
    assert f.resolved_at is None
    job = slot.job
    for r in job.members(2):
        if how == "asks":
            job.wait(r, "cross", 0.5, phase="quorum")
        elif how == "takes_part":
            job.states[r].update(quorum_id=4, num_participants=3, phase="healing")
            job.wait(r, None)
        elif how == "steps":
            job.states[r]["step"] += 1
            job.wait(r, None)
    if how == "leaves":
        job.down = set(job.members(2))
    else:
        slot.hung = lambda: None  # as it is now
    if how == "takes_part":
        slot.lh = _status(4, list(slot.lh.members) + [slot.rid[2]], list(slot.lh.heartbeats),
                          [slot.rid[1]])
    slot.train(1 if how != "leaves" else slot.det.cfg.dead_sweeps)
    (f,) = slot.hangs()
    assert f.resolution == ("left_job" if how == "leaves" else "progress")


def test_a_hang_left_out_of_the_quorum_takes_none_of_the_others_later_stalls(tmp_path):
    """Held for good (hang not in --evict-on), the left-out group's hang stays open, but the
    others go on without it: their later pause, with nothing found, is not its stall, nor is
    the time before a later hang of group 0 is confirmed (that hang's own, from its onset). Its
    incident costs its capacity only. The ledger is checked against its reference each sweep."""
    slot = _Left()
    enf, _, led = _acted_on(slot, tmp_path, {"evict_kinds": ("straggler",)})
    slot.stall(5)
    slot.rejoin()
    slot.train(10)
    job = slot.job
    for _ in range(10):  # groups 0 and 1 pause: no step, no wait (a long save, unmarked)
        slot.advance(1.0)
        for r in range(4):
            job.wait(r, None, phase="optimizer")
        slot.hung()
        slot.sweep()
    slot.train(10)
    # group 0 hangs: rank 1 never enters its all-gather, rank 0 is blocked in it
    job.fr.collective("0", "all_gather", [[300]], members=job.members(0), absent=[1])
    since = slot.now
    for _ in range(15):
        slot.advance(1.0)
        job.wait(0, "group", slot.now - since, phase="forward")
        job.wait(1, None, phase="forward")
        for r in (2, 3):
            job.wait(r, "cross", slot.now - since, phase="quorum")
        slot.hung()
        slot.sweep()
    assert sorted((f.replica_group, f.resolved_at) for f in slot.hangs()) == [(0, None),
                                                                               (2, None)]
    held, hung = (next(i for i in led.incidents.values() if i.replica_group == g)
                  for g in (2, 0))
    assert set(held.cost) == {"capacity_lost"}, held.cost
    assert {r.cause for r in led.runs if r.incident == held.id} <= {"capacity_lost"}
    # groups 0 and 1's time since group 0's hang began (settled or not) is its stall
    assert {(r.cause, r.incident) for r in led.runs
            if r.t0 >= since and r.groups == [0, 1]} == {("stall", hung.id)}
    enf.store.close()


def _torch_only(slot: _Left) -> None:
    """Group 2's ranks as torch's debug server answers for them once the Lighthouse no longer
    lists the replica (monitor.evidence.torch_rank.torch_state): no step or quorum id."""
    for r in slot.job.members(2):
        slot.job.states[r].update(step=-1, quorum_id=-1, participating=False,
                                  num_participants=0, phase="unknown",
                                  torch_only={"store": "tcp://sim", "handlers": []})


@pytest.mark.parametrize("moved", [False, True])
def test_a_torch_only_hang_left_out_stays_open_while_its_ranks_stay_blocked(moved, monkeypatch):
    """Its ranks tell no step or quorum id: the hang stays open while the rank it found
    blocked in the group is blocked still, since before the confirmation; one blocked anew
    (the old collective over, a new one begun) has moved: `progress`."""
    def kept(state: dict) -> dict:  # the poller drops a WorkerServer's `torch_only`, not torch's
        return {**was(state), **{k: state[k] for k in ("torch_only",) if k in state}}

    was = detectors_test.kept
    monkeypatch.setattr(detectors_test, "kept", kept)
    slot = _Left()
    slot.stall(5)
    slot.rejoin()
    hung = slot.hung
    if moved:
        def hung() -> None:  # rank 4 left the all-gather and waits in a new collective
            slot.job.wait(4, "group", 0.5, phase="forward")
            slot.job.wait(5, None, phase="forward")
    slot.hung = lambda: (hung(), _torch_only(slot))
    slot.train(4)
    (f,) = slot.hangs()
    assert (f.resolved_at is None) != moved and f.resolution == ("progress" if moved else None)


def test_a_hang_left_out_past_the_starting_timeout_is_evicted_under_stuck_starting(tmp_path):
    """hang not in --evict-on, stuck_starting in: the open hang does not keep the group from
    being named stuck_starting (left_out) once out of the quorum --starting-timeout, and that
    eviction goes; one hung in the quorum is named only `hang` (test_jobwide_healing_member)."""
    slot = _Left()
    enf, kills, _ = _acted_on(slot, tmp_path, {"evict_kinds": ("straggler", "stuck_starting")})
    slot.stall(5)
    slot.rejoin()
    slot.train(int(STARTING_S) - 2)
    assert kills.sent == [] and not any(f.kind == "stuck_starting"
                                        for f in slot.det.open_findings())
    # no sweep past the kill: the reference ledger counts the recovery after a kill not yet
    # confirmed at once, where monitor/goodput holds it
    for _ in range(4):
        slot.train(1)
        if kills.sent:
            break
    assert kills.sent == [slot.rid[2]]
    (kill,) = [d for d in enf.store.decisions(decision="evict") if d["replica_group"] == 2]
    assert kill["reason"] == "stuck_starting"
    assert [f.resolved_at for f in slot.hangs()] == [None]  # still hung: both stay open
    enf.store.close()
