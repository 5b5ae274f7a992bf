"""The ranks' counters on the dashboards (promtool over the queries the dashboards ship): each
event counts once across what Prometheus sees of a rank's processes, when a rank comes back
after minutes unscraped and when a container restarts in its pod (same address, same pid)."""

from __future__ import annotations

from dashboards.build import PROMETHEUS_DIR
from dashboards.yamlout import dump
from tests.test_dashboards_promtool import _dashboard_query, promtool

PANEL = "panel 'Commit failures, heals and quorum changes'"


def _labels(inst: str, group: str) -> str:
    return f'job="train", instance="{inst}", replica_group="{group}", rank="{group}"'


def _run(tmp_path, name: str, series: list[tuple[str, str]], exprs: list[str],
         expected: dict[int, float], group: str) -> None:
    """Each of ``exprs`` (summed by replica group) reads ``expected[t]`` at step ``t`` s."""
    tests = [{"expr": f"sum by (replica_group) ({e})", "eval_time": f"{t}s", "exp_samples": [
        {"labels": f'{{replica_group="{group}"}}', "value": v}]}
        for e in exprs for t, v in expected.items()]
    doc = {"rule_files": [str(PROMETHEUS_DIR / "rules.yml")], "evaluation_interval": "15s",
           "tests": [{"name": name, "interval": "15s", "promql_expr_test": tests,
                      "input_series": [{"series": s, "values": v} for s, v in series]}]}
    (tmp_path / "t.yml").write_text(dump(doc))
    r = promtool("test", "rules", "t.yml", cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


def test_a_rank_back_after_minutes_unscraped_counts_what_grew_meanwhile(tmp_path):
    """One process, scraped at 300 quorum changes, then not for over 6 minutes (its pod not
    Ready, its host partitioned): back at 301, the step that sees it counts 1, not 301."""
    lab = _labels("a:9000", "0")
    series = [(f"lightkeeper_quorum_changes_total{{{lab}}}", "300x10 _x24 301x5"),
              (f'lightkeeper_worker_info{{{lab}, pid="7", replica_id="g0:u1"}}',
               "1x10 _x24 1x5")]
    # samples at 0-150 s and from 525 s; steps 7 s after the scrapes
    _run(tmp_path, "back after a gap", series, [_dashboard_query("OVERVIEW", f"{PANEL} C")],
         {142: 0, 157: 0, 532: 1, 547: 0, 592: 0}, "0")


def test_a_container_restarted_in_its_pod_counts_its_first_heal(tmp_path):
    """On Kubernetes a restarted container keeps its pod's address and, in a fresh pid
    namespace, its pid; its Manager's replica id is new. The old process healed once; the new
    one heals before its first scrape and is first seen at 1: each heal counts once."""
    lab = _labels("trainer-1:9000", "1")
    series = [(f"lightkeeper_heals_total{{{lab}}}", "0x4 1x3 _x2 1x6")] + [
        (f'lightkeeper_worker_info{{{lab}, pid="1", replica_id="g1:{uuid}"}}', v)
        for uuid, v in (("u1", "1x8"), ("u2", "_x11 1x6"))]
    # the old process at 0-120 s (healed at 75 s), the new one from 165 s
    exprs = [_dashboard_query("OVERVIEW", f"{PANEL} B"),
             _dashboard_query("DRILLDOWN", "panel 'Commits, commit failures and heals per rank' C")]
    _run(tmp_path, "container restarted in its pod", series, exprs,
         {67: 0, 82: 1, 97: 0, 127: 0, 172: 1, 187: 0, 247: 0}, "1")
