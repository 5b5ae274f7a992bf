"""``job_stall`` of ranks on torch's debug server only while the monitor cannot read the
Lighthouse: their step and quorum are the Lighthouse's last read, frozen, so "no step committed
since" proves nothing and the stall must not be laid on the Lighthouse
(monitor/detect/jobwide.py; states made by monitor/evidence/torch_rank.py as the monitor does).
"""

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


def _entry(seq: int, created_s: float) -> dict:
    return {"record_id": 100 + seq, "pg_id": 1, "process_group": ["", ""],
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": "gloo:all_reduce", "time_created_ns": int(created_s * 1e9),
            "input_sizes": [[8]], "output_sizes": [[8]], "input_dtypes": ["Float"],
            "output_dtypes": ["Float"], "state": "scheduled", "retired": True, "is_p2p": False,
            "timeout_ms": 60000}


def _dump(seq: int, pending: bool, created_s: float) -> dict:
    """A gloo rank's dump: torchft's group (pg_id 1) enqueued up to ``seq``; ``pending``: that
    one not completed (blocked in the cross-group all_reduce since ``created_s``)."""
    return {"version": "2.10", "comm_lib_version": "",
            "entries": [_entry(s, created_s) for s in range(1, seq + 1)],
            "pg_config": {"": {"name": "", "desc": "", "ranks": "[0, 1]"}},
            "pg_status": {"1": {"last_enqueued_collective": str(seq),
                                "last_completed_collective": str(seq - 1 if pending else seq),
                                "last_started_collective": "-1"}}}


def _status(step: int) -> LighthouseStatus:
    return LighthouseStatus(3, {RID[g]: QuorumMember(RID[g], step, f"s{g}:1", 1) for g in GROUPS},
                            {RID[g]: 0.1 for g in GROUPS}, at=NOW)


class Job:
    """Single-rank groups on torch's server, swept as the monitor does."""

    def __init__(self) -> None:
        self.torch, self.views, self.verifier = TorchRanks("j"), ViewBuilder(), Verifier()
        self.detectors = Detectors(DetectorConfig(hang_floor_s=1.0, dead_sweeps=2))
        self.who = {URL[g]: TorchIdentity(RID[g], g, 0, 1, f"s{g}:1") for g in GROUPS}
        self.targets = [Target(URL[g], "torch_store") for g in GROUPS]

    def sweep(self, now: float, lighthouse: LighthouseStatus | None, dump: dict) -> None:
        polls = {URL[g]: RankPoll(URL[g], True, {RAW_KEY: TorchAnswer(("fr_trace_json",), dump)},
                                  at=now) for g in GROUPS}
        self.torch.adapt(polls, self.who, lighthouse, now)
        error = None if lighthouse is not None else "lighthouse unreachable: connection refused"
        view = self.views.update(self.targets, polls, now=now, judge=lambda ranks, changed: (
            self.verifier.judge(ranks, changed, lighthouse, error, True, now)))
        self.detectors.update(view.evidence(), {}, now, full_view=view)
        assert self.detectors.last_error is None


def test_a_stall_of_torch_only_ranks_with_the_lighthouse_unreadable_does_not_blame_it():
    """Every rank blocked in the cross-group all_reduce past the hang threshold, the Lighthouse
    unreadable: the stall is reported, but not as the Lighthouse's (a network fault would look
    the same: the steps the ranks show are the Lighthouse's last read, not theirs). Once the
    Lighthouse answers again the cause is kept, and the summary no longer says it does not."""
    job, t = Job(), NOW
    for i in range(4):  # training, the Lighthouse read: its step moves
        t += 1.0
        job.sweep(t, _status(40 + i), _dump(10 + i, False, t))
    since = t
    for _ in range(4):  # blocked in the all_reduce, the Lighthouse gone from the monitor
        t += 1.0
        job.sweep(t, None, _dump(14, True, since))
    (f,) = job.detectors.job_findings()
    assert f.kind == "job_stall" and f.evidence["lighthouse_unreadable"] is True
    assert "the ranks may be waiting for their quorum" not in f.evidence["summary"]
    assert "cannot be told apart" in f.evidence["summary"]
    assert f.evidence["cause"] == "unknown"
    for _ in range(2):  # the Lighthouse answers again, the job still stalled
        t += 1.0
        job.sweep(t, _status(43), _dump(14, True, since))
    (f,) = job.detectors.job_findings()
    assert f.evidence["cause"] == "unknown" and f.evidence["lighthouse_unreadable"] is False
    assert "does not answer" not in f.evidence["summary"]
    assert "did not answer the monitor when the stall began" in f.evidence["summary"]
