"""The monitor against a real FT-HSDP job: 3 replica groups x 2 ranks, one fault after another.

Real parts only: torchft's Lighthouse, every rank its own process launched bare (RANK/WORLD_SIZE/
MASTER_* set, group rank 0 hosts the group's store: ranks of one group as on other hosts, with no
local agent to tear them down), FSDP2 inside a group over real gloo, torchft across groups, the
monitor as a ``lightkeeper monitor`` process the ranks register with. Each group runs on its own
"host" (``NODE_NAME``); group 2's first incarnation runs with its clock 0.5 s ahead (Debian's
libfaketime, as ``bin/bootstrap --system`` installs it; without it that test skips, or fails in
CI; see tests/support/faketime.py). A supervisor thread plays Kubernetes: a group none of whose
processes is left is started again (``LocalCluster.start_group`` refuses while any process of the
group runs, so an evicted group is wholly gone before it is restarted), from a warm spare
(``LocalCluster.start_spare``: its processes imported torch before the test began), as the demo
restarts a group.

Why warm spares, all imported before the job starts: this module runs 6 ranks, a monitor and the
Lighthouse on a 2-core box, and the monitor judges the job from its first quorum on. Processes
importing torch (5-12 s of both cores each) beside the judged job starve a healthy group enough
for the straggler rule to confirm it (a cold restart's imports did, and so did spares importing
beside the job's first steps), a contention production does not have (there a restarting group
has a host of its own). So one spare per restart the module makes (``RESTARTS``) imports first,
then the groups start; no import runs while the monitor judges (``Job.prepare`` starts one only
if an earlier failure used a spare up, and then waits for steps after it).

One job serves the module, in file order (each fault is posted live to the running ranks through
their token-guarded ``POST /v1/faults``):

1. clock-shifted healthy: group 2's Flight Recorder enqueue times are 0.5 s ahead; no finding;
2. in-group hang on group 2's rank 1 (still the clock-shifted group): rank 5 named, evicted; the
   kill ends rank 4 only, the monitor tells the hung rank 5 to exit (``POST /v1/exit``); one
   hang quarantines host-g2, and the supervisor restarts the group on another node;
3. dead rank in a live group: group 0's rank 1 exits; its rank 0 (the Manager) lives on, blocked
   in the commit vote: ``dead_rank`` within max(5 s, 5 x median step), evicted;
4. in-group mismatch on group 1's rank 1 (a same-width dtype mismatch in FSDP's all-gather):
   rank 3 named by its step pattern, evicted;
5. healthy again after all of it: no new finding.

The straggler (``slow_compute`` on group 1's rank 1, found as rank 3 on its host within 10 steps,
evicted, restarted warm, healed) has no scenario here: tests/test_demo_e2e.py's default scenario
plays it on a 3 x 2 job with this monitor and asserts the same finding and decision.

Every scenario asserts the group, rank(s) and host named, no finding about any other group, the
eviction through the Lighthouse confirmed, the survivors committing again, and the evicted group
restarted by the supervisor, healed and back in a 3-group quorum.

A fault is posted inside ``Job.fault`` (a context manager): should the test fail before the
faulted incarnation is gone, it is ended on the way out (its group killed, restarted by the
supervisor, back in the quorum, nothing left open about it), so one failure stays one failure
instead of leaving a slow, hung or crashed group to the tests after it.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import requests

from lightkeeper.cluster import Host, HostPool, LocalCluster
from lightkeeper.processes import free_port, stop_process, wait_until
from tests.conftest import require_binary
from tests.support.faketime import faketime_env
from tests.support.workers import get_json, try_state

# solo: the straggler rule judges this job from its first quorum on; another job on the two
# cores (the other worker's) slowed the clock-shifted group past its bar now and then
pytestmark = [pytest.mark.e2e, pytest.mark.solo]

FAULT_TOKEN = "multirank-faults"
EXIT_TOKEN = "multirank-exit"
SHIFT_S = 0.5
# Each rank rests this long a step (sleeping, not computing): on 2 cores the 6 ranks' contention
# scatters healthy groups' cross-group waits; a shorter rest put a healthy group over the
# straggler rule's bar now and then. A production step is seconds long, on cores of its own.
STEP_PAUSE_S = 0.25
RESTARTS = (2, 0, 1)  # the groups the tests below restart, in file order: a spare each
HEALTHY_STEPS = 12  # a healthy stretch: the straggler rule confirms within 10 steps of an onset


class Job:
    """The cluster, the monitor process and the supervisor."""

    def __init__(self, d, monitor_port: int) -> None:
        self.dir = d
        self.monitor_url = f"http://127.0.0.1:{monitor_port}"
        self.monitor_port = monitor_port
        self.cluster = LocalCluster(
            d / "cluster", num_groups=3, ranks_per_group=2, steps=100_000,
            step_pause_s=STEP_PAUSE_S, pg_timeout_s=20, join_timeout_ms=2000, heartbeat_timeout_ms=3000, launcher="bare",
            extra_env={"LIGHTKEEPER_MONITOR": self.monitor_url,
                       "LIGHTKEEPER_FAULT_TOKEN": FAULT_TOKEN,
                       "LIGHTKEEPER_EXIT_TOKEN": EXIT_TOKEN})
        self.base_env = dict(self.cluster.extra_env)
        self.shift_env = faketime_env(SHIFT_S, d / "faketime-shim")
        self.monitor: subprocess.Popen | None = None
        self.restarts: list[dict] = []  # the supervisor's log
        # host-g0..g2 run the groups, host-g3..g5 are spares (lightkeeper.cluster.HostPool)
        self.pool = HostPool([Host(f"host-g{i}") for i in range(6)], groups=3)
        self.placements: list[dict] = []
        self.exits: dict[tuple[int, int], list[int | None]] = {}  # (group, incarnation) -> codes
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        self.error: BaseException | None = None
        # a second spare of a group restarted twice waits here (LocalCluster keeps one a group)
        self.reserve: dict[int, list] = {}
        self.faulted: set[str] = set()  # replica ids of the incarnations faults were posted to
        self.evicted: set[str] = set()  # ... of those evicted, confirmed and replaced (passed)

    # --- processes ---------------------------------------------------------------------
    def start_group(self, g: int, first: bool) -> None:
        """Start group ``g`` on its node; a restart goes to a fresh node when the monitor has
        quarantined the group's node (as a scheduler honouring the quarantine taint would)."""
        host = self.pool.place(g, [] if first else self.quarantined())
        if host is None:
            raise RuntimeError(f"no free host for group {g}: {self.quarantined()} quarantined")
        self.placements.append({"group": g, "node": host.node, "at": time.time()})
        env = dict(self.base_env)
        if first and g == 2 and self.shift_env:
            env.update(self.shift_env)  # this "host" runs 0.5 s ahead
        with self._lock:
            self.cluster.extra_env = env
            # a first start is cold (group 2's runs shifted): the group's spare is for its restart
            self.cluster.start_group(g, host=host, use_spare=not first)

    def start_spares(self) -> None:
        """One warm spare per restart in RESTARTS, started and imported before any group (their
        environment: base_env; a restart never runs shifted)."""
        spares = []
        with self._lock:
            self.cluster.extra_env = dict(self.base_env)
            for g in RESTARTS:
                if g in self.cluster.spares:  # the group's second: its first waits aside
                    self.reserve.setdefault(g, []).append(self.cluster.spares.pop(g))
                spares.append(self.cluster.start_spare(g))
        wait_until(lambda: all(sp.ready() for sp in spares), 300, interval=0.5,
                   what=f"{len(spares)} warm spares to import")

    def prepare(self, g: int, steps: int = 5) -> None:
        """Before a test that restarts group ``g``: its warm spare in place and ready (one
        waiting aside moves in). Should none be left (an earlier failure's restart used it),
        one is started, and then ``steps`` more steps of every group run before the test's
        own windows begin."""
        with self._lock:
            spare = self.cluster.spares.get(g)
            if (spare is None or not spare.group.alive()) and self.reserve.get(g):
                spare = self.cluster.spares[g] = self.reserve[g].pop()
            started = spare is None or not spare.group.alive()
            if started:
                self.cluster.extra_env = dict(self.base_env)
                spare = self.cluster.start_spare(g)
        wait_until(spare.ready, 150, interval=0.5, what=f"group {g}'s warm spare to import")
        if started:
            base = {h: self.step(h) for h in range(3)}
            wait_until(lambda: all(self.step(h) >= base[h] + steps for h in range(3)), 90,
                       interval=0.3, what=f"{steps} steps after the spares' imports")

    def start(self) -> None:
        self.cluster.start_lighthouse()
        log = open(self.dir / "monitor.log", "wb")
        self.monitor = subprocess.Popen(
            [sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", str(self.monitor_port),
             "--lighthouse", self.cluster.lighthouse_url, "--state", str(self.dir / "m.sqlite"),
             "--interval", "0.5", "--cooldown", "3", "--min-replicas", "2",
             "--fr-interval", "2", "--rank-exit-token", EXIT_TOKEN, "--orphan-grace", "2",
             "--starting-timeout", "120"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        wait_until(self.monitor_up, 30, what="the monitor to serve")
        self.start_spares()
        for g in range(3):
            self.start_group(g, first=True)
        for g in range(3):
            self.cluster.wait_for_workers(g, timeout=120)
        self._supervisor = threading.Thread(target=self._supervise, daemon=True)
        self._supervisor.start()

    def quarantined(self) -> list[str]:
        return requests.get(self.monitor_url + "/v1/hosts", timeout=5).json()["quarantined"]

    def monitor_up(self) -> bool:
        if self.monitor.poll() is not None:
            raise RuntimeError(f"monitor exited with {self.monitor.returncode}")
        try:
            return requests.get(self.monitor_url + "/healthz", timeout=1).ok
        except requests.RequestException:
            return False

    def _supervise(self) -> None:
        """Restart a group once none of its processes is left (as Kubernetes would)."""
        try:
            while not self._stop.wait(0.2):
                for g, grp in list(self.cluster.groups.items()):
                    if grp.alive():
                        continue
                    codes = {r: p.returncode for r, p in grp.rank_procs.items()}
                    self.restarts.append({"group": g, "at": time.time(), "exit_codes": codes})
                    self.start_group(g, first=False)
                    self.restarts[-1]["warm"] = self.cluster.groups[g].warm
                    self.cluster.wait_for_workers(g, timeout=120)
        except BaseException as e:  # surfaced by the tests
            self.error = e

    def stop(self) -> None:
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=150)
        for spare in (sp for waiting in self.reserve.values() for sp in waiting):
            for proc in spare.group.processes():
                stop_process(proc, grace=0.0)
        try:
            self.cluster.stop()  # before the monitor: a SIGTERMed rank waits for its next read
        finally:
            if self.monitor is not None:
                stop_process(self.monitor, grace=5)

    # --- reading ---------------------------------------------------------------------
    def mon(self, path: str):
        r = requests.get(self.monitor_url + path, timeout=5)
        r.raise_for_status()
        return r.json()

    def states(self, g: int) -> dict[int, dict]:
        grp = self.cluster.groups[g]
        out = {}
        for r, url in list(grp.worker_urls.items()):
            s = try_state(url)
            if s is not None:
                out[r] = s
        return out

    def step(self, g: int) -> int:
        return max((s["step"] for s in self.states(g).values()), default=-1)

    def replica_id(self, g: int) -> str:
        return wait_until(lambda: next((s["replica_id"] for s in self.states(g).values()
                                        if s["replica_id"]), None), 30,
                          what=f"group {g}'s replica id")

    def post_fault(self, g: int, spec: str) -> None:
        for url in self.cluster.groups[g].worker_urls.values():  # as the demo does: every rank
            r = requests.post(url + "/v1/faults", json={"spec": spec}, timeout=5,
                              headers={"Authorization": f"Bearer {FAULT_TOKEN}"})
            assert r.status_code == 200, r.text

    @contextmanager
    def fault(self, g: int, spec: str) -> Iterator[str]:
        """Post ``spec`` to group ``g``'s ranks; yields the replica id it was posted to. A test
        that fails before that incarnation is gone leaves nothing behind: no fault is withdrawn
        but by ending the processes, so the group is killed (the supervisor restarts it), and
        the job waits until it is back in a 3-group quorum and the monitor has nothing open about
        the faulted incarnation but ``dead``; then the test's own failure is raised."""
        rid = self.replica_id(g)
        self.faulted.add(rid)
        self.post_fault(g, spec)
        try:
            yield rid
        except BaseException:
            self._end_incarnation(g, rid)
            raise

    def _end_incarnation(self, g: int, rid: str) -> None:
        try:
            with self._lock:  # not while the supervisor starts it again
                if any(s["replica_id"] == rid for s in self.states(g).values()):
                    self.cluster.kill_group(g)
            wait_until(lambda: self.all_in_quorum() and all(
                s["replica_id"] != rid for s in self.states(g).values()), 180, interval=0.5,
                what=f"group {g} restarted and back in the quorum after a failed test")
            wait_until(lambda: not [f for f in self.mon("/v1/findings?open=1")
                                    if f["replica_id"] == rid and f["kind"] != "dead"],
                       30, interval=0.5, what=f"the findings about {rid} resolved")
        except Exception as e:  # the test's own failure is the one reported
            print(f"could not end group {g}'s faulted incarnation {rid}: {e}", file=sys.stderr)

    def all_in_quorum(self) -> bool:
        """Every rank of the 3 groups answers, in one 3-group quorum, past a committed step."""
        states = [s for g in range(3) for s in self.states(g).values()]
        return len(states) == 6 and len({s["quorum_id"] for s in states}) == 1 and all(
            s["num_participants"] == 3 and s["participating"] and s["commits"] > 0
            for s in states)

    def findings(self) -> list[dict]:
        return self.mon("/v1/findings")

    def evictions(self) -> list[dict]:
        return [d for d in self.mon("/v1/evictions") if d["decision"] == "evict"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    j = Job(tmp_path_factory.mktemp("multirank"), free_port())
    try:
        j.start()
        wait_until(j.all_in_quorum, 180, interval=0.5, what="6 ranks in a 3-group quorum")
        yield j
    finally:
        j.stop()


def other_findings(job: Job, g: int, since: float) -> list[dict]:
    """Findings about any group but ``g`` confirmed since ``since``."""
    return [f for f in job.findings() if f["replica_group"] != g and f["confirmed_at"] >= since]


def evicted_and_back(job: Job, g: int, kind: str, rid: str, since: float) -> dict:
    """The eviction of ``rid`` for ``kind`` went through the Lighthouse and was confirmed (no
    rank of it answers), the other groups commit again, and the supervisor restarted ``g``, which
    healed and is back in a 3-group quorum. Returns the eviction."""
    d = wait_until(lambda: next((d for d in job.evictions() if d["replica_id"] == rid
                                 and d["status"] != "sending"), None),
                   30, interval=0.3, what=f"group {g}'s eviction sent")
    assert (d["replica_group"], d["reason"], d["source"]) == (g, kind, "auto"), d
    assert d["http_status"] is not None, d  # the Lighthouse answered the kill
    d = wait_until(lambda: next((x for x in job.evictions() if x["id"] == d["id"]
                                 and x["status"] == "confirmed"), None), 40, interval=0.3,
                   what=f"group {g}'s eviction confirmed: no rank of {rid} answers")
    survivors = [h for h in range(3) if h != g]

    def survivors_commit():
        states = [s for h in survivors for s in job.states(h).values()]
        return len(states) == 4 and all(s["commits"] >= base[(s["rank"])] + 3 for s in states)

    base = {s["rank"]: s["commits"] for h in survivors for s in job.states(h).values()}
    wait_until(survivors_commit, 60, interval=0.3, what="the survivors to commit again")
    restart = wait_until(lambda: next((r for r in job.restarts if r["group"] == g
                                       and r["at"] >= since), None), 60, interval=0.3,
                         what=f"the supervisor to restart group {g}")
    assert all(code is not None for code in restart["exit_codes"].values()), restart
    assert restart.get("warm"), restart  # from the spare Job.prepare made ready
    wait_until(job.all_in_quorum, 120, interval=0.5, what=f"group {g} back in the quorum")
    new = job.states(g)
    assert all(s["replica_id"] != rid for s in new.values())
    assert all(s["heals"] >= 1 for s in new.values()), new  # it loaded its shards from a peer
    new_rids = {s["replica_id"] for s in new.values()}
    assert [f for f in job.findings() if f["replica_id"] in new_rids] == []  # starts clean
    # the evicted incarnation's ranks exit because of the kill: no dead finding of it
    assert [f for f in job.findings() if f["replica_id"] == rid and f["kind"] == "dead"] == []
    assert job.error is None, job.error
    job.evicted.add(rid)
    return d


def test_clock_shifted_healthy_job_has_no_findings(job):
    require_binary("faketime")
    since = time.time()
    start = job.step(0)
    wait_until(lambda: job.step(0) >= start + HEALTHY_STEPS, 90, interval=0.5,
               what=f"{HEALTHY_STEPS} healthy steps")
    # the shift is real: group 2's wall clock (its Flight Recorder dump time) runs 0.5 s ahead.
    # The dump is made between asking and the answer: its clock's offset from ours lies in
    # [dump - answered, dump - asked], taken from the quickest of 5 asks (a busy rank's answer
    # can take longer than the tolerance)
    ahead = {}
    for g in range(3):
        spans = []
        for _ in range(5):
            before = time.time()
            dump = get_json(job.cluster.groups[g].worker_urls[0] + "/v1/fr_trace", 10)
            after = time.time()
            t = dump["dump_time_ns"] / 1e9
            spans.append((after - before, t - after, t - before))
        ahead[g] = min(spans)[1:]
    assert ahead[2][0] > SHIFT_S - 0.15, ahead  # at least ~0.5 s ahead
    assert all(lo < 0.15 and hi > -0.15 for lo, hi in (ahead[0], ahead[1])), ahead  # none
    assert job.findings() == [] and job.evictions() == []
    c = job.mon("/v1/cluster")
    assert c["quorum_participants"] == 3 and all(g["in_quorum"] for g in c["groups"])
    assert {g["replica_group"] for g in c["groups"]} == {0, 1, 2}
    assert time.time() - since < 90


def test_in_group_hang_names_the_rank_and_the_monitor_ends_it(job):
    job.prepare(2)
    since = time.time()
    hung_pid = job.states(2)[1]["pid"]
    at = job.step(2) + 3
    with job.fault(2, f"hang:at_step={at},where=group,rank=1") as rid:
        f = wait_until(lambda: next((f for f in job.findings() if f["kind"] == "hang"), None),
                       60, interval=0.3, what="the hang finding")
        assert (f["replica_group"], f["replica_id"], f["ranks"]) == (2, rid, [5]), f
        ev = f["evidence"]
        assert ev["level"] == "in_group" and ev["never_arrived"] == [5]
        assert ev["waiting_ranks"] == [4]
        assert ev["culprit_hosts"] == ["host-g2"] and ev["culprits"][0]["waiting"] is None
        # onset: the survivors' last committed step (an unshifted clock); confirmed within
        # max(5 s, 5 x median step)
        onset = max(s["last_step_at"] for s in job.states(0).values())
        med = ev["median_step_s"] or 0.0
        assert f["confirmed_at"] - onset <= max(5.0, 5 * med) + 0.5, \
            (f["confirmed_at"] - onset, ev)
        assert other_findings(job, 2, since) == []
        d = evicted_and_back(job, 2, "hang", rid, since)
    # the kill ended rank 4 (the Manager's process); the monitor told the hung rank 5 to exit
    assert "told rank(s)" in d["detail"] and f"pid {hung_pid}" in d["detail"], d["detail"]
    restart = next(r for r in job.restarts if r["group"] == 2 and r["at"] >= since)
    assert restart["exit_codes"][1] == 1, restart  # the hung rank exited through /v1/exit
    # one hang quarantines its host (--quarantine-after hang=1): the group came back elsewhere
    assert "host-g2" in job.quarantined()
    moved = next(p for p in job.placements if p["group"] == 2 and p["at"] >= since)
    assert moved["node"] != "host-g2", job.placements
    assert {s["node"] for s in job.states(2).values()} == {moved["node"]}
    assert other_findings(job, 2, since) == []


def test_dead_rank_in_a_live_group_is_evicted(job):
    job.prepare(0)
    since = time.time()
    grp = job.cluster.groups[0]
    at = job.step(0) + 3
    with job.fault(0, f"crash:at_step={at},rank=1") as rid:
        wait_until(lambda: grp.rank_procs[1].poll() is not None, 60, interval=0.05,
                   what="group 0's rank 1 to exit")
        died = time.time()
        assert grp.rank_procs[0].poll() is None  # its Manager rank lives on, blocked in the vote
        f = wait_until(lambda: next((f for f in job.findings() if f["kind"] == "dead_rank"),
                                    None), 30, interval=0.2, what="the dead_rank finding")
        assert (f["replica_group"], f["replica_id"], f["ranks"]) == (0, rid, [1]), f
        assert f["evidence"]["culprit_hosts"] == ["host-g0"] and f["evidence"]["alive"] == [0]
        med = statistics.median(v for s in job.states(2).values()
                                for v in s["recent_step_seconds"])
        assert f["confirmed_at"] - died <= max(5.0, 5 * med), (f["confirmed_at"] - died, med)
        assert other_findings(job, 0, since) == []
        evicted_and_back(job, 0, "dead_rank", rid, since)
    assert other_findings(job, 0, since) == []


def test_in_group_mismatch_names_the_rank(job):
    job.prepare(1)
    since = time.time()
    at = job.step(1) + 3
    with job.fault(1, f"mismatch:at_step={at},where=group,rank=1") as rid:
        f = wait_until(lambda: next((f for f in job.findings() if f["kind"] == "mismatch"
                                     and f["confirmed_at"] >= since), None),
                       60, interval=0.3, what="the mismatch finding")
        assert (f["replica_group"], f["replica_id"], f["ranks"]) == (1, rid, [3]), f
        ev = f["evidence"]
        assert ev["level"] == "in_group" and ev["attributed_by"] == "step_pattern", ev
        assert ev["culprit_hosts"] == ["host-g1"]
        assert other_findings(job, 1, since) == []
        evicted_and_back(job, 1, "mismatch", rid, since)
    assert other_findings(job, 1, since) == []


def test_healthy_again_after_every_eviction(job):
    since = time.time()
    start = job.step(0)
    wait_until(lambda: job.step(0) >= start + HEALTHY_STEPS, 90, interval=0.5,
               what=f"{HEALTHY_STEPS} more steps")
    assert [f for f in job.findings() if f["confirmed_at"] >= since] == []
    assert not [f for f in job.mon("/v1/findings?open=1") if f["kind"] != "dead"]
    # only faulted incarnations evicted, each once, confirmed: the 3 when every test passed (a
    # failed one's incarnation may have been evicted or ended by Job.fault; it fails alone)
    evicted = [d["replica_id"] for d in job.evictions()]
    assert len(evicted) == len(set(evicted)) and job.evicted <= set(evicted) <= job.faulted
    assert all(d["status"] == "confirmed" for d in job.evictions())
    assert job.error is None
    assert os.path.exists(job.dir / "m.sqlite")
