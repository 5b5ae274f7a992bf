"""Lightkeeper's recording and alerting rules, as data, each alert with the promtool cases in
which it fires and stays silent (rendered by dashboards/rules.py)."""

from __future__ import annotations

from .promql import RANK_HEALS, RANK_HEALS_EXPR, live
from .rule_model import M2, NEVER_SWEPT, RESTARTED, Alert, Case, M, Record, W, _worker, blip, grown

_STUCK = "lightkeeper_monitor_replica_group_stuck_starting"
_IN_Q = "lightkeeper_monitor_replica_group_in_quorum"

RECORDS = [
    Record("lightkeeper:replica_group_step_seconds:mean1m",
           "sum by (job, replica_group) (rate(lightkeeper_step_duration_seconds_sum[1m]))\n"
           "  / sum by (job, replica_group) (rate(lightkeeper_step_duration_seconds_count[1m]))"),
    # A straggler is the group the others wait for: its compute a step (step time less the
    # waits) stands out, while every group's step time stretches alike (docs/dashboards.md).
    # Live series only: a restarted rank's old series, stale, keeps its last steps in the window;
    # a failed scrape's staleness marker must not drop a group (that resets the alert's for).
    Record("lightkeeper:replica_group_compute_seconds:max1m",
           "max by (job, replica_group) (\n"
           "  rate(lightkeeper_step_compute_seconds_sum[1m])\n"
           "  / rate(lightkeeper_step_compute_seconds_count[1m])\n"
           f"  and {live('lightkeeper_step_compute_seconds_count')})"),
    Record("lightkeeper:replica_group_compute_seconds:relative1m",
           "lightkeeper:replica_group_compute_seconds:max1m\n"
           "  / on (job) group_left\n"
           # a group that computed no step in the minute reads 0/0: NaN sorts first in a
           # quantile, so it is left out (>= 0) rather than skew the median
           "quantile by (job) (0.5, lightkeeper:replica_group_compute_seconds:max1m >= 0)"),
    Record("lightkeeper:replica_group_commits:rate1m",
           "max by (job, replica_group) (rate(lightkeeper_commits_total[1m]))"),
    Record("lightkeeper:job_step:max", "max by (job) (lightkeeper_step)"),
    Record(RANK_HEALS, RANK_HEALS_EXPR),
]

ALERTS = [
    Alert(
        "LightkeeperRankDown",
        'up{lightkeeper_component="worker"} == 0', "1m", "critical",
        # a pod scraped whole (Kubernetes) has no rank or group label: the instance names it
        "{{ with $labels.rank }}Rank {{ . }} (replica group {{ $labels.replica_group }}){{ else }}"
        "WorkerServer {{ $labels.instance }}{{ end }} of job {{ $labels.job }} is down",
        "Prometheus has not been able to scrape the WorkerServer at {{ $labels.instance }} for "
        "1 minute: the rank's process is dead, hung hard, or its host is unreachable.",
        "Open the Job overview dashboard; check the rank's process and host; "
        "curl http://{{ $labels.instance }}/healthz; torchft carries on without the replica "
        "group, so restart it and it rejoins and heals from a peer.",
        [Case("rank 1 stops answering",
              [(f'up{{{_worker(0)}}}', "1x20"), (f'up{{{_worker(1)}}}', "1 1 1 1 0x16")],
              "3m", [{"instance": "w1:9000", "job": "train", "lightkeeper_component": "worker",
                      "replica_group": "1", "rank": "1", "group_rank": "0"}]),
         Case("a pod scraped whole (no rank label) stops answering",
              [(f'up{{{W}, instance="10.0.0.5:9000"}}', "1 1 1 1 0x16")],
              "3m", [{"instance": "10.0.0.5:9000", "job": "train",
                      "lightkeeper_component": "worker"}]),
         Case("all ranks up", [(f'up{{{_worker(0)}}}', "1x20"), (f'up{{{_worker(1)}}}', "1x20")],
              "3m")]),
    Alert(
        "LightkeeperRanksUnreachable",
        "max by (job) (lightkeeper_monitor_ranks_unreachable) > 0", "2m", "warning",
        "The Lightkeeper monitor cannot reach ranks of job {{ $labels.job }}",
        "At least one rank has not answered the monitor's polls for 2 minutes.",
        "Open the Monitor health dashboard (poll errors by reason) and the monitor's "
        "/v1/cluster; a rank that stays unreachable is dead or hung: check its process, or "
        "let the monitor evict its replica group.",
        [Case("one rank unreachable",
              [(f"lightkeeper_monitor_ranks_unreachable{{{M}}}", "0 0 1x20")], "4m",
              [{"job": "train"}]),
         Case("all reachable", [(f"lightkeeper_monitor_ranks_unreachable{{{M}}}", "0x20")],
              "4m")]),
    Alert(
        "LightkeeperRanksLost",
        "sum by (job) (increase(lightkeeper_monitor_ranks_lost_total[10m])) > 0", "0m",
        "warning",
        "Ranks of job {{ $labels.job }} went away without saying they stopped",
        "In the last 10 minutes the monitor dropped self-registered ranks that stopped answering "
        "without saying they stopped (--forget-after): while other ranks still answered, or "
        "all at once with no rank saying the job ended and the Lighthouse no longer hearing "
        "them (a job-wide crash). "
        "Prometheus stops scraping a dropped rank, so LightkeeperRankDown cannot see it: its "
        "replica group trains no more until it is restarted.",
        "The monitor's log ('forgot ... lost while the job goes on', or 'lost: no rank "
        "answers') names each rank; its "
        "/v1/findings and /v1/evictions say whether the group was evicted. Check that the "
        "scheduler restarts the group (it rejoins and heals from a peer); else restart it.",
        [Case("a rank lost",
              [(f"lightkeeper_monitor_ranks_lost_total{{{M}}}", "0 0 0 1x20")], "5m",
              [{"job": "train"}], interval="1m"),
         Case("none lost for over 10 minutes",
              [(f"lightkeeper_monitor_ranks_lost_total{{{M}}}", "1x20")], "15m",
              interval="1m")]),
    Alert(
        "LightkeeperReplicaGroupStraggling",
        "max by (job, replica_group) (\n"
        "  lightkeeper:replica_group_compute_seconds:relative1m\n"
        ") > 1.5", "2m", "warning",
        "Replica group {{ $labels.replica_group }} of job {{ $labels.job }} is straggling",
        "Its slowest rank has computed more than 1.5x the median over replica groups a step for "
        "2 minutes (step time less the waits in collectives): the other groups wait for it.",
        "Open the drill-down dashboard for replica group {{ $labels.replica_group }}: compare "
        "compute and waits per rank, follow the Python stacks link of the rank that computes "
        "longest; if it does not recover, evict it (the monitor does when not in dry run).",
        [Case("group 2 computes 3x longer a step",
              [(f"lightkeeper_step_compute_seconds_count{{{_worker(g)}}}", "0+10x20")
               for g in range(3)]
              + [(f"lightkeeper_step_compute_seconds_sum{{{_worker(g)}}}", "0+1x20")
                 for g in range(2)]
              + [(f"lightkeeper_step_compute_seconds_sum{{{_worker(2)}}}", "0+3x20")],
              "4m", [{"job": "train", "replica_group": "2"}]),
         Case("group 1 is slow, so the others' step times stretch: only group 1 computes long",
              [(f"lightkeeper_step_compute_seconds_count{{{_worker(g)}}}", "0+10x20")
               for g in range(3)]
              + [(f"lightkeeper_step_compute_seconds_sum{{{_worker(g)}}}", s)
                 for g, s in ((0, "0+0.5x20"), (1, "0+3x20"), (2, "0+0.5x20"))]
              + [(f"lightkeeper_step_duration_seconds_count{{{_worker(g)}}}", "0+10x20")
                 for g in range(3)]
              + [(f"lightkeeper_step_duration_seconds_sum{{{_worker(g)}}}", s)
                 for g, s in ((0, "0+3x20"), (1, "0+0.1x20"), (2, "0+3x20"))],
              "4m", [{"job": "train", "replica_group": "1"}]),
         Case("groups 2 and 3 stalled (0/0 a step), group 1 computes 4x group 0",
              [(f"lightkeeper_step_compute_seconds_count{{{_worker(g)}}}", v)
               for g, v in ((0, "0+10x20"), (1, "0+10x20"), (2, "50x20"), (3, "50x20"))]
              + [(f"lightkeeper_step_compute_seconds_sum{{{_worker(g)}}}", v)
                 for g, v in ((0, "0+1x20"), (1, "0+4x20"), (2, "5x20"), (3, "5x20"))],
              "4m", [{"job": "train", "replica_group": "1"}]),
         Case("all groups compute alike",
              [(f"lightkeeper_step_compute_seconds_count{{{_worker(g)}}}", "0+10x20")
               for g in range(3)]
              + [(f"lightkeeper_step_compute_seconds_sum{{{_worker(g)}}}", "0+1x20")
                 for g in range(3)],
              "4m"),
         # at 3m45s: rule groups run apart, so the alert may read the 3m15s record (the old
         # series live until 30 s after its last sample); 3m30s's record is checked alone
         Case("group 1 evicted and restarted at pace: its old rank's last slow steps",
              RESTARTED, "3m45s"),
         # a failed scrape must not drop a group for an evaluation (resetting the for)
         Case("group 2 computes 2x, its rank's scrape failed once at 3m", blip(2, 2), "4m",
              [{"job": "train", "replica_group": "2"}]),
         Case("group 2 computes 2x, group 0's rank's scrape failed once at 3m", blip(2, 0),
              "4m", [{"job": "train", "replica_group": "2"}])]),
    Alert(
        "LightkeeperJobNoProgress",
        # every rank stopped: the job ended; every rank starting (before its first quorum,
        # loading a model) the last 2 minutes and for under 30: no page; a crash loop (every
        # group starting again and again) or a start hung that long pages
        "(max by (job) (increase(lightkeeper_commits_total[5m])) == 0)\n"
        "unless on (job)\n"
        '(min by (job) (lightkeeper_phase{phase="stopped"}) == 1)\n'
        "unless on (job)\n"
        '((min_over_time((min by (job) (lightkeeper_phase{phase="starting"}))[2m:15s]) == 1)\n'
        "  and on (job) (max by (job) (lightkeeper_phase_duration_seconds) < 1800))",
        "2m", "critical",
        "Job {{ $labels.job }} has committed no step for 7 minutes",
        "No rank of the job committed a step in the last 5 minutes (for 2 minutes), and the job "
        "has neither stopped nor has every rank been starting for the last 2 minutes (under "
        "30): it is hung, crash-looping, cannot form a quorum, or every step fails to commit.",
        "Open the Job overview (quorum, commit failures) and the drill-down's phase per rank: "
        "ranks stuck in allreduce point at a hang (follow the Flight Recorder links), ranks in "
        "quorum at the Lighthouse; evict or restart the replica group at fault.",
        [Case("commits stop",
              [(f"lightkeeper_commits_total{{{_worker(0)}}}", "0+10x10 100x30"),
               (f"lightkeeper_commits_total{{{_worker(1)}}}", "0+10x10 100x30"),
               (f'lightkeeper_phase{{{_worker(0)}, phase="stopped"}}', "0x40")],
              "10m", [{"job": "train"}]),
         Case("commits continue",
              [(f"lightkeeper_commits_total{{{_worker(0)}}}", "0+10x40"),
               (f"lightkeeper_commits_total{{{_worker(1)}}}", "0+10x40")], "10m"),
         Case("job finished (all ranks stopped)",
              [(f"lightkeeper_commits_total{{{_worker(0)}}}", "0+10x10 100x30"),
               (f'lightkeeper_phase{{{_worker(0)}, phase="stopped"}}', "0x10 1x30")],
              "10m"),
         Case("every rank still starting (loading its model)",
              [s for g in range(2) for s in (
                  (f"lightkeeper_commits_total{{{_worker(g)}}}", "0x40"),
                  (f'lightkeeper_phase{{{_worker(g)}, phase="starting"}}', "1x40"),
                  (f"lightkeeper_phase_duration_seconds{{{_worker(g)}}}", "0+15x40"))],
              "9m"),
         Case("every rank starting for over 30 minutes (hung before its first quorum)",
              [s for g in range(2) for s in (
                  (f"lightkeeper_commits_total{{{_worker(g)}}}", "0x40"),
                  (f'lightkeeper_phase{{{_worker(g)}, phase="starting"}}', "1x40"),
                  (f"lightkeeper_phase_duration_seconds{{{_worker(g)}}}", "0+60x40"))],
              "34m", [{"job": "train"}], interval="1m"),
         Case("every group crash-looping (starting 40 s of each 140 s, never committing)",
              [(f"lightkeeper_commits_total{{{_worker(0)}}}", "0x98"),
               (f'lightkeeper_phase{{{_worker(0)}, phase="starting"}}',
                " ".join(["1 1 0 0 0 0 0"] * 14)),
               (f"lightkeeper_phase_duration_seconds{{{_worker(0)}}}",
                " ".join(["0 20 0 20 40 60 80"] * 14))],
              "20m", [{"job": "train"}], interval="20s"),
         Case("one rank in its first quorum, which never completes",
              [(f"lightkeeper_commits_total{{{_worker(g)}}}", "0x40") for g in range(2)]
              + [(f'lightkeeper_phase{{{_worker(0)}, phase="starting"}}', "1x40"),
                 (f'lightkeeper_phase{{{_worker(1)}, phase="starting"}}', "0x40"),
                 (f'lightkeeper_phase{{{_worker(1)}, phase="quorum"}}', "1x40")],
              "9m", [{"job": "train"}])]),
    Alert(
        "LightkeeperEvictionsTooFrequent",
        f"sum by (job) (\n  {grown('lightkeeper_monitor_evictions_total', '1h')}\n) > 3",
        "0m", "warning",
        "The monitor of job {{ $labels.job }} evicts replica groups too often",
        "More than 3 eviction requests in the last hour: the cluster is unhealthy, or the "
        "monitor's thresholds are too tight.",
        "Look at the Monitor health dashboard (findings by kind, decisions): the same group "
        "evicted repeatedly points at a bad host; many groups at a job- or threshold-wide "
        "problem. Consider --dry-run while investigating.",
        [Case("an eviction every 2 minutes",
              [(f'lightkeeper_monitor_evictions_total{{{M}, replica_group="1"}}',
                "0 0 1 1 2 2 3 3 4 4 5 5")], "11m", [{"job": "train"}], interval="1m"),
         Case("4 evictions, the counter appearing with the first",
              [(f"lightkeeper_monitor_sweeps_total{{{M}}}", "0+60x100"),
               (f'lightkeeper_monitor_evictions_total{{{M}, replica_group="1"}}',
                "_x70 1 2 3 4 4 4")], "76m", [{"job": "train"}], interval="1m"),
         Case("one eviction",
              [(f'lightkeeper_monitor_evictions_total{{{M}, replica_group="1"}}',
                "0 0 0 1 1 1 1 1 1 1 1 1")], "11m", interval="1m"),
         # 7 s scrapes: the hour evaluated every 15 s is off their grid (one case for both
         # jobs: each case evaluates every rule for its 61 minutes)
         Case("off the scrape grid: job train's 3 evictions are not more than 3, other's 4 are",
              [(f'lightkeeper_monitor_evictions_total{{{M}, replica_group="1"}}',
                "5x250 6x100 7x100 8x100"),
               ('lightkeeper_monitor_evictions_total{job="other", instance="mon-o:19400", '
                'lightkeeper_component="monitor", replica_group="1"}',
                "5x250 6x100 7x100 8x50 9x50")], "61m", [{"job": "other"}], interval="7s"),
         Case("4 evictions of a monitor started 25 minutes ago",
              [(f"lightkeeper_monitor_sweeps_total{{{M}}}", "0+60x60"),
               (f"lightkeeper_monitor_start_time_seconds{{{M}}}", "0x60"),
               (f'lightkeeper_monitor_evictions_total{{{M}, replica_group="1"}}', "_x10 1x10 2x40"),
               (f'lightkeeper_monitor_evictions_total{{{M}, replica_group="2"}}',
                "_x15 1x10 2x35")], "30m", [{"job": "train"}], interval="1m"),
         Case("3 evictions, the monitor restarted 12 minutes ago, a 4th since",
              [(f"lightkeeper_monitor_sweeps_total{{{M}}}", "0+60x40 _x3 0+60x20"),
               (f"lightkeeper_monitor_start_time_seconds{{{M}}}", "0x40 _x3 2580x20")]
              + [(f'lightkeeper_monitor_evictions_total{{{M}, replica_group="{g}"}}',
                  f"_x{at} 1x{40 - at}") for g, at in ((1, 10), (2, 20), (3, 30))]
              + [(f'lightkeeper_monitor_evictions_total{{{M}, replica_group="4"}}', "_x50 1x14")],
              "52m", [{"job": "train"}], interval="1m"),
         Case("group 1 evicted 3 times, the monitor restarted (its series back), again",
              [(f"lightkeeper_monitor_sweeps_total{{{M}}}", "0+60x40 _x3 0+60x20"),
               (f"lightkeeper_monitor_start_time_seconds{{{M}}}", "0x40 _x3 2580x20"),
               (f'lightkeeper_monitor_evictions_total{{{M}, replica_group="1"}}',
                "_x5 1x9 2x9 3x14 _x8 1x14")], "60m", [{"job": "train"}], interval="1m"),
         Case("a monitor started 20 minutes ago evicts 3, replaced (new instance), 1 more",
              [(f"lightkeeper_monitor_sweeps_total{{{M}}}", "_x20 0+60x20"),
               (f"lightkeeper_monitor_start_time_seconds{{{M}}}", "_x20 1200x20"),
               (f"lightkeeper_monitor_sweeps_total{{{M2}}}", "_x43 0+60x20"),
               (f"lightkeeper_monitor_start_time_seconds{{{M2}}}", "_x43 2580x20")]
              + [(f'lightkeeper_monitor_evictions_total{{{M}, replica_group="{g}"}}',
                  f"_x{at} 1x{40 - at}") for g, at in ((1, 25), (2, 28), (3, 31))]
              + [(f'lightkeeper_monitor_evictions_total{{{M2}, replica_group="4"}}', "_x50 1x13")],
              "55m", [{"job": "train"}], interval="1m"),
         # a restart: the first life's few samples are not extrapolated to the hour's start
         Case("15 s scrapes: 2 evictions, the monitor restarted 30 s later, a 3rd since",
              [(f"lightkeeper_monitor_sweeps_total{{{M}}}", "0+15x9 _x4 0+15x15"),
               (f"lightkeeper_monitor_start_time_seconds{{{M}}}", "0x9 _x4 210x15"),
               (f'lightkeeper_monitor_evictions_total{{{M}, replica_group="1"}}',
                "_x4 1 2 _x14 1x5")], "5m"),
         Case("2 evictions, the monitor restarted, a 3rd since: not more than 3",
              [(f"lightkeeper_monitor_sweeps_total{{{M}}}", "0+60x2 _ 0+60x5"),
               (f"lightkeeper_monitor_start_time_seconds{{{M}}}", "0x2 _ 240x5"),
               (f'lightkeeper_monitor_evictions_total{{{M}, replica_group="1"}}',
                "_ 1 2 _x2 1x4")], "5m", interval="1m"),
         Case("15 s scrapes: 3 evictions, the monitor restarted 30 s later, a 4th since",
              [(f"lightkeeper_monitor_sweeps_total{{{M}}}", "0+15x9 _x4 0+15x15"),
               (f"lightkeeper_monitor_start_time_seconds{{{M}}}", "0x9 _x4 210x15"),
               (f'lightkeeper_monitor_evictions_total{{{M}, replica_group="1"}}',
                "_x4 1 2 3 _x13 1x5")], "6m", [{"job": "train"}]),
         # the first life counts from its first value, not from the least value of both lives
         Case("first scraped at 2 evictions, a 3rd, the monitor restarted, a 4th since",
              [(f"lightkeeper_monitor_sweeps_total{{{M}}}", "0+60x5 _x2 0+60x6"),
               (f"lightkeeper_monitor_start_time_seconds{{{M}}}", "0x5 _x2 450x6"),
               (f'lightkeeper_monitor_evictions_total{{{M}, replica_group="1"}}',
                "_ 2x2 3x2 _x3 1x5")], "12m", [{"job": "train"}], interval="1m"),
         Case("15 s scrapes: a new series' 3 evictions within 30 s",
              [(f"lightkeeper_monitor_sweeps_total{{{M}}}", "0+15x40"),
               (f"lightkeeper_monitor_start_time_seconds{{{M}}}", "0x40"),
               (f'lightkeeper_monitor_evictions_total{{{M}, replica_group="1"}}',
                "_x20 1 2 3x10")], "7m"),
         Case("15 s scrapes: a new series' 4 evictions within 45 s",
              [(f"lightkeeper_monitor_sweeps_total{{{M}}}", "0+15x40"),
               (f"lightkeeper_monitor_start_time_seconds{{{M}}}", "0x40"),
               (f'lightkeeper_monitor_evictions_total{{{M}, replica_group="1"}}',
                "_x20 1 2 3 4x10")], "7m", [{"job": "train"}]),
         # increase() extrapolated over the new series' 3 samples reads 2 increments as 3
         Case("a young monitor's 3 evictions within 2 minutes: not more than 3",
              [(f"lightkeeper_monitor_sweeps_total{{{M}}}", "0+60x60"),
               (f"lightkeeper_monitor_start_time_seconds{{{M}}}", "0x60"),
               (f'lightkeeper_monitor_evictions_total{{{M}, replica_group="1"}}',
                "_x50 1 2 3x8")], "52m", interval="1m"),
         Case("evictions long ago, Prometheus just restarted",
              [(f"lightkeeper_monitor_sweeps_total{{{M}}}", "1000+60x10"),
               (f"lightkeeper_monitor_start_time_seconds{{{M}}}", "-7200x10"),
               (f'lightkeeper_monitor_evictions_total{{{M}, replica_group="1"}}', "9x10")],
              "5m", interval="1m"),
         Case("Prometheus just restarted: a shard started 5 minutes ago, another long ago",
              [(f"lightkeeper_monitor_sweeps_total{{{M}}}", "1000+60x10"),
               (f"lightkeeper_monitor_start_time_seconds{{{M}}}", "-7200x10"),
               (f'lightkeeper_monitor_evictions_total{{{M}, replica_group="1"}}', "9x10"),
               (f"lightkeeper_monitor_sweeps_total{{{M2}}}", "0+60x10"),
               (f"lightkeeper_monitor_start_time_seconds{{{M2}}}", "0x10"),
               (f'lightkeeper_monitor_evictions_total{{{M2}, replica_group="2"}}', "1x10")],
              "5m", interval="1m")]),
    Alert(
        "LightkeeperEvictionsHeldBack",
        "sum by (job, reason) (\n  "
        # already_evicted: the finding still open the sweep after its own kill, every eviction
        + grown('lightkeeper_monitor_eviction_decisions_total{decision="hold", '
                'reason!="already_evicted"}', "15m")
        + "\n) > 0", "0m", "info",
        "The monitor of job {{ $labels.job }} held back evictions ({{ $labels.reason }})",
        "The monitor confirmed a finding that warrants eviction but did not evict "
        "(reason: {{ $labels.reason }}).",
        "Check the monitor's /v1/evictions and findings: if the finding is real, evict by "
        "hand (POST /v1/evict) or leave dry run; otherwise tune the monitor's thresholds.",
        [Case("held back in dry run",
              [(f'lightkeeper_monitor_eviction_decisions_total{{{M}, decision="hold", '
                f'reason="dry_run"}}', "0 0 1 1 1 1 1")], "5m",
              [{"job": "train", "reason": "dry_run"}], interval="1m"),
         Case("first hold (the counter appears at 1)",
              [(f"lightkeeper_monitor_sweeps_total{{{M}}}", "0+60x40"),
               (f'lightkeeper_monitor_eviction_decisions_total{{{M}, decision="hold", '
                f'reason="min_replicas"}}', "_x20 1x10")], "25m",
              [{"job": "train", "reason": "min_replicas"}], interval="1m"),
         Case("first hold of a monitor started 10 minutes ago",
              [(f"lightkeeper_monitor_sweeps_total{{{M}}}", "0+60x20"),
               (f"lightkeeper_monitor_start_time_seconds{{{M}}}", "0x20"),
               (f'lightkeeper_monitor_eviction_decisions_total{{{M}, decision="hold", '
                f'reason="dry_run"}}', "_x5 1x15")], "10m",
              [{"job": "train", "reason": "dry_run"}], interval="1m"),
         Case("an old hold, Prometheus just restarted",
              [(f"lightkeeper_monitor_sweeps_total{{{M}}}", "1000+60x10"),
               (f"lightkeeper_monitor_start_time_seconds{{{M}}}", "-7200x10"),
               (f'lightkeeper_monitor_eviction_decisions_total{{{M}, decision="hold", '
                f'reason="dry_run"}}', "1x10")], "5m", interval="1m"),
         Case("evictions carried out, each finding held the sweep after its kill",
              [(f'lightkeeper_monitor_eviction_decisions_total{{{M}, decision="evict", '
                f'reason="straggler"}}', "0 0 1 1 1 1 1"),
               (f'lightkeeper_monitor_eviction_decisions_total{{{M}, decision="hold", '
                f'reason="already_evicted"}}', "0 0 1 1 1 1 1")], "5m", interval="1m")]),
    Alert(
        "LightkeeperRankStuckInCollective",
        "(lightkeeper_phase_duration_seconds\n"
        '  * ignoring(phase) lightkeeper_phase{phase="allreduce"}) > 120', "1m", "warning",
        "Rank {{ $labels.rank }} of job {{ $labels.job }} has waited in allreduce for over 2 "
        "minutes",
        "Replica group {{ $labels.replica_group }}, rank {{ $labels.rank }} has a collective "
        "pending for more than 120 s: a peer is hung, dead or much slower.",
        "Open the drill-down for replica group {{ $labels.replica_group }} and follow the "
        "Flight Recorder link of each rank (or run lightkeeper analyze) to see which rank "
        "never joined the collective.",
        [Case("rank 1 stuck in allreduce",
              [(f"lightkeeper_phase_duration_seconds{{{_worker(1)}}}", "0+15x20"),
               (f'lightkeeper_phase{{{_worker(1)}, phase="allreduce"}}', "1x20")], "4m",
              [{"instance": "w1:9000", "job": "train", "lightkeeper_component": "worker",
                "replica_group": "1", "rank": "1", "group_rank": "0"}]),
         Case("long phase that is not a collective",
              [(f"lightkeeper_phase_duration_seconds{{{_worker(1)}}}", "0+15x20"),
               (f'lightkeeper_phase{{{_worker(1)}, phase="allreduce"}}', "0x20")], "4m")]),
    Alert(
        "LightkeeperReplicaGroupOutOfQuorum",
        # stuck_starting: out of the quorum for --starting-timeout already; a replaced or gone
        # group closes it (a normal eviction); every group starting: no page. Not in_quorum 0:
        # a dead or unreachable group is out too, and one never in a quorum is not verified
        "(max by (job, replica_group) (lightkeeper_monitor_replica_group_stuck_starting) == 1)\n"
        "and on (job)\n"
        "(max by (job) (lightkeeper_monitor_replica_group_in_quorum) == 1)", "5m", "warning",
        "Replica group {{ $labels.replica_group }} of job {{ $labels.job }} stays out of quorum",
        "The monitor's stuck_starting finding on replica group {{ $labels.replica_group }} has "
        "been open for 5 minutes while other groups train: the group has stayed out of the "
        "quorum for --starting-timeout (300 s by default) and more, hung past the others' "
        "process-group timeout (torchft went on without it) or never in a first quorum, and "
        "nothing ended it (dry run, stuck_starting not in --evict-on, a held eviction, no "
        "--rank-exit-token). It trains nothing and holds its hosts.",
        "GET /v1/findings on the monitor: the stuck_starting finding of group "
        "{{ $labels.replica_group }} (evidence shape left_out or no_first_quorum, each rank's "
        "why); follow the group's stacks and Flight Recorder links in the drill-down, then end "
        "its ranks (POST /v1/evict with --rank-exit-token set, or by hand) so the scheduler "
        "restarts it and it heals from a peer.",
        [Case("group 1 left out for 8 minutes, group 0 training, group 2 back after 2 minutes",
              [(f'{_STUCK}{{{M}, replica_group="1"}}', "0 1x40"),
               (f'{_STUCK}{{{M}, replica_group="2"}}', "0x40"),
               (f'{_IN_Q}{{{M}, replica_group="0"}}', "1x40"),
               (f'{_IN_Q}{{{M}, replica_group="1"}}', "0x40"),
               (f'{_IN_Q}{{{M}, replica_group="2"}}', "0x8 1x32")], "8m",
              [{"job": "train", "replica_group": "1"}]),
         # group 2 dead (static targets keep it listed) or unreachable: another alert's
         Case("group 1 stuck_starting, group 2 out of the quorum for another reason",
              [(f'{_STUCK}{{{M}, replica_group="1"}}', "0 1x40"),
               (f'{_STUCK}{{{M}, replica_group="2"}}', "0x40"),
               (f'lightkeeper_monitor_open_findings{{{M}, kind="stuck_starting"}}', "0 1x40"),
               (f'lightkeeper_monitor_open_findings{{{M}, kind="dead"}}', "0 1x40"),
               (f'{_IN_Q}{{{M}, replica_group="0"}}', "1x40"),
               (f'{_IN_Q}{{{M}, replica_group="1"}}', "0x40"),
               (f'{_IN_Q}{{{M}, replica_group="2"}}', "0x40")], "8m",
              [{"job": "train", "replica_group": "1"}]),
         Case("group 1 evicted and replaced 2 minutes after its finding",
              [(f'{_STUCK}{{{M}, replica_group="1"}}', "0 1x8 0x31"),
               (f'{_IN_Q}{{{M}, replica_group="0"}}', "1x40"),
               (f'{_IN_Q}{{{M}, replica_group="1"}}', "0x12 1x28")], "8m"),
         Case("every group still starting (no quorum yet)",
              [(f'{_STUCK}{{{M}, replica_group="1"}}', "0 1x40"),
               (f'{_IN_Q}{{{M}, replica_group="0"}}', "0x40"),
               (f'{_IN_Q}{{{M}, replica_group="1"}}', "0x40")], "8m")]),
    Alert(
        "LightkeeperHostQuarantined",
        'max by (job, host, node) (lightkeeper_monitor_host_quarantine_state{state="quarantined"})'
        " == 1", "0m", "warning",
        "Host {{ $labels.host }} (node {{ $labels.node }}) of job {{ $labels.job }} is "
        "quarantined",
        "The monitor's host ledger quarantined host {{ $labels.host }}: it offended (a hang, "
        "mismatch, dead rank, network fault or dead group, or a repeated straggler) within the "
        "quarantine window. Groups "
        "that come back on it are evicted; the sinks (--action) cordon or drain it.",
        "GET /v1/hosts on the monitor for the offences and their findings; check the host's "
        "hardware (GPU, NIC, memory); once repaired, POST /v1/hosts/{{ $labels.host }}/release "
        "(bearer token), else it expires after --quarantine-ttl.",
        [Case("host h1 quarantined",
              [(f'lightkeeper_monitor_host_quarantine_state{{{M}, host="h1", node="node-1", '
                f'state="suspect"}}', "1x4 stale"),
               (f'lightkeeper_monitor_host_quarantine_state{{{M}, host="h1", node="node-1", '
                f'state="quarantined"}}', "_x5 1x10")], "3m",
              [{"job": "train", "host": "h1", "node": "node-1"}]),
         Case("host h1 only suspect, h2 released",
              [(f'lightkeeper_monitor_host_quarantine_state{{{M}, host="h1", node="node-1", '
                f'state="suspect"}}', "1x20"),
               (f'lightkeeper_monitor_host_quarantine_state{{{M}, host="h2", node="node-2", '
                f'state="released"}}', "1x20"),
               (f'lightkeeper_monitor_hosts{{{M}, state="quarantined"}}', "0x20")], "3m")]),
    Alert(
        "LightkeeperQuarantineActionFailing",
        "max by (job, host, sink) (lightkeeper_monitor_host_action_failed) == 1", "2m",
        "warning",
        "The {{ $labels.sink }} action for host {{ $labels.host }} of job {{ $labels.job }} "
        "keeps failing",
        "The last quarantine or release action of host {{ $labels.host }} through sink "
        "{{ $labels.sink }} has failed or been retried for 2 minutes: the monitor decided, "
        "but the host is not cordoned, drained or released as decided.",
        "GET /v1/hosts on the monitor: last_action.detail says why (RBAC, a missing scontrol, "
        "a webhook answering 4xx/5xx) and the monitor's log has each attempt; fix the sink, "
        "then carry the action out by hand or release and let the ledger decide again.",
        [Case("k8s patch refused",
              [(f'lightkeeper_monitor_host_action_failed{{{M}, host="h1", sink="k8s"}}',
                "_x2 1x20")], "4m",
              [{"job": "train", "host": "h1", "sink": "k8s"}]),
         Case("a retry that succeeded within a minute",
              [(f'lightkeeper_monitor_host_action_failed{{{M}, host="h1", sink="webhook"}}',
                "_x2 1x4 stale")], "4m")]),
    Alert(
        "LightkeeperShardCannotAct",
        "max by (job, instance, role) (lightkeeper_monitor_shard_etcd_up) == 0", "1m",
        "warning",
        "A sharded monitor of job {{ $labels.job }} cannot reach etcd ({{ $labels.role }})",
        "The {{ $labels.role }} at {{ $labels.instance }} has had no answer from etcd for a "
        "minute: a shard proposes no eviction, a leader sends no kill. Findings are still "
        "confirmed and shown, but none is acted on.",
        "GET /v1/cluster on that monitor (shard.error, shard.leader_error) and its log say "
        "what etcd answered; check etcd's health and the --etcd URL.",
        [Case("a shard's etcd gone",
              [(f'lightkeeper_monitor_shard_etcd_up{{{M}, role="shard"}}', "1x2 0x10")], "3m",
              [{"job": "train", "instance": "mon:19400", "role": "shard"}]),
         Case("etcd back within a minute",
              [(f'lightkeeper_monitor_shard_etcd_up{{{M}, role="leader"}}', "1x2 0x2 1x10")],
              "3m")]),
    Alert(
        "LightkeeperShardNoLeader",
        "max by (job) (lightkeeper_monitor_shard_leading) == 0", "1m", "warning",
        "No leader candidate of job {{ $labels.job }} leads: no kill is sent",
        "Every --lead monitor of job {{ $labels.job }} has stood by for a minute: the shards' "
        "proposals wait, and no eviction is sent.",
        "GET /v1/cluster on the candidates (shard.leader, shard.leader_error): etcd "
        "unreachable, or the leader key held by a monitor that is gone (its lease ends after "
        "--lease-ttl).",
        [Case("both candidates standing by",
              [(f'lightkeeper_monitor_shard_leading{{{M}}}', "0x10"),
               ('lightkeeper_monitor_shard_leading{job="train", '
                'lightkeeper_component="monitor", instance="mon2:19400"}', "0x10")], "3m",
              [{"job": "train"}]),
         Case("one leads",
              [(f'lightkeeper_monitor_shard_leading{{{M}}}', "0x10"),
               ('lightkeeper_monitor_shard_leading{job="train", '
                'lightkeeper_component="monitor", instance="mon2:19400"}', "1x10")], "3m")]),
    Alert(
        "LightkeeperLighthouseSlowRecovery",
        "max by (job, setting) (lightkeeper_monitor_config_warnings) == 1", "1m", "info",
        "The Lighthouse of job {{ $labels.job }} makes recovery slow ({{ $labels.setting }})",
        "The monitor judges that a dead replica group stalls the survivors for more than 2 s "
        "(setting {{ $labels.setting }}): the Lighthouse's heartbeat timeout is long, the last "
        "eviction took long to leave the quorum, or the declared timeout is not what runs.",
        "Read docs/lighthouse.md (The monitor's warning) and the monitor's log line 'slow "
        "Lighthouse settings'; restart the Lighthouse with --heartbeat_timeout_ms 1000 "
        "(2000 on a busy or remote Lighthouse) and tell the monitor "
        "(--lighthouse-heartbeat-timeout-ms).",
        [Case("heartbeat timeout at torchft's default 5 s",
              [(f'lightkeeper_monitor_config_warnings{{{M}, setting="heartbeat_timeout"}}',
                "0 0 1x20"),
               (f'lightkeeper_monitor_config_warnings{{{M}, setting="eviction_drop"}}',
                "0x20")], "4m",
              [{"job": "train", "setting": "heartbeat_timeout"}]),
         Case("a warning that cleared within a minute",
              [(f'lightkeeper_monitor_config_warnings{{{M}, setting="eviction_drop"}}',
                "0 1 1 0x20"),
               (f'lightkeeper_monitor_config_warnings{{{M}, setting="heartbeat_timeout"}}',
                "0x20")], "4m")]),
    Alert(
        "LightkeeperJobSlowedWithoutCulprit",
        'max by (job) (lightkeeper_monitor_open_findings{kind=~"job_stall|job_slow"}) > 0',
        "2m", "warning",
        "Every replica group of job {{ $labels.job }} waits alike, and no host is to blame",
        "The monitor's job_stall or job_slow finding has been open for 2 minutes: every group "
        "is slowed or blocked in the same collectives and none is late. A network fault of one "
        "host is named by the probe mesh and evicted within seconds; one that lasts is the "
        "fabric's (every link alike), or one the probes cannot see. The monitor evicts nothing "
        "for it.",
        "GET /v1/cluster on the monitor: job_findings, and network_probes.last (the probe "
        "matrix): every link slow alike points at the fabric (a switch, a shared uplink), no "
        "round at all at ranks without the probe route; check the fabric's counters, then "
        "restart the job's groups elsewhere if it does not recover.",
        [Case("job_slow open for 3 minutes",
              [(f'lightkeeper_monitor_open_findings{{{M}, kind="job_slow"}}', "0 1x20"),
               (f'lightkeeper_monitor_open_findings{{{M}, kind="network"}}', "0x20")], "3m",
              [{"job": "train"}]),
         Case("a job stall that a named host explained within a minute",
              [(f'lightkeeper_monitor_open_findings{{{M}, kind="job_stall"}}', "0 1x3 0x20"),
               (f'lightkeeper_monitor_open_findings{{{M}, kind="network"}}', "0x3 1x2 0x20")],
              "3m")]),
    Alert(
        "LightkeeperMonitorDown",
        'up{lightkeeper_component="monitor"} == 0', "2m", "warning",
        "The Lightkeeper monitor at {{ $labels.instance }} is down",
        "Prometheus has not been able to scrape the monitor at {{ $labels.instance }} for 2 "
        "minutes: nothing detects or evicts bad replica groups meanwhile.",
        "Restart lightkeeper monitor (it rebuilds its view from the Lighthouse and the ranks' "
        "self-registration); check its log for the cause.",
        [Case("monitor gone", [(f"up{{{M}}}", "1 1 0x20")], "4m",
              [{"job": "train", "lightkeeper_component": "monitor", "instance": "mon:19400"}]),
         Case("monitor up", [(f"up{{{M}}}", "1x20")], "4m")]),
    Alert(
        "LightkeeperMonitorMissing",
        # a monitor pod Pending (its volume still held by a failed node) or deleted has no
        # target, so no up == 0 either; per job: one job's monitor hides no other's absence;
        # dry_run is exported from its start: one that never swept is NotSweeping's; a target
        # down is MonitorDown's; one up with no series of this job runs with another --job
        "count by (job) (lightkeeper_step)\n"
        "unless on (job) lightkeeper_monitor_dry_run\n"
        'unless on (job) (up{lightkeeper_component="monitor"} == 0)', "5m", "warning",
        "Ranks of job {{ $labels.job }} are scraped but no Lightkeeper monitor of it is",
        "Prometheus scrapes WorkerServers of job {{ $labels.job }} but has had no monitor series "
        "of that job for 5 minutes: nothing detects or evicts its bad replica groups meanwhile.",
        "Find the monitor: kubectl get pods -A -l app.kubernetes.io/component=monitor (a Pending "
        "pod waits for its volume or a node); else start lightkeeper monitor --job "
        "{{ $labels.job }} and check the monitor scrape job of prometheus.yml. Delete this rule "
        "where ranks run without one.",
        [Case("the monitor's target gone while ranks are scraped",
              [(f"lightkeeper_monitor_dry_run{{{M}}}", "0 0 stale"),
               (f"lightkeeper_step{{{_worker(0)}}}", "1x40")], "8m", [{"job": "train"}]),
         Case("another job's monitor scraped, not this job's",
              [(f"lightkeeper_monitor_dry_run{{{M}}}", "0x40"),
               (f"lightkeeper_step{{{_worker(0)}}}", "1x40"),
               ('lightkeeper_step{job="other", lightkeeper_component="worker", '
                'instance="o0:9000", replica_group="0", rank="0", group_rank="0"}', "1x40")],
              "8m", [{"job": "other"}]),
         Case("a monitor target up that exports another --job's series",
              [(f"up{{{M}}}", "1x40"),
               ('lightkeeper_monitor_dry_run{job="lightkeeper", lightkeeper_component="monitor", '
                'instance="mon:19400"}', "0x40"),
               (f"lightkeeper_step{{{_worker(0)}}}", "1x40")], "8m", [{"job": "train"}]),
         Case("monitor scraped", [(f"lightkeeper_monitor_dry_run{{{M}}}", "0x40"),
                                  (f"lightkeeper_step{{{_worker(0)}}}", "1x40")], "8m"),
         Case("a monitor scraped that never swept (LightkeeperMonitorNotSweeping's)",
              NEVER_SWEPT, "8m"),
         Case("the monitor's target down (LightkeeperMonitorDown's)",
              [(f"up{{{M}}}", "1x4 0x40"), (f"lightkeeper_monitor_dry_run{{{M}}}", "0x4 stale"),
               (f"lightkeeper_step{{{_worker(0)}}}", "1x40")], "8m"),
         Case("nothing scraped at all", [(f"up{{{M}}}", "stale")], "8m")]),
    Alert(
        "LightkeeperMonitorNotSweeping",
        # every good sweep counts, idle or a shard follower alike; a failed one does not, and
        # its /metrics keep the last good sweep's values, so no other alert can fire
        'up{lightkeeper_component="monitor"} == 1\n'
        "unless on (instance) increase(lightkeeper_monitor_sweeps_total[5m]) > 0", "2m",
        "critical",
        "The Lightkeeper monitor at {{ $labels.instance }} answers but does not sweep",
        "The monitor at {{ $labels.instance }} is scraped, but no sweep of it succeeded in the "
        "last 5 minutes: its view and metrics are frozen at the last good sweep, so it detects "
        "and evicts nothing and alerts on its metrics cannot fire.",
        "curl http://{{ $labels.instance }}/healthz (its last_error) and read the monitor's log "
        "('sweep failed: ...'): free space on the --state filesystem, or restart it with that "
        "line in a bug report.",
        [Case("sweeps stop while the monitor answers",
              [(f"up{{{M}}}", "1x40"),
               (f"lightkeeper_monitor_sweeps_total{{{M}}}", "0+12x10 120x30")], "10m",
              [{"job": "train", "lightkeeper_component": "monitor", "instance": "mon:19400"}]),
         Case("no sweep ever succeeded", NEVER_SWEPT, "8m",
              [{"job": "train", "lightkeeper_component": "monitor", "instance": "mon:19400"}]),
         Case("sweeping, restarted once",
              [(f"up{{{M}}}", "1x40"),
               (f"lightkeeper_monitor_sweeps_total{{{M}}}", "0+12x10 0+12x30")], "10m"),
         Case("the monitor down (LightkeeperMonitorDown's)",
              [(f"up{{{M}}}", "1x10 0x30"),
               (f"lightkeeper_monitor_sweeps_total{{{M}}}", "0+12x10 stale")], "10m")]),
    Alert(
        "LightkeeperMonitorOutOfFileDescriptors",
        'sum by (job) (increase(lightkeeper_monitor_poll_errors_total{reason="monitor"}[5m]))'
        " > 0", "1m", "warning",
        "The Lightkeeper monitor of job {{ $labels.job }} cannot ask some ranks: it is out of "
        "file descriptors, or its poller process died",
        "In the last 5 minutes the monitor could not poll some ranks for want of its own file "
        "descriptors, or lost a sweep's polls when its poller process died (poll errors with "
        "reason monitor): it knows nothing new of them and carries their last answers, so a "
        "fault there goes unseen.",
        "Raise the monitor's file descriptor limit to what its log line 'file descriptor "
        "limit' names (LimitNOFILE= in its systemd unit, ulimit -n, the container's nofile "
        "ulimit) and restart it; if the limit is already that high, something else in its "
        "process holds descriptors: its log has the limit it ran under. If its log says its "
        "poller process died instead, the next sweep starts a new one: look for why (memory).",
        [Case("connects failing with EMFILE",
              [(f'lightkeeper_monitor_poll_errors_total{{{M}, reason="monitor"}}',
                "0 0 0 40 80 120x20")], "3m", [{"job": "train"}]),
         Case("ranks timing out, the monitor fine",
              [(f'lightkeeper_monitor_poll_errors_total{{{M}, reason="monitor"}}', "0x20"),
               (f'lightkeeper_monitor_poll_errors_total{{{M}, reason="timeout"}}',
                "0 5 10 15 20x20")], "3m")]),
]
