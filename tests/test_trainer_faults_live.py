"""Faults given to a running rank: a slow fault never crashes it, a fault is given once, a
one-off past --steps is refused, and what /v1/state lists matches what it says struck."""

import threading
import time

import pytest
import requests

from trainer.faults import MAX_DELAY_S, FaultInjector, FaultSpecError, parse_fault
from trainer.loop import inject_live


@pytest.mark.parametrize("spec", ["slow:delay=1e308", "slow:delay=86401",
                                  "slow_compute:delay=1e10,rank=1"])
def test_a_delay_past_one_day_is_refused_naming_the_bound(spec):
    with pytest.raises(FaultSpecError, match="must be at most 86400 seconds"):
        parse_fault(spec)
    assert parse_fault("slow:delay=86400").delay == MAX_DELAY_S


@pytest.mark.parametrize("compute_s", [1.0, 1e300])
def test_a_huge_factor_sleeps_at_most_one_day_instead_of_overflowing(compute_s):
    """(factor - 1) x compute time past threading.TIMEOUT_MAX made time.sleep raise
    OverflowError on the training thread: a slow fault became a crash."""
    spent: list[float] = []
    injector = FaultInjector([parse_fault("slow_compute:factor=1e308")])
    injector.stretch = spent.append
    assert injector.throttle(0, compute_s) == MAX_DELAY_S
    assert spent == [MAX_DELAY_S] and MAX_DELAY_S < threading.TIMEOUT_MAX


def test_a_fault_posted_again_is_refused_and_the_first_acts_once():
    """Equal faults shared one strike: a repeated slow stacked its sleeps, a one-off posted
    again after the first struck was listed and never struck."""
    struck = []
    injector = FaultInjector([parse_fault("crash:at_step=90")], group_world_size=2)
    injector.on_strike = struck.append
    assert injector.inject("mismatch:at_step=3") and injector.mismatch_at(3)
    for spec in (" mismatch:at_step=3", "crash:at_step=90"):  # after a strike; an --inject one
        with pytest.raises(FaultSpecError, match=r"already injected: \S+ \(faults cannot be "
                                                 r"removed; restart the process to clear them\)"):
            injector.inject(spec)
    assert [s for s in range(6) if injector.mismatch_at(s)] == [3]
    assert [f.spec for f in struck] == ["mismatch:at_step=3"]
    spent: list[float] = []
    injector.stretch = spent.append
    injector.inject("slow_compute:delay=0.25")
    with pytest.raises(FaultSpecError, match="already injected"):
        injector.inject("slow_compute:delay=0.25")
    assert injector.throttle(0, 1.0) == pytest.approx(0.25) and spent == [pytest.approx(0.25)]
    other_rank = "hang:at_step=7,rank=1"  # not this rank's, but given to this process all the same
    injector.inject(other_rank)
    with pytest.raises(FaultSpecError, match="already injected"):
        injector.inject(other_rank)


def test_a_live_one_off_at_or_past_steps_is_refused_as_the_cli_refuses_it():
    injector = FaultInjector([], steps=10)
    for spec in ("crash:at_step=10", "hang:at_step=12,where=cross"):
        with pytest.raises(FaultSpecError, match="is never reached: the job trains steps 0 to 9 "
                                                 r"\(--steps 10\)"):
            injector.inject(spec)
    assert injector.specs == []
    injector.inject("crash:at_step=9")
    injector.inject("slow:delay=0.1,from_step=50")  # a repeating fault: no step to reach
    assert injector.specs == ["crash:at_step=9", "slow:delay=0.1,from_step=50"]
    with pytest.raises(FaultSpecError, match="never reached"):
        FaultInjector([parse_fault("mismatch:at_step=10")], steps=10)


def test_the_route_lists_a_posted_spec_as_it_strikes_and_refuses_it_again():
    """A real WorkerServer with the trainer's handler: " slow..." was listed with its blank
    while faults_struck_at keyed it without, so nothing matched the two by spec."""
    from worker_server import RankIdentity, RankState, WorkerServer

    injector = FaultInjector([], group_rank=0, group_world_size=2, steps=100)
    state = RankState(RankIdentity(group_rank=0, group_world_size=2))
    injector.on_strike = lambda fault: state.fault_struck(fault.spec)
    srv = WorkerServer(state, fault_handler=lambda spec: inject_live(injector, state, spec),
                       fault_token="t0k").serve()
    try:
        auth = {"Authorization": "Bearer t0k"}
        url = srv.url + "/v1/faults"
        r = requests.post(url, json={"spec": " slow:delay=0.01 "}, headers=auth, timeout=5)
        assert r.status_code == 200 and r.json()["faults"] == ["slow:delay=0.01"], r.text
        assert r.json()["injected"] == "slow:delay=0.01"
        for spec, words in [("slow:delay=0.01", "already injected: slow:delay=0.01"),
                            ("crash:at_step=100", "at_step 100 is never reached"),
                            ("slow:delay=1e308", "must be at most 86400 seconds")]:
            r = requests.post(url, json={"spec": spec}, headers=auth, timeout=5)
            assert r.status_code == 400 and words in r.json()["error"], (spec, r.text)
        started = time.monotonic()
        injector.before_allreduce(0)
        assert time.monotonic() - started < 0.5  # one 0.01 s sleep, not stacked
        body = requests.get(srv.url + "/v1/state", timeout=5).json()
        assert body["faults"] == ["slow:delay=0.01"]
        assert list(body["faults_struck_at"]) == body["faults"]
    finally:
        srv.stop()


def test_the_demo_counts_a_spec_a_rank_already_took_as_injected():
    """The demo posts again when one try's answer was lost or one rank of the group failed:
    a rank that took the spec the first time refuses it now, and the demo must count it
    injected, not give the fault's story up."""
    from types import SimpleNamespace

    from lightkeeper.demo_stories import Stories
    from worker_server import RankIdentity, RankState, WorkerServer

    injector = FaultInjector([], group_rank=0, group_world_size=1, steps=100)
    state = RankState(RankIdentity(group_rank=0, group_world_size=1))
    srv = WorkerServer(state, fault_handler=lambda spec: inject_live(injector, state, spec),
                       fault_token="t0k").serve()
    try:
        demo = SimpleNamespace(http=requests.Session(), token="t0k")
        assert Stories.post_fault(demo, [srv.url], "slow:delay=0.01")
        assert Stories.post_fault(demo, [srv.url], "slow:delay=0.01")  # taken the first time
        assert not Stories.post_fault(demo, [srv.url], "slow:delay=1e308")  # a real refusal
    finally:
        srv.stop()


def test_the_same_fault_written_another_way_is_one_fault():
    """slow:delay=1 and slow:delay=1.0 do the same: posted after the other it is refused, and
    given twice at start it is refused there (two would stack)."""
    import argparse

    from trainer.cli import add_arguments, config_from_args

    injector = FaultInjector([parse_fault("slow:delay=1")], group_rank=0, group_world_size=1,
                             steps=100)
    with pytest.raises(FaultSpecError, match="already injected"):
        injector.inject("slow:delay=1.0")
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--lighthouse", "http://127.0.0.1:1", "--inject", "slow:delay=1",
                         "--inject", "slow:delay=1.0"])
    with pytest.raises(SystemExit, match="given twice"):
        config_from_args(args)


def _live_demo(url: str):
    """The demo's injection, over one real rank (group 1, rank 1 of 2) at ``url``."""
    from types import SimpleNamespace

    from lightkeeper.demo_sampling import Sampling
    from lightkeeper.demo_stories import Stories
    from lightkeeper.scenario import Scenario

    class Demo(Sampling, Stories):
        def now(self) -> float:
            return 1.0

        def wait(self, pred, timeout: float) -> bool:
            return pred()

        def event(self, kind: str, group, detail: str) -> None:
            self.events.append((kind, detail))

    demo = Demo()
    demo.http, demo.token, demo.sc = requests.Session(), "t0k", Scenario()
    demo.args = SimpleNamespace(ranks_per_group=2)
    demo.cluster = SimpleNamespace(groups={1: SimpleNamespace(worker_urls={1: url})})
    demo.latest = {1: [{"step": 10, "group_rank": 0}, {"step": 10, "group_rank": 1}]}
    demo.restarts, demo.tracks, demo.events = {}, [], []
    return demo


@pytest.mark.parametrize("kind", ["hang", "crash", "mismatch"])
@pytest.mark.parametrize("answer_lost", [False, True])
def test_the_demo_injects_one_spec_when_the_group_moves_on_during_the_post(kind, answer_lost):
    """A posted one-off strikes at the first step at or past its own; the demo posted a second
    spec, further on, when the group passed the first one's step during the POST: a hang's story
    followed the one that never struck, a crash's retry found the rank gone, two mismatches."""
    from lightkeeper.scenario import FaultPlan
    from worker_server import RankIdentity, RankState, WorkerServer

    injector = FaultInjector([], group_rank=1, group_world_size=2, steps=1000)
    state = RankState(RankIdentity(replica_group=1, group_rank=1, group_world_size=2))
    state.step_finished(10, True)
    posted: list[str] = []

    def handler(spec: str) -> str:
        posted.append(spec)
        state.step_finished(state.step + 20, True)  # the group trains on while the POST lands
        taken = inject_live(injector, state, spec)
        if answer_lost and len(posted) == 1:
            raise RuntimeError("the answer is lost: taken, and the demo cannot know it")
        return taken

    srv = WorkerServer(state, fault_handler=handler, fault_token="t0k").serve()
    try:
        demo = _live_demo(srv.url)
        demo.inject_live(FaultPlan(1, kind, group_rank=1))
    finally:
        srv.stop()
    assert len(set(posted)) == 1 and len(posted) == 1 + answer_lost, posted
    assert posted[0].startswith(f"{kind}:at_step=14,") and posted[0].endswith(",rank=1")
    assert [tr.record["spec"] for tr in demo.tracks] == posted[:1]
    assert demo.tracks[0].record["outcome"] == "pending"  # not "injection failed"
    assert [kind for kind, _ in demo.events] == ["injected"]
    assert state.faults == posted[:1]
