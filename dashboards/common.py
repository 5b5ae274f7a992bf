"""What the three dashboards share: their tag and uids, the link bar between them, the
``$job`` variable and the in/out-of-quorum value mapping."""

from __future__ import annotations

from . import panels as P

TAG = "lightkeeper"
UID_OVERVIEW = "lightkeeper-job-overview"
UID_DRILLDOWN = "lightkeeper-rank-drilldown"
UID_MONITOR = "lightkeeper-monitor-health"

STEPS_PER_S = "suffix: steps/s"
LINKS = [P.dashboard_link("Lightkeeper dashboards", [TAG])]


# the jobs with ranks' series or a monitor's: a monitor of ranks that export no /metrics
# (torch's own server), or of none yet, still lists its job
JOBS = 'label_values({__name__=~"lightkeeper_step|lightkeeper_monitor_dry_run"}, job)'


def job_variable() -> dict:
    # one job at a time: two jobs' replica group 0, quorum ids and monitors would add up
    return P.query_variable("job", "Training job", JOBS, multi=False, include_all=False)


IN_QUORUM = P.value_mappings({"1": ("in quorum", "green"), "0": ("out of quorum", "red")})
