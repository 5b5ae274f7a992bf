"""The monitor against a real torchft job: Lighthouse + 3 replica groups as processes, on CPU.

One cluster serves the whole module, one fault after another (tests run in file order):

1. healthy run: no findings, no evictions;
2. group 2 turns slow (``slow:delay=0.6,from_step=S``): straggler confirmed within 10 steps,
   evicted through the Lighthouse, survivors' step time back to normal;
3. the monitor is restarted (same ``--state``): the audit log is intact, the restarted group 2
   (new replica id) is not evicted on old evidence;
4. the new group 2 hangs: detected and evicted, survivors commit again well before the 20 s
   process-group timeout;
5. group 2 restarted once more with a mismatched all_reduce, monitor restarted with
   ``--min-replicas 3``: the mismatch is reported for group 2 and the eviction held back.

Monitors run as ``lightkeeper monitor`` processes; ranks find them through self-registration.
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys

import pytest
import requests

from lightkeeper.cluster import LocalCluster, stop_process, wait_until
from tests.support.workers import try_state

pytestmark = pytest.mark.e2e

SLOW_FROM = 60
STEP_PAUSE = 0.1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MonitorProc:
    def __init__(self, env, *extra: str) -> None:
        self.url = env["monitor_url"]
        log = open(env["dir"] / f"monitor{env['monitors']}.log", "wb")
        env["monitors"] += 1
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", str(env["port"]),
             "--lighthouse", env["cluster"].lighthouse_url, "--state", str(env["state"]),
             "--interval", "0.5", "--cooldown", "5", "--min-replicas", "2", *extra],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        wait_until(self.up, 30, what="the monitor to serve")

    def up(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"monitor exited with {self.proc.returncode}")
        try:
            return requests.get(self.url + "/healthz", timeout=1).ok
        except requests.RequestException:
            return False

    def get(self, path: str):
        r = requests.get(self.url + path, timeout=5)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        stop_process(self.proc, grace=10)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("monitor_e2e")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cluster = LocalCluster(d / "cluster", num_groups=3, steps=100_000, step_pause_s=STEP_PAUSE,
                           pg_timeout_s=20, join_timeout_ms=5000, heartbeat_timeout_ms=5000,
                           extra_env={"LIGHTKEEPER_MONITOR": url})
    e = {"dir": d, "port": port, "monitor_url": url, "state": d / "monitor.sqlite",
         "cluster": cluster, "monitors": 0, "monitor": None}
    try:
        cluster.start_lighthouse()
        e["monitor"] = MonitorProc(e)
        for g in range(3):
            cluster.start_group(g, [f"slow:delay=0.6,from_step={SLOW_FROM}"] if g == 2 else None)
        for g in range(3):
            cluster.wait_for_workers(g, timeout=90)
        yield e
    finally:
        if e["monitor"] is not None:
            e["monitor"].stop()
        cluster.stop()


def group_states(env, g: int) -> list[dict]:
    grp = env["cluster"].groups[g]
    return [s for s in (try_state(u) for u in grp.worker_urls.values()) if s]


def step_of(env, g: int) -> int:
    states = group_states(env, g)
    return max(s["step"] for s in states) if states else -1


def median_recent(env, g: int, last: int = 5) -> float | None:
    vals = [v for s in group_states(env, g) for v in s["recent_step_seconds"][-last:]]
    return statistics.median(vals) if vals else None


def restart_group(env, g: int, fault_in_steps: int, kind: str) -> int:
    """Restart group g with a fault ``fault_in_steps`` after the survivors' current step."""
    cluster = env["cluster"]
    wait_until(lambda: not cluster.groups[g].alive(), 30, what=f"group {g} to exit")
    at = step_of(env, 0) + fault_in_steps
    cluster.start_group(g, [f"{kind}:at_step={at}"])
    cluster.wait_for_workers(g, timeout=90)
    wait_until(lambda: step_of(env, g) >= step_of(env, 0) - 2 and step_of(env, g) > 0, 90,
               what=f"restarted group {g} to catch up")
    return at


def evictions(mon, decision=None):
    return [d for d in mon.get("/v1/evictions") if decision is None or d["decision"] == decision]


def test_healthy_run_has_no_findings(env):
    mon = env["monitor"]
    wait_until(lambda: len([g for g in mon.get("/v1/cluster")["groups"]
                            if g["status"] == "up"]) == 3, 30, what="3 groups registered")
    wait_until(lambda: step_of(env, 0) >= SLOW_FROM - 8, 120, what="healthy steps")
    c = mon.get("/v1/cluster")
    assert c["quorum_participants"] == 3
    assert all(g["in_quorum"] for g in c["groups"])
    assert mon.get("/v1/findings") == []
    assert evictions(mon) == []
    env["baseline_step_s"] = median_recent(env, 0, last=16)


def test_straggler_detected_and_evicted(env):
    mon = env["monitor"]
    slow_rid = group_states(env, 2)[0]["replica_id"]
    wait_until(lambda: evictions(mon, "evict"), 60, what="the straggler's eviction")
    [f] = [f for f in mon.get("/v1/findings") if f["kind"] == "straggler"]
    assert f["replica_group"] == 2 and f["replica_id"] == slow_rid and f["ranks"] == [2]
    # confirmed within 10 steps of the onset (the step of the slow rank when confirmed)
    confirm_step = f["evidence"]["phases"]["2"]["step"]
    assert confirm_step - SLOW_FROM <= 10, f["evidence"]
    assert f["evidence"]["median_lag_s"] > 0.4
    [d] = evictions(mon, "evict")
    assert (d["replica_group"], d["replica_id"], d["reason"]) == (2, slow_rid, "straggler")
    wait_until(lambda: evictions(mon, "evict")[0]["status"] == "confirmed", 30,
               what="the eviction confirmed")
    assert not env["cluster"].groups[2].alive() or wait_until(
        lambda: not env["cluster"].groups[2].alive(), 20, what="group 2 exits")
    # survivors back to their healthy pace
    base = env["baseline_step_s"]
    s0 = step_of(env, 0)
    wait_until(lambda: step_of(env, 0) >= s0 + 8 and median_recent(env, 0) < 1.5 * base, 60,
               what=f"survivors' step time back near {base:.3f}s")


def test_monitor_restart_keeps_audit_and_judges_new_incarnation_afresh(env):
    before = evictions(env["monitor"])
    env["monitor"].stop()
    env["hang_at"] = restart_group(env, 2, 100, "hang")
    env["monitor"] = mon = MonitorProc(env)
    after = evictions(mon)
    assert after == before  # audit log intact across the restart
    new_rid = group_states(env, 2)[0]["replica_id"]
    assert new_rid != before[0]["replica_id"]
    wait_until(lambda: any(g["replica_group"] == 2 and g["replica_id"] == new_rid
                           and g["status"] == "up" for g in mon.get("/v1/cluster")["groups"]),
               30, what="the monitor to see the new group 2")
    # running healthy on: the new incarnation is not evicted on the old straggler evidence
    wait_until(lambda: step_of(env, 0) >= env["hang_at"] - 3, 120, what="steps before the hang")
    assert len(evictions(mon, "evict")) == 1
    assert not [f for f in mon.get("/v1/findings?open=1") if f["kind"] != "dead"]


def test_hang_detected_and_evicted_survivors_recover(env):
    mon = env["monitor"]
    hung_rid = group_states(env, 2)[0]["replica_id"]
    wait_until(lambda: len(evictions(mon, "evict")) == 2, 60, what="the hang's eviction")
    [f] = [f for f in mon.get("/v1/findings") if f["kind"] == "hang"]
    assert (f["replica_group"], f["replica_id"], f["ranks"]) == (2, hung_rid, [2])
    assert f["evidence"]["never_arrived"] == [2]
    # onset: the survivors' last committed step before the stall
    onset = f["first_seen"]
    detect = f["confirmed_at"] - onset
    med = f["evidence"]["median_step_s"] or 0.0
    assert detect <= max(5.0, 5 * med) + 1.0, f["evidence"]
    d = evictions(mon, "evict")[0]
    assert (d["replica_group"], d["replica_id"], d["reason"]) == (2, hung_rid, "hang")
    stalled_at = step_of(env, 0)

    def survivors_committed():
        states = group_states(env, 0) + group_states(env, 1)
        return len(states) == 2 and all(s["step"] > stalled_at for s in states) and \
            min(s["last_step_at"] for s in states)

    first_commit = wait_until(survivors_committed, 30, what="survivors to commit again")
    recovery = first_commit - onset
    assert recovery < 20.0, f"survivors took {recovery:.1f}s (pg timeout 20 s)"
    env["hang_recovery_s"] = recovery


def test_mismatch_reported_and_min_replicas_holds(env):
    env["monitor"].stop()
    at = restart_group(env, 2, 100, "mismatch")
    env["monitor"] = mon = MonitorProc(env, "--min-replicas", "3")
    n_evict = len(evictions(mon, "evict"))
    wait_until(lambda: step_of(env, 0) >= at - 5, 120, what="steps before the mismatch")
    wait_until(lambda: [f for f in mon.get("/v1/findings") if f["kind"] == "mismatch"], 60,
               what="the mismatch finding")
    [f] = [f for f in mon.get("/v1/findings") if f["kind"] == "mismatch"]
    assert f["replica_group"] == 2 and f["ranks"] == [2], f
    wait_until(lambda: any(d["decision"] == "hold" and d["reason"] == "min_replicas"
                           and d["replica_group"] == 2 for d in evictions(mon)), 20,
               what="the eviction held back by --min-replicas")
    assert len(evictions(mon, "evict")) == n_evict
