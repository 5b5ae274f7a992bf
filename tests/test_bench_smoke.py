"""The benchmark scripts whose fakes follow the product's contracts, run at their smallest
size: a contract change that leaves a fake behind made them hang or measure nothing (the
ledger's pace is dated from the ranks' ``last_step_at``: a fake job without it never had a
baseline, and bench_ledger_incident.py looped for ever). Figures are not checked here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import require_binary

ROOT = Path(__file__).resolve().parent.parent


def bench(tmp_path, script: str, *args: str) -> dict:
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", *args, "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_the_ledger_benchmarks_reach_a_paced_job_and_every_incident_phase(tmp_path):
    scale = bench(tmp_path, "bench_ledger_scale.py", "--groups", "50", "--sweeps", "15")
    assert scale["this_paced_sweeps"] > 0, scale
    incident = bench(tmp_path, "bench_ledger_incident.py", "--groups", "20")
    assert set(incident["phases"]) == {"healthy", "slow", "straggler", "back", "stall"}
    ledger = bench(tmp_path, "bench_goodput_ledger.py", "--groups", "10")
    [row] = ledger["rows"]
    assert row["groups"] == 10 and row["paced"] and row["pending_s"] == 0, row


def test_an_ab_benchmark_refuses_a_baseline_it_cannot_load_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/bench_ledger_scale.py", "--groups", "10",
                           "--sweeps", "2", "--baseline", "e1d5fb6"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().startswith("--baseline e1d5fb6: it has no monitor/goodput/")


def test_the_shard_benchmark_runs_one_monitor_and_a_shard_over_a_real_etcd(tmp_path):
    require_binary("etcd")
    for virtual in ((), ("--virtual",)):
        got = bench(tmp_path, "bench_monitor_shard.py", "--ranks", "16", "--shards", "2",
                    "--sweeps", "1", *virtual)
        assert [(r["config"], r["ranks_polled"], r["error"]) for r in got["rows"]] == \
            [("one monitor", 16, None), ("shard 0/2", 8, None)], got


def test_the_poller_benchmark_loads_the_baseline_poller_in_its_default_pairs(tmp_path):
    got = bench(tmp_path, "bench_poller.py", "--ranks", "50", "--procs", "1", "--rounds", "1")
    rows = {(r["poller"], r["servers"]): r["answered_min"] for r in got["rows"]}
    assert rows == {("new", "new"): 50, ("new", "old"): 50, ("process", "new"): 50,
                    ("old", "new"): 50, ("old", "old"): 50}, rows
