"""The survivors' abort where the gone groups hold half the ranks or more (every 2-group job):
their ranks count against no reach; and ranks on torch's own debug server, which serve no
``/v1/abort`` or ``/v1/exit``, are skipped once, never tried again as failures.
"""

from __future__ import annotations

import logging
import time

import pytest

from monitor.act.actions import Orphans, RankCalls
from monitor.act.survivors import ABORT_TRIES, Survivors
from monitor.api.metrics import MonitorMetrics
from monitor.evidence.lighthouse_status import LighthouseStatus, QuorumMember
from monitor.store import Store
from tests.support.monitor_sim import SimJob
from tests.test_monitor_network import TOKEN, Clock, Driver, Training, monitor
from tests.test_rank_wire_auth_rounds import state_of, view_of

BLOCKED = {"phase": "allreduce", "timing": {"waiting": {"scope": "cross", "seconds": 5.0}}}


def aborts(job: SimJob, groups) -> list[dict]:
    return [a for g in groups for r in job.sim.group(g) for a in r.aborts]


def lose(job: SimJob, g: int, heartbeats: bool = False) -> None:
    """Group ``g``'s ranks stop answering; unless ``heartbeats``, the Lighthouse stops hearing
    it too."""
    for r in job.sim.group(g):
        r.set_mode("down")
    if not heartbeats:
        job.alive.discard(g)


def sim_driver(tmp_path, groups: int):
    job = SimJob(groups, ranks_per_group=1, heartbeat_timeout_ms=1000)
    job.sim.probe_token = TOKEN
    clock = Clock()
    return job, Driver(monitor(tmp_path, job, clock, rank_exit_token=TOKEN), Training(job), clock)


def test_the_survivor_of_a_two_group_job_is_told_to_abort(tmp_path):
    """Group 1 frozen, group 0 waiting in the cross-group all_reduce: the Lighthouse drops group
    1, the monitor reaches 1 rank of 2. The gone group's rank counted against the reach (50%,
    not above --min-reachable): blind, the survivor waited out torchft's timeout."""
    job, d = sim_driver(tmp_path, 2)
    try:
        d.sweeps(4)
        d.train.stall(0.5, d.clock.t)
        lose(job, 1)
        # well before the lost rank is forgotten (30 s of the monitor's clock), which would
        # let the abort out for another reason
        d.until(lambda: aborts(job, (0,)), "the survivor told to abort", steps=0, pause=0.2,
                sweeps=20)
        (dec,) = d.mon.store.decisions(decision="abort")
        assert (dec["replica_group"], dec["replica_id"], dec["status"]) == \
            (1, job.replica_ids[1], "sent")
        assert [a["decision"] for a in aborts(job, (0,))] == [dec["id"]]
    finally:
        d.mon.stop()
        job.stop()


def test_a_monitor_and_lighthouse_cut_off_together_from_most_groups_hold_the_abort(tmp_path):
    """Groups 1 and 2 unreached by the monitor and unheard by the Lighthouse (both on group 0's
    node, cut off from the others): more groups lost than reached is no evidence that they are
    gone rather than that the monitor is cut off: group 0 is not told to abort."""
    job, d = sim_driver(tmp_path, 3)
    try:
        d.sweeps(4)
        d.train.stall(0.5, d.clock.t)
        lose(job, 1)
        lose(job, 2)
        lost = (job.replica_ids[1], job.replica_ids[2])
        d.until(lambda: (lh := d.mon.lighthouse_status) is not None
                and not any(lh.heartbeating(r) for r in lost),
                "the Lighthouse hearing neither", steps=0, pause=0.2)
        d.sweeps(5, steps=0)
        assert not aborts(job, (0,))
        assert not d.mon.store.decisions(decision="abort")
    finally:
        d.mon.stop()
        job.stop()


def test_an_abort_held_by_a_monitor_cut_off_from_a_live_group_is_said_once(tmp_path, caplog):
    """Group 2 gone; group 1 unreachable to the monitor but heard by the Lighthouse (the
    monitor may be the one cut off): 1 of the 2 ranks not gone reached, blind; the held abort
    is said in one line, once."""
    job, d = sim_driver(tmp_path, 3)
    try:
        d.sweeps(4)
        d.train.stall(0.5, d.clock.t)
        lose(job, 1, heartbeats=True)
        lose(job, 2)
        with caplog.at_level(logging.WARNING, logger="monitor.act.survivors"):
            d.until(lambda: [r for r in caplog.records if "blind" in r.getMessage()],
                    "the held abort said", steps=0, pause=0.2, sweeps=20)
            d.sweeps(3, steps=0)
        said = [r.getMessage() for r in caplog.records if r.name == "monitor.act.survivors"]
        assert len(said) == 1 and job.replica_ids[2] in said[0], said
        assert "reaches only 50%" in said[0]
        assert aborts(job, range(3)) == [] and d.mon.store.decisions(decision="abort") == []
    finally:
        d.mon.stop()
        job.stop()


# --- ranks on torch's own debug server ---------------------------------------------------------

def test_a_survivor_on_torchs_debug_server_is_skipped_once_not_tried(tmp_path, caplog):
    """No /v1/abort is served there: the abort is no failed try, repeated ABORT_TRIES times
    with "told to abort it" each time, but one skipped decision, counted once."""
    url = "torch+http://127.0.0.1:9"
    gone = "replica_group_1:auth"
    status = LighthouseStatus(
        quorum_id=1, members={r: QuorumMember(r, 10, "store", 1)
                              for r in ("replica_group_0:auth", gone)},
        heartbeats={"replica_group_0:auth": 0.1, gone: 30.0}, stale=frozenset({gone}))
    store, metrics = Store(str(tmp_path / "state.sqlite")), MonitorMetrics("auth")
    survivors = Survivors(RankCalls(TOKEN, timeout_s=5), store, metrics, "auth")
    view = view_of({url: state_of(url, 0, **BLOCKED)})
    try:
        with caplog.at_level(logging.WARNING):
            made = [m for _ in range(ABORT_TRIES + 2) for m in survivors.release(
                view, view, status, None, set(), time.time())]
    finally:
        survivors.close()
    (dec,) = store.decisions(decision="abort")
    store.close()
    assert [(m["ranks"], m["skipped"]) for m in made] == [([], [0])]
    assert dec["status"] == "skipped" and "torch's debug server" in dec["detail"]
    assert "told to abort" not in dec["detail"]
    said = [r.getMessage() for r in caplog.records if r.name == "monitor.act.survivors"]
    assert len(said) == 1 and "told to abort" not in said[0]
    assert metrics.registry.get_sample_value(
        "lightkeeper_monitor_eviction_decisions_total",
        {"job": "auth", "decision": "abort", "reason": "peer_gone"}) == 1


@pytest.mark.parametrize("unreached", [False, True])
def test_an_orphan_on_torchs_debug_server_is_never_said_told(caplog, unreached):
    """Followed every 5 s for 20 s: one line, one note, neither saying it was told to exit nor
    that it will be: it names the rank for its operator to stop."""
    url = "torch+http://127.0.0.1:9"
    view = view_of({url: {**state_of(url, 0), "group_rank": 1}})
    orphans = Orphans(RankCalls(TOKEN, timeout_s=5), grace_s=0.0)
    try:
        with caplog.at_level(logging.WARNING):
            notes = [orphans.follow(1, "replica_group_0:auth", [view.ranks[url]], float(t), view,
                                    unreached) for t in (1, 7, 13, 19)]
    finally:
        orphans.exits.close()
    assert notes[0] is not None and notes[1:] == [None] * 3
    assert "torch's debug server" in notes[0] and not notes[0].startswith("told")
    assert "stop rank(s)" in notes[0] and "yet" not in notes[0]  # never told: its operator's
    said = [r.getMessage() for r in caplog.records if r.name == "monitor.act.actions"]
    assert len(said) == 1 and not said[0].startswith("told"), said


@pytest.mark.parametrize("groups, lost, told, blind", [
    (2, {1}, set(), False), (3, {1}, set(), False), (3, {1, 2}, set(), True),
    (4, {1, 2, 3}, set(), True),
    # the monitor's own kill is no group lost: one lost against one reached acts, as with 2
    (3, {1}, {2}, False), (5, {2, 3}, {4}, False)])
def test_reach_for_the_survivors_abort_leaves_out_lost_groups_no_more_than_reached(
        groups, lost, told, blind):
    """``Enforcer.blind_to_kills(unheard=True)`` on views of one-rank groups: groups the
    monitor reaches none of and the Lighthouse lists as heard, then stopped, leave the count
    while they are no more than the groups reached; groups it told to go always leave it."""
    from types import SimpleNamespace as NS

    from monitor.act.enforcer import Enforcer
    from monitor.config import RailsConfig

    view = {}
    for g in range(groups):
        r = NS()
        view[g] = NS(replica_id=f"r{g}", ranks=[r],
                     reachable=[] if g in lost | told else [r])
    up = sum(len(gv.reachable) for gv in view.values())
    ev = NS(groups=view, counts=(groups, up, {}), evidence_view=None)
    heard = {f"r{g}" for g in range(groups) if g not in lost | told}
    stopped = frozenset(f"r{g}" for g in lost | told)
    lighthouse = NS(heartbeating=lambda rid: rid in heard, stale=stopped,
                    heartbeats=dict.fromkeys(heard | stopped, 1.0))
    me = NS(store=NS(told_to_go_replica_ids=lambda: {f"r{g}" for g in told}),
            blind=lambda: None, cfg=NS(rails=RailsConfig()))
    ranks = {g: NS(replica_id=f"r{g}") for g in range(groups)}
    got = Enforcer.blind_to_kills(me, NS(evidence_view=ev, ranks=ranks), lighthouse,
                                  unheard=True)
    assert (got is not None) is blind, got


def test_after_a_lighthouse_restart_older_quorums_are_its_new_ones():
    """A restarted Lighthouse numbers its quorums from 1 again: the members kept of the old
    one's quorums (40-47) give way to the new ones, so a survivor blocked in new quorum 38 with
    a gone group is told to abort it. The Lighthouse statuses are parsed objects and the ranks
    and rank calls stand-ins (no Lighthouse restart here): the bookkeeping under test is the
    monitor's own."""
    from types import SimpleNamespace as NS

    sent = []

    class Calls:
        token = "t"

        def why_not(self, view, r):
            return None

        def abort(self, r, reason, did, quorum, view):
            sent.append((r.url, quorum))
            return NS(sent=True, skipped=False, http_status=202, detail="202")

    class Decisions:
        def add_decision(self, **kw):
            return 1

        def update_decision(self, *a, **kw):
            pass

    def status(q, members, heard):
        return LighthouseStatus(q, {m: QuorumMember(m, 1, "s", 1) for m in members},
                                dict.fromkeys(heard, 0.1))

    def view(quorums: dict[str, int], blocked: str | None = None):
        groups = {}
        for g, (rid, q) in enumerate(quorums.items()):
            state = {"quorum_id": q, **(BLOCKED if rid == blocked else {"phase": "forward"})}
            r = NS(url=f"http://{rid}", fresh=True, reachable=True, state=state, rank=g,
                   replica_id=rid)
            groups[g] = NS(replica_id=rid, reported_replica_ids={rid}, ranks=[r], reachable=[r],
                           superseded=[])
        return NS(groups=groups)

    survivors = Survivors(Calls(), Decisions(), MonitorMetrics("t"), "t")
    for q in range(40, 48):  # the old Lighthouse; "old" long gone from all of them
        v = view({"a": q, "b": q})
        survivors.release(v, v, status(q, ["a", "b", "old"], ["a", "b"]), None, set(), 0.0)
    for q in range(1, 39):  # restarted: a, b and c train
        v = view({"a": q, "b": q})
        survivors.release(v, v, status(q, ["a", "b", "c"], ["a", "b", "c"]), None, set(), 0.0)
    assert sent == []
    # c's host drops; a forms 39 with a spare; b is still blocked in 38's all_reduce with c
    v = view({"a": 39, "b": 38}, blocked="b")
    survivors.release(v, v, status(39, ["a", "spare"], ["a", "b", "spare"]), None, set(), 0.0)
    assert sent == [("http://b", 38)]
