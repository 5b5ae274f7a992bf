"""``lightkeeper demo --soak`` refuses a duration that is not a number of seconds > 0 at once,
in one line, before it starts anything (lightkeeper/demo.py)."""

from __future__ import annotations

from tests.test_demo_placement import _demo


def test_a_soak_of_nan_seconds_is_refused_before_starting(tmp_path):
    # nan compared false with "<= 0": the soak started and never ended nor restarted the monitor
    report_dir = tmp_path / "report"
    proc = _demo("--report-dir", str(report_dir), "--hosts", "loopback", "--soak", "nan")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("lightkeeper demo: --soak takes seconds > 0")
    assert proc.stderr.count("\n") == 1 and not report_dir.exists()
