"""The shipped Prometheus files through promtool: the example config, the rules, and the rules'
unit tests (every alert fires on its bad series and stays silent on the healthy one). Then the
unit tests themselves are checked: an alert that never fires, or always fires, must fail them."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from types import SimpleNamespace

import pytest

from dashboards import rules
from dashboards.build import PROMETHEUS_DIR
from dashboards.promql import RANK_HEALS
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


@pytest.fixture(scope="module")
def cli_validate() -> tuple[int, dict[tuple[str, ...], subprocess.CompletedProcess]]:
    """``lightkeeper dashboards validate``'s exit status and the promtool runs it made on the
    shipped files, by arguments: the checks below read those runs rather than repeat them."""
    exe = require_binary("promtool")
    from lightkeeper.cli import main

    real_run, runs = subprocess.run, {}

    def run(cmd, *a, **kw):
        r = real_run(cmd, *a, **kw)
        if cmd[0] == exe and kw.get("cwd") == PROMETHEUS_DIR:
            runs[tuple(cmd[1:])] = r
        return r

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess, "run", run)
        status = main(["dashboards", "validate"])
    return status, runs


def test_check_rules(cli_validate):
    r = cli_validate[1][("check", "rules", "rules.yml")]
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(rules.RECORDS) + len(rules.ALERTS)} rules found" in r.stdout


def test_rules_unit_tests_pass(cli_validate):
    r = cli_validate[1][("test", "rules", "rules_test.yml")]
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


MUTANTS = {"never": "vector(1) == 2", "always": "vector(1)"}


@pytest.fixture(scope="module")
def mutant_reports(tmp_path_factory) -> dict[tuple[str, str], str]:
    """promtool's report on each alert's unit tests against that alert made never to fire and
    made always to fire, all in one promtool run (one file each). A mutant's rules.yml holds only
    the mutant: its expression reads no series and the tests name it alone, so the other rules
    cannot change what they see; evaluating them at every step would only cost time."""
    exe = require_binary("promtool")
    top = tmp_path_factory.mktemp("mutants")
    files = []
    for alert in rules.ALERTS:
        for how, expr in MUTANTS.items():
            mutant = dataclasses.replace(alert, expr=expr)
            d = top / f"{alert.name}-{how}"
            d.mkdir()
            doc = rules.rules_document([mutant])
            doc["groups"] = [g for g in doc["groups"] if g["name"] == "lightkeeper.alerts"]
            (d / "rules.yml").write_text(dump(doc))
            (d / "rules_test.yml").write_text(
                dump(rules.rules_test_document([mutant], with_records=False)))
            files.append(f"{d.name}/rules_test.yml")
    # one pipe for both streams: promtool writes each file's header and its verdict in order
    r = subprocess.run([exe, "test", "rules", *files], cwd=top, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    parts = re.split(r"^Unit Testing: +(\S+)/rules_test\.yml$", r.stdout, flags=re.M)
    reports = dict(zip(parts[1::2], parts[2::2], strict=True))
    assert sorted(reports) == sorted(f[: -len("/rules_test.yml")] for f in files), r.stdout
    assert r.returncode != 0, r.stdout
    return {tuple(name.rsplit("-", 1)): text for name, text in reports.items()}


@pytest.mark.parametrize("alert", rules.ALERTS, ids=rules.alert_names())
def test_unit_tests_catch_an_alert_that_never_fires(mutant_reports, alert):
    r = mutant_reports[alert.name, "never"]
    assert "FAILED" in r and "SUCCESS" not in r, \
        f"{alert.name}: its tests pass although it can never fire"
    for case in alert.cases:
        if case.fires:
            assert case.name in r, (case.name, r)


@pytest.mark.parametrize("alert", rules.ALERTS, ids=rules.alert_names())
def test_unit_tests_catch_an_alert_that_always_fires(mutant_reports, alert):
    r = mutant_reports[alert.name, "always"]
    assert "FAILED" in r and "SUCCESS" not in r, \
        f"{alert.name}: its tests pass although it fires on anything"
    for case in alert.cases:
        if not case.fires:
            assert case.name in r, (case.name, r)


def test_cli_validate_runs_promtool(cli_validate):
    status, runs = cli_validate
    assert status == 0
    assert set(runs) == {("check", "config", "--syntax-only", "prometheus.yml"),
                         ("check", "rules", "rules.yml"), ("test", "rules", "rules_test.yml")}


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


# --- the host and Lighthouse-settings panels and alerts on the monitor's own series ----------
HOST_AND_SETTINGS = ("lightkeeper_monitor_host", "lightkeeper_monitor_config_warnings",
                     "lightkeeper_monitor_lighthouse_")


def _monitor_series_with_trouble(tmp_path) -> list[tuple[str, str]]:
    """promtool input series (constant over 20 samples) from a real MonitorMetrics, filled by
    the real host ledger and Lighthouse-settings watch: host h1 quarantined after a hang, its
    quarantine action through a real exec sink (``false``) failing; h2 suspect after one
    straggler; the monitor told the Lighthouse's heartbeat timeout is torchft's default 5 s.
    Only the hand-made findings are not from a running job (a healthy live job has no host
    that is not ok, so tests/test_dashboards_live.py cannot show these series)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from monitor.act.hosts import HostLedger
    from monitor.act.sinks import build_sink
    from monitor.api.metrics import MonitorMetrics
    from monitor.config import QuarantineConfig
    from monitor.evidence.lighthouse_settings import LighthouseSettingsWatch
    from monitor.store import Store

    now = 1000.0
    clock = lambda: now  # noqa: E731
    led = HostLedger(Store(str(tmp_path / "m.sqlite")), QuarantineConfig(),
                     [build_sink("exec:false")], "train", clock)

    def finding(kind, host, fid):
        return {"id": fid, "kind": kind, "replica_group": fid, "replica_id": f"g{fid}:a",
                "ranks": [fid], "evidence": {"culprits": [
                    {"rank": fid, "host": host, "node": f"node-{host}", "device": {"type": "cpu"}}]}}

    led.record([finding("hang", "h1", 1), finding("straggler", "h2", 2)], now)
    led.decide(now, None, 40)
    assert led.run_actions(now) == 1
    m = MonitorMetrics("train")
    m.set_hosts(led.counts(), led.to_json(now))
    watch = LighthouseSettingsWatch(declared_heartbeat_ms=5000, interval_s=1.0)
    watch.observe(None, now)
    watch.publish(m, "train")

    out = []
    text = generate_latest(m.registry).decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.startswith(HOST_AND_SETTINGS):
                continue
            labels = {**s.labels, "lightkeeper_component": "monitor", "instance": "mon:19400"}
            sel = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            value = "NaN" if s.value != s.value else repr(float(s.value))
            out.append((f"{s.name}{{{sel}}}", " ".join([value] * 20)))
    return out


def _query(title: str, ref: str = "A") -> str:
    from dashboards.build import build_dashboards
    from dashboards.validate import all_queries, substitute

    (q,) = [q for q in all_queries(build_dashboards())
            if q.where == f"panel '{title}' {ref}"]
    return substitute(q.expr, {"job": "train"}, {"$__rate_interval": "1m"})


def promtool_test(tmp_path, name: str, series: list[tuple[str, str]],
                  expr_tests: list[tuple[str, list[dict]]],
                  alerts: list[tuple[str, list[dict]]]) -> None:
    """``promtool test rules`` of rules.yml on ``series``: each query's samples and each alert's
    labels (its annotations rendered from the rule's templates) at 3m."""
    by_name = {a.name: a for a in rules.ALERTS}
    doc = {"rule_files": [str(PROMETHEUS_DIR / "rules.yml")], "evaluation_interval": "15s",
           "tests": [{
               "name": name,
               "interval": "15s",
               "input_series": [{"series": s, "values": v} for s, v in series],
               "promql_expr_test": [{"expr": e, "eval_time": "3m", "exp_samples": exp}
                                    for e, exp in expr_tests],
               "alert_rule_test": [{
                   "eval_time": "3m", "alertname": alert,
                   "exp_alerts": [{"exp_labels": {**lab, "severity": by_name[alert].severity},
                                   "exp_annotations": {
                                       k: rules.render_template(v, lab)
                                       for k, v in by_name[alert].annotations().items()}}
                                  for lab in labels]} for alert, labels in alerts],
           }]}
    (tmp_path / "t.yml").write_text(dump(doc))
    r = promtool("test", "rules", "t.yml", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_host_and_lighthouse_panels_and_alerts_on_the_monitors_own_series(tmp_path):
    series = _monitor_series_with_trouble(tmp_path)
    names = {s.split("{")[0] for s, _ in series}
    assert {"lightkeeper_monitor_host_quarantine_state", "lightkeeper_monitor_host_offences",
            "lightkeeper_monitor_host_action_failed", "lightkeeper_monitor_hosts",
            "lightkeeper_monitor_config_warnings"} <= names, names
    j = {"job": "train"}

    def samples(rows: list[tuple[dict, float]]) -> list[dict]:
        return [{"labels": "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(lab.items())) + "}",
                 "value": v} for lab, v in rows]

    expr_tests = [
        (_query("Quarantined hosts"), samples([({}, 1)])),
        (_query("Hosts with a failing action"), samples([({}, 1)])),
        (_query("Hosts by state"), samples([({"state": s}, n) for s, n in (
            ("back to ok", 0), ("quarantined", 1), ("released", 0), ("suspect", 1))])),
        (_query("Failing host actions by sink"), samples([({"sink": "exec:false"}, 1)])),
        (_query("Hosts not ok", "A"), samples([
            ({**j, "host": "h1", "node": "node-h1", "state": "quarantined"}, 1),
            ({**j, "host": "h2", "node": "node-h2", "state": "suspect"}, 1)])),
        (_query("Hosts not ok", "B"), samples([({**j, "host": "h1"}, 1), ({**j, "host": "h2"}, 1)])),
        (_query("Hosts not ok", "C"), samples([({**j, "host": "h1", "sink": "exec:false"}, 1)])),
        (_query("Slow Lighthouse settings"), samples([({}, 1)])),
        (_query("Lighthouse settings warnings"), samples([
            ({"setting": "eviction_drop"}, 0), ({"setting": "heartbeat_timeout"}, 1),
            ({"setting": "heartbeat_timeout_declared"}, 0)])),
        # NaN (not known) never equals itself: the known sources only
        (f"({_query('Lighthouse heartbeat timeout')}) == "
         f"({_query('Lighthouse heartbeat timeout')})", samples([({"source": "declared"}, 5)])),
    ]
    base = {"job": "train"}
    alerts = [
        ("LightkeeperHostQuarantined", [{**base, "host": "h1", "node": "node-h1"}]),
        ("LightkeeperQuarantineActionFailing", [{**base, "host": "h1", "sink": "exec:false"}]),
        ("LightkeeperLighthouseSlowRecovery", [{**base, "setting": "heartbeat_timeout"}]),
    ]
    promtool_test(tmp_path, "host and Lighthouse-settings series of a real MonitorMetrics",
                  series, expr_tests, alerts)


# --- event markers and per-interval bars at Grafana's step ---------------------------------
# Scrapes every 15 s (the shipped interval, Grafana's $__interval for these dashboards); Grafana's
# steps fall 7 s after each scrape. A monitor counter appears at 30 s already at 1, grows at 75 s,
# is reset at 105 s (a monitor restart) and grows at 135 s; a worker counter exists from 0 s at
# 0 with the same increments; the quorum id changes at 30 s and 75 s. The monitor is scraped
# throughout (its lightkeeper_monitor_dry_run), so its new series are new, not back from a gap.
STEPS = range(7, 160, 15)
EVENT_STEPS = {37, 82, 142}
MONITOR_COUNTER = "_ _ 1 1 1 2 2 0 0 1 1"
WORKER_COUNTER = "0 0 1 1 1 2 2 0 0 1 1"
QUORUM_ID = "1 1 2 2 2 3 3 3 3 3 3"
MONITOR_LABELS = ('job="train", instance="mon:19400", replica_group="1", kind="hang", '
                  'outcome="accepted", decision="evict", reason="confirmed"')
EVENT_QUERIES = [  # (dashboard, where, counter, worker counter?)
    ("OVERVIEW", "panel 'Commit failures, heals and quorum changes' A",
     "lightkeeper_commit_failures_total", True),
    ("OVERVIEW", "panel 'Commit failures, heals and quorum changes' B", RANK_HEALS, True),
    ("OVERVIEW", "panel 'Commit failures, heals and quorum changes' C",
     "lightkeeper_quorum_changes_total", True),
    ("OVERVIEW", "panel 'Findings and evictions' A", "lightkeeper_monitor_findings_total", False),
    ("OVERVIEW", "panel 'Findings and evictions' B", "lightkeeper_monitor_evictions_total", False),
    ("OVERVIEW", "annotation 'Evictions'", "lightkeeper_monitor_evictions_total", False),
    ("OVERVIEW", "annotation 'Findings'", "lightkeeper_monitor_findings_total", False),
    ("MONITOR", "panel 'Ranks known / up / unreachable / finished / lost' E",
     "lightkeeper_monitor_ranks_lost_total", True),
    ("MONITOR", "panel 'Rank registrations by outcome' A",
     "lightkeeper_monitor_registrations_total", False),
    ("MONITOR", "panel 'Findings by kind' A", "lightkeeper_monitor_findings_total", False),
    ("MONITOR", "panel 'Evictions by replica group' A",
     "lightkeeper_monitor_evictions_total", False),
    ("MONITOR", "panel 'Eviction decisions (evict / hold)' A",
     "lightkeeper_monitor_eviction_decisions_total", False),
    ("MONITOR", "annotation 'Evictions'", "lightkeeper_monitor_evictions_total", False),
]


def _dashboard_query(dashboard: str, where: str) -> str:
    from dashboards import build
    from dashboards.validate import all_queries, substitute

    uid = getattr(build, f"UID_{dashboard}")
    (q,) = [q for q in all_queries(build.build_dashboards())
            if q.dashboard == uid and q.where == where]
    return substitute(q.expr, {"job": "train"}, {"$__rate_interval": "1m", "$__interval": "15s"})


def _by_labels(expr: str, series_labels: dict[str, str]) -> str:
    """The labels an aggregation ``sum by (a, b) (...)`` keeps of the one input series."""
    m = re.match(r"\w+ by \(([^)]*)\)", expr)
    keep = [k.strip() for k in m.group(1).split(",")] if m else []
    return "{" + ", ".join(f'{k}="{series_labels[k]}"' for k in sorted(keep)) + "}"


def _test_rules(tmp_path, name: str, series: list, tests: list) -> None:
    """``promtool test rules`` of ``tests`` on ``series`` (input series, or (series, values)
    pairs; samples 15 s apart) under rules.yml."""
    series = [x if isinstance(x, dict) else {"series": x[0], "values": x[1]} for x in series]
    doc = {"rule_files": [str(PROMETHEUS_DIR / "rules.yml")], "evaluation_interval": "15s",
           "tests": [{"name": name, "interval": "15s", "input_series": series,
                      "promql_expr_test": tests}]}
    (tmp_path / "t.yml").write_text(dump(doc))
    r = promtool("test", "rules", "t.yml", cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


def _event_series() -> list[dict]:
    worker = [f'{{job="train", replica_group="1", rank="{r}"}}' for r in (0, 1)]
    out = [{"series": f"lightkeeper_quorum_id{w}", "values": QUORUM_ID} for w in worker]
    out.append({"series": 'lightkeeper_monitor_dry_run{job="train", instance="mon:19400"}',
                "values": "0x10"})
    # the ranks started long before; their counters' reset is their restart
    out += [{"series": f"lightkeeper_worker_start_time_seconds{w}", "values": "-1000x6 100x4"}
            for w in worker]
    for _, _, counter, is_worker in EVENT_QUERIES:
        counter = "lightkeeper_heals_total" if counter == RANK_HEALS else counter
        if counter.startswith("lightkeeper_monitor_ranks_lost"):
            out.append({"series": f'{counter}{{job="train"}}', "values": WORKER_COUNTER})
        elif is_worker:
            out += [{"series": f"{counter}{w}", "values": WORKER_COUNTER} for w in worker]
        else:
            out.append({"series": f"{counter}{{{MONITOR_LABELS}}}", "values": MONITOR_COUNTER})
    return [dict(t) for t in {tuple(s.items()) for s in out}]


def test_event_markers_and_bars_count_each_event_once_at_grafanas_step(tmp_path):
    """Each increment is one annotation marker and bars adding up to 1, at the first step that
    sees it, with 15 s scrapes and steps not aligned to them; a new labelled series counts its
    first increment, a counter reset counts nothing; a quorum change is one marker."""
    labels = dict(re.findall(r'(\w+)="([^"]*)"', MONITOR_LABELS))
    tests = []
    for dashboard, where, counter, is_worker in EVENT_QUERIES:
        expr = _dashboard_query(dashboard, where)
        assert counter in expr, (where, expr)
        out = _by_labels(expr, {**labels, "job": "train"})
        # the heals rule reads a step late (the previous evaluation's scrapes all stored)
        late = 15 if counter == RANK_HEALS else 0
        # a difference needs a sample a step before; a new monitor series counts at once
        first = (22 if is_worker else 37) + late
        for t in STEPS:
            value = 1 if t - late in EVENT_STEPS else 0
            if where.startswith("annotation"):
                rows = [{"labels": out, "value": 1}] if value else []
            else:
                rows = [{"labels": out, "value": value}] if t >= first else []
            tests.append({"expr": expr, "eval_time": f"{t}s", "exp_samples": rows})
    quorum = _dashboard_query("OVERVIEW", "annotation 'Quorum changes'")
    for t in STEPS:
        new_id = {37: 2, 82: 3}.get(t)
        tests.append({"expr": quorum, "eval_time": f"{t}s", "exp_samples": [
            {"labels": '{job="train"}', "value": new_id}] if new_id else []})
    _test_rules(tmp_path, "events at Grafana's step", _event_series(), tests)


# The heals rule reads a step late because a sample is stamped at its scrape's start but stored
# at its end: a rank whose scrape outlasts its offset to the rule's tick had every heal missed.
# promtool stores every input sample before it evaluates, so no case here can model a scrape in
# flight, and a real Prometheus needs minutes of 15 s scrapes and evaluations to show it (not a
# unit test): these cases pin the step-late reading only.
def test_heals_panels_count_a_restarted_ranks_heal_first_seen_at_1(tmp_path):
    """Group 1's rank is evicted at 60 s and its replacement, started at 95 s, heals before its
    first scrape at 105 s: its heals series is first seen at 1. The overview's bar and the
    drill-down's rate count that heal (once), group 0's steady rank none."""
    def rank(g: int) -> str:
        return (f'job="train", lightkeeper_component="worker", instance="w{g}:9000", '
                f'replica_group="{g}", rank="{g}", group_rank="0"')

    series = [(f"lightkeeper_worker_start_time_seconds{{{rank(0)}}}", "-1000x12"),
              (f"lightkeeper_heals_total{{{rank(0)}}}", "0x12"),
              (f"lightkeeper_worker_start_time_seconds{{{rank(1)}}}", "-1000x3 stale _x2 95x5"),
              (f"lightkeeper_heals_total{{{rank(1)}}}", "0x3 stale _x2 1x5")]
    bars = _dashboard_query("OVERVIEW", "panel 'Commit failures, heals and quorum changes' B")
    drill = _dashboard_query("DRILLDOWN", "panel 'Commits, commit failures and heals per rank' C")
    # a step late: the rule reads the scrapes before its previous evaluation
    tests = [{"expr": bars, "eval_time": f"{t}s", "exp_samples": [
        {"labels": f'{{replica_group="{g}"}}', "value": v} for g, v in groups]}
        for t, groups in ((67, [(0, 0), (1, 0)]), (82, [(0, 0)]), (127, [(0, 0), (1, 1)]),
                          (142, [(0, 0), (1, 0)]))]
    # the heal spread over the rate interval (1 m: 4 evaluations)
    tests.append({"expr": drill, "eval_time": "157s", "exp_samples": [
        {"labels": f"{{{rank(g)}}}", "value": v} for g, v in ((0, 0), (1, 1 / 60))]})
    _test_rules(tmp_path, "a restarted rank's heals", series, tests)


def test_drilldown_heals_rate_of_a_rank_first_seen_at_1_is_over_the_whole_interval(tmp_path):
    """A rank started at 100 s is first scraped at 105 s already at 1: over the 1 m rate
    interval its heal is 1/60 per second, not spread over the few records it has yet."""
    rank = ('job="train", lightkeeper_component="worker", instance="w2:9000", '
            'replica_group="2", rank="2", group_rank="0"')
    series = [(f"lightkeeper_worker_start_time_seconds{{{rank}}}", "_x7 100x5"),
              (f"lightkeeper_heals_total{{{rank}}}", "_x7 1x5")]
    drill = _dashboard_query("DRILLDOWN", "panel 'Commits, commit failures and heals per rank' C")
    tests = [{"expr": drill, "eval_time": f"{t}s",
              "exp_samples": [{"labels": f"{{{rank}}}", "value": 1 / 60}]} for t in (127, 172)]
    _test_rules(tmp_path, "a young rank's heals rate", series, tests)


def test_shard_panels_and_alerts_on_the_series_of_a_shard_and_a_leader_without_etcd(tmp_path):
    """The shard series exist on sharded monitors only (the live job runs one monitor): a real
    shard and leader candidate whose etcd refuses connections, their MonitorMetrics read by
    promtool through the Monitor health panels and both shard alerts."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from lightkeeper.processes import wait_until
    from monitor.shard import Leader, Shards
    from tests.test_monitor_shard import _Monitor, swept

    mon = _Monitor("http://127.0.0.1:1", "/lk", 0)  # nothing listens on port 1
    shard = Shards(mon.shard_cfg, mon)
    shard.after_sweep(SimpleNamespace(ranks={}, groups={}), swept(), mon.now)
    leader = Leader(mon.shard_cfg, mon, "/lk/sim/")
    leader.start()
    try:
        wait_until(lambda: 'role="leader"' in generate_latest(mon.metrics.registry).decode(),
                   10, what="the leader's first tick")
    finally:
        leader.stop()
        shard.etcd.close()
        mon.store.close()
    series = []
    for fam in text_string_to_metric_families(generate_latest(mon.metrics.registry).decode()):
        for s in fam.samples:
            if s.name.startswith("lightkeeper_monitor_shard_"):
                labels = {**s.labels, "job": "train", "lightkeeper_component": "monitor",
                          "instance": "mon:19400"}
                sel = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                series.append((f"{s.name}{{{sel}}}", " ".join([repr(float(s.value))] * 20)))
    assert len(series) == 4, series  # etcd_up of both roles, leading, standby
    inst = {"instance": "mon:19400"}
    expr_tests = [
        (_query("etcd reachable, by monitor and role"),
         [{"labels": f'{{instance="mon:19400", role="{r}"}}', "value": 0}
          for r in ("leader", "shard")]),
        (_query("Leader candidates and standby shards", "A"),
         [{"labels": '{instance="mon:19400"}', "value": 0}]),
        (_query("Leader candidates and standby shards", "B"),
         [{"labels": '{instance="mon:19400"}', "value": 0}]),
    ]
    base = {"job": "train"}
    alerts = [("LightkeeperShardCannotAct", [{**base, **inst, "role": "leader"},
                                             {**base, **inst, "role": "shard"}]),
              ("LightkeeperShardNoLeader", [base])]
    promtool_test(tmp_path, "shard series of a real shard and leader candidate", series,
                  expr_tests, alerts)


def test_event_markers_and_bars_skip_a_scrape_gap_but_count_new_series(tmp_path):
    """A labelled monitor counter back after a scrape gap (staleness markers on the monitor's
    series) is no event; one new while its monitor is scraped, or in the first scrape of a
    monitor that started shortly before (even a minute before, by its own clock), counts its
    whole value; alike over the time range."""
    a = 'job="train", instance="mon:19400"'
    b = 'job="train", instance="mon2:19400"'
    c = 'job="train", instance="mon3:19400"'
    series = [  # 15 s scrapes; monitor a (started long ago) misses its scrape at 120 s
        (f"lightkeeper_monitor_dry_run{{{a}}}", "0x7 stale 0x8"),
        (f"lightkeeper_monitor_start_time_seconds{{{a}}}", "-1000x7 stale -1000x8"),
        (f'lightkeeper_monitor_evictions_total{{{a}, replica_group="1"}}', "5x7 stale 5x8"),
        (f'lightkeeper_monitor_evictions_total{{{a}, replica_group="2"}}', "_x10 1x5"),
        (f'lightkeeper_monitor_eviction_decisions_total{{{a}, decision="evict", '
         f'reason="confirmed"}}', "3x7 stale 3x8"),
        # monitor b started at 55 s, first scraped at 60 s with its first eviction
        (f"lightkeeper_monitor_dry_run{{{b}}}", "_x4 0x10"),
        (f"lightkeeper_monitor_start_time_seconds{{{b}}}", "_x4 55x10"),
        (f'lightkeeper_monitor_evictions_total{{{b}, replica_group="3"}}', "_x4 1x10"),
        (f'lightkeeper_monitor_eviction_decisions_total{{{b}, decision="hold", '
         f'reason="dry_run"}}', "_x4 1x10"),
        # monitor c first scraped at 75 s, its clock saying it started 65 s before: a first
        # scrape can come well after a start, and a clock be off
        (f"lightkeeper_monitor_dry_run{{{c}}}", "_x5 0x10"),
        (f"lightkeeper_monitor_start_time_seconds{{{c}}}", "_x5 10x10"),
        (f'lightkeeper_monitor_evictions_total{{{c}, replica_group="4"}}', "_x5 2x10"),
    ]
    bars = _dashboard_query("MONITOR", "panel 'Evictions by replica group' A")
    marks = _dashboard_query("OVERVIEW", "annotation 'Evictions'")

    def rows(*groups: tuple[str, int]) -> list[dict]:
        return [{"labels": f'{{replica_group="{g}"}}', "value": v} for g, v in groups]

    tests = []
    for t, groups in ((67, [("1", 0), ("3", 1)]), (82, [("1", 0), ("3", 0), ("4", 2)]),
                      (127, [("3", 0), ("4", 0)]), (142, [("3", 0), ("4", 0)]),
                      (157, [("1", 0), ("2", 1), ("3", 0), ("4", 0)])):
        tests.append({"expr": bars, "eval_time": f"{t}s", "exp_samples": rows(*groups)})
        tests.append({"expr": marks, "eval_time": f"{t}s", "exp_samples": [
            {"labels": f'{{job="train", replica_group="{g}"}}', "value": v}
            for g, v in groups if v]})
    from dashboards import build
    from dashboards.validate import all_queries, substitute

    (q,) = [q for q in all_queries(build.build_dashboards())
            if q.where == "panel 'Decisions in the time range' A"]
    in_range = substitute(q.expr, {"job": "train"}, {"$__range": "1m", "$__range_s": "60"})
    for t, hold in ((100, 1), (180, 0)):
        tests.append({"expr": in_range, "eval_time": f"{t}s", "exp_samples": [
            {"labels": '{decision="evict", reason="confirmed"}', "value": 0},
            {"labels": '{decision="hold", reason="dry_run"}', "value": hold}]})
    _test_rules(tmp_path, "events across a scrape gap", series, tests)


def test_job_goodput_stats_aggregate_the_shards_not_the_best_one(tmp_path):
    """Sharded monitors each export their own slice's ledger (real MonitorMetrics fed a
    SweepAccount each): the job's goodput is their ratios weighted by their expected groups,
    its capacity their sum. A standby shard's stale copy and a leader candidate that owns no
    slice (NaN, 0 groups) count for nothing."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from monitor.api.metrics import MonitorMetrics
    from monitor.goodput.model import SweepAccount

    monitors = {"shard0:19400": (0.9, 2, False), "shard1:19400": (0.5, 3, False),
                "shard1-standby:19400": (0.1, 3, True), "leader:19400": (None, 0, False)}
    series = []
    for inst, (ratio, groups, standby) in monitors.items():
        m = MonitorMetrics("train")
        m.add_goodput(SweepAccount(accounted=ratio is not None, expected_groups=groups,
                                   job_goodput_ratio=ratio))
        m.shard_standby.labels("train").set(1 if standby else 0)
        text = generate_latest(m.registry).decode()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name not in ("lightkeeper_monitor_goodput_ratio",
                                  "lightkeeper_monitor_expected_replica_groups",
                                  "lightkeeper_monitor_shard_standby"):
                    continue
                labels = {**s.labels, "lightkeeper_component": "monitor", "instance": inst}
                sel = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                value = "NaN" if s.value != s.value else repr(float(s.value))
                series.append((f"{s.name}{{{sel}}}", " ".join([value] * 20)))
    assert len(series) == 12, series
    promtool_test(tmp_path, "the job's goodput over its shards", series, [
        (_query("Goodput since the ledger began"),
         [{"labels": "{}", "value": (0.9 * 2 + 0.5 * 3) / 5}]),
        (_query("Expected replica groups"), [{"labels": "{}", "value": 5}]),
    ], [])
