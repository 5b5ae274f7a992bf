"""Numbers in a rank's ``/v1/state`` that the monitor computes with: past int64, not finite or
not a scalar, the answer is that rank's ``bad_response``, never an API 500 or a detector off.

In process: the view the poller's answers make (ViewBuilder) and what the API serves of it
(``ranks_json``); the detectors on tests/test_monitor_detectors.py's simulated job.
"""

from __future__ import annotations

import json
import time

import pytest

from monitor.api.views import ranks_json
from monitor.config import DetectorConfig
from monitor.detect import Detectors
from monitor.evidence.rank import plain_shape, valid_state
from monitor.evidence.view import ViewBuilder
from monitor.poll.discovery import Target
from monitor.poll.packed_state import pack_state
from monitor.poll.poller import RankPoll
from tests.support.monitor_sim import rank_state
from tests.test_monitor_detectors import T0, Job, sweep

HUGE = 10**400  # float() of it raises OverflowError


def answered(body: str) -> dict:
    """The answer as the poller reads it: msgspec refuses an int this big, ``json.loads`` (its
    fallback) reads a Python int."""
    return pack_state(json.loads(body))


@pytest.mark.parametrize("key, value", [
    ("phase_since", HUGE), ("phase_since", -HUGE), ("phase_since", float("inf")),
    ("phase_since", float("nan")), ("step", 2**63), ("quorum_id", -2**63 - 1),
    ("group_rank", 2**70), ("started_at", HUGE), ("started_at", float("nan")),
    ("pid", 2**64), ("num_participants", 2**80), ("commit_failures", 2**64),
    ("group_world_size", 2**64)], ids=lambda v: v if isinstance(v, str) else repr(v)[:12])
def test_a_number_past_int64_or_not_finite_is_no_state(key, value):
    s = rank_state(1, 0)
    s[key] = value
    why = valid_state(s)
    said = "not a finite number" if key in ("phase_since", "started_at") else "beyond int64"
    assert why is not None and why.startswith(key) and why.endswith(said)
    assert plain_shape(s) is None


@pytest.mark.parametrize("key, value", [
    ("pid", [1]), ("pid", {"a": 1}), ("pid", "1"), ("pid", True), ("pid", 1.5),
    ("started_at", [1]), ("started_at", {}), ("started_at", "now"), ("started_at", False)])
def test_a_pid_or_start_time_that_is_no_scalar_is_no_state(key, value):
    """Both are hashed together (Liveness.stuck_starting): a list there raised TypeError in the
    detector, which the guard caught, so stuck_starting was off for every rank."""
    s = rank_state(1, 0)
    s[key] = value
    assert valid_state(s) == f"{key} is {value!r}"
    assert plain_shape(s) is None


def test_the_bounds_themselves_and_null_are_a_state():
    s = rank_state(1, 0)
    s.update(step=2**63 - 1, quorum_id=-2**63, phase_since=1e308, pid=None, started_at=None)
    assert valid_state(s) is None and plain_shape(s) is not None
    s.update(pid=4242, started_at=int(time.time()), phase_since=int(time.time()))
    assert valid_state(s) is None and plain_shape(s) is not None


def test_a_huge_phase_since_is_that_ranks_bad_response_and_the_api_answers():
    """``phase_since`` 10**400 passed the check, then ``now - phase_since`` in /v1/ranks,
    /v1/cluster and / raised OverflowError: every reader got a 500 while one rank sent it."""
    now = time.time()
    targets = [Target(f"http://127.0.0.1:{9000 + r}", "static") for r in range(2)]
    good = json.dumps(rank_state(0, 0, now=now))
    bad = json.dumps(rank_state(1, 1, now=now)).replace(
        f'"phase_since": {json.dumps(now - 0.01)}', f'"phase_since": {HUGE}')
    assert str(HUGE) in bad
    vb = ViewBuilder()
    for sweep_at in (now, now + 1):  # the first view, then the one built from the last
        view = vb.update(targets, {t.url: RankPoll(t.url, True, data=answered(b), at=sweep_at)
                                   for t, b in zip(targets, (good, bad), strict=True)},
                         now=sweep_at, polled={t.url for t in targets})
        rows = {r["url"]: r for r in ranks_json(view, sweep_at + 0.5)}
        assert rows[targets[0].url]["reachable"] and rows[targets[0].url]["phase_for_s"] > 0
        row = rows[targets[1].url]
        assert not row["reachable"] and row["reason"] == "bad_response"
        assert "phase_since" in row["error"] and "not a finite number" in row["error"]
        json.dumps(rows, allow_nan=False)


def test_stuck_starting_still_found_while_another_rank_sends_a_list_as_its_pid():
    job = Job()
    det = Detectors(DetectorConfig(starting_timeout_s=10))
    job.steps(5, now=T0)
    for r in job.members(2):  # group 2 never reached a quorum
        job.states[r].update(quorum_id=-1, phase="starting", replica_id=None, step=0,
                             participating=False)
    for r in job.members(0) + job.members(1):  # the quorum of the other two
        job.states[r].update(num_participants=2)
    job.states[0].update(pid=[1], started_at={"at": 1})  # group 0's rank 0: garbage
    found = []
    for t in (0, 5, 10.5):
        found += [(t, f) for f in sweep(det, job, T0 + t)]
    assert [(t, f.kind, f.replica_group, f.ranks) for t, f in found] == \
        [(10.5, "stuck_starting", 2, [4, 5])]
    gone = job.view(T0 + 11).ranks[job.targets[0].url]
    assert not gone.reachable and gone.reason == "bad_response" and "pid" in gone.error
