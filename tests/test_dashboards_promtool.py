"""The shipped Prometheus files through promtool: the example config, the rules, and the rules'
unit tests (every alert fires on its bad series and stays silent on the healthy one). Then the
unit tests themselves are checked: an alert that never fires, or always fires, must fail them."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest

from dashboards import rules
from dashboards.build import PROMETHEUS_DIR
from dashboards.yamlout import dump
from tests.conftest import require_binary


def promtool(*args: str, cwd=PROMETHEUS_DIR) -> subprocess.CompletedProcess:
    exe = require_binary("promtool")
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_check_config():
    # (it warns that the example's file_sd path does not exist here; that is not an error)
    r = promtool("check", "config", "prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_check_rules():
    r = promtool("check", "rules", "rules.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(rules.RECORDS) + len(rules.ALERTS)} rules found" in r.stdout


def test_rules_unit_tests_pass():
    r = promtool("test", "rules", "rules_test.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def _run_mutant(tmp_path, alert: rules.Alert, expr: str) -> subprocess.CompletedProcess:
    mutant = dataclasses.replace(alert, expr=expr)
    alerts = [mutant if a.name == alert.name else a for a in rules.ALERTS]
    (tmp_path / "rules.yml").write_text(dump(rules.rules_document(alerts)))
    (tmp_path / "rules_test.yml").write_text(
        dump(rules.rules_test_document([mutant], with_records=False)))
    return promtool("test", "rules", "rules_test.yml", cwd=tmp_path)


@pytest.mark.parametrize("alert", rules.ALERTS, ids=rules.alert_names())
def test_unit_tests_catch_an_alert_that_never_fires(tmp_path, alert):
    r = _run_mutant(tmp_path, alert, "vector(1) == 2")
    assert r.returncode != 0, f"{alert.name}: its tests pass although it can never fire"
    for case in alert.cases:
        if case.fires:
            assert case.name in r.stdout + r.stderr, (case.name, r.stdout)


@pytest.mark.parametrize("alert", rules.ALERTS, ids=rules.alert_names())
def test_unit_tests_catch_an_alert_that_always_fires(tmp_path, alert):
    r = _run_mutant(tmp_path, alert, "vector(1)")
    assert r.returncode != 0, f"{alert.name}: its tests pass although it fires on anything"
    for case in alert.cases:
        if not case.fires:
            assert case.name in r.stdout + r.stderr, (case.name, r.stdout)


def test_cli_validate_runs_promtool(capsys):
    require_binary("promtool")
    from lightkeeper.cli import main

    assert main(["dashboards", "validate"]) == 0


def test_yaml_writer_round_trips_through_prometheus(tmp_path):
    """Quoting corner cases of the YAML writer come back unchanged from a real Prometheus."""
    require_binary("prometheus")
    from tests.support import prometheus

    tricky = ["it's", "a: b", "#hash", "yes", "1.5", "- dash", "{{ $labels.x }}", "line1\nline2",
              "", "null", "15s", "@at", "%pct", "back\\slash", 'dq"uote', "tab\there", "ü"]
    doc = {"groups": [{"name": "g", "rules": [
        {"alert": f"A{i}", "expr": "vector(1)", "annotations": {"text": t}}
        for i, t in enumerate(tricky)]}]}
    (tmp_path / "r.yml").write_text(dump(doc))
    r = promtool("check", "rules", "r.yml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr + (tmp_path / "r.yml").read_text()
    cfg = {"global": {"evaluation_interval": "1s"}, "rule_files": [str(tmp_path / "r.yml")],
           "scrape_configs": []}
    with prometheus.start(cfg, tmp_path / "prom") as prom:
        got = {r["name"]: r["annotations"]["text"]
               for g in prom.api("rules")["groups"] for r in g["rules"]}
    assert got == {f"A{i}": t for i, t in enumerate(tricky)}
