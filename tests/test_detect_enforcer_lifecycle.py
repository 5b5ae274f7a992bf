"""Finding lifecycles as the enforcer acts on them (monitor/act/enforcer.py): a host a network
finding names only from its refresh on is charged then; a finding of a group no rank of which
answers waits, however the rails stand. A real Enforcer, Store and HostLedger in process, its
Lighthouse a recorder of kills; views built as the service builds them."""

from __future__ import annotations

import contextlib
import shutil
import sqlite3

import pytest

from monitor.act.actions import Outcome
from monitor.act.bundles import Bundles
from monitor.act.enforcer import Enforcer
from monitor.act.hosts import HostLedger
from monitor.api.metrics import MonitorMetrics
from monitor.config import BundleConfig, DetectorConfig, MonitorConfig, RailsConfig
from monitor.detect import Detectors
from monitor.detect.findings import Finding
from monitor.evidence.lighthouse_settings import LighthouseSettingsWatch
from monitor.evidence.rank import RankView
from monitor.evidence.verification import VERIFIED, Trust
from monitor.evidence.view import ViewBuilder
from monitor.store import Store
from tests.support.views import scratch_view
from tests.test_detect_network_hosts import cut
from tests.test_monitor_detectors import T0, Job
from tests.test_upgrade_compat import OLD


class Kills:
    """The Lighthouse: records each kill and answers as torchft does to one it delivers."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def kill(self, replica_id: str) -> Outcome:
        self.sent.append(replica_id)
        return Outcome(True, 200, "killed")


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock():
    return Clock(T0)


@pytest.fixture
def make(tmp_path, clock):
    stores = []

    def build(detectors: Detectors, job: str = "t", **rails) -> Enforcer:
        cfg = MonitorConfig(state_path=str(tmp_path / "state.sqlite"), job=job,
                            bundles=BundleConfig(enabled=False), rails=RailsConfig(**rails))
        store = Store(cfg.state_path)
        stores.append(store)
        hosts = HostLedger(store, cfg.quarantine, [], cfg.job, clock)
        return Enforcer(cfg, store, detectors, hosts, Kills(), LighthouseSettingsWatch(),
                        MonitorMetrics(cfg.job), lambda: None, clock, Bundles(cfg, store, clock))

    yield build
    for s in stores:
        s.close()


# (url, replica group, rank, host): group 1 runs on b and c, no other group on c
RANKS = [("a", 0, 0, "a"), ("b", 1, 1, "b"), ("c", 1, 2, "c"), ("d", 2, 3, "d"),
         ("e", 3, 4, "e"), ("f", 4, 5, "f")]


def probed_view(now: float):
    ranks = {}
    for name, g, rank, host in RANKS:
        url = f"http://{name}:1"
        ranks[url] = RankView(url, True, {
            "replica_group": g, "rank": rank, "group_rank": rank - min(
                r for _, gg, r, _ in RANKS if gg == g), "group_world_size": 2,
            "replica_id": f"rg{g}:x", "quorum_id": 7, "participating": True, "step": 10,
            "host": host}, answered_at=now)
    view = scratch_view(now, ranks)
    view.evidence_view = view
    return view


def network_offences(enf: Enforcer, host: str) -> list[dict]:
    return [o for o in enf.store.host_offences(host) if o["kind"] == "network"]


def test_a_host_a_network_finding_names_a_round_after_it_opened_is_charged(make, clock):
    """Group 1 spans b and c. Round 2 confirms b (group 1's finding opens, b charged); round 3
    confirms c: the same finding now names c too, and c is charged once, then (a round naming
    both again charges nobody twice)."""
    det = Detectors(DetectorConfig())  # --probe-rounds 2
    enf = make(det)
    view = probed_view(clock.t)
    det.findings.confirm("job_stall", None, [], {"summary": "stalled", "probe": None,
                                                 "step": 10}, clock.t, clock.t, view)

    def round_(*hosts: str) -> None:
        clock.t += 1.0
        new = enf.record(det.network(view, cut(*hosts), clock.t, None), clock.t)
        enf.judge_hosts(view, new, clock.t)

    round_("b")
    round_("b", "c")
    assert [o["data"]["replica_group"] for o in network_offences(enf, "b")] == [1]
    assert network_offences(enf, "c") == []
    round_("b", "c")
    (f,) = [x for x in det.open_findings() if x.kind == "network"]
    assert f.evidence["hosts"] == ["b", "c"]
    (o,) = network_offences(enf, "c")
    assert o["data"]["counts"] and o["data"]["ranks"] == [2]
    assert o["finding_id"] == enf.finding_id(f.key)
    round_("b", "c")
    assert len(network_offences(enf, "b")) == len(network_offences(enf, "c")) == 1


def verified(job: Job, now: float):
    """The job's view with every rank verified (its answers evidence)."""
    return job.view(now, judge=lambda ranks, changed: {
        u: Trust(VERIFIED, "ok", "verified", True) for u in changed})


def held_straggler(job: Job, enf: Enforcer, clock: Clock, g: int) -> Finding:
    """An open straggler finding of group ``g``, recorded and held by the cooldown (a manual
    eviction of the last group just now)."""
    view = verified(job, clock.t)
    last = job.n - 1
    enf.evict_manual(view, view.evidence(), last, job.states[job.members(last)[0]]["replica_id"],
                     "test")
    culprits = [{"rank": r, "host": f"host-g{g}"} for r in job.members(g)]
    f = Finding("straggler", g, job.states[job.members(g)[0]]["replica_id"], job.members(g),
                {"culprits": culprits, "summary": "late"}, clock.t, clock.t)
    enf.detectors.report(f)
    enf.record([f], clock.t)
    clock.t += 1.0
    view = verified(job, clock.t)
    enf.decide(view, view.evidence(), clock.t)
    assert [(d["decision"], d["reason"]) for d in enf.store.decisions(decision="hold")] == [
        ("hold", "cooldown")]
    return f


def test_a_finding_of_a_group_out_of_sight_waits_while_the_cooldown_ends(make, clock):
    """A straggler held by the cooldown; its group answers no sweep while the cooldown elapses
    (its host down, --dead-sweeps not reached): no kill for a group nobody sees, no decision
    said; once it answers again, it is evicted."""
    job = Job(groups=4)
    enf = make(Detectors(DetectorConfig()), min_replicas=2, cooldown_s=30)
    f = held_straggler(job, enf, clock, 1)
    kills = enf.lighthouse.sent[:]
    job.down = set(job.members(1))
    clock.t += 40.0  # the cooldown over
    view = verified(job, clock.t)
    enf.decide(view, view.evidence(), clock.t)
    assert enf.lighthouse.sent == kills
    assert [d["reason"] for d in enf.store.decisions()] == ["cooldown", "manual"]
    job.down = set()
    clock.t += 1.0
    view = verified(job, clock.t)
    enf.decide(view, view.evidence(), clock.t)
    assert enf.lighthouse.sent == [*kills, f.replica_id]


def kill_group_3(make, clock) -> None:
    """Job t's monitor kills group 3 (by hand: a kill the cooldown counts)."""
    old = Job(groups=4)
    view = verified(old, clock.t)
    make(Detectors(DetectorConfig())).evict_manual(
        view, view.evidence(), 3, old.states[old.members(3)[0]]["replica_id"], "test")


def straggler_decided(enf: Enforcer, now: float) -> str:
    """Group 1 of a new job found a straggler and decided on at ``now``: its replica id."""
    new = Job(groups=4)
    f = Finding("straggler", 1, new.states[new.members(1)[0]]["replica_id"], new.members(1),
                {"culprits": [{"rank": r, "host": "host-g1"} for r in new.members(1)],
                 "summary": "late"}, now, now)
    enf.detectors.report(f)
    enf.record([f], now)
    view = verified(new, now)
    enf.decide(view, view.evidence(), now)
    return f.replica_id


@pytest.mark.parametrize("job, held", [("t", True), ("other", False)])
def test_the_cooldown_counts_only_this_jobs_kills(make, clock, job, held):
    """Job t's monitor kills a group, then a monitor starts on its --state: restarted for job
    t it keeps the cooldown; started for another --job, its first automatic eviction is not
    held by job t's kill (before, it was, for the whole --cooldown)."""
    kill_group_3(make, clock)
    clock.t += 10.0
    enf = make(Detectors(DetectorConfig()), job=job, min_replicas=2, cooldown_s=600)
    rid = straggler_decided(enf, clock.t)
    assert enf.lighthouse.sent == ([] if held else [rid])
    assert [d["reason"] for d in enf.store.decisions(decision="hold")] == (
        ["cooldown"] if held else [])


@pytest.mark.parametrize("older_file", [False, True])
def test_a_jobs_cooldown_outlasts_another_jobs_monitor_on_its_state(make, clock, tmp_path,
                                                                     older_file):
    """A -> B -> A: job t's monitor kills a group, a monitor started by mistake with another
    --job on its --state runs a while, and t's monitor, restarted 10 s after its kill, holds
    its next automatic eviction for the --cooldown (before, the other job's start had moved
    the cooldown's start past t's kill). ``older_file``: the kill is in the last release's
    --state, from before decisions named their job; it counts for every job."""
    if older_file:
        shutil.copy(OLD / "monitor.sqlite", tmp_path / "state.sqlite")
        with contextlib.closing(sqlite3.connect(tmp_path / "state.sqlite")) as db:
            clock.t = db.execute("SELECT MAX(at) FROM decisions WHERE decision='evict'"
                                 ).fetchone()[0]
    else:
        kill_group_3(make, clock)
    clock.t += 5.0
    make(Detectors(DetectorConfig()), job="mistaken")
    clock.t += 5.0
    enf = make(Detectors(DetectorConfig()), min_replicas=2, cooldown_s=600)
    straggler_decided(enf, clock.t)
    assert enf.lighthouse.sent == []
    assert [d["reason"] for d in enf.store.decisions(decision="hold")] == ["cooldown"]


def test_a_host_added_to_a_finding_whose_first_write_failed_is_charged_once(make, clock,
                                                                              monkeypatch):
    """Group 1's finding opens on b the round c is first cut (c's streak 1) and its write fails
    (the disk full: the sweep aborts). The next round's refresh names c too, and the finding is
    charged as new then, c by its own culprits: the widening must not charge c a second time."""
    import sqlite3

    det = Detectors(DetectorConfig())  # --probe-rounds 2
    enf = make(det)
    view = probed_view(clock.t)
    det.findings.confirm("job_stall", None, [], {"summary": "stalled", "probe": None,
                                                 "step": 10}, clock.t, clock.t, view)
    enf.record(det.job_findings(), clock.t)
    real = enf.store.add_finding
    full = {"on": False}

    def add_finding(f: dict):
        if full["on"] and f["kind"] == "network":
            raise sqlite3.OperationalError("database or disk is full")
        return real(f)

    monkeypatch.setattr(enf.store, "add_finding", add_finding)

    def round_(*hosts: str) -> None:
        clock.t += 1.0
        new = enf.record(det.network(view, cut(*hosts), clock.t, None), clock.t)
        enf.judge_hosts(view, new, clock.t)

    round_("b")
    full["on"] = True
    with pytest.raises(sqlite3.OperationalError):
        round_("b", "c")
    full["on"] = False
    round_("b", "c")
    round_("b", "c")
    (f,) = [x for x in det.open_findings() if x.kind == "network"]
    assert f.evidence["hosts"] == ["b", "c"]
    (o,) = network_offences(enf, "c")
    assert o["data"]["ranks"] == [2] and o["finding_id"] == enf.finding_id(f.key)
    assert len(network_offences(enf, "b")) == 1


def test_an_episode_a_previous_run_never_charged_counts_when_found_again(make, clock):
    """Run A: group 1 dead, the Lighthouse agrees: host-g1 charged and quarantined, then
    released; A stops with the finding open. Run B: group 1 steps on healthy (that episode
    over) and dies again (a new finding) while the Lighthouse cannot be read: not charged yet;
    B stops. Run C finds it again and the Lighthouse agrees: that episode's offence counts.
    Before, a finding confirmed again was skipped whenever its host's newest offence of that
    replica id was closed by a restart (A's): the second episode never counted."""
    from monitor.evidence.lighthouse_status import LighthouseStatus

    job = Job()
    rids = [job.states[job.members(g)[0]]["replica_id"] for g in range(3)]

    def lighthouse(dead: bool) -> LighthouseStatus:
        return LighthouseStatus(3, {}, {r: 30.0 if dead and r == rids[1] else 0.1
                                        for r in rids},
                                frozenset({rids[1]}) if dead else frozenset())

    def run() -> Enforcer:
        """A monitor started on the --state: the previous run's episodes marked, as Monitor."""
        enf = make(Detectors(DetectorConfig()), min_replicas=1)
        enf.detectors.restarted = enf.store.restart_marks(clock.t)
        return enf

    def healthy(enf: Enforcer, sweeps: int) -> None:
        job.down = set()
        for _ in range(sweeps):
            clock.t += 1.0
            job.steps(3, now=clock.t)
            view = verified(job, clock.t)
            new = enf.detectors.update(view.evidence(), None, clock.t, full_view=view,
                                       lighthouse=lighthouse(False))
            new += enf.host_findings(view, view.evidence(), clock.t, None)  # the hosts known
            enf.judge_hosts(view, enf.record(new, clock.t), clock.t, lighthouse(False))

    def dead(enf: Enforcer, lh: LighthouseStatus | None) -> str:
        """Group 1 confirmed dead, as liveness does: host-g1's state after."""
        clock.t += 1.0
        job.down = set(job.members(1))
        view = verified(job, clock.t)
        f = enf.detectors.findings.confirm("dead", view.groups[1], job.members(1),
                                           {"summary": "down", "unreachable": {}},
                                           clock.t - 5, clock.t, view)
        new = [f, *enf.host_findings(view, view.evidence(), clock.t, None)]
        enf.judge_hosts(view, enf.record(new, clock.t), clock.t, lh)
        return {h["host"]: h["state"] for h in enf.hosts.to_json(clock.t)}["host-g1"]

    enf = run()
    healthy(enf, 2)
    assert dead(enf, lighthouse(True)) == "quarantined"
    enf.release_host("host-g1", "hardware swapped")
    enf = run()
    healthy(enf, 3)
    assert dead(enf, None) == "released"  # waits for the Lighthouse
    enf = run()
    assert dead(enf, lighthouse(True)) == "quarantined"
    assert [(o["data"]["counts"], o["data"].get("note")) for o in
            enf.store.host_offences("host-g1")] == [(True, None), (True, None)]


def monitor_run(make, clock, job: str = "t") -> Enforcer:
    """A monitor of ``job`` started on the --state: its restart marks taken, as Monitor does."""
    enf = make(Detectors(DetectorConfig(straggler_steps=6, hang_floor_s=1.0, dead_sweeps=2),
                         clock=clock), job=job)
    enf.detectors.restarted = enf.store.restart_marks(clock.t)
    return enf


def stall(enf: Enforcer, job: Job, clock: Clock, healthy: int, ranks: int = 0) -> list[Finding]:
    """``healthy`` sweeps of steps, then every rank from ``ranks`` on in the cross-group
    collective (a fresh view builder: a new monitor's) for three sweeps: the findings recorded."""
    job.vb, found = ViewBuilder(), []
    for i in range(healthy + 3):
        if i < healthy:
            job.steps(3, now=clock.t + 1.0, noise=0.01)
        else:
            for r in range(ranks, job.world):
                job.wait(r, "cross", 5.0, phase="allreduce")
        clock.t += 1.0
        view = verified(job, clock.t)
        wanted = enf.detectors.fr_wanted(view, clock.t)
        found += enf.record(enf.detectors.update(view.evidence(), job.dumps() if wanted else None,
                                                 clock.t, full_view=view), clock.t)
    return found


def stalls_counted(enf: Enforcer) -> float:
    return enf.metrics.registry.get_sample_value("lightkeeper_monitor_findings_total", {
        "job": enf.cfg.job, "kind": "job_stall", "replica_group": "job"}) or 0.0


def test_another_jobs_restart_mark_confirms_none_of_this_jobs_findings(make, clock):
    """Job t's monitor stops with a job_stall open; a monitor of job u on its --state (one keeps
    the audit log) finds u's first stall: counted, confirming nothing again. t's monitor back,
    its job still stalled: that episode found again, not counted again. Before, t's episode,
    keyed by kind alone, was taken as found again by u: u's findings_total stayed 0."""
    t = Job()
    t.step = 1488
    (first,) = stall(monitor_run(make, clock), t, clock, 4)
    enf = monitor_run(make, clock, "u")
    (f,) = stall(enf, Job(seed=5), clock, 1)
    assert (f.reconfirms, stalls_counted(enf)) == (None, 1)
    enf = monitor_run(make, clock)
    (again,) = stall(enf, t, clock, 0)
    assert (again.reconfirms, stalls_counted(enf)) == (enf.store.findings()[-1]["id"], 0)


@pytest.mark.parametrize("after", ["stalled", "through", "healed"])
def test_a_stall_healed_while_no_monitor_ran_counts_when_it_comes_back(make, clock, after):
    """Job t stalls at step 1500; its monitor stops with the job_stall open. ``healed``: with no
    monitor, the stall clears, the job commits 21 steps and stalls again: the next monitor's
    first look has the job past 1500, that episode over, and the new stall counts. Before, the
    restart mark started at that first look's step (the new stall's): taken as the old one found
    again, not counted. ``stalled``: the same stall, found again, not counted again; so too
    ``through``: groups 0 and 1 through the collective (step 1501) while group 2 is still in it,
    no step committed job-wide."""
    job = Job()
    job.step = 1488
    stall(monitor_run(make, clock), job, clock, 4)
    if after == "healed":
        for _ in range(7):
            clock.t += 1.0
            job.steps(3, now=clock.t, noise=0.01)
    for r in range(job.members(2)[0] if after == "through" else 0):
        job.states[r].update(step=1501, phase="quorum", phase_since=clock.t)
        job.wait(r, None)
    enf = monitor_run(make, clock)
    (f,) = stall(enf, job, clock, 0, 4 if after == "through" else 0)
    assert f.evidence["step"] == {"stalled": 1500, "through": 1501, "healed": 1521}[after]
    assert (f.reconfirms, stalls_counted(enf)) == ((None, 1) if after == "healed" else (1, 0))


def test_an_older_files_open_finding_is_no_jobs_restart_mark(tmp_path):
    """The last release's --state left a dead finding open, from before findings named their
    job: a monitor started on it closes it and marks it for no job (found again, it counts once
    more rather than hide another job's first finding)."""
    shutil.copy(OLD / "monitor.sqlite", tmp_path / "state.sqlite")
    store = Store(str(tmp_path / "state.sqlite"))
    store.job = "lightkeeper"
    try:
        assert store.restart_marks(T0) == {}
        assert [f["resolution"] for f in store.findings()] == ["monitor_restarted", "left_job"]
    finally:
        store.close()
