"""The Monitor health dashboard: the Lightkeeper monitor itself (sweeps, reachability of ranks,
poll errors, findings, evictions and held-back decisions, the Lighthouse's settings)."""

from __future__ import annotations

from . import panels as P
from .common import IN_QUORUM, LINKS, TAG, UID_MONITOR, job_variable
from .panels import Layout, stat, table, target, targets, timeseries
from .promql import RI, J, active_sum, events, finding_events, step_events, step_growth

# per group 1 in the quorum, 0 out, -1 stuck starting (one never in a quorum has no in_quorum)
_STUCK = f"max by (replica_group) (lightkeeper_monitor_replica_group_stuck_starting{{{J}}})"
IN_QUORUM_OR_STUCK = (f"max by (replica_group) (lightkeeper_monitor_replica_group_in_quorum{{{J}}})"
                      f" unless on (replica_group) ({_STUCK} == 1) or -{_STUCK} == -1")
STUCK = P.value_mappings({"-1": ("stuck starting", "dark-red")})


def monitor_health() -> dict:
    L = Layout()
    L.row("Monitor")
    L.add(stat("Ranks known", "Ranks the monitor polls.",
               [target(active_sum(f"lightkeeper_monitor_ranks_known{{{J}}}"), "known")]), 4, 4)
    L.add(stat("Ranks up", "Ranks that answered the last sweep.",
               [target(active_sum(f"lightkeeper_monitor_ranks_up{{{J}}}"), "up")]), 4, 4)
    L.add(stat("Ranks unreachable", "Ranks that did not answer the last sweep (not those whose "
               "training finished).",
               [target(active_sum(f"lightkeeper_monitor_ranks_unreachable{{{J}}}"), "unreachable")],
               thresholds_=P.thresholds((None, "green"), (1, "red"))), 4, 4)
    L.add(stat("Open findings", "Findings the monitor currently holds open.",
               [target(active_sum(f"lightkeeper_monitor_open_findings{{{J}}}"), "open")],
               thresholds_=P.thresholds((None, "green"), (1, "orange"))), 4, 4)
    L.add(stat("Mode", "Dry run: the monitor reports but never evicts.",
               [target(f"max(lightkeeper_monitor_dry_run{{{J}}})", "dry run")],
               mappings=P.value_mappings({"1": ("dry run", "orange"),
                                          "0": ("evicting", "green")})), 4, 4)
    L.add(stat("Since last eviction", "Time since the monitor last requested an eviction.",
               [target(f"time() - max(lightkeeper_monitor_last_eviction_timestamp_seconds{{{J}}} > 0)",
                       "since last eviction")], unit="s"), 4, 4)
    L.add(timeseries(
        "Sweep duration", "Time one poll of every rank (plus analysis) takes; and sweeps per second.",
        targets((f"histogram_quantile(0.5, sum by (le) "
                 f"(rate(lightkeeper_monitor_sweep_duration_seconds_bucket{{{J}}}[{RI}])))", "p50"),
                (f"histogram_quantile(0.95, sum by (le) "
                 f"(rate(lightkeeper_monitor_sweep_duration_seconds_bucket{{{J}}}[{RI}])))", "p95"),
                (f"sum(rate(lightkeeper_monitor_sweep_duration_seconds_sum{{{J}}}[{RI}])) / "
                 f"sum(rate(lightkeeper_monitor_sweep_duration_seconds_count{{{J}}}[{RI}]))",
                 "mean")),
        unit="s", min_=0), 8, 8)
    L.add(timeseries("Sweeps per second", "Completed sweeps per second.",
                     [target(f"sum(rate(lightkeeper_monitor_sweeps_total{{{J}}}[{RI}]))",
                             "sweeps/s")], min_=0), 4, 8)
    L.add(timeseries(
        "Ranks known / up / unreachable / finished / lost",
        "What the monitor saw in each sweep; finished: gone after saying their training "
        "finished; lost: self-registered ranks it dropped after --forget-after while the job "
        "went on (LightkeeperRanksLost), per interval.",
        targets((active_sum(f"lightkeeper_monitor_ranks_known{{{J}}}"), "known"),
                (active_sum(f"lightkeeper_monitor_ranks_up{{{J}}}"), "up"),
                (active_sum(f"lightkeeper_monitor_ranks_unreachable{{{J}}}"), "unreachable"),
                (active_sum(f"lightkeeper_monitor_ranks_finished{{{J}}}"), "finished"),
                (active_sum(step_growth(f"lightkeeper_monitor_ranks_lost_total{{{J}}}")), "lost")),
        interpolation="stepAfter", fill=0, min_=0), 6, 8)
    L.add(timeseries(
        "Poll errors by reason", "Failed polls per second: timeout, connection, http_status, "
        "bad_response, monitor (the monitor's own file descriptors ran out, or its poller "
        "process died: LightkeeperMonitorOutOfFileDescriptors).",
        [target(f"sum by (reason) (rate(lightkeeper_monitor_poll_errors_total{{{J}}}[{RI}]))",
                "{{reason}}")], unit="suffix: errors/s", min_=0), 6, 8)
    L.add(timeseries(
        "Rank registrations by outcome",
        "POST /v1/targets per interval: accepted, or refused (unauthorized, not_allowed, "
        "bad_request, too_many_targets, other_job; resolver_busy: asked to retry shortly). "
        "Refusals mean ranks the monitor does not poll.",
        [target(step_events("lightkeeper_monitor_registrations_total", J, "outcome"),
                "{{outcome}}")],
        draw="bars", fill=80, min_=0), 12, 6)
    L.add(timeseries(
        "Ranks verified / unverified by reason",
        "Ranks whose claims the Lighthouse and their peers confirm (only their answers are "
        "evidence for a finding), and the others by reason (shown, never evidence): those "
        "answering (LightkeeperRanksUnverified), and those not answering by their last verdict.",
        targets((active_sum(f"lightkeeper_monitor_ranks_verified{{{J}}}"), "verified"),
                (active_sum(f"lightkeeper_monitor_ranks_answering_unverified{{{J}}}", "reason"),
                 "unverified: {{reason}}"),
                (active_sum(f"lightkeeper_monitor_ranks_unverified{{{J}}}", "reason") + " - "
                 + active_sum(f"lightkeeper_monitor_ranks_answering_unverified{{{J}}}",
                              "reason"), "not answering, last unverified: {{reason}}")),
        interpolation="stepAfter", fill=0, min_=0), 8, 6)
    L.add(stat("Lighthouse readable",
               "Whether the monitor read and understood the Lighthouse's status at its last "
               "sweep; without it no rank is verified and nothing is evicted.",
               [target(f"min(lightkeeper_monitor_lighthouse_up{{{J}}})", "lighthouse")],
               mappings=P.value_mappings({"1": ("read", "green"),
                                          "0": ("unreadable: no eviction", "red")})), 4, 6)

    L.row("Lighthouse settings")
    _lighthouse_settings_panels(L)

    L.row("Shards (sharded monitors only: --shard, --lead)")
    L.add(P.state_timeline(
        "etcd reachable, by monitor and role",
        "Whether each sharded monitor's last exchange with etcd succeeded: a shard that cannot "
        "reach it proposes no eviction, a leader sends no kill (LightkeeperShardCannotAct). A "
        "shard set up so that nothing acts on it (its index held by another --shards, no "
        "leader under its prefix) shows 0 too: shard.error in /v1/cluster says which.",
        [target(f"max by (instance, role) (lightkeeper_monitor_shard_etcd_up{{{J}}})",
                "{{instance}} {{role}}")],
        mappings=P.value_mappings({"1": ("up", "green"), "0": ("unreachable", "red")})), 12, 6)
    L.add(P.state_timeline(
        "Leader candidates and standby shards",
        "leading: the --lead monitor that sends the kills (none: LightkeeperShardNoLeader); "
        "standby: a monitor whose --shard index another one holds (it reports nothing).",
        targets((f"max by (instance) (lightkeeper_monitor_shard_leading{{{J}}})",
                 "{{instance}} leading"),
                (f"max by (instance) (lightkeeper_monitor_shard_standby{{{J}}})",
                 "{{instance}} standby")),
        mappings=P.value_mappings({"1": ("yes", "blue"), "0": ("no", "text")})), 12, 6)

    L.row("Findings, evictions and held-back decisions")
    L.add(timeseries(
        "Findings by kind", "Confirmed findings per interval, by kind.",
        [target(finding_events(J, "kind"),
                "{{kind}}")],
        draw="bars", fill=80, min_=0), 8, 8)
    L.add(timeseries(
        "Open findings by kind", "Findings currently open, by kind.",
        [target(active_sum(f"lightkeeper_monitor_open_findings{{{J}}}", "kind"), "{{kind}}")],
        interpolation="stepAfter", min_=0), 8, 8)
    L.add(timeseries(
        "Evictions by replica group", "Kill requests the monitor sent, per interval.",
        # only senders count kills (a --lead monitor standing by for its --shard included)
        [target(step_events("lightkeeper_monitor_evictions_total", J, "replica_group"),
                "group {{replica_group}}")], draw="bars", fill=80, min_=0), 8, 8)
    L.add(timeseries(
        "Eviction decisions (evict / hold)",
        "What the monitor decided for each confirmed finding: evict, or hold back (dry run, "
        "eviction budget, quorum too small, ...), per interval. A hold already_evicted "
        "follows each kill (its finding still open a sweep later): nothing held back.",
        [target(step_events("lightkeeper_monitor_eviction_decisions_total", J,
                            "decision, reason"), "{{decision}}: {{reason}}")],
        draw="bars", fill=80, min_=0), 14, 8)
    L.add(table(
        "Decisions in the time range", "Eviction decisions over the dashboard's time range "
        "(hold already_evicted: the sweep after each kill, nothing held back).",
        [target(events("lightkeeper_monitor_eviction_decisions_total", J, "decision, reason"),
                "", instant=True, fmt="table")],
        transformations=[{"id": "organize", "options": {
            "excludeByName": {"Time": True}, "renameByName": {"Value": "decisions"}}}]), 10, 8)

    L.row("Replica groups as the monitor sees them")
    L.add(P.state_timeline(
        "Replica groups in the quorum (monitor)",
        "From the Lighthouse's view, including groups whose ranks are gone; stuck starting: "
        "the monitor's stuck_starting finding names it (LightkeeperReplicaGroupOutOfQuorum).",
        [target(IN_QUORUM_OR_STUCK, "group {{replica_group}}")],
        mappings=IN_QUORUM + STUCK,
        thresholds_=P.thresholds((None, "red"), (1, "green"))), 12, 7)
    L.add(timeseries(
        "Arrival lag at the cross-group allreduce",
        "How long the other replica groups wait for each group at the cross-group step (median "
        "over the straggler window, from every rank's own per-step wait times; no clocks "
        "compared): the straggler detector's evidence.",
        [target(f"lightkeeper_monitor_replica_group_arrival_lag_seconds{{{J}}}",
                "group {{replica_group}}")], unit="s", min_=0), 12, 7)
    L.add(timeseries(
        "Step per replica group (monitor)", "Committed step of each group as the monitor polled it.",
        [target(f"lightkeeper_monitor_replica_group_step{{{J}}}", "group {{replica_group}}")]),
        12, 7)
    L.add(timeseries(
        "Quorum (monitor)", "Quorum id and participants as the monitor sees them.",
        targets((f"max(lightkeeper_monitor_quorum_id{{{J}}})", "quorum id"),
                (f"max(lightkeeper_monitor_quorum_participants{{{J}}})", "participants")),
        interpolation="stepAfter", fill=0), 12, 7)

    annotations = [P.prometheus_annotation(
        "Evictions",
        step_events("lightkeeper_monitor_evictions_total", J, "job, replica_group") + " > 0",
        title="Eviction of replica group {{replica_group}}",
        text="The monitor asked to evict replica group {{replica_group}}", color="red",
        tags="replica_group")]
    return P.dashboard(
        UID_MONITOR, "Lightkeeper / Monitor health",
        "Is the Lightkeeper monitor itself healthy: sweep duration, reachability of ranks, "
        "poll errors, findings, evictions and decisions it held back.",
        [TAG], [P.datasource_variable(), job_variable()], L, annotations, LINKS)


SETTING_WARNING = P.value_mappings({"0": ("ok", "green"), "1": ("slow recovery", "orange")})
UNKNOWN = P.special_mapping("nan", "unknown")


def _lighthouse_settings_panels(L: Layout) -> None:
    """What the monitor knows of the Lighthouse's timeouts and whether they make recovery slow
    (docs/lighthouse.md, "The monitor's warning"). NaN (not known yet) shows as "unknown"."""
    warnings = f"lightkeeper_monitor_config_warnings{{{J}}}"
    L.add(stat("Slow Lighthouse settings",
               "Settings that make recovery after a fault slow (a dead group would stall the "
               "survivors more than 2 s): heartbeat_timeout, eviction_drop, "
               "heartbeat_timeout_declared (LightkeeperLighthouseSlowRecovery).",
               # one per setting: every monitor of the job (shards, leader) judges the same
               # Lighthouse
               [target(f"count(max by (setting) ({warnings}) == 1) or vector(0)",
                       "warnings")],
               thresholds_=P.thresholds((None, "green"), (1, "orange"))), 4, 6)
    L.add(table(
        "Lighthouse settings warnings",
        "One row per setting the monitor judges: ok, or slow recovery while the evidence "
        "holds (declared timeouts, the heartbeat ages /status shows, the last kill's drop "
        "time). The monitor's log says why.",
        [target(f"max by (setting) ({warnings})", "", instant=True, fmt="table")],
        sort_by="setting",
        overrides=[P.override_by_name("warning", mappings=SETTING_WARNING,
                                      **{"custom.cellOptions": {"type": "color-text"}})],
        transformations=[{"id": "organize", "options": {
            "excludeByName": {"Time": True}, "indexByName": {"setting": 0, "Value": 1},
            "renameByName": {"Value": "warning"}}}]), 8, 6)
    L.add(stat("Lighthouse heartbeat timeout",
               "declared: what the monitor was told (--lighthouse-heartbeat-timeout-ms); "
               "observed_above / observed_at_most: the bounds the Lighthouse's /status shows "
               "(a left group's heartbeat ageing past it). unknown until there is evidence.",
               [target(f"max by (source) "
                       f"(lightkeeper_monitor_lighthouse_heartbeat_timeout_seconds{{{J}}})",
                       "{{source}}")],
               unit="s", decimals=2, mappings=[UNKNOWN],
               thresholds_=P.thresholds((None, "green"), (2, "orange"))), 8, 6)
    L.add(stat("Last eviction: out of the quorum after",
               "Seconds from the monitor's last kill until the Lighthouse's newest quorum no "
               "longer listed the group (to within one sweep); the survivors stall about this "
               "long. Orange above 3 s (2 s plus the process's exit); unknown before the first "
               "eviction.",
               [target(f"max(lightkeeper_monitor_lighthouse_drop_seconds{{{J}}})", "drop")],
               unit="s", decimals=2, mappings=[UNKNOWN],
               thresholds_=P.thresholds((None, "green"), (3, "orange"))), 4, 6)
