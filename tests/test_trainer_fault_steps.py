"""At which step a one-off fault strikes, and which faults a group takes: the real training loop
(``train()``, one rank, in this process) over a stand-in for torchft's Manager, and the injector.

The stand-in behaves as torchft 0.2.0's Manager does for a one-rank group (``use_async_quorum``):
``start_quorum`` returns at once and a heal sets the step on the quorum thread, so
``current_step()`` changes only once the quorum is waited on (``wait_quorum``, which
``allreduce`` and ``should_commit`` also do).
"""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest

from trainer.config import TrainConfig
from trainer.faults import FaultInjector, FaultSpecError, check_fits_group, parse_fault


class AsyncQuorumManager:
    """``heals``: quorum number -> the step that quorum heals this group to; ``failed``: the
    quorum numbers whose step does not commit; ``errored``: the quorum numbers whose process
    group or heal fails (torchft reports the error and returns without healing; the step does
    not commit). ``on_wait`` is called while ``wait_quorum`` blocks for a quorum."""

    def __init__(self, heals: dict[int, int], failed: tuple[int, ...] = (),
                 errored: tuple[int, ...] = (), on_wait=None) -> None:
        self.heals, self.failed, self.errored_quorums = heals, failed, errored
        self.on_wait = on_wait
        self.quorums = 0
        self.pending: tuple[int | None, bool] | None = None
        self.error: Exception | None = None
        self.step = 0
        self.allreduced: list[tuple[int, int]] = []  # (step, elements) of each all_reduce
        self.transport = None

    def __call__(self, **kw):  # torchft.Manager(...)
        self.transport = kw["checkpoint_transport"]
        return self

    def start_quorum(self, *args, **kwargs) -> None:
        self.error = None
        self.pending = (self.heals.get(self.quorums), self.quorums in self.errored_quorums)
        self.quorums += 1

    def wait_quorum(self) -> None:
        if self.pending is not None:  # blocks until the quorum is known (once a quorum)
            if self.on_wait is not None:
                self.on_wait()
            (heal, errored), self.pending = self.pending, None
            if errored:
                self.error = RuntimeError("pg configure failed")
            elif heal is not None:
                self.step = heal

    def errored(self):
        return self.error

    def current_step(self) -> int:
        return self.step

    def state_dict(self) -> dict:  # what a heal from a group of another size puts back
        return {"step": self.step, "batches_committed": 0}

    def allreduce(self, tensor):
        self.wait_quorum()
        self.allreduced.append((self.step, tensor.numel()))
        return SimpleNamespace(wait=lambda: tensor)

    def should_commit(self, timeout=None) -> bool:
        self.wait_quorum()
        ok = self.quorums - 1 not in self.failed and self.error is None
        self.step += ok
        return ok

    def shutdown(self, wait: bool = True) -> None:
        self.transport.shutdown(wait=False)


def run_train(monkeypatch, manager: AsyncQuorumManager, faults: list[str], steps: int,
              worker_server: bool = False) -> None:
    # imported here, not at collection: torch costs every pytest-xdist worker a second
    import torch
    import torchft

    from trainer.loop import train

    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "RANK",
                 "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    # what train() sets for itself, given back after the test
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torchft, "Manager", manager)
    cfg = TrainConfig(lighthouse="http://127.0.0.1:1", steps=steps, faults=faults,
                      worker_server=worker_server, torch_threads=torch.get_num_threads(),
                      connect_timeout_s=5)
    assert train(cfg) == 0


def mismatched_at(manager: AsyncQuorumManager) -> list[int]:
    """The steps whose all_reduce carried the mismatch fault's extra element."""
    usual = min(n for _, n in manager.allreduced)
    return [step for step, n in manager.allreduced if n > usual]


def test_a_fault_at_the_step_a_one_rank_group_heals_to_strikes_there(monkeypatch):
    """The step was read before the async quorum healed the group: a fault at the heal step
    struck one step late."""
    manager = AsyncQuorumManager(heals={1: 5})  # trained step 0, then fell behind: healed to 5
    run_train(monkeypatch, manager, ["mismatch:at_step=5"], steps=8)
    assert [s for s, _ in manager.allreduced] == [0, 5, 6, 7]
    assert mismatched_at(manager) == [5]


def test_a_late_joiner_never_acts_on_a_fault_the_job_passed(monkeypatch, capsys):
    """A process that joined at step 3 acted on at_step=0 at its first iteration (read as 0)."""
    manager = AsyncQuorumManager(heals={0: 3})
    run_train(monkeypatch, manager, ["mismatch:at_step=0"], steps=6)
    assert [s for s, _ in manager.allreduced] == [3, 4, 5]
    assert mismatched_at(manager) == []
    err = capsys.readouterr().err
    assert err.count("fault 'mismatch:at_step=0': this process joined the job at step 3, past "
                     "step 0: not struck") == 1, err


def test_a_restart_that_heals_to_its_fault_step_does_not_strike_again(monkeypatch, capsys):
    """The job stood at step 3, where this fault stopped it: the restarted process, given the
    same --inject, healed to 3 and struck again (every restart, until torchrun gave up)."""
    manager = AsyncQuorumManager(heals={0: 3})
    run_train(monkeypatch, manager, ["mismatch:at_step=3"], steps=6)
    assert mismatched_at(manager) == []
    assert "joined the job at step 3, at its step: not struck" in capsys.readouterr().err


def test_a_failed_commit_at_the_heal_step_is_logged_as_failed(monkeypatch, caplog):
    manager = AsyncQuorumManager(heals={1: 5}, failed=(1,))
    with caplog.at_level(logging.INFO, logger="lightkeeper.trainer"):
        run_train(monkeypatch, manager, [], steps=7)
    logged = [re.search(r"step=(\d+) .* committed=(\w+)", r.getMessage()).groups()
              for r in caplog.records if r.name == "lightkeeper.trainer"]
    assert logged == [("1", "True"), ("5", "False"), ("6", "True"), ("7", "True")]


def test_a_one_rank_group_waiting_for_its_quorum_shows_phase_quorum(monkeypatch):
    """While the loop waited for a one-rank group's async quorum /v1/state said "forward" (set
    as start_quorum returns): the monitor reads that as a quorum asked for and not yet waited
    on, so a first quorum that never formed got the wrong stuck_starting why."""
    import requests

    from trainer.model import TinyTransformerLM
    from worker_server import WorkerServer

    servers: list = []
    start = WorkerServer.start.__func__

    def started(cls, *args, **kwargs):
        servers.append(start(cls, *args, **kwargs))
        return servers[-1]

    def phase() -> str:
        return requests.get(servers[0].url + "/v1/state", timeout=5).json()["phase"]

    forward = TinyTransformerLM.forward
    in_forward: list[str] = []

    def timed_forward(self, tokens):
        in_forward.append(phase())
        return forward(self, tokens)

    monkeypatch.setattr(WorkerServer, "start", classmethod(started))
    monkeypatch.setattr(TinyTransformerLM, "forward", timed_forward)
    in_wait: list[str] = []
    manager = AsyncQuorumManager(heals={1: 4}, on_wait=lambda: in_wait.append(phase()))
    run_train(monkeypatch, manager, [], steps=6, worker_server=True)
    assert in_wait == ["quorum"] * 3 and in_forward == ["forward"] * 3


def test_a_step_whose_quorum_errored_strikes_no_one_off_and_its_rerun_does(monkeypatch):
    """torchft discards a step whose quorum errored (its process group or heal failed) and runs
    it again: the fault struck in the discarded run, and again in the rerun."""
    manager = AsyncQuorumManager(heals={}, errored=(3,))
    run_train(monkeypatch, manager, ["mismatch:at_step=3"], steps=5)
    usual = min(n for _, n in manager.allreduced)
    assert manager.allreduced == [(0, usual), (1, usual), (2, usual), (3, usual),
                                  (3, usual + 1), (4, usual)]


@pytest.mark.parametrize("at_step, said", [
    (3, "joined the job at step 3, at its step: not struck"),
    (0, "joined the job at step 3, past step 0: not struck"),
])
def test_a_first_quorum_that_errored_is_not_the_step_the_process_started_at(
        monkeypatch, capsys, at_step, said):
    """A fresh process's first quorum errored (torchft returns before the heal, the step still
    0), then the next healed it to 3: the injector took 0 as its start, so a restart with the
    same --inject struck again at 3, and at_step=0 struck in the discarded first step."""
    manager = AsyncQuorumManager(heals={1: 3}, errored=(0,))
    run_train(monkeypatch, manager, [f"mismatch:at_step={at_step}"], steps=6)
    assert [s for s, _ in manager.allreduced] == [0, 3, 4, 5]
    assert len({n for _, n in manager.allreduced}) == 1  # no extra element, anywhere
    err = capsys.readouterr().err
    assert err.count("not struck") == 1 and said in err, err


def test_a_process_that_joined_before_the_step_and_healed_past_it_still_strikes():
    inj = FaultInjector([parse_fault("mismatch:at_step=5")], group_world_size=2)
    inj.started(1)  # healed into the job at 1, before the fault
    inj.joined(1)
    assert [inj.mismatch_at(s) for s in (2, 7, 8)] == [False, True, False]


def test_a_process_that_heals_into_the_job_at_its_faults_step_passes_it(capsys):
    inj = FaultInjector([parse_fault("mismatch:at_step=4"), parse_fault("mismatch:at_step=9")],
                        group_world_size=2)
    inj.started(4)
    assert [inj.mismatch_at(s) for s in (4, 5, 9)] == [False, False, True]
    assert capsys.readouterr().err.count("not struck") == 1
    live = FaultInjector([], group_world_size=2)
    live.started(4)
    live.inject("mismatch:at_step=4")  # posted to the running process: it strikes
    assert live.mismatch_at(4)


@pytest.mark.parametrize("spec, does", [
    ("hang:at_step=3,where=group", "blocks before the all-gather"),
    ("mismatch:at_step=3,where=group", "sends the same dtype"),
])
def test_where_group_without_a_rank_is_refused_everywhere(monkeypatch, spec, does):
    """On every rank of the group it did nothing, and was listed as struck."""
    import argparse

    from lightkeeper.scenario import parse_inject
    from trainer.cli import add_arguments, config_from_args

    words = f"where=group in '{spec}' needs rank=R"
    with pytest.raises(FaultSpecError, match=words) as e:
        check_fits_group(parse_fault(spec), 2)
    assert does in str(e.value) and f"e.g. {spec},rank=1" in str(e.value)
    with pytest.raises(FaultSpecError, match=words):
        FaultInjector([], group_world_size=2).inject(spec)  # POST /v1/faults: 400
    with pytest.raises(ValueError, match=words):
        parse_inject(f"1:{spec}", 3, 2)
    assert parse_inject(f"1.1:{spec}", 3, 2).spec == f"{spec},rank=1"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(SystemExit, match=words):
        config_from_args(p.parse_args(["--lighthouse", "http://127.0.0.1:1", "--inject", spec]))
    check_fits_group(parse_fault(f"{spec},rank=0"), 2)


def test_the_demo_injects_a_group_wide_one_off_across_groups():
    from lightkeeper.demo_stories import Stories
    from lightkeeper.scenario import FaultPlan, Scenario, parse_inject

    demo = SimpleNamespace(sc=Scenario(), args=SimpleNamespace(ranks_per_group=2))
    for kind in ("hang", "mismatch"):
        spec = Stories.live_spec(demo, FaultPlan(1, kind), 40)
        assert spec == f"{kind}:at_step=44" and parse_inject(f"1:{spec}", 3, 2).group_rank is None
        assert Stories.live_spec(demo, FaultPlan(1, kind, group_rank=1), 40) == \
            f"{kind}:at_step=44,where=group,rank=1"


def test_no_rank_and_rank_0_are_one_fault_in_a_one_rank_group(monkeypatch):
    """They stacked: --inject slow:delay=1 --inject slow:delay=1,rank=0 slept 2 s a step."""
    import argparse

    from trainer.cli import add_arguments, config_from_args

    inj = FaultInjector([parse_fault("slow:delay=1")], group_world_size=1)
    with pytest.raises(FaultSpecError, match="already injected"):
        inj.inject("slow:delay=1,rank=0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--lighthouse", "http://127.0.0.1:1", "--inject", "slow:delay=1",
                         "--inject", "slow:delay=1,rank=0"])
    with pytest.raises(SystemExit, match="given twice"):
        config_from_args(args)
    # in a bigger group no rank strikes every rank, rank=0 one: two faults
    FaultInjector([parse_fault("slow:delay=1")], group_world_size=2).inject("slow:delay=1,rank=0")
