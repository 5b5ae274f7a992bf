"""The Job overview dashboard: the job at a glance (quorum, goodput, hosts, progress, step
time per replica group, the monitor's findings and evictions)."""

from __future__ import annotations

from . import panels as P
from .common import IN_QUORUM, LINKS, STEPS_PER_S, TAG, UID_OVERVIEW, job_variable
from .panels import Layout, stat, table, target, targets, timeseries
from .promql import (
    GROUP_COMPUTE,
    QUORUM_CHANGED,
    RI,
    J,
    active_sum,
    finding_events,
    group_heals,
    group_steps,
    not_standby,
    step_events,
    step_mean,
    step_quantile,
)

# Per group, 1 in the quorum, 0 out: as its ranks say (lightkeeper_participating), unless the
# monitor sees it out of the newest quorum (a hung rank keeps saying 1, at its old quorum)
IN_OR_OUT = (f"min by (replica_group) (lightkeeper_participating{{{J}}} "
             f"or lightkeeper_monitor_replica_group_in_quorum{{{J}}})")
# a hung group's ranks still say their old quorum's participants
PARTICIPANTS = (f"max(lightkeeper_quorum_participants{{{J}}} unless on (replica_group) "
                f"(lightkeeper_monitor_replica_group_in_quorum{{{J}}} == 0))")


def job_overview() -> dict:
    L = Layout()
    L.row("Quorum")
    L.add(stat("Replica groups in quorum",
               "Replica groups whose ranks take part in the current step (lightkeeper_participating) "
               "and that the monitor sees in the newest quorum.",
               [target(f"count({IN_OR_OUT} == 1) or vector(0)", "in quorum")],
               thresholds_=P.thresholds((None, "red"), (1, "green"))), 4, 4)
    L.add(stat("Replica groups out of quorum",
               "Replica groups that report not participating, or that the monitor knows but that "
               "are not in the Lighthouse's quorum (e.g. a group whose ranks are dead).",
               [target(f"count({IN_OR_OUT} == 0) or vector(0)", "out of quorum")],
               thresholds_=P.thresholds((None, "green"), (1, "orange"))), 4, 4)
    L.add(stat("Quorum id", "The current torchft quorum id (highest over ranks).",
               [target(f"max(lightkeeper_quorum_id{{{J}}})", "quorum id")]), 4, 4)
    L.add(stat("Quorum participants", "Replica groups in the current quorum (as the ranks of "
               "the groups the monitor sees in it say).",
               [target(PARTICIPANTS, "participants")]), 4, 4)
    L.add(stat("Committed step", "Highest committed step over all ranks.",
               [target(f"max(lightkeeper_step{{{J}}})", "step")], unit="none", decimals=0,
               graph="area"), 4, 4)
    L.add(stat("Step rate", "Committed steps per second of the job (fastest replica group).",
               [target(f"max(rate(lightkeeper_commits_total{{{J}}}[{RI}]))", "steps/s")],
               unit=STEPS_PER_S, decimals=2, graph="area"), 4, 4)
    L.add(P.state_timeline(
        "Replica groups in and out of the quorum",
        "Per replica group: green while its ranks take part in the step, red while they sit out "
        "or the monitor sees the group out of the newest quorum.",
        [target(IN_OR_OUT, "group {{replica_group}}")],
        mappings=IN_QUORUM, thresholds_=P.thresholds((None, "red"), (1, "green"))), 12, 7)
    L.add(timeseries(
        "Quorum id and participants over time",
        "Each quorum change (new quorum id) rebuilds torchft's process group; participants is "
        "the number of replica groups in it.",
        targets((f"max(lightkeeper_quorum_id{{{J}}})", "quorum id"),
                (PARTICIPANTS, "participants")),
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
        targets((step_mean("replica_group", J), "group {{replica_group}} mean"),
                (step_quantile(0.95, "replica_group", J), "group {{replica_group}} p95")),
        unit="s", min_=0, legend_calcs=["mean", "max"]), 12, 8)
    L.add(timeseries(
        "Commit failures, heals and quorum changes",
        "Per replica group and interval: steps whose should_commit returned False, recoveries "
        "from a peer (recorded by rules.yml, a restarted rank's heal before its first scrape "
        "included), and process-group rebuilds.",
        targets((group_steps("lightkeeper_commit_failures_total"),
                 "group {{replica_group}} commit failures"),
                (group_heals(J), "group {{replica_group}} heals"),
                (group_steps("lightkeeper_quorum_changes_total"),
                 "group {{replica_group}} quorum changes")),
        draw="bars", fill=80, min_=0), 12, 8)
    L.add(timeseries(
        "Relative compute time",
        "Each group's compute a step (its slowest rank's step time less its waits in "
        "collectives) over the median of all groups: the group the others wait for stands out, "
        "while every group's step time stretches alike. Above the dashed line for 2 minutes the "
        "group is a straggler (LightkeeperReplicaGroupStraggling).",
        # a stalled group's 0/0 (NaN) sorts first in a quantile: left out of the median
        [target(f"{GROUP_COMPUTE} / on (job) group_left quantile by (job) "
                f"(0.5, {GROUP_COMPUTE} >= 0)", "group {{replica_group}}")],
        min_=0, thresholds_=P.thresholds((None, "green"), (1.5, "red")),
        threshold_style="dashed"), 12, 8)
    L.add(timeseries("Loss per replica group", "Training loss of the last step (mean over ranks).",
                     [target(f"avg by (replica_group) (lightkeeper_loss{{{J}}})",
                             "group {{replica_group}}")]), 12, 7)
    L.add(timeseries(
        "Findings and evictions",
        "Confirmed findings by kind and eviction requests by replica group (monitor).",
        targets((finding_events(J, "kind"),
                 "finding: {{kind}}"),
                # only the monitor that sends a kill counts it, a --lead one standing by for
                # its own --shard included: no standby copy to leave out
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
            finding_events(J, "job, kind, replica_group")
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
        [TAG], [P.datasource_variable(), job_variable()], L, annotations, LINKS)


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
    # sharded monitors (--shard) each export their own slice's ledger: the job's capacity is
    # their sum, its ratio theirs weighted by it (a standby shard's gauges are another's stale
    # copy; a ratio is NaN before its ledger's first sweep)
    expected = not_standby(f"lightkeeper_monitor_expected_replica_groups{{{J}}}")
    ratio = f"(lightkeeper_monitor_goodput_ratio{{{J}}} >= 0)"
    L.add(stat("Goodput since the ledger began",
               "Replica-seconds spent in steps committed at healthy pace / (expected replica "
               "groups x wall seconds), since the monitor's goodput ledger began (it survives "
               "monitor restarts). Sharded monitors: their ratios weighted by their expected "
               "replica groups. GET /v1/goodput on the monitor has the incidents.",
               [target(f"sum({ratio} * {expected}) / (sum({expected} and {ratio}) > 0)",
                       "goodput")],
               unit="percentunit", decimals=1,
               thresholds_=P.thresholds((None, "red"), (0.8, "orange"), (0.9, "green"))), 4, 8)
    L.add(stat("Expected replica groups",
               "The ledger's capacity: the monitor's --expected-groups, else the number of "
               "replica groups it has seen (sharded monitors: the sum of their slices').",
               [target(f"sum({expected})", "expected")]), 4, 8)
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
        # a former holder of a shard, standing by now, keeps its ratios frozen: not a 2nd line
        [target(not_standby(f"lightkeeper_monitor_replica_group_goodput_ratio{{{J}}}"),
                "group {{replica_group}}")],
        unit="percentunit", min_=0, max_=1), 8, 8)


BACK_TO_OK = "back to ok"
HOST_STATE = P.value_mappings({"suspect": ("suspect", "orange"),
                                "quarantined": ("quarantined", "red"),
                                "released": ("released", "blue")})


# most severe first: a host two ledgers disagree on (quarantined in one, suspect in another)
# is one host, in the state that holds it hardest
HOST_SEVERITY = ("quarantined", "suspect", "released")


def _severest(by: str) -> str:
    """Each host's quarantine state series (``max by (by)`` over the job's monitors), in its
    most severe state only."""
    terms, worse = [], []
    for s in HOST_SEVERITY:
        sel = f'lightkeeper_monitor_host_quarantine_state{{{J}, state="{s}"}}'
        term = f"max by ({by}) ({sel})"
        terms.append(f"({term} unless on (host) ({' or '.join(worse)}))" if worse else term)
        worse.append(sel)
    return " or ".join(terms)


def _host_panels(L: Layout) -> None:
    """The monitor's host ledger (docs/quarantine.md): how many hosts are quarantined, which
    hosts are not ok and why, and quarantine/release actions that fail. The per-host series
    exist only for hosts that are not ok, so a healthy job shows "0" and an empty table.

    Every panel counts hosts, each once over all the job's monitors: a host may be in several
    ledgers (shards whose groups share it; a standby keeps its own, acting as the holder does),
    so per-monitor counts would add it twice, or miss it where a standby holds it."""
    ok = f'lightkeeper_monitor_hosts{{{J}, state="ok"}}'
    failed = f"lightkeeper_monitor_host_action_failed{{{J}}}"
    L.add(stat("Quarantined hosts",
               "Hosts a monitor's host ledger holds quarantined (each once, whatever the "
               "monitors of the job that hold it): their groups are evicted "
               "when they come back there (quarantined_host findings), and the sinks "
               "(--action) cordon or drain them. GET /v1/hosts on the monitor has the evidence; "
               "POST /v1/hosts/{host}/release lifts it.",
               [target(f'count(max by (host) (lightkeeper_monitor_host_quarantine_state'
                       f'{{{J}, state="quarantined"}}) == 1) or vector(0)', "quarantined")],
               thresholds_=P.thresholds((None, "green"), (1, "orange"))), 4, 8)
    L.add(stat("Hosts with a failing action",
               "Hosts whose last quarantine or release action (k8s, slurm, exec, webhook) "
               "failed or is being retried: a quarantine decided but not carried out.",
               [target(f"count(count by (host) ({failed} == 1)) or vector(0)", "failing")],
               thresholds_=P.thresholds((None, "green"), (1, "red"))), 4, 8)
    L.add(timeseries(
        "Hosts by state",
        "Hosts in the monitor's ledger by state: suspect (offences counting, not yet "
        "quarantined, or held back by a rail), quarantined, released, back to ok (offended "
        "before, nothing counting now, still in the ledger; such a host has no series of its "
        "own, so the line adds up the monitors' counts, a standby's left out). A host that "
        "monitors' ledgers hold in different states counts once, in the most severe "
        "(quarantined, suspect, released). Only hosts that ever offended are in a ledger: a "
        "healthy host counts in no line.",
        # a state no host is in reads 0, not "no data"; a ledger's "ok" hosts are only those
        # that offended before, not every healthy host: named so
        [target(f"count by (state) ({_severest('host, state')}) "
                f'or label_replace({active_sum(ok, "state")}, "state", "{BACK_TO_OK}", '
                f'"state", "ok") '
                f'or 0 * max by (state) (lightkeeper_monitor_hosts{{{J}, state!="ok"}})',
                "{{state}}")],
        interpolation="stepAfter", fill=0, min_=0,
        overrides=[_fixed_color("quarantined", "red"), _fixed_color("suspect", "orange"),
                   _fixed_color("released", "blue"), _fixed_color(BACK_TO_OK, "green")]), 8, 8)
    L.add(timeseries(
        "Failing host actions by sink",
        "Hosts whose last action failed or is being retried (retries back off 2 s, 4 s, 8 s "
        "... then go on every 5 minutes until done), by sink.",
        [target(f"count by (sink) (max by (host, sink) ({failed}) == 1)", "{{sink}}")],
        interpolation="stepAfter", fill=0, min_=0), 8, 8)
    key = "job, host"
    L.add(table(
        "Hosts not ok",
        "One row per host that is not ok: its node, state (the most severe where the "
        "monitors' ledgers differ), the offences that count now, and the sink whose last "
        "action failed (empty when none). A healthy job has no row.",
        targets((_severest(f"{key}, node, state"), ""),
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
