"""The slow-Lighthouse warning (monitor/evidence/lighthouse_settings.py): the decision on plain inputs,
the evidence read from Lighthouse /status snapshots, and the log line and gauges a Monitor
publishes. No processes: the Lighthouse's page is given as parsed snapshots (the parser has
its own tests), the Monitor's Lighthouse is a closed port (status unreadable)."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import generate_latest

from monitor.config import ConfigError, MonitorConfig
from monitor.evidence.lighthouse_settings import (
    RELOG_S,
    SETTINGS,
    Evidence,
    LighthouseSettingsWatch,
    assess,
)
from monitor.evidence.lighthouse_status import LighthouseStatus, parse_status
from monitor.evidence.rank import RankView
from monitor.service import Monitor
from tests.support.monitor_sim import rank_state
from tests.support.views import scratch_view


def settings(ws):
    return sorted(w.setting for w in ws)


@pytest.mark.parametrize("ev,expected", [
    (Evidence(), []),  # nothing known: nothing said
    (Evidence(declared_heartbeat_s=1.0), []),
    (Evidence(declared_heartbeat_s=2.0), []),  # at the threshold: not slow
    (Evidence(declared_heartbeat_s=5.0), ["heartbeat_timeout"]),  # torchft's default
    # a short join timeout caps the stall (the Lighthouse issues the quorum after it)
    (Evidence(declared_heartbeat_s=5.0, declared_join_s=1.0), []),
    (Evidence(declared_heartbeat_s=5.0, declared_join_s=60.0), ["heartbeat_timeout"]),
    # observed: a departed group's heartbeat 4.2 s old and not yet "old": timeout > 4.2 s
    (Evidence(heartbeat_above_s=4.2), ["heartbeat_timeout"]),
    (Evidence(heartbeat_above_s=0.9, heartbeat_at_most_s=1.3), []),
    # a kill that took long to leave the quorum, whatever is declared
    (Evidence(declared_heartbeat_s=1.0, last_drop_s=4.5, interval_s=1.0),
     ["eviction_drop"]),
    (Evidence(last_drop_s=3.9, interval_s=1.0), []),  # 2 s + one sweep + exit slack
    # the declared value contradicts the page (more than one sweep off)
    (Evidence(declared_heartbeat_s=1.0, heartbeat_above_s=4.6),
     ["heartbeat_timeout_declared"]),
    (Evidence(declared_heartbeat_s=5.0, heartbeat_at_most_s=1.2),
     ["heartbeat_timeout", "heartbeat_timeout_declared"]),
    (Evidence(declared_heartbeat_s=1.0, heartbeat_above_s=0.9, heartbeat_at_most_s=1.4), []),
])
def test_assess(ev, expected):
    ws = assess(ev)
    assert settings(ws) == expected
    assert all(w.setting in SETTINGS and w.message for w in ws)


def test_a_slow_drop_with_a_short_heartbeat_blames_the_survivors_collective():
    """The heartbeat timeout is already short (declared, or bracketed by /status): a slow drop
    is the survivors asking late (blocked in a collective with the evicted group), and the
    warning says so instead of pointing at the Lighthouse's settings."""
    for ev, known in ((Evidence(declared_heartbeat_s=1.0, last_drop_s=6.0), "1000 ms (declared)"),
                      (Evidence(heartbeat_above_s=0.9, heartbeat_at_most_s=1.3, last_drop_s=6.0),
                       "at most 1300 ms (observed)")):
        (w,) = assess(ev)
        assert w.setting == "eviction_drop"
        assert f"heartbeat timeout is {known}" in w.message
        assert "blocked in a collective with the evicted group" in w.message
        assert "check the Lighthouse's heartbeat_timeout_ms" not in w.message
    # nothing known, or a long one: the Lighthouse's settings are still the suspects
    for ev in (Evidence(last_drop_s=6.0), Evidence(declared_heartbeat_s=5.0, last_drop_s=6.0)):
        drop = next(w for w in assess(ev) if w.setting == "eviction_drop")
        assert "check the Lighthouse's heartbeat_timeout_ms" in drop.message


def _page(qid, members, heartbeats, stale=(), next_status=""):
    """A torchft 0.2.0 Lighthouse /status page, in its shape (quorum, next status, heartbeats)."""
    blocks = "".join(f'<div class="member\n \n">\n  <b>{m}</b> <br/>\n  Step: 7 <br/>\n'
                     f"  Manager: http://127.0.0.1:1 <br/>\n  TCPStore: 127.0.0.1:2 <br/>\n"
                     f"  World size: 2 <br/>\n</div>\n" for m in members)
    beats = "".join(f'<li class="heartbeat{" old" if r in stale else ""}">\n    {r}: seen '
                    f"{age}s ago\n  </li>\n" for r, age in heartbeats.items())
    return (f"\nCurrent quorum_id: {qid} <br>\nNext quorum status: {next_status}\n\n"
            f"<h3>Previous Quorum</h3>\nPrevious quorum id: {qid} <br>\nNum participants: "
            f"{len(members)} <br>\n<div>\n{blocks}</div>\n<h2>Heartbeats</h2>\n<ul>\n{beats}</ul>")


JOIN_WAIT = ("Valid quorum with 2 participants, waiting for 1 healthy but not participating "
             "stragglers due to join timeout [2/2 participants healthy][3 heartbeating]"
             "[shrink_only=false]")


@pytest.mark.parametrize("survivor_held", [True, False])
def test_a_drop_held_for_the_join_timeout_names_a_survivor_held_out(survivor_held):
    """Every evicted rank exited at once, but a survivor's rank stayed blocked in the old
    collective on another survivor's rank that had given it up: the Lighthouse, its heartbeat
    timeout short, waited for that healthy group until its join timeout. The warning says so,
    not that the evicted group's ranks did not exit."""
    w = LighthouseSettingsWatch(interval_s=0.5)
    g = ["g0", "g1", "g2"]
    w.observe(parse_status(_page(3, g, {**dict.fromkeys(g, 0.1), "old": 1.2}, ["old"])), 9.0)
    w.kill_sent("g1", now=10.0)
    # g1 still heartbeats: the Lighthouse waits for the evicted group itself, not a survivor
    w.observe(parse_status(_page(3, g, {"g0": 0.1, "g1": 0.5, "g2": 0.1}, (), JOIN_WAIT)), 10.5)
    for t in (11.5, 12.5, 13.5, 14.5):  # g1's heartbeat old: a survivor holds the quorum
        w.observe(parse_status(_page(3, g, {"g0": 0.1, "g1": t - 10, "g2": 0.1}, ["g1"],
                                     JOIN_WAIT if survivor_held else "")), t)
    w.observe(parse_status(_page(4, ["g0", "g2"], {"g0": 0.1, "g1": 5.5, "g2": 0.1}, ["g1"])),
              15.5)
    msg = w.active["eviction_drop"].message
    assert "5.5s after the kill" in msg
    assert ("held the survivors' next quorum until its join timeout" in msg) is survivor_held
    assert not survivor_held or ("--rank-exit-token" in msg and "join_timeout_ms" in msg)
    assert ("blocked in a collective with the evicted group" in msg) is not survivor_held
    # the declared join timeout, the drop about that long: the same, without /status's word
    (d,) = assess(Evidence(declared_heartbeat_s=1.0, declared_join_s=5.0, last_drop_s=5.4,
                           interval_s=0.5))
    assert "join_timeout_ms, 5000 ms (declared)" in d.message
    assert "blocked in a collective with the evicted group" not in d.message
    (d,) = assess(Evidence(declared_heartbeat_s=1.0, declared_join_s=5.0, last_drop_s=9.0))
    assert "blocked in a collective with the evicted group" in d.message


def status(qid, members, heartbeats, stale=()):
    return LighthouseStatus(qid, dict.fromkeys(members), heartbeats, frozenset(stale))


def test_watch_brackets_the_heartbeat_timeout_from_a_departed_group():
    w = LighthouseSettingsWatch(interval_s=1.0)
    live = {"a": 0.05, "b": 0.07}
    # group c died: its heartbeat ages sweep by sweep until the Lighthouse lists it as old
    for age, stale in ((0.6, False), (1.6, False), (2.6, False), (3.6, False), (4.6, False),
                       (5.6, True)):
        w.observe(status(3, ["a", "b", "c"], {**live, "c": age}, ["c"] if stale else []),
                  now=100 + age)
    assert w.ev.heartbeat_above_s == pytest.approx(4.6)
    assert w.ev.heartbeat_at_most_s == pytest.approx(5.6)
    assert settings(w.active.values()) == ["heartbeat_timeout"]
    # a page that could not be read teaches nothing and does not clear what is known
    w.observe(None, now=200)
    assert settings(w.active.values()) == ["heartbeat_timeout"]


def test_watch_measures_each_kill_until_the_group_leaves_the_quorum():
    w = LighthouseSettingsWatch(declared_heartbeat_ms=1000, interval_s=1.0)
    hb = {"a": 0.1, "b": 0.1, "c": 0.1}
    w.kill_sent("c", now=10.0)
    w.observe(status(3, ["a", "b", "c"], hb), now=11.0)  # still listed
    assert w.ev.last_drop_s is None and "c" in w.pending
    w.observe(status(4, ["a", "b"], hb, ["c"]), now=12.5)
    assert w.ev.last_drop_s == pytest.approx(2.5)
    assert w.active == {}  # 2.5 s with a 1 s sweep: not slow
    w.kill_sent("b", now=20.0)
    w.observe(status(5, ["a"], hb, ["c"]), now=26.0)
    assert settings(w.active.values()) == ["eviction_drop"]
    assert "6.0s after the kill" in w.active["eviction_drop"].message


def _ranks(at, phases):
    """The monitor's view at ``at``: one single-rank group per entry, in that phase."""
    return scratch_view(at, {f"http://r{g}": RankView(f"http://r{g}", True,
                                                      rank_state(g, g, phase=p, now=at))
                             for g, p in phases.items()})


def _rid(g):
    return f"replica_group_{g}:sim"  # rank_state's replica id


@pytest.mark.parametrize("survivor,asked", [
    # asked at once: the Lighthouse (--min_replicas 2, two groups) waits for a replacement
    (lambda t: "quorum", True),
    # blocked in the all-reduce with the evicted group until its timeout, then asked
    (lambda t: "allreduce" if t < 40 else "quorum", False)])
def test_a_slow_drop_names_min_replicas_when_the_survivors_asked_at_once(survivor, asked):
    w = LighthouseSettingsWatch(interval_s=1.0)
    hb = {_rid(0): 0.1, _rid(1): 0.1}
    w.observe(status(3, [_rid(0), _rid(1)], {**hb, "old": 1.2}, ["old"]), now=9.0)
    w.kill_sent(_rid(1), now=10.0)
    for t in range(11, 42):  # the evicted group's rank still answers for a while
        phases = {0: survivor(t), **({1: "allreduce"} if t < 13 else {}),
                  **({2: "starting"} if t >= 38 else {})}  # the replacement, not yet a member
        w.observe(status(3, [_rid(0), _rid(1)], hb), float(t), _ranks(t - 1.0, phases))
    # a replacement joined: the quorum forms, without the evicted group
    w.observe(status(4, [_rid(0), _rid(2)], {**hb, _rid(2): 0.1}), 42.5,
              _ranks(41.5, {0: "quorum", 2: "quorum"}))
    msg = w.active["eviction_drop"].message
    assert "32.5s after the kill" in msg
    assert ("min_replicas" in msg) is asked
    assert ("asked for a new quorum late" in msg) is not asked
    assert "its heartbeat timeout at most 1200 ms (observed)" in msg or not asked
    # the heartbeat timeout not known to be short: it stays a suspect too
    (w,) = assess(Evidence(last_drop_s=32.5, last_drop_asked=True))
    assert "min_replicas" in w.message and "heartbeat_timeout_ms" in w.message


def test_watch_logs_once_then_again_after_relog_and_when_cleared(caplog):
    w = LighthouseSettingsWatch(declared_heartbeat_ms=5000)
    caplog.set_level(logging.INFO, logger="monitor.evidence.lighthouse_settings")
    for t in range(10):
        w.observe(None, now=float(t))
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "heartbeat_timeout" in warned[0].getMessage()
    w.observe(None, now=RELOG_S + 1)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2
    w.ev.declared_join_s = 1.0  # the stall is capped now: the warning clears, once
    w.observe(None, now=RELOG_S + 2)
    w.observe(None, now=RELOG_S + 3)
    assert [r.getMessage() for r in caplog.records if "cleared" in r.getMessage()] == [
        "Lighthouse settings warning cleared (heartbeat_timeout)"]


def test_bad_declared_value_is_a_config_error(tmp_path):
    cfg = MonitorConfig(lighthouse_heartbeat_timeout_ms=0, state_path=str(tmp_path / "s.db"))
    with pytest.raises(ConfigError, match="lighthouse_heartbeat_timeout_ms"):
        cfg.validate()


def test_monitor_publishes_the_warning_and_logs_it(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="monitor.evidence.lighthouse_settings")
    # the Lighthouse is a closed port: its status cannot be read, the declared value stands
    cfg = MonitorConfig(port=0, lighthouse="http://127.0.0.1:9", state_path=str(tmp_path / "s.db"),
                        lighthouse_heartbeat_timeout_ms=5000, lighthouse_timeout_s=0.2)
    mon = Monitor(cfg)
    try:
        mon.sweep_once()
        text = generate_latest(mon.metrics.registry).decode()
        assert 'lightkeeper_monitor_config_warnings{job="lightkeeper",setting="heartbeat_timeout"}' \
               ' 1.0' in text
        assert 'setting="eviction_drop"} 0.0' in text
        assert 'lightkeeper_monitor_lighthouse_heartbeat_timeout_seconds{job="lightkeeper",' \
               'source="declared"} 5.0' in text
        assert 'lightkeeper_monitor_lighthouse_drop_seconds{job="lightkeeper"} NaN' in text
        assert [r for r in caplog.records if "slow Lighthouse settings" in r.getMessage()]
        assert mon.cluster_json()["lighthouse_settings"]["warnings"][0]["setting"] == \
            "heartbeat_timeout"
    finally:
        mon.stop()
