"""The Lightkeeper Grafana dashboards, as code.

``build_dashboards()`` returns the three dashboards as dicts; ``write_all()`` writes them (and
the generated Prometheus files, see :mod:`dashboards.rules` and :mod:`dashboards.promconfig`) to
``dashboards/generated/`` and ``dashboards/prometheus/``. The committed files are this module's
output: ``lightkeeper dashboards build --check`` (and a test) fails when they are stale.

Every query uses only metrics the WorkerServer (``lightkeeper_*``) or the monitor
(``lightkeeper_monitor_*``) export (docs/CONTRACTS.md), and Grafana's ``$job``,
``$replica_group`` and ``$rank`` variables (multi-value, "All" = ``.*``; ``$job``: one job) as
regex matchers.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import panels as P
from .panels import Layout, stat, table, target, targets, timeseries

PACKAGE_DIR = Path(__file__).resolve().parent
GENERATED_DIR = PACKAGE_DIR / "generated"
PROMETHEUS_DIR = PACKAGE_DIR / "prometheus"

TAG = "lightkeeper"
UID_OVERVIEW = "lightkeeper-job-overview"
UID_DRILLDOWN = "lightkeeper-rank-drilldown"
UID_MONITOR = "lightkeeper-monitor-health"

# The WorkerServer's phases (worker_server.state.PHASES), in order; the phase timeline encodes
# the current phase as its 1-based position here. A test keeps the two lists in step.
PHASES = ("starting", "quorum", "forward", "backward", "allreduce", "commit", "optimizer",
          "healing", "stopped", "checkpoint")
PHASE_COLORS = {"starting": "blue", "quorum": "purple", "forward": "green", "backward": "green",
                "allreduce": "orange", "commit": "yellow", "optimizer": "green",
                "healing": "red", "stopped": "text", "checkpoint": "blue"}

J = 'job=~"$job"'
G = f'{J}, replica_group=~"$replica_group"'
R = f'{G}, rank=~"$rank"'
RI = "$__rate_interval"
STEP = "$__interval"

STEPS_PER_S = "suffix: steps/s"
LINKS = [P.dashboard_link("Lightkeeper dashboards", [TAG])]


def _job_var() -> dict:
    # one job at a time: two jobs' replica group 0, quorum ids and monitors would add up
    return P.query_variable("job", "Training job", "label_values(lightkeeper_step, job)",
                            multi=False, include_all=False)


# each group's slowest rank's compute a step (as the straggler alert's recording rule)
GROUP_COMPUTE = (f"max by (job, replica_group) "
                 f"(rate(lightkeeper_step_compute_seconds_sum{{{J}}}[{RI}]) "
                 f"/ rate(lightkeeper_step_compute_seconds_count{{{J}}}[{RI}]))")


def events(metric: str, sel: str, by: str, window: str = RI) -> str:
    """How much counter ``metric`` grew within ``window``, by ``by``.

    ``increase`` cannot see the first increment of a labelled counter (its series appears
    already at 1), so a series that is new within the window counts with its whole value."""
    m = f"{metric}{{{sel}}}"
    return f"sum by ({by}) (({m} unless {m} offset {window}) or increase({m}[{window}]))"


def step_growth(m: str) -> str:
    """How much each series of counter selector ``m`` grew since the previous step.

    Grafana steps ``$__interval`` apart: each step compares two instant values one step apart,
    so every increment counts at exactly one step (``increase`` over a longer window would count
    it at several, and over one step sees a single sample). A counter reset counts 0."""
    return f"clamp_min({m} - {m} offset {STEP}, 0)"


def step_events(metric: str, sel: str, by: str) -> str:
    """How much labelled counter ``metric`` grew since the previous step, by ``by``; a series
    new since then counts with its whole value (it appears already at 1)."""
    m = f"{metric}{{{sel}}}"
    return f"sum by ({by}) (({m} unless {m} offset {STEP}) or {step_growth(m)})"


def _group_steps(metric: str) -> str:
    """A worker counter's growth since the previous step per replica group (its ranks count
    the same events: the most of any rank)."""
    return f"max by (replica_group) ({step_growth(f'{metric}{{{J}}}')})"


# one marker at the first step that sees a new quorum id (changes() over one step sees one sample)
QUORUM_CHANGED = (f"max by (job) (lightkeeper_quorum_id{{{J}}} "
                  f"!= lightkeeper_quorum_id{{{J}}} offset {STEP})")


def _step_quantile(q: float, by: str, sel: str) -> str:
    return (f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate(lightkeeper_step_duration_seconds_bucket{{{sel}}}[{RI}])))")


def _step_mean(by: str, sel: str) -> str:
    return (f"sum by ({by}) (rate(lightkeeper_step_duration_seconds_sum{{{sel}}}[{RI}])) / "
            f"sum by ({by}) (rate(lightkeeper_step_duration_seconds_count{{{sel}}}[{RI}]))")


def phase_code_expr(sel: str) -> str:
    """One series per rank whose value is the 1-based index of its current phase in PHASES."""
    terms = " or ".join(f'lightkeeper_phase{{{sel}, phase="{p}"}} * {i}'
                        for i, p in enumerate(PHASES, start=1))
    return f"sum by (job, replica_group, rank) ({terms})"


def phase_mappings() -> list[dict]:
    return P.value_mappings({str(i): (p, PHASE_COLORS[p]) for i, p in enumerate(PHASES, start=1)})


IN_QUORUM = P.value_mappings({"1": ("in quorum", "green"), "0": ("out of quorum", "red")})


# --- 1. job overview ----------------------------------------------------------------------------
def job_overview() -> dict:
    L = Layout()
    L.row("Quorum")
    L.add(stat("Replica groups in quorum",
               "Replica groups whose ranks take part in the current step (lightkeeper_participating).",
               [target(f"count(max by (replica_group) (lightkeeper_participating{{{J}}}) == 1) "
                       "or vector(0)", "in quorum")],
               thresholds_=P.thresholds((None, "red"), (1, "green"))), 4, 4)
    L.add(stat("Replica groups out of quorum",
               "Replica groups that report not participating, or that the monitor knows but that "
               "are not in the Lighthouse's quorum (e.g. a group whose ranks are dead).",
               [target(f"count(max by (replica_group) (lightkeeper_participating{{{J}}} == 0 or "
                       f"lightkeeper_monitor_replica_group_in_quorum{{{J}}} == 0)) or vector(0)",
                       "out of quorum")],
               thresholds_=P.thresholds((None, "green"), (1, "orange"))), 4, 4)
    L.add(stat("Quorum id", "The current torchft quorum id (highest over ranks).",
               [target(f"max(lightkeeper_quorum_id{{{J}}})", "quorum id")]), 4, 4)
    L.add(stat("Quorum participants", "Replica groups in the current quorum.",
               [target(f"max(lightkeeper_quorum_participants{{{J}}})", "participants")]), 4, 4)
    L.add(stat("Committed step", "Highest committed step over all ranks.",
               [target(f"max(lightkeeper_step{{{J}}})", "step")], graph="area"), 4, 4)
    L.add(stat("Step rate", "Committed steps per second of the job (fastest replica group).",
               [target(f"max(rate(lightkeeper_commits_total{{{J}}}[{RI}]))", "steps/s")],
               unit=STEPS_PER_S, decimals=2, graph="area"), 4, 4)
    L.add(P.state_timeline(
        "Replica groups in and out of the quorum",
        "Per replica group: green while its ranks take part in the step, red while they sit out.",
        [target(f"max by (replica_group) (lightkeeper_participating{{{J}}})",
                "group {{replica_group}}")],
        mappings=IN_QUORUM, thresholds_=P.thresholds((None, "red"), (1, "green"))), 12, 7)
    L.add(timeseries(
        "Quorum id and participants over time",
        "Each quorum change (new quorum id) rebuilds torchft's process group; participants is "
        "the number of replica groups in it.",
        targets((f"max(lightkeeper_quorum_id{{{J}}})", "quorum id"),
                (f"max(lightkeeper_quorum_participants{{{J}}})", "participants")),
        interpolation="stepAfter", fill=0), 12, 7)

    L.row("Goodput (monitor)")
    _goodput_panels(L)

    L.row("Hosts (monitor)")
    _host_panels(L)

    L.row("Progress")
    L.add(timeseries(
        "Step rate per replica group",
        "Committed steps per second (should_commit True) and attempted steps per second.",
        targets((f"max by (replica_group) (rate(lightkeeper_commits_total{{{J}}}[{RI}]))",
                 "group {{replica_group}} committed"),
                (f"max by (replica_group) "
                 f"(rate(lightkeeper_step_duration_seconds_count{{{J}}}[{RI}]))",
                 "group {{replica_group}} attempted")),
        unit=STEPS_PER_S, min_=0), 12, 8)
    L.add(timeseries(
        "Step time per replica group",
        "Mean step wall time (exact, from the histogram's sum/count) and p95 (from its buckets).",
        targets((_step_mean("replica_group", J), "group {{replica_group}} mean"),
                (_step_quantile(0.95, "replica_group", J), "group {{replica_group}} p95")),
        unit="s", min_=0, legend_calcs=["mean", "max"]), 12, 8)
    L.add(timeseries(
        "Commit failures, heals and quorum changes",
        "Per replica group and interval: steps whose should_commit returned False, recoveries "
        "from a peer, and process-group rebuilds.",
        targets((_group_steps("lightkeeper_commit_failures_total"),
                 "group {{replica_group}} commit failures"),
                (_group_steps("lightkeeper_heals_total"), "group {{replica_group}} heals"),
                (_group_steps("lightkeeper_quorum_changes_total"),
                 "group {{replica_group}} quorum changes")),
        draw="bars", fill=80, min_=0), 12, 8)
    L.add(timeseries(
        "Relative compute time",
        "Each group's compute a step (its slowest rank's step time less its waits in "
        "collectives) over the median of all groups: the group the others wait for stands out, "
        "while every group's step time stretches alike. Above the dashed line for 2 minutes the "
        "group is a straggler (LightkeeperReplicaGroupStraggling).",
        [target(f"{GROUP_COMPUTE} / on (job) group_left quantile by (job) "
                f"(0.5, {GROUP_COMPUTE})", "group {{replica_group}}")],
        min_=0, thresholds_=P.thresholds((None, "green"), (1.5, "red")),
        threshold_style="dashed"), 12, 8)
    L.add(timeseries("Loss per replica group", "Training loss of the last step (mean over ranks).",
                     [target(f"avg by (replica_group) (lightkeeper_loss{{{J}}})",
                             "group {{replica_group}}")]), 12, 7)
    L.add(timeseries(
        "Findings and evictions",
        "Confirmed findings by kind and eviction requests by replica group (monitor).",
        targets((step_events("lightkeeper_monitor_findings_total", J, "kind"),
                 "finding: {{kind}}"),
                (step_events("lightkeeper_monitor_evictions_total", J, "replica_group"),
                 "eviction: group {{replica_group}}")),
        draw="bars", fill=80, min_=0), 12, 7)

    annotations = [
        P.prometheus_annotation(
            "Evictions",
            step_events("lightkeeper_monitor_evictions_total", J, "job, replica_group") + " > 0",
            title="Eviction of replica group {{replica_group}}",
            text="The monitor asked to evict replica group {{replica_group}}",
            color="red", tags="replica_group"),
        P.prometheus_annotation(
            "Findings",
            step_events("lightkeeper_monitor_findings_total", J, "job, kind, replica_group")
            + " > 0",
            title="Finding: {{kind}} in replica group {{replica_group}}",
            text="The monitor confirmed a {{kind}} finding",
            color="orange", tags="kind,replica_group"),
        P.prometheus_annotation(
            "Quorum changes", QUORUM_CHANGED,
            title="Quorum changed", text="torchft formed a new quorum", color="purple"),
    ]
    return P.dashboard(
        UID_OVERVIEW, "Lightkeeper / Job overview",
        "A fault-tolerant torchft job at a glance: quorum, progress, step time per replica "
        "group, commit failures, and the monitor's findings and evictions.",
        [TAG], [P.datasource_variable(), _job_var()], L, annotations, LINKS)


# Badput causes of the monitor's goodput ledger (monitor.goodput.ledger.CAUSES), in stacking order,
# with their colours; a test keeps the two lists in step.
BADPUT_COLORS = {"startup": "blue", "capacity_lost": "red", "recovery": "orange",
                 "stall": "dark-red", "straggler_drag": "yellow", "unattributed": "purple"}


def _fixed_color(name: str, color: str) -> dict:
    return P.override_by_name(name, color={"mode": "fixed", "fixedColor": color})


def _goodput_panels(L: Layout) -> None:
    """The ledger's job-level view: its ratio, its capacity, and where each interval's
    replica-seconds went (docs/goodput.md)."""
    good = f"sum(rate(lightkeeper_monitor_goodput_seconds_total{{{J}}}[{RI}]))"
    bad = f"rate(lightkeeper_monitor_badput_seconds_total{{{J}}}[{RI}])"
    total = f"({good} + sum({bad}))"
    L.add(stat("Goodput since the ledger began",
               "Replica-seconds spent in steps committed at healthy pace / (expected replica "
               "groups x wall seconds), since the monitor's goodput ledger began (it survives "
               "monitor restarts). GET /v1/goodput on the monitor has the incidents.",
               [target(f"max(lightkeeper_monitor_goodput_ratio{{{J}}})", "goodput")],
               unit="percentunit", decimals=1,
               thresholds_=P.thresholds((None, "red"), (0.8, "orange"), (0.9, "green"))), 4, 8)
    L.add(stat("Expected replica groups",
               "The ledger's capacity: the monitor's --expected-groups, else the number of "
               "replica groups it has seen.",
               [target(f"max(lightkeeper_monitor_expected_replica_groups{{{J}}})",
                       "expected")]), 4, 8)
    L.add(timeseries(
        "Goodput and badput by cause",
        "Per interval, the share of the job's replica-seconds that went to goodput (steps "
        "committed at healthy pace) and to each badput cause, stacked to 100%: startup, "
        "capacity_lost (a group out of the quorum), recovery (after an eviction until back at "
        "pace), stall (no commit anywhere), straggler_drag, unattributed. Slow time is counted "
        "once its cause is settled (up to the attribution horizon later).",
        targets((f"{good} / {total}", "goodput"),
                (f"sum by (cause) ({bad}) / scalar{total}", "{{cause}}")),
        unit="percentunit", stack=True, fill=70, min_=0, max_=1,
        overrides=[_fixed_color("goodput", "green")]
        + [_fixed_color(c, color) for c, color in BADPUT_COLORS.items()]), 8, 8)
    L.add(timeseries(
        "Goodput per replica group",
        "Each replica group slot's goodput / its wall seconds since the ledger began.",
        [target(f"lightkeeper_monitor_replica_group_goodput_ratio{{{J}}}",
                "group {{replica_group}}")],
        unit="percentunit", min_=0, max_=1), 8, 8)


HOST_STATE = P.value_mappings({"suspect": ("suspect", "orange"),
                                "quarantined": ("quarantined", "red"),
                                "released": ("released", "blue")})


def _host_panels(L: Layout) -> None:
    """The monitor's host ledger (docs/quarantine.md): how many hosts are quarantined, which
    hosts are not ok and why, and quarantine/release actions that fail. The per-host series
    exist only for hosts that are not ok, so a healthy job shows "0" and an empty table."""
    hosts = f"lightkeeper_monitor_hosts{{{J}}}"
    failed = f"lightkeeper_monitor_host_action_failed{{{J}}}"
    L.add(stat("Quarantined hosts",
               "Hosts the monitor's host ledger holds quarantined: their groups are evicted "
               "when they come back there (quarantined_host findings), and the sinks "
               "(--action) cordon or drain them. GET /v1/hosts on the monitor has the evidence; "
               "POST /v1/hosts/{host}/release lifts it.",
               [target(f'sum(lightkeeper_monitor_hosts{{{J}, state="quarantined"}})',
                       "quarantined")],
               thresholds_=P.thresholds((None, "green"), (1, "orange"))), 4, 8)
    L.add(stat("Hosts with a failing action",
               "Hosts whose last quarantine or release action (k8s, slurm, exec, webhook) "
               "failed or is being retried: a quarantine decided but not carried out.",
               [target(f"count({failed} == 1) or vector(0)", "failing")],
               thresholds_=P.thresholds((None, "green"), (1, "red"))), 4, 8)
    L.add(timeseries(
        "Hosts by state",
        "Hosts in the monitor's ledger by state: suspect (offences counting, not yet "
        "quarantined, or held back by a rail), quarantined, released, ok (offended once, "
        "nothing counting now). Only hosts that ever offended are in the ledger.",
        [target(f"sum by (state) ({hosts})", "{{state}}")],
        interpolation="stepAfter", fill=0, min_=0,
        overrides=[_fixed_color("quarantined", "red"), _fixed_color("suspect", "orange"),
                   _fixed_color("released", "blue"), _fixed_color("ok", "green")]), 8, 8)
    L.add(timeseries(
        "Failing host actions by sink",
        "Hosts whose last action failed or is being retried (retries back off 2 s, 4 s, ... "
        "up to 6 attempts), by sink.",
        [target(f"sum by (sink) ({failed})", "{{sink}}")],
        interpolation="stepAfter", fill=0, min_=0), 8, 8)
    key = "job, host"
    L.add(table(
        "Hosts not ok",
        "One row per host that is not ok: its node, state, the offences that count now, and "
        "the sink whose last action failed (empty when none). A healthy job has no row.",
        targets((f"max by ({key}, node, state) "
                 f"(lightkeeper_monitor_host_quarantine_state{{{J}}})", ""),
                (f"max by ({key}) (lightkeeper_monitor_host_offences{{{J}}})", ""),
                (f"max by ({key}, sink) ({failed})", ""),
                instant=True, fmt="table"),
        sort_by="host",
        overrides=[P.override_by_name("state", mappings=HOST_STATE,
                                      **{"custom.cellOptions": {"type": "color-text"}}),
                   P.override_by_name("action failing", mappings=P.value_mappings(
                       {"1": ("failed / retrying", "red")}),
                       **{"custom.cellOptions": {"type": "color-text"}})],
        transformations=[
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {
                "excludeByName": {"Time": True, "job": True, "Value #A": True},
                "indexByName": {"host": 0, "node": 1, "state": 2, "Value #B": 3, "sink": 4,
                                "Value #C": 5},
                "renameByName": {"Value #B": "offences counting", "sink": "action sink",
                                 "Value #C": "action failing"}}},
        ]), 24, 7)


# --- 2. replica group / rank drill-down ---------------------------------------------------------
def rank_drilldown() -> dict:
    L = Layout()
    L.row("Ranks")
    info_by = "job, replica_group, rank, group_rank, host, pid, worker_url, replica_id"
    key = "job, replica_group, rank, group_rank"
    links = [
        P.data_link("Python stacks (/v1/stacks)", "${__data.fields.worker_url}/v1/stacks"),
        P.data_link("Flight Recorder (/v1/fr_trace)", "${__data.fields.worker_url}/v1/fr_trace"),
        P.data_link("State (/v1/state)", "${__data.fields.worker_url}/v1/state"),
    ]
    L.add(table(
        "Ranks",
        "One row per rank. Click a cell for the rank's live Python stacks, Flight Recorder "
        "dump and state from its WorkerServer.",
        targets((f"max by ({info_by}) (lightkeeper_worker_info{{{R}}})", ""),
                (f"max by ({key}) (lightkeeper_step{{{R}}})", ""),
                (f"max by ({key}) (lightkeeper_last_step_duration_seconds{{{R}}})", ""),
                (f"max by ({key}, phase) (lightkeeper_phase{{{R}}} == 1)", ""),
                (f"max by ({key}) (lightkeeper_phase_duration_seconds{{{R}}})", ""),
                instant=True, fmt="table"),
        links=links, sort_by="rank",
        transformations=[
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {
                "excludeByName": {"Time": True, "job": True, "Value #A": True, "Value #D": True},
                "indexByName": {"replica_group": 0, "rank": 1, "group_rank": 2, "phase": 3,
                                "Value #E": 4, "Value #B": 5, "Value #C": 6, "host": 7,
                                "pid": 8, "worker_url": 9, "replica_id": 10},
                "renameByName": {"Value #B": "step", "Value #C": "last step (s)",
                                 "Value #E": "in phase (s)", "group_rank": "group rank",
                                 "replica_group": "replica group"}}},
        ]), 24, 7)

    L.row("Phases and pending collectives")
    L.add(P.state_timeline(
        "Phase per rank",
        "What each rank was doing when scraped: quorum, forward, backward, allreduce (a pending "
        "collective), commit, optimizer, healing.",
        [target(phase_code_expr(R), "rank {{rank}}")], mappings=phase_mappings()), 12, 8)
    L.add(stat("Ranks in a collective",
               "Ranks currently in allreduce, i.e. with a pending collective.",
               [target(f'sum(lightkeeper_phase{{{R}, phase="allreduce"}})', "in allreduce")],
               thresholds_=P.thresholds((None, "green"), (1, "orange"))), 4, 8)
    L.add(timeseries(
        "Pending collective per rank",
        "Seconds the rank has been waiting in its current allreduce (0 when it is not in one). "
        "A rank stuck here while its peers are elsewhere points at a hang: open its Flight "
        "Recorder dump from the Ranks table.",
        [target(f"lightkeeper_phase_duration_seconds{{{R}}} * ignoring(phase) "
                f'lightkeeper_phase{{{R}, phase="allreduce"}}', "rank {{rank}}")],
        unit="s", min_=0, thresholds_=P.thresholds((None, "green"), (30, "red")),
        threshold_style="dashed"), 8, 8)
    L.add(timeseries("Time in current phase per rank",
                     "Seconds since each rank entered its current phase.",
                     [target(f"lightkeeper_phase_duration_seconds{{{R}}}", "rank {{rank}}")],
                     unit="s", min_=0), 12, 7)
    L.add(timeseries("Time since last step per rank",
                     "Seconds since each rank last finished a step.",
                     [target(f"time() - lightkeeper_last_step_timestamp_seconds{{{R}}}",
                             "rank {{rank}}")], unit="s", min_=0), 12, 7)

    L.row("Step time")
    L.add(timeseries(
        "Step time per rank (p50 / p95 / p99)", "From the step-time histogram of each rank.",
        targets((_step_quantile(0.5, "rank", R), "rank {{rank}} p50"),
                (_step_quantile(0.95, "rank", R), "rank {{rank}} p95"),
                (_step_quantile(0.99, "rank", R), "rank {{rank}} p99")),
        unit="s", min_=0, legend_calcs=["mean", "max"]), 12, 8)
    L.add(P.heatmap(
        "Step time distribution",
        "Steps per histogram bucket and interval, over the selected ranks.",
        [target(f"sum by (le) (increase(lightkeeper_step_duration_seconds_bucket{{{R}}}[{RI}]))",
                "{{le}}", fmt="heatmap")]), 12, 8)
    L.add(timeseries(
        "Compute per step per rank (mean / p95)",
        "Seconds of each step the rank spent outside collective waits (forward, backward, "
        "optimizer, data), on its own clock. A rank that computes longer than its peers is the "
        "straggler; the others then wait for it.",
        targets((f"sum by (rank) (rate(lightkeeper_step_compute_seconds_sum{{{R}}}[{RI}])) / "
                 f"sum by (rank) (rate(lightkeeper_step_compute_seconds_count{{{R}}}[{RI}]))",
                 "rank {{rank}} mean"),
                (f"histogram_quantile(0.95, sum by (rank, le) "
                 f"(rate(lightkeeper_step_compute_seconds_bucket{{{R}}}[{RI}])))",
                 "rank {{rank}} p95")),
        unit="s", min_=0), 12, 8)
    L.add(timeseries(
        "Collective wait per step per rank (mean / p95)",
        "Seconds of each step the rank's training thread waited inside collectives: cross = "
        "torchft's quorum and allreduce across replica groups, group = FSDP collectives and the "
        "commit vote inside the replica group. The ranks that wait long are waiting for one "
        "that does not.",
        targets((f"sum by (rank, scope) (rate(lightkeeper_collective_wait_seconds_sum{{{R}}}[{RI}]))"
                 f" / sum by (rank, scope) "
                 f"(rate(lightkeeper_collective_wait_seconds_count{{{R}}}[{RI}]))",
                 "rank {{rank}} {{scope}} mean"),
                (f"histogram_quantile(0.95, sum by (rank, scope, le) "
                 f"(rate(lightkeeper_collective_wait_seconds_bucket{{{R}}}[{RI}])))",
                 "rank {{rank}} {{scope}} p95")),
        unit="s", min_=0), 12, 8)
    L.add(timeseries("Last step time per rank", "Wall time of each rank's last finished step.",
                     [target(f"lightkeeper_last_step_duration_seconds{{{R}}}", "rank {{rank}}")],
                     unit="s", min_=0), 24, 7)

    L.row("Progress")
    L.add(timeseries("Committed step per rank", "torchft's committed step on each rank.",
                     [target(f"lightkeeper_step{{{R}}}", "rank {{rank}}")]), 8, 7)
    L.add(timeseries(
        "Commits, commit failures and heals per rank", "Per second, per rank.",
        targets((f"rate(lightkeeper_commits_total{{{R}}}[{RI}])", "rank {{rank}} commits"),
                (f"rate(lightkeeper_commit_failures_total{{{R}}}[{RI}])",
                 "rank {{rank}} commit failures"),
                (f"rate(lightkeeper_heals_total{{{R}}}[{RI}])", "rank {{rank}} heals")),
        min_=0), 8, 7)
    L.add(timeseries(
        "Quorum per rank", "Quorum id each rank is in, and whether it participates (0/1).",
        targets((f"lightkeeper_quorum_id{{{R}}}", "rank {{rank}} quorum id"),
                (f"lightkeeper_quorum_participants{{{R}}}", "rank {{rank}} participants"),
                (f"lightkeeper_participating{{{R}}}", "rank {{rank}} participating")),
        interpolation="stepAfter", fill=0), 8, 7)
    L.add(timeseries("Loss per rank", "Training loss of each rank's last step.",
                     [target(f"lightkeeper_loss{{{R}}}", "rank {{rank}}")]), 16, 7)
    L.add(timeseries(
        "WorkerServer cost", "CPU the rank's WorkerServer spends answering (share of one core), "
        "and its requests per second.",
        targets((f"rate(lightkeeper_worker_server_cpu_seconds_total{{{R}}}[{RI}])",
                 "rank {{rank}} CPU share"),
                (f"rate(lightkeeper_worker_server_requests_total{{{R}}}[{RI}])",
                 "rank {{rank}} requests/s")),
        min_=0), 16, 7)
    L.add(stat("Faults injected", "Faults injected into the selected ranks (testing only).",
               [target(f"sum(lightkeeper_faults_injected{{{R}}})", "faults")],
               thresholds_=P.thresholds((None, "green"), (1, "orange"))), 8, 7)

    variables = [
        P.datasource_variable(), _job_var(),
        P.query_variable("replica_group", "Replica group",
                         f"label_values(lightkeeper_step{{{J}}}, replica_group)"),
        P.query_variable("rank", "Rank", f"label_values(lightkeeper_step{{{G}}}, rank)"),
    ]
    return P.dashboard(
        UID_DRILLDOWN, "Lightkeeper / Replica group and rank drill-down",
        "One replica group or rank in detail: phases, pending collectives, step-time "
        "distribution, and links to each rank's stacks, Flight Recorder dump and state.",
        [TAG], variables, L, links=LINKS)


# --- 3. monitor health --------------------------------------------------------------------------
def monitor_health() -> dict:
    L = Layout()
    L.row("Monitor")
    L.add(stat("Ranks known", "Ranks the monitor polls.",
               [target(f"sum(lightkeeper_monitor_ranks_known{{{J}}})", "known")]), 4, 4)
    L.add(stat("Ranks up", "Ranks that answered the last sweep.",
               [target(f"sum(lightkeeper_monitor_ranks_up{{{J}}})", "up")]), 4, 4)
    L.add(stat("Ranks unreachable", "Ranks that did not answer the last sweep (not those whose "
               "training finished).",
               [target(f"sum(lightkeeper_monitor_ranks_unreachable{{{J}}})", "unreachable")],
               thresholds_=P.thresholds((None, "green"), (1, "red"))), 4, 4)
    L.add(stat("Open findings", "Findings the monitor currently holds open.",
               [target(f"sum(lightkeeper_monitor_open_findings{{{J}}})", "open")],
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
        targets((f"sum(lightkeeper_monitor_ranks_known{{{J}}})", "known"),
                (f"sum(lightkeeper_monitor_ranks_up{{{J}}})", "up"),
                (f"sum(lightkeeper_monitor_ranks_unreachable{{{J}}})", "unreachable"),
                (f"sum(lightkeeper_monitor_ranks_finished{{{J}}})", "finished"),
                ("sum(" + step_growth(f"lightkeeper_monitor_ranks_lost_total{{{J}}}") + ")",
                 "lost")),
        interpolation="stepAfter", fill=0, min_=0), 6, 8)
    L.add(timeseries(
        "Poll errors by reason", "Failed polls per second: timeout, connection, http_status, "
        "bad_response.",
        [target(f"sum by (reason) (rate(lightkeeper_monitor_poll_errors_total{{{J}}}[{RI}]))",
                "{{reason}}")], min_=0), 6, 8)
    L.add(timeseries(
        "Rank registrations by outcome",
        "POST /v1/targets per interval: accepted, or refused (unauthorized, not_allowed, "
        "bad_request, too_many_targets, other_job). Refusals mean ranks the monitor does not "
        "poll.",
        [target(step_events("lightkeeper_monitor_registrations_total", J, "outcome"),
                "{{outcome}}")],
        draw="bars", fill=80, min_=0), 12, 6)
    L.add(timeseries(
        "Ranks verified / unverified by reason",
        "Ranks whose claims the Lighthouse and their peers confirm (only their answers are "
        "evidence for a finding), and the others by reason (shown, never evidence).",
        targets((f"sum(lightkeeper_monitor_ranks_verified{{{J}}})", "verified"),
                (f"sum by (reason) (lightkeeper_monitor_ranks_unverified{{{J}}})",
                 "unverified: {{reason}}")),
        interpolation="stepAfter", fill=0, min_=0), 8, 6)
    L.add(stat("Lighthouse readable",
               "Whether the monitor read and understood the Lighthouse's status at its last "
               "sweep; without it no rank is verified and nothing is evicted.",
               [target(f"min(lightkeeper_monitor_lighthouse_up{{{J}}})", "lighthouse")],
               mappings=P.value_mappings({"1": ("read", "green"),
                                          "0": ("unreadable: no eviction", "red")})), 4, 6)

    L.row("Lighthouse settings")
    _lighthouse_settings_panels(L)

    L.row("Findings, evictions and held-back decisions")
    L.add(timeseries(
        "Findings by kind", "Confirmed findings per interval, by kind.",
        [target(step_events("lightkeeper_monitor_findings_total", J, "kind"), "{{kind}}")],
        draw="bars", fill=80, min_=0), 8, 8)
    L.add(timeseries(
        "Open findings by kind", "Findings currently open, by kind.",
        [target(f"sum by (kind) (lightkeeper_monitor_open_findings{{{J}}})", "{{kind}}")],
        interpolation="stepAfter", min_=0), 8, 8)
    L.add(timeseries(
        "Evictions by replica group", "Kill requests the monitor sent, per interval.",
        [target(step_events("lightkeeper_monitor_evictions_total", J, "replica_group"),
                "group {{replica_group}}")], draw="bars", fill=80, min_=0), 8, 8)
    L.add(timeseries(
        "Eviction decisions (evict / hold)",
        "What the monitor decided for each confirmed finding: evict, or hold back (dry run, "
        "eviction budget, quorum too small, ...), per interval.",
        [target(step_events("lightkeeper_monitor_eviction_decisions_total", J,
                            "decision, reason"), "{{decision}}: {{reason}}")],
        draw="bars", fill=80, min_=0), 14, 8)
    L.add(table(
        "Decisions in the time range", "Eviction decisions over the dashboard's time range.",
        [target(events("lightkeeper_monitor_eviction_decisions_total", J, "decision, reason",
                       "$__range"), "", instant=True, fmt="table")],
        transformations=[{"id": "organize", "options": {
            "excludeByName": {"Time": True}, "renameByName": {"Value": "decisions"}}}]), 10, 8)

    L.row("Replica groups as the monitor sees them")
    L.add(P.state_timeline(
        "Replica groups in the quorum (monitor)",
        "From the Lighthouse's view, including groups whose ranks are gone.",
        [target(f"max by (replica_group) "
                f"(lightkeeper_monitor_replica_group_in_quorum{{{J}}})", "group {{replica_group}}")],
        mappings=IN_QUORUM, thresholds_=P.thresholds((None, "red"), (1, "green"))), 12, 7)
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
        [TAG], [P.datasource_variable(), _job_var()], L, annotations, LINKS)


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
               [target(f"sum({warnings})", "warnings")],
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


# --- output -------------------------------------------------------------------------------------
def build_dashboards() -> dict[str, dict]:
    """File name -> dashboard JSON, for every dashboard Lightkeeper ships."""
    return {
        "job-overview.json": job_overview(),
        "rank-drilldown.json": rank_drilldown(),
        "monitor-health.json": monitor_health(),
    }


def render_json(obj: dict) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def expected_files() -> dict[Path, str]:
    """Every generated file (absolute path) and the text it must contain."""
    from .promconfig import render_prometheus_yml
    from .rules import render_rules, render_rules_test

    files = {GENERATED_DIR / name: render_json(d) for name, d in build_dashboards().items()}
    files[PROMETHEUS_DIR / "prometheus.yml"] = render_prometheus_yml()
    files[PROMETHEUS_DIR / "rules.yml"] = render_rules()
    files[PROMETHEUS_DIR / "rules_test.yml"] = render_rules_test()
    return files


def stale_files() -> list[Path]:
    """Generated files whose committed content differs from what the code builds now."""
    out = []
    for path, text in expected_files().items():
        try:
            current = path.read_text()
        except FileNotFoundError:
            current = None
        if current != text:
            out.append(path)
    return out


def write_all() -> list[Path]:
    """(Re)write every generated file; returns those that changed."""
    changed = []
    for path, text in expected_files().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed.append(path)
    return changed
