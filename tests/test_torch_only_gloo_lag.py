"""Ranks on torch's debug server only, read through gloo's Flight Recorder, which marks a step's
last collective completed only once the rank enqueues its next one: a rank is not blocked in a
collective another member of its group completed or enqueued past
(monitor.evidence.torch_rank.peers_past), so neither a rank hung outside the collectives nor
one in its quorum call reads as blocked in its last all_reduce. Real dumps of a torchft job
(tests/fixtures/torch-only-gloo-lag), swept as the monitor does; the detectors are real.
"""

from __future__ import annotations

import copy
import json
import sqlite3
from pathlib import Path

import pytest

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from monitor.evidence.lighthouse_status import LighthouseStatus, QuorumMember
from monitor.evidence.torch_rank import StepPace, TorchRanks, blocked_in
from monitor.evidence.verification import Verifier
from monitor.evidence.view import ViewBuilder
from monitor.poll.discovery import Target
from monitor.poll.poller import RankPoll
from monitor.poll.torch_server import RAW_KEY, TorchAnswer, TorchIdentity
from monitor.store import Store
from tests.test_torch_server import entry

FIX = Path(__file__).parent / "fixtures" / "torch-only-gloo-lag"


def _dumps(kind: str) -> dict[tuple[int, int], dict]:
    """(replica group, group rank) -> the dump torch served."""
    return {(int(p.stem[1]), int(p.stem[3])): json.loads(p.read_text())
            for p in sorted((FIX / kind).glob("g*r*.json"))}


def _rid(g: int) -> str:
    return f"replica_group_{g}:u{g}"


def _status(quorum_id: int, step: int, groups, world_size: int, at: float,
            silent: dict[int, float] | None = None) -> LighthouseStatus:
    return LighthouseStatus(quorum_id, {_rid(g): QuorumMember(_rid(g), step, f"s{g}:1",
                                                              world_size) for g in groups},
                            {_rid(g): (silent or {}).get(g, 0.1) for g in groups}, at=at)


class Job:
    """Torch-only ranks answering ``dumps`` every sweep, as the monitor reads them."""

    def __init__(self, dumps: dict[tuple[int, int], dict], world_size: int) -> None:
        self.dumps = dumps
        self.url = {k: f"torch+http://g{k[0]}r{k[1]}:1" for k in dumps}
        self.who = {self.url[(g, r)]: TorchIdentity(_rid(g), g, r, world_size, f"s{g}:1")
                    for g, r in dumps}
        self.targets = [Target(u, "torch_store") for u in self.who]
        self.torch, self.views, self.verifier = TorchRanks("j"), ViewBuilder(), Verifier()
        self.detectors = Detectors(DetectorConfig(hang_floor_s=1.0))
        self.states: dict[tuple[int, int], dict] = {}

    def watched(self, t0: float, step: int, groups, world_size: int) -> None:
        """The monitor saw every group step twice before ``t0``, to ``step`` (0.4-s steps): none
        is held as on its first step."""
        for i, s in enumerate(range(step - 2, step + 1)):
            at = t0 - (3 - i) * 0.4
            self.torch.adapt({}, self.who, _status(3, s, groups, world_size, at), at)

    def sweep(self, now: float, lighthouse: LighthouseStatus) -> list:
        polls = {self.url[k]: RankPoll(self.url[k], True, {RAW_KEY: TorchAnswer(
            ("fr_trace_json", "dump_traceback"), copy.deepcopy(d))}, at=now)
            for k, d in self.dumps.items()}
        self.torch.adapt(polls, self.who, lighthouse, now)
        self.states = {k: polls[u].data for k, u in self.url.items()}
        view = self.views.update(self.targets, polls, now=now, judge=lambda ranks, changed: (
            self.verifier.judge(ranks, changed, lighthouse, None, True, now)))
        dumps = {self.who[u].rank: d for u, d in self.torch.dumps.items()}
        new = self.detectors.update(view.evidence(), dumps, now, full_view=view,
                                    lighthouse=lighthouse)
        assert self.detectors.last_error is None
        return new


def _wait(state: dict) -> tuple:
    w = state["timing"]["waiting"]
    return (state["phase"], w and w["scope"])


def test_a_rank_hung_outside_the_collectives_is_not_read_as_blocked_and_is_found():
    """Group 1's rank 1 sleeps before its step's all_reduce (seq 179); its recorder still says
    178 is not completed, but its peers enqueued 179 and 180: it is blocked in nothing, so the
    hang names it (read as blocked in 178, it was ruled out as the culprit: a job-wide stall)."""
    dumps = _dumps("hang")
    t0 = max(e["time_created_ns"] for d in dumps.values() for e in d["entries"]) / 1e9
    job, groups = Job(dumps, 2), (0, 1, 2)
    job.watched(t0, 60, groups, 2)
    found = []
    for i in range(8):
        found += job.sweep(t0 + 0.5 + i, _status(3, 60, groups, 2, t0 + i))
        if i == 0:
            assert _wait(job.states[(1, 1)]) == ("unknown", None)
            # its peers wait in 179 for it; group rank 0 finished 180, marked 179 on every rank:
            # nothing tells that from a wait, and nobody is past it
            assert {k: _wait(s) for k, s in job.states.items() if k != (1, 1)} == \
                dict.fromkeys([(0, 0), (0, 1), (1, 0), (2, 0), (2, 1)], ("allreduce", "cross"))
    hangs = [f for f in found if f.kind == "hang"]
    assert [(f.replica_group, f.ranks) for f in hangs] == [(1, [3])], found
    assert hangs[0].evidence["waiting_ranks"] == [1, 5]
    assert not [f for f in found if f.kind == "job_stall"]


def test_groups_waiting_for_their_quorum_after_a_crash_are_not_hung():
    """Group 2 crashed; groups 0, 1 and 3 asked for the next quorum and wait for the Lighthouse
    to time group 2 out. Groups 0 and 1 mark their last all_reduce (182) completed, group 3 does
    not: it completed for all of them, so no group reads as blocked and none as "never asked
    for the quorum" (group 0 was evicted so, and group 1 held only by --min-replicas)."""
    dumps = _dumps("crash")
    t0 = max(e["time_created_ns"] for d in dumps.values() for e in d["entries"]) / 1e9
    job = Job(dumps, 1)
    found = []
    for i in range(10):
        found += job.sweep(t0 + 0.3 + i, _status(6, 167, (0, 1, 2, 3), 1, t0 + i,
                                                  silent={2: 0.3 + i}))
        assert {k: _wait(s) for k, s in job.states.items()} == \
            dict.fromkeys([(0, 0), (1, 0), (3, 0)], ("unknown", None))
    assert not [f for f in found if f.kind == "hang"], found


@pytest.mark.parametrize("completed", ["0", "-1"])
def test_a_peer_not_yet_in_the_new_incarnation_clears_nothing(completed):
    """Group 1's rank 0 reconfigured into a new incarnation (a new pg, 5 s after the old one's
    last entry) and waits in its seq 1; its peers' newest entries are still of the old one, whose
    sequence ids (180) say nothing of the new one's: it stays blocked. gloo says a new group's
    last completed is -1 (its first sequence id is 1): read as blocked in its first all_reduce
    (it was read as blocked in nothing, so a hang in a new incarnation's first step went
    unfound)."""
    dumps = _dumps("hang")
    d = dumps[(1, 0)]
    last = max(e["time_created_ns"] for e in d["entries"])
    d["entries"].append({**d["entries"][-1], "pg_id": 2, "collective_seq_id": 1, "op_id": 1,
                         "record_id": 999, "time_created_ns": last + 5_000_000_000})
    d["pg_status"]["2"] = {"last_completed_collective": completed, "last_enqueued_collective": "1",
                           "last_started_collective": "-1"}
    job = Job(dumps, 2)
    job.sweep(last / 1e9 + 7, _status(3, 60, (0, 1, 2), 2, last / 1e9))
    assert _wait(job.states[(1, 0)]) == ("allreduce", "cross")
    assert job.states[(1, 0)]["timing"]["waiting"]["seconds"] == 2.0


def test_the_hang_threshold_of_torch_only_ranks_follows_their_steps_on_the_lighthouse():
    """Torch-only ranks serve no step times, so their hang threshold was --hang-floor alone:
    a group late by 3 s in a job of multi-second steps (a GC pause, an eval inside the step)
    was evicted as hung where Lightkeeper's ranks are judged against --hang-factor steps. Their
    step time is read from the Lighthouse's step counter over the sweeps: the same late group
    (the dumps of a rank outside the collectives while its peers wait) is not hung 4.5 s in
    when the steps took 2 s, and is when they took 0.4 s."""
    dumps = _dumps("hang")
    t0 = max(e["time_created_ns"] for d in dumps.values() for e in d["entries"]) / 1e9

    def late(step_s: float) -> list:
        job, groups = Job(dumps, 2), (0, 1, 2)
        job.detectors = Detectors(DetectorConfig())  # --hang-floor 3 s, --hang-factor 3
        # the sweeps before: every group stepping, one step each step_s on the Lighthouse
        for i in range(8):
            job.torch.adapt({}, job.who, _status(3, 52 + i, groups, 2, t0), t0 - (8 - i) * step_s)
        found = []
        for i in range(9):
            found += job.sweep(t0 + 0.5 + 0.5 * i, _status(3, 60, groups, 2, t0 + 0.5 * i))
        assert {s["torch_only"]["step_s"] for s in job.states.values()} == {step_s}
        return [(f.kind, f.replica_group) for f in found if f.kind == "hang"]

    assert late(2.0) == []
    assert late(0.4) == [("hang", 1)]


def test_a_group_that_joined_under_the_monitors_eyes_is_held_as_on_its_first_step():
    """A restarted torch-only group's first step compiles (minutes) while the others wait for it
    in the cross-group all_reduce; judged at the hang threshold it was evicted as hung, and its
    replacement too. Held as Lightkeeper's ranks are (no step timed past the heal): the same late
    group (the hang dumps, 0.4-s steps) is not hung while it has not stepped since it joined
    under the monitor's eyes, and is once it stepped twice; one only left out of a quorum for
    a while is no new incarnation, nor one whose dumps show it trained before (back from a
    quorum it was left out of when the monitor started)."""
    dumps = _dumps("hang")
    t0 = max(e["time_created_ns"] for d in dumps.values() for e in d["entries"]) / 1e9
    fresh = {**dumps, **{k: d for k, d in _first_step(dumps).items() if k[0] == 1}}

    def late(joined_at: int, gap: tuple = (0, 1, 2), before: tuple = (0, 2),
             dumps: dict = fresh) -> list:
        job = Job(dumps, 2)
        job.detectors = Detectors(DetectorConfig())  # --starting-timeout 300 s
        for i in range(8):  # groups 0 and 2 step each 0.4 s; group 1 joins at sweep joined_at
            groups = ((0, 1, 2) if i != 7 else gap) if i >= joined_at else before
            job.torch.adapt({}, job.who, _status(3, 52 + i, groups, 2, t0), t0 - (8 - i) * 0.4)
        found = []
        for i in range(9):
            found += job.sweep(t0 + 0.5 + 0.5 * i, _status(3, 60, (0, 1, 2), 2, t0 + 0.5 * i))
        timed = {s["torch_only"]["timed"] for k, s in job.states.items() if k[0] == 1}
        return timed, [(f.kind, f.replica_group) for f in found if f.kind == "hang"]

    assert late(joined_at=7) == ({False}, [])
    # what its dumps hold tells nothing: a first step's bucket all-reduces complete too
    assert late(joined_at=7, dumps=dumps) == ({False}, [])
    assert late(joined_at=4)[0] == {True}  # it stepped twice since it joined
    assert late(joined_at=4, dumps=dumps) == ({True}, [("hang", 1)])
    # the same incarnation back after one quorum formed without it (it asked late), or after a
    # restarted Lighthouse listed no member: no new incarnation, nothing held
    assert late(joined_at=0, gap=(0, 2), dumps=dumps) == ({True}, [("hang", 1)])
    assert late(joined_at=0, gap=(), dumps=dumps) == ({True}, [("hang", 1)])
    # a job that started (or resumed at its checkpoint's step) under the monitor, first seen
    # steps in: held alike until it steps twice
    assert late(joined_at=7, before=(), dumps=dumps) == ({False}, [])
    assert late(joined_at=4, before=(), dumps=dumps) == ({True}, [("hang", 1)])


def test_a_group_back_in_a_quorum_takes_no_step_time_from_its_heal():
    """Group 1, left out of one quorum (it asked late), heals back to the job's step 36 steps
    on: that jump is no step, its step time stays its own 0.4 s (the jump as a sample made it
    0.21 s, and its hang threshold with it)."""
    dumps = _dumps("hang")
    t0 = max(e["time_created_ns"] for d in dumps.values() for e in d["entries"]) / 1e9
    job = Job(dumps, 2)
    for i, (step, groups) in enumerate([(52, (0, 1, 2)), (53, (0, 1, 2)), (54, (0, 1, 2)),
                                        (55, (0, 2)), (90, (0, 1, 2))]):
        job.torch.adapt({}, job.who, _status(3, step, groups, 2, t0), t0 - 2.0 + 0.4 * i)
    job.sweep(t0 + 0.5, _status(3, 90, (0, 1, 2), 2, t0))
    assert {s["torch_only"]["step_s"] for k, s in job.states.items() if k[0] == 1} == {0.4}


def test_a_first_move_of_the_lighthouses_step_is_no_step_time():
    """A restarted group's step jumps from 0 to the others' at its heal, and a monitor started
    mid-step first sees a part of one: read as steps, they made a 5-s step's threshold ~0.1 s
    (the floor) or half. The time is taken between the first sweeps that saw two moves."""
    pace = StepPace()
    for now, step in ((0.0, 0), (1.0, 0), (1.5, 40), (6.5, 41), (11.5, 42)):  # a heal, 5-s steps
        pace.see(step, now)
    assert pace.seconds() == 5.0
    pace = StepPace()
    for now, step in ((0.0, 7), (0.5, 8), (5.5, 9)):  # first seen 4.5 s into step 7
        pace.see(step, now)
    assert pace.seconds() == 5.0
    pace = StepPace()
    for now, step in ((0.0, 7), (0.5, 8)):
        pace.see(step, now)
    assert pace.seconds() is None  # none before its second move


def _hang_found(dumps: dict) -> tuple:
    t0 = max(e["time_created_ns"] for d in dumps.values() for e in d["entries"]) / 1e9
    job, found = Job(dumps, 2), []
    job.watched(t0, 60, (0, 1, 2), 2)
    for i in range(8):
        found += job.sweep(t0 + 0.5 + 0.5 * i, _status(3, 60, (0, 1, 2), 2, t0 + 0.5 * i))
    return _wait(job.states[(1, 1)]), [(f.kind, f.replica_group, f.ranks) for f in found
                                       if f.kind == "hang"]


def test_a_rank_hung_in_the_second_step_of_an_incarnation_is_found():
    """An incarnation's rank that hung in its second step enqueued its first step's collectives
    before a peer's first: judged against the newest first entry of all members, it was taken
    for an older incarnation and read alone (blocked, by gloo's lag): no hang. A rank is judged
    by the members with an entry since its own first. The real dumps, cut to seq 177 on and
    renumbered from 1, as if the group had been rebuilt at that step."""
    dumps = _dumps("hang")
    for d in dumps.values():
        d["entries"] = [dict(e, collective_seq_id=e["collective_seq_id"] - 176)
                        for e in d["entries"] if e["collective_seq_id"] >= 177]
        pg = str(d["entries"][0]["pg_id"])
        d["pg_status"][pg] = {k: str(int(v) - 176) if k != "last_started_collective" else v
                              for k, v in d["pg_status"][pg].items()}
    assert _hang_found(dumps) == (("unknown", None), [("hang", 1, [3])])


def test_peers_whose_recorder_wrapped_still_clear_the_hung_rank():
    """The waiting peers' recorders keep only their newest entries (a ring that wrapped:
    TORCH_FR_BUFFER_SIZE counts every group's entries): their oldest was newer than the hung
    rank's newest, and it was read alone again."""
    for keep in (3, 2):
        dumps = _dumps("hang")
        for k in ((0, 1), (2, 1)):
            dumps[k]["entries"] = dumps[k]["entries"][-keep:]
        assert _hang_found(dumps) == (("unknown", None), [("hang", 1, [3])]), keep


def _first_step(dumps: dict[tuple[int, int], dict]) -> dict[tuple[int, int], dict]:
    """The hang dumps as a fresh process's first step: one torchft process group, its first
    all_reduce (seq 1) enqueued by every rank but group 1's rank 1 (compiling), none completed
    (gloo: -1)."""
    out = {}
    for k, d in dumps.items():
        last = d["entries"][-1]
        first = [] if k == (1, 1) else [dict(last, collective_seq_id=1, op_id=1, record_id=0)]
        out[k] = dict(d, entries=first, pg_status={str(last["pg_id"]): {
            "last_completed_collective": "-1", "last_enqueued_collective": str(len(first)),
            "last_started_collective": "-1"}})
    return out


def _late_in_first_sight(dumps: dict, reads_before: list, step: int,
                         torch: TorchRanks | None = None) -> tuple:
    """Group 1 late (its rank 1 outside the collectives, the others waiting) for 4.5 s after
    ``reads_before`` (the Lighthouse as the monitor read it before: callables of the time), every
    group at ``step``: (group 1's ``timed``, the hangs named at the defaults: 3 s, 300 s).
    ``torch``: the monitor's TorchRanks (one restarted on a --state)."""
    t0 = max(e["time_created_ns"] for d in _dumps("hang").values() for e in d["entries"]) / 1e9
    job = Job(dumps, 2)
    job.detectors = Detectors(DetectorConfig())
    job.torch = torch or job.torch
    for i, read in enumerate(reads_before):
        at = t0 - (len(reads_before) - i) * 0.4
        job.torch.adapt({}, job.who, read(at), at)
    found = []
    for i in range(9):
        found += job.sweep(t0 + 0.5 + 0.5 * i, _status(3, step, (0, 1, 2), 2, t0 + 0.5 * i))
    return ({s["torch_only"]["timed"] for k, s in job.states.items() if k[0] == 1},
            [(f.kind, f.replica_group) for f in found if f.kind == "hang"])


def test_a_group_first_seen_is_held_until_it_steps_twice_whatever_its_dumps():
    """Where no member was seen before (a job resumed at its checkpoint's step 1000 under a
    monitor started before it, a whole job relaunched under a running one) or on the monitor's
    first read, a group's Lighthouse step says nothing of whether it trained, and neither do its
    dumps (a first step's bucket all-reduces complete before it ends): a first step that
    compiles was named hung at 3 s and evicted. Held as joining at the job's step, whatever its
    dumps hold, until it steps twice past it."""
    empty = [lambda at: LighthouseStatus(None, {}, {}, at=at)] * 8
    old = [lambda at, s=s: LighthouseStatus(7, {f"replica_group_{g}:old": QuorumMember(
        f"replica_group_{g}:old", s, f"s{g}:1", 2) for g in (0, 1, 2)}, {}, at=at)
        for s in range(1040, 1048)]  # the job's last run, other replica ids
    first, trained = _first_step(_dumps("hang")), _dumps("hang")
    for before in (empty, old, []):
        for dumps in (first, trained):
            assert _late_in_first_sight(dumps, before, 1000) == ({False}, []), before
    # seen stepping twice (1000, 1001, 1002): no longer held, its hang named
    stepping = [lambda at, s=s: _status(3, s, (0, 1, 2), 2, at) for s in (1000, 1001)]
    for before in (empty + stepping, stepping):
        assert _late_in_first_sight(trained, before, 1002) == ({True}, [("hang", 1)])


def test_a_restarted_monitor_keeps_the_groups_it_timed_and_holds_new_ones(tmp_path, caplog):
    """A monitor restarted on its --state reads the groups the run before timed (their replica
    ids: one incarnation each) as timed, with their step times: a group already hung at its
    first read is named at the defaults, as under the monitor that saw it step. A replica id the
    run before never timed (a replacement) is held as on its first step; an unreadable row holds
    every group again, said once."""
    state = str(tmp_path / "monitor.sqlite")
    seen = Job(_dumps("hang"), 2)
    seen.watched(0.0, 1000, (0, 1, 2), 2)
    first = Store(state)
    seen.torch.save_paces(10.0, lambda paces: first.save_torch_paces("j", paces))
    first.close()
    timed = Store(state).torch_paces("j")
    assert sorted(timed) == [_rid(g) for g in (0, 1, 2)]
    assert all(t == [pytest.approx(0.4)] for t in timed.values()), timed
    assert _late_in_first_sight(_dumps("hang"), [], 1000, TorchRanks("j", timed=timed)) == \
        ({True}, [("hang", 1)])
    # the run before timed other incarnations: these are held
    other = {rid.replace(":u", ":other"): t for rid, t in timed.items()}
    assert _late_in_first_sight(_dumps("hang"), [], 1000, TorchRanks("j", timed=other)) == \
        ({False}, [])
    # another job's groups are not this one's
    assert Store(state).torch_paces("another") == {}
    bad = Store(state)
    bad.save_torch_paces("j", {_rid(1): ["0.4"]})  # type: ignore[list-item]
    with caplog.at_level("WARNING"):
        assert bad.torch_paces("j") == {}
    assert "held again until it steps twice" in caplog.text
    bad.close()
    with sqlite3.connect(state) as db:  # a hand-edited row, nested past Python's recursion
        db.execute("UPDATE torch_paces SET data=? WHERE job='j'", ("[" * 100000 + "]" * 100000,))
    assert Store(state).torch_paces("j") == {}


def _gloo_dump(seqs: range, done: int, enqueued: int, lib: str = "gloo") -> dict:
    entries = [dict(entry(s, 0, s, "0", created_s=100 + s), profiling_name=f"{lib}:all_reduce")
               for s in seqs]
    return {"entries": entries, "pg_status": {"0": {
        "last_completed_collective": str(done), "last_enqueued_collective": str(enqueued)}}}


def test_gloo_counts_of_send_recv_read_as_the_entries_sequence_ids():
    """As a real gloo group shows them (two processes: 3 all_reduce, 5 send/recv, more
    all_reduce): its pg_status counts the send/recv at the next collective, and records no entry
    of them. Past a heal over PGTransport a rank blocked in its newest all_reduce read as
    blocked in nothing; it is blocked in it. NCCL's counts are its collectives' alone."""
    now = 200.0
    # the sender blocked in all_reduce 5 (counted 11), all_reduce 4 completed (counted 10)
    assert blocked_in(_gloo_dump(range(1, 6), 10, 11), now)[2]["collective_seq_id"] == 5
    # all of them completed: nothing
    assert blocked_in(_gloo_dump(range(1, 6), 11, 11), now) is None
    # gloo marks one completed when it enqueues the next: its peer's 3 (before the send/recv)
    # completed, 4 (counted 10) not yet: as without the send/recv, blocked in 4
    assert blocked_in(_gloo_dump(range(1, 5), 3, 10), now)[2]["collective_seq_id"] == 4
    assert blocked_in(_gloo_dump(range(1, 5), 3, 4), now)[2]["collective_seq_id"] == 4
    # NCCL: a count past its entries is not read so (its send/recv have entries of their own)
    assert blocked_in(_gloo_dump(range(1, 6), 10, 11, "nccl"), now) is None


def test_a_state_that_cannot_keep_the_paces_stops_no_sweep(tmp_path, monkeypatch, caplog):
    """A full --state disk fails the timed groups' save: said once, the sweeps go on (before,
    each sweep raised before it published), and the save is tried again a minute later, not
    every sweep."""
    from tests.test_loop_sweep_writes import monitor

    mon, _ = monitor(str(tmp_path / "m.sqlite"), 2)
    mon.sweep_once()
    seen = Job(_dumps("hang"), 2)
    seen.torch = mon.torch_ranks  # the monitor's own, timing group 0..2 as its sweeps would
    seen.watched(0.0, 1000, (0, 1, 2), 2)
    tries = []

    def full(job: str, paces: dict) -> None:
        tries.append(sorted(paces))
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(mon.store, "save_torch_paces", full)
    clock = [100.0]
    monkeypatch.setattr(mon, "clock", lambda: clock[0])
    before = mon.sweeps
    with caplog.at_level("WARNING"):
        for _ in range(3):
            mon.sweep_once()
            clock[0] += 1
    assert mon.sweeps == before + 3 and len(tries) == 1, (mon.sweeps, tries)
    said = [r for r in caplog.records if "cannot keep the torch-only" in r.getMessage()]
    assert len(said) == 1 and "disk is full" in said[0].getMessage()
    clock[0] += 60
    mon.sweep_once()
    assert len(tries) == 2
    monkeypatch.undo()
    clock = [clock[0] + 61]
    mon.sweep_once()
    assert sorted(Store(str(tmp_path / "m.sqlite")).torch_paces(mon.cfg.job)) == \
        [_rid(g) for g in (0, 1, 2)]
