"""``lightkeeper demo`` end to end: real Lighthouse, trainers, monitor (and Prometheus if there).

Stage timings are shortened through the demo's hidden flags so the default scenario (3 groups x
2 ranks, faults on single ranks) runs in about a minute and a half (a healthy run's report:
tests/test_demo_keep_running.py). It runs with ``--keep-running``: once its story is over, the
whole job (torchrun, the monitor, the Lighthouse, Prometheus) must stay up and keep working until
SIGTERM (every rank listed where its host is, seeing no GPU), and FT-HSDP's Flight Recorder
evidence is read from its ranks then. A fault given at
start on one rank (``--inject 1.0:...``, groups of one rank) must be reported when it struck, on
that rank and host, caught there and nowhere else, and the run must end once its story is over.

``--dry-run`` has no demo of its own: its wiring (monitor and host ledger dry, no eviction, no
restart) is asserted on tests/test_demo_keep_running.py's ``--steps`` run; a real monitor holding
a finding under --dry-run in tests/test_monitor_api.py (and tests/test_monitor_rails.py for
every kind); the story that ends at such a hold in tests/test_demo_faulttrack.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import requests

from lightkeeper.demo import LEDGER_WAIT_S
from tests.support.demo import RunningDemo, check_ft_hsdp, get_json, gone

# solo: the demos' stories are timed against a healthy baseline
pytestmark = [pytest.mark.e2e, pytest.mark.solo]

FAULT_KEYS = {"replica_group", "group_rank", "rank", "host", "spec", "given", "injected_at_s",
              "struck_at_s", "detected_at_s", "detected_kind", "finding_ranks", "culprit_ranks",
              "culprit_hosts", "evicted_at_s", "restarted_at_s", "survivors_committing_at_s",
              "rejoined_at_s", "steps_lost", "outcome", "note", "stages", "cost", "recovery_s",
              "recovery_s_ranks", "torchft_alone", "torchft_alone_at_defaults"}
STAGE_KEYS = {"onset", "detected", "kill_sent", "lighthouse_dropped", "survivors_quorum",
              "survivors_committing", "back_at_pace", "back_at_pace_ledger", "restarted",
              "joined", "healed", "join_dip", "steps_to_detect", "evicted_replica_id"}
TIME_KEYS = {"injected_at_s", "struck_at_s", "detected_at_s", "evicted_at_s", "restarted_at_s",
             "survivors_committing_at_s", "rejoined_at_s"}
DETECTION_KEYS = {"kind", "replica_group", "ranks", "culprit_ranks", "culprit_hosts", "at_s",
                  "evicted", "fault"}
PHASE_KEYS = {"name", "start_s", "end_s", "steps", "step_rate", "vs_healthy"}


def run_demo(report_dir: Path, *args: str, timeout: float = 400, cwd: Path | None = None,
             env: dict[str, str] | None = None) -> tuple[dict, str]:
    """``lightkeeper demo``; with ``cwd``, the console script run from there; ``env`` added to
    the environment."""
    cmd = [str(Path(sys.executable).with_name("lightkeeper"))] if cwd else \
        [sys.executable, "-m", "lightkeeper.cli"]
    proc = subprocess.run([*cmd, "demo", "--report-dir", str(report_dir), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    report = json.loads((report_dir / "report.json").read_text())
    check_shape(report)
    assert (report_dir / "report.md").exists() and (report_dir / "timeline.png").exists()
    for pid in report["pids"]:  # no process left behind
        assert not os.path.exists(f"/proc/{pid}") or gone(pid), f"PID {pid} still running"
    return report, out


def check_shape(r: dict) -> None:
    for f in r["faults"]:
        assert FAULT_KEYS <= f.keys(), f
        assert STAGE_KEYS <= f["stages"].keys(), f["stages"]
        for k in TIME_KEYS:
            assert f[k] is None or isinstance(f[k], (int, float)), (k, f)
    for k in ("pg_timeout_s", "quorum_timeout_s", "join_timeout_ms", "heartbeat_timeout_ms",
              "hang_floor_s", "warm_spares"):
        assert k in r["config"], r["config"]
    for d in r["detections"]:
        assert DETECTION_KEYS <= d.keys(), d
        assert isinstance(d["evicted"], bool) and isinstance(d["at_s"], (int, float))
    for p in r["phases"]:
        assert PHASE_KEYS <= p.keys(), p
    assert r["healthy_step_rate"] is None or r["healthy_step_rate"] > 0
    assert isinstance(r["pids"], list) and r["pids"]


def check_rank_addresses(r: dict, ranks: list[str]) -> None:
    """Every rank the demo lists for ``curl``, on its host's address, seeing no GPU."""
    assert len(set(ranks)) == r["config"]["groups"] * r["config"]["ranks_per_group"], ranks
    if netns(r):  # namespaced hosts (root, as in CI): reached through 127.0.0.1 forwards
        assert all(u.startswith("http://127.0.0.1:") for u in ranks), ranks
    else:  # each group's ranks on its host's own loopback address (docs/demo.md)
        addrs = {u.rsplit(":", 1)[0].removeprefix("http://") for u in ranks}
        assert len(addrs) == r["config"]["groups"], ranks
        assert addrs <= {h["addr"] for h in r["hosts"]["hosts"]}, (ranks, r["hosts"])
    for url in ranks:  # the ranks see no GPU, whatever this machine has (docs/demo.md)
        pid = get_json(url + "/v1/state")["pid"]
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"CUDA_VISIBLE_DEVICES=" in environ, (url, pid)


def check_printed_urls(r: dict) -> None:
    """The Lighthouse's and the WorkerServers' URLs the demo printed as it started them, and the
    report's, are ones a user on this machine reaches: on namespaced hosts, 127.0.0.1 forwards."""
    printed = [u for e in r["events"] if e["kind"] in ("lighthouse", "started")
               for u in re.findall(r"http://[^\s,]+", e["detail"])]
    assert len(printed) == 1 + r["config"]["groups"] * r["config"]["ranks_per_group"], printed
    if netns(r):
        assert all(u.startswith("http://127.0.0.1:") for u in printed), printed
        # beside each forward, the address the monitor's audit log and bundles name the rank by
        inside = [a for e in r["events"] if e["kind"] == "started"
                  for a in re.findall(r"\((\S+) in the job's network\)", e["detail"])]
        assert len(inside) == len(printed) - 1, (inside, printed)
        assert {a.rsplit(":", 1)[0] for a in inside} <= {h["addr"] for h in r["hosts"]["hosts"]}
    assert printed[0] == r["urls"]["lighthouse"], (printed, r["urls"])
    assert requests.get(r["urls"]["lighthouse"] + "/status", timeout=5).ok


def test_default_scenario(tmp_path):
    demo = RunningDemo.start(tmp_path, "--healthy-s", "6", "--end-s", "3")
    try:
        r = demo.announced(400)  # the report at the story's end, before the cluster kept running
        check_shape(r)
        check_straggler_finding(r)
        check_rank_addresses(r, demo.check_keeps_working(r))
        check_printed_urls(r)
        check_ft_hsdp(demo.text())
    except BaseException:
        demo.kill()
        raise
    check_shape(demo.stop(r))
    out, report_dir = demo.text(), demo.report_dir
    assert (report_dir / "report.md").exists() and (report_dir / "timeline.png").exists()
    assert r["config"]["ranks_per_group"] == 2
    slow, hang, *net = r["faults"]
    assert slow["spec"].startswith("slow_compute:") and slow["spec"].endswith(",rank=1")
    assert hang["spec"].startswith("hang:") and hang["spec"].endswith(",where=group,rank=1")
    assert (slow["replica_group"], slow["group_rank"], slow["rank"]) == (1, 1, 3)
    assert (hang["replica_group"], hang["group_rank"], hang["rank"]) == (2, 1, 5)
    for f, kind, host in ((slow, "straggler", "node-1"), (hang, "hang", "node-2")):
        assert f["given"] == "live" and f["host"] == host, f  # each group on its own host
        assert f["culprit_hosts"] == [host], f
        assert f["detected_kind"] == kind, f
        assert f["culprit_ranks"] == [f["rank"]], f  # the rank, not its group or its rank 0
        # injected, then struck (the rank's own report), then caught
        assert f["injected_at_s"] <= f["struck_at_s"] < f["detected_at_s"], f
        assert f["detected_at_s"] <= f["evicted_at_s"] + 1.0, f
        assert f["evicted_at_s"] <= f["survivors_committing_at_s"] < f["rejoined_at_s"], f
        assert f["outcome"] == "recovered"
        det = [d for d in r["detections"] if d["kind"] == kind and d["replica_group"] ==
               f["replica_group"] and d["evicted"]]
        assert det, r["detections"]
    if netns(r):  # namespaced hosts: then group 0's host is partitioned from its peers
        (part,) = net
        assert part["spec"].startswith("partition:at_step=") and part["given"] == "live"
        assert (part["replica_group"], part["host"], part["culprit_hosts"]) == \
            (0, "node-0", ["node-0"]), part
        assert part["detected_kind"] == "network" and part["culprit_ranks"] == [0, 1], part
        assert part["injected_at_s"] <= part["struck_at_s"] < part["detected_at_s"], part
        assert part["evicted_at_s"] <= part["survivors_committing_at_s"], part
        assert part["outcome"] == "recovered", part
        check_survivors_released(r)
    else:  # the group that never had a fault was never flagged
        assert net == [] and not [d for d in r["detections"] if d["replica_group"] == 0], \
            r["detections"]
    evicted = {1, 2} | ({0} if net else set())
    assert {e["replica_group"] for e in r["evictions"] if e["decision"] == "evict"} == evicted
    # each eviction's incident bundle, kept before its kill, in the report folder and linked
    md = (report_dir / "report.md").read_text()
    for e in (e for e in r["evictions"] if e["decision"] == "evict"):
        assert e["bundle_file"] and (report_dir / e["bundle_file"]).is_file(), e
        assert f"[{e['bundle']}]({e['bundle_file']})" in md
    # the hosts as they were: namespaced (with the network fault) or loopback addresses
    assert ("a network namespace of its own" if net else "a loopback address") in md
    # a job-wide stall the partition caused is its, not a false alarm
    assert not [d for d in r["detections"] if d["replica_group"] is None and not d["fault"]], \
        r["detections"]
    assert {x["replica_group"] for x in r["restarts"]} >= evicted
    assert r["phases"][0]["name"] == "healthy" and r["healthy_step_rate"] > 0
    assert "| 1 | `slow_compute:" in out and "group 1 rank 1 (rank 3" in out
    check_recoveries(r, out)
    check_hosts(r, out, report_dir)
    # the run ends once the last story did (plus the healthy end and, at most LEDGER_WAIT_S,
    # the monitor's ledger seeing the job back at pace), not at a fixed time; the last story is
    # the partition's where there is one
    last = r["faults"][-1]
    assert r["duration_s"] <= last["rejoined_at_s"] + 3 + 15 + LEDGER_WAIT_S, \
        (r["duration_s"], last)


def check_straggler_finding(r: dict) -> None:
    """The monitor's own finding and decision behind the straggler's story (its live API, while
    the cluster keeps running): the slow rank named by its group, rank and host within 10 steps
    of the onset, by a lag of at least half the delay; evicted automatically through the
    Lighthouse, which answered, and confirmed; nothing found about the restarted incarnation."""
    slow = r["faults"][0]
    rid = slow["stages"]["evicted_replica_id"]
    spec = dict(kv.split("=") for kv in slow["spec"].split(":", 1)[1].split(","))
    monitor = r["urls"]["monitor"]
    [f] = [f for f in requests.get(monitor + "/v1/findings", timeout=5).json()
           if f["kind"] == "straggler"]
    assert (f["replica_group"], f["replica_id"], f["ranks"]) == (1, rid, [3]), f
    ev = f["evidence"]
    assert ev["culprit_hosts"] == ["node-1"] and ev["culprits"][0]["group_rank"] == 1, ev
    assert ev["median_lag_s"] >= float(spec["delay"]) / 2, ev
    assert ev["phases"]["3"]["step"] - int(spec["from_step"]) <= 10, ev
    [d] = [d for d in requests.get(monitor + "/v1/evictions", timeout=5).json()
           if d["decision"] == "evict" and d["reason"] == "straggler"]
    assert (d["replica_group"], d["replica_id"], d["source"]) == (1, rid, "auto"), d
    assert d["http_status"] is not None and d["status"] == "confirmed", d
    assert {x["replica_id"] for x in r["detections"] if x["replica_group"] == 1} == {rid}


def netns(r: dict) -> bool:
    """The demo's hosts were network namespaces (root with iproute2, as in CI)."""
    return r["hosts"]["hosts"][0]["addr"].startswith("198.18.")


def check_survivors_released(r: dict) -> None:
    """After the partitioned group's kill the Lighthouse dropped it, and the monitor told the
    survivors blocked in the all_reduce with it to abort that collective (audit log)."""
    aborts = [d for d in r["evictions"] if d["decision"] == "abort"]
    assert aborts and all(d["reason"] == "peer_gone" for d in aborts), r["evictions"]
    (part,) = r["faults"][2:]
    assert any(d["replica_id"] == part["stages"]["evicted_replica_id"] and "POST /v1/abort"
               in d["detail"] for d in aborts), aborts
    # named by its group, though a new incarnation of it may run elsewhere by then
    assert {d["replica_group"] for d in aborts if d["replica_id"]
            == part["stages"]["evicted_replica_id"]} == {part["replica_group"]}, aborts


def check_hosts(r: dict, out: str, report_dir: Path) -> None:
    """The hang's host is quarantined and group 2 restarted on the spare (its ranks report the
    spare's node and address); the straggler (2 offences quarantine, one was injected) is only
    evicted: group 1 back on its own host; nothing evicted again as quarantined_host. On
    namespaced hosts the partitioned host is quarantined too, group 0 restarted on the other
    spare."""
    slow, hang, *net = r["faults"]
    hosts = r["hosts"]
    addr = {h["node"]: h["addr"] for h in hosts["hosts"]}
    assert list(addr) == [f"node-{i}" for i in range(5)], hosts
    bad = ["node-0", "node-2"] if net else ["node-2"]
    assert hosts["quarantined"] == bad and hosts["states"]["node-2"] == "quarantined"
    assert hosts["states"].get("node-1") == "suspect", hosts  # one straggler offence of two
    assert hosts["groups"] == {"0": "node-4" if net else "node-0", "1": "node-1",
                               "2": "node-3"}, hosts
    assert hosts["policy"]["cap"] == 2, hosts["policy"]  # --max-quarantined: the spare hosts
    # quarantined in the sweep that confirmed the finding, before the group was restarted
    for f, spare in ((hang, "node-3"), *((x, "node-4") for x in net)):
        assert f["detected_at_s"] - 1.0 <= f["host_quarantined_at_s"] <= f["restarted_at_s"], f
        assert (f["restarted_on"], f["restarted_addr"]) == (spare, addr[spare]), f
    assert slow["host_quarantined_at_s"] is None and slow["restarted_on"] == "node-1", slow
    assert slow["host_state"].startswith("suspect (1 straggler offence"), slow
    # what the restarted incarnations' ranks themselves report
    samples = json.loads((report_dir / "timeline.json").read_text())["samples"]
    moved = [(2, "node-3"), (1, "node-1")] + ([(0, "node-4")] if net else [])
    for g, node, addr_ in ((g, node, addr[node]) for g, node in moved):
        mine = [s for s in samples if s["replica_group"] == g and s["replica_id"]]
        later = [s for s in mine if s["replica_id"] != mine[0]["replica_id"]]
        assert later and all(s["host"] == node and s["worker_url"].startswith(
            f"http://{addr_}:") for s in later), (g, later[-1:])
    assert all(s["host"] == "node-2" for s in samples if s["replica_group"] == 2
               and s["t"] < hang["evicted_at_s"])
    assert not [e for e in r["evictions"] if e["reason"] == "quarantined_host"], r["evictions"]
    assert not [d for d in r["detections"] if d["kind"] == "quarantined_host"]
    assert [p["node"] for p in r["placements"] if p["replica_group"] == 2] == ["node-2", "node-3"]
    # the story, each step with its time (printed and in report.md)
    assert f"node-2 quarantined at {hang['host_quarantined_at_s']:.1f}s -> restarted on node-3 " \
           f"({addr['node-3']}), a spare host at" in out, out[-3000:]
    assert "hang finding naming rank 5 on node-2 at" in out
    assert "node-1 not quarantined: suspect (1 straggler offence)" in out
    assert f"| node-2 | {addr['node-2']} | none | quarantined |" in \
        (report_dir / "report.md").read_text()
    if net:
        assert "network finding naming ranks 0, 1 on node-0 at" in out


def check_recoveries(r: dict, out: str) -> None:
    """Each evicted fault's recovery stage by stage (in order, from the parts' own records),
    its cost as the monitor's ledger measured it, torchft alone's computed beside it."""
    cfg = r["config"]
    assert cfg["warm_spares"] is True
    for f in r["faults"]:
        st = f["stages"]
        assert (st["onset"], st["detected"], st["kill_sent"]) == (
            f["struck_at_s"], f["detected_at_s"], f["evicted_at_s"]), st
        assert st["evicted_replica_id"] and st["evicted_replica_id"].startswith(
            f"replica_group_{f['replica_group']}:"), st
        # the Lighthouse let the killed group go, then issued the survivors a quorum without it
        assert st["kill_sent"] <= st["lighthouse_dropped"], st
        assert st["kill_sent"] <= st["survivors_quorum"], st
        # the survivors' first commit after the kill: usually in that quorum, but a step in
        # flight when the kill was sent may still commit in the old one first
        assert st["kill_sent"] <= st["survivors_committing"], st
        # the restarted group came from its warm spare, joined, then healed
        assert st["restarted"] <= st["joined"] <= st["healed"] + 1.0, st
        assert st["join_dip"] is not None and st["join_dip"]["stall_s"] >= 0, st
        # the monitor's ledger: the same incident, back at pace after the kill, a real cost
        c = f["cost"]
        assert c is not None and c["source"].startswith("measured"), f
        assert c["replica_seconds"] > 0 and c["by_cause"], c
        # (back at pace only once a whole pace window after the kill was: on a busy machine
        # the ledger may not have seen it before the demo's wait for it ran out)
        if st["back_at_pace_ledger"] is not None:
            assert st["back_at_pace_ledger"] >= st["kill_sent"] - 0.1, st
            # from the fault's onset, as the stage table
            assert f["recovery_s"] == pytest.approx(st["back_at_pace_ledger"] - f["struck_at_s"],
                                                    abs=0.02) and f["recovery_s"] > 0
        if f["spec"].startswith("partition:"):
            # one incident per fault: the network's, counted from the job-wide stall it caused
            # (confirmed before the probes could name the host), not from the naming
            stalls = [d["at_s"] for d in r["detections"] if d["kind"] == "job_stall"
                      and d["at_s"] >= f["struck_at_s"]]
            assert stalls and c["onset_s"] <= min(stalls) and c["by_cause"].get("stall"), (
                c, stalls)
        # torchft alone: nobody evicts; a hang stalls for the process-group timeout plus the
        # join timeout, a straggler drags the job to the end (computed from its phase's pace:
        # none when the busy box made that phase no slower than the healthy one)
        alone = f["torchft_alone"]
        if f["detected_kind"] == "hang":
            assert alone["source"].startswith("computed"), alone
            assert alone["stall_s"] == pytest.approx(
                cfg["pg_timeout_s"] + cfg["join_timeout_ms"] / 1000), alone
            assert "dies at +120 s" in f["torchft_alone_at_defaults"]["outcome"]
        elif f["spec"].startswith("partition:"):  # the partitioned group still heartbeats
            assert alone["recovery_s"] is None and "stops for good" in alone["outcome"], alone
        elif alone is not None:
            assert alone["source"].startswith("computed"), alone
            assert alone["recovery_s"] is None and "drags" in alone["outcome"], alone
            assert alone["replica_seconds"] > 0 and alone["job_steps"] > 0, alone
    assert "Recovery, stage by stage" in out and "torchft alone, same settings (computed)" in out
    assert r["goodput"] and 0 < r["goodput"]["goodput_ratio"] <= 1, r["goodput"]


@pytest.fixture(scope="module")
def rank_fault_run(tmp_path_factory):
    """One demo with a fault given at start to one rank: group 1, group rank 0 (global 1)."""
    d = tmp_path_factory.mktemp("rank-fault")
    # Nothing here asserts on the ledger's verdicts (the default scenario's test does) nor on
    # Prometheus: no wait for the ledger after the story, a 1 s healthy end, no Prometheus; two
    # groups (the fault's and one to wrongly blame) of one rank: two ranks start sooner than
    # six (a culprit that is not its group's rank 0: the default scenario)
    # run from a user's project that has packages named as Lightkeeper's, in a shell where
    # another job's name is set: its ranks, spares and monitor still import Lightkeeper's own,
    # and the monitor takes its own ranks
    project = d / "project"
    for name in ("trainer", "monitor", "worker_server", "lightkeeper"):
        (project / name).mkdir(parents=True)
        (project / name / "__init__.py").write_text(f"raise ImportError('the user\'s {name}')\n")
    r, out = run_demo(d, "--inject", "1.0:slow_compute:delay=0.6,from_step=15", "--end-s", "1",
                      "--ledger-wait", "0", "--no-prometheus", "--groups", "2",
                      "--ranks-per-group", "1", cwd=project,
                      env={"LIGHTKEEPER_JOB": "someone-elses-job"})
    return r, out, d


def test_a_fault_given_at_start_is_reported_when_and_where_it_struck(rank_fault_run):
    r, out, report_dir = rank_fault_run
    [f] = r["faults"]
    assert f["spec"] == "slow_compute:delay=0.6,from_step=15,rank=0" and f["given"] == "start"
    assert (f["replica_group"], f["group_rank"], f["rank"], f["host"]) == (1, 0, 1, "node-1")
    # given when the group started, struck once its training reached step 15: the rank's own
    # time, between its steps before and after 15. Not after the whole job trained, nor after
    # the demo's first sample of it: one-rank groups start apart, and group 1 may reach step 15
    # before the other's first commit
    group1 = [s for s in json.loads((report_dir / "timeline.json").read_text())["samples"]
              if s["replica_group"] == 1 and s["replica_id"]]
    life = [s for s in group1 if s["replica_id"] == group1[0]["replica_id"]
            and s["last_step_at_s"] is not None]
    assert f["injected_at_s"] < r["training_started_at_s"], f
    assert all(s["last_step_at_s"] <= f["struck_at_s"] for s in life if s["step"] < 15), f
    after = [s["last_step_at_s"] for s in life if s["step"] > 15]
    assert after and min(after) > f["struck_at_s"] > f["injected_at_s"], (after[:1], f)
    assert f["struck_at_s"] < f["detected_at_s"] <= f["evicted_at_s"] + 1.0, f
    assert f["detected_kind"] == "straggler" and f["outcome"] == "recovered", f
    assert f["finding_ranks"] == [1], f
    # caught in group 1 and nowhere else
    assert r["detections"] and {d["replica_group"] for d in r["detections"]} == {1}, \
        r["detections"]
    assert all(d["fault"] == 1 for d in r["detections"]), r["detections"]
    assert [e["replica_group"] for e in r["evictions"] if e["decision"] == "evict"] == [1]
    # not given again: the restarted group's ranks carry no fault
    first_life = group1[0]["replica_id"]
    assert any(s["faults"] == [f["spec"]] for s in group1 if s["replica_id"] == first_life)
    later = [s for s in group1 if s["replica_id"] != first_life]
    assert later and all(s["faults"] == [] for s in later)
    assert sum(1 for e in r["events"] if e["kind"] == "struck") == 1
    # the story is over once the group is back: then the healthy end (1 s) and stop (no wait
    # for the ledger here: --ledger-wait 0)
    assert r["duration_s"] <= f["rejoined_at_s"] + 1 + 15, (r["duration_s"], f)
    assert "| 1 | `slow_compute:delay=0.6,from_step=15,rank=0` | group 1 rank 0 (rank 1" in out


def test_the_monitor_names_the_culprit_rank_and_host(rank_fault_run):
    """The finding that caught it names global rank 1 on its host (the monitor's evidence)."""
    r, out, _ = rank_fault_run
    [f] = r["faults"]
    assert f["culprit_ranks"] == [1] and f["culprit_hosts"] == ["node-1"], f
    caught = [d for d in r["detections"] if d["kind"] == "straggler"]
    assert caught and all(d["culprit_ranks"] == [1] for d in caught), caught
    assert "| straggler in group 1 | rank 1 on node-1 |" in out


def test_second_demo_fails_clearly(tmp_path):
    import fcntl

    lock = Path(tempfile.gettempdir()) / "lightkeeper-demo.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.write(fd, b"424242")
        proc = subprocess.run([sys.executable, "-m", "lightkeeper.cli", "demo", "--report-dir",
                               str(tmp_path)], capture_output=True, text=True, timeout=60)
    finally:
        os.close(fd)
    assert proc.returncode == 1
    assert "another lightkeeper demo is running (PID 424242" in proc.stderr
    assert "Traceback" not in proc.stderr
