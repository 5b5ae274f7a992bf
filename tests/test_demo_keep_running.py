"""``lightkeeper demo --keep-running``: after the scenario everything stays up until SIGTERM.

The demo runs as a real subprocess with a real Lighthouse, trainers, monitor (and Prometheus when
the binary is there). The test polls until the report is written and the cluster is announced,
checks that every process still serves (and keeps working: steps and sweeps advance), sends
SIGTERM and checks that every process the demo started is gone within a deadline.

The ``--steps`` run is also a ``--dry-run`` (a healthy job has nothing to evict, so it changes
nothing else here): it carries the demo's dry-run wiring (the monitor runs dry, hosts too, no
restart, no spare), which needs no demo of its own. That a real monitor holds a real finding
under --dry-run (tests/test_monitor_api.py) and that the demo's story ends at the hold
(tests/test_demo_faulttrack.py) are tested on their own parts.

The ``--duration`` run's job (3 groups x 2 ranks under torchrun) also carries FT-HSDP's Flight
Recorder evidence (``check_ft_hsdp``), which had a 2 x 2 torchrun job of its own in
tests/test_trainer_faults_e2e.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from lightkeeper.cluster import stop_process

pytestmark = pytest.mark.e2e


def poll(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def get_json(url: str):
    try:
        r = requests.get(url, timeout=2)
        return r.json() if r.ok else None
    except (requests.RequestException, ValueError):
        return None


MODES = {
    "duration": ["--no-faults", "--duration", "3"],  # the scenario ends by its --duration
    # ... or when every group trained its --steps. Without Prometheus: the duration run
    # checks it serves; two of them would only take CPU from the two jobs' start
    "steps": ["--no-faults", "--steps", "8", "--dry-run", "--no-prometheus"],
}


@dataclass
class RunningDemo:
    proc: subprocess.Popen
    out_path: Path
    report_dir: Path


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    """Both demos, started at once; each test checks and stops its own. Much of a demo's
    start is waiting (the first quorum, then the scenario's 3 s or 8 steps), so the two
    overlap well. Each has a TMPDIR of its own, hence its own lock file (the lock keeps a
    user from starting a second demo by mistake; these two share nothing: ephemeral ports,
    their own report directories)."""
    started: dict[str, RunningDemo] = {}
    try:
        for name, mode in MODES.items():
            d = tmp_path_factory.mktemp(f"keep-running-{name}")
            (d / "tmp").mkdir()
            out_path, report_dir = d / "demo.out", d / "report"
            with open(out_path, "w") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "lightkeeper.cli", "demo", "--report-dir",
                     str(report_dir), "--keep-running", *mode],
                    stdout=out, stderr=subprocess.STDOUT, text=True,
                    env={**os.environ, "TMPDIR": str(d / "tmp")})
            started[name] = RunningDemo(proc, out_path, report_dir)
        yield started
    finally:  # a demo whose test did not stop it (failed early, or deselected)
        for demo in started.values():
            if demo.proc.poll() is None:
                demo.proc.send_signal(signal.SIGTERM)
                try:
                    demo.proc.wait(timeout=90)
                except subprocess.TimeoutExpired:
                    stop_process(demo.proc, grace=0)


def check_ft_hsdp(text: str) -> None:
    """FT-HSDP under torchrun, from a rank's Flight Recorder: group 0's rank 1 (torchrun's
    second worker; the agent hosts the group's store) in a quorum of the 3 groups reduces across
    them with global ranks 1, 3 and 5 (torchft's gloo all_reduce) and all-gathers inside its
    group (FSDP2). This job runs anyway: a 2 x 2 torchrun job of its own took ~20 s."""
    [url] = re.findall(r"curl (\S+)/v1/state +# group 0 rank 1$", text, re.M)
    poll(lambda: (get_json(url + "/v1/state") or {}).get("num_participants") == 3, 30,
         "group 0's rank 1 in a quorum of the 3 groups")
    dump = get_json(url + "/v1/fr_trace")
    inc = dump["incarnations"][-1]
    assert inc["group_rank"] == 1 and inc["global_ranks"] == [1, 3, 5], inc
    names = {(e["process_group"][0], e["profiling_name"]) for e in dump["entries"]}
    assert ("", "gloo:all_reduce") in names, names  # across groups (torchft)
    assert any(n.startswith("gloo:all_gather") for _, n in names), names  # FSDP2 inside


@pytest.mark.parametrize("name", list(MODES))
def test_keep_running_stays_up_until_sigterm(demos, name):
    mode, demo = MODES[name], demos[name]
    proc, out_path, report_dir = demo.proc, demo.out_path, demo.report_dir
    try:
        def announced():
            assert proc.poll() is None, f"demo exited ({proc.returncode}):\n" + \
                out_path.read_text()[-4000:]
            text = out_path.read_text()
            return "the cluster keeps running" in text and (report_dir / "report.json").exists()

        poll(announced, 300, "the demo to announce the running cluster")
        report = json.loads((report_dir / "report.json").read_text())
        text = out_path.read_text()
        # a healthy run's report: no fault, no finding (with --steps only the groups that
        # finished are gone: `dead`), no eviction, one healthy phase
        assert report["faults"] == [] and report["restarts"] == []
        assert [d for d in report["detections"] if "--duration" in mode or d["kind"] != "dead"] \
            == [], report["detections"]
        assert [e for e in report["evictions"] if e["decision"] == "evict"] == []
        assert [p["name"] for p in report["phases"]] == ["healthy"]
        assert report["healthy_step_rate"] > 0 and report["config"]["warm_spares"] is False
        urls = report["urls"]
        monitor = urls["monitor"]
        # each group's ranks on its host's own loopback address (docs/demo.md, Hosts)
        ranks = re.findall(r"curl (http://127\.0\.0\.\d+:\d+)/v1/state", text)

        # everything still serves, and keeps working, well after the announcement
        cluster = get_json(monitor + "/v1/cluster")
        sweeps = cluster["sweeps"]
        dry_run = "--dry-run" in mode
        # --dry-run reaches the monitor (it never evicts) and its host ledger (never
        # quarantines); nothing was restarted, so every group is where it first started
        assert cluster["dry_run"] is dry_run and report["config"]["dry_run"] is dry_run
        assert report["hosts"]["dry_run"] is dry_run and report["hosts"]["quarantined"] == []
        assert not any(d["evicted"] for d in report["detections"]), report["detections"]
        assert [p["why"] for p in report["placements"]] == ["first start"] * 3
        assert requests.get(urls["lighthouse"] + "/status", timeout=2).ok
        if urls["prometheus"]:
            assert requests.get(urls["prometheus"] + "/-/ready", timeout=2).ok
        poll(lambda: (get_json(monitor + "/v1/cluster") or {}).get("sweeps", 0) >= sweeps + 5,
             60, "the monitor to keep sweeping")
        if "--duration" in mode:  # the ranks keep training
            assert len(ranks) == 6, text
            assert sorted({u.rsplit(":", 1)[0] for u in ranks}) == [
                "http://127.0.0.2", "http://127.0.0.3", "http://127.0.0.4"], ranks
            steps = {u: get_json(u + "/v1/state")["step"] for u in ranks}
            poll(lambda: all((get_json(u + "/v1/state") or {}).get("step", -1) > steps[u]
                             for u in ranks), 60, "every rank to keep stepping")
            check_ft_hsdp(text)
        else:  # --steps: the groups finished their steps and exited; the rest stays up
            assert [e["detail"] for e in report["events"] if e["kind"] == "stop"] == [
                "every group trained 8 steps"], report["events"]
        assert proc.poll() is None, "the demo exited on its own"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
    text = out_path.read_text()
    assert code == 0, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    final = json.loads((report_dir / "report.json").read_text())
    assert final["outcome"] == "completed"
    if "--duration" in mode:  # healthy to the end: the whole run, its checks above included
        assert final["detections"] == [] and final["faults"] == [], final["detections"]
        assert [p["name"] for p in final["phases"]] == ["healthy"], final["phases"]
    pids = set(final["pids"]) | set(report["pids"])
    assert len(pids) >= 5  # Lighthouse, monitor, the groups and their ranks
    poll(lambda: all(gone(p) for p in pids), 30, "every process the demo started to be gone")
    assert not any(os.path.exists(f"/proc/{p}") and not gone(p) for p in pids)
