"""Phase ``busy`` (worker_server.checkpoint.busy): a group's own work outside the collectives
(an eval between steps) while the others wait for it is held like a checkpoint save, up to
--checkpoint-timeout; unmarked, the same wait is a hang (docs/monitor.md, hang)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from tests.test_monitor_detectors import T0, Job, run, sweep
from worker_server import RankIdentity, RankState, WorkerServer
from worker_server.checkpoint import busy


def group_0_evaluates(phase: str, until: int = 20, **cfg) -> list:
    """A 3 x 2 job after 10 sweeps of steps whose group 0 then runs an eval in ``phase`` from
    one sweep on while groups 1 and 2 wait for it in their next all_reduce: the findings."""
    job = Job(groups=3, ranks=2, step_s=1.0)
    det = Detectors(DetectorConfig(**cfg))
    found, now = run(det, job, 10, T0, per_sweep=1)
    assert found == []
    began = now + 0.5
    for t in range(1, until + 1):
        for r in range(job.world):
            if job.group_of(r) == 0:
                job.wait(r, None)
                job.states[r].update(phase=phase, phase_since=began)
            else:
                job.wait(r, "cross", float(t), phase="allreduce")
        found += [(t, f) for f in sweep(det, job, now + t)]
    assert det.last_error is None  # judged, not failed
    return found


def test_a_group_busy_with_an_eval_is_not_hung(caplog):
    with caplog.at_level("WARNING", logger="monitor.detect.hang"):
        assert group_0_evaluates("busy") == []
    held = [r.getMessage() for r in caplog.records if "hang held" in r.getMessage()]
    assert len(held) == 1 and "busy" in held[0], held


def test_the_same_eval_unmarked_is_a_hang():
    found = group_0_evaluates("optimizer")
    assert [(t, f.kind, f.replica_group, f.ranks, f.evidence["level"]) for t, f in found] == [
        (3, "hang", 0, [0, 1], "quorum")]


def test_busy_past_the_checkpoint_timeout_is_a_hang():
    found = group_0_evaluates("busy", until=8, checkpoint_timeout_s=5.0)
    assert [(f.kind, f.replica_group) for _, f in found] == [("hang", 0)]
    assert found[0][0] >= 5


def _phase(server) -> str:
    with urllib.request.urlopen(f"{server.url}/v1/state", timeout=10) as r:
        return json.load(r)["phase"]


def test_busy_says_phase_busy_for_the_block_and_the_phase_before_after():
    server = WorkerServer(RankState(RankIdentity())).serve()
    try:
        server.state.set_phase("optimizer")
        with busy():
            assert _phase(server) == "busy"
        assert _phase(server) == "optimizer"
        with pytest.raises(RuntimeError, match="eval failed"), busy():
            raise RuntimeError("eval failed")
        assert _phase(server) == "optimizer"
    finally:
        server.stop()
