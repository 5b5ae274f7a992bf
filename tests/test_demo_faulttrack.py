"""A fault's story (:class:`lightkeeper.faulttrack.FaultTrack`) from what the demo observes.

Observations are written here as plain data in the shapes the ranks (``/v1/state``) and the
monitor (``/v1/findings``, ``/v1/evictions``) serve; the real processes run in
``tests/test_demo_e2e.py``. Every stage's deadline is exercised: a story always ends.
"""

from __future__ import annotations

from lightkeeper.faulttrack import Deadlines, FaultTrack, Observation, Strike

T0 = 1_800_000_000.0
SPEC = "slow_compute:delay=0.6,from_step=20,rank=1"


def rank_state(g: int, r: int, step: int, started_at: float, participants: int = 3) -> dict:
    return {"replica_group": g, "group_rank": r, "rank": 2 * g + r, "step": step,
            "participating": True, "num_participants": participants, "started_at": started_at,
            "host": "node-a", "last_step_at": None}


def obs(t: float, *, states=None, incarnation=None, alive=None, strikes=(), findings=(),
        evictions=(), restarts=(), samples=(), finished=None, **hosts) -> Observation:
    states = states if states is not None else {g: [rank_state(g, 0, 10, T0), rank_state(g, 1, 10, T0)]
                                                for g in range(3)}
    return Observation(t=t, t0_unix=T0, groups=3, ranks_per_group=2, states=states,
                       incarnation=incarnation or {0: 0, 1: 0, 2: 0},
                       alive=alive or {0: True, 1: True, 2: True},
                       finished=finished or {0: False, 1: False, 2: False},
                       strikes=list(strikes), findings=list(findings),
                       evictions=list(evictions), restarts=list(restarts),
                       samples=list(samples), **hosts)


def track(given: str = "start", **kw) -> FaultTrack:
    args = dict(replica_group=1, group_rank=1, spec=SPEC, kind="slow_compute", trigger_step=20,
                given=given, armed_at_s=2.0, counting_from_s=10.0, incarnation=0,
                step_at_arming=10, ranks_per_group=2,
                deadlines=Deadlines(strike_s=30, s_per_step=2, detect_s=60, evict_s=30,
                                    rejoin_s=120))
    args.update(kw)
    return FaultTrack(1, **args)


STRIKE = Strike(1, 0, 1, 3, "node-a", SPEC, T0 + 25.0)
FINDING = {"id": 7, "kind": "straggler", "replica_group": 1, "ranks": [2, 3],
           "first_seen": T0 + 27.0, "confirmed_at": T0 + 29.0, "evidence": {}}
EVICT = {"id": 3, "replica_group": 1, "decision": "evict", "reason": "straggler",
         "at": T0 + 29.1, "finding_id": 7}


def survivor_samples() -> list[dict]:
    # groups 0 and 2 at step 30 until the eviction (29.1 s), step 31 committed at 33.0 s
    out = []
    for g in (0, 2):
        out.append({"t": 29.0, "replica_group": g, "rank": 2 * g, "step": 30,
                    "last_step_at_s": 28.9})
        out.append({"t": 33.5, "replica_group": g, "rank": 2 * g, "step": 31,
                    "last_step_at_s": 33.0})
    return out


def test_the_whole_story_with_the_times_the_parts_report():
    tr = track()
    assert tr.update(obs(20.0)) == [] and tr.stage == "strike"
    events = tr.update(obs(25.5, strikes=[STRIKE]))
    assert tr.record["struck_at_s"] == 25.0 and tr.record["host"] == "node-a"
    assert tr.record["rank"] == 3 and events[0][0] == "struck"
    tr.update(obs(30.0, strikes=[STRIKE], findings=[FINDING], evictions=[EVICT]))
    assert tr.record["detected_at_s"] == 29.0 and tr.record["detected_kind"] == "straggler"
    assert tr.record["finding_ranks"] == [2, 3]
    assert tr.record["culprit_ranks"] is None  # the finding did not name one
    assert tr.record["evicted_at_s"] == 29.1 and tr.stage == "rejoin"
    restarted = {0: [rank_state(0, 0, 40, T0), rank_state(0, 1, 40, T0)],
                 1: [rank_state(1, 0, 39, T0 + 31), rank_state(1, 1, 39, T0 + 31)],
                 2: [rank_state(2, 0, 40, T0), rank_state(2, 1, 40, T0)]}
    events = tr.update(obs(41.0, states=restarted, incarnation={0: 0, 1: 1, 2: 0},
                           strikes=[STRIKE], findings=[FINDING], evictions=[EVICT],
                           restarts=[(1, 30.5)], samples=survivor_samples()))
    r = tr.record
    assert tr.done and r["outcome"] == "recovered" and r["note"] is None
    assert (r["restarted_at_s"], r["survivors_committing_at_s"], r["rejoined_at_s"]) == (
        30.5, 33.0, 41.0)
    assert events[-1][0] == "rejoined"


def test_a_group_back_in_the_jobs_quorum_while_another_is_out_has_rejoined():
    """Group 2 hung (held, not evicted): its ranks still report the old quorum of 3. Group 1,
    evicted and restarted, trains with group 0 in the newest quorum, of 2: it has rejoined."""
    tr = track()
    tr.update(obs(25.5, strikes=[STRIKE]))
    tr.update(obs(30.0, strikes=[STRIKE], findings=[FINDING], evictions=[EVICT]))

    def rank(g, r, step, started_s, quorum, n):
        return {**rank_state(g, r, step, T0 + started_s, n), "quorum_id": quorum}

    states = {0: [rank(0, 0, 47, 0, 3, 2), rank(0, 1, 47, 0, 3, 2)],
              1: [rank(1, 0, 47, 31, 3, 2), rank(1, 1, 47, 31, 3, 2)],
              2: [rank(2, 0, 46, 0, 2, 3), rank(2, 1, 46, 0, 2, 3)]}
    tr.update(obs(38.0, states=states, incarnation={0: 0, 1: 1, 2: 0}, strikes=[STRIKE],
                  findings=[FINDING], evictions=[EVICT], restarts=[(1, 30.5)],
                  samples=survivor_samples()))
    assert tr.done and tr.record["outcome"] == "recovered"
    assert tr.record["rejoined_at_s"] == 38.0


def test_culprits_are_taken_from_the_finding():
    tr = track()
    finding = dict(FINDING, evidence={"culprit_ranks": [3], "culprit_hosts": ["node-a"]})
    tr.update(obs(30.0, strikes=[STRIKE], findings=[finding]))
    assert tr.record["culprit_ranks"] == [3] and tr.record["culprit_hosts"] == ["node-a"]


def test_a_finding_before_the_strike_or_elsewhere_is_not_the_fault_s():
    tr = track()
    early = dict(FINDING, confirmed_at=T0 + 20.0)
    elsewhere = dict(FINDING, replica_group=0, confirmed_at=T0 + 29.0)
    tr.update(obs(40.0, strikes=[STRIKE], findings=[early, elsewhere]))
    assert tr.stage == "detection" and tr.record["detected_at_s"] is None


def test_strike_of_another_rank_or_incarnation_does_not_count():
    tr = track()
    other_rank = Strike(1, 0, 0, 2, "node-a", SPEC, T0 + 25.0)
    other_life = Strike(1, 1, 1, 3, "node-a", SPEC, T0 + 25.0)
    tr.update(obs(26.0, strikes=[other_rank, other_life]))
    assert tr.stage == "strike"


def test_never_struck_by_its_deadline():
    tr = track()  # counting from 10 s: 30 s + 10 steps to go x 2 s = 60 s
    assert tr.deadline_s == 60.0
    tr.update(obs(59.9))
    assert not tr.done
    tr.update(obs(60.0))
    assert tr.done and tr.record["outcome"] == "never struck"
    assert "60.0s" in tr.record["note"]


def test_a_restart_before_the_strike_takes_the_fault_along():
    tr = track()
    tr.update(obs(20.0, incarnation={0: 0, 1: 1, 2: 0}))
    assert tr.record["outcome"] == "never struck"
    assert "not given again" in tr.record["note"]


def test_not_detected_names_its_deadline():
    tr = track()
    tr.update(obs(26.0, strikes=[STRIKE]))
    assert tr.deadline_s == 86.0  # 60 s after the strike was seen (26 s)
    tr.update(obs(86.0, strikes=[STRIKE]))
    assert tr.record["outcome"] == "not detected" and "within 60s" in tr.record["note"]


def test_dry_run_hold_ends_the_story_at_detection():
    tr = track()
    hold = dict(EVICT, decision="hold", reason="dry_run")
    tr.update(obs(30.0, strikes=[STRIKE], findings=[FINDING], evictions=[hold]))
    assert tr.done and tr.record["outcome"] == "detected, not evicted (dry run)"
    assert tr.record["evicted_at_s"] is None and tr.record["rejoined_at_s"] is None, tr.record


def test_a_hold_that_does_not_lift_is_named_at_the_deadline():
    tr = track()
    hold = dict(EVICT, decision="hold", reason="min_replicas")
    tr.update(obs(30.0, strikes=[STRIKE], findings=[FINDING], evictions=[hold]))
    assert tr.stage == "eviction"
    tr.update(obs(60.0, strikes=[STRIKE], findings=[FINDING], evictions=[hold]))
    assert tr.record["outcome"] == "detected, not evicted (held: min_replicas)"


def test_an_eviction_for_another_finding_is_not_this_one():
    tr = track()
    other = dict(EVICT, finding_id=99)
    tr.update(obs(30.0, strikes=[STRIKE], findings=[FINDING], evictions=[other]))
    assert tr.stage == "eviction" and tr.record["evicted_at_s"] is None


def test_a_crash_is_caught_as_dead_once_the_process_is_gone():
    crash = "crash:at_step=20,rank=1"
    tr = track(spec=crash, kind="crash")
    dead = dict(FINDING, kind="dead", confirmed_at=T0 + 27.0)
    # alive: a dead finding does not count yet (an eviction's own aftermath looks the same)
    tr.update(obs(26.0, findings=[dead]))
    assert tr.stage == "strike"
    tr.update(obs(28.0, findings=[dead], alive={0: True, 1: False, 2: True}))
    assert tr.record["detected_kind"] == "dead" and tr.record["struck_at_s"] is None
    assert "never reported the strike" in tr.record["note"]
    assert tr.stage == "eviction"
    tr.update(obs(31.0, findings=[dead], incarnation={0: 0, 1: 1, 2: 0},
                  restarts=[(1, 30.0)]))
    assert tr.stage == "rejoin"  # restarted without an eviction


def test_a_host_offline_under_dry_run_is_caught_as_dead_while_its_processes_live():
    """--dry-run: nothing kills the group on the host gone dark; the monitor's dead finding
    names it, and its dry run shows in the survivors' abort it did not send."""
    spec = "host_offline:at_step=20"
    tr = track(spec=spec, kind="host_offline", group_rank=None)
    strike = Strike(1, 0, 0, 2, "node-1", spec, T0 + 25.0)
    abort = {"id": 4, "replica_group": 1, "decision": "abort", "reason": "peer_gone",
             "status": "dry_run", "at": T0 + 26.0, "finding_id": None}
    dead = dict(FINDING, kind="dead", confirmed_at=T0 + 28.0,
                evidence={"culprit_ranks": [2, 3], "culprit_hosts": ["node-1"]})
    tr.update(obs(29.0, strikes=[strike], findings=[dead], evictions=[abort]))
    assert tr.done and tr.record["outcome"] == "detected, not evicted (dry run)", tr.record
    assert tr.record["detected_kind"] == "dead" and tr.record["culprit_hosts"] == ["node-1"]


def test_a_crash_under_dry_run_follows_its_restart_not_the_dry_run():
    """--dry-run: the dead finding on a crashed rank comes before its restart is seen, with a
    dry-run abort for the survivors: the story went on to the restart (torchft's own recovery,
    as without --dry-run), not "detected, not evicted (dry run)"."""
    tr = track(spec="crash:at_step=20,rank=1", kind="crash")
    dead = dict(FINDING, kind="dead", confirmed_at=T0 + 27.0)
    abort = {"id": 4, "replica_group": 1, "decision": "abort", "reason": "peer_gone",
             "status": "dry_run", "at": T0 + 27.5, "finding_id": None}
    tr.update(obs(28.0, findings=[dead], alive={0: True, 1: False, 2: True}))
    assert tr.stage == "eviction"
    tr.update(obs(31.0, findings=[dead], evictions=[abort], incarnation={0: 0, 1: 1, 2: 0},
                  restarts=[(1, 30.0)]))
    assert tr.stage == "rejoin", tr.record


def test_a_crash_struck_time_is_the_rank_s_own_record_else_said_to_be_the_exit():
    """A crashed rank exits right after it strikes, usually before a poll sees the strike:
    ``struck_at_s`` is then the supervisor's restart (the exit as it saw it, up to a tick
    late), and the report says so; a strike the rank did report is kept as it said."""
    crash = "crash:at_step=20,rank=1"
    gone = dict(incarnation={0: 0, 1: 1, 2: 0}, restarts=[(1, 30.0)])
    tr = track(spec=crash, kind="crash")
    tr.update(obs(31.0, **gone))
    assert tr.stage == "rejoin" and tr.record["struck_at_s"] == 30.0
    assert "exit" in tr.record["note"] and "never reported" in tr.record["note"]
    reported = track(spec=crash, kind="crash")
    reported.update(obs(25.5, strikes=[Strike(1, 0, 1, 3, "node-a", crash, T0 + 25.0)]))
    reported.update(obs(31.0, **gone))
    assert reported.stage == "rejoin" and reported.record["struck_at_s"] == 25.0
    assert "never reported" not in reported.record["note"]


def test_describe_says_where_the_story_stands():
    tr = track()
    assert tr.describe() == f"{SPEC} in group 1 rank 1: waiting for strike (until 60s)"
    tr.update(obs(60.0))
    assert tr.describe() == f"{SPEC} in group 1 rank 1: never struck"


def test_stop_says_where_the_story_stood():
    tr = track()
    tr.update(obs(26.0, strikes=[STRIKE]))
    tr.stop(30.0)
    assert tr.done and tr.record["outcome"] == "pending"
    assert "while waiting for detection" in tr.record["note"]


def test_without_a_kill_the_survivors_are_timed_from_a_quorum_that_left_the_group_out():
    """A crash (or a host gone): no eviction, so the survivors' first commit was looked for
    after the group's restart, seconds after they had gone on without it."""
    crash = "crash:at_step=20,rank=1"
    tr = track(spec=crash, kind="crash")
    dead = dict(FINDING, kind="dead", confirmed_at=T0 + 27.0)
    strike = Strike(1, 0, 1, 3, "node-a", crash, T0 + 25.0)
    samples = []
    for g in (0, 2):
        samples += [
            {"t": 24.5, "replica_group": g, "rank": 2 * g, "step": 30, "last_step_at_s": 24.4,
             "num_participants": 3},
            # a step in flight at the crash commits with the old quorum: not yet going on
            {"t": 25.5, "replica_group": g, "rank": 2 * g, "step": 31, "last_step_at_s": 25.2,
             "num_participants": 3},
            {"t": 26.5, "replica_group": g, "rank": 2 * g, "step": 32, "last_step_at_s": 26.3,
             "num_participants": 2}]
    tr.update(obs(26.0, strikes=[strike], samples=samples[:2]))
    tr.update(obs(28.0, strikes=[strike], findings=[dead], samples=samples,
                  alive={0: True, 1: False, 2: True}))
    tr.update(obs(31.0, strikes=[strike], findings=[dead], samples=samples,
                  incarnation={0: 0, 1: 1, 2: 0}, restarts=[(1, 30.0)]))
    assert tr.stage == "rejoin"
    assert tr.record["survivors_committing_at_s"] == 26.3  # not after the restart at 30 s


# --- faults measured alone: what another fault made is not this one's -----------------------
def back_in_quorum(started_s: float) -> dict[int, list[dict]]:
    """Group 1 restarted at ``started_s`` and back in a quorum of all 3 groups."""
    return {0: [rank_state(0, 0, 40, T0), rank_state(0, 1, 40, T0)],
            1: [rank_state(1, 0, 39, T0 + started_s), rank_state(1, 1, 39, T0 + started_s)],
            2: [rank_state(2, 0, 40, T0), rank_state(2, 1, 40, T0)]}


def survivors_commit(gone_s: float) -> list[dict]:
    """Groups 0 and 2 at step 30 until ``gone_s``, step 31 committed 2 s after."""
    return [s for g in (0, 2) for s in (
        {"t": gone_s - 0.5, "replica_group": g, "rank": 2 * g, "step": 30,
         "last_step_at_s": gone_s - 0.6},
        {"t": gone_s + 2.5, "replica_group": g, "rank": 2 * g, "step": 31,
         "last_step_at_s": gone_s + 2.0})]


def test_a_restart_after_the_strike_but_before_the_finding_is_the_groups_restart():
    """The group's process went (a drain, its own exit) and the supervisor restarted it before
    the monitor confirmed ``dead``: that restart, not only one after the finding, is the one
    its rejoin is timed from; the story no longer waits out its rejoin deadline."""
    tr = track()
    dead = dict(FINDING, kind="dead", confirmed_at=T0 + 30.0)
    tr.update(obs(26.0, strikes=[STRIKE]))
    later = dict(strikes=[STRIKE], findings=[dead], incarnation={0: 0, 1: 1, 2: 0},
                 restarts=[(1, 29.5)], samples=survivors_commit(29.5))
    tr.update(obs(31.0, **later))
    assert tr.record["detected_kind"] == "dead" and tr.stage == "rejoin"
    tr.update(obs(40.0, states=back_in_quorum(31.0), **later))
    assert tr.done and tr.record["outcome"] == "recovered", tr.record
    assert (tr.record["restarted_at_s"], tr.record["rejoined_at_s"]) == (29.5, 40.0)


def test_the_dead_finding_of_a_drain_for_an_earlier_faults_quarantine_is_not_this_faults():
    """Seed 11: node-4 quarantined (an earlier fault's, held by the cap until then) at 68.2 s,
    a slow link struck its group at 71.0 s, the supervisor drained the group off node-4 at
    73.6 s and the monitor found it ``dead`` at 74.2 s. That finding is the drain's: the slow
    link was never found, nor its host named; the story ends as not measured."""
    spec = "slow_link:mbit=20,from_step=274"
    tr = track(spec=spec, kind="slow_link", group_rank=None, given="live", armed_at_s=69.9,
               trigger_step=274, step_at_arming=270)
    strike = Strike(1, 0, 0, 2, "node-4", spec, T0 + 71.0)
    dead = dict(FINDING, kind="dead", confirmed_at=T0 + 74.2,
                evidence={"culprit_ranks": [2, 3], "culprit_hosts": ["node-4"]})
    tr.update(obs(71.5, strikes=[strike], quarantines={"node-4": 68.2}))
    drained = dict(strikes=[strike], findings=[dead], incarnation={0: 0, 1: 1, 2: 0},
                   restarts=[(1, 73.6)], drains=[(1, 73.6)], quarantines={"node-4": 68.2})
    tr.update(obs(74.5, **drained))
    assert tr.stage == "detection" and tr.record["detected_at_s"] is None
    tr.update(obs(75.6, **drained))
    r = tr.record
    assert tr.done and r["outcome"] == "not measured", r
    assert "drained at 73.6s" in r["note"]
    assert r["detected_kind"] is None and r["culprit_hosts"] is None
    tr.note_hosts(obs(76.0, **drained))
    assert r["host_quarantined_at_s"] is None  # quarantined before the strike: not its own


def test_a_quarantined_host_finding_is_not_the_faults():
    tr = track()
    back = dict(FINDING, kind="quarantined_host", confirmed_at=T0 + 27.0)
    tr.update(obs(30.0, strikes=[STRIKE], findings=[back]))
    assert tr.stage == "detection" and tr.record["detected_kind"] is None


PART = "partition:at_step=423"


def partition_evicted() -> tuple[FaultTrack, dict]:
    """Seed 5's fault 8: a partition of node-0, found (network) and group 1 evicted at 123.5 s,
    restarted at 123.9 s on node-0 (its quarantine held by the cap)."""
    tr = track(spec=PART, kind="partition", group_rank=None, given="live", armed_at_s=117.3,
               trigger_step=423, step_at_arming=420)
    strike = Strike(1, 0, 0, 2, "node-0", PART, T0 + 119.5)
    found = dict(FINDING, id=13, kind="network", confirmed_at=T0 + 123.1,
                 evidence={"culprit_ranks": [2, 3], "culprit_hosts": ["node-0"]})
    evict = dict(EVICT, finding_id=13, reason="network", at=T0 + 123.5)
    seen = dict(strikes=[strike], findings=[found], evictions=[evict],
                samples=survivors_commit(123.5), quarantines={},
                placements=[{"replica_group": 1, "at_s": 10.0, "node": "node-0"},
                            {"replica_group": 1, "at_s": 123.9, "node": "node-0"}])
    tr.update(obs(124.0, **seen))
    assert tr.stage == "rejoin" and tr.record["evicted_at_s"] == 123.5
    return tr, seen


def test_a_network_faults_group_back_on_its_own_host_is_not_told_recovered():
    """Back in a quorum on the host its fault is still on: it rejoined, the fault did not go."""
    tr, seen = partition_evicted()
    events = tr.update(obs(130.0, states=back_in_quorum(124.0), incarnation={0: 0, 1: 1, 2: 0},
                           restarts=[(1, 123.9)], **seen))
    r = tr.record
    assert tr.done and r["outcome"] == "rejoined on its faulty host", r
    assert events[-1] == ("outcome", f"fault 1: rejoined on its faulty host ({r['note']})")
    assert "on node-0" in r["note"] and "partition still was" in r["note"]


def test_a_network_faults_group_moved_off_its_host_after_a_restart_there_says_so():
    """Seed 5: restarted on the partitioned node-0, drained once node-0 was quarantined at
    129.1 s, back from node-4 at 145.5 s: recovered, after 22 s on its faulty host."""
    tr, seen = partition_evicted()
    seen["placements"] = seen["placements"] + [{"replica_group": 1, "at_s": 134.4,
                                                "node": "node-4"}]
    tr.update(obs(145.5, states=back_in_quorum(135.0), incarnation={0: 0, 1: 2, 2: 0},
                  restarts=[(1, 123.9), (1, 134.4)], drains=[(1, 134.4)], **seen))
    r = tr.record
    assert tr.done and r["outcome"] == "recovered after a restart on its faulty host", r
    assert "on node-0" in r["note"] and "on node-4 since 134.4s" in r["note"]


SLOW = "slow:delay=0.6,from_step=276"


def straggler_story() -> FaultTrack:
    """Seed 5's fault 5: a straggler on node-0 struck at 77.9 s, found (finding 9) and evicted
    at 81.0 s, back at 82.9 s: over then. Its host was not quarantined."""
    tr = track(spec=SLOW, kind="slow", group_rank=None, given="live", armed_at_s=77.9,
               trigger_step=276, step_at_arming=276)
    strike = Strike(1, 0, 0, 2, "node-0", SLOW, T0 + 77.9)
    found = dict(FINDING, id=9, confirmed_at=T0 + 81.0,
                 evidence={"culprit_ranks": [2, 3], "culprit_hosts": ["node-0"]})
    evict = dict(EVICT, finding_id=9, at=T0 + 81.0)
    seen = dict(strikes=[strike], findings=[found], evictions=[evict],
                samples=survivors_commit(81.0))
    tr.update(obs(78.5, **seen))
    tr.update(obs(81.5, **seen))
    tr.update(obs(82.9, states=back_in_quorum(82.0), incarnation={0: 0, 1: 1, 2: 0},
                  restarts=[(1, 81.9)], **seen))
    assert tr.done and tr.record["outcome"] == "recovered"
    return tr


def test_a_later_quarantine_of_the_host_for_another_fault_is_not_this_ones():
    """Seed 5: node-0 quarantined at 129.1 s for a partition (finding 13), 46 s after this
    straggler's story ended: neither the ledger's finding nor the time is this story's."""
    tr = straggler_story()
    tr.note_hosts(obs(130.0, quarantines={"node-0": 129.06}))  # the ledger named no finding
    assert tr.record["host_quarantined_at_s"] is None
    tr.note_hosts(obs(130.0, quarantines={"node-0": 129.06},
                      quarantine_findings={"node-0": 13}))
    assert tr.record["host_quarantined_at_s"] is None


def test_a_quarantine_a_rail_held_past_the_story_is_still_its_own():
    tr = straggler_story()
    tr.note_hosts(obs(130.0, quarantines={"node-0": 129.06}, quarantine_findings={"node-0": 9}))
    assert tr.record["host_quarantined_at_s"] == 129.06
