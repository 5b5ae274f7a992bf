"""The hang's confirming sweep fetches the drilled groups' Flight Recorder first and skips the
leaders' cross-group dumps only when they cannot change a finding (monitor/polling.py
``Polling.fr_dumps``, ``Detectors.in_group_hangs``; docs/scaling.md).

A real monitor (its poller, view, schedule with leader polling on, detectors) sweeps 32 groups
x 2 ranks of tests/test_monitor_detectors.py's synthetic FT-HSDP job over real HTTP: one asyncio
server answers every rank's ``/v1/state`` and ``/v1/fr_trace`` (the WorkerServer's own filter
applied) under a path prefix, as the virtual ranks of the 100,000-rank benchmark do. The
monitor's clock is the job's (the ranks report their waits; no sleeping). A whole-job stall is
planted three ways:

- a non-leader rank hangs: its leader blocks in the group's all-gather, every other group waits
  in the cross-group all_reduce. Confirmed in the first sweep whose waits pass the hang
  threshold, at the in-group level, *without* the leaders' ``pg=torchft`` fetch; the same
  finding at the same sweep as a monitor that always fetches them;
- the hung rank is a group's leader (it computes, outside any collective): the others wait for
  that group, which is drilled for that, not for a blocked leader, so the leaders' dumps are
  fetched; the hang is confirmed on the leader in the same first sweep;
- a whole group never arrives at the cross-group all_reduce: only the leaders' dumps show it
  (a cross-group hang); fetched, confirmed in the same first sweep. A monitor made to skip
  them (the mutation: every drilled group taken as an in-group hang) misses it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from urllib.parse import parse_qs

import pytest

from monitor import polling
from monitor.config import DetectorConfig, MonitorConfig
from monitor.detect import Detectors
from monitor.poll.poll_process import ProcessPoller
from monitor.service import Monitor
from tests.support.virtual_ranks import _Connection
from tests.test_monitor_detectors import IN_GROUP_STEP, T0, Job
from worker_server.app import filter_fr_dump

# the rules under test are scale-free (a majority of the leaders, one group's own ranks)
GROUPS, RANKS = 32, 2
HUNG_GROUP = 17
STARTED: list[str] = []  # dump queries sent to a poller process before the view (ask early)


class JobServer:
    """The job's ranks over HTTP, rank r at ``http://127.0.0.1:<port>/r/<r>``; remembers what
    was asked (rank, endpoint, query)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.asked: list[tuple[int, str, str]] = []
        self._fr: dict[tuple[int, str], bytes] = {}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            self.loop.create_server(lambda: _Connection(self), "127.0.0.1", 0),
            self.loop).result(10)
        port = self.server.sockets[0].getsockname()[1]
        self.urls = [f"http://127.0.0.1:{port}/r/{r}" for r in range(job.world)]

    def fr_changed(self) -> None:
        """The job's collectives moved on: dumps are rendered again when next asked."""
        self._fr = {}

    def answer(self, request_line: bytes) -> tuple[bytes, bytes]:
        target = request_line.split()[1].decode()
        path, _, query = target.partition("?")
        _, _, rank, _, what = path.split("/")
        rank = int(rank)
        self.asked.append((rank, what, query))
        if what == "state":
            return b"200 OK", json.dumps(self.job.states[rank]).encode()
        body = self._fr.get((rank, query))
        if body is None:
            args = parse_qs(query)
            body = self._fr[rank, query] = filter_fr_dump(
                json.dumps(self.job.fr.dumps(ranks=[rank])[rank]).encode(),
                args.get("pg", [None])[0],
                int(args["last"][0]) if "last" in args else None)
        return b"200 OK", body

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def sparse_job() -> Job:
    """The job, its in-group collectives recorded for the hung group only: no other group's
    in-group entries are ever fetched (its leader gives torchft's group only), and recording
    every group's was most of this file's time."""
    job = Job(groups=GROUPS, ranks=RANKS)
    record = job.fr.collective

    def hung_group_only(pg, op, sizes, *, members=None, **kw):
        if members is not None and job.group_of(members[0]) == HUNG_GROUP:
            record(pg, op, sizes, members=members, **kw)

    job.fr.collective = hung_group_only
    return job


@pytest.fixture(scope="module")
def job_server():
    server = JobServer(sparse_job())
    yield server
    server.close()


def run_stall(server: JobServer, tmp_path, plant, wait, mutate=None,
              fr_interval_s: float = 15.0) -> dict:
    """A fresh job behind ``server``: steps, one monitor's first sweep and 3 healthy sweeps,
    then ``plant(job)`` (the stall's collectives) and sweeps 1 s apart with ``wait(job, t)``
    setting the ranks' waits at t s after onset. What each sweep found and fetched, and
    (``seen``) per sweep the dumps its detectors were given and whether any were asked early
    (before its view: ``Polling.ask_fr_early``)."""
    job = server.job = sparse_job()
    server.fr_changed()
    clock = [T0]
    mon = Monitor(MonitorConfig(port=0, targets=server.urls, leader_polling="on",
                                member_interval_s=100.0, poll_timeout_s=10.0,
                                state_path=str(tmp_path / f"m{id(plant)}{mutate is None}.db"),
                                detectors=DetectorConfig(hang_floor_s=3.0, hang_factor=3.0,
                                                         fr_interval_s=fr_interval_s)),
                  clock=lambda: clock[0])
    if mutate is not None:
        mutate(mon)
    seen: list[dict] = []
    fetch_fr, update = mon.polling.fr_dumps, mon.detectors.update

    def fetching(view, now):
        seen.append({"early": sorted(STARTED)})
        STARTED.clear()
        return fetch_fr(view, now)

    def updating(view, dumps=None, *a, **k):
        seen[-1]["dumps"] = {r: json.dumps(d, sort_keys=True) for r, d in (dumps or {}).items()}
        return update(view, dumps, *a, **k)

    mon.polling.fr_dumps, mon.detectors.update = fetching, updating
    try:
        job.steps(6, now=clock[0])
        mon.sweep_once()  # every rank
        for _ in range(3):
            clock[0] += 1.0
            job.steps(2, now=clock[0])
            server.fr_changed()
            mon.sweep_once()
            assert not mon.detectors.open_findings()
        onset = clock[0]
        plant(job)
        server.fr_changed()
        out = {"sweeps": []}
        for t in (1.0, 2.0, 3.0, 4.0, 5.0):
            wait(job, t)
            clock[0] = onset + t
            server.asked.clear()
            mon.sweep_once()
            hangs = [(f.kind, f.replica_group, f.ranks, f.evidence["level"])
                     for f in mon.detectors.open_findings() if f.kind == "hang"]
            out["sweeps"].append({
                "t": t, "hangs": hangs,
                "drilled": dict(mon.sweep_plan.drilled),
                "torchft_fetched": sum(1 for _, what, q in server.asked
                                       if what == "fr_trace" and "pg=torchft" in q),
                "drilled_fetched": sorted(r for r, what, q in server.asked
                                          if what == "fr_trace" and "pg=torchft" not in q)})
            if hangs:
                out.update(confirmed_t=t, found=hangs, last=out["sweeps"][-1])
                break
        out["seen"] = seen
        return out
    finally:
        mon.stop()


def members(g: int) -> list[int]:
    return list(range(g * RANKS, (g + 1) * RANKS))


def cross_waits(job: Job, t: float) -> None:
    """Every rank outside the hung group waits in the cross-group all_reduce."""
    for r in range(job.world):
        if job.group_of(r) != HUNG_GROUP:
            job.wait(r, "cross", t - 0.2, phase="allreduce")


LEADER, MEMBER = members(HUNG_GROUP)
# the first sweep whose waits (t - 0.1, t - 0.2 s) pass the hang threshold, 3 s
FIRST_OVER_THRESHOLD = 4.0


def plant_member_hang(job: Job) -> None:
    job.fr.collective("0", "all_gather", [[300]], members=members(HUNG_GROUP), absent=[MEMBER])
    job.fr.ft_collective("all_reduce", [[1000]], absent=members(HUNG_GROUP))


def wait_member_hang(job: Job, t: float) -> None:
    cross_waits(job, t)
    job.wait(LEADER, "group", t - 0.1)  # blocked on the member in FSDP's all-gather
    job.wait(MEMBER, None)


def never_skip(mon: Monitor) -> None:
    mon.detectors.in_group_hangs = lambda *a, **k: set()


def test_an_in_group_hang_is_confirmed_without_the_leaders_dumps_and_no_later(job_server,
                                                                               tmp_path):
    got = run_stall(job_server, tmp_path, plant_member_hang, wait_member_hang)
    assert got["found"] == [("hang", HUNG_GROUP, [MEMBER], "in_group")]
    assert got["confirmed_t"] == FIRST_OVER_THRESHOLD
    last = got["last"]
    assert set(last["drilled"]) == {HUNG_GROUP}
    assert "in-group collective" in last["drilled"][HUNG_GROUP]
    assert last["torchft_fetched"] == 0
    assert last["drilled_fetched"] == [LEADER, MEMBER]
    # a monitor that always fetches the leaders' dumps: the same finding, the same sweep
    full = run_stall(job_server, tmp_path, plant_member_hang, wait_member_hang, never_skip)
    assert (full["found"], full["confirmed_t"]) == (got["found"], got["confirmed_t"])
    assert full["last"]["torchft_fetched"] == GROUPS - 1


def plant_leader_hang(job: Job) -> None:
    job.fr.collective("0", "all_gather", [[300]], members=members(HUNG_GROUP), absent=[LEADER])
    job.fr.ft_collective("all_reduce", [[1000]], absent=members(HUNG_GROUP))


def wait_leader_hang(job: Job, t: float) -> None:
    cross_waits(job, t)
    job.wait(LEADER, None)  # computing: outside any collective
    job.wait(MEMBER, "group", t - 0.1)


def plant_group_late(job: Job) -> None:
    for op, sizes in IN_GROUP_STEP:  # the group completes its own collectives
        job.fr.collective("0", op, sizes, members=members(HUNG_GROUP))
    job.fr.ft_collective("all_reduce", [[1000]], absent=members(HUNG_GROUP))


def wait_group_late(job: Job, t: float) -> None:
    cross_waits(job, t)
    job.wait(LEADER, None)
    job.wait(MEMBER, None)


def always_skip(mon: Monitor) -> None:
    """The mutation: the leaders' dumps skipped whenever a group is drilled (every drilled
    group taken as an in-group hang behind a blocked leader)."""
    mon.detectors.in_group_hangs = lambda view, dumps, now: set(mon.sweep_plan.drilled)


@pytest.mark.parametrize("plant, wait, found", [
    (plant_leader_hang, wait_leader_hang, [("hang", HUNG_GROUP, [LEADER], "in_group")]),
    # torchft's cross-group all_reduce of group rank 0s: the leaders' dumps name the leader
    (plant_group_late, wait_group_late, [("hang", HUNG_GROUP, [LEADER], "cross_group")]),
], ids=["leader_hung", "group_never_arrives"])
def test_the_group_the_others_wait_for_gets_the_leaders_dumps_and_no_later(
        job_server, tmp_path, monkeypatch, plant, wait, found):
    got = run_stall(job_server, tmp_path, plant, wait)
    assert got["found"] == found
    assert got["confirmed_t"] == FIRST_OVER_THRESHOLD
    last = got["last"]
    assert set(last["drilled"]) == {HUNG_GROUP}
    assert "the others wait for it" in last["drilled"][HUNG_GROUP]
    assert last["torchft_fetched"] == GROUPS - 1
    assert last["drilled_fetched"] == [LEADER, MEMBER]
    if plant is plant_group_late:  # the leaders' dumps are the evidence: skipping them misses it
        monkeypatch.setattr(polling, "_blocked_in_group", lambda gv: True)
        mutated = run_stall(job_server, tmp_path, plant, wait, always_skip)
        # named from the ranks' states alone (the whole group, level quorum), not the leader
        assert [h[3] for h in mutated.get("found", [])] in ([], ["quorum"])
        assert mutated["sweeps"][-1]["torchft_fetched"] == 0


def poll_from_a_process(monkeypatch) -> None:
    """run_stall's monitors poll from their own process (from 0 targets), and never ask the
    next sweep ahead: the job moves between sweeps, and states asked during the sweep before
    would read it before its move."""
    monkeypatch.setitem(globals(), "MonitorConfig",
                        functools.partial(MonitorConfig, poll_process_min_targets=0))
    monkeypatch.setattr(polling.Polling, "after_view", lambda *a: None)
    monkeypatch.setattr(polling.Polling, "after_decisions", lambda *a: None)
    # a dump query started and left to run (asked ahead), not a sweep's start-and-wait
    start = ProcessPoller.start

    def recording(self, urls, path, *a, **k):
        if path.startswith("/v1/fr_trace"):
            STARTED.append(path.removeprefix("/v1/fr_trace"))
        return start(self, urls, path, *a, **k)

    monkeypatch.setattr(ProcessPoller, "start", recording)
    monkeypatch.setattr(ProcessPoller, "sweep",
                        lambda self, *a, **k: start(self, *a, **k).result())


def asked_early_and_late(server: JobServer, tmp_path, monkeypatch,
                         fr_interval_s: float) -> tuple[dict, dict]:
    """The member hang run twice with the poller in its own process (from 0 targets here):
    dumps asked early (Polling.ask_fr_early) and not; both give the detectors the same dumps,
    sweep by sweep, and confirm the same hang in the same sweep. (early, late)."""
    poll_from_a_process(monkeypatch)
    early = run_stall(server, tmp_path, plant_member_hang, wait_member_hang,
                      fr_interval_s=fr_interval_s)
    late = run_stall(server, tmp_path, plant_member_hang, wait_member_hang,
                     lambda mon: setattr(mon.polling, "ask_fr_early", lambda *a: None), fr_interval_s)
    assert (early["found"], early["confirmed_t"]) == (late["found"], late["confirmed_t"])
    assert [s["dumps"] for s in early["seen"]] == [s["dumps"] for s in late["seen"]]
    assert all(not s["early"] for s in late["seen"])
    return early, late


def test_the_periodic_look_asked_early_gives_the_detectors_the_same_dumps(job_server, tmp_path,
                                                                          monkeypatch):
    """A due periodic look (every 2 s of the monitor's clock here) asks its dumps right after
    the states, before the view: the detectors get the same dumps as a monitor that asks them
    after its view (the drilled group's and the leaders', through healthy sweeps and the
    in-group hang), and the same finding in the same sweep. The looks are never held here (a
    stall holds them: tested below), so that one falls in the drilled group's sweeps."""
    monkeypatch.setattr(Detectors, "periodic_look_held", lambda *a, **k: False)
    early, _ = asked_early_and_late(job_server, tmp_path, monkeypatch, 2.0)
    asked_early = [s["early"] for s in early["seen"]]
    assert ["?pg=torchft&last=64"] in asked_early  # healthy periodic looks: the leaders'
    assert ["?last=256", "?pg=torchft&last=64"] in asked_early  # ... and a drilled group's
    assert sum(len(s["dumps"]) >= GROUPS for s in early["seen"]) >= 3


def test_a_blocked_groups_dumps_are_asked_early_between_looks(job_server, tmp_path, monkeypatch):
    """Between periodic looks (none due here), the dumps of a group drilled because its leader
    is blocked inside it are asked right after the states too: the same dumps and the same
    confirming sweep as asking them after the view; the leaders' are not asked early."""
    early, _ = asked_early_and_late(job_server, tmp_path, monkeypatch, 1000.0)
    asked_early = [s["early"] for s in early["seen"]]
    assert ["?last=256"] in asked_early  # the blocked group's, before the view
    assert all(s in ([], ["?last=256"]) for s in asked_early)  # never the leaders' here


def never_held(mon: Monitor) -> None:
    mon.detectors.periodic_look_held = lambda *a, **k: False


@pytest.mark.parametrize("early", [True, False], ids=["asked_early", "asked_after_view"])
def test_a_building_stall_holds_the_periodic_look_and_the_hang_comes_no_later(
        job_server, tmp_path, monkeypatch, early):
    """A periodic look falls due (every 2 s here) in the sweep at 3 s after a member's hang,
    when the ranks have waited ~2.9 s, under the 3 s hang threshold: held, because a rank waits
    a third of that threshold or more (no leader's dump fetched, none asked early); the hang is
    confirmed in the same sweep as by a monitor that looks then (which fetches every leader's
    dump in that sweep: ~0.9 s of a sweep at 100,000 ranks). With the poller in its own process
    (asked early) and in the monitor's (after the view)."""
    if early:
        poll_from_a_process(monkeypatch)
    held = run_stall(job_server, tmp_path, plant_member_hang, wait_member_hang,
                     fr_interval_s=2.0)
    looked = run_stall(job_server, tmp_path, plant_member_hang, wait_member_hang, never_held,
                       fr_interval_s=2.0)
    assert held["found"] == looked["found"] == [("hang", HUNG_GROUP, [MEMBER], "in_group")]
    assert held["confirmed_t"] == looked["confirmed_t"] == FIRST_OVER_THRESHOLD
    at_3 = {run: next(s for s in got["sweeps"] if s["t"] == 3.0)
            for run, got in (("held", held), ("looked", looked))}
    assert at_3["looked"]["torchft_fetched"] == GROUPS - 1  # the look, due then
    assert at_3["held"]["torchft_fetched"] == 0  # held: the leaders' dumps not fetched
    assert held["last"]["torchft_fetched"] == 0  # the hang look skips them (in-group hang)
    if early:  # nothing of the held look asked early either
        assert all("?pg=torchft&last=64" not in s["early"] for s in held["seen"][-3:])


def test_a_held_periodic_look_waits_at_most_twice_its_interval(job_server, tmp_path):
    """Every rank waits 1.5 s in the cross-group collective, sweep after sweep (over a third of
    the 3 s hang threshold, under it): the look due at 1 s after onset (2 s since the last) is
    held, and taken at 3 s, 4 s since the last look."""
    def plant(job: Job) -> None:
        pass

    def wait(job: Job, t: float) -> None:
        for r in range(job.world):
            job.wait(r, "cross", 1.5, phase="allreduce")

    got = run_stall(job_server, tmp_path, plant, wait, fr_interval_s=2.0)
    assert "found" not in got
    # dumps fetched per sweep, the leaders' or (every group drilled from 2 s: every leader
    # waits, none stands out) every rank's
    fetched = {s["t"]: s["torchft_fetched"] + len(s["drilled_fetched"]) for s in got["sweeps"]}
    assert fetched[1.0] == fetched[2.0] == 0, fetched
    assert fetched[3.0] >= GROUPS, fetched
