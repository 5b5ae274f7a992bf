"""A replica group that saves a checkpoint while the others wait in the next step's
cross-group all_reduce is not hung (docs/monitor.md, hang), and the save shows as phase
``checkpoint`` in its ranks' ``/v1/state`` (docs/worker_server.md).

On a real 3-group torchft job whose group 0 saved 9 s after ``zero_grad`` (its quorum joined,
so the others issued the all_reduce), the monitor evicted group 0 mid-save; the detectors here
get the view that job gave."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import urllib.request
from types import SimpleNamespace

import pytest

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from tests.support.hook import hooked_env
from tests.test_monitor_detectors import T0, Job, sweep
from worker_server import RankIdentity, RankState, WorkerServer
from worker_server.checkpoint import checkpointing, patch

# torch's dcp warns that a no_dist save is a single process's: it is, on purpose
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def saving_group_0(timeout_s: float) -> tuple[Job, Detectors, list]:
    """A 3 x 2 job after 20 steps (3 s hang threshold) whose group 0 writes a checkpoint from
    T0 + 0.5 on while groups 1 and 2 wait for it in the cross-group all_reduce; the findings of
    sweeps up to 12 s in."""
    job = Job()
    det = Detectors(DetectorConfig(hang_floor_s=3.0, hang_factor=3.0,
                                   checkpoint_timeout_s=timeout_s))
    job.steps(20, now=T0)
    sweep(det, job, T0)
    job.fr.ft_collective("all_reduce", [[1000]], absent=[0, 1])
    found = []
    for t in (1.0, 2.0, 3.5, 5.0, 7.0, 9.0, 12.0):
        for r in (2, 3, 4, 5):
            job.wait(r, "cross", t - 0.2, phase="allreduce")
        for r in (0, 1):
            job.wait(r, None)
            job.states[r].update(phase="checkpoint", phase_since=T0 + 0.5)
        found += sweep(det, job, T0 + t)
    return job, det, found


def test_a_group_saving_a_checkpoint_is_not_hung_nor_anything_else(caplog):
    job, det, found = saving_group_0(timeout_s=1800.0)
    assert found == [] and det.open_findings() == []
    held = [r.getMessage() for r in caplog.records if "hang held" in r.getMessage()]
    # aged from T0 + 1, when the monitor first saw the save (its own clock), not the rank's
    assert held == ["hang held: replica group 0 rank(s) [0, 1] write a checkpoint (2s of "
                    "--checkpoint-timeout 1800s), the others wait for it"], held
    # the save ends (one slow step for group 0): still nothing, straggler included
    job.steps(1, late_group={0: 11.5}, now=T0 + 13)
    for t in (13.0, 14.0, 15.0):
        job.steps(3, now=T0 + t)
        assert sweep(det, job, T0 + t) == []


def test_a_checkpoint_past_its_timeout_is_a_hang_again():
    _, _, found = saving_group_0(timeout_s=5.0)
    assert [(f.kind, f.replica_group, f.ranks) for f in found] == [("hang", 0, [0, 1])]
    assert found[0].confirmed_at >= T0 + 5.5  # held while the phase was younger than the timeout


# --- the rank side: a real torch.distributed.checkpoint save, single process -----------------

def _phase(server) -> str:
    with urllib.request.urlopen(f"{server.url}/v1/state", timeout=10) as r:
        return json.load(r)["phase"]


class Probe:
    """A Stateful DCP asks for its state inside the save: it reads the rank's /v1/state then."""

    def __init__(self, server, fail: bool = False) -> None:
        self.server, self.fail, self.seen = server, fail, []

    def state_dict(self):
        self.seen.append(_phase(self.server))
        if self.fail:
            raise RuntimeError("disk full")
        import torch  # not at collection: torch costs every pytest-xdist worker a second

        return {"w": torch.ones(4)}

    def load_state_dict(self, sd) -> None:
        pass


@pytest.fixture
def server():
    # the wrapping is installed when a Manager is instrumented; a real torchft Manager needs a
    # Lighthouse and process groups, and the wrapping does not read it: a stand-in is attached
    s = WorkerServer(RankState(RankIdentity())).serve()
    try:
        s.attach(SimpleNamespace())
        s.state.set_phase("optimizer")
        yield s
    finally:
        s.stop()


def test_dcp_save_says_checkpoint_while_it_runs_and_the_phase_before_after(server, tmp_path):
    import torch.distributed.checkpoint as dcp

    probe = Probe(server)
    dcp.save({"model": probe}, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    assert probe.seen == ["checkpoint"] and _phase(server) == "optimizer"
    failing = Probe(server, fail=True)
    with pytest.raises(RuntimeError, match="disk full"):
        dcp.save({"model": failing}, checkpoint_id=str(tmp_path / "bad"), no_dist=True)
    assert failing.seen == ["checkpoint"] and _phase(server) == "optimizer"
    with checkpointing():  # a save made another way, marked by the loop
        assert _phase(server) == "checkpoint"
    assert _phase(server) == "optimizer"


def test_dcp_async_save_says_checkpoint_for_its_synchronous_part_only(server, tmp_path):
    import torch.distributed.checkpoint as dcp

    release = threading.Event()

    class HeldWriter(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            release.wait(30)  # the upload, on torch's thread, until the test has looked
            return super().write_data(plan, planner)

    probe = Probe(server)
    future = dcp.async_save({"model": probe}, storage_writer=HeldWriter(str(tmp_path / "a")),
                            no_dist=True)
    try:
        assert probe.seen == ["checkpoint"]
        # the upload runs on and the loop with it: the phase is the loop's again
        assert _phase(server) == "optimizer" and not future.done()
    finally:
        release.set()
    future.result(timeout=30)
    assert _phase(server) == "optimizer"


def test_a_saver_that_cannot_be_wrapped_is_one_line_and_nothing_else(capfd):
    assert patch(SimpleNamespace(save=lambda: None)) is False  # a torch without async_save
    assert capfd.readouterr().err == (
        "[lightkeeper] cannot mark torch.distributed.checkpoint's saves as phase checkpoint "
        "(AttributeError: 'types.SimpleNamespace' object has no attribute 'async_save'); "
        "training goes on\n")


# lightkeeper run's hook in a fresh interpreter: a stand-in torchft (its Manager needs a
# Lighthouse; the hook only wraps its __init__), the real torch.distributed.checkpoint: its
# save bound by name before the Manager exists, and the module used after it
ZERO_CODE = textwrap.dedent('''
    import json, sys, urllib.request
    from torch.distributed.checkpoint import save as bound_early
    import torchft.manager
    from worker_server import autostart
    manager = torchft.manager.Manager(replica_id="job_0")
    url = autostart.started_server().url + "/v1/state"
    phase = lambda: json.load(urllib.request.urlopen(url, timeout=10))["phase"]
    before = phase()
    import torch, torch.distributed.checkpoint as dcp
    seen = []
    class Probe:
        def state_dict(self):
            seen.append(phase())
            return {"w": torch.ones(2)}
        def load_state_dict(self, sd):
            pass
    dcp.save({"m": Probe()}, checkpoint_id=sys.argv[1], no_dist=True)
    bound_early({"m": Probe()}, checkpoint_id=sys.argv[1] + "-early", no_dist=True)
    print(json.dumps({"before": before, "during": seen, "after": phase()}))
''')


def test_lightkeeper_runs_hook_marks_dcp_saves_bound_before_or_after_the_manager(tmp_path):
    env = hooked_env(tmp_path)
    res = subprocess.run([sys.executable, "-c", ZERO_CODE, str(tmp_path / "ckpt")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.splitlines()[-1])
    assert out == {"before": "starting", "during": ["checkpoint"] * 2, "after": "starting"}, out
