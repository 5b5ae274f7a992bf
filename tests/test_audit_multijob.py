"""Two training jobs side by side, each with its own monitor (docs/monitor.md, Several jobs on
the same machines): what one job's monitor must never do to the other's.

The monitors are real `lightkeeper monitor` processes; no Lighthouse or rank is needed for what
these check (the file_sd output and start-up), so none is started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import requests

from lightkeeper.processes import SAFE_PATH, start_monitor_process, stop_process, wait_until


def _monitor_cmd(state, sd_out, job: str) -> list[str]:
    return [sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0", "--job", job,
            "--state", str(state), "--sd-out", str(sd_out), "--interval", "0.2"]


def test_second_monitor_on_one_sd_out_is_refused_and_the_first_keeps_its_ranks(tmp_path):
    """Given the same --sd-out (dashboards.md's one path, copied for a second job), a monitor
    of another job used to start and write its own (empty) set over the first's, which then
    never wrote it again while its targets stood still: Prometheus lost the first job's ranks."""
    sd_out = tmp_path / "file_sd" / "lightkeeper.json"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, url = start_monitor_process(_monitor_cmd(tmp_path / "a" / "m.sqlite", sd_out, "alpha"),
                                       tmp_path / "a.out", tmp_path / "a.log")
    try:
        rank = "http://127.0.0.1:9"  # nothing answers there: a registered rank, polled and down
        r = requests.post(url + "/v1/targets", json={"url": rank, "job": "alpha",
                                                      "replica_group": 0, "rank": 0}, timeout=5)
        assert r.status_code == 200, r.text

        def written():
            return sd_out.exists() and "127.0.0.1:9" in sd_out.read_text()

        wait_until(written, 20, what="the first monitor's file_sd output")
        before = sd_out.read_text()

        second = subprocess.run(_monitor_cmd(tmp_path / "b" / "m.sqlite", sd_out, "beta"),
                                capture_output=True, text=True, timeout=30,
                                env={**os.environ, **SAFE_PATH})
        assert second.returncode == 2, (second.returncode, second.stderr)
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "--sd-out" in lines[0] and str(sd_out) in lines[0] \
            and f"PID {first.pid}" in lines[0], second.stderr
        assert sd_out.read_text() == before
        assert [g["labels"]["job"] for g in json.loads(before)] == ["alpha"]
    finally:
        stop_process(first, grace=5)

    # once the first is gone, a monitor may take the file over (a restart, an upgrade)
    again, _ = start_monitor_process(_monitor_cmd(tmp_path / "b" / "m.sqlite", sd_out, "beta"),
                                     tmp_path / "b.out", tmp_path / "b.log")
    try:
        deadline = time.monotonic() + 20
        while json.loads(sd_out.read_text()) != [] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert json.loads(sd_out.read_text()) == []  # alpha's rank is not beta's to re-adopt
    finally:
        stop_process(again, grace=5)


def test_dashboards_show_one_job_at_a_time():
    """The dashboards aggregate by replica_group, quorum and monitor without the job (two jobs'
    group 0 would be one series, their quorum ids one maximum), so the shipped dashboards let
    Grafana select one job only; they used to default to "All", every job added up."""
    from dashboards.build import GENERATED_DIR

    for path in sorted(GENERATED_DIR.glob("*.json")):
        variables = {v["name"]: v for v in json.loads(path.read_text())["templating"]["list"]}
        job = variables["job"]
        assert job["multi"] is False and job["includeAll"] is False, path.name
        assert "allValue" not in job and job.get("current", {}).get("value") != ["$__all"]


def test_a_missing_monitor_of_one_job_alerts_beside_another_jobs_monitor(tmp_path):
    """Jobs alpha and beta scraped, only alpha's monitor: LightkeeperMonitorMissing fires for
    beta. It used to ask for no monitor target at all, so alpha's monitor hid beta's absence.
    promtool on the shipped rules.yml (Debian's promtool)."""
    from dashboards import rules
    from dashboards.build import PROMETHEUS_DIR
    from dashboards.yamlout import dump
    from tests.conftest import require_binary

    alert = next(a for a in rules.ALERTS if a.name == "LightkeeperMonitorMissing")

    def rank(job: str) -> str:
        return (f'lightkeeper_step{{job="{job}", lightkeeper_component="worker", '
                f'instance="{job}0:9000", replica_group="0", rank="0", group_rank="0"}}')

    series = [(rank("alpha"), "1x40"), (rank("beta"), "1x40"),
              ('lightkeeper_monitor_sweeps_total{job="alpha", lightkeeper_component="monitor", '
               'instance="mon-alpha:19400"}', "0+60x40"),
              ('lightkeeper_monitor_dry_run{job="alpha", lightkeeper_component="monitor", '
               'instance="mon-alpha:19400"}', "0x40"),
              ('up{job="lightkeeper-monitor", lightkeeper_component="monitor", '
               'instance="mon-alpha:19400"}', "1x40")]
    fires = {"job": "beta"}
    doc = {"rule_files": [str(PROMETHEUS_DIR / "rules.yml")], "evaluation_interval": "15s",
           "tests": [{"interval": "15s",
                      "input_series": [{"series": s, "values": v} for s, v in series],
                      "alert_rule_test": [{
                          "eval_time": "8m", "alertname": alert.name,
                          "exp_alerts": [{"exp_labels": {**fires, "severity": alert.severity},
                                          "exp_annotations": {
                                              k: rules.render_template(v, fires)
                                              for k, v in alert.annotations().items()}}]}]}]}
    (tmp_path / "t.yml").write_text(dump(doc, "two jobs, one monitor"))
    r = subprocess.run([require_binary("promtool"), "test", "rules", "t.yml"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_targets_file_entries_of_another_job_are_left_out(tmp_path):
    """A --targets-file that lists two jobs' ranks (a shared file_sd, or the other job's
    monitor's --sd-out): the ranks labelled with another job used to be polled and written to
    this monitor's --sd-out too, so Prometheus scraped them twice (their series doubled, told
    apart only by lightkeeper_source). They are left out, as their registrations are (409)."""
    shared = tmp_path / "all-ranks.json"
    shared.write_text(json.dumps([
        {"targets": ["127.0.0.1:9"], "labels": {"job": "alpha", "replica_group": "0"}},
        {"targets": ["127.0.0.1:10"], "labels": {"job": "beta", "replica_group": "0"}},
        {"targets": ["127.0.0.1:11"]}]))  # no job label: this monitor's
    sd_out = tmp_path / "alpha.json"
    cmd = _monitor_cmd(tmp_path / "m.sqlite", sd_out, "alpha") + ["--targets-file", str(shared)]
    proc, url = start_monitor_process(cmd, tmp_path / "out", tmp_path / "log")
    try:
        wait_until(sd_out.exists, 20, what="the monitor's file_sd output")
        known = sorted(t["url"] for t in requests.get(url + "/v1/targets", timeout=5).json())
        assert known == ["http://127.0.0.1:11", "http://127.0.0.1:9"]
        written = sorted(a for g in json.loads(sd_out.read_text()) for a in g["targets"])
        assert written == ["127.0.0.1:11", "127.0.0.1:9"]
        said = [ln for ln in (tmp_path / "log").read_text().splitlines() if "'beta'" in ln
                or "job(s) beta" in ln]
        assert len(said) == 1 and "leaving out" in said[0], said
    finally:
        stop_process(proc, grace=5)


def test_two_states_in_one_folder_share_the_default_sd_out_and_the_second_is_refused(tmp_path):
    """--state alpha.sqlite and --state beta.sqlite in one folder: both default --sd-out to
    lightkeeper-targets.json there, and the second monitor used to write over the first's."""
    def cmd(job):
        return [sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0", "--job", job,
                "--state", str(tmp_path / f"{job}.sqlite")]

    first, _ = start_monitor_process(cmd("alpha"), tmp_path / "a.out", tmp_path / "a.log")
    try:
        second = subprocess.run(cmd("beta"), capture_output=True, text=True, timeout=30,
                                env={**os.environ, **SAFE_PATH})
        assert second.returncode == 2, second.stderr
        assert str(tmp_path / "lightkeeper-targets.json") in second.stderr
        assert "beside --state" in second.stderr and f"PID {first.pid}" in second.stderr
    finally:
        stop_process(first, grace=5)
