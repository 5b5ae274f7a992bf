"""The --inject grammar: good specs parse, bad ones fail with a message that names the problem;
rank-level faults strike only their rank, and what depends on the group is checked against it."""

import re
import time

import pytest
import requests

from trainer.faults import (
    Fault,
    FaultInjector,
    FaultSpecError,
    check_fits_group,
    gpu_stall,
    parse_fault,
)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("slow:delay=0.5", Fault("slow", "slow:delay=0.5", delay=0.5)),
        ("slow:delay=2,from_step=10", Fault("slow", "slow:delay=2,from_step=10", delay=2.0, from_step=10)),
        ("hang:at_step=7", Fault("hang", "hang:at_step=7", at_step=7)),
        ("mismatch:at_step=3", Fault("mismatch", "mismatch:at_step=3", at_step=3)),
        ("crash:at_step=0", Fault("crash", "crash:at_step=0", at_step=0)),
        ("slow_compute:factor=3", Fault("slow_compute", "slow_compute:factor=3", factor=3.0)),
        ("slow_compute:delay=0.25,from_step=4,rank=1",
         Fault("slow_compute", "slow_compute:delay=0.25,from_step=4,rank=1", delay=0.25,
               from_step=4, rank=1)),
        ("hang:at_step=5,where=group,rank=1",
         Fault("hang", "hang:at_step=5,where=group,rank=1", at_step=5, where="group", rank=1)),
        ("hang:at_step=5,where=cross", Fault("hang", "hang:at_step=5,where=cross", at_step=5)),
        ("mismatch:at_step=2,where=group",
         Fault("mismatch", "mismatch:at_step=2,where=group", at_step=2, where="group")),
        ("crash:at_step=9,rank=0", Fault("crash", "crash:at_step=9,rank=0", at_step=9, rank=0)),
        ("slow:delay=1,rank=3", Fault("slow", "slow:delay=1,rank=3", delay=1.0, rank=3)),
        ("slow_link:mbit=20,from_step=4",
         Fault("slow_link", "slow_link:mbit=20,from_step=4", mbit=20.0, from_step=4)),
        ("partition:at_step=6", Fault("partition", "partition:at_step=6", at_step=6)),
        ("host_offline:at_step=6", Fault("host_offline", "host_offline:at_step=6", at_step=6)),
    ],
)
def test_valid_specs_parse(spec, expected):
    assert parse_fault(spec) == expected


@pytest.mark.parametrize(
    "spec, words",
    [
        ("explode:at_step=1", "unknown fault kind 'explode'"),
        ("hang", "has no parameters"),
        ("hang:", "has no parameters"),
        ("hang:step=3", "unknown parameter 'step'"),
        ("hang:at_step=three", "must be an integer"),
        ("slow:delay=fast", "must be a number"),
        ("slow:from_step=3", "slow needs delay"),
        ("hang:at_step=-1", "must be >= 0"),
        ("slow:delay=1,delay=2", "given twice"),
        ("hang:at_step", "is not KEY=VALUE"),
        ("hang:at_step=3,where=gpu", "where in 'hang:at_step=3,where=gpu' must be cross or group"),
        ("mismatch:at_step=3,where=", "must be cross or group, got ''"),
        ("crash:at_step=3,where=group", "crash takes at_step, rank; got unknown parameter 'where'"),
        ("slow:delay=1,where=group", "unknown parameter 'where'"),
        ("slow_compute:factor=1", "factor in 'slow_compute:factor=1' must be > 1"),
        ("slow_compute:factor=0.5", "must be > 1"),
        ("slow_compute:factor=2,delay=1", "slow_compute takes factor or delay, not both"),
        ("slow_compute:from_step=2", "slow_compute takes factor or delay, one of them"),
        ("slow_compute:factor=inf", "must be a finite number"),
        ("slow_compute:delay=nan", "must be a finite number"),
        ("hang:at_step=1,rank=-1", "rank in 'hang:at_step=1,rank=-1' must be >= 0"),
        ("hang:at_step=1,rank=one", "rank in 'hang:at_step=1,rank=one' must be an integer"),
        ("slow_link:mbit=0", "a link that carries nothing is host_offline"),
        ("slow:delay=0", "delay in 'slow:delay=0' must be > 0 seconds"),
        ("slow_compute:delay=0", "must be > 0 seconds"),
        ("slow_link:from_step=2", "slow_link needs mbit"),
        ("partition:at_step=3,rank=1", "partition takes at_step; got unknown parameter 'rank'"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec, words):
    with pytest.raises(FaultSpecError, match=words.replace("(", r"\(")):
        parse_fault(spec)


@pytest.mark.parametrize(
    "spec, size, words",
    [
        ("hang:at_step=1,rank=2", 2, r"rank=2 in 'hang:at_step=1,rank=2' is out of range: this "
                                     r"replica group has 2 ranks \(0..1\)"),
        ("slow_compute:factor=2,rank=1", 1, r"has 1 rank \(0..0\)"),
        ("hang:at_step=1,where=group", 1, "where=group .* needs a replica group of several ranks"),
        ("mismatch:at_step=1,where=group,rank=0", 1, "needs a replica group of several ranks"),
    ],
)
def test_what_only_the_group_can_check_is_checked_against_it(spec, size, words):
    with pytest.raises(FaultSpecError, match=words):
        check_fits_group(parse_fault(spec), size)
    with pytest.raises(FaultSpecError, match=words):
        FaultInjector([parse_fault(spec)], group_rank=0, group_world_size=size)
    injector = FaultInjector([], group_rank=0, group_world_size=size)
    with pytest.raises(FaultSpecError, match=words):
        injector.inject(spec)  # POST /v1/faults
    assert injector.faults == []


@pytest.mark.parametrize("spec", ["slow_link:mbit=5", "partition:at_step=3",
                                  "host_offline:at_step=3"])
def test_network_faults_are_the_hosts_not_the_trainers(spec, capsys):
    """A process cannot degrade its own host's link: the trainer refuses a network fault at its
    command line, at start and live, naming who applies it."""
    from lightkeeper.cli import main

    with pytest.raises(FaultSpecError, match="network fault of the group's host"):
        FaultInjector([parse_fault(spec)])
    with pytest.raises(FaultSpecError, match="lightkeeper demo --inject GROUP:"):
        FaultInjector([]).inject(spec)
    with pytest.raises(SystemExit):
        main(["train", "--lighthouse", "http://127.0.0.1:1", "--inject", spec])
    assert "network fault of the group's host" in capsys.readouterr().err


def test_slow_applies_from_step_and_mismatch_only_at_its_step():
    slow = parse_fault("slow:delay=0.1,from_step=5")
    assert not slow.applies(4) and slow.applies(5) and slow.applies(50)
    injector = FaultInjector([parse_fault("mismatch:at_step=3")])
    assert [s for s in range(6) if injector.mismatch_at(s)] == [3]
    assert not any(injector.group_mismatch_at(s) for s in range(6))


def test_a_one_off_fault_a_rank_never_runs_exactly_acts_at_the_first_step_past_it():
    """A group healing from step 0 to step 5 never runs step 3, and a fault posted at step 13
    for step 2 was accepted: both were silently never struck."""
    struck = []
    injector = FaultInjector([parse_fault("mismatch:at_step=3")])
    injector.on_strike = struck.append
    assert not injector.mismatch_at(0)
    injector.joined(0)  # it committed step 0, then fell behind and healed past step 3
    assert injector.mismatch_at(5) and injector.mismatch_at(5)  # step 5 tried again: again
    assert not injector.mismatch_at(6) and len(struck) == 1
    live = FaultInjector([])
    assert not live.mismatch_at(12)
    live.joined(12)
    live.inject("mismatch:at_step=2")
    assert live.mismatch_at(13) and not live.mismatch_at(14)


@pytest.mark.parametrize("first_read", [None, 0], ids=["sync_quorum", "async_quorum"])
def test_a_process_that_joins_past_a_one_off_fault_says_so_and_never_strikes(capsys, first_read):
    """A late group, or a process restarted by torchrun or a pod's restart policy with the same
    --inject, heals to step 57 on joining: striking then would crash or hang every incarnation
    of the group again. With an async quorum (one-rank groups) its first step reads 0, its
    first commit is 57."""
    restarted = FaultInjector([parse_fault("mismatch:at_step=3")])
    if first_read is not None:
        assert not restarted.mismatch_at(first_read)
        restarted.joined(57)
    assert not any(restarted.mismatch_at(s) for s in (57, 57, 58))
    err = capsys.readouterr().err
    assert err.count("[lightkeeper] fault 'mismatch:at_step=3': this process joined the job at "
                     "step 57, past step 3: not struck") == 1, err


@pytest.mark.parametrize("env, argv, words", [
    ({}, ["--steps", "10", "--inject", "crash:at_step=10"],
     "at_step 10 is never reached: the job trains steps 0 to 9"),
    ({"LOCAL_RANK": "abc"}, [], "LOCAL_RANK='abc' is not an integer"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, ["--worker-port", "65535"],
     "--worker-port 65535 + group rank 1 is past 65535"),
])
def test_cli_refuses_before_torch_what_would_fail_later(monkeypatch, env, argv, words):
    import argparse

    from trainer.cli import add_arguments, config_from_args

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(SystemExit, match=re.escape(words)):
        config_from_args(p.parse_args(["--lighthouse", "http://127.0.0.1:1", *argv]))


def test_a_rank_acts_only_on_faults_for_it():
    specs = ["slow_compute:delay=0.2,rank=1", "mismatch:at_step=2,where=group,rank=0",
             "mismatch:at_step=3", "hang:at_step=9,where=group,rank=1"]
    rank0 = FaultInjector([parse_fault(s) for s in specs], group_rank=0, group_world_size=2)
    rank1 = FaultInjector([parse_fault(s) for s in specs], group_rank=1, group_world_size=2)
    assert rank0.specs == [specs[1], specs[2]]
    assert rank1.specs == [specs[0], specs[2], specs[3]]
    assert [s for s in range(5) if rank0.group_mismatch_at(s)] == [2]
    assert [s for s in range(5) if rank1.group_mismatch_at(s)] == []
    assert [s for s in range(5) if rank0.mismatch_at(s)] == [3]
    assert [s for s in range(5) if rank1.mismatch_at(s)] == [3]
    assert rank0.throttle(0, 1.0) == 0.0  # rank 1's slow_compute never sleeps here
    rank0.before_forward(9)  # rank 1's hang: returns at once on rank 0
    live = rank0.inject("crash:at_step=4,rank=1")
    assert not live.targets(0) and rank0.specs == [specs[1], specs[2]]
    rank0.before_allreduce(4)  # rank 1's crash: rank 0 lives on


def test_slow_compute_sleeps_its_factor_or_delay_from_its_step():
    by_factor = FaultInjector([parse_fault("slow_compute:factor=3,from_step=2")])
    assert by_factor.throttle(1, 0.05) == 0.0
    started = time.monotonic()
    slept = by_factor.throttle(2, 0.05)  # (3 - 1) x 0.05 s of compute
    assert slept == pytest.approx(0.1) and time.monotonic() - started >= 0.1
    by_delay = FaultInjector([parse_fault("slow_compute:delay=0.05")])
    assert by_delay.throttle(0, 10.0) == pytest.approx(0.05)  # delay does not scale


def test_slow_compute_spends_its_time_through_stretch():
    # on CUDA the loop sets stretch to gpu_stall: the time is the GPU's, not the host's
    spent: list[float] = []
    injector = FaultInjector([parse_fault("slow_compute:delay=0.3,from_step=1")])
    injector.stretch = spent.append
    assert injector.throttle(0, 1.0) == 0.0 and spent == []
    assert injector.throttle(1, 1.0) == pytest.approx(0.3) and spent == [pytest.approx(0.3)]


def test_gpu_stall_without_a_gpu_sleeps_on_the_host_and_says_so_once(capsys):
    # no CUDA on this machine (CI's neither): the GPU path itself ran on an H100 (docs/gpu.md, 7)
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this checks the fallback of a process without a GPU")
    stall = gpu_stall("cuda:0")
    started = time.monotonic()
    stall(0.05)
    stall(0.05)
    assert time.monotonic() - started >= 0.1
    err = capsys.readouterr().err
    assert err.count("slow_compute: no GPU stall") == 1 and "the host sleeps instead" in err


def test_cli_rejects_a_bad_spec_before_starting(capsys):
    from lightkeeper.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["train", "--lighthouse", "http://127.0.0.1:1", "--inject", "hang:at=3"])
    assert exc.value.code == 2
    assert "unknown parameter 'at'" in capsys.readouterr().err


@pytest.mark.parametrize("spec, words", [
    ("hang:at_step=3,where=group", "needs a replica group of several ranks"),
    ("slow_compute:factor=2,rank=1", "rank=1 in 'slow_compute:factor=2,rank=1' is out of range"),
])
def test_cli_rejects_a_spec_that_does_not_fit_the_group(monkeypatch, spec, words):
    import argparse

    from trainer.cli import add_arguments, config_from_args

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--lighthouse", "http://127.0.0.1:1", "--inject", spec])
    with pytest.raises(SystemExit, match=words):
        config_from_args(args)


def test_post_faults_takes_the_same_grammar_and_checks_the_group():
    """A real WorkerServer with the trainer's handler shape: a spec for another rank is accepted
    (the demo posts to every rank of a group) but not listed here; one that does not fit is 400."""
    from worker_server import RankIdentity, RankState, WorkerServer

    injector = FaultInjector([], group_rank=0, group_world_size=2)
    state = RankState(RankIdentity(group_rank=0, group_world_size=2))

    def handler(spec):
        if injector.inject(spec).targets(0):
            state.faults.append(spec)

    srv = WorkerServer(state, fault_handler=handler, fault_token="t0k").serve()
    try:
        auth = {"Authorization": "Bearer t0k"}
        url = srv.url + "/v1/faults"
        for spec, words in [("hang:at_step=4,rank=2", "out of range"),
                            ("slow_compute:factor=1", "must be > 1"),
                            ("hang:at_step=4,where=sideways", "must be cross or group")]:
            r = requests.post(url, json={"spec": spec}, headers=auth, timeout=5)
            assert r.status_code == 400 and words in r.json()["error"], (spec, r.text)
        r = requests.post(url, json={"spec": "slow_compute:delay=0.5,rank=1"}, headers=auth,
                          timeout=5)
        assert r.status_code == 200 and r.json()["faults"] == []
        r = requests.post(url, json={"spec": "hang:at_step=7,where=group,rank=0"}, headers=auth,
                          timeout=5)
        assert r.status_code == 200 and r.json()["faults"] == ["hang:at_step=7,where=group,rank=0"]
        assert [f.spec for f in injector.faults] == ["hang:at_step=7,where=group,rank=0"]
        assert requests.get(srv.url + "/v1/state", timeout=5).json()["faults"] == [
            "hang:at_step=7,where=group,rank=0"]
    finally:
        srv.stop()
