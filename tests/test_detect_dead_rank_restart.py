"""``dead_rank`` across a monitor restart: a rank down since before the monitor started is judged
by the commits its group's Manager had when the last run first saw it down (kept in ``--state``
with the rank's last state), else by the rank's own last commits; neither known, it is held. A
rank that lived unreachable is not named for another group's crash (that would evict a training
group), and a real death is found again.

The restart is what ``Monitor._build`` does: a fresh ViewBuilder seeded with the kept rows, and
fresh Detectors (tests/test_detect_dead_rank_held.py's job; the last test runs the monitor).
"""

from __future__ import annotations

import time

import pytest

from monitor.config import DetectorConfig, MonitorConfig
from monitor.detect import Detectors
from monitor.evidence.rank import last_known
from monitor.evidence.verification import Verifier
from monitor.evidence.view import ViewBuilder
from monitor.poll.poller import STATE_PATH, RankPoll
from monitor.service import Monitor
from tests.support.monitor_sim import rank_state
from tests.test_detect_dead_rank_held import kinds, slow_job
from tests.test_monitor_detectors import Job, sweep


def restart(job: Job, down: list[int]) -> Detectors:
    """A restarted monitor (a fresh ViewBuilder, Verifier and Detectors) whose last run kept
    ``down``'s last states and verdicts, as Unreachable.keep does, and no mark (it died before
    writing one, or never saw their Manager answer while they were down)."""
    kept = {}
    for r in down:
        rv = job.last_view.ranks[job.targets[r].url]
        kept[rv.url] = (rv.unreachable_since, last_known(rv.state),
                        rv.trust.to_dict() if rv.trust else None)
    job.vb, job.verifier = ViewBuilder(), Verifier()
    job.vb.seed(kept)
    return Detectors(DetectorConfig())


def lived_then_restart(healed: int, manager_misses_first_poll: bool = False,
                       ends: bool = False) -> list[tuple]:
    """Rank 1 lives unreachable while group 0 commits 4 steps past it (its step ``healed``
    ahead of its commits: a heal or a checkpoint load moves the step alone); the monitor
    restarts; another group's crash then holds rank 0 in the cross all_reduce, or (``ends``)
    rank 0 says it finished at the restarted monitor's first look, then exits."""
    job, det, now = slow_job()
    job.step += healed

    def commits() -> None:
        for s in job.states:
            s["commits"] = s["step"] - healed

    now += 1.0
    job.steps(1, now=now)
    commits()
    assert sweep(det, job, now) == []  # rank 1's last answer
    job.down = {1}
    for i in range(16):
        now += 1.0
        if i % 4 == 0:
            job.steps(1, now=now)
            commits()
        assert sweep(det, job, now) == []
    det = restart(job, [1])
    found = []
    if ends:
        job.states[0]["finished"] = True
        now += 1.0
        found += sweep(det, job, now)
        job.down = {0, 1}
        for _ in range(6):
            now += 1.0
            found += sweep(det, job, now)
        return kinds(found)
    for i in range(6):
        now += 1.0
        job.down = {0, 1} if i == 0 and manager_misses_first_poll else {1}
        job.wait(0, "cross", 1.5 + i, phase="allreduce")
        found += sweep(det, job, now)
    return kinds(found)


@pytest.mark.parametrize("healed", [0, 50])
def test_a_rank_that_lived_before_a_monitor_restart_still_lived_after_it(healed):
    """No ``dead_rank`` for rank 1: its own last commits show its group went on past it (not its
    step: after a heal that is far past its commits, and it was named)."""
    assert lived_then_restart(healed) == []


def test_a_manager_missing_the_restarted_monitors_first_poll_changes_nothing():
    """Rank 0 refuses the restarted monitor's first poll: rank 1, down since before the
    restart, is still judged by its last commits when the Manager answers (before: marked at
    the Manager's commits then, as if it had just gone down, and named)."""
    assert lived_then_restart(0, manager_misses_first_poll=True) == []


def test_a_group_that_finishes_at_the_restarted_monitors_first_look_lost_no_rank():
    """Rank 0's stop is read at the restarted monitor's first look: rank 1, down since before
    the restart, lived (its group committed past it), so it ended with its group, not a crash
    torchrun stopped its peer for (before: ``dead``, counted against its host)."""
    assert lived_then_restart(0, ends=True) == []


def test_a_rank_that_died_at_its_last_answer_is_found_by_its_own_commits_after_a_restart():
    """No mark kept (the monitor restarted before writing one): rank 1 died at its last answer
    and rank 0 blocks in the commit vote; its own last commits, kept, show the group never went
    past it, and the restarted monitor finds it."""
    job, det, now = slow_job()
    now += 1.0
    job.steps(1, now=now)
    for s in job.states:
        s["commits"] = s["step"] - 7  # a resumed run: its step is not its process's commits
    assert sweep(det, job, now) == []
    job.down = {1}
    det = restart(job, [1])
    found = []
    for i in range(4):
        now += 1.0
        job.wait(0, "group", 1.5 + i, phase="commit")
        found += sweep(det, job, now)
    assert kinds(found) == [("dead_rank", 0, [1])]


class Ranks:
    """A poller: 2 replica groups x 2 ranks answer ``states``; those in ``down`` refuse."""

    def __init__(self) -> None:
        self.urls = [f"http://127.0.0.1:1/r/{r}" for r in range(4)]
        self.states = []
        for r in range(4):
            s = rank_state(r, r // 2, step=10)
            s.update(group_rank=r % 2, group_world_size=2, host=f"host-{r // 2}")
            self.states.append(s)
        self.down: set[int] = set()
        self.max_idle = 0

    def steps(self, group: int, n: int) -> None:
        for s in self.states[2 * group:2 * group + 2]:
            s["step"] += n
            s["commits"] += n

    def sweep(self, urls, path=STATE_PATH, timeout_s=None, max_bytes=None, queries=None):
        now, out = time.time(), {}
        for u in urls:
            r = self.urls.index(u)
            out[u] = RankPoll(u, False, reason="connection", error="refused", at=now) \
                if r in self.down or path != STATE_PATH \
                else RankPoll(u, True, dict(self.states[r], phase_since=now), at=now)
        return out

    def close(self) -> None:
        pass


def dead_rank_after(mon: Monitor, ranks: Ranks, sweeps: int) -> list[tuple]:
    for _ in range(sweeps):
        ranks.steps(1, 1)
        mon.sweep_once()
    return [(f.kind, f.replica_group, f.ranks) for f in mon.detectors.open_findings()
            if f.kind == "dead_rank"]


def test_a_dead_rank_whose_last_answer_is_older_than_its_death_is_found_again(tmp_path):
    """Group 0 commits 3 steps after rank 1's last answer; rank 1 dies and rank 0 blocks in the
    commit vote. The monitor finds ``dead_rank``; restarted (findings are not restored), it
    finds it again: the Manager's commits when rank 1 was first seen down are kept with its
    state (before: judged by its last answer, 3 commits behind, it counted as lived for good)."""
    path, ranks = str(tmp_path / "state.sqlite"), Ranks()

    def monitor() -> Monitor:
        mon = Monitor(MonitorConfig(port=0, targets=ranks.urls, state_path=path,
                                    leader_polling="off", max_targets=4))
        mon.polling.poller.close()
        mon.polling.poller = ranks
        return mon

    mon = monitor()
    try:
        mon.sweep_once()
        ranks.steps(0, 3)
        ranks.down = {1}
        ranks.states[0].update(phase="commit",
                               timing={"waiting": {"scope": "group", "seconds": 30.0}})
        assert dead_rank_after(mon, ranks, 5) == [("dead_rank", 0, [1])]
    finally:
        mon.stop()
    mon = monitor()
    try:
        assert dead_rank_after(mon, ranks, 4) == [("dead_rank", 0, [1])]
    finally:
        mon.stop()
