"""Planned maintenance on a running job: real ``lightkeeper train`` ranks, a real Lighthouse and,
where the monitor's view is checked, a real ``lightkeeper monitor``.

A rolling restart (each group in turn SIGTERMed, as Kubernetes or Slurm stop it, and started
again once gone) and then the whole job stopped at once are no incident: no finding, no host
offence, no rank counted lost (the counter behind ``LightkeeperRanksLost``) and no goodput
incident, while a rank that crashed just before the job's stop is still found dead.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest
import requests

from lightkeeper.cluster import Host, LocalCluster
from lightkeeper.processes import stop_process, wait_until

pytestmark = pytest.mark.e2e

HOSTS = [Host("host-a"), Host("host-b")]
FAULT_TOKEN = "planned-maintenance"


def _start_monitor(d, lighthouse: str) -> tuple[subprocess.Popen, str]:
    log = d / "monitor.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "lightkeeper.cli", "monitor", "--lighthouse", lighthouse,
             "--port", "0", "--interval", "0.5", "--state", str(d / "monitor.sqlite"),
             "--min-replicas", "1", "--dead-sweeps", "2",
             # a crash is found and held against its host, its group not evicted: the job's
             # stop ends its peers (an eviction's kill would race that stop)
             "--evict-on", "straggler,hang,mismatch,network,quarantined_host",
             # jobs beside this one on the same cores hold a group behind by part of a step and
             # slow the whole job by half: the box's doing, judged at two steps and four times
             "--straggler-rel-lag", "2", "--job-slow-factor", "4",
             # a rank that failed before its own SIGTERM stays in view, unreachable: forgotten
             # (30 s by default) it would be counted lost (a limit: docs/worker_server.md)
             "--forget-after", "600"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def url():
        if proc.poll() is not None:
            raise RuntimeError(f"monitor exited with {proc.returncode}: {log.read_text()[-3000:]}")
        m = re.search(r"monitor=(\S+)", log.read_text())
        return m.group(1) if m else None

    return proc, wait_until(url, 30, what="the monitor to listen")


def _ranks_lost(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=5).text
    m = re.search(r"^lightkeeper_monitor_ranks_lost_total\{[^}]*\} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_rolling_restart_and_a_whole_job_stop_are_no_incident(tmp_path):
    """Two groups of two ranks, one pod per rank (launcher bare, as a LeaderWorkerSet runs
    them). Group 0's pods get SIGTERM together; group 1's one by one, as a node drain evicts
    them: rank 1 first, while rank 0 waits for it inside an in-group collective, which rank 1's
    exit fails, so rank 0 exits unsaid before its own SIGTERM comes. Neither is a dead group
    nor held against its host."""
    # a group gone leaves the quorum once its heartbeat expires (docs/lighthouse.md: 1000 ms)
    # pg timeout 60 s: the crash below leaves its peer in the commit vote while the test waits
    # for the crash to be seen and held; no collective here ends by the timeout
    cluster = LocalCluster(tmp_path / "job", num_groups=2, ranks_per_group=2, steps=100_000,
                           step_pause_s=0.1, launcher="bare", heartbeat_timeout_ms=1000,
                           pg_timeout_s=60)
    monitor = None
    try:
        monitor, url = _start_monitor(tmp_path, cluster.start_lighthouse())
        cluster.extra_env.update(LIGHTKEEPER_MONITOR=url, LIGHTKEEPER_FAULT_TOKEN=FAULT_TOKEN)
        log = tmp_path / "monitor.log"

        def get(path):
            return requests.get(url + path, timeout=5).json()

        def inject(urls, spec):
            for u in urls:
                r = requests.post(u + "/v1/faults", timeout=5, json={"spec": spec},
                                  headers={"Authorization": f"Bearer {FAULT_TOKEN}"})
                assert r.status_code == 200, r.text

        def rank_state(u):
            return requests.get(u + "/v1/state", timeout=2).json()

        def hang_rank1(group, where, phase, what):
            """Group rank 1 hung 4 steps ahead (``where``), until rank 0 is seen waiting for
            it inside its group in ``phase``."""
            urls = group.worker_urls
            at = rank_state(urls[0])["step"] + 4
            inject(urls.values(), f"hang:at_step={at},where={where},rank=1")

            def held():
                s0, s1 = (rank_state(urls[r]) for r in (0, 1))
                return s1["faults_struck_at"] and s0["phase"] == phase and (
                    s0["timing"]["waiting"] or {}).get("scope") == "group"
            wait_until(held, 30, interval=0.05, what=what)

        def stepping(g, above):
            return any(r["replica_group"] == g and (r.get("step") or 0) > above
                       and r.get("phase") != "stopped" for r in get("/v1/ranks"))

        def forgotten_as_stopped(urls):
            wait_until(lambda: all(f"forgot {u}: stopped by SIGTERM" in log.read_text()
                                   for u in urls), 30, interval=0.1,
                       what=f"{urls} forgotten as stopped by SIGTERM")

        def judged():  # a rank gone unsaid is dead after --dead-sweeps 2
            after = get("/v1/cluster")["sweeps"] + 4
            wait_until(lambda: get("/v1/cluster")["sweeps"] >= after, 30, interval=0.2,
                       what="4 more sweeps")

        for g in range(2):
            cluster.start_group(g, host=HOSTS[g])
        for g in range(2):  # each restart's incarnation, imported meanwhile
            cluster.start_spare(g, host=HOSTS[g])
        for g in range(2):
            cluster.wait_for_workers(g, timeout=120)
        wait_until(lambda: all(stepping(g, 3) for g in range(2)), 120, interval=0.2,
                   what="every group stepping, as the monitor sees it")
        for g in range(2):  # the rolling restart
            old = cluster.groups[g]
            wait_until(lambda: cluster.spares[g].ready(), 120, interval=0.2,  # noqa: B023
                       what=f"group {g}'s spare")
            step = max(r.get("step") or 0 for r in get("/v1/ranks"))
            if g == 0:
                for p in old.rank_procs.values():
                    p.send_signal(signal.SIGTERM)
                for p in old.rank_procs.values():
                    p.wait(timeout=20)
                forgotten_as_stopped(list(old.worker_urls.values()))
            else:  # rank 0 blocked in FSDP's all-gather for rank 1 (stopped before its forward)
                hang_rank1(old, "group", "forward",
                           "rank 1 hung, rank 0 waiting for it in its group")
                old.rank_procs[1].send_signal(signal.SIGTERM)  # said, read, gone: well before
                assert old.rank_procs[1].wait(timeout=20) == -signal.SIGTERM  # a hang is found
                assert old.rank_procs[0].wait(timeout=20) == 1  # its all-gather failed
                old.rank_procs[0].send_signal(signal.SIGTERM)  # its SIGTERM, too late
                forgotten_as_stopped([old.worker_urls[1]])
            cluster.start_group(g, host=HOSTS[g])
            cluster.wait_for_workers(g, timeout=120)  # as at the start, on a busy machine
            wait_until(lambda: stepping(g, step), 60, interval=0.2,  # noqa: B023
                       what=f"group {g} back and stepping")
        judged()
        # a planned stop while the job goes on is no lost rank (LightkeeperRanksLost)
        assert _ranks_lost(url) == 0
        assert get("/v1/findings") == []
        assert get("/v1/hosts")["hosts"] == []
        assert get("/v1/goodput")["incidents"] == []

        # the whole job stopped on purpose, every rank at once, but for group 1's rank 1 that
        # crashed just before (seen down by the monitor first, as torchrun stops the crashed
        # rank's peers once it saw it go): that one is still a crash. It crashes where its
        # peer waits for it in the commit vote, which its end does not fail (an in-group
        # collective would: its peer would go down unsaid too, a second crash)
        crashed_group = cluster.groups[1]
        hang_rank1(crashed_group, "cross", "commit",
                   "rank 3 hung before its all_reduce, rank 2 waiting for its vote")
        crashed = crashed_group.rank_procs[1]
        crashed.send_signal(signal.SIGKILL)
        crashed.wait(timeout=20)
        crashed_url = crashed_group.worker_urls[1]
        wait_until(lambda: any(r["url"] == crashed_url and not r["reachable"]
                               for r in get("/v1/ranks")), 30, interval=0.2,
                   what="the crashed rank seen down")
        # found a crash once its group is seen held by it or gone (a rank merely unreachable
        # from the monitor is none), and held against its host, before the job is stopped
        wait_until(lambda: [h["host"] for h in get("/v1/hosts")["hosts"]] == ["host-b"], 30,
                   interval=0.2, what="the crash held against its host")
        # its peer waits in the vote until the process group's timeout (pg_timeout_s, 60 s)
        assert crashed_group.rank_procs[0].poll() is None, "rank 2 went down before its SIGTERM"
        for g in cluster.groups.values():
            for p in g.rank_procs.values():
                if p is not crashed:
                    p.send_signal(signal.SIGTERM)
        for g in cluster.groups.values():
            for p in g.rank_procs.values():
                p.wait(timeout=20)
        forgotten_as_stopped([u for g in cluster.groups.values() for u in g.worker_urls.values()
                              if u != crashed_url])
        judged()
        assert _ranks_lost(url) == 0
        # (dead_rank while its group's Manager still answered, then dead: the crash alone)
        found = {(f["kind"], f["replica_group"], tuple(f["ranks"])) for f in get("/v1/findings")}
        assert found and found <= {("dead_rank", 1, (3,)), ("dead", 1, (3,))}, found
        # held against its host alone; no planned stop is
        hosts = get("/v1/hosts")["hosts"]
        assert [h["host"] for h in hosts] == ["host-b"], hosts
        assert {o["ranks"] == [3] for o in hosts[0]["offences"]} == {True}, hosts
        # the only goodput incident is the crash's
        assert {i["kind"] for i in get("/v1/goodput")["incidents"]} <= {"dead_rank", "dead"}
    finally:
        if monitor is not None:
            stop_process(monitor)
        cluster.stop()


def test_a_rank_whose_peer_stopped_first_still_says_it_stopped(tmp_path):
    """Both ranks of a group get SIGTERM; the one read first exits, which fails its peer's
    collective: the peer must still say it stopped, not vanish as a crash would.

    The reader here is the test, with the monitor's User-Agent, not a monitor process: the
    order of the two reads decides it, and the monitor reads a group's ranks at once."""
    cluster = LocalCluster(tmp_path / "job", num_groups=1, ranks_per_group=2, steps=100_000,
                           step_pause_s=0.1, launcher="bare")
    try:
        cluster.start_lighthouse()
        # group rank 1 stops before step 3's forward: rank 0 waits for it in FSDP's all-gather
        group = cluster.start_group(0, faults=["hang:at_step=3,where=group,rank=1"])
        urls = cluster.wait_for_workers(0, timeout=120)
        plain, monitor = requests.Session(), requests.Session()
        monitor.headers["User-Agent"] = "lightkeeper-monitor"

        def state(session, rank):
            try:
                return session.get(urls[rank] + "/v1/state", timeout=2).json()
            except requests.RequestException:
                return None

        # read as a monitor at --interval 5 reads (the reader's pace, not a wait for an event;
        # the first read before the start, the next once rank 0 is blocked): a rank SIGTERMed
        # then answers, saying it stopped, until two intervals have passed since its last read
        # (server.stopped()), then ends. Every read below is due by then, on a machine busy
        # with other jobs too; past it the rank is gone, and waiting longer cannot see it.
        pace = 5.0
        assert all(state(monitor, r) for r in (0, 1))
        first = time.monotonic()
        wait_until(lambda: (s := state(plain, 0)) and s["step"] >= 3 and s["phase"] == "forward",
                   120, interval=0.2, what="rank 0 blocked in step 3's all-gather")
        time.sleep(max(0.0, first + pace - time.monotonic()))
        said_until = time.monotonic() + 2 * pace
        assert all(state(monitor, r) for r in (0, 1))
        for p in group.rank_procs.values():
            p.send_signal(signal.SIGTERM)
        # (a plain read is not a monitor's: it does not end the rank's wait for one)
        wait_until(lambda: (s := state(plain, 1)) and s["finished"],
                   said_until - time.monotonic(), interval=0.05,
                   what="rank 1 saying it stopped (it waits for a read this long at most)")
        assert state(monitor, 1)["stopped_by"] == "SIGTERM"
        assert group.rank_procs[1].wait(timeout=10) == -signal.SIGTERM
        try:  # its peer gone, rank 0's all-gather fails; the old code then stopped serving
            wait_until(lambda: state(plain, 0) is None, 1.0, interval=0.05)
        except TimeoutError:
            pass
        said = state(monitor, 0)
        assert said is not None, "rank 0 stopped serving before saying it stopped"
        assert (said["finished"], said["stopped_by"], said["phase"]) == (True, "SIGTERM", "stopped")
        group.rank_procs[0].wait(timeout=10)
    finally:
        cluster.stop()


def test_a_stopped_rank_waits_for_the_next_read_and_takes_no_more_steps(tmp_path):
    """A monitor's reads are not evenly spaced (a sweep asked ahead, a retry): one soon after
    another must not make a SIGTERMed rank think the monitor polls that often and go unsaid.
    While it waits, the rank takes no further step: a quorum it joined now would hold the other
    groups in its process group's configuration until its timeout, once it is gone.

    The reader is the test, with the monitor's User-Agent: the spacing of the reads decides it."""
    cluster = LocalCluster(tmp_path / "job", num_groups=1, steps=100_000, step_pause_s=0.1,
                           launcher="bare")
    try:
        cluster.start_lighthouse()
        proc = cluster.start_group(0).proc
        url = cluster.wait_for_workers(0, timeout=120)[0] + "/v1/state"
        monitor = requests.Session()
        monitor.headers["User-Agent"] = "lightkeeper-monitor"
        wait_until(lambda: requests.get(url, timeout=2).json()["step"] >= 1, 120, interval=0.2,
                   what="the rank stepping")
        monitor.get(url, timeout=2)
        time.sleep(1.0)  # the reader's pace: one read a second ...
        monitor.get(url, timeout=2)
        step = monitor.get(url, timeout=2).json()["step"]  # ... and one more at once
        proc.send_signal(signal.SIGTERM)
        try:  # the old code ended the rank at once, unsaid
            wait_until(lambda: proc.poll() is not None, 1.0, interval=0.05)
        except TimeoutError:
            pass
        said = monitor.get(url, timeout=2).json()  # the next read, within its interval
        assert (said["finished"], said["stopped_by"]) == (True, "SIGTERM")
        # the step under way and, on a loaded box, one begun before the watcher thread ran
        # (~0.15 s each); unheld, it steps on until this read, ~1 s later (6 steps or more)
        assert said["step"] <= step + 3
        assert proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        cluster.stop()
