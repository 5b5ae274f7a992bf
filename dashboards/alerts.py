"""Lightkeeper's recording and alerting rules, as data: each rule's PromQL and each alert's
annotations (summary, description, runbook), rendered by dashboards/rules.py. The promtool
cases in which each alert fires and stays silent are dashboards/alert_cases.py's."""

from __future__ import annotations

from .alert_cases import CASES
from .promql import RANK_HEALS, RANK_HEALS_EXPR, live
from .rule_model import Alert, Record, grown

# reasons an answering rank is unverified that other alerts or the design cover: its Manager is
# not up yet (stuck_starting), or the monitor runs without --lighthouse (it never evicts)
UNVERIFIED_EXPECTED = "no_replica_id|no_lighthouse"

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
        CASES["LightkeeperRankDown"]),
    Alert(
        "LightkeeperRanksUnreachable",
        "max by (job) (lightkeeper_monitor_ranks_unreachable) > 0", "2m", "warning",
        "The Lightkeeper monitor cannot reach ranks of job {{ $labels.job }}",
        "At least one rank has not answered the monitor's polls for 2 minutes.",
        "Open the Monitor health dashboard (poll errors by reason) and the monitor's "
        "/v1/cluster; a rank that stays unreachable is dead or hung: check its process, or "
        "let the monitor evict its replica group.",
        CASES["LightkeeperRanksUnreachable"]),
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
        CASES["LightkeeperRanksLost"]),
    Alert(
        "LightkeeperRanksUnverified",
        "max by (job) (lightkeeper_monitor_ranks_answering_unverified"
        f'{{reason!~"{UNVERIFIED_EXPECTED}"}}) > 0', "10m", "warning",
        "The Lightkeeper monitor cannot verify ranks of job {{ $labels.job }}",
        "For 10 minutes some ranks have answered the monitor with claims the Lighthouse does "
        "not bear out (or the Lighthouse could not be read): while this lasts the monitor may "
        "not act on a fault in their replica groups.",
        "Open the Monitor health dashboard (ranks unverified by reason) and the monitor's "
        "/v1/ranks (each rank's verification reason and detail). unknown_replica_id or "
        "quorum_ahead: --lighthouse names another job's Lighthouse, or it restarted; "
        "replica_id_conflict, rank_taken, group_rank_taken: two processes claim one identity "
        "(a stale process, or two jobs with one --job); world_size_mismatch: a group started "
        "with another size; lighthouse_unreadable: check the Lighthouse and the monitor's "
        "route to it.",
        CASES["LightkeeperRanksUnverified"]),
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
        CASES["LightkeeperReplicaGroupStraggling"]),
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
        CASES["LightkeeperJobNoProgress"]),
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
        CASES["LightkeeperEvictionsTooFrequent"]),
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
        CASES["LightkeeperEvictionsHeldBack"]),
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
        CASES["LightkeeperRankStuckInCollective"]),
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
        CASES["LightkeeperReplicaGroupOutOfQuorum"]),
    Alert(
        "LightkeeperHostQuarantined",
        'max by (job, host, node) (lightkeeper_monitor_host_quarantine_state{state="quarantined"})'
        " == 1", "0m", "warning",
        "Host {{ $labels.host }} (node {{ $labels.node }}) of job {{ $labels.job }} is "
        "quarantined",
        "The monitor's host ledger quarantined host {{ $labels.host }}: it offended (a hang, "
        "mismatch, dead rank, network fault or dead group, or a repeated straggler) within the "
        "quarantine window. Groups "
        "that come back on it are evicted; the monitor's --action sinks, if it runs any "
        "(GET /v1/hosts: actions, and each host's), cordon or drain it: with none, nothing "
        "tells the scheduler.",
        "GET /v1/hosts on the monitor for the offences and their findings; check the host's "
        "hardware (GPU, NIC, memory); once repaired, POST /v1/hosts/{{ $labels.host }}/release "
        "(bearer token), else it expires after --quarantine-ttl.",
        CASES["LightkeeperHostQuarantined"]),
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
        CASES["LightkeeperQuarantineActionFailing"]),
    Alert(
        "LightkeeperShardCannotAct",
        "max by (job, instance, role) (lightkeeper_monitor_shard_etcd_up) == 0", "1m",
        "warning",
        "A sharded monitor of job {{ $labels.job }} cannot act ({{ $labels.role }})",
        "The {{ $labels.role }} at {{ $labels.instance }} has had no answer from etcd for a "
        "minute, or (a shard) is set up so that nothing acts on it: its --shard index held by "
        "a monitor of another --shards, or no leader under its --etcd-prefix and --job. A "
        "shard proposes no eviction, a leader sends no kill. Findings are still confirmed and "
        "shown, but none is acted on.",
        "GET /v1/cluster on that monitor (shard.error, shard.leader_error) and its log say "
        "what etcd answered or which setting is wrong; check etcd's health and the --etcd "
        "URL, or stop the monitor of the wrong --shards, or give the shards the leader's "
        "--etcd-prefix and --job.",
        CASES["LightkeeperShardCannotAct"]),
    Alert(
        "LightkeeperShardNoLeader",
        "max by (job) (lightkeeper_monitor_shard_leading) == 0", "1m", "warning",
        "No leader candidate of job {{ $labels.job }} leads: no kill is sent",
        "Every --lead monitor of job {{ $labels.job }} has stood by for a minute: the shards' "
        "proposals wait, and no eviction is sent.",
        "GET /v1/cluster on the candidates (shard.leader, shard.leader_error): etcd "
        "unreachable, or the leader key held by a monitor that is gone (its lease ends after "
        "--lease-ttl).",
        CASES["LightkeeperShardNoLeader"]),
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
        CASES["LightkeeperLighthouseSlowRecovery"]),
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
        CASES["LightkeeperJobSlowedWithoutCulprit"]),
    Alert(
        "LightkeeperMonitorDown",
        'up{lightkeeper_component="monitor"} == 0', "2m", "warning",
        "The Lightkeeper monitor at {{ $labels.instance }} is down",
        "Prometheus has not been able to scrape the monitor at {{ $labels.instance }} for 2 "
        "minutes: nothing detects or evicts bad replica groups meanwhile.",
        "Restart lightkeeper monitor (it rebuilds its view from the Lighthouse and the ranks' "
        "self-registration); check its log for the cause.",
        CASES["LightkeeperMonitorDown"]),
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
        CASES["LightkeeperMonitorMissing"]),
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
        CASES["LightkeeperMonitorNotSweeping"]),
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
        CASES["LightkeeperMonitorOutOfFileDescriptors"]),
]
