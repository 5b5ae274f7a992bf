"""How long a sweep waits for Flight Recorder dumps (monitor/poll/fr_bound.py): as long as the
ranks asked took lately, times a slack, at least a second, at most ``--fr-timeout``. A host that
goes dark while its dump is being fetched must not hold the sweep, and with it the polls that
find the host gone, for the whole timeout; nor may a rank whose dumps wedge while its state
still answers hold every look.

The live test runs a real Monitor against a real torchft Lighthouse that simulated groups join
(``SimJob``, tests/support/monitor_sim.py): a simulated host "goes dark" by reading requests and
answering none, with no reset, as a host whose link dropped.
"""

from __future__ import annotations

import pytest

from lightkeeper.processes import wait_until
from monitor.config import DetectorConfig, MonitorConfig, RailsConfig
from monitor.poll import fr_bound
from monitor.poll.fr_bound import FLOOR_S, REST_MOST_S, REST_S, SLACK, FrBound
from monitor.poll.poller import RankPoll
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob


def answer(url: str, took: float) -> RankPoll:
    return RankPoll(url, True, {"entries": []}, latency_s=took)


def test_a_rank_never_heard_is_given_the_whole_timeout():
    bound = FrBound(5.0)
    bound.learn({"a": answer("a", 0.03)}, 5.0)
    assert bound.wait_s(["a", "b"]) == 5.0
    assert bound.wait_s(["a"]) == FLOOR_S


def test_the_wait_follows_the_slowest_rank_asked_within_the_timeout():
    bound = FrBound(5.0)
    bound.learn({"a": answer("a", 0.03), "b": answer("b", 0.6), "c": answer("c", 3.0)}, 5.0)
    assert bound.wait_s(["a", "b"]) == pytest.approx(SLACK * 0.6)
    assert bound.wait_s(["a", "c"]) == 5.0
    # a faster answer lowers the rank's time by half at most: one quick dump is no promise
    bound.learn({"b": answer("b", 0.01)}, 5.0)
    assert bound.wait_s(["b"]) == pytest.approx(SLACK * 0.3)


def test_a_rank_that_ran_out_of_time_is_given_slack_times_as_long_next():
    bound = FrBound(30.0)
    bound.learn({"a": answer("a", 0.05)}, 30.0)
    assert bound.wait_s(["a"]) == FLOOR_S
    bound.learn({"a": RankPoll("a", False, reason="timeout")}, FLOOR_S)
    assert bound.wait_s(["a"]) == pytest.approx(SLACK * FLOOR_S)
    # refused or cut off says nothing about how long its dump takes
    bound.learn({"a": RankPoll("a", False, reason="connection")}, SLACK * FLOOR_S)
    assert bound.wait_s(["a"]) == pytest.approx(SLACK * FLOOR_S)
    # an HTTP error is an answer, with its time
    bound.learn({"a": RankPoll("a", False, reason="http_status", status=500, latency_s=0.02)},
                SLACK * FLOOR_S)
    assert bound.wait_s(["a"]) == pytest.approx(SLACK * FLOOR_S / 2)


def test_a_dump_that_ran_out_of_the_whole_timeout_is_not_asked_for_a_while():
    t = [100.0]
    bound = FrBound(5.0, clock=lambda: t[0])
    asked: list[tuple[list[str], float]] = []

    def fetch(answers: dict[str, str]) -> dict[str, RankPoll]:
        """One fetch of ``answers``' ranks, each answering at once ("ok") or never."""
        def sweep(urls, wait):
            asked.append((urls, wait))
            return {u: answer(u, 0.05) if answers[u] == "ok" else
                    RankPoll(u, False, reason="timeout") for u in urls}
        return bound.fetch(list(answers), sweep)

    fetch({"a": "ok", "b": "ok"})
    for wait in (FLOOR_S, SLACK * FLOOR_S):  # out of its bound, not of the whole timeout
        fetch({"a": "never"})
        assert asked[-1] == (["a"], wait) and bound.resting(["a", "b"]) == {}
    fetch({"a": "never"})
    assert asked[-1] == (["a"], 5.0)
    [(url, why)] = bound.resting(["a", "b"]).items()
    assert url == "a" and not why.ok and why.reason == "timeout"
    assert why.error == f"its dump did not answer in 5 s; not asked for {REST_S:g} s, " \
                        f"again in {REST_S:.0f} s"
    # resting: not asked, its failed poll handed back beside the others' answers
    n = len(asked)
    got = fetch({"a": "never", "b": "ok"})
    assert asked[n:] == [(["b"], FLOOR_S)] and got["a"].error == why.error and got["b"].ok
    t[0] += REST_S - 0.1
    fetch({"a": "never"})
    assert len(asked) == n + 1
    t[0] += 0.2
    assert bound.resting(["a"]) == {} and bound.wait_s(["a"]) == 5.0
    # missed again: twice as long, up to REST_MOST_S
    rests = []
    for _ in range(8):
        fetch({"a": "never"})
        start = t[0]
        while "a" in bound.resting(["a"]):
            t[0] += 1.0
        rests.append(round(t[0] - start))
    assert rests == [min(REST_MOST_S, REST_S * 2 ** i) for i in range(1, 9)]
    # an answer ends it: the next such miss rests REST_S again
    fetch({"a": "ok"})
    fetch({"a": "never"})
    assert asked[-1] == (["a"], 5.0)  # 4x half of the 5 s remembered: the whole timeout
    assert bound.resting(["a"])["a"].error.endswith(f"again in {REST_S:.0f} s")


def test_ranks_no_longer_watched_are_forgotten():
    bound = FrBound(5.0)
    old = [f"old{i}" for i in range(1026)]
    bound.learn({u: answer(u, 0.01) for u in ["a", "b", *old]}, 5.0)
    bound.keep({"a", "b", "c"})  # a sweep leaving a few out forgets nobody
    assert bound.wait_s(["a", "b", "old0"]) == FLOOR_S
    bound.keep({"a"})  # more than twice as many (and 1,024) remembered: pruned
    assert bound.wait_s(["a"]) == FLOOR_S
    assert bound.wait_s(["b"]) == bound.wait_s(["old0"]) == 5.0


@pytest.fixture
def job():
    j = SimJob(3, ranks_per_group=2, heartbeat_timeout_ms=1000)
    j.serve_dumps()
    yield j
    j.stop()


def test_a_host_gone_dark_during_a_dump_fetch_is_found_before_the_fetch_timeout(tmp_path, job):
    """``--fr-timeout`` 30 s: a group whose host drops every packet while the monitor waits for
    one of its rank's dumps is evicted as ``dead`` within 15 s, the sweep having waited for that
    dump about a second (the rank answered its earlier dumps at once)."""
    mon = Monitor(MonitorConfig(
        port=0, interval_s=0.2, state_path=str(tmp_path / "state.sqlite"),
        sd_out=str(tmp_path / "targets.json"), job="sim", lighthouse=job.url,
        targets=job.sim.urls, kill_timeout_s=2.0, fr_timeout_s=30.0,
        detectors=DetectorConfig(dead_sweeps=2, fr_interval_s=1.0),
        rails=RailsConfig(min_replicas=1, cooldown_s=0, evict_kinds=("dead",)))).start()
    try:
        job.dark_mid_dump(0, timeout=15)
        wait_until(lambda: job.replica_ids[0] in job.kills, 15,
                   what="the dark group evicted while its dump was awaited")
        assert job.kills == [job.replica_ids[0]]
    finally:
        mon.stop()


def test_a_rank_whose_dumps_wedge_is_left_alone_while_its_peers_looks_go_on(tmp_path, job,
                                                                             monkeypatch):
    """One rank's dumps stop answering, its state does not: it is asked at its bound, then
    for the whole ``--fr-timeout`` (1.5 s), then left alone (1.5 s here, then 3 s) while the
    other ranks' dumps are read at each look, half a second apart; once it answers again, its
    dumps are read again after its rest. Without the rest, every look would ask it and wait."""
    monkeypatch.setattr(fr_bound, "REST_S", 1.5)
    mon = Monitor(MonitorConfig(
        port=0, interval_s=0.2, state_path=str(tmp_path / "state.sqlite"),
        sd_out=str(tmp_path / "targets.json"), job="sim", lighthouse=job.url,
        targets=job.sim.urls, fr_timeout_s=1.5,
        detectors=DetectorConfig(fr_interval_s=0.5), rails=RailsConfig(dry_run=True))).start()
    try:
        ranks = job.sim.ranks
        wait_until(lambda: all(r.fr_answered for r in ranks), 15, what="every rank's dump")
        victim, peer = ranks[2], ranks[0]
        victim.set_mode("fr_silent")
        looks = peer.fr_answered
        wait_until(lambda: peer.fr_answered >= looks + 8, 40, what="eight more looks")
        assert 2 <= victim.fr_held <= 4, (victim.fr_held, peer.fr_answered - looks)
        answered = victim.fr_answered
        victim.set_mode("ok")
        wait_until(lambda: victim.fr_answered > answered, 15, what="its dumps read again")
    finally:
        mon.stop()
