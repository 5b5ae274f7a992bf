"""The poller in its own process (monitor/poll/poll_process.py): the Poller's bounds hold in the
child, its answers stream back while the sweep goes on, a child that dies fails that sweep's
polls only, and no child outlives its monitor. Real processes, real HTTP on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from monitor.evidence.view import ViewBuilder
from monitor.poll.discovery import Target
from monitor.poll.poll_process import BATCH, ProcessPoller
from tests.support.monitor_sim import SimRanks
from tests.test_monitor_trust import hostile_sim  # noqa: F401 (a fixture)
from tests.test_monitor_trust import test_poller_bounds_every_answer as bounds_checked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_until(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def gone(pid: int) -> bool:
    """The process ended (reaped, or a zombie left to its new parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("event_loop", ["auto", "asyncio"])
def test_every_bound_holds_in_the_child(hostile_sim, monkeypatch, event_loop):  # noqa: F811
    """test_monitor_trust's hostile ranks (huge, chunked, unframed, dribbling, slow, many and
    long headers, deep JSON, garbage) and per-sweep body bound, with the poller in its own
    process: the same reasons and words, within the same timeout; on the child's default loop
    (uvloop where installed) and on the stdlib's."""
    import monitor.poll.poller

    made = []

    class Recorded(ProcessPoller):
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k, event_loop=event_loop)
            made.append(self)
            # the child up (on a loaded box its start alone can outlast that test's 1.5 s)
            assert self.sweep([hostile_sim.ranks[0].url])[hostile_sim.ranks[0].url].ok

    monkeypatch.setattr(monitor.poll.poller, "Poller", Recorded)  # what that test builds
    bounds_checked(hostile_sim)
    assert len(made) == 1 and made[0].restarts == 0


def virtual_ranks(n: int):
    """n virtual ranks behind one real asyncio server (tests/support/virtual_ranks.py)."""
    import asyncio
    import threading

    from tests.support.virtual_ranks import VirtualRanks

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    vr = VirtualRanks(n, 0, 8, 0.5)
    server = asyncio.run_coroutine_threadsafe(
        loop.create_server(vr.protocol, "127.0.0.1", 0), loop).result(10)
    port = server.sockets[0].getsockname()[1]

    def stop() -> None:
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)

    return [f"http://127.0.0.1:{port}/r/{r}" for r in range(n)], stop


def test_answers_come_back_in_batches_while_the_sweep_goes_on():
    urls, stop = virtual_ranks(2 * BATCH)
    sim = SimRanks.start(1)
    sim.ranks[0].set_mode("slow", delay=30.0)
    p = ProcessPoller(timeout_s=60.0)
    try:
        handle = p.start(urls + sim.urls)
        # in the monitor while the slow rank holds the sweep open
        wait_until(lambda: handle.received >= 2 * BATCH, 30, "the first batches")
        assert not handle.done.is_set()
        p._child.kill()  # rather than wait out the slow rank: what came stays
        polls = handle.result()
        assert [polls[u].data["rank"] for u in urls] == list(range(2 * BATCH))
        assert "poller process" in polls[sim.urls[0]].error
    finally:
        p.close()
        sim.stop()
        stop()


def test_a_child_killed_mid_sweep_fails_that_sweep_only():
    sim = SimRanks.start(4, groups=2)
    targets = [Target(u, "static") for u in sim.urls]
    p = ProcessPoller(timeout_s=20.0)
    vb = ViewBuilder()
    try:
        vb.update(targets, p.sweep(sim.urls), now=100.0)
        first = p.pid
        for r in sim.ranks:
            r.set_mode("slow", delay=30.0)
        asked = sum(r.requests for r in sim.ranks)
        handle = p.start(sim.urls)
        wait_until(lambda: sum(r.requests for r in sim.ranks) == asked + 4, 10,
                   "the requests in flight")
        os.kill(first, signal.SIGKILL)
        start = time.monotonic()
        polls = handle.result()
        assert time.monotonic() - start < 5.0  # not the requests' 20 s timeout
        assert all(x.reason == "connection" and "poller process" in x.error
                   and f"pid {first}" in x.error for x in polls.values()), polls
        view = vb.update(targets, polls, now=101.0)
        assert all(r.failures == 1 for r in view.ranks.values())
        for r in sim.ranks:
            r.set_mode("ok")
        view = vb.update(targets, p.sweep(sim.urls), now=102.0)  # a new child, all answer
        assert p.pid != first and p.restarts == 1 and gone(first)
        assert all(r.reachable and r.failures == 0 for r in view.ranks.values())
    finally:
        p.close()
        sim.stop()


def test_close_ends_the_child():
    p = ProcessPoller(timeout_s=1.0)
    pid = p.pid
    assert not gone(pid)
    p.close()
    assert gone(pid)


def test_no_child_outlives_a_killed_monitor():
    """The monitor's process killed outright (no close): its child reads the end of its pipe
    and exits."""
    code = ("import sys, time\n"
            "from monitor.poll.poll_process import ProcessPoller\n"
            "p = ProcessPoller(timeout_s=1.0)\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        child = int(parent.stdout.readline())
        assert not gone(child)
        parent.kill()
        parent.wait()
        wait_until(lambda: gone(child), 10, "the orphaned child to exit")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_a_closed_poller_refuses_sweeps():
    p = ProcessPoller(timeout_s=1.0)
    p.close()
    with pytest.raises(RuntimeError):
        p.sweep(["http://127.0.0.1:9/"])


@pytest.fixture
def process_monitor(tmp_path, monkeypatch):
    """A monitor over 4 real ranks that polls from its own process from the first target on,
    with a 0.3 s interval. Its sweeps are called by the test."""
    from monitor import service
    from monitor.config import MonitorConfig

    monkeypatch.setattr(service, "POLL_PROCESS_MIN_TARGETS", 1)
    sim = SimRanks.start(4, groups=2)
    mon = service.Monitor(MonitorConfig(port=0, interval_s=0.3, targets=sim.urls,
                                        state_path=str(tmp_path / "m.db"), job="unit"))
    yield mon, sim
    pid = mon.poller.pid
    mon.stop()
    assert gone(pid)  # the monitor's stop ends its poller process
    sim.stop()


def test_the_next_sweep_is_asked_ahead_when_due(process_monitor, monkeypatch):
    """When the next sweep is due within ASK_LEAD x the polling time (here always: as if the
    polling took longer than the interval), a sweep asks the next sweep's ranks before its
    ledger and metrics; the next sweep folds those answers (asked before it began). A next
    sweep that comes later than the interval asks again: never answers older than that."""
    from monitor import service

    mon, sim = process_monitor
    rank = sim.ranks[1]
    monkeypatch.setattr(service, "ASK_LEAD", 1e6)
    mon.sweep_once()
    assert isinstance(mon.poller, ProcessPoller)
    plan, handle = mon._ahead.plan, mon._ahead.handles[0]
    assert set(plan.urls) == set(handle.urls) == set(sim.urls)
    wait_until(handle.done.is_set, 10, "the answers asked ahead")
    rank.update(step=101)  # after they were asked: the next sweep cannot see it
    view = mon.sweep_once()
    assert view.ranks[rank.url].state["step"] == 100
    assert mon.sweep_plan is plan
    view = mon.sweep_once()  # the answers asked during the last sweep's tail
    assert view.ranks[rank.url].state["step"] == 101
    # too late for the answers asked ahead: asked again, the change made meanwhile is seen
    assert mon._ahead is not None
    wait_until(mon._ahead.handles[0].done.is_set, 10, "the answers asked ahead")
    rank.update(step=102)
    sent = mon._ahead.sent_at
    wait_until(lambda: time.monotonic() - sent > mon.cfg.interval_s, 5, "the interval to pass")
    view = mon.sweep_once()
    assert view.ranks[rank.url].state["step"] == 102


def test_a_sweep_inside_the_interval_asks_the_next_one_just_before_it(process_monitor):
    """A sweep well inside the interval does not ask the next sweep's ranks (their answers
    would wait, growing old); the loop's wait (Monitor.wait_next) asks them ASK_LEAD x the
    polling time before the next sweep is due, not sooner: a change made during the wait is
    in them, and the next sweep starts with its answers asked (it does not poll again)."""
    from monitor import service

    mon, sim = process_monitor
    rank = sim.ranks[1]
    # 4 ranks sweep and poll in milliseconds; 3 s keeps a loaded box's inside the interval
    # (the first sweep also starts the poller process: at load 4, over 0.3 s)
    mon.cfg.interval_s = 3.0
    mon.sweep_once()
    started = time.monotonic()
    mon.sweep_once()
    assert isinstance(mon.poller, ProcessPoller)
    assert mon._poll_s is not None and mon._poll_s * service.ASK_LEAD < 1.0
    assert mon._ahead is None
    rank.update(step=101)  # during the wait, before the next sweep's ranks are asked
    assert mon.wait_next(started) is False
    assert time.monotonic() >= started + mon.cfg.interval_s
    ahead = mon._ahead
    assert ahead is not None  # asked in the wait, not at the sweep's end:
    assert ahead.sent_at >= started + mon.cfg.interval_s \
        - service.ASK_LEAD * mon._poll_s - 0.05
    view = mon.sweep_once()
    assert mon.sweep_plan is ahead.plan
    assert view.ranks[rank.url].state["step"] == 101


@pytest.mark.parametrize("waiting, wait_s, early", [("member", 1.0, True),
                                                     ("member", 10.0, False),
                                                     ("leader", 1.5, False)])
def test_a_sweep_that_drills_asks_early_unless_a_hang_may_be_building(tmp_path, monkeypatch,
                                                                      waiting, wait_s, early):
    """A sweep that drills a group (here a straggler candidate) asks the next sweep's ranks as
    soon as its view is built, like any other sweep, unless a rank it polled has been blocked
    in a collective for the hang threshold (3 s here: a hang's Flight Recorder dumps may then
    be fetched in it, and must not share the poller process with the next sweep's requests),
    or a drilled group's leader is blocked inside it (a hang may be building: the next
    sweep's answers, which may confirm it, are asked as late as before). Then the next sweep
    is asked after the detectors."""
    from monitor import service
    from monitor.config import MonitorConfig

    monkeypatch.setattr(service, "POLL_PROCESS_MIN_TARGETS", 1)
    monkeypatch.setattr(service, "ASK_LEAD", 1e6)  # the next sweep always due (see above)
    sim = SimRanks.start(8, groups=4)  # 4 groups of 2
    mon = service.Monitor(MonitorConfig(port=0, interval_s=0.3, targets=sim.urls,
                                        state_path=str(tmp_path / "m.db"), job="unit",
                                        leader_polling="on", member_interval_s=3600.0))
    try:
        mon.sweep_once()  # every rank: nothing known yet
        if mon._ahead is not None:  # asked before group 2 was suspect: the next sweep plans
            mon._ahead.result()
            mon._ahead = None
        member = next(r for r in sim.group(2)
                      if (r.state["group_rank"] == 0) == (waiting == "leader"))
        member.update(timing={"recent": [], "waiting": {"scope": "group",
                                                            "seconds": wait_s}})
        if waiting == "member":  # group 2 a straggler candidate: drilled
            mon.detectors.last_lags = {2: 5.0}
        # (else its leader, blocked in its group for over suspect_s, gets it drilled at once)
        asked_before_detectors = []
        update = mon.detectors.update

        def detecting(*a, **k):
            asked_before_detectors.append(mon._ahead is not None)
            return update(*a, **k)

        mon.detectors.update = detecting
        view = mon.sweep_once()
        assert 2 in mon.sweep_plan.drilled
        assert (2 in mon.sweep_plan.blocked) == (waiting == "leader")
        assert view.ranks[member.url].fresh  # its wait was read in this sweep
        assert mon.detectors.longest_wait(view, view.at) == wait_s
        assert asked_before_detectors == [early]
        assert mon._ahead is not None  # asked either way: early, or after the detectors
    finally:
        pid = mon.poller.pid
        mon.stop()
        assert gone(pid)
        sim.stop()


def test_the_next_sweep_is_asked_early_and_its_suspects_added(tmp_path, monkeypatch):
    """When the next sweep is due, its ranks are asked as soon as this sweep's view is built (before its detectors run: the polling then overlaps them); a
    group the detectors newly suspect in this sweep is added to that plan and drilled (its
    other ranks asked too), and the next sweep polls exactly the plan's URLs."""
    from monitor import service
    from monitor.config import MonitorConfig

    monkeypatch.setattr(service, "POLL_PROCESS_MIN_TARGETS", 1)
    sim = SimRanks.start(8, groups=4)  # 4 groups of 2
    mon = service.Monitor(MonitorConfig(port=0, interval_s=0.3, targets=sim.urls,
                                        state_path=str(tmp_path / "m.db"), job="unit",
                                        leader_polling="on", member_interval_s=3600.0))
    try:
        first = mon.sweep_once()  # every rank: nothing known yet
        leaders = {g: gv.leader.url for g, gv in first.groups.items()}
        other = [r.url for r in first.groups[2].ranks if r.url != leaders[2]]
        assert len(leaders) == 4 and len(other) == 1
        asked_before_detectors = []
        update = mon.detectors.update

        def detecting(*a, **k):
            asked_before_detectors.append(mon._ahead is not None)
            out = update(*a, **k)
            mon.detectors.last_lags = {2: 5.0}  # group 2 now a straggler candidate
            return out

        mon.detectors.update = detecting
        # the next sweep due within ASK_LEAD x the polling time: as if the polling took longer
        # than the interval
        monkeypatch.setattr(service, "ASK_LEAD", 1e6)
        mon.sweep_once()
        assert asked_before_detectors == [True]
        ahead = mon._ahead
        assert len(ahead.handles) == 2  # the plan's, then group 2's other rank
        assert ahead.handles[1].urls == other
        assert 2 in ahead.plan.drilled
        for h in ahead.handles:
            wait_until(h.done.is_set, 10, "the answers asked ahead")
        mon.detectors.update = update
        view = mon.sweep_once()
        assert mon.sweep_plan is ahead.plan
        polled = set(ahead.plan.urls)
        assert set(view.polled) == polled == set(leaders.values()) | set(other)
        assert all(view.ranks[u].reachable and view.ranks[u].fresh for u in polled)
    finally:
        pid = mon.poller.pid
        mon.stop()
        assert gone(pid)
        sim.stop()
