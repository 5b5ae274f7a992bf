"""``lightkeeper demo`` end to end: real Lighthouse, trainers, monitor (and Prometheus if there).

Stage timings are shortened through the demo's hidden flags so the default scenario runs in
about two minutes and the healthy / dry-run variants in well under one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

FAULT_KEYS = {"replica_group", "spec", "injected_at_s", "detected_at_s", "detected_kind",
              "evicted_at_s", "survivors_committing_at_s", "rejoined_at_s"}
DETECTION_KEYS = {"kind", "replica_group", "ranks", "at_s", "evicted"}
PHASE_KEYS = {"name", "start_s", "end_s", "steps", "step_rate", "vs_healthy"}


def run_demo(report_dir: Path, *args: str, timeout: float = 400) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "lightkeeper.cli", "demo", "--report-dir", str(report_dir), *args],
        capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    report = json.loads((report_dir / "report.json").read_text())
    check_shape(report)
    assert (report_dir / "report.md").exists() and (report_dir / "timeline.png").exists()
    for pid in report["pids"]:  # no process left behind
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), f"PID {pid} still running"
    return report, out


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def check_shape(r: dict) -> None:
    for f in r["faults"]:
        assert FAULT_KEYS <= f.keys(), f
        for k in FAULT_KEYS - {"replica_group", "spec", "detected_kind"}:
            assert f[k] is None or isinstance(f[k], (int, float)), (k, f)
    for d in r["detections"]:
        assert DETECTION_KEYS <= d.keys(), d
        assert isinstance(d["evicted"], bool) and isinstance(d["at_s"], (int, float))
    for p in r["phases"]:
        assert PHASE_KEYS <= p.keys(), p
    assert r["healthy_step_rate"] is None or r["healthy_step_rate"] > 0
    assert isinstance(r["pids"], list) and r["pids"]


def test_default_scenario(tmp_path):
    r, out = run_demo(tmp_path, "--healthy-s", "10", "--end-s", "5")
    slow, hang = r["faults"]
    assert slow["replica_group"] == 1 and slow["spec"].startswith("slow:")
    assert hang["replica_group"] == 2 and hang["spec"].startswith("hang:")
    for f, kind in ((slow, "straggler"), (hang, "hang")):
        assert f["detected_kind"] == kind, f
        assert f["injected_at_s"] < f["detected_at_s"] <= f["evicted_at_s"] + 1.0, f
        assert f["evicted_at_s"] <= f["survivors_committing_at_s"] < f["rejoined_at_s"], f
        assert f["outcome"] == "recovered"
        det = [d for d in r["detections"] if d["kind"] == kind and d["replica_group"] ==
               f["replica_group"] and d["evicted"]]
        assert det, r["detections"]
    # the group that never had a fault was never flagged
    assert not [d for d in r["detections"] if d["replica_group"] == 0], r["detections"]
    assert {e["replica_group"] for e in r["evictions"] if e["decision"] == "evict"} == {1, 2}
    assert {x["replica_group"] for x in r["restarts"]} >= {1, 2}
    assert r["phases"][0]["name"] == "healthy" and r["healthy_step_rate"] > 0
    assert "| 1 | 1 | `slow:" in out and "recovered" in out


def test_dry_run_evicts_nothing(tmp_path):
    r, _ = run_demo(tmp_path, "--dry-run", "--duration", "30", "--healthy-s", "5",
                    "--evict-timeout", "60")
    assert r["config"]["dry_run"] is True
    assert [e for e in r["evictions"] if e["decision"] == "evict"] == []
    assert not any(d["evicted"] for d in r["detections"])
    assert r["restarts"] == []
    [slow] = r["faults"]
    assert slow["evicted_at_s"] is None and slow["rejoined_at_s"] is None
    assert slow["detected_kind"] == "straggler", r  # detected, just not acted on


def test_no_faults_is_quiet(tmp_path):
    r, _ = run_demo(tmp_path, "--no-faults", "--duration", "25")
    assert r["faults"] == []
    assert r["detections"] == [] and r["evictions"] == []
    assert len(r["phases"]) == 1 and r["healthy_step_rate"] > 0


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
