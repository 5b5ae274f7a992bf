"""The promtool cases of Lightkeeper's alerts (dashboards/alerts.py), by alert name: the series
in which each alert fires and those in which it stays silent, rendered into rules_test.yml by
dashboards/rules.py."""

from __future__ import annotations

from .rule_model import M2, NEVER_SWEPT, RESTARTED, Case, M, W, _worker, blip

_STUCK = "lightkeeper_monitor_replica_group_stuck_starting"
_IN_Q = "lightkeeper_monitor_replica_group_in_quorum"
_UNV = "lightkeeper_monitor_ranks_answering_unverified"

CASES: dict[str, list[Case]] = {
    "LightkeeperRankDown":
        [Case("rank 1 stops answering",
              [(f'up{{{_worker(0)}}}', "1x20"), (f'up{{{_worker(1)}}}', "1 1 1 1 0x16")],
              "3m", [{"instance": "w1:9000", "job": "train", "lightkeeper_component": "worker",
                      "replica_group": "1", "rank": "1", "group_rank": "0"}]),
         Case("a pod scraped whole (no rank label) stops answering",
              [(f'up{{{W}, instance="10.0.0.5:9000"}}', "1 1 1 1 0x16")],
              "3m", [{"instance": "10.0.0.5:9000", "job": "train",
                      "lightkeeper_component": "worker"}]),
         Case("all ranks up", [(f'up{{{_worker(0)}}}', "1x20"), (f'up{{{_worker(1)}}}', "1x20")],
              "3m")],
    "LightkeeperRanksUnreachable":
        [Case("one rank unreachable",
              [(f"lightkeeper_monitor_ranks_unreachable{{{M}}}", "0 0 1x20")], "4m",
              [{"job": "train"}]),
         Case("all reachable", [(f"lightkeeper_monitor_ranks_unreachable{{{M}}}", "0x20")],
              "4m")],
    "LightkeeperRanksLost":
        [Case("a rank lost",
              [(f"lightkeeper_monitor_ranks_lost_total{{{M}}}", "0 0 0 1x20")], "5m",
              [{"job": "train"}], interval="1m"),
         Case("none lost for over 10 minutes",
              [(f"lightkeeper_monitor_ranks_lost_total{{{M}}}", "1x20")], "15m",
              interval="1m")],
    "LightkeeperRanksUnverified":
        [Case("two ranks claim one rank number for 12 minutes",
              [(f'{_UNV}{{{M}, reason="rank_taken"}}', "0 2x14"),
               (f'{_UNV}{{{M}, reason="no_lighthouse"}}', "0x15")], "12m",
              [{"job": "train"}], interval="1m"),
         Case("a Lighthouse restart's quorum ids, ahead for 3 minutes",
              [(f'{_UNV}{{{M}, reason="quorum_ahead"}}', "0 4 4 4 0x11")], "12m",
              interval="1m"),
         Case("a monitor without --lighthouse, and ranks starting",
              [(f'{_UNV}{{{M}, reason="no_lighthouse"}}', "8x15"),
               (f'{_UNV}{{{M}, reason="no_replica_id"}}', "2x15")], "12m",
              interval="1m")],
    "LightkeeperReplicaGroupStraggling":
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
              "4m", [{"job": "train", "replica_group": "2"}])],
    "LightkeeperJobNoProgress":
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
              "9m", [{"job": "train"}])],
    "LightkeeperEvictionsTooFrequent":
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
              "5m", interval="1m")],
    "LightkeeperEvictionsHeldBack":
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
                f'reason="already_evicted"}}', "0 0 1 1 1 1 1")], "5m", interval="1m")],
    "LightkeeperRankStuckInCollective":
        [Case("rank 1 stuck in allreduce",
              [(f"lightkeeper_phase_duration_seconds{{{_worker(1)}}}", "0+15x20"),
               (f'lightkeeper_phase{{{_worker(1)}, phase="allreduce"}}', "1x20")], "4m",
              [{"instance": "w1:9000", "job": "train", "lightkeeper_component": "worker",
                "replica_group": "1", "rank": "1", "group_rank": "0"}]),
         Case("long phase that is not a collective",
              [(f"lightkeeper_phase_duration_seconds{{{_worker(1)}}}", "0+15x20"),
               (f'lightkeeper_phase{{{_worker(1)}, phase="allreduce"}}', "0x20")], "4m")],
    "LightkeeperReplicaGroupOutOfQuorum":
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
               (f'{_IN_Q}{{{M}, replica_group="1"}}', "0x40")], "8m")],
    "LightkeeperHostQuarantined":
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
               (f'lightkeeper_monitor_hosts{{{M}, state="quarantined"}}', "0x20")], "3m")],
    "LightkeeperQuarantineActionFailing":
        [Case("k8s patch refused",
              [(f'lightkeeper_monitor_host_action_failed{{{M}, host="h1", sink="k8s"}}',
                "_x2 1x20")], "4m",
              [{"job": "train", "host": "h1", "sink": "k8s"}]),
         Case("a retry that succeeded within a minute",
              [(f'lightkeeper_monitor_host_action_failed{{{M}, host="h1", sink="webhook"}}',
                "_x2 1x4 stale")], "4m")],
    "LightkeeperShardCannotAct":
        [Case("a shard's etcd gone",
              [(f'lightkeeper_monitor_shard_etcd_up{{{M}, role="shard"}}', "1x2 0x10")], "3m",
              [{"job": "train", "instance": "mon:19400", "role": "shard"}]),
         Case("etcd back within a minute",
              [(f'lightkeeper_monitor_shard_etcd_up{{{M}, role="leader"}}', "1x2 0x2 1x10")],
              "3m")],
    "LightkeeperShardNoLeader":
        [Case("both candidates standing by",
              [(f'lightkeeper_monitor_shard_leading{{{M}}}', "0x10"),
               ('lightkeeper_monitor_shard_leading{job="train", '
                'lightkeeper_component="monitor", instance="mon2:19400"}', "0x10")], "3m",
              [{"job": "train"}]),
         Case("one leads",
              [(f'lightkeeper_monitor_shard_leading{{{M}}}', "0x10"),
               ('lightkeeper_monitor_shard_leading{job="train", '
                'lightkeeper_component="monitor", instance="mon2:19400"}', "1x10")], "3m")],
    "LightkeeperLighthouseSlowRecovery":
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
                "0x20")], "4m")],
    "LightkeeperJobSlowedWithoutCulprit":
        [Case("job_slow open for 3 minutes",
              [(f'lightkeeper_monitor_open_findings{{{M}, kind="job_slow"}}', "0 1x20"),
               (f'lightkeeper_monitor_open_findings{{{M}, kind="network"}}', "0x20")], "3m",
              [{"job": "train"}]),
         Case("a job stall that a named host explained within a minute",
              [(f'lightkeeper_monitor_open_findings{{{M}, kind="job_stall"}}', "0 1x3 0x20"),
               (f'lightkeeper_monitor_open_findings{{{M}, kind="network"}}', "0x3 1x2 0x20")],
              "3m")],
    "LightkeeperMonitorDown":
        [Case("monitor gone", [(f"up{{{M}}}", "1 1 0x20")], "4m",
              [{"job": "train", "lightkeeper_component": "monitor", "instance": "mon:19400"}]),
         Case("monitor up", [(f"up{{{M}}}", "1x20")], "4m")],
    "LightkeeperMonitorMissing":
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
         Case("nothing scraped at all", [(f"up{{{M}}}", "stale")], "8m")],
    "LightkeeperMonitorNotSweeping":
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
               (f"lightkeeper_monitor_sweeps_total{{{M}}}", "0+12x10 stale")], "10m")],
    "LightkeeperMonitorOutOfFileDescriptors":
        [Case("connects failing with EMFILE",
              [(f'lightkeeper_monitor_poll_errors_total{{{M}, reason="monitor"}}',
                "0 0 0 40 80 120x20")], "3m", [{"job": "train"}]),
         Case("ranks timing out, the monitor fine",
              [(f'lightkeeper_monitor_poll_errors_total{{{M}, reason="monitor"}}', "0x20"),
               (f'lightkeeper_monitor_poll_errors_total{{{M}, reason="timeout"}}',
                "0 5 10 15 20x20")], "3m")],
}
