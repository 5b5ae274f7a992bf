"""`lightkeeper train`'s flags and their documented environment fallbacks (docs/trainer.md)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from trainer.cli import add_arguments, config_from_args
from trainer.loop import pick_device


def parse(argv: list[str]):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(["--lighthouse", "http://127.0.0.1:29510", *argv]))


def test_worker_host_and_port_fall_back_to_the_environment(monkeypatch):
    monkeypatch.delenv("LIGHTKEEPER_WORKER_HOST", raising=False)
    monkeypatch.delenv("LIGHTKEEPER_WORKER_PORT", raising=False)
    cfg = parse([])
    assert (cfg.worker_host, cfg.worker_port) == ("127.0.0.1", 0)
    monkeypatch.setenv("LIGHTKEEPER_WORKER_HOST", "0.0.0.0")
    monkeypatch.setenv("LIGHTKEEPER_WORKER_PORT", "9600")
    cfg = parse([])
    assert (cfg.worker_host, cfg.worker_port) == ("0.0.0.0", 9600)
    cfg = parse(["--worker-host", "127.0.0.2", "--worker-port", "0"])  # a flag wins
    assert (cfg.worker_host, cfg.worker_port) == ("127.0.0.2", 0)


@pytest.mark.parametrize("local_rank, gpus, device", [
    (0, 0, "cpu"), (3, 0, "cpu"),        # no GPU seen: the CPU
    (5, 1, "cuda:0"),                    # one GPU a rank (srun --gpus-per-task=1)
    (0, 8, "cuda:0"), (7, 8, "cuda:7"),  # torchrun: one process per GPU
])
def test_each_rank_trains_on_the_gpu_its_launcher_gave_it(local_rank, gpus, device):
    assert pick_device(local_rank, gpus) == device


def test_a_local_rank_beyond_the_gpus_it_sees_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match=r"LOCAL_RANK=2, but this process sees 2 GPUs "
                                         r"\(CUDA_VISIBLE_DEVICES='0,1'\)"):
        pick_device(2, 2)


@pytest.mark.parametrize("argv, said", [
    (["--worker-port", "70000"], "--worker-port 70000 is not a port"),
    (["--worker-port", "-1"], "--worker-port -1 is not a port"),
    (["--pg-timeout", "-1"], "--pg-timeout must be"),
    (["--quorum-timeout", "0"], "--quorum-timeout must be"),
    (["--connect-timeout", "nan"], "--connect-timeout must be"),
    (["--step-pause", "-1"], "--step-pause must be"),
    (["--min-replica-size", "0"], "--min-replica-size must be"),
])
def test_a_bad_number_is_one_line_naming_its_flag(argv, said):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert said in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("argv, env, said", [
    (["--lighthouse", "http://10.1.2.3:29510"], {}, "the Lighthouse http://10.1.2.3:29510"),
    ([], {"MASTER_ADDR": "10.0.0.5"}, "MASTER_ADDR 10.0.0.5"),
    (["--lighthouse", "http://10.1.2.3:29510", "--worker-host", "0.0.0.0"], {}, None),
    ([], {"MASTER_ADDR": "10.0.0.5", "TORCHELASTIC_USE_AGENT_STORE": "True"}, None),  # torchrun's
    ([], {"MASTER_ADDR": "localhost"}, None),
])
def test_a_job_across_hosts_at_a_loopback_worker_host_is_said(monkeypatch, argv, env, said):
    """At the default --worker-host a rank advertises 127.0.0.1 to torchft, so a Lighthouse or
    group store on another host left the other groups waiting, unsaid, to reach or heal from it;
    now one line says so (and which flag)."""
    from trainer.cli import unreachable

    monkeypatch.delenv("LIGHTKEEPER_WORKER_HOST", raising=False)
    why = unreachable(parse(argv), env)
    if said is None:
        assert why is None, why
    else:
        assert why.startswith(f"{said} is not on loopback, but this rank advertises 127.0.0.1 "
                              "to torchft") and "--worker-host 0.0.0.0" in why, why


def test_several_local_ranks_on_the_one_gpu_they_see_is_a_clear_error(monkeypatch):
    """torchrun's ranks all see the host's one GPU: each took cuda:0, and NCCL refused the group
    at its first collective ("Duplicate GPU detected")."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ValueError, match=r"LOCAL_RANK=1 of LOCAL_WORLD_SIZE=2 ranks on this "
                                         r"host, but it has 1 GPU \(CUDA_VISIBLE_DEVICES unset\)"):
        pick_device(1, 1, local_world_size=2)
    with pytest.raises(ValueError, match="Duplicate GPU"):
        pick_device(0, 1, local_world_size=2)
    assert pick_device(0, 1, local_world_size=1) == "cuda:0"
    assert pick_device(1, 2, local_world_size=2) == "cuda:1"
    assert pick_device(1, 0, local_world_size=2) == "cpu"


@pytest.mark.parametrize("visible", ["3", "GPU-5f2a", "0,1"])
def test_a_launcher_that_sets_cuda_visible_devices_is_trusted_with_one_gpu_a_rank(
        monkeypatch, visible):
    """torchrun with a wrapper setting CUDA_VISIBLE_DEVICES=$LOCAL_RANK, or srun
    --gpus-per-task=1 exporting LOCAL_WORLD_SIZE, gives each rank its own GPU: they were
    refused, as one process cannot tell that from ranks sharing the one GPU they see."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert pick_device(1, 1, local_world_size=2) == "cuda:0"
    assert pick_device(3, 1, local_world_size=4) == "cuda:0"


def test_a_bad_local_world_size_is_a_usage_error_before_torch(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(SystemExit, match="LOCAL_WORLD_SIZE='two' is not an integer"):
        parse([])


def test_a_bad_cuda_timing_is_a_usage_error_before_torch(monkeypatch, capsys):
    # with --no-worker-server the step timer raised it after the process group was set up
    from trainer.cli import run

    monkeypatch.setenv("LIGHTKEEPER_CUDA_TIMING", "sometimes")
    said = "LIGHTKEEPER_CUDA_TIMING='sometimes': expected one of"
    with pytest.raises(SystemExit, match=said):
        parse(["--no-worker-server"])
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert run(p.parse_args(["--lighthouse", "http://127.0.0.1:29510",
                             "--no-worker-server"])) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, said", [
    (["--inject", "hang:at=3"], "argument --inject: "),
    (["--inject", "slow:delay=1e6"], "argument --inject: "),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["--cross-group", "mpi"], "argument --cross-group: invalid choice: 'mpi'"),
    (["--bogus"], "unrecognized arguments: --bogus"),  # the command's, not the top level's
])
def test_a_value_argparse_refuses_is_one_line_too(argv, said):
    """trainer.md says a bad flag value is one line on stderr and status 2: argparse printed its
    whole usage block first. Run as an operator runs it."""
    res = subprocess.run([sys.executable, "-m", "lightkeeper.cli", "train", *argv],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith(f"lightkeeper train: error: {said}"), res.stderr
