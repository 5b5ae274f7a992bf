"""The detectors' fast paths against a plain reference, sweep after sweep: each group's polled ranks taken from the one pass over the sweep's answers (not
from a scan of every GroupView's ranks), the straggler's verdict loop run only for the groups
late now, with a late streak or with an open finding (not for every group), and
stuck_starting reading the ranks without a quorum from that pass when every rank is evidence
(not from a pass of its own over the full view). The job is
tests/test_monitor_detectors.py's synthetic FT-HSDP job (real /v1/state documents with
per-step timings through a real ViewBuilder); the reference is the same classes with those
three methods written plainly."""

from __future__ import annotations

import random

import pytest

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from monitor.detect.straggler import Straggler
from monitor.poll.poller import RankPoll
from tests.test_monitor_detectors import T0, Job, kept


class EveryGroupStraggler(Straggler):
    """Members from every GroupView's reachable ranks, every group judged."""

    def members(self, view, groups):
        slots, rids, members = self.memory.slot, self.memory.rid, {}
        for g, gv in groups.items():
            rid = gv.replica_id
            rows = [(r, slots[r.url], rid) for r in gv.reachable
                    if r.fresh and self.memory.newest(r.url) is not None
                    and rids[slots[r.url]] == rid]
            if not rows:
                return None
            members[g] = rows
        return members

    def judged(self, order, is_late, open_groups):
        return list(range(len(order)))


class EveryGroup(Detectors):
    """The reference: EveryGroupStraggler, and stuck_starting reading the full view itself."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.straggler = EveryGroupStraggler(self.cfg, self.findings, self._groups)

    def _starting_urls(self, full):
        return None


def clock() -> float:  # the one clock read outside update's ``now`` (a group replaced)
    return T0


def memories(det: Detectors) -> dict:
    return {g: (m.replica_id, m.straggler_windows, m.straggler_newest, m.straggler_first_seen,
                list(m.straggler_lags)) for g, m in det._groups.items()}


def summary(findings) -> list:
    return [(f.kind, f.replica_group, f.replica_id, f.ranks, f.evidence, f.first_seen,
             f.confirmed_at, f.resolved_at, f.resolution) for f in findings]


def run(fast: Detectors, ref: Detectors, seed: int, sweeps: int = 120) -> set[str]:
    """Random sweeps of leader polling (leaders every sweep, members now and then, drilled
    groups whole) through stragglers that come and go (some late in only part of a window),
    ranks that miss polls, groups restarted under a new replica id and a new quorum: the
    fast detectors and the reference see the same views; everything they say and remember
    about stragglers must be equal. Returns what happened, to show the paths were taken."""
    rng = random.Random(seed)
    job = Job(groups=7, ranks=3, seed=seed)
    job.steps(8, now=T0)
    now, late, drilled, seen = T0, {}, set(), set()
    for sweep_no in range(sweeps):
        now += 1.0
        event = rng.random()
        if event < 0.15:
            late = {rng.randrange(job.n): rng.choice([0.3, 0.6])}
        elif event < 0.25:
            late = {}
        elif event < 0.32:
            job.down = {rng.randrange(job.world)} if not job.down else set()
            drilled = {job.group_of(r) for r in job.down}
        elif event < 0.37:  # a restart: all of the group's ranks at once, or some first
            g = rng.randrange(job.n)
            ranks = job.members(g) if rng.random() < 0.5 else job.members(g)[:rng.choice([1, 2])]
            for r in ranks:
                job.states[r]["replica_id"] = f"replica_group_{g}:{sweep_no}"
            seen.add("restart")
        elif event < 0.40:
            for s in job.states:
                s["quorum_id"] += 1
        elif event < 0.5:
            drilled = {rng.randrange(job.n)}
        elif event < 0.55:  # a rank without a quorum (restarting), or back in it
            r = rng.randrange(job.world)
            job.states[r]["quorum_id"] = -1 if job.states[r]["quorum_id"] >= 0 else \
                max(s["quorum_id"] for s in job.states)
            seen.add("starting")
        if rng.random() < 0.2 and late:  # late in only some steps of the window
            job.steps(1, now=now)
            seen.add("partly late")
        job.steps(rng.choice([1, 1, 2]), late_group=late, now=now)
        polled = {t.url for r, t in enumerate(job.targets)
                  if job.group_of(r) in drilled or rng.random() < (
                      1.0 if r % job.ranks == 0 else 0.15)}
        polls = {t.url: (RankPoll(t.url, True, data=kept(s)) if r not in job.down
                         else RankPoll(t.url, False, reason="connection", error="refused"))
                 for r, (t, s) in enumerate(zip(job.targets, job.states, strict=True))
                 if t.url in polled}
        # verified as the service does: the evidence view is the full one's, rank for rank
        full = job.vb.update(job.targets, polls, now=now, polled=polled,
                             judge=job.verified_by(job.lighthouse(job.targets), now))
        view = full.evidence()
        assert view is not full and full.evidence_view is view
        assert fast.fr_wanted(view, now) == ref.fr_wanted(view, now), sweep_no
        got = fast.update(view, None, now, full_view=full)
        assert summary(got) == summary(ref.update(view, None, now, full_view=full)), sweep_no
        assert summary(fast.open_findings()) == summary(ref.open_findings()), sweep_no
        assert summary(fast.resolved_findings()) == summary(ref.resolved_findings()), sweep_no
        assert fast.last_lags == ref.last_lags, sweep_no
        assert memories(fast) == memories(ref), sweep_no
        assert fast.last_error is None and ref.last_error is None, sweep_no
        seen |= {f.kind for f in got}
        seen |= {f.resolution for f in fast.resolved_findings() if f.kind == "straggler"}
        if any(m.straggler_windows and not fast.last_lags.get(g, 0) >= 0.1
               for g, m in fast._groups.items()):
            seen.add("streak kept")
    return seen


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fast_straggler_matches_the_reference_over_random_sweeps(seed):
    cfg = DetectorConfig(straggler_steps=4, straggler_windows=3, dead_sweeps=2,
                         fr_interval_s=1e9, starting_timeout_s=3.0)
    seen = run(Detectors(cfg, clock=clock), EveryGroup(cfg, clock=clock), seed)
    assert {"straggler", "caught_up", "restart", "partly late", "stuck_starting"} <= seen, seen


def test_a_group_whose_streak_is_not_judged_again_diverges():
    """The mutation the equivalence test must catch: a group with a late streak left out of
    the verdict loop once it is no longer late keeps its streak (never reset), and confirms
    sooner than the reference on its next late window."""

    class ForgetsStreaks(Straggler):
        def judged(self, order, is_late, open_groups):
            self._streaks = set()
            return super().judged(order, is_late, open_groups)

    def forgets(cfg):
        det = Detectors(cfg, clock=clock)
        det.straggler = ForgetsStreaks(det.cfg, det.findings, det._groups)
        return det

    cfg = DetectorConfig(straggler_steps=4, straggler_windows=3, dead_sweeps=2,
                         fr_interval_s=1e9)
    with pytest.raises(AssertionError):
        for seed in (1, 2, 3):
            run(forgets(cfg), EveryGroup(cfg, clock=clock), seed)
