"""A hang's confirming sweep runs the Flight Recorder engine once: the analysis of the drilled
group's dumps that lets the monitor skip the leaders' (``Detectors.in_group_hangs``) is the one
its detectors then judge (``Detectors.update``), the dumps being the same.

The monitor and job of tests/test_monitor_fr_leaders_skip.py: a member of one group hangs, its
leader blocks in the group's all-gather, the other groups wait across groups.
"""

from __future__ import annotations

import pytest

from monitor.analysis import analyze
from monitor.detect import detectors
from tests.test_monitor_detectors import T0, group_1_never_arrives
from tests.test_monitor_fr_leaders_skip import (
    FIRST_OVER_THRESHOLD,
    HUNG_GROUP,
    MEMBER,
    RANKS,
    JobServer,
    plant_member_hang,
    run_stall,
    sparse_job,
    wait_member_hang,
)


@pytest.fixture(scope="module")
def job_server():
    server = JobServer(sparse_job())
    yield server
    server.close()


def test_the_hang_sweep_analyses_its_dumps_once(job_server, tmp_path, monkeypatch):
    runs: list[list[int]] = []  # per engine run, the ranks it was given
    per_sweep: list[int] = []  # engine runs per sweep

    def counting(traces):
        runs.append(sorted(traces))
        return analyze(traces)

    def count_sweeps(mon) -> None:
        sweep = mon.sweep_once

        def counted():
            before = len(runs)
            try:
                return sweep()
            finally:
                per_sweep.append(len(runs) - before)
        mon.sweep_once = counted

    monkeypatch.setattr(detectors, "analyze", counting)  # every Detectors' default engine
    got = run_stall(job_server, tmp_path, plant_member_hang, wait_member_hang, count_sweeps)
    assert got["found"] == [("hang", HUNG_GROUP, [MEMBER], "in_group")]
    assert got["confirmed_t"] == FIRST_OVER_THRESHOLD
    assert got["last"]["torchft_fetched"] == 0  # the leaders' dumps skipped
    drilled = list(range(HUNG_GROUP * RANKS, (HUNG_GROUP + 1) * RANKS))
    assert per_sweep[-1] == 1 and runs[-1] == drilled
    assert max(per_sweep) == 1


def test_dumps_added_after_the_early_check_are_analysed_again(monkeypatch):
    """The leaders' dumps fetched after all (added to the same dict): the detectors judge the
    engine's run over every dump, not the drilled group's alone."""
    runs: list[list[int]] = []

    def counting(traces):
        runs.append(sorted(traces))
        return analyze(traces)

    monkeypatch.setattr(detectors, "analyze", counting)
    job, det = group_1_never_arrives(absent_in_group=[3])
    for r in (0, 1, 4, 5):
        job.wait(r, "cross", 3.3, phase="allreduce")
    job.wait(2, "group", 3.4)
    job.wait(3, None)
    now = T0 + 3.5
    view = job.view(now)
    assert det.fr_wanted(view, now)
    every = job.dumps()
    dumps = {r: every[r] for r in job.members(1)}
    runs.clear()
    assert det.in_group_hangs(view, dumps, now) == {1}
    dumps.update(every)
    found = det.update(view.evidence(), dumps, now, full_view=view)
    assert runs == [[2, 3], list(range(job.world))]
    assert [(f.kind, f.replica_group, f.ranks) for f in found] == [("hang", 1, [3])]
