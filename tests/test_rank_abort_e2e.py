"""``POST /v1/abort`` on a real torchft job: a peer whose host drops off the network, and the
survivors let out of the cross-group all_reduce long before the process group's timeout.

A real Lighthouse and 3 one-rank replica groups training over torchft's ``ProcessGroupGloo``
(60 s timeout). Group 2 is told (``POST /v1/faults``) to hang before its all_reduce of a step a
few ahead, so groups 0 and 1 block in that all_reduce, then its process is SIGSTOPped: its
heartbeats stop and its TCP connections stay open, as when a host drops off the network. Without
the token the abort is refused and the survivors stay blocked; with it they fail the collective,
do not commit that step, and commit again in a quorum of two, the same processes throughout.
And a survivor only waiting for its next quorum (a user's loop, on each torchft the suite has) is
neither picked by the monitor nor aborted.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import requests

from lightkeeper.cluster import LocalCluster
from lightkeeper.processes import stop_process, wait_until
from monitor.act.survivors import Gone, blocked_survivors
from tests.conftest import IN_CI
from tests.support.workers import struck_state, try_state
from tests.test_rank_wire_auth_rounds import view_of
from tests.test_torchft_versions_e2e import (
    EXAMPLE,
    FLAVOURS,
    HOOK_LINE,
    LIGHTKEEPER,
    Job,
    available,
)

pytestmark = pytest.mark.e2e

EXIT_TOKEN = "abort-e2e-exit"
FAULT_TOKEN = "abort-e2e-faults"
PG_TIMEOUT_S = 60.0


def post(url: str, path: str, body: dict, token: str | None) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.post(url + path, json=body, headers=headers, timeout=10)


def test_abort_lets_survivors_out_of_a_collective_on_a_stopped_peer(tmp_path):
    c = LocalCluster(tmp_path, num_groups=3, steps=100_000, pg_timeout_s=PG_TIMEOUT_S,
                     heartbeat_timeout_ms=2000, join_timeout_ms=3000,
                     extra_env={"LIGHTKEEPER_EXIT_TOKEN": EXIT_TOKEN,
                                "LIGHTKEEPER_FAULT_TOKEN": FAULT_TOKEN})
    victim = None
    try:
        c.start(timeout=120)
        urls = {g: c.groups[g].worker_urls[0] for g in range(3)}
        survivors = [urls[0], urls[1]]

        def all_three():
            states = [try_state(u) for u in urls.values()]
            return states if all(s and s["num_participants"] == 3 and s["commits"] >= 2
                                 for s in states) else None

        wait_until(all_three, 120, interval=0.3, what="3 groups committing in one quorum")
        spec = f"hang:at_step={max(try_state(u)['step'] for u in urls.values()) + 5}"
        r = post(urls[2], "/v1/faults", {"spec": spec}, FAULT_TOKEN)
        assert r.status_code == 200, r.text
        at = struck_state(urls[2], spec)["step"]

        def blocked(min_s: float):
            states = [try_state(u) for u in survivors]
            return states if all(s and s["step"] == at and s["timing"]["waiting"]
                                 and s["timing"]["waiting"]["scope"] == "cross"
                                 and s["timing"]["waiting"]["seconds"] >= min_s
                                 for s in states) else None

        before = wait_until(lambda: blocked(0.5), 60, interval=0.2,
                            what=f"groups 0 and 1 blocked in the all_reduce of step {at}")
        blocked_since = time.monotonic() - max(s["timing"]["waiting"]["seconds"] for s in before)
        victim = c.groups[2].proc
        os.kill(victim.pid, signal.SIGSTOP)  # its host is gone: no heartbeat, sockets open

        body = {"reason": "group 2's host is unreachable", "decision": 41}
        for u in survivors:
            assert post(u, "/v1/abort", body, None).status_code == 401
            assert post(u, "/v1/abort", body, "wrong").status_code == 401
        # refused: still blocked in the same all_reduce, seconds later
        wait_until(lambda: blocked(3.0), 10, interval=0.2, what="the survivors still blocked")

        for u in survivors:
            r = post(u, "/v1/abort", body, EXIT_TOKEN)
            assert r.status_code == 202, r.text
            done = r.json()
            assert done["aborted"] is True and done["decision"] == 41, done
            assert done["pg"] == "ProcessGroupGloo", done
            assert done["mechanism"] == "gloo_connections", done

        def committing_without_group_2():
            states = [try_state(u) for u in survivors]
            return states if all(s and s["step"] > at and s["num_participants"] == 2
                                 for s in states) else None

        after = wait_until(committing_without_group_2, 25, interval=0.2,
                           what="the survivors committing again in a quorum of two")
        # well inside the 60 s the all_reduce would otherwise have waited
        assert time.monotonic() - blocked_since < PG_TIMEOUT_S - 20
        for g, (b, a) in enumerate(zip(before, after, strict=True)):
            proc = c.groups[g].proc
            assert a["pid"] == b["pid"] == proc.pid and proc.poll() is None  # not restarted
            assert a["commit_failures"] > b["commit_failures"]  # the aborted step did not commit
            log = c.groups[g].log()
            assert log.count("abort of the cross-group process group") == 1, log[-3000:]
            assert "decision 41: group 2's host is unreachable" in log
    finally:
        if victim is not None:
            stop_process(victim, grace=0)  # SIGKILL ends a stopped process too
        c.stop()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_survivor_waiting_for_its_next_quorum_is_not_aborted(tmp_path, flavour):
    """examples/torchft_two_groups.py (torchft's default asynchronous quorum, ``Manager.allreduce``
    by hand) under ``lightkeeper run``, per torchft; group 1 is SIGKILLed and the Lighthouse (6 s
    heartbeat timeout) keeps the next quorum waiting for it. torchft's allreduce waits for that
    quorum before any collective: the rank said phase ``allreduce``, the monitor counted it
    blocked in the old quorum's collective, and it took the abort; its report failed the next
    quorum's step, whose peers waited out the process group's timeout (a reviewer's 3-group job:
    10 s). Now it says phase ``quorum``, the monitor's selection leaves it out, the rank refuses
    (409), and its first step in the new quorum commits."""
    if why := available(flavour):
        if IN_CI:
            pytest.fail(why)
        pytest.skip(why)
    job = Job(flavour, tmp_path)
    try:  # its Lighthouse, slow to drop a group (its --join_timeout_ms given again): the
        # survivor's wait for the next quorum lasts ~6 s, 2 s of it seen before the abort
        job.start("lighthouse", [*job.lighthouse_cmd[:-2], "--join_timeout_ms", "6000",
                                 "--heartbeat_timeout_ms", "6000"])
        for g in (0, 1):
            job.start(f"group{g}", [*LIGHTKEEPER, "run", "--", sys.executable, str(EXAMPLE),
                                    "--steps", "100000"],
                      REPLICA_GROUP_ID=str(g), LIGHTKEEPER_EXIT_TOKEN=EXIT_TOKEN)
        urls = [job.wait_line(f"group{g}", HOOK_LINE)[2] for g in (0, 1)]

        def both_committing():
            states = [try_state(u) for u in urls]
            return states if all(s and s["num_participants"] == 2 and s["commits"] >= 2
                                 for s in states) else None

        gone = job.wait(both_committing, 120, "2 groups in one quorum")[1]
        stop_process(job.procs["group1"], grace=0)  # its connections close, its heartbeats stop

        def waiting_for_next_quorum():
            s = try_state(urls[0])
            w = s and s["timing"]["waiting"]
            # a collective with a killed peer fails at once: a cross-group wait this long in the
            # old quorum is the wait for the next one (the Lighthouse still hears group 1)
            return s if (w and w["scope"] == "cross" and w["seconds"] >= 2.0
                         and s["quorum_id"] == gone["quorum_id"]) else None

        waiting = job.wait(waiting_for_next_quorum, 10, "group 0 waiting for its next quorum")
        r = post(urls[0], "/v1/abort", {"reason": "group 1 is gone", "decision": 7,
                                        "quorum_id": gone["quorum_id"]}, EXIT_TOKEN)
        assert r.status_code == 409, r.text
        assert "this rank is in phase quorum" in r.json()["error"], r.text
        assert blocked_survivors(view_of({urls[0]: waiting}), Gone(
            1, gone["replica_id"], gone["quorum_id"], "unheard")) == []

        after = job.wait(lambda: (s := try_state(urls[0])) and s["quorum_id"] != waiting[
            "quorum_id"] and s["commits"] > waiting["commits"] and s, 40,
            "group 0 committing in its next quorum")
        assert after["commit_failures"] == waiting["commit_failures"]  # its first step there
        assert after["pid"] == waiting["pid"] and job.procs["group0"].poll() is None
        assert "abort of the cross-group process group" not in job.log("group0")
    finally:
        job.stop()
