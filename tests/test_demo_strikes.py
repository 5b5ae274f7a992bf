"""When a fault strikes: the injector says so once per fault, the rank serves it in /v1/state.

The demo reads ``faults_struck_at`` to report when each fault actually struck (rather than when
it was armed). Real FaultInjector and RankState; hangs are driven on a thread of their own.
"""

from __future__ import annotations

import threading
import time

from trainer.faults import FaultInjector, parse_fault
from worker_server.state import RankIdentity, RankState


def _injector(*specs: str, group_rank: int = 0, size: int = 2) -> tuple[FaultInjector, list]:
    inj = FaultInjector([parse_fault(s) for s in specs], group_rank, size)
    struck: list[tuple[str, float]] = []
    inj.on_strike = lambda f: struck.append((f.spec, time.time()))
    return inj, struck


def test_slow_compute_strikes_once_from_its_step():
    inj, struck = _injector("slow_compute:delay=0.01,from_step=3")
    for step in range(3):
        inj.throttle(step, 0.0)
    assert struck == []
    for step in range(3, 6):
        inj.throttle(step, 0.0)
    assert [s for s, _ in struck] == ["slow_compute:delay=0.01,from_step=3"]


def test_slow_crossgroup_and_mismatch_strike_at_their_hooks():
    inj, struck = _injector("slow:delay=0.01,from_step=2", "mismatch:at_step=4,where=group,rank=0",
                            "mismatch:at_step=5")
    for step in range(6):
        inj.before_forward(step)
        inj.group_mismatch_at(step)
        inj.throttle(step, 0.0)
        inj.before_allreduce(step)
        inj.mismatch_at(step)
    assert [s for s, _ in struck] == ["slow:delay=0.01,from_step=2",
                                      "mismatch:at_step=4,where=group,rank=0", "mismatch:at_step=5"]


def test_a_fault_for_another_rank_never_strikes_here():
    inj, struck = _injector("slow_compute:factor=3,rank=1", group_rank=0)
    inj.throttle(0, 0.01)
    assert struck == []
    live = inj.inject("hang:at_step=1,where=group,rank=1")
    assert not live.targets(0)
    assert struck == []


def test_hang_strikes_before_it_blocks():
    inj, struck = _injector("hang:at_step=2,where=group,rank=1", group_rank=1)
    t = threading.Thread(target=lambda: [inj.before_forward(s) for s in range(5)], daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while not struck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [s for s, _ in struck] == ["hang:at_step=2,where=group,rank=1"]
    assert t.is_alive()  # it struck and now blocks, as a hung rank does


def test_rank_state_serves_the_first_strike_time():
    state = RankState(RankIdentity(replica_group=1, group_rank=1, group_world_size=2),
                      faults=["slow_compute:factor=3,rank=1"])
    assert state.snapshot()["faults_struck_at"] == {}
    before = time.time()
    state.fault_struck("slow_compute:factor=3,rank=1")
    first = state.snapshot()["faults_struck_at"]["slow_compute:factor=3,rank=1"]
    state.fault_struck("slow_compute:factor=3,rank=1")  # later strikes keep the first time
    snap = state.snapshot()
    assert before <= first <= time.time()
    assert snap["faults_struck_at"] == {"slow_compute:factor=3,rank=1": first}
    assert snap["faults"] == ["slow_compute:factor=3,rank=1"]
