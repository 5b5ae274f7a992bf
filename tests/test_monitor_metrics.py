"""The monitor's per-group series (made at scrape time from the last sweep's view): what
``/metrics`` shows for each replica group, and that a group the monitor no longer knows, or a
value it no longer has, disappears. Real ViewBuilder, registry and text exposition."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from monitor.api.metrics import MonitorMetrics
from monitor.evidence.view import ViewBuilder
from monitor.goodput import SweepAccount
from monitor.poll.discovery import Target
from monitor.poll.packed_state import pack_state
from monitor.poll.poller import RankPoll
from tests.support.monitor_sim import rank_state

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
