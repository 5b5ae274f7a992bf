"""Live: a real Prometheus scrapes a real job and monitor; every dashboard query returns data.

The set-up is the one the README describes: the monitor writes a ``file_sd`` file from the
WorkerServers that register with it (``LIGHTKEEPER_MONITOR``), and Prometheus runs the shipped
configuration (``dashboards.promconfig``, pointed at the real paths and ports, 1 s scrapes) and
the shipped ``rules.yml`` (its groups evaluated every second: the recording rules' 15 s would
only make the test wait). The Debian ``prometheus`` binary is started on 127.0.0.1 with a
temporary storage directory and stopped by PID, like the Lighthouse, the trainers and the monitor.

Scenario: a Lighthouse and 2 replica groups train; once Prometheus has the monitor's Flight
Recorder analysis and the recording rules, replica group 1 is slowed (a fault posted to its
rank) until the monitor confirms it a straggler (report-only here: ``--evict-on hang``), then
evicted through the monitor's ``POST /v1/evict`` (the monitor asks the Lighthouse to kill it).
That gives the event panels (findings, evictions, decisions, poll errors, quorum changes) real
events. Each query is run as
Grafana would run it (instant for tables/stats, and annotations as range queries over the run);
a query passes once it has returned data.

Prometheus missing: skipped locally, a failure under CI (see tests/conftest.require_binary).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
import yaml

from dashboards.build import PROMETHEUS_DIR, build_dashboards
from dashboards.promconfig import render_prometheus_yml
from dashboards.rules import RECORDS
from dashboards.validate import Query, all_queries, metric_names, substitute
from lightkeeper.cluster import LocalCluster
from lightkeeper.processes import stop_process, wait_until
from tests.conftest import require_binary
from tests.support import prometheus

pytestmark = pytest.mark.e2e

TOKEN = "dashboards-live-test"
FAULT_TOKEN = "dashboards-live-faults"
JOB = "lightkeeper"
# What Grafana would send with every variable on "All" values of this job, 1 s scrapes.
VARIABLES = {"job": JOB, "replica_group": "(0|1)", "rank": "(0|1)"}
BUILTINS = {"$__rate_interval": "10s", "$__rate_interval_ms": "10000", "$__interval": "5s",
            "$__interval_ms": "5000",
            "$__range": "5m", "$__range_s": "300"}
DEADLINE_S = 45.0


@dataclass
class LiveRun:
    prom: prometheus.PrometheusServer
    monitor_url: str
    started: float
    queries: list[Query]
    data: dict[Query, int] = field(default_factory=dict)  # query -> most series seen
    errors: dict[Query, str] = field(default_factory=dict)
    variable_values: dict[str, set[str]] = field(default_factory=dict)
    eviction: dict = field(default_factory=dict)
    alerts_seen: list[dict] = field(default_factory=list)
    timeline: list[str] = field(default_factory=list)

    def missing(self) -> list[Query]:
        return [q for q in self.queries if not self.data.get(q)]

    def missing_expected(self) -> list[Query]:
        """Queries without data that this job can give data (not the host-not-ok ones)."""
        return [q for q in self.missing() if not _host_not_ok_only(q)]


def _run_queries(run: LiveRun) -> None:
    """Run every query once as Grafana would; remember which returned data."""
    now = time.time()
    for q in run.queries:
        expr = substitute(q.expr, VARIABLES, BUILTINS)
        try:
            if q.kind == "annotation":
                # Grafana runs annotation queries over the dashboard's time range
                result = run.prom.query_range(expr, run.started, now, 1.0)
            else:
                result = run.prom.query(expr)
        except prometheus.PrometheusError as e:
            run.errors[q] = str(e)
            continue
        run.data[q] = max(run.data.get(q, 0), len(result))
        if q.kind == "variable" and result:
            label = q.where.split()[-1]
            run.variable_values.setdefault(label, set()).update(
                r["metric"].get(label, "") for r in result)


def _start_monitor(workdir: Path, lighthouse: str) -> tuple[subprocess.Popen, str, Path]:
    sd_dir = workdir / "file_sd"
    log_path = workdir / "monitor.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "lightkeeper.cli", "monitor", "--lighthouse", lighthouse,
             "--port", "0", "--interval", "0.5", "--state", str(workdir / "monitor.sqlite"),
             "--sd-out", str(sd_dir / "lightkeeper.json"), "--token", TOKEN, "--job", JOB,
             "--min-replicas", "1", "--dead-sweeps", "2", "--fr-interval", "1",
             "--evict-on", "hang"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def url():
        if proc.poll() is not None:
            raise RuntimeError(f"monitor exited with {proc.returncode}: "
                               f"{log_path.read_text()[-3000:]}")
        m = re.search(r"monitor=(\S+)", log_path.read_text())
        return m.group(1) if m else None

    return proc, wait_until(url, 30, what="the monitor to listen"), sd_dir


def _rules_every_second(workdir: Path) -> Path:
    """The shipped rules.yml, every group evaluated each second (the expressions unchanged)."""
    rules = yaml.safe_load((PROMETHEUS_DIR / "rules.yml").read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
    path = workdir / "rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    return path


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    require_binary("prometheus")
    workdir = tmp_path_factory.mktemp("dashboards_live")
    t0 = time.monotonic()
    # heartbeat 1000 ms (docs/lighthouse.md): the survivor's quorum change (an annotation
    # waited for) comes once the evicted group's heartbeat expires; the default 5 s is waited out
    cluster = LocalCluster(workdir / "cluster", num_groups=2, steps=100000, step_pause_s=0.1,
                           job=JOB, heartbeat_timeout_ms=1000)
    monitor = prom = None
    try:
        lighthouse = cluster.start_lighthouse()
        monitor, monitor_url, sd_dir = _start_monitor(workdir, lighthouse)
        # the ranks register with the monitor, which lists them in its file_sd file
        cluster.extra_env.update(LIGHTKEEPER_MONITOR=monitor_url, LIGHTKEEPER_TOKEN=TOKEN,
                                 LIGHTKEEPER_FAULT_TOKEN=FAULT_TOKEN)
        for g in range(2):
            cluster.start_group(g)
        # Prometheus starts while the ranks import torch: it finds them through the file_sd
        # file once they register, and its rule evaluations are already running by then.
        config = workdir / "prometheus.yml"
        config.write_text(render_prometheus_yml(
            file_sd_files=[str(sd_dir / "*.json")],
            monitor_targets=[monitor_url.split("://", 1)[1]], monitor_job=JOB,
            rule_files=[str(_rules_every_second(workdir))], scrape_interval="1s"))
        prom = prometheus.start(config, workdir / "prometheus")
        run = LiveRun(prom, monitor_url, time.time(),
                      [q for q in all_queries(build_dashboards())])
        run.timeline.append(f"{time.monotonic() - t0:.1f}s Prometheus up at {prom.url}")
        for g in range(2):
            cluster.wait_for_workers(g)
        run.timeline.append(f"{time.monotonic() - t0:.1f}s WorkerServers up")
        prom.wait_for_targets(2, job="lightkeeper-workers", timeout=30)
        prom.wait_for_targets(1, job="lightkeeper-monitor", timeout=30)
        run.timeline.append(f"{time.monotonic() - t0:.1f}s all 3 targets scraped")

        # Phase 1: healthy job, until the monitor's FR analysis (arrival lag of both groups)
        # and the recording rules have reached Prometheus.
        def warmed_up():
            lag = prom.query("count(lightkeeper_monitor_replica_group_arrival_lag_seconds)")
            rel = prom.query("count(lightkeeper:replica_group_compute_seconds:relative1m)")
            # the queries after the check: the arrival lag's panel has data only until the
            # eviction below (one group has no lag), so it must be read once both groups have it
            _run_queries(run)
            return (lag and float(lag[0]["value"][1]) >= 2 and rel
                    and float(rel[0]["value"][1]) >= 2)

        wait_until(warmed_up, 40, interval=1.0, what="monitor analysis and recording rules")
        run.timeline.append(f"{time.monotonic() - t0:.1f}s warmed up")
        if os.environ.get("LIGHTKEEPER_DOCS_IMG"):  # longer healthy stretch for the pictures
            time.sleep(float(os.environ.get("LIGHTKEEPER_DOCS_BEFORE_S", "40")))

        # Phase 2: slow replica group 1 until the monitor finds it a straggler (a finding for
        # the event panels), then evict it through the monitor.
        for url in cluster.groups[1].worker_urls.values():
            requests.post(url + "/v1/faults", json={"spec": "slow:delay=0.5"}, timeout=5,
                          headers={"Authorization": f"Bearer {FAULT_TOKEN}"}).raise_for_status()
        wait_until(lambda: any(f["kind"] == "straggler" for f in requests.get(
            monitor_url + "/v1/findings", timeout=5).json()), 60, interval=0.5,
            what="group 1 found a straggler")
        run.timeline.append(f"{time.monotonic() - t0:.1f}s straggler found")
        r = requests.post(monitor_url + "/v1/evict", json={"replica_group": 1,
                                                            "reason": "dashboards live test"},
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        run.eviction = {"status": r.status_code, **r.json()}
        run.timeline.append(f"{time.monotonic() - t0:.1f}s evicted group 1: {r.status_code}")
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            _run_queries(run)
            seen = {(a["labels"]["alertname"], tuple(sorted(a["labels"].items())))
                    for a in run.alerts_seen}
            run.alerts_seen += [a for a in prom.api("alerts")["alerts"]
                                if (a["labels"]["alertname"], tuple(sorted(a["labels"].items())))
                                not in seen]
            # done once every query that can have data here has it (waiting for the
            # host-not-ok-only ones would wait out the whole deadline on every run)
            if not run.missing_expected() and any(
                    a["labels"]["alertname"] == "LightkeeperRankDown" for a in run.alerts_seen):
                break
            time.sleep(1.0)
        run.timeline.append(f"{time.monotonic() - t0:.1f}s done, {len(run.missing_expected())} "
                            "queries without data")
        print("\n".join(run.timeline))  # in the captured output of a failing test
        _maybe_render_docs(run)
        yield run
    finally:
        if prom is not None:
            prom.stop()
        try:
            cluster.stop()  # before the monitor: a SIGTERMed rank waits for its next read
        finally:
            if monitor is not None:
                stop_process(monitor)


def _maybe_render_docs(run: LiveRun) -> None:
    """With LIGHTKEEPER_DOCS_IMG=DIR, render each dashboard's panels from this run's data
    (docs/img: ``LIGHTKEEPER_DOCS_IMG=docs/img pytest tests/test_dashboards_live.py``)."""
    out = os.environ.get("LIGHTKEEPER_DOCS_IMG")
    if out:
        from dashboards.render import render_all

        time.sleep(float(os.environ.get("LIGHTKEEPER_DOCS_AFTER_S", "30")))
        render_all(run.prom.url, Path(out), start=run.started, end=time.time(),
                   variables=VARIABLES, builtins=BUILTINS)


def _report(run: LiveRun, queries: list[Query]) -> str:
    lines = [f"{q.dashboard}: {q.where}: {substitute(q.expr, VARIABLES, BUILTINS)}"
             + (f"  [error: {run.errors[q]}]" if q in run.errors else "") for q in queries]
    return "\n".join(["timeline:", *run.timeline, "no data:", *lines])


def _needs_monitor(q: Query) -> bool:
    return any(n.startswith("lightkeeper_monitor_") for n in metric_names(substitute(q.expr)))


# Series the monitor exports only for hosts that are not ok (docs/quarantine.md): this job's one
# host never offends, so queries reading nothing else have no data here. They are evaluated on
# series from the real host ledger in test_dashboards_promtool.py
# (test_host_and_lighthouse_panels_and_alerts_on_the_monitors_own_series).
HOST_NOT_OK_ONLY = {"lightkeeper_monitor_host_quarantine_state",
                    "lightkeeper_monitor_host_offences", "lightkeeper_monitor_host_action_failed",
                    # and only sharded monitors (--shard, --lead) export these: read in
                    # test_shard_panels_and_alerts_on_the_series_of_a_shard_and_a_leader_without_etcd
                    "lightkeeper_monitor_shard_etcd_up", "lightkeeper_monitor_shard_leading",
                    "lightkeeper_monitor_shard_standby"}


def _host_not_ok_only(q: Query) -> bool:
    names = metric_names(substitute(q.expr))
    return bool(names) and names <= HOST_NOT_OK_ONLY


def test_eviction_was_sent(live):
    assert live.eviction.get("decision") == "evict" and live.eviction.get("sent"), live.eviction


def test_worker_dashboard_queries_return_data(live):
    missing = [q for q in live.missing() if not _needs_monitor(q)]
    assert not missing, _report(live, missing)


def test_monitor_dashboard_queries_return_data(live):
    missing = [q for q in live.missing() if _needs_monitor(q) and not _host_not_ok_only(q)]
    assert not missing, _report(live, missing)
    # those left out still ran without an error
    errors = [q for q in live.queries if _host_not_ok_only(q) and q in live.errors]
    assert not errors, _report(live, errors)


def test_annotations_mark_the_eviction_finding_and_quorum_change(live):
    annotations = {q.where: live.data.get(q, 0) for q in live.queries if q.kind == "annotation"}
    assert annotations and all(annotations.values()), annotations


def test_variables_list_the_job_groups_and_ranks(live):
    assert JOB in live.variable_values.get("job", set())
    assert {"0", "1"} <= live.variable_values.get("replica_group", set())
    assert {"0", "1"} <= live.variable_values.get("rank", set())


def test_every_metric_the_dashboards_name_reached_prometheus(live):
    names = live.prom.metric_names()
    wanted = set().union(*(metric_names(substitute(q.expr)) for q in live.queries))
    assert wanted - HOST_NOT_OK_ONLY <= names, sorted(wanted - HOST_NOT_OK_ONLY - names)


def test_recording_rules_produce_data(live):
    for r in RECORDS:
        assert live.prom.query(r.record), f"recording rule {r.record} has no data"


def test_rank_down_alert_fires_for_the_evicted_rank(live):
    """The shipped rules plus the file_sd labels the monitor writes: the evicted rank's
    target goes down and LightkeeperRankDown becomes pending with its group and rank."""
    down = [a for a in live.alerts_seen if a["labels"]["alertname"] == "LightkeeperRankDown"]
    assert down, live.alerts_seen
    labels = down[0]["labels"]
    assert (labels["job"], labels["replica_group"], labels["rank"]) == (JOB, "1", "1")
    assert down[0]["annotations"]["summary"] == f"Rank 1 (replica group 1) of job {JOB} is down"
    assert down[0]["annotations"]["runbook"]


def test_pictures_render_from_the_live_data(live, tmp_path):
    """The renderer behind docs/img draws a dashboard with every panel kind (table, state
    timeline, stat, time series, heatmap) from this run, without a panel error."""
    from dashboards.render import render_all

    errors: list[str] = []
    paths = render_all(live.prom.url, tmp_path, start=live.started, end=time.time(),
                       variables=VARIABLES, builtins=BUILTINS, errors=errors,
                       only=["rank-drilldown.json"])
    assert not errors, errors
    assert [p.name for p in paths] == ["rank-drilldown.png"]
    assert paths[0].stat().st_size > 50_000


def test_the_heals_rule_records_every_real_rank_and_each_that_healed(live):
    """The heals recording rule joins the real ranks' heals and start time series by their
    labels: every rank scraped gets a record, and those that healed (a group that joined after
    the other began; none when both made the first quorum) a positive one (a series first seen
    at 1 is tests/test_dashboards_promtool.py's; 5 minutes cover the whole run)."""
    def ranks(expr: str) -> set[str]:
        return {r["metric"]["rank"] for r in live.prom.query(expr)}

    rule = "lightkeeper:rank_heals:growth15s"
    scraped = ranks(f'count_over_time(lightkeeper_heals_total{{job="{JOB}"}}[5m])')
    assert scraped == {"0", "1"}
    assert ranks(f'count_over_time({rule}{{job="{JOB}"}}[5m])') == scraped
    # the rule reads one evaluation late: a heal scraped just now is recorded a few seconds on
    healed = ranks(f'max_over_time(lightkeeper_heals_total{{job="{JOB}"}}[5m]) > 0')
    wait_until(lambda: ranks(f'max_over_time({rule}{{job="{JOB}"}}[5m]) > 0') == healed, 30,
               interval=1.0, what=f"the rule recording the heals of rank(s) {sorted(healed)}")
