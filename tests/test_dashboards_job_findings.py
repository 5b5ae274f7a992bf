"""A job-wide finding (``replica_group="job"``: job_stall, job_slow) that every shard finds over
its slice counts once on the findings panels and annotation, a group's finding once per group
(dashboards/promql.py finding_events; docs/dashboards.md); evaluated by promtool."""

from __future__ import annotations

from monitor.api.metrics import MonitorMetrics
from tests.test_dashboards_aggregation import _check, _one, _query, _series


def test_a_job_stall_every_shard_finds_counts_once_and_group_findings_add_up(tmp_path):
    """Shards 0 and 1 both confirm the job's stall at 45 s, and each a hang of one of its
    groups; shard 1's standby copies its counts. One job_stall, two hangs."""
    series = []
    for inst, standby in (("shard0:19400", 0), ("shard1:19400", 0), ("shard1-sb:19400", 1)):
        m = MonitorMetrics("train")
        m.shard_standby.labels("train").set(standby)
        series += _series(m, inst)
        for kind, group in (("job_stall", "job"), ("hang", inst[5])):
            series.append({"series": f'lightkeeper_monitor_findings_total{{job="train", '
                                     f'instance="{inst}", kind="{kind}", '
                                     f'replica_group="{group}"}}', "values": "0 0 0 1x17"})
    at = "45s"
    both = [{"labels": '{kind="hang"}', "value": 2}, {"labels": '{kind="job_stall"}', "value": 1}]
    _check(tmp_path, series, [{"expr": _query(where), "eval_time": at, "exp_samples": exp}
                              for where, exp in (
        ("panel 'Findings by kind' A", both),
        ("panel 'Findings and evictions' A", both),
        ("annotation 'Findings'", _one(1, job="train", kind="job_stall", replica_group="job")
         + _one(1, job="train", kind="hang", replica_group="0")
         + _one(1, job="train", kind="hang", replica_group="1")),
    )])
