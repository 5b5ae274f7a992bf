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


def job_variable() -> dict:
    # one job at a time: two jobs' replica group 0, quorum ids and monitors would add up
    return P.query_variable("job", "Training job", "label_values(lightkeeper_step, job)",
                            multi=False, include_all=False)


IN_QUORUM = P.value_mappings({"1": ("in quorum", "green"), "0": ("out of quorum", "red")})
