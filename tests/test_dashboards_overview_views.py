"""The Job overview's quorum stats, relative compute time and host states where a plain read
of the ranks' or the ledgers' series misleads: a hung group that still says it takes part, a
stalled group's 0/0 compute, a ledger's ok hosts. Evaluated by promtool."""

from __future__ import annotations

from dashboards.rule_model import RESTARTED
from monitor.api.metrics import MonitorMetrics
from tests.test_dashboards_aggregation import _check, _one, _query, _series

RANK = 'job="train", lightkeeper_component="worker"'
MON = 'job="train", lightkeeper_component="monitor", instance="mon:19400"'


def _rank(g: int, metric: str, values: str) -> dict:
    return {"series": f'{metric}{{{RANK}, instance="w{g}:9000", replica_group="{g}", '
                      f'rank="{g}"}}', "values": values}


def _ranks(hung_quorum: bool) -> list[dict]:
    """Groups 0 and 1 in quorum 6 of 2; group 2's rank (hung, or a third member) still says
    it takes part in quorum 5 of 3, or in quorum 6 of 3."""
    out = []
    for g in range(3):
        quorum, n = (5, 3) if g == 2 and hung_quorum else (6, 2 if hung_quorum else 3)
        out += [_rank(g, "lightkeeper_participating", "1x20"),
                _rank(g, "lightkeeper_quorum_id", f"{quorum}x20"),
                _rank(g, "lightkeeper_quorum_participants", f"{n}x20")]
    return out


def _quorum_tests(in_q: int, out_q: int, participants: int, timeline: list[int]) -> list[dict]:
    return [{"expr": _query(where), "eval_time": "2m", "exp_samples": exp} for where, exp in (
        ("panel 'Replica groups in quorum' A", _one(in_q)),
        ("panel 'Replica groups out of quorum' A", _one(out_q)),
        ("panel 'Quorum participants' A", _one(participants)),
        ("panel 'Quorum id and participants over time' B", _one(participants)),
        ("panel 'Replica groups in and out of the quorum' A",
         [{"labels": f'{{replica_group="{g}"}}', "value": v} for g, v in enumerate(timeline)]))]


def test_a_hung_group_the_monitor_sees_out_of_the_quorum_is_out_in_every_quorum_stat(tmp_path):
    """Group 2 hung: the others formed quorum 6 without it, its rank still says it takes part
    in quorum 5 of 3; the monitor sees it out of the newest quorum. In 2, out 1, 2 participants,
    red on the timeline: the stats agree with each other and with the monitor."""
    monitor = [{"series": f'lightkeeper_monitor_replica_group_in_quorum{{{MON}, '
                          f'replica_group="{g}"}}', "values": f"{int(g != 2)}x20"}
               for g in range(3)]
    _check(tmp_path, _ranks(True) + monitor, _quorum_tests(2, 1, 2, [1, 1, 0]))


def test_without_a_monitor_the_quorum_stats_are_the_ranks_word(tmp_path):
    _check(tmp_path, _ranks(False), _quorum_tests(3, 0, 3, [1, 1, 1]))


def test_a_stalled_groups_nan_compute_is_left_out_of_the_median(tmp_path):
    """4 groups, 2 stalled (counters frozen: 0/0 a step); group 1 computes 4x group 0: the
    median is that of the groups that computed, so group 1 reads 1.6 and group 0 0.4."""
    series = []
    for g, (count, total) in enumerate((("0+10x20", "0+1x20"), ("0+10x20", "0+4x20"),
                                        ("50x20", "5x20"), ("50x20", "5x20"))):
        series += [_rank(g, "lightkeeper_step_compute_seconds_count", count),
                   _rank(g, "lightkeeper_step_compute_seconds_sum", total)]
    relative = _query("panel 'Relative compute time' A")
    # NaN compares false: the stalled groups drop out of the comparison
    _check(tmp_path, series, [{
        "expr": f"({relative}) >= 0", "eval_time": "4m",
        "exp_samples": [{"labels": f'{{job="train", replica_group="{g}"}}', "value": v}
                        for g, v in ((0, 0.4), (1, 1.6))]}])


def test_a_straggler_restarted_at_pace_reads_its_new_ranks_pace(tmp_path):
    """Group 1 computed 3x the others, was evicted (its rank's series marked stale) and
    restarted as another instance at pace: the old series' last slow steps, still in the
    rate's window, are not its compute (they read it 3x for a minute more)."""
    relative = _query("panel 'Relative compute time' A")
    _check(tmp_path, [{"series": s, "values": v} for s, v in RESTARTED], [{
        "expr": relative, "eval_time": "3m30s",
        "exp_samples": [{"labels": f'{{job="train", replica_group="{g}"}}', "value": 1}
                        for g in range(3)]}])


def test_hosts_by_state_names_the_ledgers_ok_hosts_back_to_ok(tmp_path):
    """A ledger's ok hosts offended before (a healthy host is in no ledger): host h1 released
    and past the quarantine window reads 1 back to ok, and no line says a healthy host is
    ok."""
    m = MonitorMetrics("train")
    m.set_hosts({"ok": 1, "suspect": 0, "quarantined": 0, "released": 0},
                [{"host": "h1", "node": "h1", "state": "ok"}])
    _check(tmp_path, _series(m, "mon:19400"), [{
        "expr": _query("panel 'Hosts by state' A"), "eval_time": "2m", "exp_samples": [
            {"labels": f'{{state="{s}"}}', "value": int(s == "back to ok")}
            for s in ("back to ok", "quarantined", "released", "suspect")]}])
