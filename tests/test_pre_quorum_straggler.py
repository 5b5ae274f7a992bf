"""A rank slow before its torchft quorum call (data loading, logging before ``zero_grad``) is a
straggler (monitor/detect/pre_quorum.py): its group's peers wait for it inside the quorum call
like every other group, so the group shows no arrival lag and job_slow names it in
``quorum_late``; once the rank's own work (its compute a step over the other ranks', against
its own at pace) explains half its group's rise in lag, for --straggler-windows windows, a
``straggler`` finding (cause ``before_quorum``) names it and job_slow is explained. A network
slowdown that moves a group's quorum lag (another group's work ended before it) raises nobody's
own work: nothing is found.

The step model and poll path are tests/test_job_slow_quorum.py's (rows served packed, read by
the poller, judged by the real Detectors); the enforcer is the real one, its Lighthouse a
recorder of kills (tests/test_detect_enforcer_lifecycle.py)."""

from __future__ import annotations

import random

import pytest

from monitor.act.bundles import Bundles
from monitor.act.enforcer import Enforcer
from monitor.act.hosts import HostLedger
from monitor.api.metrics import MonitorMetrics
from monitor.config import BundleConfig, DetectorConfig, MonitorConfig, RailsConfig
from monitor.detect import Detectors
from monitor.evidence.lighthouse_settings import LighthouseSettingsWatch
from monitor.store import Store
from tests.test_detect_enforcer_lifecycle import Clock, Kills
from tests.test_job_slow_quorum import QuorumJob
from tests.test_monitor_detectors import T0


def zero(g, r):
    return 0.0


def run(groups: int, ranks: int, phases: list[dict], *, use_async: bool = False,
        enforcer=None, cfg: DetectorConfig | None = None) -> tuple[Detectors, list[dict]]:
    """Each phase ``sweeps`` sweeps of ``pre`` (and ``net``) as in test_job_slow_quorum's
    ``phased``; per sweep: its phase's tag, the findings opened, the open ones by kind, and
    job_slow's quorum_late. ``enforcer(det) -> Enforcer``: each sweep's findings recorded, hosts
    judged and decided on, the views verified."""
    job, det, rng = QuorumJob(groups=groups, ranks=ranks, seed=1), Detectors(
        cfg or DetectorConfig()), random.Random(1)
    enf, now, log = enforcer(det) if enforcer else None, T0, []
    for ph in phases:
        job.active = ph.get("groups")  # None: all; ``rid``: {group: suffix}, a group restarted
        for r, s in enumerate(job.states):
            s.update(num_participants=len(job.active or range(groups)),
                     quorum_id=ph.get("qid", 3), replica_id=f"replica_group_{r // ranks}:"
                     f"{ph.get('rid', {}).get(r // ranks, 'sim')}")
        for _ in range(ph["sweeps"]):
            now += 1.0
            for _ in range(6):
                job.model(ph["pre"], rng, use_async=use_async, net=ph.get("net", 0.0),
                          old=ph.get("old", ()))
            job.steps(0, now=now)
            view = job.view(now)  # verified as the service does
            new = det.update(view.evidence(), None, now, full_view=view)
            if enf is not None:
                enf.clock.t = now
                enf.judge_hosts(view, enf.record(new, now), now)  # as the service does
                enf.decide(view, view.evidence(), now)
            slow = det.findings.open.get(("job_slow", None, None))
            log.append({"tag": ph.get("tag"), "new": new, "now": now,
                        "open": {f.kind: f for f in det.open_findings()},
                        "quorum_late": slow.evidence["quorum_late"] if slow else None})
    return det, log


def found(log: list[dict]) -> list:
    return [f for s in log for f in s["new"] if f.kind == "straggler"]


@pytest.fixture
def make(tmp_path):
    stores = []

    def build(det: Detectors, **rails) -> Enforcer:
        cfg = MonitorConfig(state_path=str(tmp_path / "state.sqlite"), job="t",
                            bundles=BundleConfig(enabled=False), rails=RailsConfig(**rails))
        clock = Clock(T0)
        store = Store(cfg.state_path)
        stores.append(store)
        return Enforcer(cfg, store, det, HostLedger(store, cfg.quarantine, [], cfg.job, clock),
                        Kills(), LighthouseSettingsWatch(), MonitorMetrics(cfg.job),
                        lambda: None, clock, Bundles(cfg, store, clock))

    yield build
    for s in stores:
        s.close()


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("groups,ranks", [(3, 2), (2, 4)])
def test_a_rank_slow_before_its_quorum_is_found_a_straggler(groups, ranks, use_async):
    """Rank ``slow`` (the last group's last rank) works 0.3 s before its quorum call: job_slow
    names its group, then a straggler finding names the rank (cause before_quorum), from
    job_slow's onset; job_slow is explained."""
    slow, late = groups * ranks - 1, groups - 1
    det, log = run(groups, ranks, [
        {"sweeps": 14, "pre": zero},
        {"sweeps": 6, "pre": lambda g, r: 0.3 if g * ranks + r == slow else 0.0}],
        use_async=use_async)
    (f,) = found(log)
    assert (f.replica_group, f.ranks, f.evidence["cause"]) == (late, [slow], "before_quorum")
    ev = f.evidence
    assert ev["culprit_hosts"] == [f"host-g{late}"]
    assert ev["lag_s"] == pytest.approx(0.3, abs=0.02)
    assert ev["extra_work_s"] - ev["baseline_extra_work_s"] == pytest.approx(0.3, abs=0.02)
    assert ev["lag_s"] >= ev["threshold_s"] and ev["job_slow_ratio"] > 1.5
    assert f"rank {slow} on host host-g{late} is slow before its quorum call" in ev["summary"]
    (j,) = [x for x in det.resolved_findings() if x.kind == "job_slow"]
    assert j.resolution == "explained" and f.first_seen == j.first_seen
    at = next(i for i, s in enumerate(log) if f in s["new"])
    assert log[at]["open"].get("job_slow") is j, "found while job_slow was open"


def test_the_enforcer_evicts_a_straggler_found_before_its_quorum(make):
    """The real enforcer records an eviction for the before_quorum straggler, sends its group's
    kill and charges its host an offence, as for any straggler."""
    built = []

    def enforcer(det: Detectors) -> Enforcer:
        built.append(make(det))
        return built[-1]

    det, log = run(3, 2, [{"sweeps": 14, "pre": zero},
                          {"sweeps": 6, "pre": lambda g, r: 0.3 if (g, r) == (2, 1) else 0.0}],
                   enforcer=enforcer)
    (f,) = found(log)
    (enf,) = built
    assert enf.lighthouse.sent == [f.replica_id]
    assert [(d["decision"], d["finding_id"]) for d in enf.store.decisions(decision="evict")] == [
        ("evict", enf.finding_id(f.key))]
    assert [o["kind"] for o in enf.store.host_offences("host-g2")] == ["straggler"]


def logs(y: float):
    return lambda g, r: y if (g, r) == (0, 0) else 0.0


@pytest.mark.parametrize("use_async", [False, True])
def test_a_network_slowdown_beside_steady_pre_quorum_work_finds_no_straggler(use_async):
    """The re-reviews' shapes where job_slow names a group no rank of which works more than it
    did at pace: (1) global rank 0 logs 0.3 s before its quorum all along, then the network
    slows; (2) rank 0 logs 0.4 s, group 1's data loading takes 0.6 s during the baseline, the
    network degrades mildly (nothing learned, job_slow closed) while that loading ends, then
    slows further: group 0's quorum lag rose by what group 1 stopped doing, and job_slow names
    it; (3) as (2), group 1's loading ending at pace before the slowdown. No straggler."""
    both = {(0, 0): 0.4, (1, 0): 0.6}
    drift = [{"sweeps": 14, "pre": lambda g, r: both.get((g, r), 0.0)},
             {"sweeps": 4, "pre": lambda g, r: both.get((g, r), 0.0), "net": 0.35},
             {"sweeps": 5, "pre": logs(0.4), "net": 0.55},
             {"sweeps": 10, "pre": logs(0.4), "net": 0.8}]
    for groups, ranks, phases, named in [
            (2, 4, [{"sweeps": 14, "pre": logs(0.3)}, {"sweeps": 10, "pre": logs(0.3),
                                                        "net": 0.3}], False),
            (2, 2, drift, True), (2, 4, drift, True),
            (2, 4, [{"sweeps": 14, "pre": lambda g, r: {(0, 0): 0.3, (1, 0): 0.5}.get(
                (g, r), 0.0)}, {"sweeps": 4, "pre": logs(0.3)},
                {"sweeps": 10, "pre": logs(0.3), "net": 0.7}], False)]:
        det, log = run(groups, ranks, phases, use_async=use_async)
        slow = [s for s in log if "job_slow" in s["open"]]
        assert slow, "job_slow fires"
        if named:  # job_slow's evidence names group 0 (its lag moved with group 1's work)
            assert {s["quorum_late"]["group"] for s in slow if s["quorum_late"]} == {0}
        assert found(log) == [] and "straggler" not in log[-1]["open"]


@pytest.mark.parametrize("use_async", [False, True])
def test_a_held_before_quorum_straggler_resolves_once_the_rank_catches_up(make, use_async):
    """--dry-run holds the finding; the rank's pre-quorum work goes on 8 sweeps (its group
    never late by arrival lag: the straggler's own rule would close it each window), then
    ends: resolved caught_up at the first window at pace, not before."""
    built = []

    def enforcer(det: Detectors) -> Enforcer:
        built.append(make(det, dry_run=True))
        return built[-1]

    slow = {"sweeps": 8, "pre": lambda g, r: 0.3 if (g, r) == (1, 1) else 0.0, "tag": "slow"}
    det, log = run(3, 2, [{"sweeps": 14, "pre": zero}, slow,
                          {"sweeps": 4, "pre": zero, "tag": "over"}],
                   use_async=use_async, enforcer=enforcer)
    (f,) = found(log)
    at = next(i for i, s in enumerate(log) if f in s["new"])
    assert all(s["open"].get("straggler") is f for s in log[at:] if s["tag"] == "slow")
    assert built[0].lighthouse.sent == [] and f.resolution == "caught_up"
    over = [s for s in log if s["tag"] == "over"]
    assert over[0]["open"].get("straggler") is None and f.resolved_at == over[0]["now"]


@pytest.mark.parametrize("use_async", [False, True])
def test_a_held_finding_with_no_quorum_lag_to_read_resolves_at_pace(make, use_async):
    """Held (dry run here; a cooldown, min_replicas in life) while the rank recovers and another
    rank serves no quorum waits: no lag to read, the finding stayed open for good, and a rail
    lifting later would evict a group that recovered. The job back at pace ends it."""
    built = []

    def enforcer(det: Detectors) -> Enforcer:
        built.append(make(det, dry_run=True))
        return built[-1]

    det, log = run(3, 2, [{"sweeps": 14, "pre": zero},
                          {"sweeps": 6, "pre": lambda g, r: 0.3 if (g, r) == (1, 1) else 0.0},
                          {"sweeps": 6, "pre": zero, "old": (0,), "tag": "over"}],
                   use_async=use_async, enforcer=enforcer)
    (f,) = found(log)
    assert f.resolution == "caught_up" and built[0].lighthouse.sent == []
    assert log[-1]["open"].get("straggler") is None


@pytest.mark.parametrize("unread", [False, True])
def test_a_rank_still_late_keeps_its_finding_though_the_step_is_near_pace(unread):
    """--job-slow-factor 2: half way to it allows a step 1.5x its baseline, so a rank recovered
    only to 0.12 s late (over the 0.1 s floor), its lag unread (rank 0 serving no quorum waits),
    read as at pace and its finding closed; its next burst opened a second one (a second
    offence). The step's rise, which bounds any lag, must be under the threshold too."""
    late = {"sweeps": 8, "pre": lambda g, r: 0.12 if (g, r) == (2, 1) else 0.0}
    if unread:
        late["old"] = (0,)
    burst = {"sweeps": 4, "pre": lambda g, r: 0.6 if (g, r) == (2, 1) else 0.0}
    det, log = run(3, 2, [{"sweeps": 14, "pre": zero}, burst, late, {**burst, "sweeps": 6}],
                   cfg=DetectorConfig(job_slow_factor=2.0))
    (f,) = found(log)
    assert f.resolved_at is None and f.replica_group == 2


@pytest.mark.parametrize("use_async", [False, True])
def test_a_group_restarted_still_slow_is_found_again(use_async):
    """The trouble stays with the host (another process takes its CPU): the group evicted comes
    back under a new replica id, as slow. Its lag at pace was learned with the old incarnation,
    and a lag is held only against the same groups, so job_slow reopened blaming the network and
    no second straggler (no second offence: the host never quarantined). The incarnation after
    one found here is held against the one before."""
    slow = lambda g, r: 0.4 if (g, r) == (2, 1) else 0.0  # noqa: E731
    det, log = run(3, 2, [{"sweeps": 14, "pre": zero}, {"sweeps": 4, "pre": slow},
                          {"sweeps": 3, "pre": slow, "groups": {0, 1}, "qid": 4},
                          {"sweeps": 20, "pre": slow, "qid": 5, "rid": {2: "new"}}],
                   use_async=use_async)
    first, again = found(log)
    assert (first.replica_group, first.ranks, first.resolution) == (2, [5], "gone")
    assert (again.replica_group, again.replica_id, again.ranks) == (2, "replica_group_2:new", [5])


def test_the_carry_holds_only_the_restarted_groups_own_lag_against_before():
    """rr12: group 1's rank 3 a little slow at pace, then found and evicted; group 1 back healthy
    on a spare; rank 0 logs 0.3 s all along; then the network slows. Holding every group's lag
    against the windows before the restart named group 0 late at its quorum (its lag was
    against a late group 1 then): the network's slowdown blamed on a rank. Only the carried
    group's own lag is held against its old incarnation's."""
    logs = lambda g, r: 0.3 if (g, r) == (0, 0) else 0.0  # noqa: E731
    det, log = run(2, 2, [
        {"sweeps": 14, "pre": lambda g, r: logs(g, r) + (0.15 if (g, r) == (1, 1) else 0.0)},
        {"sweeps": 5, "pre": lambda g, r: logs(g, r) + (0.65 if (g, r) == (1, 1) else 0.0)},
        {"sweeps": 3, "pre": logs, "groups": {0}, "qid": 4},
        {"sweeps": 30, "pre": logs, "qid": 5, "rid": {1: "new"}, "net": 0.3, "tag": "net"}])
    (f,) = found(log)
    assert f.replica_group == 1 and f.resolution == "gone"
    late = [s["quorum_late"] for s in log if s["tag"] == "net" and s["quorum_late"]]
    assert late == [], late


@pytest.mark.parametrize("groups,ranks", [(3, 2), (2, 4)])
def test_a_group_whose_every_rank_works_before_its_quorum_is_found(groups, ranks):
    """Group 1's host reads its data slowly: each of its ranks works 0.3 s before its quorum
    call, none its last arriver more than the others. Every rank of it waits less at the
    cross-group step, so the straggler's arrival lag finds it, its ranks named, once."""
    det, log = run(groups, ranks, [
        {"sweeps": 14, "pre": zero},
        {"sweeps": 6, "pre": lambda g, r: 0.3 if g == 1 else 0.0}])
    (f,) = found(log)
    assert (f.replica_group, f.ranks) == (1, list(range(ranks, 2 * ranks)))
    assert f.resolved_at is None and "job_slow" not in log[-1]["open"]
