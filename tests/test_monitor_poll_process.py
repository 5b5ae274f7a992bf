"""The poller in its own process (monitor/poll/poll_process.py): the Poller's bounds hold in the
child, its answers stream back while the sweep goes on, a child that dies fails that sweep's
polls only, and no child outlives its monitor. Real processes, real HTTP on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from monitor import polling
from monitor.config import MonitorConfig
from monitor.evidence.view import ViewBuilder
from monitor.poll.discovery import Target
from monitor.poll.poll_process import BATCH, ProcessPoller
from monitor.service import Monitor
from tests.support.monitor_sim import SimRank, SimRanks
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
            self.first_pid = self.pid

    monkeypatch.setattr(monitor.poll.poller, "Poller", Recorded)  # what that test builds
    bounds_checked(hostile_sim)
    assert len(made) == 1 and made[0].pid == made[0].first_pid  # no child died or hung


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
        wait_until(lambda: handle.batches.qsize() >= 2, 30, "the first two batches")
        assert handle.finished_at is None
        p._child.kill()  # rather than wait out the slow rank: what came stays
        polls = handle.result()
        assert [polls[u].data["rank"] for u in urls] == list(range(2 * BATCH))
        assert "poller process" in polls[sim.urls[0]].error
    finally:
        p.close()
        sim.stop()
        stop()


def test_a_child_killed_mid_sweep_fails_that_sweep_only(caplog):
    """The polls it never answered are the monitor's failure (reason ``monitor``): the view
    carries each rank as not asked, no failure counted; the death is logged once."""
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
        assert all(x.reason == "monitor" and "poller process" in x.error
                   and f"pid {first}" in x.error for x in polls.values()), polls
        said = [r for r in caplog.records if f"poller process (pid {first})" in r.getMessage()]
        assert len(said) == 1 and said[0].levelname == "WARNING"
        view = vb.update(targets, polls, now=101.0)
        assert all(r.failures == 0 and r.reachable and r.unreachable_since is None
                   and not r.fresh for r in view.ranks.values()), view.ranks
        for r in sim.ranks:
            r.set_mode("ok")
        view = vb.update(targets, p.sweep(sim.urls), now=102.0)  # a new child, all answer
        assert p.pid != first and gone(first)
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


def state_asks(monkeypatch) -> list[str]:
    """The ``/v1/state`` requests the simulated ranks answer, by rank URL, as they come."""
    asked: list[str] = []
    respond = SimRank.respond

    def recording(self, path, mode):
        if path.split("?")[0].endswith("/v1/state"):
            asked.append(self.url)
        return respond(self, path, mode)

    monkeypatch.setattr(SimRank, "respond", recording)
    return asked


def asked_within(asked: list[str], n: int, timeout_s: float) -> bool:
    """Whether more than ``n`` state requests came within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while len(asked) <= n and time.monotonic() < deadline:
        time.sleep(0.02)
    return len(asked) > n


def process_monitor_of(tmp_path, sim: SimRanks, **kw) -> Monitor:
    """A monitor that polls from its own process from the first target on (0.3 s interval);
    its sweeps are called by the test."""
    return Monitor(MonitorConfig(port=0, interval_s=0.3, targets=sim.urls, job="unit",
                                 state_path=str(tmp_path / "m.db"), poll_process_min_targets=1,
                                 **kw))


def stop(mon: Monitor, sim: SimRanks) -> None:
    pid = mon.polling.poller.pid
    mon.stop()
    assert gone(pid)  # the monitor's stop ends its poller process
    sim.stop()


@pytest.fixture
def process_monitor(tmp_path, monkeypatch):
    """4 real ranks, the /v1/state requests they answer, and a monitor of them
    (:func:`process_monitor_of`)."""
    asked = state_asks(monkeypatch)
    sim = SimRanks.start(4, groups=2)
    mon = process_monitor_of(tmp_path, sim)
    yield mon, sim, asked
    stop(mon, sim)


def test_the_next_sweep_is_asked_ahead_when_due(process_monitor, monkeypatch):
    """When the next sweep is due within ASK_LEAD x the polling time (here always: as if the
    polling took longer than the interval), a sweep asks the next sweep's ranks before it
    ends; the next sweep folds those answers. A next sweep that comes later than the interval
    asks again: never answers older than that."""
    mon, sim, asked = process_monitor
    n, rank = len(sim.urls), sim.ranks[1]
    monkeypatch.setattr(polling, "ASK_LEAD", 1e6)
    mon.sweep_once()
    wait_until(lambda: len(asked) == 2 * n, 10, "the next sweep's ranks asked ahead")
    rank.update(step=101)  # after they were asked: the next sweep cannot see it
    view = mon.sweep_once()
    assert view.ranks[rank.url].state["step"] == 100
    wait_until(lambda: len(asked) == 3 * n, 10, "the next sweep's ranks asked ahead")
    view = mon.sweep_once()  # the answers asked during the last sweep
    assert view.ranks[rank.url].state["step"] == 101
    wait_until(lambda: len(asked) == 4 * n, 10, "the next sweep's ranks asked ahead")
    rank.update(step=102)
    time.sleep(1.5)  # past the interval (and the last sweep's length): too old to use
    view = mon.sweep_once()
    assert view.ranks[rank.url].state["step"] == 102


def test_a_sweep_inside_the_interval_asks_the_next_one_just_before_it(process_monitor):
    """A sweep well inside the interval does not ask the next sweep's ranks (their answers
    would wait, growing old); the loop's wait asks them just before the next sweep is due: a
    change made a second into the wait is in them, and the next sweep polls no more."""
    mon, sim, asked = process_monitor
    rank = sim.ranks[1]
    # 4 ranks poll in milliseconds; 3 s keeps a loaded box's sweeps inside the interval
    mon.cfg.interval_s = 3.0
    mon.sweep_once()
    started = time.monotonic()
    mon.sweep_once()
    n = len(asked)
    assert not asked_within(asked, n, 0.3)  # not asked at the sweep's end
    change = threading.Timer(1.0, rank.update, kwargs={"step": 101})
    change.start()
    assert mon.wait_next(started) is False
    assert time.monotonic() >= started + mon.cfg.interval_s
    wait_until(lambda: len(asked) == n + len(sim.urls), 5, "the ranks asked in the wait")
    view = mon.sweep_once()
    assert len(asked) == n + len(sim.urls)  # the sweep used the answers asked in the wait
    assert view.ranks[rank.url].state["step"] == 101


def stale_first_sweep(mon: Monitor, asked: list[str], n: int) -> None:
    """The first sweep (every rank), then its asks ahead (the groups' leaders) left to grow
    too old to use: the next sweep plans for itself."""
    t = time.monotonic()
    view = mon.sweep_once()
    took = time.monotonic() - t
    # every one of them in before the test counts: on a loaded box one can come late
    wait_until(lambda: len(asked) == n + len(view.groups), 10, "the first sweep's asks ahead")
    time.sleep(max(mon.cfg.interval_s, took) + 0.2)


@pytest.mark.parametrize("waiting, wait_s, early", [("member", 1.0, True),
                                                     ("member", 10.0, False),
                                                     ("leader", 1.5, False)])
def test_a_sweep_that_drills_asks_early_unless_a_hang_may_be_building(tmp_path, monkeypatch,
                                                                      waiting, wait_s, early):
    """A sweep that drills a group (here a straggler candidate) asks the next sweep's ranks
    before its detectors run, like any other sweep, unless a rank it polled has been blocked
    in a collective for the hang threshold (3 s here: a hang's dumps may then be fetched in
    it, and must not share the poller process with the next sweep's requests), or a drilled
    group's leader is blocked inside it (a hang may be building). Then the next sweep is asked
    after the detectors."""
    asked = state_asks(monkeypatch)
    monkeypatch.setattr(polling, "ASK_LEAD", 1e6)  # the next sweep always due (see above)
    sim = SimRanks.start(8, groups=4)  # 4 groups of 2
    mon = process_monitor_of(tmp_path, sim, leader_polling="on", member_interval_s=3600.0)
    try:
        stale_first_sweep(mon, asked, len(sim.urls))
        member = next(r for r in sim.group(2)
                      if (r.state["group_rank"] == 0) == (waiting == "leader"))
        member.update(timing={"recent": [], "waiting": {"scope": "group",
                                                        "seconds": wait_s}})
        if waiting == "member":  # group 2 a straggler candidate: drilled
            mon.detectors.straggler.last_lags = {2: 5.0}
        # (else its leader, blocked in its group for over suspect_s, gets it drilled at once)
        n = len(asked)
        asked_before_detectors = []
        update = mon.detectors.update

        def detecting(*a, **k):  # the next sweep's asks: more than this sweep's own polls
            own = len(mon.sweep_plan.urls)
            asked_before_detectors.append(asked_within(asked, n + own, 1.0))
            return update(*a, **k)

        mon.detectors.update = detecting
        view = mon.sweep_once()
        assert 2 in mon.sweep_plan.drilled
        assert (2 in mon.sweep_plan.blocked) == (waiting == "leader")
        assert view.ranks[member.url].fresh  # its wait was read in this sweep
        assert mon.detectors.hang.longest_wait(view, view.at) == wait_s
        assert asked_before_detectors == [early]
        # asked either way: early, or after the detectors
        assert asked_within(asked, n + len(mon.sweep_plan.urls), 5.0)
    finally:
        stop(mon, sim)


def test_the_next_sweep_is_asked_early_and_its_suspects_added(tmp_path, monkeypatch):
    """When the next sweep is due, its ranks are asked as soon as this sweep's view is built;
    a group the detectors newly suspect in this sweep is added to that plan (its other rank
    asked then), and the next sweep polls exactly those ranks."""
    asked = state_asks(monkeypatch)
    # every sweep's next one due within ASK_LEAD x the polling time: as if the polling took
    # longer than the interval (else whether the first sweep asks ahead is the box's timing)
    monkeypatch.setattr(polling, "ASK_LEAD", 1e6)
    sim = SimRanks.start(8, groups=4)  # 4 groups of 2
    mon = process_monitor_of(tmp_path, sim, leader_polling="on", member_interval_s=3600.0)
    try:
        stale_first_sweep(mon, asked, len(sim.urls))
        first = mon.view
        leaders = {g: gv.leader.url for g, gv in first.groups.items()}
        other = [r.url for r in first.groups[2].ranks if r.url != leaders[2]]
        assert len(leaders) == 4 and len(other) == 1
        n = len(asked)
        update = mon.detectors.update

        def detecting(*a, **k):
            out = update(*a, **k)
            mon.detectors.straggler.last_lags = {2: 5.0}  # group 2 now a straggler candidate
            return out

        mon.detectors.update = detecting
        mon.sweep_once()
        own = len(mon.sweep_plan.urls)
        assert set(asked[n:n + own]) == set(leaders.values())  # this sweep's: the leaders
        wait_until(lambda: len(asked) == n + own + 5, 10, "the next sweep's ranks")
        ahead = asked[n + own:]
        assert set(ahead) == set(leaders.values()) | set(other)
        assert ahead[-1] == other[0]  # added after the detectors suspected group 2
        mon.detectors.update = update
        view = mon.sweep_once()
        polled = set(ahead)
        assert set(view.polled) == polled
        assert all(view.ranks[u].reachable and view.ranks[u].fresh for u in polled)
    finally:
        stop(mon, sim)
