"""Ranks on torch's own debug server while the Lighthouse cannot be read: their step and quorum
come from it, and are those of its last read, so groups that go on training are not found
``stuck_starting`` once ``--starting-timeout`` passes (monitor/evidence/torch_rank.py)."""

from __future__ import annotations

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
UNREADABLE = "http://lighthouse:29510/status unreachable: connection refused"


class Job:
    """Single-rank groups on torch's server, swept as the monitor does: answers made states
    (TorchRanks), the view with its verdicts, the detectors."""

    def __init__(self) -> None:
        self.torch, self.views, self.verifier = TorchRanks("j"), ViewBuilder(), Verifier()
        self.detectors = Detectors()
        self.who = {URL[g]: TorchIdentity(RID[g], g, 0, 1, f"s{g}:1") for g in GROUPS}
        self.targets = [Target(URL[g], "torch_store") for g in GROUPS]

    def sweep(self, now: float, lighthouse: LighthouseStatus | None):
        polls = {URL[g]: RankPoll(URL[g], True, {RAW_KEY: TorchAnswer(("fr_trace_json",))},
                                  at=now) for g in GROUPS}
        self.torch.adapt(polls, self.who, lighthouse, now)
        error = None if lighthouse is not None else UNREADABLE
        view = self.views.update(self.targets, polls, now=now, judge=lambda ranks, changed: (
            self.verifier.judge(ranks, changed, lighthouse, error, True, now)))
        self.detectors.update(view.evidence(), {}, now, full_view=view)
        return view


def test_torch_only_groups_keep_their_quorum_while_the_lighthouse_is_unreadable():
    lh = LighthouseStatus(3, {RID[g]: QuorumMember(RID[g], 40, f"s{g}:1", 1) for g in GROUPS},
                          {RID[g]: 0.1 for g in GROUPS}, at=NOW)
    job = Job()
    view = job.sweep(NOW, lh)
    assert all(r.trust.state == "verified" for r in view.ranks.values())
    timeout = job.detectors.cfg.starting_timeout_s
    t = NOW
    while t < NOW + 2 * timeout:
        t += 10.0
        view = job.sweep(t, None)
    assert not [f for f in job.detectors.open_findings() if f.kind == "stuck_starting"]
    for r in view.ranks.values():  # still evidence, in the quorum of the last read
        assert r.trust.evidence and r.trust.reason == "lighthouse_unreadable"
        assert (r.state["quorum_id"], r.state["step"], r.state["participating"]) == (3, 40, True)
    assert {g.replica_group for g in view.evidence().in_quorum()} == set(GROUPS)


def test_a_group_the_last_read_left_out_of_the_quorum_is_still_stuck_starting():
    """Only the quorum is carried: a group the Lighthouse last listed in none is still found."""
    lh = LighthouseStatus(3, {RID[g]: QuorumMember(RID[g], 40, f"s{g}:1", 1) for g in (0, 1)},
                          {RID[g]: 0.1 for g in GROUPS}, at=NOW)
    job = Job()
    job.sweep(NOW, lh)
    t = NOW
    while t < NOW + job.detectors.cfg.starting_timeout_s + 20:
        t += 10.0
        job.sweep(t, None)
    assert [(f.kind, f.replica_group) for f in job.detectors.open_findings()] == [
        ("stuck_starting", 2)]
