"""A claimant conflict (a replica id claimed by two replica groups, a group rank or a global rank
claimed twice) keeps the incumbent: the rank verified before under that identity stays evidence
and the newcomer gets the conflict's reason, so a stranger allowed to register cannot blind the
monitor to a group. Claimants all new at once: neither counts, as before
(monitor/evidence/verification.py; docs/monitor.md, Verification)."""

from __future__ import annotations

import logging

import pytest
import requests

from lightkeeper.processes import wait_until
from monitor.evidence.lighthouse_status import LighthouseStatus, QuorumMember
from monitor.evidence.rank import RankView
from monitor.evidence.verification import verify_ranks
from tests.support.monitor_sim import rank_state
from tests.test_monitor_trust import DEAD, findings, impostor, job_monitor, verdicts

RID = {g: f"replica_group_{g}:x" for g in range(3)}
LH = LighthouseStatus(1, {r: QuorumMember(r, 0, "s", 1) for r in RID.values()},
                      {r: 0.1 for r in RID.values()})
LOG = "monitor.evidence.verification"


def st(rank: int, group: int, **claims) -> dict:
    return {**rank_state(rank, group, quorum_id=1, participants=3, now=1000.0),
            "replica_id": RID[group], **claims}


class Sweeps:
    """verify_ranks sweep after sweep, each rank carrying its last verdict and, down (None), its
    last state, as the monitor's RankViews do."""

    def __init__(self) -> None:
        self.trust: dict = {}
        self.last: dict[str, dict] = {}

    def __call__(self, states: dict[str, dict | None], lh: LighthouseStatus = LH) -> dict:
        self.last.update((u, s) for u, s in states.items() if s is not None)
        ranks = {u: RankView(u, s is not None, self.last[u], trust=self.trust.get(u))
                 for u, s in states.items()}
        self.trust = verify_ranks(ranks, lh, None, True, 1000.0)
        return {u: (t.reason, t.evidence) for u, t in self.trust.items()}


JOB = {"a": st(0, 0), "b": st(1, 1), "c": st(2, 2)}
# group 0's rank, its replica id swapped for group 2's: the reviewer's stranger
STRANGER = st(50, 0, replica_id=RID[2])


def warnings(caplog, reason: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOG and r.levelno == logging.WARNING and reason in r.getMessage()]


def test_a_stranger_copying_a_verified_groups_replica_id_loses_it_and_is_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger=LOG)
    sweep = Sweeps()
    assert set(sweep(JOB).values()) == {("ok", True)}
    for _ in range(3):  # the conflict lasts: one WARNING
        v = sweep({**JOB, "x": STRANGER})
        assert v == {"a": ("ok", True), "b": ("ok", True), "c": ("ok", True),
                     "x": ("replica_id_conflict", False)}, v
    assert "group 2 held it first" in sweep.trust["x"].detail
    [w] = warnings(caplog, "replica_id_conflict")
    assert "'c'" in w and "'x'" in w and RID[2] in w, w
    # group 2 dies: its last verdict still holds the id, so the stranger gains nothing (not
    # even a say in group 0, whose replica id it would contradict)
    v = sweep({**JOB, "c": None, "x": STRANGER})
    assert v == {"a": ("ok", True), "b": ("ok", True), "c": ("ok", True),
                 "x": ("replica_id_conflict", False)}, v
    assert sweep.trust["c"].stale and len(warnings(caplog, "replica_id_conflict")) == 1


def test_claimants_new_at_once_neither_counts(caplog):
    caplog.set_level(logging.WARNING, logger=LOG)
    sweep = Sweeps()
    for _ in range(2):
        v = sweep({**JOB, "x": STRANGER})
        assert v["c"] == v["x"] == ("replica_id_conflict", False) and v["a"] == ("ok", True), v
    [w] = warnings(caplog, "replica_id_conflict")
    assert "none verified before" in w, w


def test_a_copy_of_a_verified_ranks_slot_is_the_one_refused():
    """The same rule for a group rank: a copy of group 1's rank under another global rank."""
    copy = st(60, 1)
    sweep = Sweeps()
    sweep(JOB)
    assert sweep({**JOB, "y": copy}) == {"a": ("ok", True), "b": ("ok", True),
                                         "c": ("ok", True), "y": ("group_rank_taken", False)}
    fresh = Sweeps()  # both new: neither
    v = fresh({**JOB, "y": copy})
    assert v["b"] == v["y"] == ("group_rank_taken", False), v


def test_a_restart_under_a_new_replica_id_is_verified_as_before():
    """Group 2 restarts (torchft: a new replica id) at a new URL; its old URL first still
    answers with the old id while the Lighthouse lists both, then goes down."""
    new_rid = "replica_group_2:new"
    lh = LighthouseStatus(2, {**LH.members, new_rid: QuorumMember(new_rid, 0, "s", 1)},
                          {**LH.heartbeats, new_rid: 0.1})
    sweep = Sweeps()
    sweep(JOB)
    restarted = {**JOB, "c2": st(2, 2, replica_id=new_rid, quorum_id=2, pid=4242)}
    v = sweep(restarted, lh)
    assert v["c"] == v["c2"] == ("group_disagrees", False), v  # no telling which: as before
    lh_new = LighthouseStatus(3, {r: m for r, m in lh.members.items() if r != RID[2]},
                              {r: t for r, t in lh.heartbeats.items() if r != RID[2]})
    v = sweep({**restarted, "c": None,
               "c2": {**restarted["c2"], "quorum_id": 3}}, lh_new)
    assert v["c2"] == ("ok", True) and v["a"] == ("ok", True), v


@pytest.fixture
def job():
    from tests.support.monitor_sim import SimJob

    j = SimJob(3, ranks_per_group=2)
    yield j
    j.stop()


@pytest.fixture
def strangers():
    from tests.support.monitor_sim import SimRanks

    s = SimRanks.start(2)
    yield s
    s.stop()


def test_a_stranger_registered_with_a_groups_replica_id_does_not_hide_its_death(
        tmp_path, job, strangers, caplog):
    """The reviewer's scenario against a real Lighthouse: once the job is verified, a stranger
    registers claiming group 2's replica id under replica group 0. Group 2's ranks stay
    evidence; group 2 then dies and is found dead and evicted."""
    caplog.set_level(logging.WARNING, logger=LOG)
    forged = impostor(strangers, job.sim.group(0)[0].state, replica_id=job.replica_ids[2],
                      rank=50)
    mon = job_monitor(tmp_path, job)
    try:
        wait_until(lambda: mon.sweeps >= 2 and all(
            v["state"] == "verified" for v in verdicts(mon).values()), 15, what="verified ranks")
        requests.post(mon.url + "/v1/targets", json={"url": forged.url},
                      timeout=5).raise_for_status()
        wait_until(lambda: verdicts(mon).get(forged.url, {}).get("reason")
                   == "replica_id_conflict", 15, what="the stranger judged")
        n = mon.sweeps
        wait_until(lambda: mon.sweeps >= n + 3, 15, what="sweeps with the stranger")
        v = verdicts(mon)
        assert v[forged.url]["evidence"] is False
        for r in job.sim.ranks:
            assert (v[r.url]["state"], v[r.url]["evidence"]) == ("verified", True), v[r.url]
        [w] = warnings(caplog, "replica_id_conflict")
        assert forged.url in w and all(r.url in w for r in job.sim.group(2)), w

        job.kill(job.replica_ids[2])  # its processes gone, its heartbeats stopped
        wait_until(lambda: any(f["kind"] in DEAD and f["replica_group"] == 2
                               for f in findings(mon)), 20, what="group 2's death found")
        wait_until(lambda: job.kills, 20, what="group 2 evicted")
        assert job.kills == [job.replica_ids[2]]
        assert {f["replica_group"] for f in findings(mon)} == {2}
        assert verdicts(mon)[forged.url]["reason"] == "replica_id_conflict"
    finally:
        mon.stop()
