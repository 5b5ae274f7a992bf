"""job_slow names the group whose arrival at torchft's quorum the job waited for
(``evidence.quorum_late``, docs/monitor.md): a rank slow before its quorum call (data loading,
logging before ``zero_grad``) keeps its own group's peers waiting in the quorum too, so every
group waits alike at the cross-group step and only job_slow fires; each rank's
``wait_quorum_s`` (from its ``start_quorum`` call to the quorum's completion) tells the group's
last arrival. Its rank's own work explaining it, a straggler finding follows
(tests/test_pre_quorum_straggler.py): here only job_slow's evidence is asserted.

Rows come from a model of a torchft step, the synchronous quorum (the Lighthouse frees every
group once the last group's last rank called it; the forward pass then starts) and the
asynchronous one (the forward pass runs beside the quorum; the all_reduce waits for it), served
packed by the WorkerServer's writer, read by the monitor's poller and judged by the real
Detectors."""

from __future__ import annotations

import json
import random

import pytest

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from monitor.poll.poller import RankPoll, judge_body
from tests.test_monitor_detectors import T0, Job, update
from worker_server.packed import state_packed

FORWARD, AR = 0.2, 0.01


class QuorumJob(Job):
    active: set[int] | None = None  # the groups training (None: all); the others not started
    fail: frozenset[int] = frozenset()  # groups whose polls time out

    def live(self, r: int) -> bool:
        return self.active is None or r // self.ranks in self.active

    def polls(self, now: float):
        """Every live rank's answer as a WorkerServer serves it asked ``packed=1``."""
        polls = {t.url: RankPoll(t.url, False, reason="timeout", error="timed out", at=now)
                 if r // self.ranks in self.fail else
                 judge_body(t.url, json.dumps(state_packed(json.loads(json.dumps(s)))).encode(),
                            0.0, now, state=True)
                 for r, (t, s) in enumerate(zip(self.targets, self.states, strict=True))
                 if self.live(r)}
        return [t for r, t in enumerate(self.targets) if self.live(r)], polls

    def model(self, pre, rng, *, use_async=False, net=0.0, old=(), bad=()) -> None:
        """One step: rank (g, r) works ``pre(g, r)`` s before its quorum call, then forward; the
        cross-group all_reduce takes ``net`` s more than AR; ``old``: ranks serving no quorum
        waits (an older WorkerServer); ``bad``: ranks serving theirs in ms."""
        p = {r: 0.02 + pre(r // self.ranks, r % self.ranks) for r in range(self.world)
             if self.live(r)}
        quorum = max(p.values()) + 0.005  # the Lighthouse frees every group at once
        f = {r: FORWARD + rng.uniform(0, 0.01) for r in p}
        # at the all_reduce: the async quorum's first waits for the quorum, then for the others
        arrive = {r: max(quorum, p[r] + f[r]) if use_async else quorum + f[r] for r in p}
        done = max(arrive.values()) + AR + net
        for r in p:
            s, group = self.states[r], rng.uniform(0.005, 0.01)
            row = {"step": self.step, "compute_s": p[r] + f[r],
                   "wait_cross_s": done - p[r] - f[r], "wait_group_s": group,
                   "step_s": done + group}
            s["timing"]["recent"] = (s["timing"]["recent"] + [row])[-32:]
            s["timing"]["last_step"] = row
            if r not in old:
                waited = (quorum - p[r] + rng.uniform(0, 0.003)) * (1000 if r in bad else 1)
                s["timing"]["recent_quorum"] = (s["timing"].get("recent_quorum", []) + [
                    {"step": self.step, "wait_quorum_s": waited}])[-32:]
        self.step += 1


def before_quorum(f) -> bool:
    return f.kind == "straggler" and f.evidence.get("cause") == "before_quorum"


def job_slow(groups: int, ranks: int, pre_slow, *, pre_base=None, use_async=False, net=0.0,
             seed=1, old=(), bad=(), baseline_sweeps=14, slow_sweeps=6, named=False):
    """The job_slow findings' evidence, per sweep once confirmed: ``baseline_sweeps`` healthy
    sweeps (``pre_base`` before every rank's quorum), then ``pre_slow`` (and ``net``);
    ``named``: a straggler found before its quorum may follow (pre_quorum), nothing else."""
    job, det, now = QuorumJob(groups=groups, ranks=ranks, seed=seed), Detectors(
        DetectorConfig()), T0
    rng = random.Random(seed)
    pre_base = pre_base or (lambda g, r: 0.0)
    seen, opened = [], []
    for i in range(baseline_sweeps + slow_sweeps):
        now += 1.0
        slow = i >= baseline_sweeps
        for _ in range(6):
            job.model(pre_slow if slow else pre_base, rng, use_async=use_async,
                      net=net if slow else 0.0, old=old, bad=bad)
        job.steps(0, now=now)  # the states' step, step times and phase; no rows
        opened += [f for f in update(det, job, now) if f.kind != "job_slow"
                   and not (named and before_quorum(f))]
        for f in det.open_findings():
            if f.kind == "job_slow":
                seen.append(dict(f.evidence))
    assert [f.kind for f in opened] == [], "nothing but job_slow"
    assert not [d for d in det.open_findings() if d.kind != "job_slow"
                and not (named and before_quorum(d))]
    return seen


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("groups,ranks", [(3, 2), (2, 4)])
def test_a_rank_slow_before_its_quorum_is_named_in_job_slow(groups, ranks, use_async):
    slow = 2 * ranks - 1 if groups == 2 else 2 * ranks + 1  # group 1 (of 2) or 2: a rank of it
    late = slow // ranks

    def pre(g, r):
        return 0.3 if g * ranks + r == slow else 0.0

    seen = job_slow(groups, ranks, pre, use_async=use_async, named=True)
    assert seen, "job_slow fires, as before"
    q = seen[-1]["quorum_late"]
    assert q is not None, seen[-1]["summary"]
    assert (q["group"], q["rank"], q["host"]) == (late, slow, f"host-g{late}")
    assert q["lag_s"] == pytest.approx(0.3, abs=0.02) and q["steps"] == [6, 6]
    assert f"group {late} arrives at torchft's quorum" in seen[-1]["summary"]
    assert f"rank {slow} on host host-g{late} its last arriver in 6/6 steps" in seen[-1]["summary"]
    assert "more likely than the network" in seen[-1]["summary"]
    assert "a network fault slows them all" not in seen[-1]["summary"]


@pytest.mark.parametrize("seed", range(6))
def test_random_rank0_work_and_a_network_slowdown_name_no_group(seed):
    """Two groups, every rank 0 working U(0, 0.6) s before its quorum (the same before and
    during the slowdown); then every group's all_reduce 0.45 s slower (the network): a step's
    quorum lag is one rank 0's draw less the other's, and names no group."""
    draws = random.Random(100 + seed)

    def pre(g, r):
        return draws.uniform(0, 0.6) if r == 0 else 0.0

    seen = job_slow(2, 4, pre, pre_base=pre, net=0.45, seed=seed, slow_sweeps=10)
    assert seen, "job_slow fires, as before"
    assert [e["quorum_late"] for e in seen] == [None] * len(seen)
    assert "a network fault slows them all" in seen[-1]["summary"]


@pytest.mark.parametrize("old,bad", [((1,), ()), ((), (0,)), ((), (4, 5))])
def test_without_every_ranks_trusted_quorum_wait_job_slow_is_as_before(old, bad):
    """A rank serving no quorum waits (an older WorkerServer), or serving them in ms (above its
    step): the measure is left out; job_slow fires as before, naming no group."""
    seen = job_slow(3, 2, lambda g, r: 0.3 if (g, r) == (2, 1) else 0.0, old=old, bad=bad)
    assert seen and seen[-1]["quorum_late"] is None
    assert "a network fault slows them all" in seen[-1]["summary"]


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("groups,ranks,y", [(2, 4, 0.3), (3, 2, 0.2), (4, 2, 0.3)])
def test_a_group_late_at_its_quorum_at_pace_too_is_not_named_for_a_network_slowdown(
        groups, ranks, y, use_async):
    """Only global rank 0 logs ``y`` s before its quorum, at pace and during the slowdown, and
    every all_reduce gets 0.3 s slower (the network): group 0 is late at the quorum by as much as
    always, which explains none of the rise; the network is said, group 0 not named."""
    def pre(g, r):
        return y if (g, r) == (0, 0) else 0.0

    seen = job_slow(groups, ranks, pre, pre_base=pre, use_async=use_async, net=0.3,
                    slow_sweeps=10)
    assert seen, "job_slow fires, as before"
    assert [e["quorum_late"] for e in seen] == [None] * len(seen), seen[-1]["summary"]
    assert "a network fault slows them all" in seen[-1]["summary"]


def test_a_rank_slow_before_its_quorum_beside_a_logging_rank0_is_named_against_its_baseline():
    """Global rank 0 logs 0.2 s before its quorum all along; then rank 5 (group 2) takes 0.6 s
    more before its own: group 2 is named, its lag held against its own baseline."""
    def base(g, r):
        return 0.2 if (g, r) == (0, 0) else 0.0

    def slow(g, r):
        return 0.6 if (g, r) == (2, 1) else base(g, r)

    seen = job_slow(3, 2, slow, pre_base=base, named=True)
    q = seen[-1]["quorum_late"]
    assert q is not None and (q["group"], q["rank"]) == (2, 5), seen[-1]["summary"]
    assert "at pace" in seen[-1]["summary"]


def phased(groups: int, ranks: int, phases: list[dict], *, use_async: bool,
           named: bool = False) -> list[dict]:
    """job_slow's evidence per sweep over ``phases``: each ``sweeps`` sweeps of ``pre`` (and
    ``net``), with the quorum's ``groups`` (None: all), its id ``qid`` and replica ids ``rid``
    (``{group: suffix}``: a group restarted), as the ranks report them; ``fail``: groups whose
    polls time out."""
    job, det, now, rng = QuorumJob(groups=groups, ranks=ranks, seed=1), Detectors(
        DetectorConfig()), T0, random.Random(1)
    seen = []
    for ph in phases:
        job.active, job.fail = ph.get("groups"), frozenset(ph.get("fail", ()))
        for r, s in enumerate(job.states):
            s.update(num_participants=len(job.active or range(groups)),
                     quorum_id=ph.get("qid", 3),
                     replica_id=f"replica_group_{r // ranks}:{ph.get('rid', {}).get(r // ranks, 'sim')}")
        for _ in range(ph["sweeps"]):
            now += 1.0
            for _ in range(6):
                job.model(ph["pre"], rng, use_async=use_async, net=ph.get("net", 0.0))
            job.steps(0, now=now)
            assert [f.kind for f in update(det, job, now)
                    if f.kind != "job_slow" and not (named and before_quorum(f))] == []
            seen += [dict(f.evidence) for f in det.open_findings() if f.kind == "job_slow"]
    return seen


@pytest.mark.parametrize("use_async", [False, True])
def test_quorum_lags_learned_before_the_quorum_changed_name_no_group(use_async):
    """A group's quorum lag is against the other groups': learned again when they change.
    (1) Group 1's host worked 0.3 s before its quorum while the baseline was learned; group 1 is
    replaced on a healthy host, then the network slows. (2) Global rank 0 logs 0.4 s before its
    quorum all along; the baseline is learned with two groups, a third joins, then the network
    slows. Neither names a group (each named one with a baseline kept across the change)."""
    def busy_host(g, r):
        return 0.3 if (g, r) == (1, 0) else 0.0

    def logging(g, r):
        return 0.4 if (g, r) == (0, 0) else 0.0

    def healthy(g, r):
        return 0.0

    replaced = phased(2, 4, [
        {"sweeps": 14, "pre": busy_host},
        {"sweeps": 4, "pre": healthy, "qid": 4, "rid": {1: "new"}},
        {"sweeps": 10, "pre": healthy, "qid": 4, "rid": {1: "new"}, "net": 0.6}],
        use_async=use_async)
    joined = phased(3, 2, [
        {"sweeps": 14, "pre": logging, "groups": {0, 1}},
        {"sweeps": 4, "pre": logging, "qid": 4},
        {"sweeps": 10, "pre": logging, "qid": 4, "net": 0.5}], use_async=use_async)
    for seen in (replaced, joined):
        assert seen, "job_slow fires, as before"
        assert [e["quorum_late"] for e in seen] == [None] * len(seen), seen[-1]["summary"]
        assert "a network fault slows them all" in seen[-1]["summary"]


@pytest.mark.parametrize("use_async", [False, True])
def test_another_groups_pre_quorum_work_that_ended_before_a_network_slowdown_names_no_group(
        use_async):
    """Global rank 0 logs 0.3 s before its quorum all along; group 1's host loaded its data
    0.5 s late for most of the baseline, then no more; then the network slows. Group 0's lag
    moved with group 1's work, not with the slowdown: held against the newest at-pace windows,
    nothing is named."""
    def both(g, r):
        return {(0, 0): 0.3, (1, 0): 0.5}.get((g, r), 0.0)

    def logging(g, r):
        return 0.3 if (g, r) == (0, 0) else 0.0

    seen = phased(2, 4, [{"sweeps": 14, "pre": both}, {"sweeps": 4, "pre": logging},
                         {"sweeps": 10, "pre": logging, "net": 0.7}], use_async=use_async)
    assert seen, "job_slow fires, as before"
    assert [e["quorum_late"] for e in seen] == [None] * len(seen), seen[-1]["summary"]


def test_a_named_group_stays_named_through_a_sweep_its_polls_time_out():
    """Rank 3 (group 1) slow before its quorum is named; its group's polls time out one sweep
    (the busy host), then answer again as the same incarnation: still named, not the network."""
    def slow(g, r):
        return 0.5 if (g, r) == (1, 1) else 0.0

    seen = phased(3, 2, [{"sweeps": 14, "pre": lambda g, r: 0.0}, {"sweeps": 6, "pre": slow},
                         {"sweeps": 1, "pre": slow, "fail": {1}}, {"sweeps": 8, "pre": slow}],
                  use_async=False, named=True)
    q = seen[-1]["quorum_late"]
    assert q is not None and (q["group"], q["rank"]) == (1, 3), seen[-1]["summary"]


@pytest.mark.parametrize("use_async", [False, True])
def test_a_group_that_left_for_good_before_a_network_slowdown_moves_no_lag_into_a_name(
        use_async):
    """Global rank 0 logs 0.3 s before its quorum; group 2's host loads its data 0.6 s late.
    Group 2 leaves for good (no replacement), then the network slows: group 0's lag rose only
    because group 2 left; held against windows of the same groups only, nothing is named."""
    def pre(g, r):
        return {(0, 0): 0.3, (2, 0): 0.6}.get((g, r), 0.0)

    seen = phased(3, 2, [{"sweeps": 14, "pre": pre},
                         {"sweeps": 2, "pre": pre, "groups": {0, 1}, "qid": 4},
                         {"sweeps": 10, "pre": pre, "groups": {0, 1}, "qid": 4, "net": 0.8}],
                  use_async=use_async)
    assert seen, "job_slow fires, as before"
    assert [e["quorum_late"] for e in seen] == [None] * len(seen), seen[-1]["summary"]
