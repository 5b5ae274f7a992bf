"""A fault confirmed before another fault's kill whose own eviction is held (--cooldown, the
rails): once the kill's own part is over by the ranks' commits, the job's lost time is the held
fault's (its stall or drag), not that kill's recovery, and the recovery ends ``superseded``.
A fault that cannot stop commits (a slowdown, a group out of the quorum) takes no stall, and
a pause after the killed group's rejoin is not the kill's. The model job of tests/test_goodput.py."""

from __future__ import annotations

import re
import time

import pytest

from monitor.api.app import create_app
from monitor.config import MonitorConfig
from monitor.goodput import GoodputConfig, GoodputLedger
from monitor.service import Monitor
from tests.support import goodput_reference as reference
from tests.support.clock import ManualClock
from tests.test_goodput import ModelJob, check_counted, check_invariant, healthy_ledger


def _incidents(led) -> dict[int, dict]:
    return {i["replica_group"]: i for i in led.to_json()["incidents"]}


def _confirmed_kill(job, g: int, did: int, fid: int) -> None:
    job.evict(g, at=job.t, did=did, fid=fid)
    job.evictions[-1]["status"] = "confirmed"


def _hang_killed(job, led, g: int, still: int) -> None:
    """A hang in group ``g``: nobody commits for ``still`` sweeps, it is confirmed, then killed."""
    h = job.t
    job.run(led, still, pace=0.0)
    hang = job.finding("hang", g, first_seen=h + 0.1, confirmed_at=job.t, fid=2)
    job.sweep(led, pace=0.0)
    _confirmed_kill(job, g, did=7, fid=2)
    job.findings.remove(hang)


def test_a_hang_held_at_a_kill_stalls_the_job_as_its_own_not_as_that_kills_recovery():
    """Hangs in groups 2 (B) and 3 (A) confirmed together; A is killed, B's kill held 30 s
    while B's hang keeps the job still."""
    job, led = healthy_ledger(groups=4, seconds=40)
    h = job.t
    job.run(led, 2, pace=0.0)
    job.finding("hang", 2, first_seen=h + 0.1, confirmed_at=job.t, fid=22)
    job.finding("hang", 3, first_seen=h + 0.1, confirmed_at=job.t, fid=21)
    job.sweep(led, pace=0.0)
    _confirmed_kill(job, 3, did=8, fid=21)
    job.run(led, 30, pace=0.0)
    window = led.to_json()["pace"]["window_s"]
    a, b = _incidents(led)[3], _incidents(led)[2]
    # A's kill keeps at most a window of the three survivors' time; the rest is B's stall
    assert a["cost"]["by_cause"]["recovery"] <= 3 * window + 1e-6, a
    assert b["cost"]["by_cause"]["stall"] >= 3 * (30 - window) - 1e-6, b
    assert (a["back_to_pace"], a["superseded_by"]) == ("superseded", b["id"])
    assert a["evicted_at"] < a["back_to_pace_at"] <= a["evicted_at"] + window
    _confirmed_kill(job, 2, did=9, fid=22)
    job.run(led, 3, pace=0.0)
    job.findings.clear()
    job.run(led, 30, pace=1.0)
    a, b = _incidents(led)[3], _incidents(led)[2]
    assert a["cost"]["by_cause"]["recovery"] <= 3 * window + 1e-6, a
    # B's own eviction is recovered from, on its own incident
    assert b["back_to_pace"] == "reached" and b["cost"]["by_cause"]["recovery"] > 0
    assert b["back_to_pace_at"] > b["evicted_at"]
    check_invariant(led)
    check_counted(job, led)


def _straggler_held_then_hang_killed(job, led, pace: float = 0.5):
    """Group 0's straggler at ``pace``, held by the rails (never evicted), then a hang in
    group 2 confirmed and killed. Returns the straggler's finding."""
    on = job.t
    job.groups[0]["struck"] = {"slow": on + 0.05}
    job.run(led, 5, pace=pace)
    strag = job.finding("straggler", 0, first_seen=on + 0.1, confirmed_at=job.t, fid=1)
    job.run(led, 30, pace=pace)
    _hang_killed(job, led, 2, still=2)
    return strag


def _held_straggler_and_killed_hang(after: float):
    """Group 0's straggler held by the rails (never evicted) keeps the job at 0.5x; a hang in
    group 2 is killed, the survivors still for longer than a window (the Lighthouse has not
    dropped the killed group), then group 2 back and the job on at the straggler's 0.5x for
    ``after`` s. Returns (job, ledger, seconds still, when the job went on)."""
    job, led = healthy_ledger(groups=3, seconds=60)
    _straggler_held_then_hang_killed(job, led)
    still = int(led.to_json()["pace"]["window_s"]) + 3
    job.run(led, still, pace=0.0)
    # a straggler slows commits, it does not stop them: the stall is the kill's recovery
    hang_inc = _incidents(led)[2]
    assert hang_inc["back_to_pace"] is None
    assert hang_inc["cost"]["by_cause"]["recovery"] == pytest.approx(2 * still)
    job.restart(2, "b")
    job.sweep(led, pace=0.5)
    went_on = job.t
    job.run(led, after, pace=0.5)
    return job, led, still, went_on


def test_a_straggler_held_at_a_kill_drags_once_the_job_went_on_without_the_killed_group():
    job, led, still, went_on = _held_straggler_and_killed_hang(300)
    hang_inc, strag = _incidents(led)[2], _incidents(led)[0]
    # the kill's recovery ended the sweep the job went on, the hang's incident closed
    assert (hang_inc["back_to_pace"], hang_inc["superseded_by"]) == ("superseded", strag["id"])
    assert hang_inc["back_to_pace_at"] == pytest.approx(went_on, abs=1e-6)
    assert hang_inc["open"] is False
    assert hang_inc["cost"]["by_cause"]["recovery"] <= 2 * still + 3 + 1e-6, hang_inc
    # every group in the quorum at 0.5x since: half of each second is the straggler's drag
    assert strag["open"] and strag["back_to_pace"] is None
    assert strag["cost"]["by_cause"]["straggler_drag"] >= 3 * 300 * 0.5 * 0.95, strag
    bad = led.to_json()["job"]["badput_seconds"]
    assert bad["recovery"] == pytest.approx(hang_inc["cost"]["by_cause"]["recovery"])
    assert bad["unattributed"] == 0, bad
    check_invariant(led)
    check_counted(job, led)


def test_the_overview_shows_a_superseded_recovery_as_the_demo_report_does(tmp_path):
    """Superseded by incident N at the time it ended, as the demo report, not as back at pace:
    ``back_to_pace_at`` is no time the job was back at pace."""
    _, led, _, went_on = _held_straggler_and_killed_hang(10)
    mon = Monitor(MonitorConfig(port=0, targets=["http://127.0.0.1:9"],
                                state_path=str(tmp_path / "m.db")), clock=ManualClock(1000.0))
    mon.goodput.ledger = led
    html = create_app(mon).test_client().get("/").get_data(as_text=True)
    line = re.sub(r"\s+", " ", re.search(r'id="last-incident">(.*?)</span>', html, re.S)[1])
    at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(went_on))
    assert f"hang in group 2, onset &rarr; superseded by incident 1 at {at}," in line, line
    assert "back at pace" not in line, line


class Compared(GoodputLedger):
    """The ledger fed each sweep to the reference model too (tests/support/goodput_reference.py,
    which test_goodput_columns' random sweeps compare with but never send these kinds): equal
    after each."""

    def __init__(self, cfg: GoodputConfig | None = None) -> None:
        super().__init__(cfg)
        self.ref = reference.GoodputLedger(reference.GoodputConfig(**vars(self.cfg)))

    def update(self, view, findings, evictions, now):
        acct = super().update(view, findings, evictions, now)
        assert vars(acct) == vars(self.ref.update(view, findings, evictions, now))
        assert self.to_json() == self.ref.to_json()
        return acct


def compared_ledger(groups: int = 3, seconds: float = 60, **cfg) -> tuple[ModelJob, Compared]:
    job, led = ModelJob(groups), Compared(GoodputConfig(**cfg))
    job.run(led, seconds)
    return job, led


@pytest.mark.parametrize("kind", ["dead", "stuck_starting", "job_slow"])
def test_a_fault_that_cannot_stop_commits_held_at_a_kill_takes_no_stall_of_it(kind):
    """Held at a hang's kill: a group out of the quorum (its `dead` or `stuck_starting`
    finding, never evicted by default) or a job-wide `job_slow`. The survivors of the kill stand
    still longer than a window, then go on at pace: that is the kill's recovery, and the hang's
    own stall before it is the hang's."""
    job, led = compared_ledger(groups=4)
    if kind == "job_slow":
        job.run(led, 4, pace=0.6)
        job.findings.append({"id": 1, "kind": kind, "replica_group": None, "replica_id": None,
                             "ranks": [], "evidence": {}, "first_seen": job.t - 4,
                             "confirmed_at": job.t})
    else:
        job.groups[0].update({"in": False, "reach": kind == "stuck_starting"})
        job.run(led, 4)
        job.finding(kind, 0, first_seen=job.t - 4, confirmed_at=job.t, fid=1)
    job.run(led, 2, pace=0.6 if kind == "job_slow" else 1.0)
    in_quorum = sum(s["in"] for s in job.groups.values())
    _hang_killed(job, led, 3, still=3)
    still = int(led.to_json()["pace"]["window_s"]) + 6
    job.run(led, still, pace=0.0)
    job.run(led, 20)
    held, killed = _incidents(led)[None if kind == "job_slow" else 0], _incidents(led)[3]
    assert held["kind"] == kind and held["open"] and "stall" not in held["cost"]["by_cause"]
    # the hang's stall from its onset to its kill (4 sweeps), the survivors' stillness after
    assert killed["cost"]["by_cause"]["stall"] == pytest.approx(in_quorum * 4)
    assert killed["cost"]["by_cause"]["recovery"] == pytest.approx((in_quorum - 1) * still)
    assert killed["back_to_pace"] in ("reached", "superseded")
    assert killed["back_to_pace_at"] >= job.t - 20
    check_invariant(led)
    check_counted(job, led)


def _killed_beside_a_straggler(on_s: int, clear: bool = False):
    """Group 0's straggler held (0.5x; a false one, 1.0x, its findings cleared after ``on_s``
    when ``clear``); a hang in group 2 killed; the survivors go on without it for ``on_s``
    sweeps; then group 2's new incarnation rejoins and the quorum waits for its heal, nobody
    committing for longer than a window. Returns (ledger, the kill's incident before the
    rejoin, seconds healing, the sweep the survivors first committed)."""
    job, led = compared_ledger(groups=3)
    p = 1.0 if clear else 0.5
    strag = _straggler_held_then_hang_killed(job, led, pace=p)
    job.run(led, 2, pace=0.0)
    went_on = job.t + 1
    job.run(led, on_s, pace=p)
    if clear:
        job.findings.remove(strag)
        job.run(led, 10)
    before = _incidents(led)[2]
    job.restart(2, "b")
    heal = int(led.to_json()["pace"]["window_s"]) + 2
    job.run(led, heal, pace=0.0)
    job.run(led, 20, pace=p)
    check_invariant(led)
    check_counted(job, led)
    return led, before, heal, went_on


@pytest.mark.parametrize("on_s", [1, 2, 5])
def test_a_pause_after_the_killed_groups_rejoin_leaves_the_kill_as_published(on_s):
    """However soon after the survivors went on the killed group rejoins, a pause after its
    rejoin is not the kill's (torchft heals a group before it is in the quorum): the kill's
    recovery, closed and published ``superseded`` when the job went on, stays put, and the
    held straggler keeps the pause as its drag, no stall."""
    led, before, heal, went_on = _killed_beside_a_straggler(on_s)
    strag, killed = _incidents(led)[0], _incidents(led)[2]
    assert "stall" not in strag["cost"]["by_cause"], strag
    assert killed["cost"] == before["cost"], killed
    assert (killed["back_to_pace"], killed["superseded_by"]) == ("superseded", strag["id"])
    assert killed["back_to_pace_at"] == pytest.approx(went_on, abs=1e-6)
    assert not killed["open"]
    # the hang's own stall before its kill is the job's only one
    assert led.to_json()["job"]["badput_seconds"]["stall"] == killed["cost"]["by_cause"]["stall"]


def test_a_kills_published_end_stays_put_after_the_straggler_that_superseded_it_cleared():
    """A false straggler (the job at pace) superseded the kill's recovery when the survivors
    went on, then cleared; the group rejoins later and the job pauses: the kill stays as
    published."""
    led, before, _, _ = _killed_beside_a_straggler(5, clear=True)
    killed = _incidents(led)[2]
    assert before["back_to_pace"] == "superseded"
    for k in ("back_to_pace", "superseded_by", "back_to_pace_at", "recovery_s", "cost"):
        assert killed[k] == before[k], (k, killed, before)


@pytest.mark.parametrize("kind", [None, "straggler", "job_slow"])
def test_a_hangs_stall_before_its_confirmation_is_its_own_beside_a_slowdown(kind):
    """A slowdown open (a straggler on group 1, or job_slow), then a hang in group 2 stops
    every group for longer than a window before it is confirmed: the whole stall from the
    hang's onset is the hang's, as with no slowdown open."""
    job, led = compared_ledger(groups=4)
    if kind == "straggler":
        job.finding("straggler", 1, first_seen=job.t + 0.1, confirmed_at=job.t + 1, fid=1)
    elif kind == "job_slow":
        job.findings.append({"id": 1, "kind": kind, "replica_group": None, "replica_id": None,
                             "ranks": [], "evidence": {}, "first_seen": job.t,
                             "confirmed_at": job.t + 1})
    job.run(led, 10, pace=1.0 if kind is None else 0.6)
    _hang_killed(job, led, 2, still=10)
    job.run(led, 20, pace=1.0 if kind is None else 0.6)
    check_invariant(led)
    check_counted(job, led)
    incs = {i["kind"]: i for i in led.to_json()["incidents"]}
    assert incs["hang"]["cost"]["by_cause"]["stall"] == pytest.approx(4 * 11)
    assert "stall" not in incs.get(kind, {"cost": {"by_cause": {}}})["cost"]["by_cause"]


def test_a_job_slow_found_late_claims_its_idle_sweeps_as_drag_not_stall():
    """Steps ten times the healthy time, a commit every other sweep (each gap shorter than a
    window): job_slow confirmed 12 s after its onset claims the idle sweeps as its drag, as a
    straggler does: a slowdown stops no commits."""
    job, led = compared_ledger(groups=3)
    on = job.t
    for _ in range(6):
        job.run(led, 1, pace=0.0)
        job.run(led, 1, pace=0.25)
    job.findings.append({"id": 1, "kind": "job_slow", "replica_group": None, "replica_id": None,
                         "ranks": [], "evidence": {}, "first_seen": on, "confirmed_at": job.t})
    for _ in range(6):
        job.run(led, 1, pace=0.0)
        job.run(led, 1, pace=0.25)
    check_invariant(led)
    check_counted(job, led)
    slow = led.to_json()["incidents"][0]
    assert "stall" not in slow["cost"]["by_cause"], slow
    assert led.to_json()["job"]["badput_seconds"]["stall"] == 0


@pytest.mark.parametrize("kind", ["straggler", "job_slow"])
def test_a_held_slowdown_whose_steps_outlast_a_window_keeps_the_idle_time_between_them(kind):
    """Every step takes 6 s, longer than the window: whole windows without a commit while only
    the slowdown is open (held, never evicted). All the badput is linked to the slowdown, none
    to no incident, and most of it is its drag: the whole windows before its confirmation are
    its `stall` (docs/goodput.md, Limits)."""
    from tests.test_goodput import STEP
    job, led = compared_ledger(groups=3)
    on = job.t
    job.run(led, 6, pace=STEP / 6.0)
    if kind == "job_slow":
        job.findings.append({"id": 1, "kind": kind, "replica_group": None, "replica_id": None,
                             "ranks": [], "evidence": {}, "first_seen": on + 0.1,
                             "confirmed_at": job.t})
    else:
        job.finding(kind, 1, first_seen=on + 0.1, confirmed_at=job.t, fid=1)
    job.run(led, 100, pace=STEP / 6.0)
    check_invariant(led)
    check_counted(job, led)
    out = led.to_json()
    [slow] = out["incidents"]
    bad = {k: v for k, v in out["job"]["badput_seconds"].items() if k != "startup" and v}
    assert sum(slow["cost"]["by_cause"].values()) == pytest.approx(
        sum(bad.values()) + out["job"]["pending_seconds"]), (slow, bad)
    assert slow["cost"]["by_cause"]["straggler_drag"] > 0.8 * sum(bad.values())


@pytest.mark.parametrize("det", [2, 8])
def test_a_hang_during_a_held_slowdowns_long_step_stalls_from_its_onset_only(det):
    """A held straggler's steps take 6 s (longer than a window); group 2 hangs 3 s after the
    last commit and is confirmed ``det`` s later: its stall starts at its onset, and the 3 s
    before it stay the straggler's drag (that step was slow anyway)."""
    from tests.test_goodput import STEP
    job, led = compared_ledger(groups=3)
    on = job.t
    job.run(led, 6, pace=STEP / 6.0)
    job.finding("straggler", 1, first_seen=on + 0.1, confirmed_at=job.t, fid=1)
    job.run(led, 30, pace=STEP / 6.0)
    job.run(led, 3, pace=STEP / 6.0)
    h = job.t
    job.run(led, det, pace=0.0)
    job.finding("hang", 2, first_seen=h, confirmed_at=job.t, fid=2)
    job.run(led, 6, pace=0.0)
    check_invariant(led)
    check_counted(job, led)
    incs = {i["kind"]: i for i in led.to_json()["incidents"]}
    assert incs["hang"]["onset_at"] == pytest.approx(h, abs=1e-6)
    assert incs["hang"]["cost"]["by_cause"]["stall"] == pytest.approx(3 * (job.t - h))
