"""Trainer faults with real parts: a hung group's stacks and survivors.

FT-HSDP under torchrun (2 ranks per group, FSDP2 inside a group, the agent hosting the group's
store, torchft across groups) has no job of its own: its Flight Recorder evidence (the group rank
1 incarnation's cross-group ranks, torchft's gloo all_reduce across and FSDP2's all_gather inside)
is asserted on the 3 x 2 torchrun job of tests/test_demo_keep_running.py, which runs anyway."""

from __future__ import annotations

import time

import pytest
import requests

from lightkeeper.cluster import LocalCluster, wait_until
from tests.support.workers import analyze_cli, save_dumps, try_state

pytestmark = pytest.mark.e2e

FAULT_TOKEN = "faults-e2e"


@pytest.fixture
def hung_cluster(tmp_path):
    # Three groups: the Lighthouse forms a quorum only from more than half of the heartbeating
    # groups, and a hung group keeps heartbeating, so with two the survivor would wait forever.
    # The hang is posted live once all three groups step in one quorum: a hang fixed at start
    # (at_step=8) could strike and be over (the peers' 5 s timeout, a new quorum) before a slow
    # start-up returned, and the test would never see the peer waiting.
    c = LocalCluster(tmp_path, num_groups=3, steps=100_000, pg_timeout_s=5,
                     join_timeout_ms=3000, step_pause_s=0.02,
                     extra_env={"LIGHTKEEPER_FAULT_TOKEN": FAULT_TOKEN})
    try:
        c.start()
        urls = [c.groups[g].worker_urls[0] for g in range(3)]

        def stepping_together():
            states = [try_state(u) for u in urls]
            return all(s and s["num_participants"] == 3 and s["commits"] > 0 for s in states) \
                and states
        states = wait_until(stepping_together, 90, what="three groups in one quorum")
        c.hang_step = states[1]["step"] + 15
        r = requests.post(urls[1] + "/v1/faults", json={"spec": f"hang:at_step={c.hang_step}"},
                          headers={"Authorization": f"Bearer {FAULT_TOKEN}"}, timeout=5)
        assert r.status_code == 200, r.text
        yield c
    finally:
        c.stop()


def test_hang_stacks_answer_fast_and_survivor_moves_on(hung_cluster, tmp_path):
    c = hung_cluster
    hung_url, peer_url = c.groups[1].worker_urls[0], c.groups[0].worker_urls[0]
    wait_until(lambda: (s := try_state(peer_url)) and s["phase"] == "allreduce"
               and time.time() - s["phase_since"] > 1.0, 60,
               what="the peer to wait in its all_reduce")
    t0 = time.monotonic()
    hung = requests.get(hung_url + "/v1/stacks", timeout=1).text
    t1 = time.monotonic()
    peer = requests.get(peer_url + "/v1/stacks", timeout=1).text
    t2 = time.monotonic()
    assert t1 - t0 < 1.0 and t2 - t1 < 1.0
    assert "before_allreduce" in hung and "faults.py" in hung  # blocked by the injected hang
    assert "loop.py" in peer and ".wait()" in peer  # waiting on its collective
    hung_state = try_state(hung_url)
    assert hung_state["phase"] == "backward" and hung_state["step"] == c.hang_step

    # The same live dumps, analyzed as a user would: the hung rank never arrived at seq N.
    status, report = analyze_cli(*save_dumps([c.groups[g].worker_urls[0] for g in range(3)],
                                             tmp_path))
    hangs = [f for f in report["findings"] if f["kind"] == "hang"]
    assert status == 1 and hangs, report
    assert hangs[0]["culprit_ranks"] == [1]

    # Survivors survive: the peer's collective times out, the next quorum leaves the hung
    # group out (it heartbeats but never asks), and the peer commits again alone.
    resumed = wait_until(lambda: (s := try_state(peer_url)) and s["num_participants"] == 2
                         and s["step"] > c.hang_step + 1 and s, 60,
                         what="the survivors to commit again")
    assert resumed["quorum_id"] > hung_state["quorum_id"], "a new quorum without the hung group"
    assert c.groups[0].alive() and c.groups[2].alive()
