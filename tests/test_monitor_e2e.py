"""The monitor against a real torchft job: Lighthouse + 3 replica groups as processes, on CPU.

One cluster serves the whole module, one fault after another (tests run in file order):

0. the trainer itself: the 3 groups train in one quorum with matching Flight Recorder
   collectives, ``lightkeeper analyze`` finds nothing in their healthy dumps, ``/metrics``
   passes promtool;
1. healthy run: no findings, no evictions; the goodput ledger's badput is startup only and its
   goodput after startup is high;
2. group 2 turns slow (``slow:delay=0.6,from_step=S``, given at start): straggler confirmed
   within 10 steps, evicted through the Lighthouse, survivors' step time back to normal and
   committing in a quorum without it;
3. the goodput ledger ties it together: the straggler's badput to its finding, back to the rank's
   own strike time; the eviction's ``capacity_lost`` and ``recovery`` intervals to the eviction's
   decision id; the job back at pace; group 2, not restarted yet, keeps losing capacity on the
   same incident;
4. the monitor is restarted (same ``--state``): the audit log is intact, the restarted group 2
   (new replica id, healed from a peer to the quorum's step) is not evicted on old evidence;
5. the new group 2 hangs (posted live): detected and evicted, survivors commit again well before
   the 20 s process-group timeout; the incident bundle kept before the kill is listed,
   downloadable, and ``lightkeeper analyze`` on it names the rank the monitor evicted;
6. group 2 restarted once more, a mismatched all_reduce posted live, monitor restarted with
   ``--min-replicas 3``: the mismatch is reported for group 2 and the eviction held back; its
   evidence is kept all the same (a bundle on confirmation).

Monitors run as ``lightkeeper monitor`` processes; ranks find them through self-registration.
Faults after the first are posted to the restarted group's rank through its token-guarded
``POST /v1/faults`` a few steps ahead, once it has caught up (as the demo does), so no test waits
for a step chosen before the group started.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tarfile

import pytest
import requests

from lightkeeper.cluster import LocalCluster
from lightkeeper.processes import free_port, stop_process, wait_until
from tests.conftest import require_binary
from tests.support.workers import analyze_cli, get_json, save_dumps, torchft_entries, try_state

# solo: the goodput ledger judges the job's pace: another job's load is unattributed badput
pytestmark = [pytest.mark.e2e, pytest.mark.solo]

SLOW_FROM = 100  # room for the ledger's baseline before the fault, on a busy box too
STEP_PAUSE = 0.1
FAULT_TOKEN = "monitor-e2e-faults"


class MonitorProc:
    def __init__(self, env, *extra: str) -> None:
        self.url = env["monitor_url"]
        log = open(env["dir"] / f"monitor{env['monitors']}.log", "wb")
        env["monitors"] += 1
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", str(env["port"]),
             "--lighthouse", env["cluster"].lighthouse_url, "--state", str(env["state"]),
             "--interval", "0.5", "--cooldown", "5", "--min-replicas", "2",
             "--expected-groups", "3", *extra],
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
    # heartbeat 1000 ms (docs/lighthouse.md): each eviction stalls the survivors' next quorum
    # until the evicted group's heartbeat expires, waited out twice here
    cluster = LocalCluster(d / "cluster", num_groups=3, steps=100_000, step_pause_s=STEP_PAUSE,
                           pg_timeout_s=20, join_timeout_ms=5000, heartbeat_timeout_ms=1000,
                           extra_env={"LIGHTKEEPER_MONITOR": url,
                                      "LIGHTKEEPER_FAULT_TOKEN": FAULT_TOKEN})
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
        try:
            cluster.stop()  # before the monitor: a SIGTERMed rank waits for its next read
        finally:
            if e["monitor"] is not None:
                e["monitor"].stop()


def group_states(env, g: int) -> list[dict]:
    grp = env["cluster"].groups[g]
    return [s for s in (try_state(u) for u in grp.worker_urls.values()) if s]


def replica_id_of(env, g: int) -> str:
    """Group ``g``'s replica id as its rank 0 reports it, once it reports one (between a
    restart and its first quorum a rank answers with none)."""
    def rid():
        states = group_states(env, g)
        return states[0]["replica_id"] if states else None
    return wait_until(rid, 30, what=f"group {g}'s replica id")


def step_of(env, g: int) -> int:
    states = group_states(env, g)
    return max(s["step"] for s in states) if states else -1


def median_recent(env, g: int, last: int = 5) -> float | None:
    vals = [v for s in group_states(env, g) for v in s["recent_step_seconds"][-last:]]
    return statistics.median(vals) if vals else None


def restart_group(env, g: int) -> None:
    """Restart group g once it has exited; wait until it caught up with group 0."""
    cluster = env["cluster"]
    wait_until(lambda: not cluster.groups[g].alive(), 30, what=f"group {g} to exit")
    cluster.start_group(g)
    cluster.wait_for_workers(g, timeout=90)
    wait_until(lambda: step_of(env, g) >= step_of(env, 0) - 2 and step_of(env, g) > 0, 90,
               what=f"restarted group {g} to catch up")


def post_fault(env, g: int, kind: str, ahead: int = 4) -> int:
    """Arm ``kind:at_step=S`` on group g's rank, S ``ahead`` steps past the job's step."""
    at = max(step_of(env, h) for h in range(3)) + ahead
    for url in env["cluster"].groups[g].worker_urls.values():
        r = requests.post(url + "/v1/faults", json={"spec": f"{kind}:at_step={at}"}, timeout=5,
                          headers={"Authorization": f"Bearer {FAULT_TOKEN}"})
        assert r.status_code == 200, r.text
    return at


def evictions(mon, decision=None):
    return [d for d in mon.get("/v1/evictions") if decision is None or d["decision"] == decision]


def test_groups_train_in_one_quorum_with_matching_collectives(env, tmp_path):
    """The trainer with real parts, before any fault strikes (group 2 turns slow at step
    SLOW_FROM): one quorum, the same collectives on every group, healthy dumps and metrics."""
    urls = [env["cluster"].groups[g].worker_urls[0] for g in range(3)]

    def states():
        out = [try_state(u) for u in urls]
        return out if all(out) else None

    first = wait_until(lambda: (s := states()) and all(
        x["step"] >= 10 and x["num_participants"] == 3 for x in s) and s, 120,
        what="3 groups at step 10 with 3 participants")
    later = wait_until(lambda: (s := states()) and min(x["step"] for x in s) > max(
        x["step"] for x in first) and s, 30, what="steps to keep advancing")
    # A group that joined late healed to the quorum's step, so count commits, not steps.
    assert all(x["commits"] > y["commits"] for x, y in zip(later, first, strict=True))
    assert len({x["quorum_id"] for x in later}) == 1
    assert all(x["replica_id"].startswith(f"replica_group_{g}:") for g, x in enumerate(later))

    def current_collectives():
        """Every group's dump, once the current quorum has 10+ all_reduces on each."""
        dumps = [get_json(u + "/v1/fr_trace", 5) for u in urls]
        quorum = dumps[0]["incarnations"][-1]["quorum_id"]
        incs = [next((i for i in d["incarnations"] if i["quorum_id"] == quorum), None)
                for d in dumps]
        if None in incs:
            return None
        seqs = [{e["collective_seq_id"]: e for e in torchft_entries(d, inc)}
                for d, inc in zip(dumps, incs, strict=True)]
        common = set.intersection(*(set(x) for x in seqs))
        return (incs, seqs, common) if len(common) >= 10 else None

    # A group that joined late makes a new quorum (sequence ids restart): wait for 10 steps in it.
    incs, seqs, common = wait_until(current_collectives, 60, interval=0.5,
                                    what="10 collectives of the current quorum on every group")
    assert sorted(i["replica_rank"] for i in incs) == [0, 1, 2]
    assert all(i["global_ranks"] == [0, 1, 2] for i in incs)
    for by_seq in seqs:
        assert all(e["profiling_name"] == "gloo:all_reduce" for e in by_seq.values())
    assert all(s[k]["input_sizes"] == seqs[0][k]["input_sizes"] for s in seqs for k in common)

    # The healthy dumps, analysed as a user would: nothing to report.
    assert max(try_state(u)["step"] for u in urls) < SLOW_FROM - 5, "the fault strikes too soon"
    status, report = analyze_cli(*save_dumps(urls, tmp_path))
    assert status == 0, report
    assert report["ranks"] == [0, 1, 2] and report["findings"] == [] and report["errors"] == []

    promtool = require_binary("promtool")
    text = requests.get(urls[0] + "/metrics", timeout=2).text
    assert 'lightkeeper_step{group_rank="0",job="lightkeeper",rank="0",replica_group="0"}' in text
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr


def test_healthy_run_has_no_findings(env):
    mon = env["monitor"]
    wait_until(lambda: len([g for g in mon.get("/v1/cluster")["groups"]
                            if g["status"] == "up"]) == 3, 30, what="3 groups registered")
    wait_until(lambda: step_of(env, 0) >= SLOW_FROM - 30, 120, what="healthy steps")
    # the ledger's baseline (its startup ends with it) forms from the monitor's sweeps: a
    # busy box may need more of the healthy run for it, never past the fault's onset
    wait_until(lambda: step_of(env, 0) >= SLOW_FROM - 8
               or mon.get("/v1/goodput")["baseline"]["step_seconds"] is not None, 60,
               what="the ledger's baseline")
    wait_until(lambda: step_of(env, 0) >= SLOW_FROM - 8, 120, what="healthy steps")
    c = mon.get("/v1/cluster")
    assert c["quorum_participants"] == 3
    assert all(g["in_quorum"] for g in c["groups"])
    assert mon.get("/v1/findings") == []
    assert evictions(mon) == []
    env["baseline_step_s"] = median_recent(env, 0, last=16)
    # the goodput ledger of the healthy run
    g = mon.get("/v1/goodput")
    (env["dir"] / "goodput_healthy.json").write_text(json.dumps(g, indent=1))
    j = g["job"]
    assert g["expected_groups"] == 3 and g["incidents"] == [], g
    assert g["baseline"]["step_seconds"] is not None
    bad = j["badput_seconds"]
    assert bad["startup"] > 0
    assert bad["stall"] == bad["recovery"] == bad["capacity_lost"] == 0, j
    assert bad["straggler_drag"] == 0, j
    # Other work on a shared machine slows the job below 90% of its measured pace now and
    # then; the ledger rightly calls that unexplained (pending, then unattributed), never a
    # fault's. A quiet machine shows ~0.
    after_startup = j["expected_seconds"] - bad["startup"]
    assert after_startup > 0
    noise = bad["unattributed"] + j["pending_seconds"]
    load = os.getloadavg()[0]
    assert noise <= 0.3 * after_startup, (load, g)
    assert j["goodput_seconds"] / after_startup >= 0.7, (load, g)


def test_straggler_detected_and_evicted(env):
    mon = env["monitor"]
    slow_rid = replica_id_of(env, 2)
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
    # survivors back to their healthy pace, committing in a quorum without group 2
    base = env["baseline_step_s"]
    s0 = step_of(env, 0)
    wait_until(lambda: step_of(env, 0) >= s0 + 8 and median_recent(env, 0) < 1.5 * base
               and all(s["num_participants"] == 2 for g in (0, 1) for s in group_states(env, g)),
               60, what=f"survivors' step time back near {base:.3f}s, 2 in the quorum")


def test_straggler_and_eviction_are_tied_to_their_finding_and_decision(env):
    mon = env["monitor"]
    [ev] = evictions(mon, "evict")
    [finding] = [f for f in mon.get("/v1/findings") if f["kind"] == "straggler"]

    def back_at_pace():
        incs = mon.get("/v1/goodput")["incidents"]
        return incs if incs and incs[0]["back_to_pace_at"] is not None else None

    [inc] = wait_until(back_at_pace, 60, what="the job back at pace")
    assert inc["kind"] == "straggler" and inc["replica_group"] == 2
    assert finding["id"] in inc["finding_ids"] and inc["eviction_id"] == ev["id"]
    # onset: the slow rank's own strike time. The detector's first evidence, dated from the
    # ranks' own step durations back to its first late step, is that strike: within a slow
    # step and a sweep (0.5 s), not the several steps later its first late window was judged
    assert inc["onset_source"] == "faults_struck_at"
    step = finding["evidence"]["median_step_s"]
    assert -step <= finding["first_seen"] - inc["onset_at"] <= step + 0.5, (finding, inc)
    assert inc["onset_at"] <= inc["detected_at"] <= inc["evicted_at"] <= inc["back_to_pace_at"]
    assert inc["open"] and inc["rejoined_at"] is None  # group 2 is not restarted yet
    # let the killed group's capacity accrue a little more, then read the whole ledger
    wait_until(lambda: mon.get("/v1/goodput")["incidents"][0]["cost"]["by_cause"].get(
        "capacity_lost", 0) >= 5, 30, what="capacity lost on the incident")
    g = mon.get("/v1/goodput?intervals=500")
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


def test_monitor_restart_keeps_audit_and_judges_new_incarnation_afresh(env):
    before = evictions(env["monitor"])
    env["monitor"].stop()
    restart_group(env, 2)
    # the restarted group continues at the quorum's step: it healed from a peer
    [new] = group_states(env, 2)
    assert new["heals"] >= 1 and new["commits"] < new["step"], new
    env["monitor"] = mon = MonitorProc(env)
    after = evictions(mon)
    assert after == before  # audit log intact across the restart
    new_rid = replica_id_of(env, 2)
    assert new_rid != before[0]["replica_id"]
    wait_until(lambda: any(g["replica_group"] == 2 and g["replica_id"] == new_rid
                           and g["status"] == "up" for g in mon.get("/v1/cluster")["groups"]),
               30, what="the monitor to see the new group 2")
    # running healthy on (12 steps: the straggler rule confirms within 10 of an onset): the new
    # incarnation is not evicted on the old straggler evidence
    healthy_from = step_of(env, 0)
    wait_until(lambda: step_of(env, 0) >= healthy_from + 12, 120, what="12 healthy steps")
    assert len(evictions(mon, "evict")) == 1
    assert not [f for f in mon.get("/v1/findings?open=1") if f["kind"] != "dead"]
    env["hang_at"] = post_fault(env, 2, "hang")


def test_hang_detected_and_evicted_survivors_recover(env):
    mon = env["monitor"]
    hung_rid = replica_id_of(env, 2)
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
    check_hang_bundle(env, mon, d, f)


def check_hang_bundle(env, mon, d, f):
    """The evidence the kill destroyed, kept before it: the hung rank's and the survivors'
    stacks and dumps, listed, downloadable, and ``lightkeeper analyze`` on the bundle names
    the rank the monitor evicted."""
    # the row as the kill left it (while the bundle is fetched it reads "sending")
    [d] = [x for x in evictions(mon, "evict") if x["id"] == d["id"]]
    assert d["status"] in ("sent", "confirmed"), d
    assert d["bundle"] and f"evidence kept in bundle {d['bundle']}" in d["detail"]
    rows = {r["id"]: r for r in mon.get("/v1/incidents")["bundles"]}
    row = rows[d["bundle"]]
    assert (row["trigger"], row["kind"], row["decision_id"], row["finding_id"]) == (
        "evict", "hang", d["id"], f["id"])
    # the straggler's eviction kept one too
    assert any(r["kind"] == "straggler" and r["trigger"] == "evict" for r in rows.values())
    r = requests.get(mon.url + row["download"], timeout=10)
    assert r.status_code == 200
    path = env["dir"] / f"{row['id']}.tar.gz"
    path.write_bytes(r.content)
    status, report = analyze_cli(path)
    [b] = report["bundles"]
    assert b["culprit_ranks"] == f["ranks"] == [2] and b["decision"] == "evict"
    assert b["analysis_agrees"] is True, report
    assert status == 1 and any(x["kind"] == "hang" and x["culprit_ranks"] == [2]
                               for x in report["findings"])
    with tarfile.open(path) as tar:
        m = json.load(tar.extractfile(f"{row['id']}/manifest.json"))
    # written while the decision was still being sent: before the kill
    assert m["written_before_kill"] and m["decision"]["status"] == "sending"
    assert m["fetch"]["seconds"] <= m["fetch"]["timeout_s"] + 0.5
    assert {x["rank"]: x["fr_trace"] for x in m["ranks"]} == {0: "ok", 1: "ok", 2: "ok"}
    assert all(x["stacks"] == "ok" for x in m["ranks"]), m["ranks"]


def test_mismatch_reported_and_min_replicas_holds(env):
    env["monitor"].stop()
    restart_group(env, 2)
    env["monitor"] = mon = MonitorProc(env, "--min-replicas", "3")
    n_evict = len(evictions(mon, "evict"))
    # the new monitor knows the new group 2 (it registers every 5 s) before the fault strikes
    wait_until(lambda: sum(g["status"] == "up" and g["in_quorum"]
                           for g in mon.get("/v1/cluster")["groups"]) == 3, 60,
               what="the monitor to see 3 groups in the quorum")
    post_fault(env, 2, "mismatch")
    wait_until(lambda: [f for f in mon.get("/v1/findings") if f["kind"] == "mismatch"], 60,
               what="the mismatch finding")
    [f] = [f for f in mon.get("/v1/findings") if f["kind"] == "mismatch"]
    assert f["replica_group"] == 2 and f["ranks"] == [2], f
    wait_until(lambda: any(d["decision"] == "hold" and d["reason"] == "min_replicas"
                           and d["replica_group"] == 2 for d in evictions(mon)), 20,
               what="the eviction held back by --min-replicas")
    assert len(evictions(mon, "evict")) == n_evict
    # held, yet its evidence is kept: a bundle on confirmation (written on a helper thread)
    wait_until(lambda: [b for b in mon.get("/v1/incidents")["bundles"] if b["trigger"] ==
                        "confirm" and b["kind"] == "mismatch" and b["finding_id"] == f["id"]],
               20, what="the mismatch's bundle")
