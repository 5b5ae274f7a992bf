"""Dashboard queries that add up the series of several monitors of one job (shards, a standby
shard, a leader candidate) count each rank, finding, setting and host once, and counts over a
range read whole events off the scrape grid; evaluated by promtool on real MonitorMetrics."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dashboards.build import build_dashboards
from dashboards.validate import all_queries, substitute
from dashboards.yamlout import dump
from monitor.api.metrics import MonitorMetrics
from monitor.evidence.lighthouse_settings import LighthouseSettingsWatch
from tests.test_dashboards_promtool import promtool

VARS = {"$__rate_interval": "1m", "$__interval": "15s"}


def _query(where: str, **extra: str) -> str:
    (q,) = [q for q in all_queries(build_dashboards()) if q.where == where]
    return substitute(q.expr, {"job": "train"}, {**VARS, **extra})


def _series(m: MonitorMetrics, instance: str, n: int = 20) -> list[dict]:
    """promtool input series of ``m``'s /metrics scraped from ``instance``, constant."""
    out = []
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = {**s.labels, "lightkeeper_component": "monitor", "instance": instance}
            sel = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            value = "NaN" if s.value != s.value else repr(float(s.value))
            out.append({"series": f"{s.name}{{{sel}}}", "values": " ".join([value] * n)})
    return out


def _check(tmp_path, series: list[dict], tests: list[dict], interval: str = "15s") -> None:
    doc = {"rule_files": [], "evaluation_interval": "15s", "tests": [{
        "name": "aggregation", "interval": interval, "input_series": series,
        "promql_expr_test": tests}]}
    (tmp_path / "t.yml").write_text(dump(doc))
    r = promtool("test", "rules", "t.yml", cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


def _one(value: float, **labels: str) -> list[dict]:
    return [{"labels": "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}",
             "value": value}]


def _shard(known: int, up: int, standby: bool, host: str) -> MonitorMetrics:
    m = MonitorMetrics("train")
    m.ranks_known.labels("train").set(known)
    m.ranks_up.labels("train").set(up)
    m.ranks_unreachable.labels("train").set(known - up)
    m.ranks_finished.labels("train").set(0)
    m.ranks_verified.labels("train").set(up)
    m.open_findings.labels("train", "dead").set(known - up)
    m.set_hosts({"quarantined": 1}, [{"host": host, "state": "quarantined"}])
    m.shard_standby.labels("train").set(1 if standby else 0)
    return m


def test_a_standby_shard_is_not_counted_again(tmp_path):
    """Shard 0 (4 ranks), shard 1 (6 ranks, one dead) and a standby for shard 1 that sees
    what shard 1 sees: the job has 10 ranks, not 16; one finding and one new finding a step,
    not two; each shard's quarantined host once."""
    series = (_series(_shard(4, 4, False, "h0"), "shard0:19400")
              + _series(_shard(6, 5, False, "h1"), "shard1:19400")
              + _series(_shard(6, 5, True, "h1"), "shard1-standby:19400"))
    for inst in ("shard1:19400", "shard1-standby:19400"):  # both confirm the dead rank's finding
        series.append({"series": f'lightkeeper_monitor_findings_total{{job="train", '
                                 f'instance="{inst}", kind="dead", replica_group="3"}}',
                       "values": "0 0 0 1x17"})
    at = "45s"  # the step that sees the finding
    tests = [{"expr": _query(where), "eval_time": at, "exp_samples": exp} for where, exp in (
        ("panel 'Ranks known' A", _one(10)),
        ("panel 'Ranks up' A", _one(9)),
        ("panel 'Ranks unreachable' A", _one(1)),
        ("panel 'Open findings' A", _one(1)),
        ("panel 'Ranks known / up / unreachable / finished / lost' A", _one(10)),
        ("panel 'Ranks known / up / unreachable / finished / lost' C", _one(1)),
        ("panel 'Ranks known / up / unreachable / finished / lost' D", _one(0)),
        ("panel 'Ranks verified / unverified by reason' A", _one(9)),
        ("panel 'Open findings by kind' A", [
            {"labels": f'{{kind="{k}"}}', "value": int(k == "dead")}
            for k in ("dead", "hang", "mismatch", "straggler")]),
        ("panel 'Findings by kind' A", _one(1, kind="dead")),
        ("panel 'Findings and evictions' A", _one(1, kind="dead")),
        ("panel 'Quarantined hosts' A", _one(2)),
    )]
    _check(tmp_path, series, tests)


def test_a_slow_setting_and_a_failing_host_count_once_whatever_the_monitors(tmp_path):
    """Every monitor of a sharded job (two shards and the leader) judges the one Lighthouse:
    one slow setting reads 1, not 3. A host whose action fails on two sinks is one host."""
    series = []
    for inst in ("shard0:19400", "shard1:19400", "lead:19400"):
        m = MonitorMetrics("train")
        watch = LighthouseSettingsWatch(declared_heartbeat_ms=5000, interval_s=1.0)
        watch.observe(None, 1000.0)
        watch.publish(m, "train")
        series += _series(m, inst)
    for sink in ("k8s", "webhook:ops"):
        series.append({"series": f'lightkeeper_monitor_host_action_failed{{job="train", '
                                 f'instance="shard0:19400", host="h1", sink="{sink}"}}',
                       "values": "1x20"})
    _check(tmp_path, series, [
        {"expr": _query("panel 'Slow Lighthouse settings' A"), "eval_time": "2m",
         "exp_samples": _one(1)},
        {"expr": _query("panel 'Hosts with a failing action' A"), "eval_time": "2m",
         "exp_samples": _one(1)}])
    # healthy: 0, not "no data"
    healthy = [s for s in series if "config_warnings" not in s["series"]
               and "host_action_failed" not in s["series"]]
    _check(tmp_path, healthy, [
        {"expr": _query("panel 'Slow Lighthouse settings' A"), "eval_time": "2m",
         "exp_samples": _one(0)},
        {"expr": _query("panel 'Hosts with a failing action' A"), "eval_time": "2m",
         "exp_samples": _one(0)}])


def test_decisions_in_the_time_range_are_whole_off_the_scrape_grid(tmp_path):
    """3 decisions within an hour scraped every 7 s, the range not on that grid: 3, not the
    3.01 increase() extrapolates."""
    series = [
        {"series": 'lightkeeper_monitor_dry_run{job="train", instance="mon:19400"}',
         "values": "0x550"},
        {"series": 'lightkeeper_monitor_eviction_decisions_total{job="train", '
                   'instance="mon:19400", decision="evict", reason="confirmed"}',
         "values": "5x250 6x100 7x100 8x100"},
    ]
    expr = _query("panel 'Decisions in the time range' A", **{"$__range": "1h",
                                                                "$__range_s": "3600"})
    _check(tmp_path, series, [{"expr": expr, "eval_time": "61m",
                               "exp_samples": _one(3, decision="evict", reason="confirmed")}],
           interval="7s")


def test_panel_texts_name_every_poll_error_reason_and_registration_outcome():
    from monitor.poll.admission import REFUSALS
    from monitor.poll.poller import REASONS

    panels = {p["title"]: p["description"] for d in build_dashboards().values()
              for p in d["panels"] if "description" in p}
    for reason in REASONS:
        assert reason in panels["Poll errors by reason"], reason
    for outcome in ("accepted", *REFUSALS.values()):
        assert outcome in panels["Rank registrations by outcome"], outcome
    # retried until done (no attempt cap): none told
    assert "attempts" not in panels["Failing host actions by sink"]


def _ledger(standby: bool, *hosts: str, state: str = "quarantined") -> MonitorMetrics:
    """A monitor whose host ledger holds ``hosts`` in ``state``, each's k8s cordon failing."""
    m = MonitorMetrics("train")
    m.shard_standby.labels("train").set(1 if standby else 0)
    m.set_hosts({"ok": 0, "suspect": 0, "quarantined": 0, "released": 0, state: len(hosts)},
                [{"host": h, "node": h, "state": state, "offences": [{"in_window": True}],
                  "actions": {"k8s": {"sink": "k8s", "status": "failed"}}} for h in hosts])
    return m


def test_every_host_panel_counts_a_host_once_whatever_the_ledgers_that_hold_it(tmp_path):
    """Host h1 quarantined, its cordon failing, in the ledgers of two shards (it runs groups of
    both slices), or only in a demoted holder's (standing by now, it keeps its ledger and acts
    as the holder does) beside a new holder that has not seen it, or quarantined in one shard's
    ledger and only suspect in the other's: one host in every panel, quarantined."""
    shapes = {
        "two shards": [(_ledger(False, "h1"), "shard0:19400"),
                       (_ledger(False, "h1"), "shard1:19400")],
        "a demoted holder": [(_ledger(True, "h1"), "old:19400"),
                             (_ledger(False), "new:19400")],
        "states differ": [(_ledger(False, "h1"), "shard0:19400"),
                          (_ledger(False, "h1", state="suspect"), "shard1:19400")],
    }
    j = {"job": "train"}
    for monitors in shapes.values():
        series = [s for m, inst in monitors for s in _series(m, inst)]
        _check(tmp_path, series, [
            {"expr": _query(where), "eval_time": "2m", "exp_samples": exp}
            for where, exp in (
                ("panel 'Quarantined hosts' A", _one(1)),
                ("panel 'Hosts with a failing action' A", _one(1)),
                ("panel 'Hosts by state' A", [
                    {"labels": f'{{state="{s}"}}', "value": int(s == "quarantined")}
                    for s in ("back to ok", "quarantined", "released", "suspect")]),
                ("panel 'Failing host actions by sink' A", _one(1, sink="k8s")),
                ("panel 'Hosts not ok' A", _one(1, **j, host="h1", node="h1",
                                                state="quarantined")),
                ("panel 'Hosts not ok' C", _one(1, **j, host="h1", sink="k8s")))])


def test_goodput_per_replica_group_is_one_line_a_group_beside_a_standby(tmp_path):
    """A former holder standing by keeps its ratios, frozen: only the holder's line shows."""
    series = []
    for inst, standby, ratio in (("holder:19400", 0, "0.9"), ("old:19400", 1, "0.5")):
        series += [
            {"series": f'lightkeeper_monitor_shard_standby{{job="train", instance="{inst}"}}',
             "values": f"{standby}x20"},
            {"series": f'lightkeeper_monitor_replica_group_goodput_ratio{{job="train", '
                       f'instance="{inst}", replica_group="1"}}', "values": f"{ratio}x20"}]
    _check(tmp_path, series, [{
        "expr": _query("panel 'Goodput per replica group' A"), "eval_time": "2m",
        "exp_samples": _one(0.9, __name__="lightkeeper_monitor_replica_group_goodput_ratio",
                            job="train", instance="holder:19400", replica_group="1")}])


def test_decisions_in_the_time_range_count_those_before_a_monitor_restart(tmp_path):
    """3 decisions, the monitor restarted 12 minutes ago (its series gone, each at 1), a 4th
    since: 4 in the hour, not the 1 of the series alive now."""
    start = 'lightkeeper_monitor_start_time_seconds{job="train", instance="mon:19400"}'
    series = [
        {"series": 'lightkeeper_monitor_dry_run{job="train", instance="mon:19400"}',
         "values": "0x40 _x3 0x20"},
        {"series": start, "values": "0x40 _x3 2580x20"}]
    for reason, at in (("confirmed", 10), ("manual", 20), ("rail", 30)):
        series.append({"series": f'lightkeeper_monitor_eviction_decisions_total{{job="train", '
                                 f'instance="mon:19400", decision="evict", reason="{reason}"}}',
                       "values": f"_x{at} 1x{40 - at}"})
    series.append({"series": 'lightkeeper_monitor_eviction_decisions_total{job="train", '
                             'instance="mon:19400", decision="hold", reason="dry_run"}',
                   "values": "_x50 1x14"})
    expr = _query("panel 'Decisions in the time range' A", **{"$__range": "1h",
                                                                "$__range_s": "3600"})
    _check(tmp_path, series, [{"expr": expr, "eval_time": "52m", "exp_samples": [
        {"labels": '{decision="evict", reason="confirmed"}', "value": 1},
        {"labels": '{decision="evict", reason="manual"}', "value": 1},
        {"labels": '{decision="evict", reason="rail"}', "value": 1},
        {"labels": '{decision="hold", reason="dry_run"}', "value": 1}]}], interval="1m")


def test_decisions_in_the_time_range_count_across_restarts_and_replaced_monitors(tmp_path):
    """A monitor evicts group 1 three times, restarts (same instance: the series comes back
    at 1) and evicts it again: 4, not the 3 before the restart. A monitor started 20 minutes
    in decides twice and is replaced (a new instance) that decides once more: its 2 count,
    gone as it is."""
    series = []
    for inst, up in (("mon:19400", ("0x40 _x3 0x20", "0x40 _x3 2580x20")),
                     ("old:19400", ("_x20 0x20", "_x20 1200x20")),
                     ("new:19400", ("_x43 0x20", "_x43 2580x20"))):
        series += [{"series": f'lightkeeper_monitor_dry_run{{job="train", instance="{inst}"}}',
                    "values": up[0]},
                   {"series": f'lightkeeper_monitor_start_time_seconds{{job="train", '
                              f'instance="{inst}"}}', "values": up[1]}]
    for inst, reason, values in (("mon:19400", "straggler", "_x5 1x9 2x9 3x14 _x8 1x14"),
                                 ("old:19400", "confirmed", "_x25 1x15"),
                                 ("old:19400", "rail", "_x31 1x9"),
                                 ("new:19400", "confirmed", "_x50 1x13")):
        series.append({"series": f'lightkeeper_monitor_eviction_decisions_total{{job="train", '
                                 f'instance="{inst}", decision="evict", reason="{reason}"}}',
                       "values": values})
    expr = _query("panel 'Decisions in the time range' A", **{"$__range": "1h",
                                                                "$__range_s": "3600"})
    _check(tmp_path, series, [{"expr": expr, "eval_time": "60m", "exp_samples": [
        {"labels": '{decision="evict", reason="confirmed"}', "value": 2},
        {"labels": '{decision="evict", reason="rail"}', "value": 1},
        {"labels": '{decision="evict", reason="straggler"}', "value": 4}]}], interval="1m")


def _decisions_in_range(tmp_path, interval: str, dry_run: str, start: str, decisions: str,
                        eval_time: str, count: int) -> None:
    """One monitor's evict decisions (``decisions``, its series values) over the hour."""
    inst = 'job="train", instance="mon:19400"'
    series = [{"series": f"lightkeeper_monitor_dry_run{{{inst}}}", "values": dry_run},
              {"series": f"lightkeeper_monitor_start_time_seconds{{{inst}}}", "values": start},
              {"series": f'lightkeeper_monitor_eviction_decisions_total{{{inst}, '
                         'decision="evict", reason="confirmed"}', "values": decisions}]
    expr = _query("panel 'Decisions in the time range' A", **{"$__range": "1h",
                                                                "$__range_s": "3600"})
    _check(tmp_path, series, [{"expr": expr, "eval_time": eval_time,
                               "exp_samples": _one(count, decision="evict", reason="confirmed")}],
           interval=interval)


def test_decisions_in_the_time_range_are_not_extrapolated_across_a_restart(tmp_path):
    """2 decisions, the monitor restarted 30 s later (its series back at 1 with a 3rd): 3, at
    15 s and at 1 m scrapes; the first life's few samples must not stretch to the range's
    start."""
    _decisions_in_range(tmp_path, "15s", "0x9 _x4 0x15", "0x9 _x4 210x15",
                        "_x4 1 2 _x14 1x5", "5m", 3)
    _decisions_in_range(tmp_path, "1m", "0x2 _ 0x5", "0x2 _ 240x5", "_ 1 2 _x2 1x4", "5m", 3)


def test_decisions_in_the_time_range_count_a_first_life_from_its_first_value(tmp_path):
    """First scraped at 2 decisions, a 3rd, the monitor restarted, a 4th: 4, not the least
    value of both lives (1) plus the increments."""
    _decisions_in_range(tmp_path, "1m", "0x5 _x2 0x6", "0x5 _x2 450x6",
                        "_ 2x2 3x2 _x3 1x5", "12m", 4)
    _decisions_in_range(tmp_path, "15s", "0x20 _x4 0x20", "0x20 _x4 375x20",
                        "_x4 2x4 3x8 _x8 1x8", "10m", 4)


def test_a_leader_standing_by_for_its_shard_shows_the_kills_it_sends(tmp_path):
    """Two monitors ``--shard 0/2 --lead``: the one standing by for slice 0 won the election
    and sends the job's kills. Only a sender counts a kill, so its evictions are no standby
    copy: both eviction panels show them, as the alert and the annotations do."""
    sender, holder = MonitorMetrics("train"), MonitorMetrics("train")
    for m, standby in ((sender, 1), (holder, 0)):
        m.dry_run.labels("train").set(0)  # as the monitor sets them at its start
        m.start_time.labels("train").set(-1000)
        m.shard_standby.labels("train").set(standby)
        m.shard_leading.labels("train").set(standby)
    sender.evictions.labels("train", "2").inc()
    series = _series(holder, "holder:19400")
    for s in _series(sender, "lead:19400"):
        if s["series"].startswith("lightkeeper_monitor_evictions_total"):
            s["values"] = "_x3 1x17"  # the kill sent at 45 s
        series.append(s)
    at = "45s"
    _check(tmp_path, series, [{"expr": _query(where), "eval_time": at, "exp_samples": exp}
                              for where, exp in (
        ("panel 'Findings and evictions' B", _one(1, replica_group="2")),
        ("panel 'Evictions by replica group' A", _one(1, replica_group="2")),
    )])


def test_groups_in_the_quorum_show_a_stuck_starting_group_whatever_its_shard(tmp_path):
    """Two shards: group 0 in the quorum, group 1 out and named stuck_starting, group 2 out
    (dead, say), group 3 stuck before any quorum (unverified: no in_quorum series): 1, -1
    ("stuck starting"), 0, -1."""
    mon = 'job="train", lightkeeper_component="monitor"'
    series = [{"series": f'lightkeeper_monitor_replica_group_{name}{{{mon}, instance="{i}", '
                         f'replica_group="{g}"}}', "values": f"{v}x20"}
              for i, name, g, v in (("a:1", "in_quorum", 0, 1), ("a:1", "in_quorum", 1, 0),
                                    ("a:1", "stuck_starting", 0, 0),
                                    ("a:1", "stuck_starting", 1, 1),
                                    ("b:1", "in_quorum", 2, 0), ("b:1", "stuck_starting", 2, 0),
                                    ("b:1", "stuck_starting", 3, 1))]
    _check(tmp_path, series, [{
        "expr": _query("panel 'Replica groups in the quorum (monitor)' A"), "eval_time": "2m",
        "exp_samples": [{"labels": f'{{replica_group="{g}"}}', "value": v}
                        for g, v in ((0, 1), (1, -1), (2, 0), (3, -1))]}])
