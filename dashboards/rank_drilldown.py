"""The Replica group and rank drill-down dashboard: one replica group or rank in detail."""

from __future__ import annotations

from . import panels as P
from .common import LINKS, TAG, UID_DRILLDOWN, job_variable
from .panels import Layout, stat, table, target, targets, timeseries
from .promql import (
    PHASE_COLORS,
    PHASES,
    RANK_HEALS,
    RI,
    G,
    J,
    R,
    phase_code_expr,
    step_quantile,
)


def phase_mappings() -> list[dict]:
    return P.value_mappings({str(i): (p, PHASE_COLORS[p]) for i, p in enumerate(PHASES, start=1)})


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
        links=links, sort_by="rank", unit="none",  # a step of 123456 is not "123 K"
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
        targets((step_quantile(0.5, "rank", R), "rank {{rank}} p50"),
                (step_quantile(0.95, "rank", R), "rank {{rank}} p95"),
                (step_quantile(0.99, "rank", R), "rank {{rank}} p99")),
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
        "Commits, commit failures and heals per rank", "Per second, per rank (heals recorded "
        "by rules.yml, a restarted rank's heal before its first scrape included).",
        targets((f"rate(lightkeeper_commits_total{{{R}}}[{RI}])", "rank {{rank}} commits"),
                (f"rate(lightkeeper_commit_failures_total{{{R}}}[{RI}])",
                 "rank {{rank}} commit failures"),
                # the recorded growth over the whole interval, not over the records present
                (f"sum_over_time({RANK_HEALS}{{{R}}}[{RI}]) / ({RI}_ms / 1000)",
                 "rank {{rank}} heals")),
        unit="suffix:/s", min_=0), 8, 7)
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
        P.datasource_variable(), job_variable(),
        P.query_variable("replica_group", "Replica group",
                         f"label_values(lightkeeper_step{{{J}}}, replica_group)"),
        P.query_variable("rank", "Rank", f"label_values(lightkeeper_step{{{G}}}, rank)"),
    ]
    return P.dashboard(
        UID_DRILLDOWN, "Lightkeeper / Replica group and rank drill-down",
        "One replica group or rank in detail: phases, pending collectives, step-time "
        "distribution, and links to each rank's stacks, Flight Recorder dump and state.",
        [TAG], variables, L, links=LINKS)
