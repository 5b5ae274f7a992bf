"""The goodput ledger on a real torchft job: a Lighthouse, 3 replica groups of 1 rank (real
processes, gloo on CPU) and ``lightkeeper monitor`` as a process, found by self-registration.

One cluster, two tests in order (kept small: the machine has 2 cores shared with other work):

1. healthy: the ledger's badput is startup only and its goodput after startup is high;
2. group 2 turns slow (``slow:delay=0.6,from_step=S``): the straggler's badput is tied to its
   finding, back to the rank's own strike time; the eviction's ``capacity_lost`` and
   ``recovery`` intervals are tied to the eviction's decision id; the job is back at pace and
   group 2, never restarted, keeps losing capacity on the same incident.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import requests

from lightkeeper.cluster import LocalCluster, stop_process, wait_until
from tests.support.workers import try_state

pytestmark = pytest.mark.e2e

SLOW_FROM = 70
STEP_PAUSE = 0.1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("goodput_e2e")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cluster = LocalCluster(d / "cluster", num_groups=3, steps=100_000, step_pause_s=STEP_PAUSE,
                           pg_timeout_s=20, join_timeout_ms=5000, heartbeat_timeout_ms=5000,
                           extra_env={"LIGHTKEEPER_MONITOR": url})
    monitor = None
    try:
        cluster.start_lighthouse()
        log = open(d / "monitor.log", "wb")
        monitor = subprocess.Popen(
            [sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", str(port),
             "--lighthouse", cluster.lighthouse_url, "--state", str(d / "monitor.sqlite"),
             "--interval", "0.5", "--cooldown", "5", "--min-replicas", "2",
             "--expected-groups", "3"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

        def up():
            if monitor.poll() is not None:
                raise RuntimeError(f"monitor exited with {monitor.returncode}")
            try:
                return requests.get(url + "/healthz", timeout=1).ok
            except requests.RequestException:
                return False

        wait_until(up, 30, what="the monitor to serve")
        for g in range(3):
            cluster.start_group(g, [f"slow:delay=0.6,from_step={SLOW_FROM}"] if g == 2 else None)
        for g in range(3):
            cluster.wait_for_workers(g, timeout=90)
        yield {"cluster": cluster, "url": url, "dir": d}
    finally:
        if monitor is not None:
            stop_process(monitor, grace=10)
        cluster.stop()


def get(env, path):
    r = requests.get(env["url"] + path, timeout=10)
    r.raise_for_status()
    return r.json()


def step_of(env, g: int) -> int:
    states = [s for s in (try_state(u) for u in env["cluster"].groups[g].worker_urls.values())
              if s]
    return max(s["step"] for s in states) if states else -1


def test_healthy_run_is_goodput_and_startup_only(env):
    wait_until(lambda: step_of(env, 0) >= SLOW_FROM - 8, 180, what="healthy steps")
    g = get(env, "/v1/goodput")
    (env["dir"] / "goodput_healthy.json").write_text(json.dumps(g, indent=1))
    j = g["job"]
    assert g["expected_groups"] == 3 and g["incidents"] == [], g
    assert g["baseline"]["step_seconds"] is not None
    bad = j["badput_seconds"]
    assert bad["startup"] > 0
    assert bad["stall"] == bad["recovery"] == bad["capacity_lost"] == 0, j
    assert bad["straggler_drag"] == 0, j
    # On this shared 2-core machine other work slows the job below 90% of its measured pace
    # now and then; the ledger rightly calls that unexplained (pending, then unattributed),
    # never a fault's. Measured: 1.3 of 33 replica-s after startup at load average 6,
    # 7.7 of 36 at load average 9. A quiet machine shows ~0.
    after_startup = j["expected_seconds"] - bad["startup"]
    assert after_startup > 0
    noise = bad["unattributed"] + j["pending_seconds"]
    load = os.getloadavg()[0]
    assert noise <= 0.3 * after_startup, (load, g)
    assert j["goodput_seconds"] / after_startup >= 0.7, (load, g)


def test_straggler_and_eviction_are_tied_to_their_finding_and_decision(env):
    wait_until(lambda: [d for d in get(env, "/v1/evictions") if d["decision"] == "evict"],
               90, what="the straggler's eviction")
    [ev] = [d for d in get(env, "/v1/evictions") if d["decision"] == "evict"]
    [finding] = [f for f in get(env, "/v1/findings") if f["kind"] == "straggler"]
    assert ev["replica_group"] == 2

    def back_at_pace():
        incs = get(env, "/v1/goodput")["incidents"]
        return incs if incs and incs[0]["back_to_pace_at"] is not None else None

    [inc] = wait_until(back_at_pace, 60, what="the job back at pace")
    assert inc["kind"] == "straggler" and inc["replica_group"] == 2
    assert finding["id"] in inc["finding_ids"] and inc["eviction_id"] == ev["id"]
    # onset: the slow rank's own strike time, before the detector's first evidence
    assert inc["onset_source"] == "faults_struck_at"
    assert inc["onset_at"] <= finding["first_seen"]
    assert inc["onset_at"] <= inc["detected_at"] <= inc["evicted_at"] <= inc["back_to_pace_at"]
    assert inc["open"] and inc["rejoined_at"] is None  # group 2 is never restarted here
    # let the killed group's capacity accrue a little more, then read the whole ledger
    wait_until(lambda: get(env, "/v1/goodput")["incidents"][0]["cost"]["by_cause"].get(
        "capacity_lost", 0) >= 5, 30, what="capacity lost on the incident")
    g = get(env, "/v1/goodput?intervals=500")
    (env["dir"] / "goodput_evicted.json").write_text(json.dumps(g, indent=1))
    [inc] = g["incidents"]
    by = inc["cost"]["by_cause"]
    assert by.get("straggler_drag", 0) > 0 and by.get("capacity_lost", 0) >= 5, inc
    assert inc["cost"]["gpu_seconds"] == pytest.approx(inc["cost"]["replica_seconds"], rel=1e-3)
    ivs = g["intervals"]
    drag = [iv for iv in ivs if iv["cause"] == "straggler_drag"]
    assert drag and all(iv["incident"] == inc["id"] and iv["finding_id"] in inc["finding_ids"]
                        for iv in drag)
    after = [iv for iv in ivs if iv["cause"] in ("capacity_lost", "recovery")
             and iv["start"] >= inc["evicted_at"] - 1]
    assert {iv["cause"] for iv in after} >= {"capacity_lost"}
    assert all(iv["eviction_id"] == ev["id"] and iv["incident"] == inc["id"] for iv in after)
    assert {iv["replica_group"] for iv in after if iv["cause"] == "capacity_lost"} == {2}
    # the invariant on the live monitor
    j = g["job"]
    assert j["goodput_seconds"] + sum(j["badput_seconds"].values()) + j["pending_seconds"] \
        == pytest.approx(j["expected_seconds"], abs=0.05)
    assert j["expected_seconds"] == pytest.approx(3 * g["wall_seconds"], rel=0.01)
