"""``job_stall`` while a member of the Lighthouse's quorum is out of the monitor's sight but not
yet ``dead`` (monitor/detect/jobwide.py): the groups it sees all wait on that one, so no job-wide
stall is confirmed before the dead finding (--dead-sweeps) names it; with every member seen the
stall is still found. Single-rank groups on torch's debug server, swept as the monitor does."""

from __future__ import annotations

from monitor.config import DetectorConfig
from monitor.detect import Detectors
from monitor.evidence.lighthouse_status import LighthouseStatus, QuorumMember
from monitor.evidence.torch_rank import TorchRanks
from monitor.evidence.verification import Verifier
from monitor.evidence.view import ViewBuilder
from monitor.poll.discovery import Target
from monitor.poll.poller import RankPoll
from monitor.poll.torch_server import RAW_KEY, TorchAnswer, TorchIdentity

NOW = 1_800_000_000.0
GROUPS = (0, 1, 2)
RID = {g: f"job_{g}:u{g}" for g in GROUPS}
URL = {g: f"torch+http://h{g}:1" for g in GROUPS}
DEAD_SWEEPS = 3


def _dump(seq: int, pending: bool, created_s: float) -> dict:
    """A gloo rank's dump: torchft's group (pg_id 1) enqueued up to ``seq``; ``pending``: that
    one not completed (blocked in the cross-group all_reduce since ``created_s``)."""
    entries = [{"record_id": 100 + s, "pg_id": 1, "process_group": ["", ""],
                "collective_seq_id": s, "p2p_seq_id": 0, "op_id": s,
                "profiling_name": "gloo:all_reduce", "time_created_ns": int(created_s * 1e9),
                "input_sizes": [[8]], "output_sizes": [[8]], "input_dtypes": ["Float"],
                "output_dtypes": ["Float"], "state": "scheduled", "retired": True,
                "is_p2p": False, "timeout_ms": 60000} for s in range(1, seq + 1)]
    return {"version": "2.10", "comm_lib_version": "", "entries": entries,
            "pg_config": {"": {"name": "", "desc": "", "ranks": "[0, 1]"}},
            "pg_status": {"1": {"last_enqueued_collective": str(seq),
                                "last_completed_collective": str(seq - 1 if pending else seq),
                                "last_started_collective": "-1"}}}


def _status(step: int, extra: tuple[str, ...] = (), silent: dict[str, float] | None = None
            ) -> LighthouseStatus:
    """``silent``: replica id -> seconds since the Lighthouse last heard it."""
    rids = [RID[g] for g in GROUPS] + list(extra)
    return LighthouseStatus(3, {r: QuorumMember(r, step, "s:1", 1) for r in rids},
                            {**dict.fromkeys(rids, 0.1), **(silent or {})}, at=NOW)


class Job:
    def __init__(self) -> None:
        self.torch, self.views, self.verifier = TorchRanks("j"), ViewBuilder(), Verifier()
        self.detectors = Detectors(DetectorConfig(hang_floor_s=1.0, dead_sweeps=DEAD_SWEEPS))
        self.who = {URL[g]: TorchIdentity(RID[g], g, 0, 1, f"s{g}:1") for g in GROUPS}
        self.targets = [Target(URL[g], "torch_store") for g in GROUPS]

    def sweep(self, now: float, lighthouse: LighthouseStatus, dump: dict,
              frozen: tuple[int, ...] = ()) -> list:
        polls = {URL[g]: RankPoll(URL[g], False, reason="timeout", at=now) if g in frozen else
                 RankPoll(URL[g], True, {RAW_KEY: TorchAnswer(("fr_trace_json",), dump)}, at=now)
                 for g in GROUPS}
        self.torch.adapt(polls, self.who, lighthouse, now)
        view = self.views.update(self.targets, polls, now=now, judge=lambda ranks, changed: (
            self.verifier.judge(ranks, changed, lighthouse, None, True, now)))
        new = self.detectors.update(view.evidence(), {}, now, full_view=view, lighthouse=lighthouse)
        assert self.detectors.last_error is None
        return new


def _train(job: Job, extra: tuple[str, ...] = ()) -> float:
    t = NOW
    for i in range(4):
        t += 1.0
        job.sweep(t, _status(40 + i, extra), _dump(10 + i, False, t))
    return t


def test_no_job_stall_while_a_member_is_unseen_but_not_yet_dead():
    """Group 2 frozen (its server answers no poll), groups 0 and 1 blocked in the cross-group
    all_reduce waiting for it past the hang threshold: no job_stall (the probe mesh may start:
    suspected), then the dead finding names group 2 and no job_stall is ever confirmed."""
    job = Job()
    t = since = _train(job)
    kinds: list[str] = []
    suspected = False
    for _ in range(DEAD_SWEEPS + 2):
        t += 1.5
        # frozen, its Manager too: no heartbeat since (the Lighthouse has not timed it out yet)
        kinds += [f.kind for f in job.sweep(t, _status(43, silent={RID[2]: t - since}),
                                            _dump(14, True, since), frozen=(2,))]
        suspected |= job.detectors.jobwide.suspected()
    assert "job_stall" not in kinds
    assert "dead" in kinds
    assert job.detectors.job_findings() == []
    assert suspected


def test_a_job_wide_stall_with_every_member_seen_is_still_found():
    job = Job()
    t = since = _train(job)
    for _ in range(4):
        t += 1.5
        job.sweep(t, _status(43), _dump(14, True, since))
    (f,) = job.detectors.job_findings()
    assert f.kind == "job_stall" and f.evidence["cause"] == "network"
    assert sorted(f.evidence["groups"]) == ["0", "1", "2"]


def test_a_member_never_seen_holds_no_stall_back_and_the_summary_names_it():
    """A member of the Lighthouse's quorum the monitor has not seen for --dead-sweeps sweeps
    (not among its targets): the stall of the groups it sees is found, and the summary says
    that one was not seen instead of "no group is absent"."""
    job, extra = Job(), ("job_9:u9",)
    t = since = _train(job, extra)
    for _ in range(4):
        t += 1.5
        job.sweep(t, _status(43, extra), _dump(14, True, since))
    (f,) = job.detectors.job_findings()
    assert f.kind == "job_stall" and f.evidence["unseen_replica_ids"] == ["job_9:u9"]
    assert "(3 seen; the Lighthouse's member(s) ['job_9:u9'] unseen, not found dead)" \
        in f.evidence["summary"]
    assert "no group seen is late: a job-wide stall" in f.evidence["summary"]
    assert "absent" not in f.evidence["summary"]
