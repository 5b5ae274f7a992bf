"""``benchmarks/bench_network.py`` exits non-zero when a run gave no figures (its demo refused
or failed): a row of nulls with status 0 reads as a measurement; torchft alone trains the whole
``--duration``. The runs themselves need root and namespaced hosts (a benchmark, not a test):
here each run's row, or the demo's exit, is given."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightkeeper.scenario import Scenario
from tests.support.demo import demo_args

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "bench_network", ROOT / "benchmarks" / "bench_network.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod.os, "geteuid", lambda: 0)
    return mod


@pytest.mark.parametrize("refused", [False, True])
def test_a_run_without_figures_fails_the_bench(bench, monkeypatch, tmp_path, capsys, refused):
    def run_case(case, mode, at, duration, workdir):
        if refused and mode == "torchft_alone":
            return {"case": case, "mode": mode, "rc": 2, "error": "no report: the demo refused"}
        return {"case": case, "mode": mode, "rc": 0, "healthy_steps_per_s": 5.0}

    monkeypatch.setattr(bench, "run_case", run_case)
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["bench_network.py", "--cases", "partition",
                                      "--duration", "1", "--json", str(out)])
    assert bench.main() == (1 if refused else 0)
    printed = capsys.readouterr()
    rows = [json.loads(line) for line in printed.out.splitlines()]
    assert [r["mode"] for r in rows] == ["torchft_alone", "lightkeeper"]
    if refused:
        assert rows[0]["error"] == "no report: the demo refused"
        assert "no figures for partition/torchft_alone" in printed.err
    else:
        assert "error" not in rows[0] and printed.err == ""
    assert len(json.loads(out.read_text())["rows"]) == 2  # written either way


def test_torchft_alone_trains_to_the_end_of_its_duration(bench, monkeypatch, tmp_path):
    # its story ends at "detected, not evicted"; the demo then stopped after end_s (3 s), before
    # torchft's own recovery (its process-group timeout) could show
    ran = []

    def run(cmd, **kw):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(bench.subprocess, "run", run)
    for mode in bench.MODES:
        bench.run_case("partition", mode, 60, 45.0, tmp_path)
    alone, acting = (demo_args(*cmd[2:]) for cmd in ran)
    assert alone.dry_run and alone.duration == alone.end_s == 45.0
    assert not acting.dry_run and acting.end_s == Scenario.end_s


@pytest.mark.parametrize("rc,struck_at_s,error", [
    (1, 30.0, "the demo failed (status 1): lightkeeper demo: something failed"),
    (0, None, "the fault never struck: never struck (no strike reported by 60.0s)"),
    (0, 30.0, None)])
def test_a_demo_that_failed_or_a_fault_that_never_struck_is_no_measurement(
        bench, monkeypatch, tmp_path, rc, struck_at_s, error):
    # the demo writes its report also when it fails (status 1), and a fault that never struck
    # leaves every figure null
    def run(cmd, **kw):
        rd = Path(cmd[cmd.index("--report-dir") + 1])
        rd.mkdir(parents=True)
        (rd / "report.json").write_text(json.dumps({
            "training_started_at_s": 5.0, "detections": [], "evictions": [], "hosts": {},
            "faults": [{"spec": "partition:at_step=60", "struck_at_s": struck_at_s,
                        "outcome": "recovered" if struck_at_s else "never struck",
                        "note": None if struck_at_s else "no strike reported by 60.0s"}]}))
        (rd / "timeline.json").write_text(json.dumps(
            {"samples": [{"t": 5 + i * 0.5, "step": i} for i in range(80)]}))
        return subprocess.CompletedProcess(cmd, rc, "", "lightkeeper demo: something failed")

    monkeypatch.setattr(bench.subprocess, "run", run)
    monkeypatch.setattr(sys, "argv", ["bench_network.py", "--cases", "partition",
                                      "--modes", "lightkeeper", "--keep", str(tmp_path)])
    assert bench.main() == (1 if error else 0)
    row = bench.run_case("partition", "lightkeeper", 60, 45.0, tmp_path / "again")
    assert row.get("error") == error
