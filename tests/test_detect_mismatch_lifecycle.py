"""A ``mismatch`` closes (``no_longer_seen``) at a Flight Recorder look that could have seen it
and did not, and only there (docs/monitor.md, mismatch): an open one would evict on old evidence
once a rail lifts and would explain away every later job-wide stall."""

from __future__ import annotations

from monitor.analysis import analyze
from monitor.config import DetectorConfig
from monitor.detect import Detectors
from tests.support.frgen import FRJob
from tests.test_monitor_detectors import T0, Job, run, sweep, update


def mismatched(**cfg) -> tuple[Job, Detectors, list[int]]:
    """3 single-rank groups; rank 1 enqueued a bigger all_reduce than its peers: confirmed. The
    list counts the looks (analyses) from then on."""
    looks = [0]

    def counting(traces):
        looks[0] += 1
        return analyze(traces)
    job = Job(ranks=1)
    det = Detectors(DetectorConfig(**cfg), analyzer=counting)
    job.steps(10, now=T0)
    sweep(det, job, T0)
    job.fr.ft_collective("all_reduce", [[1000]], rank_sizes={1: [[1001]]})
    for s in job.states:
        s["commit_failures"] = 1
    for r in range(job.world):
        job.wait(r, "cross", 2.5, phase="allreduce")
    found = sweep(det, job, T0 + 1)
    assert [(f.kind, f.replica_group, f.ranks) for f in found] == [("mismatch", 1, [1])]
    looks[0] = 0
    return job, det, looks


def healthy_recorders(job: Job) -> None:
    """The fault is over: the old entries rolled out of the ranks' windows."""
    job.fr = FRJob(world_size=job.world, flavour="gloo", replica_group_size=1, jitter_ms=5,
                   compute_ms=250, seed=1, hosts={r: f"host-g{r}" for r in range(job.world)})
    job.fr.quorum(4, list(range(job.n)))
    for s in job.states:
        s["quorum_id"] = 4


def open_kinds(det: Detectors) -> list[tuple]:
    return [(f.kind, f.replica_group) for f in det.open_findings()]


def test_a_mismatch_no_longer_seen_closes_and_a_job_stall_is_named_again():
    job, det, looks = mismatched()
    healthy_recorders(job)
    now = T0 + 1
    for _ in range(40):  # a periodic look comes every --fr-interval (15 s) at most
        _, now = run(det, job, 1, now)
        if not det.open_findings():
            break
    assert open_kinds(det) == [] and looks[0] >= 1
    last = det.resolved_findings()[-1]
    assert (last.kind, last.replica_group, last.resolution) == ("mismatch", 1, "no_longer_seen")
    # every group then blocked in the cross-group all_reduce, no step moving: the job's stall
    found = []
    for i in range(12):
        now += 1.0
        for r in range(job.world):
            job.wait(r, "cross", 1.0 + i, phase="allreduce")
        found += sweep(det, job, now)
    assert [f.kind for f in found] == ["job_stall"]


def test_a_mismatch_that_goes_on_stays_open_across_looks():
    job, det, looks = mismatched(fr_interval_s=2.0)
    healthy_recorders(job)
    now = T0 + 1
    while looks[0] < 3 and now < T0 + 30:
        now += 1.0
        job.steps(3, now=now)  # training commits on, and rank 1 keeps disagreeing
        job.fr.ft_collective("all_reduce", [[1000]], rank_sizes={1: [[1001]]})
        sweep(det, job, now)
    assert looks[0] >= 3
    assert open_kinds(det) == [("mismatch", 1)] and det.resolved_findings() == []


def test_a_look_that_could_not_see_the_mismatch_says_nothing():
    job, det, _ = mismatched()
    healthy_recorders(job)
    now = T0 + 2
    update(det, job, now, job.dumps())  # no step committed since it was seen
    assert open_kinds(det) == [("mismatch", 1)]
    job.steps(3, now=now)
    partial = [{r: d for r, d in job.dumps().items() if r != 1},  # the culprit's dump missing
               {**job.dumps(), 1: {"not": "a Flight Recorder dump"}},  # or unreadable
               {r: d for r, d in job.dumps().items() if r == 1}]  # no other side to compare
    for dumps in partial:
        now += 1.0
        update(det, job, now, dumps)
        assert open_kinds(det) == [("mismatch", 1)]
    now += 1.0
    update(det, job, now)  # no look at all
    assert open_kinds(det) == [("mismatch", 1)]
    now += 1.0
    update(det, job, now, job.dumps())
    assert open_kinds(det) == []
    assert det.resolved_findings()[-1].resolution == "no_longer_seen"


def test_a_mismatch_whose_peers_crashed_on_it_stays_open_while_the_culprit_trains_on():
    """A wrong-size all_reduce aborts the ranks that receive it; they come back as new processes
    with empty recorders while the culprit trains on: their silence is no sign it is over."""
    job, det, looks = mismatched(fr_interval_s=2.0)
    healthy_recorders(job)
    for r in (0, 2):  # restarted by their supervisor, crashing again before any commit
        job.states[r].update(pid=job.states[r]["pid"] + 100, started_at=T0 + 2, commits=0)
    now = T0 + 1
    while looks[0] < 3 and now < T0 + 30:
        now += 1.0
        job.steps(3, now=now)
        sweep(det, job, now)
    assert looks[0] >= 3
    assert open_kinds(det) == [("mismatch", 1)] and det.resolved_findings() == []
    # once a restarted peer trains beside the culprit, its agreeing record says it is over
    job.states[0]["commits"] = 5
    for _ in range(30):
        now += 1.0
        job.steps(3, now=now)
        sweep(det, job, now)
        if not det.open_findings():
            break
    assert open_kinds(det) == []
    assert det.resolved_findings()[-1].resolution == "no_longer_seen"
