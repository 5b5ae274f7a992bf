"""``job_stall`` while a group the Lighthouse let into the quorum is still healing into it
(monitor/detect/jobwide.py): a replacement, started under a new replica id after its group was
evicted, hangs in its first step; its ranks report the quorum but do not take part in it
(``participating`` false), so the groups taking part wait for it in the cross-group all_reduce.
That is recovery or the replacement's own fault, never a job-wide network stall; with every
group taking part and blocked alike, or the replacement not among the Lighthouse's members,
the stall is still found. The replacement's hang is its own: held as a first step until
--starting-timeout, then a ``hang`` naming it (monitor/detect/hang.py). 3 groups x 2 ranks
(gloo dumps, the replacement's recorder a new process's), the real Verifier judging against
the Lighthouse's status, swept as the service does."""

from __future__ import annotations

import logging

import pytest

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from monitor.evidence.lighthouse_status import LighthouseStatus, QuorumMember
from monitor.evidence.verification import Verifier
from tests.support.frgen import _Rank
from tests.test_monitor_detectors import T0, Job

Q = 4  # the quorum the replacement heals into (the job trained at quorum 3)
NEW = "replica_group_2:replacement"
STARTING_S = 30.0  # --starting-timeout


def _lighthouse(q: int, ids: set[str]) -> LighthouseStatus:
    return LighthouseStatus(q, {i: QuorumMember(i, 5, "", 2) for i in ids},
                            dict.fromkeys(ids, 0.1), at=T0)


def sweeper(job: Job, det: Detectors, found: list):
    """A sweep as the service runs it: the real Verifier judging against the Lighthouse's
    status ``lh``, the dumps read when the detectors want them; new findings into ``found``."""
    verifier = Verifier()

    def sweep(now: float, lh: LighthouseStatus, evicted=frozenset()) -> None:
        view = job.view(now, lambda ranks, changed: verifier.judge(ranks, changed, lh, None,
                                                                   True, now))
        dumps = job.dumps() if det.fr_wanted(view.evidence(), now) else None
        found.extend(det.update(view.evidence(), dumps, now, full_view=view, evicted=evicted,
                                lighthouse=lh))
        assert det.last_error is None
    return sweep


def _run(replacement: str, lead_s: float | None = None) -> tuple[list, Detectors]:
    """Train, replace group 2, then the groups taking part block in the all_reduce for twice
    --starting-timeout. ``replacement``: ``healing`` (rank 4 heals, rank 5 hung in its first
    forward, neither taking part), ``unlisted`` (the same, but not among the Lighthouse's
    members of quorum Q) or ``joined`` (taking part and blocked like the others). ``lead_s``:
    an asynchronous quorum (rank 5 reports no quorum id before its first collective), the
    replacement seen that long before the others block."""
    job = Job()
    det = Detectors(DetectorConfig(starting_timeout_s=STARTING_S))
    found: list = []
    sweep = sweeper(job, det, found)
    now = T0
    lh = _lighthouse(3, {s["replica_id"] for s in job.states})
    for _ in range(6):
        now += 1.0
        job.steps(3, now=now)
        sweep(now, lh)
    old = job.states[4]["replica_id"]
    ids = {job.states[r]["replica_id"] for r in (0, 2)}
    lh = _lighthouse(Q, ids if replacement == "unlisted" else ids | {NEW})
    for r in (4, 5):  # the replacement is a new process: its recorder starts empty
        was = job.fr._ranks[r]
        job.fr._ranks[r] = _Rank(r, was.host, was.clock_offset_ns, was.now_ns,
                                 pg_ids={"0": 0}, next_pg_id=1)
    job.fr.quorum(Q, [0, 1, 2])
    # groups 0 and 1 enqueued the all_reduce; the replacement never did
    job.fr.ft_collective("all_reduce", [[1000]],
                         absent=() if replacement == "joined" else (4, 5))
    since = now
    for r, s in enumerate(job.states):
        s.update(quorum_id=Q, num_participants=3 if replacement == "joined" else 2)
        if r in (4, 5):
            # one that joined has healed to the others' step
            s.update(replica_id=NEW, pid=s["pid"] + 100, started_at=now - 5.0,
                     step=s["step"] if replacement == "joined" else 0,
                     participating=replacement == "joined", last_step_seconds=None,
                     recent_step_seconds=[], commits=0, heals=0,
                     timing={"recent": [], "waiting": None, "last_step": None,
                             "window": None})
    job.wait(4, None, phase="healing")
    job.wait(5, None, phase="forward")
    if lead_s is not None:
        job.states[5]["quorum_id"] = -1
        while now - since < lead_s:
            now += 1.5
            sweep(now, lh, evicted={old})
        since = now
    while now - since < 2 * STARTING_S:
        now += 1.5
        for r in range(job.world):
            if r < 4 or replacement == "joined":
                job.wait(r, "cross", now - since, phase="allreduce")
        sweep(now, lh, evicted={old})
    return found, det


def test_a_replacement_healing_into_the_quorum_is_no_job_wide_stall():
    found, det = _run("healing")
    assert "job_stall" not in [f.kind for f in found]
    assert [f for f in det.open_findings() if f.kind == "job_stall"] == []


def test_the_replacement_hung_healing_into_the_quorum_is_named_at_the_starting_timeout(caplog):
    caplog.set_level(logging.WARNING, logger="monitor.detect.hang")
    found, det = _run("healing")
    (f,) = [f for f in found if f.kind == "hang"]
    assert (f.replica_group, f.replica_id, f.ranks) == (2, NEW, [4, 5])
    assert f.evidence["never_arrived"] == [4, 5] and f.evidence["waiting_ranks"] == [0, 1, 2, 3]
    assert f.evidence["level"] == "cross_group" and f.evidence["threshold_s"] == STARTING_S
    # first_seen: when the others began waiting; held (never confirmed) until they had waited
    # --starting-timeout, named at the first sweep (1.5 s apart) past it
    assert STARTING_S <= f.confirmed_at - f.first_seen < STARTING_S + 1.5
    assert f in det.open_findings()
    held = [r.getMessage() for r in caplog.records if "hang held" in r.getMessage()]
    assert len(held) == 1 and "replica group 2 rank(s) [4, 5] have timed no step since" in held[0]
    assert "job_stall" not in [f.kind for f in found]


@pytest.mark.parametrize("lead_s", [0.0, 15.0])
def test_a_replacement_named_hung_in_its_first_step_is_not_stuck_starting_too(lead_s):
    """With an asynchronous quorum its rank in the first forward reports no quorum id, and
    `stuck_starting` (shape ``no_first_quorum``) would name the same group for the same fault:
    the hang is its name. Not opened beside it (before: the next sweep), nor left open beside
    it when its clock ran out first (seen ``lead_s`` before the others blocked): `superseded`."""
    found, det = _run("healing", lead_s)
    (hang,) = [f for f in found if f.kind == "hang"]
    assert [f.kind for f in det.open_findings()] == ["hang"]
    early = [f for f in found if f.kind == "stuck_starting"]
    assert [(f.confirmed_at < hang.confirmed_at, f.resolution, f.resolved_at) for f in early] \
        == ([] if lead_s == 0 else [(True, "superseded", hang.confirmed_at)])


@pytest.mark.parametrize("replacement", ["joined", "unlisted"])
def test_the_stall_is_still_found_with_every_group_taking_part_or_the_group_unlisted(
        replacement):
    found, det = _run(replacement)
    (f,) = [f for f in found if f.kind == "job_stall"]
    assert f.evidence["cause"] == "network" and f.evidence["quorum_id"] == Q
    assert sorted(f.evidence["groups"]) == (["0", "1", "2"] if replacement == "joined"
                                            else ["0", "1"])
    assert f in det.open_findings()
