"""A replacement that hangs in every first step, healing into the quorum, is named whatever
torchft's timeout: its rank 0's ``should_commit`` times out after the Manager's timeout, the
process exits and its supervisor restarts it under a new replica id, so the survivors' wait is
cut short of --starting-timeout at every incarnation. The first-step hold is timed per group
slot across its untimed incarnations (monitor/detect/hang.py); a slot that trained in between
starts afresh. Built as tests/test_jobwide_healing_member.py: 3 groups x 2 ranks, gloo dumps,
the real Verifier against the Lighthouse's status, swept as the service does."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from monitor.act.bundles import Bundles
from monitor.act.enforcer import Enforcer
from monitor.act.hosts import HostLedger
from monitor.api.metrics import MonitorMetrics
from monitor.config import BundleConfig, DetectorConfig, MonitorConfig, RailsConfig
from monitor.detect import Detectors
from monitor.evidence.lighthouse_settings import LighthouseSettingsWatch
from monitor.evidence.verification import Verifier
from monitor.store import Store
from tests.support.frgen import _Rank
from tests.test_detect_enforcer_lifecycle import Kills
from tests.test_goodput_held import Compared
from tests.test_jobwide_healing_member import _lighthouse
from tests.test_monitor_detectors import T0, Job

STARTING_S = 30.0  # --starting-timeout
TORCHFT_S = 10.0  # the Manager's timeout: the survivors' wait is cut there
SWEEP_S = 1.5


class _Slot:
    """The job after group 2 was evicted; each :meth:`incarnation` its replacement anew."""

    def __init__(self) -> None:
        self.job, self.verifier = Job(), Verifier()
        self.det = Detectors(DetectorConfig(starting_timeout_s=STARTING_S))
        self.found: list = []
        self.named: dict[str, float] = {}  # replica id -> when an open hang first named it
        self.then = None  # called with each sweep's view and new findings (the act stage)
        self.now, self.q, self.k = T0, 3, 0
        self.evicted: set[str] = set()
        self.ids = {self.job.states[r]["replica_id"] for r in (0, 2)}
        self.lh = _lighthouse(3, {s["replica_id"] for s in self.job.states})
        for _ in range(6):
            self.job.steps(3, now=self.advance(1.0))
            self.sweep()

    def advance(self, dt: float) -> float:
        self.now += dt
        return self.now

    def sweep(self) -> None:
        now, lh = self.now, self.lh
        view = self.job.view(now, lambda ranks, changed: self.verifier.judge(
            ranks, changed, lh, None, True, now))
        dumps = self.job.dumps() if self.det.fr_wanted(view.evidence(), now) else None
        new = self.det.update(view.evidence(), dumps, now, full_view=view,
                              evicted=frozenset(self.evicted), lighthouse=lh)
        assert self.det.last_error is None
        self.found.extend((now, f) for f in new)
        for f in self.det.open_findings():
            if f.kind == "hang":
                self.named.setdefault(f.replica_id, now)
        if self.then is not None:
            self.then(view, new)

    def incarnation(self, trains: bool = False, evict: bool = True, gap_s: float = 0.0,
                    compile_s: float | None = None) -> tuple[str, float]:
        """Group 2 restarted under a new replica id into a new quorum. Hung: it heals (rank 4)
        and never enters the all_reduce (rank 5 in its forward) while groups 0 and 1 wait up to
        the Manager's timeout, then it exits (the survivors wait no more) and is restarted
        ``gap_s`` later. ``trains``: it joins and trains instead; ``compile_s``: its first step
        takes that long, the others waiting for it, uncut. ``evict``: its predecessor was
        evicted (else it exited on its own). (its replica id, when the survivors began
        waiting)"""
        job = self.job
        if evict:
            self.evicted.add(job.states[4]["replica_id"])
        self.q, self.k = self.q + 1, self.k + 1
        new = f"replica_group_2:incarnation-{self.k}"
        self.lh = _lighthouse(self.q, self.ids | {new})
        for r in (4, 5):  # a new process: its recorder starts empty
            was = job.fr._ranks[r]
            job.fr._ranks[r] = _Rank(r, was.host, was.clock_offset_ns, was.now_ns,
                                     pg_ids={"0": 0}, next_pg_id=1)
        job.fr.quorum(self.q, [0, 1, 2])
        for r, s in enumerate(job.states):
            s.update(quorum_id=self.q, num_participants=3 if trains else 2)
            if r in (4, 5):
                s.update(replica_id=new, pid=s["pid"] + 100, started_at=self.now - 5.0,
                         step=s["step"] if trains else 0, participating=trains,
                         last_step_seconds=0.2 if trains else None, recent_step_seconds=[],
                         commits=5 if trains else 0, heals=1 if trains else 0,
                         timing={"recent": [], "waiting": None, "last_step": None,
                                 "window": None})
        since = self.now
        if trains:
            for _ in range(8):
                job.steps(1, now=self.advance(1.0))
                self.sweep()
            return new, since
        job.fr.ft_collective("all_reduce", [[1000]], absent=(4, 5))
        job.wait(4, None, phase="healing")
        job.wait(5, None, phase="forward")
        while self.advance(SWEEP_S) - since < (compile_s or TORCHFT_S):
            for r in range(4):
                job.wait(r, "cross", self.now - since, phase="allreduce")
            self.sweep()
        if compile_s:
            return new, since
        for r in range(4):  # should_commit timed out: the step is given up, the process exits
            job.wait(r, None, phase="quorum")
        while self.now - since < TORCHFT_S + 4 * SWEEP_S + gap_s:
            self.sweep()
            self.advance(SWEEP_S)
        return new, since

    def hangs(self) -> list:
        return [(at, f) for at, f in self.found if f.kind == "hang"]


def _named_at_the_starting_timeout(slot: _Slot) -> int:
    """Hung incarnations until one is named: once its incarnations have held the others
    --starting-timeout in all (their waits summed, the restarts' gaps not), never before; how
    many incarnations that took."""
    incarnations = [slot.incarnation()]
    first = incarnations[0][1]
    while not slot.hangs():
        incarnations.append(slot.incarnation())
        assert len(incarnations) < 6, "never named"
    ((at, f),) = slot.hangs()
    new, since = incarnations[-1]
    assert (f.replica_group, f.replica_id, f.ranks) == (2, new, [4, 5])
    # not before the slot was held that long in all, then at the incarnation's first stall
    assert at - first >= STARTING_S and at - since < 2 * SWEEP_S + 1.0
    assert f.evidence["stalled_s"] < TORCHFT_S <= STARTING_S == f.evidence["threshold_s"]
    assert f.evidence["held_s"] >= STARTING_S
    assert f.evidence["incarnations"] == len(incarnations) > 1
    assert f"over {len(incarnations)} incarnation(s)" in f.evidence["summary"]
    return len(incarnations)


def test_a_replacement_hung_in_every_first_step_is_named_across_its_incarnations(caplog):
    caplog.set_level(logging.WARNING, logger="monitor.detect.hang")
    slot = _Slot()
    n = _named_at_the_starting_timeout(slot)
    held = [r.getMessage() for r in caplog.records if "hang held" in r.getMessage()]
    assert len(held) == n - 1, held  # once an incarnation held
    slot.incarnation()  # the named one replaced: its successor is held afresh
    assert len(slot.hangs()) == 1
    assert "replica group 2 rank(s) [4, 5] have timed no step since" in held[0]
    assert "over 1 incarnation(s)" in held[0] and "over 2 incarnation(s)" in held[1]


def test_a_slot_that_trained_in_between_is_held_afresh():
    slot = _Slot()
    slot.incarnation()
    slot.incarnation(trains=True)  # it healed and trained: no first step any more
    _named_at_the_starting_timeout(slot)


def test_a_named_incarnation_that_exits_unevicted_leaves_its_slot_held():
    slot = _Slot()
    _named_at_the_starting_timeout(slot)
    # its eviction held (a cooldown), the named one exits on its own: its successor is named at
    # its first stall past the plain hang threshold, not after a fresh --starting-timeout, by
    # the same finding, open in between
    new, since = slot.incarnation(evict=False)
    assert len(slot.hangs()) == 2
    at, f = slot.hangs()[-1]
    assert f.replica_id == new and at - since < 2 * SWEEP_S + 1.0
    assert f.evidence["held_s"] > STARTING_S


def _acted_on(slot: _Slot, tmp_path, rails: dict) -> tuple[Enforcer, Kills, Compared]:
    """Each sweep's findings acted on and accounted as the service does: a real Enforcer with
    ``rails`` and Store (the kills to a recorder), the goodput ledger (and its reference)."""
    cfg = MonitorConfig(state_path=str(tmp_path / "state.sqlite"), job="t",
                        bundles=BundleConfig(enabled=False), rails=RailsConfig(**rails))
    store, kills, led = Store(cfg.state_path), Kills(), Compared()
    # on the --state of an earlier run: its open findings closed and marked, as Monitor does
    slot.det.restarted = store.restart_marks(slot.now)

    def clock() -> float:
        return slot.now

    enf = Enforcer(cfg, store, slot.det, HostLedger(store, cfg.quarantine, [], cfg.job, clock),
                   kills, LighthouseSettingsWatch(), MonitorMetrics(cfg.job), lambda: None,
                   clock, Bundles(cfg, store, clock))

    def act(view, new) -> None:
        enf.record(new, slot.now)
        enf.decide(view, view.evidence(), slot.now, lighthouse=slot.lh)
        led.update(view.evidence(), enf.open_findings(),
                   store.decisions(limit=100, decision="evict"), slot.now)

    slot.then = act
    return enf, kills, led


def test_a_cooldown_ending_between_incarnations_kills_only_the_one_hung_now(tmp_path):
    """Named while the cooldown holds its eviction, the incarnation exits; the cooldown ends as
    its successor starts: nothing is killed until the successor hangs too (the gone one's
    finding closed `replaced`), then the successor is, never the one gone."""
    slot = _Slot()
    enf, kills, _ = _acted_on(slot, tmp_path, {"cooldown_s": 1e6})
    # group 2's predecessor was evicted at the start: the cooldown runs from there
    enf.store.add_decision(replica_group=2, replica_id="replica_group_2:sim", decision="evict",
                           reason="hang", status="sent", at=T0)
    _named_at_the_starting_timeout(slot)
    assert kills.sent == []
    enf.cfg = dataclasses.replace(enf.cfg, rails=RailsConfig())  # the cooldown is over
    new, since = slot.incarnation(evict=False)
    assert kills.sent == [new]
    assert slot.named[new] - since < 2 * SWEEP_S + 1.0
    enf.store.close()


def test_a_healthy_first_step_after_a_hung_one_is_timed_on_its_own():
    slot = _Slot()
    slot.incarnation()  # hung, not named, exits
    # its replacement's first step compiles under --starting-timeout, holding the others past
    # the earlier one's cut: not the loop, not named however long the slot was held
    slot.incarnation(compile_s=STARTING_S - 8.0)
    assert slot.hangs() == []


def test_a_group_gone_from_the_view_is_held_afresh():
    slot = _Slot()
    slot.incarnation()  # hung, not named, exits
    job, targets, states = slot.job, slot.job.targets, slot.job.states
    job.targets, job.states, job.down = targets[:4], states[:4], {4, 5}
    for _ in range(3):  # relaunched: its group's ranks out of the targets a while
        slot.sweep()
        slot.advance(SWEEP_S)
    job.targets, job.states, job.down = targets, states, set()
    slot.incarnation()
    assert slot.hangs() == []


def test_a_loop_restarted_slower_than_the_starting_timeout_is_named():
    slot = _Slot()
    # each incarnation holds nobody for longer than --starting-timeout before the next one
    first = slot.incarnation(gap_s=25.0)[1]
    for _ in range(4):
        new, since = slot.incarnation(gap_s=25.0)
        if slot.hangs():
            break
    ((at, f),) = slot.hangs()
    assert f.replica_id == new and at - first >= STARTING_S and at - since < 2 * SWEEP_S + 1.0
    assert f.evidence["held_s"] >= STARTING_S > f.evidence["stalled_s"]


@pytest.mark.parametrize("gap_s", [10.0, 20.0])
def test_a_restarts_gap_holds_nobody(gap_s):
    """The slot's hold sums the time its incarnations held the others, not the wall time since
    the first: after a hung one and a long restart, a healthy first step compiling under
    --starting-timeout is not named however long ago the first one began."""
    slot = _Slot()
    slot.incarnation(gap_s=gap_s)  # hung, not named, exits; restarted gap_s later
    slot.incarnation(compile_s=STARTING_S - 8.0)
    assert slot.hangs() == []
