"""A network fault seen by a live monitor: the whole job stalled or slowed with no group to
blame (``job_stall``, ``job_slow``), then the host whose network is bad, found by asking the
hosts' ranks to probe each other (``network``), evicted and quarantined; and what must not
happen (uniform slowness, a blind monitor, ranks without the probe route, healthy jitter).

A real Monitor (real HTTP, real SQLite, its real rails and host ledger) against a real torchft
Lighthouse that simulated groups join (``SimJob``, tests/support/monitor_sim.py; kills recorded
by its front). A simulated group has no trainer, so the test writes its ranks' per-step timings
(``timing.recent``, ``timing.waiting``) as the WorkerServer would serve them. The sweeps are
driven by the test, one per simulated second on the monitor's injected clock.
"""

from __future__ import annotations

import json
import logging
import random
import sqlite3
import tarfile
import time

import pytest

from monitor.api.views import goodput_json
from monitor.config import DetectorConfig, MonitorConfig, RailsConfig
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob

STEPS_PER_SWEEP = 3
BASELINE_SWEEPS = 14  # 5 disjoint healthy windows of 6 steps after the first: the baseline
HEALTHY = {"compute_s": 0.16, "wait_cross_s": 0.02, "wait_group_s": 0.01}
# the link of one host (or of every host) throttled: every group waits ~0.4 s more inside the
# cross-group all_reduce, and arrives on time
NETWORK_SLOW = {"compute_s": 0.16, "wait_cross_s": 0.42, "wait_group_s": 0.01}


class Clock:
    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


class Training:
    """What a trainer's WorkerServer would serve, written into the simulated ranks."""

    def __init__(self, job: SimJob, seed: int = 0) -> None:
        self.job, self.rng, self.step = job, random.Random(seed), 100
        for r in job.sim.ranks:
            g = r.state["replica_group"]
            r.update(host=f"h{g}", node=f"node-{g}", step=self.step,
                     timing={"recent": [], "waiting": None, "last_step": None, "window": None})

    def steps(self, n: int, now: float, jitter: float = 0.1, groups: dict | None = None,
              **seconds: float) -> None:
        """``groups``: replica group -> its own seconds, for groups unlike the rest."""
        secs = {**HEALTHY, **seconds}
        for _ in range(n):
            self.step += 1
            for g in self.job.alive:
                for r in self.job.sim.group(g):
                    own = {**secs, **(groups or {}).get(g, {})}
                    row = {k: v * (1 + self.rng.uniform(-jitter, jitter)) for k, v in own.items()}
                    row["step_s"] = sum(row.values())
                    row["step"] = self.step
                    t = r.state["timing"]
                    t = {**t, "recent": (t["recent"] + [row])[-16:], "last_step": row,
                         "waiting": None}
                    r.update(timing=t, step=self.step, commits=self.step, phase="forward",
                             phase_since=now, last_step_at=now,
                             recent_step_seconds=[x["step_s"] for x in t["recent"]])

    def stall(self, waiting_s: float, now: float) -> None:
        """Every rank blocked in the cross-group all_reduce for ``waiting_s`` (its own clock)."""
        for g in self.job.alive:
            for r in self.job.sim.group(g):
                r.update(phase="allreduce", phase_since=now - waiting_s,
                         timing={**r.state["timing"],
                                 "waiting": {"scope": "cross", "seconds": waiting_s}})


@pytest.fixture
def job():
    j = SimJob(4, ranks_per_group=2, heartbeat_timeout_ms=1000)
    yield j
    j.stop()


def monitor(tmp_path, job, clock, **kw) -> Monitor:
    kw.setdefault("rails", RailsConfig(min_replicas=1, cooldown_s=0))
    kw.setdefault("detectors", DetectorConfig(hang_floor_s=1.0, dead_sweeps=2))
    cfg = MonitorConfig(port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"),
                        targets=job.sim.urls, sd_out=str(tmp_path / "targets.json"), job="sim",
                        lighthouse=job.url, **kw)
    return Monitor(cfg, clock=clock)  # not started: the test sweeps


class Driver:
    def __init__(self, mon: Monitor, train: Training, clock: Clock) -> None:
        self.mon, self.train, self.clock = mon, train, clock

    def sweep(self, steps: int = STEPS_PER_SWEEP, **seconds: float) -> None:
        self.clock.t += 1.0
        if steps:
            self.train.steps(steps, self.clock.t, **seconds)
        self.mon.sweep_once()
        m = self.mon  # no stage failed quietly
        errors = (m.last_sweep_error, m.detectors.last_error, m.goodput.error,
                  m.enforcer.hosts_trouble.error)
        assert errors == (None,) * 4, errors

    def sweeps(self, n: int, **kw) -> None:
        for _ in range(n):
            self.sweep(**kw)

    def open_kinds(self) -> list[str]:
        return sorted(f.kind for f in self.mon.detectors.open_findings())

    def until(self, predicate, what: str, sweeps: int = 30, pause: float = 0.02, **kw):
        """Sweep (with ``kw``'s training) until ``predicate()``; at most ``sweeps`` sweeps and
        20 s (a probe round runs on its own thread, the Lighthouse keeps real time: ``pause``
        between sweeps)."""
        deadline = time.monotonic() + 20
        for _ in range(sweeps):
            got = predicate()
            if got:
                return got
            if time.monotonic() > deadline:
                break
            self.sweep(**kw)
            time.sleep(pause)
        got = predicate()
        assert got, f"no {what} after {sweeps} sweeps; open: {self.open_kinds()}"
        return got


@pytest.fixture
def driver(tmp_path, job):
    clock = Clock()
    train = Training(job)
    mon = monitor(tmp_path, job, clock)
    yield Driver(mon, train, clock)
    mon.stop()


def test_every_group_waiting_in_the_cross_group_collective_is_a_job_stall(driver):
    d = driver
    d.sweeps(4)
    assert d.open_kinds() == []
    d.train.stall(0.3, d.clock.t)
    d.sweeps(2, steps=0)  # blocked, but not for the hang threshold yet
    assert d.open_kinds() == []
    d.train.stall(4.0, d.clock.t)
    d.sweeps(2, steps=0)
    (f,) = d.mon.detectors.job_findings()
    assert f.kind == "job_stall" and f.replica_group is None and f.ranks == []
    ev = f.evidence
    assert sorted(ev["groups"]) == ["0", "1", "2", "3"] and ev["hosts"] == ["h0", "h1", "h2", "h3"]
    assert ev["stalled_s"] == pytest.approx(4.0) and ev["culprits"] == []
    stored = d.mon.store.findings(open_only=True)
    assert [(s["kind"], s["replica_group"]) for s in stored] == [("job_stall", None)]
    assert d.mon.cluster_json()["job_findings"] == ["job_stall"]
    assert d.mon.store.decisions() == []  # reported, never acted on
    d.sweep()  # a step moved: over
    assert d.open_kinds() == []
    assert d.mon.store.findings()[0]["resolution"] == "progress"


def test_a_stall_with_each_groups_other_rank_in_its_commit_is_a_job_stall(driver):
    """A partition striking between the shards' all_reduces: each group's first rank got through
    and waits in torchft's commit for the other, stuck in the cross-group collective."""
    d = driver
    d.sweeps(4)
    d.train.stall(4.0, d.clock.t)
    for g in d.train.job.alive:
        first = d.train.job.sim.group(g)[0]
        first.update(phase="commit", phase_since=d.clock.t - 4.0,
                     timing={**first.state["timing"], "waiting": None})
    d.sweeps(2, steps=0)
    (f,) = d.mon.detectors.job_findings()
    assert f.kind == "job_stall" and sorted(f.evidence["groups"]) == ["0", "1", "2", "3"]
    assert d.mon.store.decisions() == []


def test_groups_through_the_collective_waiting_for_a_quorum_are_part_of_a_job_stall(driver):
    """A partition striking mid all_reduce: three groups got their part through, committed and
    wait for the next quorum; the fourth is blocked in the collective for good. Still every
    group waits, and none is late: a job stall (the probes then find the host)."""
    d = driver
    d.sweeps(4)
    d.train.stall(4.0, d.clock.t)
    step = d.train.step
    for g in (0, 1, 2):
        for r in d.train.job.sim.group(g):
            r.update(step=step + 1, phase="quorum", phase_since=d.clock.t - 4.0,
                     timing={**r.state["timing"], "waiting": None})
    d.sweeps(2, steps=0)
    (f,) = d.mon.detectors.job_findings()
    assert f.kind == "job_stall" and f.evidence["step"] == step + 1
    assert f.evidence["groups"]["3"]["waiting_s"] == pytest.approx(4.0)
    assert [f.evidence["groups"][g]["phase"] for g in "012"] == ["quorum"] * 3
    assert "through it, waits for a quorum (group(s) [0, 1, 2])" in f.evidence["summary"]
    d.sweeps(2, steps=0)
    assert d.mon.detectors.job_findings() == [f]  # still stalled: no step moved


def test_groups_waiting_for_a_quorum_with_no_group_blocked_is_no_job_stall(driver):
    d = driver
    d.sweeps(4)
    d.train.stall(4.0, d.clock.t)
    for r in d.train.job.sim.ranks:  # all between quorums: torchft's business
        r.update(step=d.train.step + 1, phase="quorum", timing={**r.state["timing"],
                                                                "waiting": None})
    d.sweeps(3, steps=0)
    assert d.open_kinds() == []


def test_one_group_not_in_the_collective_is_no_job_stall(driver):
    d = driver
    d.sweeps(4)
    d.train.stall(4.0, d.clock.t)
    for r in d.train.job.sim.group(2):  # group 2 never arrived: the hang detector's case
        r.update(phase="forward", timing={**r.state["timing"], "waiting": None})
    d.sweeps(3, steps=0)
    assert "job_stall" not in d.open_kinds()


def test_a_group_healing_from_a_peer_inside_a_synchronous_quorum_is_no_job_stall(driver):
    """With a synchronous quorum a restarted group heals inside start_quorum: its ranks show
    phase ``quorum``, waiting across, their quorum not known yet, while every other group
    waits for it in the all_reduce. torchft's recovery: no job stall, no probe round."""
    d = driver
    d.sweeps(4)
    d.train.stall(4.0, d.clock.t)
    for r in d.train.job.sim.group(3):
        r.update(quorum_id=-1, step=0, phase="quorum")
    d.sweeps(3, steps=0)
    assert d.open_kinds() == []
    assert not d.mon.detectors.probes_wanted() and not round_started(d)
    assert d.mon.store.decisions() == []


def test_a_group_asking_to_join_since_long_before_hides_no_job_stall(driver):
    """A group that cannot start (re-asking the Lighthouse for minutes: a pod Pending, a crash
    loop) waits across in its quorum call too; it holds nobody, so the in-quorum groups' stall
    is still a job_stall and the probe mesh is wanted."""
    d = driver
    d.sweeps(4)
    d.train.stall(4.0, d.clock.t)
    for r in d.train.job.sim.group(3):
        r.update(quorum_id=-1, step=0, phase="quorum", phase_since=d.clock.t - 200.0,
                 timing={**r.state["timing"], "waiting": {"scope": "cross", "seconds": 200.0}})
    d.until(lambda: "job_stall" in d.open_kinds(), "a job stall", steps=0)


def test_a_group_the_lighthouse_left_out_of_the_quorum_holds_nobody(driver):
    """A group re-asking for a quorum whose wait happens to begin with the others' (long steps
    make the slack wide) holds nobody when the Lighthouse's quorum of the others does not
    include it: their stall is still a job_stall. (A joiner the Lighthouse let in holds them:
    the healing test above.)"""
    d = driver
    d.sweeps(4)
    job = d.train.job
    job.alive.discard(3)  # the others form a quorum without it; it heartbeats again after
    try:
        q = job.requorum()
    finally:
        job.alive.add(3)
    # its heartbeat lapsed while the others formed their quorum: verified again once heard
    d.until(lambda: d.mon.lighthouse_status.quorum_id == q
            and d.mon.lighthouse_status.heartbeating(job.replica_ids[3]), "group 3 heard",
            sweeps=100, pause=0.05)
    d.train.stall(4.0, d.clock.t)
    for r in job.sim.group(3):
        r.update(quorum_id=-1, step=0, phase="quorum", phase_since=d.clock.t - 8.0,
                 timing={**r.state["timing"], "waiting": {"scope": "cross", "seconds": 8.0}})
    d.until(lambda: "job_stall" in d.open_kinds(), "a job stall", steps=0)
    assert d.mon.lighthouse_status.quorum_id == q
    assert 3 in d.mon.view.evidence().groups  # judged, verified: not left out of the view
    assert job.replica_ids[3] not in d.mon.lighthouse_status.members


def test_the_whole_job_slowed_in_its_collectives_is_job_slow(driver):
    d = driver
    d.sweeps(BASELINE_SWEEPS)
    assert d.mon.detectors.jobwide.baseline_medians() is not None
    d.sweeps(4, **NETWORK_SLOW)
    (f,) = d.mon.detectors.job_findings()
    assert f.kind == "job_slow" and f.ranks == []
    ev = f.evidence
    assert ev["ratio"] > 2 and ev["baseline_step_s"] == pytest.approx(0.19, rel=0.1)
    assert ev["now_s"]["wait_cross_s"] > 0.3 and max(ev["arrival_lags_s"].values()) < 0.1
    assert ev["host_clock_cuda_ranks"] == [] and "host clock" not in ev["summary"]
    assert ev["late_group"] is None and "arrives" not in ev["summary"]
    assert "straggler" not in d.open_kinds()
    d.sweeps(3)  # back at the healthy pace
    assert d.open_kinds() == []
    assert d.mon.store.findings()[0]["resolution"] == "back_at_pace"
    assert d.mon.store.decisions() == []


def test_job_slow_names_the_cuda_ranks_whose_waits_are_on_the_host_clock(driver):
    """On the host clock a GPU slow on the GPU waits in the collective like its peers (measured
    on an H100, docs/gpu.md 7: the monitor saw job_slow only): the finding says which CUDA
    ranks time their waits there, so the operator knows the culprit may be among them."""
    d = driver
    host_clock = []
    for r in d.train.job.sim.ranks:
        on_host = r.state["replica_group"] == 1
        r.update(device={"type": "cuda", "index": 0},
                 timing={**r.state["timing"], "clock": "host" if on_host else "device"})
        if on_host:
            host_clock.append(r.state["rank"])
    d.sweeps(BASELINE_SWEEPS)
    d.sweeps(4, **NETWORK_SLOW)
    (f,) = d.mon.detectors.job_findings()
    assert f.kind == "job_slow" and len(host_clock) == 2
    assert f.evidence["host_clock_cuda_ranks"] == sorted(host_clock)
    assert f"CUDA rank(s) {sorted(host_clock)} time their waits on the host clock" in \
        f.evidence["summary"]


@pytest.mark.parametrize("groups", [4, 2])
def test_job_slow_names_a_group_late_by_most_of_the_rise_under_the_lag_floor(tmp_path, groups):
    """A group late by less than the straggler's floor (here the healthy groups' own work a
    step, 0.17 s, under --straggler-min-lag 0.3 s) slows the whole job: job_slow, but it says
    which group arrives late rather than blaming the network alone. With two groups only half
    the ranks wait for it: the median wait rises by half the step's rise, no more."""
    job = SimJob(groups, ranks_per_group=2, heartbeat_timeout_ms=1000)
    clock, mon = Clock(), None
    try:
        mon = monitor(tmp_path, job, clock, detectors=DetectorConfig(
            hang_floor_s=1.0, dead_sweeps=2, straggler_min_lag_s=0.3))
        d = Driver(mon, Training(job), clock)
        d.sweeps(BASELINE_SWEEPS)
        # group 1 computes 0.12 s longer; the others wait that long for it, under the floor
        late = {1: {"compute_s": 0.28, "wait_cross_s": 0.02}}
        d.sweeps(4, groups=late, compute_s=0.16, wait_cross_s=0.14)
        (f,) = d.mon.detectors.job_findings()
        ev = f.evidence
        assert f.kind == "job_slow" and "straggler" not in d.open_kinds()
        assert ev["late_group"] == 1 and 0.09 < ev["arrival_lags_s"]["1"] < 0.16
        assert ev["lag_threshold_s"] == pytest.approx(0.17, rel=0.1)
        assert "group 1 arrives" in ev["summary"] and "--straggler-min-lag 0.3s" in ev["summary"]
        assert "no group is late" not in ev["summary"]
    finally:
        if mon is not None:
            mon.stop()
        job.stop()


# a GPU job's steps: tens of ms, under --straggler-min-lag (docs/gpu.md 7: an H100's 11 ms)
SHORT = {"compute_s": 0.03, "wait_cross_s": 0.005, "wait_group_s": 0.002}


def test_a_group_late_by_a_groups_own_work_under_the_lag_floor_is_a_straggler(driver):
    """Steps of ~37 ms, 32 ms of them a group's own work, and one group 60 ms late a step from
    the job's first steps (a GPU slow from the start; the job ~2.6x slower): under the 0.1 s
    --straggler-min-lag, but over the median group's own work, the floor when shorter. A group
    whose timings say it works 4 ms a step (it waits the rest across) does not lower it."""
    d = driver
    assert d.mon.detectors.lag_floor == 0.1  # no window judged yet
    odd = {1: {"compute_s": 0.09, "wait_cross_s": 0.005},  # late
           2: {"compute_s": 0.002, "wait_cross_s": 0.093}}
    d.sweeps(5, groups=odd, **{**SHORT, "wait_cross_s": 0.065})
    (f,) = [f for f in d.mon.store.findings() if f["kind"] == "straggler"]
    ev = f["evidence"]
    assert f["replica_group"] == 1 and 0.05 < ev["median_lag_s"] < 0.1
    assert ev["floor_s"] == pytest.approx(0.032, rel=0.1) == ev["threshold_s"]
    (e,) = d.mon.store.decisions(decision="evict")
    assert e["replica_group"] == 1 and e["finding_id"] == f["id"]


def test_short_steps_whose_slowest_group_changes_find_nothing(driver):
    """Healthy steps of ~37 ms where each step's slowest group is another, by up to 60 % of the
    compute: every group waits for the slowest, and none is late by a group's own work."""
    d, rng = driver, random.Random(11)
    for _ in range(BASELINE_SWEEPS + 10):
        for _ in range(STEPS_PER_SWEEP):
            compute = {g: SHORT["compute_s"] * rng.uniform(0.8, 1.4) for g in d.train.job.alive}
            top = max(compute.values())
            d.train.steps(1, d.clock.t + 0.5, groups={
                g: {"compute_s": c, "wait_cross_s": 0.005 + top - c} for g, c in compute.items()},
                **SHORT)
        d.sweep(steps=0)
    assert d.mon.detectors.lag_floor < 0.1  # judged against a group's own work
    assert d.open_kinds() == []
    assert d.mon.store.findings() == [] and d.mon.store.decisions() == []


def test_job_slow_is_first_seen_when_its_first_slow_step_began(driver):
    """Two steps of ~0.5 s a sweep (one a second): the clock and the steps agree. The finding's
    first evidence (the ledger's onset of a network fault) is the last healthy sweep, not the
    sweep whose window first looked slow."""
    d = driver
    d.sweeps(BASELINE_SWEEPS)
    healthy_until = d.clock.t
    d.sweeps(4, steps=2, compute_s=0.16, wait_cross_s=0.32, wait_group_s=0.02)
    (f,) = d.mon.detectors.job_findings()
    assert f.kind == "job_slow" and f.confirmed_at - healthy_until >= 2
    assert f.first_seen == pytest.approx(healthy_until, abs=0.35), f.first_seen - healthy_until


def test_a_slowdown_just_under_the_factor_does_not_become_the_baseline(driver):
    """The job 1.45x slower in its collectives for long (under --job-slow-factor 1.5: no
    finding), then 2x: job_slow against the healthy baseline, not against the 1.45x."""
    d = driver
    d.sweeps(BASELINE_SWEEPS)
    d.sweeps(70, wait_cross_s=0.105)  # 0.275 s steps against 0.19: more than 30 windows
    assert d.open_kinds() == []
    assert d.mon.detectors.jobwide.baseline_medians()[0] == pytest.approx(0.19, rel=0.1)
    d.sweeps(4, wait_cross_s=0.21)  # 0.38 s: 2x the healthy step, 1.4x the slower one
    (f,) = d.mon.detectors.job_findings()
    assert f.kind == "job_slow" and f.evidence["ratio"] > 1.8


def test_slower_compute_is_not_job_slow(driver):
    """Every rank computing longer (a bigger batch, a throttled device) is not a network
    fault: the time did not go into the collectives."""
    d = driver
    d.sweeps(BASELINE_SWEEPS)
    d.sweeps(5, compute_s=0.6)
    assert d.open_kinds() == []


def test_healthy_jitter_finds_nothing(driver):
    d = driver
    rng = random.Random(7)
    for i in range(25):
        slow = {"wait_cross_s": 0.2} if i % 9 == 8 else {}  # now and then one slow sweep
        d.train.steps(1, d.clock.t + 0.5, jitter=0.3, compute_s=0.16 * rng.uniform(0.7, 1.4))
        d.sweep(jitter=0.3, **slow)
    assert d.mon.detectors.jobwide.baseline_medians() is not None  # job_slow was judged
    assert d.open_kinds() == []
    assert d.mon.store.findings() == [] and d.mon.store.decisions() == []


# --- the probe mesh: which host -------------------------------------------------------------
TOKEN = "exit-token"
FAST = {"ok": True, "mbit_s": 940.0}
THROTTLED = {"ok": True, "mbit_s": 19.5, "transfer_s": 0.107}  # tc tbf 20 Mbit/s on its link
CUT_OFF = {"ok": False, "mbit_s": None, "connect_s": None, "transfer_s": None,
           "error": "connect: timed out after 2.0s"}


def links(job: SimJob, bad_host: str | None = None, bad: dict | None = None,
          every: dict | None = None, seed: int = 0, direction: str = "both"):
    """The link matrix the fake probe route answers from: ``every`` link (default FAST, with
    10% jitter), those of ``bad_host`` ``bad`` (``direction``: both, or only those "from" it,
    as a rate limit on its egress alone)."""
    host_of = {r.url: r.state["host"] for r in job.sim.ranks}
    rng = random.Random(seed)

    def link(src: str, dst: str) -> dict:
        ends = (host_of[src],) if direction == "from" else (host_of[src], host_of[dst])
        if bad_host in ends:
            return dict(bad)
        row = dict(every or FAST)
        if row.get("mbit_s"):
            row["mbit_s"] *= rng.uniform(0.9, 1.1)
        return row
    return link


@pytest.fixture
def probing(tmp_path, job):
    """A monitor with the ranks' token, the simulated ranks answering /v1/probe."""
    clock = Clock()
    train = Training(job)
    job.sim.probe_token = TOKEN
    job.sim.links = links(job)
    mon = monitor(tmp_path, job, clock, rank_exit_token=TOKEN)
    yield Driver(mon, train, clock)
    mon.stop()


def probes_asked(job: SimJob) -> int:
    return sum(r.probes for r in job.sim.ranks)


def round_started(d: Driver) -> bool:
    """The monitor has started a probe round (``/v1/cluster``'s ``network_probes``)."""
    p = d.mon.probes.to_json()
    return bool(p["running"] or p["rounds"])


def network_findings(d: Driver) -> list:
    return [f for f in d.mon.detectors.open_findings() if f.kind == "network"]


@pytest.mark.parametrize("direction,described", [("both", 6), ("from", 3)])
def test_a_throttled_host_is_named_from_the_probe_matrix(probing, direction, described):
    d = probing
    d.sweeps(BASELINE_SWEEPS)
    assert probes_asked(d.train.job) == 0  # healthy: nobody probed
    d.train.job.sim.links = links(d.train.job, "h2", THROTTLED, direction=direction)
    (f,) = d.until(lambda: network_findings(d), "network finding", **NETWORK_SLOW)
    assert (f.replica_group, f.ranks) == (2, [2, 6])
    ev = f.evidence
    assert ev["host"] == "h2" and ev["culprit_hosts"] == ["h2", "h2"]
    assert ev["rounds"] == 2 and ev["job_findings"] == ["job_slow"]
    assert len(ev["links"]) == described  # h2 -> 3 peers (and 3 peers -> h2)
    assert ("every link of h2" if direction == "both" else "every transfer h2 fetched") \
        in ev["summary"]
    matrix = ev["probe"]["matrix"]
    assert sorted(matrix) == ["h0", "h1", "h2", "h3"]
    assert matrix["h2"]["h0"]["mbit_s"] == pytest.approx(19.5)
    assert matrix["h0"]["h1"]["mbit_s"] > 800
    (slow,) = d.mon.detectors.job_findings()
    assert slow.evidence["probe"]["culprit_hosts"] == ["h2"]
    stored = [s for s in d.mon.store.findings(open_only=True) if s["kind"] == "network"]
    assert stored and stored[0]["evidence"]["host"] == "h2"


def test_probe_rounds_during_a_heal_name_no_slow_host_until_it_is_over(probing):
    """A heal's checkpoint transfer fills its sender's and receiver's links (and keeps their
    processes busy): slow links measured meanwhile name nobody. Once it is over, they do."""
    d = probing
    d.sweeps(BASELINE_SWEEPS)
    d.train.job.sim.links = links(d.train.job, "h2", THROTTLED)
    steps = d.train.steps

    def healing(*a, **kw):  # rank 3 (host h3) loads a peer's state the whole time
        steps(*a, **kw)
        d.train.job.sim.ranks[3].update(phase="healing")

    d.train.steps = healing
    asked = probes_asked(d.train.job)
    for _ in range(8):  # fewer rounds than HEAL_ROUNDS
        d.sweep(**NETWORK_SLOW)
        time.sleep(0.02)  # a round runs on its own thread
    assert probes_asked(d.train.job) > asked
    assert [f for f in d.mon.store.findings() if f["kind"] == "network"] == []
    (slow,) = d.mon.detectors.job_findings()
    assert slow.evidence["probe"]["verdict"].startswith("no culprit: a rank heals")
    d.train.steps = steps
    (f,) = d.until(lambda: network_findings(d), "network finding", **NETWORK_SLOW)
    assert f.evidence["host"] == "h2"


@pytest.mark.parametrize("heal", [False, True], ids=["", "during_a_heal"])
def test_a_host_cut_off_from_its_peers_is_named(probing, heal):
    """Judged on connecting alone: a heal that fills links does not hide it (a group restarted
    there may be the one healing, stuck)."""
    d = probing
    d.sweeps(4)
    d.train.job.sim.links = links(d.train.job, "h1", CUT_OFF)
    d.train.stall(4.0, d.clock.t)
    if heal:  # group 1's other rank loads a peer's state
        d.train.job.sim.ranks[5].update(phase="healing")
    (f,) = d.until(lambda: network_findings(d), "network finding", steps=0)
    assert f.replica_group == 1 and f.evidence["host"] == "h1"
    assert f.evidence["job_findings"] == ["job_stall"]
    assert all("failed" in line for line in f.evidence["links"])


def test_probing_starts_half_way_to_a_job_stall_and_names_the_host_as_it_confirms(probing):
    """Every group blocked half the hang threshold (1 s here) starts the mesh; its rounds count
    but name nobody until ``job_stall`` is confirmed, and then the host is named at once."""
    d = probing
    job = d.train.job
    d.sweeps(4)
    job.sim.links = links(job, "h1", CUT_OFF)
    d.train.stall(0.6, d.clock.t)  # over half the threshold, under all of it
    d.until(lambda: round_started(d), "a probe round", steps=0)
    assert d.mon.probes.wait(10) and probes_asked(job) > 0
    d.sweeps(4, steps=0)  # rounds finished and handed over while the stall is on its way
    assert d.mon.probes.wait(10) and d.mon.probes.rounds >= 2  # rounds run on their own thread
    assert d.mon.detectors.job_findings() == [] and network_findings(d) == []
    assert job.kills == []
    d.train.stall(1.2, d.clock.t)  # past the threshold: the same sweep confirms both
    d.mon.probes.wait(10)
    d.sweep(steps=0)
    assert [f.kind for f in d.mon.detectors.job_findings()] == ["job_stall"]
    (f,) = network_findings(d)
    assert f.evidence["host"] == "h1" and f.evidence["rounds"] >= 2


def test_a_stall_under_half_the_threshold_asks_no_probe(probing):
    d = probing
    d.sweeps(4)
    d.train.stall(0.4, d.clock.t)
    d.sweeps(4, steps=0)
    assert probes_asked(d.train.job) == 0 and not round_started(d)


def test_every_link_alike_slow_names_no_host_and_acts_on_nothing(probing, caplog):
    d = probing
    d.sweeps(BASELINE_SWEEPS)
    job = d.train.job
    job.sim.links = links(job, every=THROTTLED)  # every link limited alike
    d.until(lambda: (f := d.mon.detectors.job_findings()) and f[0].evidence.get("probe"),
            "a probe round", **NETWORK_SLOW)
    first_round = d.mon.detectors.job_findings()[0].evidence["probe"]["at"]
    d.sweeps(6, **NETWORK_SLOW)
    d.until(lambda: d.mon.detectors.job_findings()[0].evidence["probe"]["at"] > first_round,
            "a later probe round", **NETWORK_SLOW)
    (f,) = d.mon.detectors.job_findings()
    assert f.evidence["probe"]["verdict"].startswith("no culprit: every link alike")
    assert network_findings(d) == []
    assert d.mon.store.decisions() == [] and d.mon.hosts.quarantined() == []
    assert job.kills == []
    # a host's rank stops answering probes: the open finding's row follows the new verdict
    # (/v1/findings shows it; a restart closes the finding as last written)
    (row,) = [r for r in d.mon.store.findings(open_only=True) if r["kind"] == f.kind]
    assert row["evidence"]["probe"]["verdict"].startswith("no culprit: every link alike")
    job.sim.group(3)[0].probe_route = False
    write, failed = d.mon.store.update_finding_evidence, []

    def full_once(*a):  # the disk full for three writes: the sweep goes on, it is retried
        if len(failed) < 3:
            failed.append(a)
            raise sqlite3.OperationalError("database or disk is full")
        return write(*a)

    d.mon.store.update_finding_evidence = full_once
    d.until(lambda: f.evidence["probe"]["verdict"].startswith("no culprit: no probe results "
                                                              "from h3"), "h3 unprobed",
            **NETWORK_SLOW)

    def stored():
        (row,) = [r for r in d.mon.store.findings(open_only=True) if r["kind"] == f.kind]
        return row["evidence"]["probe"]["verdict"]

    d.until(lambda: stored() == f.evidence["probe"]["verdict"], "the verdict written",
            **NETWORK_SLOW)
    assert len(failed) == 3
    said = [r.getMessage() for r in caplog.records if "probe verdict" in r.getMessage()]
    assert len(said) == 2 and "disk is full" in said[0] and "written again" in said[1], said
    job.sim.group(3)[0].probe_route = True
    job.sim.links = links(job)
    d.until(lambda: not d.mon.detectors.job_findings(), "the job back at pace")
    # the audit log keeps the last verdict, the rounds came after the confirmation; a round the
    # links' repair cut through may name a host (its first transfers at the old rates): still
    # nothing acted on it
    (row,) = [r for r in d.mon.store.findings() if r["kind"] == f.kind]
    assert row["resolution"] and row["evidence"]["probe"] == f.evidence["probe"]
    assert row["evidence"]["probe"]["at"] > first_round
    assert network_findings(d) == []
    assert d.mon.store.decisions() == [] and d.mon.hosts.quarantined() == [] and job.kills == []


def test_a_second_job_wide_finding_says_its_first_probe_verdict(caplog):
    """The monitor's log says a verdict when it changes: one said for a finding since closed
    is said again for the next one."""
    from monitor.config import ProbeConfig
    from monitor.detect.findings import Findings
    from monitor.detect.network import Network
    from tests.support.views import scratch_view

    findings, view = Findings(), scratch_view(100.0, {})
    net = Network(ProbeConfig(), findings)
    alike = a_round(["a", "b", "c"], lambda s, d: {})
    with caplog.at_level(logging.INFO, logger="monitor.detect.network"):
        for now in (100.0, 200.0):
            f = findings.confirm("job_slow", None, [], {"summary": "slow"}, now, now, view)
            net.judge(view, alike, now + 1, None)
            net.judge(view, alike, now + 2, None)  # the same verdict: not said again
            findings.resolve(f.key, "job_recovered", now + 3)
            net.judge(view, None, now + 4, None)
    said = [r.getMessage() for r in caplog.records if "probe round" in r.getMessage()]
    assert len(said) == 2 and all("no culprit: every link alike" in m for m in said)


def test_a_verdict_naming_another_host_is_news():
    from monitor.detect.network import gist
    said = [gist({"verdict": f"no culprit: no probe results from {h} (3 links, 19.5 Mbit/s)"})
            for h in ("node-3", "node-7", "h2", "10.0.0.3", "10.0.0.7", "cn-hz.192.168.0.3")]
    assert len(set(said)) == 6
    assert gist({"verdict": "every link alike (12 links, median 19.5 Mbit/s)"}) == \
        gist({"verdict": "every link alike (12 links, median 20.4 Mbit/s)"})


def test_ranks_without_the_probe_route_or_token_name_nobody(probing, caplog):
    d = probing
    job = d.train.job
    d.sweeps(BASELINE_SWEEPS)
    job.sim.links = links(job, "h2", THROTTLED)
    old = job.sim.group(3)[0]  # host h3's first rank: the one asked, an older WorkerServer
    old.probe_route = False
    with caplog.at_level(logging.WARNING, logger="monitor.evidence.probes"):
        d.until(lambda: probes_asked(job) >= 8, "two probe rounds", **NETWORK_SLOW)
        d.sweeps(4, **NETWORK_SLOW)
    assert old.probes >= 2 and network_findings(d) == []
    (f,) = d.mon.detectors.job_findings()
    assert f.evidence["probe"]["verdict"].startswith("no culprit: no probe results from h3")
    lines = [r.getMessage() for r in caplog.records if "network probes" in r.getMessage()]
    assert len(lines) == 1 and "an older WorkerServer" in lines[0] and "h3" in lines[0]
    # the token refused everywhere: one more line, still nobody named
    assert d.mon.probes.wait(10)  # no round half asked with the old token
    old.probe_route = True
    job.sim.probe_token = "another"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="monitor.evidence.probes"):
        d.sweeps(8, **NETWORK_SLOW)
    lines = [r.getMessage() for r in caplog.records if "network probes" in r.getMessage()]
    assert len(lines) == 1 and "refused the signature (HTTP 401" in lines[0]
    assert network_findings(d) == [] and d.mon.store.decisions() == []
    assert d.mon.sweeps > 0 and d.mon.last_sweep_error is None


def test_a_probe_refused_with_another_http_status_is_news(probing, caplog):
    """The rank asked on h3 answers 503 (no WorkerServer's answer: one busy probing says 429;
    something in front of the rank), then 500, then 404 (an older WorkerServer without the
    route): each verdict names its status, and each change is news, in the log and in the open
    finding's audit row (a verdict's gist drops rates and counts, not an HTTP status)."""
    d = probing
    job = d.train.job
    d.sweeps(BASELINE_SWEEPS)
    job.sim.links = links(job, "h2", THROTTLED)
    asked = job.sim.group(3)[0]

    def stored() -> str:
        rows = [r for r in d.mon.store.findings(open_only=True) if r["kind"] == "job_slow"]
        return (rows[0]["evidence"].get("probe") or {}).get("verdict", "") if rows else ""

    with caplog.at_level(logging.INFO, logger="monitor.detect.network"):
        for status, why in (("503 Service Unavailable", "(HTTP 503)"),
                            ("500 Internal Server Error", "(HTTP 500)"),
                            (None, "(no /v1/probe route (an older WorkerServer))")):
            asked.probe_status, asked.probe_route = status, status is not None
            d.until(lambda why=why: stored() == f"no culprit: no probe results from h3 {why}",
                    f"h3's {why} in the audit log", **NETWORK_SLOW)
    said = [r.getMessage() for r in caplog.records if "probe round for" in r.getMessage()]
    for why in ("(HTTP 503)", "(HTTP 500)", "(no /v1/probe route"):
        assert any(f"from h3 {why}" in m for m in said), said
    assert network_findings(d) == []


def test_a_monitor_that_cannot_reach_most_ranks_blames_no_one(probing):
    d = probing
    job = d.train.job
    d.sweeps(4)
    job.sim.links = links(job, "h2", CUT_OFF)
    d.train.stall(4.0, d.clock.t)
    d.until(lambda: d.mon.detectors.job_findings(), "job_stall", steps=0)
    # the monitor is cut off from three hosts of four (the ranks and the Lighthouse are fine)
    for g in (1, 2, 3):
        for r in job.sim.group(g):
            r.set_mode("down")
    d.mon.probes.wait(10)
    asked = probes_asked(job)
    d.sweeps(8, steps=0)
    assert network_findings(d) == [] and job.kills == []
    assert d.mon.hosts.quarantined() == []
    assert probes_asked(job) == asked  # no round asked while blind
    # the groups out of its sight are not dead (the Lighthouse still hears them) and, while
    # it may be the one cut off, the stall it found stays open: nothing closes
    assert d.open_kinds() == ["job_stall"]
    assert [dd for dd in d.mon.store.decisions() if dd["decision"] == "evict"] == []



LATE = {0: {"compute_s": 0.5, "wait_cross_s": 0.005}}  # group 0 a straggler (dry run: kept)


def straggling(tmp_path, job, clock, late: dict) -> Driver:
    """A monitor (a dry run) with ``late``'s group's straggler finding open."""
    d = Driver(monitor(tmp_path, job, clock,
                       rails=RailsConfig(min_replicas=1, cooldown_s=0, dry_run=True)),
               Training(job), clock)
    d.until(lambda: "straggler" in d.open_kinds(), "a straggler", groups=late,
            wait_cross_s=0.36)
    return d


def test_groups_gone_for_good_shrink_the_quorum_though_the_monitor_misses_most_ranks(
        tmp_path, job):
    """Three groups of four gone (their host dead: the Lighthouse stops hearing them too):
    the monitor reaches a quarter of the ranks, yet it is the job that shrank, not the monitor
    that is cut off: the survivor's straggler closes ``quorum_shrunk`` within --dead-sweeps."""
    clock = Clock()
    d = straggling(tmp_path, job, clock, LATE)
    try:
        for g in (1, 2, 3):
            for r in job.sim.group(g):
                r.set_mode("down")
            job.alive.discard(g)
        status = lambda: d.mon.lighthouse_status  # noqa: E731
        d.until(lambda: status() and not any(
            status().heartbeating(job.replica_ids[g]) for g in (1, 2, 3)),
            "the Lighthouse to hear groups 1-3 no more", groups=LATE, pause=0.1, sweeps=100)
        d.until(lambda: "straggler" not in d.open_kinds(), "the straggler closed",
                sweeps=2 + 3, groups=LATE)
        (f,) = [x for x in d.mon.store.findings() if x["kind"] == "straggler"]
        assert (f["replica_group"], f["resolution"]) == (0, "quorum_shrunk")
    finally:
        d.mon.stop()


def test_groups_the_lighthouse_still_hears_keep_their_findings_while_out_of_sight(
        tmp_path, job):
    """The opposite: the monitor cut off from three hosts of four while their Managers
    heartbeat on. The straggler of a group out of its sight is not over (no ``left_job``, no
    ``quorum_shrunk``): when the link comes back it is the same episode."""
    clock = Clock()
    late = {1: LATE[0]}
    d = straggling(tmp_path, job, clock, late)
    try:
        for g in (1, 2, 3):
            for r in job.sim.group(g):
                r.set_mode("down")
        d.sweeps(2 + 3, groups=late)
        assert all(d.mon.lighthouse_status.heartbeating(job.replica_ids[g]) for g in (1, 2, 3))
        assert "dead" not in d.open_kinds()  # only the monitor misses them
        assert [(f.kind, f.replica_group) for f in d.mon.detectors.open_findings()
                if f.kind == "straggler"] == [("straggler", 1)]
        assert [f["resolution"] for f in d.mon.store.findings()
                if f["kind"] == "straggler"] == [None]
    finally:
        d.mon.stop()

def test_no_probe_and_no_culprit_while_ranks_cannot_be_verified(probing):
    d = probing
    job = d.train.job
    d.sweeps(4)
    job.sim.links = links(job, "h2", CUT_OFF)
    job.front_down()  # the Lighthouse unreadable: nothing seen can be verified
    d.train.stall(4.0, d.clock.t)
    d.sweeps(6, steps=0)
    assert [f.kind for f in d.mon.detectors.job_findings()] == ["job_stall"]  # reported
    assert probes_asked(job) == 0 and network_findings(d) == []
    assert "network probes held: ranks cannot be verified" in d.mon.probes.note
    job.front_up()  # verified again: the same evidence now names the host
    (f,) = d.until(lambda: network_findings(d), "network finding", steps=0)
    assert f.evidence["host"] == "h2"


# --- acting on it: the group evicted, the host quarantined ----------------------------------
def offences(d: Driver, host: str) -> list[str]:
    return [o["kind"] for o in d.mon.store.host_offences(host)]


def test_a_network_finding_evicts_its_group_and_quarantines_its_host(probing):
    d = probing
    job = d.train.job
    d.sweeps(BASELINE_SWEEPS)
    job.sim.links = links(job, "h2", THROTTLED)
    d.until(lambda: job.kills, "an eviction", **NETWORK_SLOW)
    assert job.kills == [job.replica_ids[2]]
    (ev,) = [x for x in d.mon.store.decisions() if x["decision"] == "evict"]
    assert (ev["replica_group"], ev["reason"]) == (2, "network")
    assert ev["finding"]["evidence"]["host"] == "h2"
    assert d.mon.hosts.quarantined() == ["h2"]
    assert d.mon.hosts.hosts["h2"]["kind"] == "network"
    # quarantined in the sweep before the kill: the audit row says so, as the release to do
    assert "; host(s) h2 quarantined (POST /v1/hosts/<host>/release)" in ev["detail"], ev["detail"]
    # the bundle holds the job-wide finding that came first, with its evidence, not the trigger
    # twice
    with tarfile.open(d.mon.bundles.store.path(ev["bundle"])) as tar:
        kept = json.load(tar.extractfile(f"{ev['bundle']}/findings.json"))
    assert kept["finding"]["kind"] == "network"
    assert [f["kind"] for f in kept["related"]] == ["job_slow"], kept["related"]
    assert kept["related"][0]["evidence"]["summary"]
    # no round started with the evicted group's ranks (they are ending: a round counting on
    # them would find a host's row missing and say so); the next one asks the hosts left
    assert d.mon.probes.wait(10)
    last = d.mon.probes.to_json()["last"]
    assert last["started_at"] < ev["at"] or "h2" not in last["asked"], last["asked"]
    rounds = d.mon.probes.rounds
    d.until(lambda: d.mon.probes.wait(10) and d.mon.probes.rounds > rounds, "the next round",
            **NETWORK_SLOW)
    assert sorted(d.mon.probes.to_json()["last"]["asked"]) == ["h0", "h1", "h3"]
    # the others back at pace without group 2; its end is the eviction's: no finding, not h2's
    d.until(lambda: d.mon.cluster_json(ranks=False)["groups"][2]["status"] == "unreachable",
            "group 2 gone", pause=0.1, sweeps=100)
    d.sweeps(6)
    assert d.open_kinds() == []
    assert offences(d, "h2") == ["network"]
    assert [o for h in ("h0", "h1", "h3") for o in offences(d, h)] == []


def test_dead_counts_against_its_host_once_the_lighthouse_agrees(driver):
    d = driver
    job = d.train.job
    d.sweeps(4)
    for r in job.sim.group(3):  # the monitor loses host h3; the Lighthouse still hears it
        r.set_mode("silent")  # no answer, not even a refusal: the host, not a process
    d.sweeps(10)
    assert "dead" not in d.open_kinds()
    assert offences(d, "h3") == [] and d.mon.hosts.quarantined() == []
    job.alive.discard(3)  # now its heartbeats stop too: gone from the quorum
    d.until(lambda: d.mon.hosts.quarantined() == ["h3"], "h3 quarantined", pause=0.1,
            sweeps=100)
    assert offences(d, "h3") == ["dead"]
    (o,) = d.mon.store.host_offences("h3")
    assert o["data"]["replica_group"] == 3 and o["data"]["ranks"] == [3, 7]
    assert d.mon.store.decisions() == []  # dead is counted, not evicted (torchft dropped it)


def test_a_group_found_dead_during_a_job_stall_takes_over_its_incident(driver):
    """Group 3's host drops off while the job is stalled: its ``dead`` finding explains the
    stall (named in its evidence), and the ledger counts the one fault from the stall's onset."""
    d = driver
    d.sweeps(8)
    d.train.stall(4.0, d.clock.t)
    d.until(lambda: d.mon.detectors.job_findings(), "job_stall", steps=0)
    [stall] = d.mon.detectors.job_findings()
    lose(d.train.job, 3)
    d.until(lambda: "dead" in d.open_kinds(), "a dead finding", steps=0, pause=0.1, sweeps=100)
    [dead] = [f for f in d.mon.detectors.open_findings() if f.kind == "dead"]
    assert dead.evidence["job_findings"] == ["job_stall"] and not d.mon.detectors.job_findings()
    incs = goodput_json(d.mon)["incidents"]
    assert [(i["kind"], i["replica_group"], i["onset_source"]) for i in incs] == [
        ("dead", 3, "job_wide")]
    assert incs[0]["onset_at"] == pytest.approx(stall.first_seen, abs=1e-6)
    assert set(incs[0]["finding_ids"]) == {f["id"] for f in d.mon.store.findings()}


def test_a_job_that_ends_counts_against_no_host(driver):
    d = driver
    job = d.train.job
    d.sweeps(4)
    for g in sorted(job.alive):
        for r in job.sim.group(g):
            r.set_mode("down")
    job.alive.clear()  # every group gone at once, heartbeats too
    d.until(lambda: d.open_kinds().count("dead") == 4, "four dead findings", steps=0,
            pause=0.1, sweeps=100)
    status = lambda: d.mon.lighthouse_status  # noqa: E731
    d.until(lambda: status() and not any(map(status().heartbeating, job.replica_ids.values())),
            "the Lighthouse to hear no group", steps=0, pause=0.1, sweeps=100)
    d.sweeps(3, steps=0)
    assert [o for h in ("h0", "h1", "h2", "h3") for o in offences(d, h)] == []
    assert d.mon.hosts.quarantined() == []


# --- the survivors let out of a collective with a group that is gone ----------------------
def aborts(job: SimJob, groups) -> list[dict]:
    return [a for g in groups for r in job.sim.group(g) for a in r.aborts]


def lose(job: SimJob, g: int, heartbeats: bool = False) -> None:
    """Group ``g``'s host drops off the network: its ranks stop answering and, unless
    ``heartbeats``, the Lighthouse stops hearing it."""
    for r in job.sim.group(g):
        r.set_mode("down")
    if not heartbeats:
        job.alive.discard(g)


def test_survivors_blocked_with_a_group_gone_from_the_quorum_are_told_to_abort(probing):
    d = probing
    job = d.train.job
    d.sweeps(4)
    d.train.stall(0.5, d.clock.t)  # every group in the cross-group all_reduce
    lose(job, 3)
    d.until(lambda: len(aborts(job, (0, 1, 2))) == 6, "the six survivors told to abort",
            steps=0, pause=0.1, sweeps=100)
    assert aborts(job, (3,)) == []
    (dec,) = [x for x in d.mon.store.decisions() if x["decision"] == "abort"]
    assert (dec["replica_group"], dec["replica_id"], dec["reason"], dec["status"]) == \
        (3, job.replica_ids[3], "peer_gone", "sent")
    assert "the Lighthouse no longer hears it" in dec["detail"]
    assert {a["decision"] for a in aborts(job, (0, 1, 2))} == {dec["id"]}
    # for the quorum they are blocked in: a rank in the next one by now keeps its step
    assert {a["quorum_id"] for a in aborts(job, (0, 1, 2))} == {job.quorum_id}
    d.sweeps(3, steps=0)  # told once
    assert len(aborts(job, (0, 1, 2))) == 6
    assert [x["decision"] for x in d.mon.store.decisions()] == ["abort"]  # nobody evicted


def test_a_survivor_left_blocked_in_an_older_quorum_is_told_to_abort(probing):
    """Group 3's host drops off while group 2 is blocked with it in quorum q's all_reduce; the
    others (groups 0 and 1, done with that collective) form quorum q+1 without either. Group 3 is
    in no newer quorum, yet group 2 is still blocked in q's collective with it: told to abort
    that collective (for quorum q), not left to its process group's timeout."""
    d = probing
    job = d.train.job
    d.sweeps(4)
    q = job.quorum_id
    for r in job.sim.group(2):  # blocked in q's cross-group all_reduce
        r.update(phase="allreduce", phase_since=d.clock.t - 0.5,
                 timing={**r.state["timing"], "waiting": {"scope": "cross", "seconds": 0.5}})
    lose(job, 3)
    job.alive.discard(2)  # out of the next quorum: 0 and 1 form it alone
    assert job.requorum() > q
    job.alive.add(2)  # its Manager still heartbeats
    d.until(lambda: len(aborts(job, (2,))) == 2, "group 2's ranks told to abort",
            steps=0, pause=0.1, sweeps=100)
    assert aborts(job, (0, 1, 3)) == []
    assert {a["quorum_id"] for a in aborts(job, (2,))} == {q}
    (dec,) = [x for x in d.mon.store.decisions() if x["decision"] == "abort"]
    assert (dec["replica_group"], dec["replica_id"], dec["status"]) == (3, job.replica_ids[3],
                                                                        "sent")
    assert f"is gone from quorum {q}" in dec["detail"]


def test_a_survivor_whose_abort_failed_is_asked_again(probing):
    """A failed request (the rank's server busy) was never repeated, and the decision said
    sent: that survivor waited out the process group's timeout after all."""
    d = probing
    job = d.train.job
    d.sweeps(4)
    d.train.stall(0.5, d.clock.t)
    busy = job.sim.group(0)[0]
    busy.abort_failures = 1
    lose(job, 3)
    d.until(lambda: len(aborts(job, (0, 1, 2))) == 6, "every survivor told, one on its second try",
            steps=0, pause=0.1, sweeps=100)
    decisions = [x for x in d.mon.store.decisions() if x["decision"] == "abort"]
    assert len(decisions) == 2 and {x["status"] for x in decisions} == {"sent"}
    first = min(decisions, key=lambda x: x["id"])
    assert "HTTP 503" in first["detail"] and "asked again next sweep, try 1 of 3" in first["detail"]
    assert len(busy.aborts) == 1


def test_a_gone_incarnation_is_named_by_its_group_once_replaced():
    """The gone replica id is reported only by its group's old, superseded processes (the
    group restarted elsewhere under a new id): the abort still names the group."""
    from monitor.act.survivors import gone_groups
    from monitor.evidence.lighthouse_status import LighthouseStatus, QuorumMember
    from monitor.evidence.rank import RankView
    from tests.support.views import scratch_view

    def rank(url, g, rid, reachable, answered_at):
        state = {"replica_group": g, "rank": g, "group_rank": 0, "replica_id": rid,
                 "quorum_id": 4, "step": 10}
        return RankView(url, reachable, state, answered_at=answered_at)

    ranks = {"http://a": rank("http://a", 0, "g0:old", False, 10.0),
             "http://b": rank("http://b", 0, "g0:new", True, 20.0),
             "http://c": rank("http://c", 1, "g1:x", True, 20.0)}
    view = scratch_view(20.0, ranks)
    assert [r.url for r in view.groups[0].superseded] == ["http://a"]
    status = LighthouseStatus(4, {rid: QuorumMember(rid, 10, "", 1) for rid in ("g0:old", "g1:x")},
                              {"g1:x": 0.1})
    [gone] = gone_groups(view, status)
    assert (gone.replica_group, gone.replica_id) == (0, "g0:old")


def test_a_group_the_lighthouse_still_hears_is_not_gone(probing):
    """The monitor cut off from a healthy host (a partition on its side): the Lighthouse still
    hears the group, so nobody is aborted."""
    d = probing
    job = d.train.job
    d.sweeps(4)
    d.train.stall(0.5, d.clock.t)
    lose(job, 3, heartbeats=True)
    deadline = time.monotonic() + 2.5  # past the Lighthouse's 1 s heartbeat timeout
    while time.monotonic() < deadline:
        d.sweep(steps=0)
        time.sleep(0.1)
    assert "dead" not in d.open_kinds()
    assert aborts(job, range(4)) == [] and d.mon.store.decisions() == []


def test_no_abort_while_the_lighthouse_cannot_be_read(probing):
    d = probing
    job = d.train.job
    d.sweeps(4)
    d.train.stall(0.5, d.clock.t)
    job.front_down()
    lose(job, 3)
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        d.sweep(steps=0)
        time.sleep(0.1)
    assert aborts(job, range(4)) == []
    job.front_up()  # readable again: the same evidence now holds
    d.until(lambda: len(aborts(job, (0, 1, 2))) == 6, "the survivors told to abort",
            steps=0, pause=0.1, sweeps=100)


def test_without_the_ranks_token_nobody_is_aborted(tmp_path, job):
    clock = Clock()
    d = Driver(monitor(tmp_path, job, clock), Training(job), clock)
    job.sim.probe_token = TOKEN
    try:
        d.sweeps(4)
        d.train.stall(0.5, d.clock.t)
        lose(job, 3)
        d.until(lambda: d.mon.lighthouse_status and not d.mon.lighthouse_status.heartbeating(
            job.replica_ids[3]), "the Lighthouse to lose group 3", steps=0, pause=0.1,
            sweeps=100)
        d.sweeps(2, steps=0)
        assert aborts(job, range(4)) == [] and d.mon.store.decisions() == []
    finally:
        d.mon.stop()


# --- the verdict alone, on rounds built here ------------------------------------------------
def a_round(hosts: list[str], link, missing: dict[str, str] | None = None, control=None):
    """``control(host)``: the rank's transfer from itself, over the fine one; None: none sent."""
    from monitor.evidence.probes import HostProbe, ProbeRound

    probes = {}
    for h in hosts:
        p = HostProbe(h, f"http://{h}:1", 0, {o: f"http://{o}:1" for o in hosts if o != h},
                      status=200)
        if missing and h in missing:
            p.status, p.error = 404, missing[h]
        else:
            p.results = {o: {"ok": True, "mbit_s": 900.0, "error": None, **link(h, o)}
                         for o in hosts if o != h}
            if control is not None:
                p.control = {"ok": True, "mbit_s": 2000.0, "error": None, **control(h)}
        probes[h] = p
    return ProbeRound(0.0, 1.0, probes)


CUT = {"ok": False, "mbit_s": None, "error": "refused"}
SLOW = {"mbit_s": 20.0}


@pytest.mark.parametrize("hosts,link,missing,culprits,says", [
    (["a", "b", "c"], lambda s, d: {}, None, [], "every link alike"),
    (["a", "b", "c"], lambda s, d: SLOW, None, [], "every link alike"),
    (["a", "b", "c"], lambda s, d: CUT, None, [], "every link failed alike"),
    (["a", "b"], lambda s, d: CUT if "b" in (s, d) else {}, None, [], "cannot be placed"),
    (["a", "b", "c"], lambda s, d: CUT if "c" in (s, d) else {}, None, ["c"], "every link of c"),
    (["a", "b", "c"], lambda s, d: SLOW if d == "c" else {}, None, ["c"],
     "every transfer fetched from c"),
    (["a", "b", "c"], lambda s, d: SLOW if "c" in (s, d) else {}, {"a": "no route"}, [],
     "no probe results from a (no route)"),
    # two bad hosts among six: each is in every one of its bad links, the rest are fine
    (list("abcdef"), lambda s, d: SLOW if {s, d} & {"b", "e"} else {}, None, ["b", "e"], "of b"),
    # one host cut off while the others' rates vary with load (two links among them slow):
    # named from the failures alone
    (list("abcd"), lambda s, d: CUT if "b" in (s, d) else
     SLOW if (s, d) in (("c", "a"), ("d", "c")) else {}, None, ["b"], "every link of b failed"),
    # only the transfers fetched from d fail: named for that direction
    (list("abcd"), lambda s, d: CUT if d == "d" else {}, None, ["d"],
     "every transfer fetched from d failed"),
    # half the hosts cut off: no one is placed
    (list("abcd"), lambda s, d: CUT if {s, d} & {"a", "b"} else {}, None, [], "links bad"),
    # one bad link, no host in all bad links: nobody
    (list("abcd"), lambda s, d: CUT if (s, d) == ("a", "b") else {}, None, [], "1 of 12 links"),
])
def test_the_verdict_names_only_the_host_common_to_every_bad_link(hosts, link, missing,
                                                                  culprits, says):
    from monitor.detect.network import place

    v = place(a_round(hosts, link, missing), 0.25)
    assert v.hosts == culprits and says in v.text, v.text


@pytest.mark.parametrize("link,control,culprits,says", [
    # its process as slow serving itself (no network in the way) as across its links: busy
    (lambda s, d: SLOW if "c" in (s, d) else {}, {"c": {"mbit_s": 15.0}}, [],
     "no culprit: not c: its rank serves itself at 15.0 Mbit/s"),
    # stuck: it cannot serve itself either
    (lambda s, d: CUT if "c" in (s, d) else {},
     {"c": {**CUT, "error": "transfer: timed out (2 s) after 0 of 262144 bytes"}}, [],
     "cannot serve itself either"),
    # serving itself slower than its peers but far faster than its links: the network
    (lambda s, d: SLOW if "c" in (s, d) else {}, {"c": {"mbit_s": 300.0}}, ["c"],
     "every link of c"),
    (lambda s, d: CUT if "c" in (s, d) else {}, {}, ["c"], "every link of c failed"),
    # one busy host spared, another's network named
    (lambda s, d: SLOW if {s, d} & {"b", "e"} else {}, {"e": {"mbit_s": 9.0}}, ["b"],
     "not e: its rank serves itself"),
    # a control that could not connect fails for the network (an iptables drop, its name
    # resolved through DNS): a cut-off host is named
    (lambda s, d: CUT if "c" in (s, d) else {},
     {"c": {**CUT, "error": "connect: timed out (2 s)"}}, ["c"], "every link of c failed"),
])
def test_a_host_whose_rank_is_as_slow_serving_itself_is_not_named(link, control, culprits,
                                                                   says):
    """A rank busy in Python (its WorkerServer shares the training process's GIL) serves and
    fetches slowly on every link: its transfer from itself, with no network in it, says so."""
    from monitor.detect.network import place

    v = place(a_round(list("abcdef"), link, control=lambda h: control.get(h, {})), 0.25)
    assert v.hosts == culprits and says in v.text, v.text


@pytest.mark.parametrize("raw", [{}, {"ok": "yes"}, {"ok": None}, {"ok": True}, "fast", None])
def test_a_control_of_a_shape_not_known_spares_no_host(raw):
    """A control that says neither "worked, at a rate" nor "failed, because": none kept, so a
    cut-off host is named on its links as before."""
    from monitor.detect.network import place
    from monitor.evidence.probes import control_row

    rnd = a_round(list("abcd"), lambda s, d: CUT if "c" in (s, d) else {},
                  control=lambda h: {})
    rnd.probes["c"].control = control_row(raw)
    assert rnd.probes["c"].control is None
    assert place(rnd, 0.25).hosts == ["c"]


def test_a_spared_hosts_open_finding_stays_and_its_rounds_wait(tmp_path, job):
    """A network finding open on h2 (its eviction held: a dry run); then h2's rank turns as slow
    serving itself: those rounds spare h2, but its links are no better, so the finding is not
    closed as ``links_good``."""
    clock = Clock()
    job.sim.probe_token = TOKEN
    job.sim.links = links(job)
    d = Driver(monitor(tmp_path, job, clock, rank_exit_token=TOKEN,
                       rails=RailsConfig(min_replicas=1, cooldown_s=0, dry_run=True)),
               Training(job), clock)
    try:
        _spared_finding_stays(d, job)
    finally:
        d.mon.stop()


def _spared_finding_stays(d, job) -> None:
    d.sweeps(BASELINE_SWEEPS)
    job.sim.links = links(job, "h2", THROTTLED)
    (f,) = d.until(lambda: network_findings(d), "network finding", **NETWORK_SLOW)
    host_of = {r.url: r.state["host"] for r in job.sim.ranks}
    job.sim.control = lambda url: THROTTLED if host_of[url] == "h2" else {}
    rounds = d.mon.probes.rounds
    while d.mon.probes.rounds < rounds + 3:
        d.sweep(**NETWORK_SLOW)
        d.mon.probes.wait(10)
    d.sweep(**NETWORK_SLOW)
    assert [x.evidence["host"] for x in network_findings(d)] == ["h2"]
    assert not [x for x in d.mon.store.findings() if x["kind"] == "network"
                and x.get("resolution") == "links_good"]


def test_a_busy_ranks_host_is_never_named_over_rounds(probing):
    """The same through the monitor: the ranks' answers carry ``control``; h2's links and its
    transfer from itself are slow alike, so the job's slowdown names no host and acts on
    nothing."""
    d = probing
    d.sweeps(BASELINE_SWEEPS)
    job = d.train.job
    job.sim.links = links(job, "h2", THROTTLED)
    host_of = {r.url: r.state["host"] for r in job.sim.ranks}
    job.sim.control = lambda url: THROTTLED if host_of[url] == "h2" else {}
    for _ in range(6):
        d.sweep(**NETWORK_SLOW)
        d.mon.probes.wait(10)
    assert d.mon.probes.rounds >= 3
    assert network_findings(d) == [] and job.kills == []
    (slow,) = d.mon.detectors.job_findings()
    assert "not h2: its rank serves itself" in slow.evidence["probe"]["verdict"]
    assert slow.evidence["probe"]["asked"]["h2"]["control"]["ok"] is True


# --- job_slow on the detectors alone (tests/test_monitor_detectors.py's synthetic job) -------
@pytest.mark.parametrize("restarted", [False, True])
def test_a_group_healing_after_a_restart_is_not_a_job_slowdown(restarted):
    """Six slow steps (every group waiting longer in its collectives) right after a group's new
    incarnation joined are its healing, not a slowdown; the same steps without the restart
    are."""
    from monitor.detect import Detectors
    from tests.test_monitor_detectors import T0, Job, sweep

    job, det, now = Job(), Detectors(DetectorConfig()), T0
    job.steps(6, now=now)
    for _ in range(40):
        now += 1.0
        job.steps(1, now=now)
        assert sweep(det, job, now) == []
    assert det.jobwide.baseline_medians() is not None
    if restarted:
        for r in job.members(1):
            job.states[r]["replica_id"] = "replica_group_1:restarted"
    found = []
    for i in range(12):
        now += 1.0
        job.steps(1, noise=0.4 if i < 6 else 0.03, now=now)
        found += [f.kind for f in sweep(det, job, now)]
    assert found == ([] if restarted else ["job_slow"])


def test_probing_starts_at_the_first_slow_window(probing):
    """The mesh is asked while ``job_slow`` is still pending, so its two rounds are in by the
    time the job-wide finding is: the host is named no later than one round after it."""
    d = probing
    d.sweeps(BASELINE_SWEEPS)
    d.train.job.sim.links = links(d.train.job, "h2", THROTTLED)
    # the round starts inside the sweep that saw the first slow window; its requests reach the
    # ranks from the round's own thread, which under load may be after further sweeps
    d.until(lambda: round_started(d), "a probe round", **NETWORK_SLOW)
    assert d.mon.detectors.job_findings() == []  # started before job_slow is confirmed
    deadline = time.monotonic() + 10
    while not probes_asked(d.train.job) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert probes_asked(d.train.job), "the round asked no rank"
    d.until(lambda: d.mon.detectors.job_findings(), "job_slow", **NETWORK_SLOW)
    sweeps = 0
    while not network_findings(d) and sweeps < 10:
        d.mon.probes.wait(5)  # the round under way finishes (its own thread), as in real time
        d.sweep(**NETWORK_SLOW)
        sweeps += 1
    (f,) = network_findings(d)
    assert f.evidence["host"] == "h2"
    assert sweeps <= 2, f"named {sweeps} sweeps after job_slow"


def test_a_shard_calls_a_group_of_another_slice_gone_on_the_other_shards_word():
    """A shard polls its slice: a group of another slice that the Lighthouse stops hearing was
    gone to it at once (no rank it reaches reports it), so one vantage point, the Lighthouse,
    aborted its survivors' healthy step. The other shards' reports are the second."""
    from monitor.act.survivors import gone_groups
    from monitor.evidence.lighthouse_status import LighthouseStatus, QuorumMember
    from monitor.evidence.rank import RankView
    from tests.support.monitor_sim import rank_state
    from tests.support.views import scratch_view

    mine, other = "replica_group_0:a", "replica_group_1:b"
    status = LighthouseStatus(quorum_id=5, members={r: QuorumMember(r, 100, "store", 1)
                                                    for r in (mine, other)},
                              heartbeats={mine: 0.1, other: 30.0}, stale=frozenset({other}))
    url = "http://127.0.0.1:9000"
    view = scratch_view(1000.0, {url: RankView(url, True, {**rank_state(0, 0), "replica_id": mine})})
    assert [g.replica_id for g in gone_groups(view, status)] == [other]  # one monitor's view

    def gone(elsewhere, evicted=frozenset()):  # a shard's: the other shards' word counts too
        return [g.replica_id for g in gone_groups(view, status, evicted, lambda: elsewhere)]

    assert gone(({other}, True)) == []  # its own shard's ranks still answer as it
    assert gone((set(), True)) == [other]  # every other shard said: none reports it
    assert gone((set(), False)) == []  # a shard did not say (etcd away, an older monitor)
    assert gone((set(), False), {other}) == [other]  # ... but the leader killed it


def test_job_slow_stores_the_group_torchfts_quorum_waited_for_once_it_is_named(driver, caplog):
    """Every rank serves its quorum waits, alike at pace and in a network slowdown: job_slow
    opens naming no group. Then group 1's second rank turns slow before its quorum call (every
    other rank waits for it in the quorum, so every group waits alike at the cross-group step):
    the stored finding (what /v1/findings serves) names group 1 and that rank while it is open,
    not at its end."""
    d, job = driver, driver.train.job
    slow = job.sim.group(1)[1]
    steps, before_quorum = d.train.steps, [False]

    def with_quorum_waits(n, now, **kw):
        steps(n, now, **kw)
        for g in job.alive:
            for r in job.sim.group(g):
                t = r.state["timing"]
                r.update(timing={**t, "recent_quorum": [
                    {"step": row["step"], "wait_quorum_s": 0.003 if r is slow and before_quorum[0]
                     else max(0.0, row["wait_cross_s"] - 0.01)} for row in t["recent"]]})

    d.train.steps = with_quorum_waits
    d.sweeps(BASELINE_SWEEPS)
    d.sweeps(4, **NETWORK_SLOW)
    (f,) = d.mon.store.findings()
    assert f["kind"] == "job_slow" and f["evidence"]["quorum_late"] is None
    assert "a network fault slows them all" in f["evidence"]["summary"]
    before_quorum[0] = True
    d.sweeps(6, **NETWORK_SLOW)
    (f,) = d.mon.store.findings()
    q = f["evidence"]["quorum_late"]
    assert f["resolved_at"] is None and q is not None, f["evidence"]["summary"]
    assert (q["group"], q["rank"]) == (1, slow.state["rank"])
    assert "group 1 arrives at torchft's quorum" in f["evidence"]["summary"]
    # its confirmation's log line blamed the network: one more says whom it names now
    named = [r.getMessage() for r in caplog.records if r.getMessage().startswith("job_slow now")]
    assert len(named) == 1 and "group 1 arrives at torchft's quorum" in named[0], named
    assert d.mon.store.decisions() == []  # named, never evicted
