"""The monitor's per-group series (made at scrape time from the last sweep's view): what
``/metrics`` shows for each replica group, and that a group the monitor no longer knows, or a
value it no longer has, disappears. Real ViewBuilder, registry and text exposition."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from monitor.api.metrics import MonitorMetrics, publish_sweep
from monitor.detect import Detectors
from monitor.evidence.lighthouse_settings import LighthouseSettingsWatch
from monitor.evidence.view import ViewBuilder
from monitor.goodput import SweepAccount
from monitor.poll.discovery import Target
from monitor.poll.packed_state import pack_state
from monitor.poll.poller import RankPoll
from tests.support.monitor_sim import rank_state
from tests.test_monitor_detectors import T0 as DT0
from tests.test_monitor_stuck_starting import left_out_job

T0 = 1_700_000_000.0
PREFIX = "lightkeeper_monitor_replica_group_"


def _view(vb: ViewBuilder, groups: dict[int, dict], now: float):
    """One rank per group: {group: {step_seconds, step, participating}}."""
    targets, polls = [], {}
    for g, spec in groups.items():
        t = Target(f"http://127.0.0.1:{9000 + g}", "static")
        s = rank_state(g, g, step=spec["step"], step_seconds=spec["step_seconds"],
                       quorum_id=4, now=now)
        s["participating"] = spec.get("participating", True)
        targets.append(t)
        polls[t.url] = RankPoll(t.url, True, data=pack_state(s))  # as the poller keeps it
    return vb.update(targets, polls, now=now)


def _series(m: MonitorMetrics) -> dict[tuple[str, str], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            if s.name.startswith(PREFIX):
                assert s.labels["job"] == "train"
                out[(s.name[len(PREFIX):], s.labels["replica_group"])] = s.value
    return out


def test_group_series_are_the_last_sweeps_and_vanish_with_their_group():
    m, vb = MonitorMetrics("train"), ViewBuilder()
    view = _view(vb, {0: {"step": 7, "step_seconds": 1.0}, 1: {"step": 7, "step_seconds": 1.0},
                      2: {"step": 6, "step_seconds": 2.0, "participating": False}}, T0)
    m.set_groups(view, {0: 0.0, 1: None, 2: 0.4})
    m.add_goodput(SweepAccount(accounted=True, group_goodput_ratio={0: 1.0, 1: 0.5}))
    assert _series(m) == {
        ("arrival_lag_seconds", "0"): 0.0, ("arrival_lag_seconds", "2"): 0.4,  # 1: no lag
        ("step", "0"): 7.0, ("step", "1"): 7.0, ("step", "2"): 6.0,
        ("in_quorum", "0"): 1.0, ("in_quorum", "1"): 1.0, ("in_quorum", "2"): 0.0,
        ("stuck_starting", "0"): 0.0, ("stuck_starting", "1"): 0.0,
        ("stuck_starting", "2"): 0.0,
        ("goodput_ratio", "0"): 1.0, ("goodput_ratio", "1"): 0.5}
    # the next sweep: group 2 is gone, group 1 moved on; a sweep the ledger did not account
    # keeps the last ratios
    view2 = _view(vb, {0: {"step": 8, "step_seconds": 1.0},
                       1: {"step": 9, "step_seconds": 3.0}}, T0 + 1)
    m.set_groups(view2, {0: 0.1, 1: 0.0})
    m.add_goodput(SweepAccount())
    got = _series(m)
    assert {k for k in got if k[1] == "2"} == set()
    assert got[("step", "1")] == 9.0
    assert got[("arrival_lag_seconds", "0")] == 0.1 and got[("goodput_ratio", "1")] == 0.5
    # the series are of the view the monitor keeps: dropped, none is shown
    del view, view2
    assert {k for k in _series(m) if k[0] != "goodput_ratio"} == set()


def test_stuck_starting_is_1_for_the_group_an_open_finding_names_only():
    """Group 1 left out of the job's quorums while groups 0 and 2 train: out of the quorum but
    not yet stuck_starting (--starting-timeout) it reads 0, 1 from the sweep its finding opens,
    0 again once that finding closes (the group replaced); the others read 0 throughout. The
    LightkeeperReplicaGroupOutOfQuorum alert pages on it, not on in_quorum 0."""
    job, det = left_out_job()
    m = MonitorMetrics("train")

    def sweep(t: float, quorum: int = 4, **group_1) -> dict[tuple[str, str], float]:
        for r, s in enumerate(job.states):
            if job.group_of(r) == 1:
                s.update(group_1)
            else:
                s.update(quorum_id=quorum, step=s["step"] + 1, last_step_at=DT0 + t)
        view = job.view(DT0 + t)
        det.update(view.evidence(), None, DT0 + t, full_view=view)
        publish_sweep(m, view, view.evidence(), {}, det, True, LighthouseSettingsWatch())
        return {k: v for k, v in _series(m).items() if k[0] in ("in_quorum", "stuck_starting")}

    for t in range(0, 30, 5):
        assert sweep(t) == {("in_quorum", "0"): 1.0, ("in_quorum", "1"): 0.0,
                            ("in_quorum", "2"): 1.0, ("stuck_starting", "0"): 0.0,
                            ("stuck_starting", "1"): 0.0, ("stuck_starting", "2"): 0.0}, t
    got = sweep(30)
    assert [g for (name, g), v in got.items() if name == "stuck_starting" and v] == ["1"]
    assert _samples_by_kind(m)["stuck_starting"] == 1
    # replaced: a new incarnation let into the newest quorum
    got = sweep(35, quorum=6, replica_id="replica_group_1:new", step=7, quorum_id=6)
    assert {g: v for (name, g), v in got.items() if name == "stuck_starting"} == {
        "0": 0.0, "1": 0.0, "2": 0.0}


def _samples_by_kind(m: MonitorMetrics) -> dict[str, float]:
    return {s.labels["kind"]: s.value
            for fam in text_string_to_metric_families(generate_latest(m.registry).decode())
            for s in fam.samples if s.name == "lightkeeper_monitor_open_findings"}


def _samples(m: MonitorMetrics) -> dict[str, float]:
    """name -> value of the unlabelled-but-job series (``lightkeeper_monitor_`` stripped)."""
    return {s.name.removeprefix("lightkeeper_monitor_"): s.value
            for fam in text_string_to_metric_families(generate_latest(m.registry).decode())
            for s in fam.samples if set(s.labels) == {"job"}}


def _remove_before_0_22(self, *labelvalues):
    """MetricWrapperBase.remove of prometheus-client 0.20/0.21 (pyproject allows them): a label
    set never set raises KeyError (client_python #1077 made it a no-op in 0.22)."""
    if len(labelvalues) != len(self._labelnames):
        raise ValueError(f"Incorrect label count (expected {len(self._labelnames)}, "
                         f"got {labelvalues})")
    labelvalues = tuple(str(v) for v in labelvalues)
    with self._lock:
        del self._metrics[labelvalues]


def test_sweeps_without_a_quorum_publish_on_an_older_prometheus_client(monkeypatch):
    """A fresh monitor, or one whose Lighthouse is out, has no verified quorum: its sweeps
    publish (no quorum series) and count, on every prometheus-client the install allows."""
    monkeypatch.setattr(MetricWrapperBase, "remove", _remove_before_0_22)
    m, vb = MonitorMetrics("train"), ViewBuilder()
    for i in range(2):
        view = vb.update([], {}, now=T0 + i)
        publish_sweep(m, view, view, {}, Detectors(), False, LighthouseSettingsWatch())
    got = _samples(m)
    assert got["sweeps_total"] == 2 and got["sweep_duration_seconds_count"] == 2
    assert "quorum_id" not in got and "quorum_participants" not in got
    # a quorum seen, then gone again: its series goes
    view = _view(vb, {0: {"step": 7, "step_seconds": 1.0}}, T0 + 2)
    publish_sweep(m, view, view, {}, Detectors(), True, LighthouseSettingsWatch())
    assert _samples(m)["quorum_id"] == 4
    view = vb.update([], {}, now=T0 + 3)
    publish_sweep(m, view, view, {}, Detectors(), False, LighthouseSettingsWatch())
    assert "quorum_id" not in _samples(m) and _samples(m)["sweeps_total"] == 4


def test_a_sweep_whose_publishing_fails_is_not_counted():
    """LightkeeperMonitorNotSweeping reads sweeps_total: a sweep that raised on the way is no
    sweep done."""

    class Broken(LighthouseSettingsWatch):
        def publish(self, metrics, job):
            raise OSError("disk full")

    m, vb = MonitorMetrics("train"), ViewBuilder()
    view = vb.update([], {}, now=T0)
    with pytest.raises(OSError):
        publish_sweep(m, view, view, {}, Detectors(), True, Broken())
    got = _samples(m)
    assert got.get("sweeps_total", 0) == 0 and got.get("sweep_duration_seconds_count", 0) == 0
    publish_sweep(m, view, view, {}, Detectors(), True, LighthouseSettingsWatch())
    assert _samples(m)["sweeps_total"] == 1


def test_registrations_help_names_every_outcome():
    from monitor.poll.admission import REFUSALS

    (fam,) = [f for f in text_string_to_metric_families(
        generate_latest(MonitorMetrics("train").registry).decode())
        if f.name == "lightkeeper_monitor_registrations"]
    for outcome in ("accepted", *REFUSALS.values()):
        assert outcome in fam.documentation, outcome


def test_unverified_ranks_that_answer_are_counted_apart_from_unreachable_ones():
    """``ranks_unverified`` counts every known rank by its last verdict, an unreachable one's
    included; ``ranks_answering_unverified`` only those that answered their last poll, what
    LightkeeperRanksUnverified alerts on (a dead rank is LightkeeperRanksUnreachable's
    business). The real Verifier against a Lighthouse that lists none of their replica ids."""
    from monitor.evidence.lighthouse_status import LighthouseStatus
    from monitor.evidence.verification import Verifier

    targets = [Target(f"http://127.0.0.1:{9000 + r}", "static") for r in range(4)]
    states = [rank_state(r, r // 2, quorum_id=4, now=T0) for r in range(4)]
    for r, s in enumerate(states):
        s.update(group_rank=r % 2, group_world_size=2)
    other_job = LighthouseStatus(4, {}, {})  # --lighthouse names another job's
    vb, verifier, m = ViewBuilder(), Verifier(), MonitorMetrics("train")

    def sweep(now: float, down: set[int]):
        polls = {t.url: RankPoll(t.url, False, reason="connection", error="refused")
                 if r in down else RankPoll(t.url, True, data=pack_state(dict(states[r])))
                 for r, t in enumerate(targets)}
        view = vb.update(targets, polls, now=now, judge=lambda ranks, changed: verifier.judge(
            ranks, changed, other_job, None, True, now))
        publish_sweep(m, view, view.evidence(), polls, Detectors(), True,
                      LighthouseSettingsWatch())

    def value(name: str) -> float:
        return m.registry.get_sample_value(f"lightkeeper_monitor_{name}",
                                           {"job": "train", "reason": "unknown_replica_id"})

    sweep(T0, set())
    assert (value("ranks_unverified"), value("ranks_answering_unverified")) == (4.0, 4.0)
    sweep(T0 + 1, {2, 3})  # group 1 gone: its ranks keep their last verdict
    assert (value("ranks_unverified"), value("ranks_answering_unverified")) == (4.0, 2.0)
