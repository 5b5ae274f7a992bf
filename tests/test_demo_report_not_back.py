"""A fault the job was not back at pace from before the next fault struck: its back at pace is
not the next fault's recovery (the ranks' search stops at the next onset, as the bench's truth
does), and its measured cost, which then holds every slow second until the ledger stopped
counting it, says so. Plain data in the demo's shapes, no processes."""

from __future__ import annotations

from lightkeeper import recovery
from lightkeeper.report import recoveries
from lightkeeper.report_text import cost_markdown, story_lines, summary_markdown
from tests.test_demo_recovery import T0, sample

RATE = 5.0  # healthy steps/s


def two_faults_run():
    """5 steps/s until a straggler in group 1 at 10 s (1 step/s); group 1 evicted at 11.5 s;
    from 12 s the job runs at 0.78x (the machine's load, not the fault) until a hang in group 2
    at 30 s; group 2 evicted at 31.5 s; from 32 s the job is back at full pace to 45 s."""
    out, step, t = [], 0, 0.0

    def run(until, dt):
        nonlocal step, t
        while t + dt <= until + 1e-9:
            t = round(t + dt, 3)
            step += 1
            for g in range(3):
                out.append(sample(t, g, step, t))

    run(10.0, 1 / RATE)
    run(11.5, 1.0)
    t = 12.0
    run(30.0, 1 / (0.78 * RATE))
    t = 32.0
    run(45.0, 1 / RATE)
    return out


# what the demo's fault record carries besides (lightkeeper.faulttrack)
RECORD = {"given": "live", "steps_lost": 0, "outcome": "recovered", "note": None}
STRAGGLER = {**RECORD, "detected_kind": "straggler", "injected_at_s": 9.0,
             "replica_group": 1, "spec": "slow_compute:delay=0.6", "struck_at_s": 10.0,
             "detected_at_s": 11.4, "evicted_at_s": 11.5, "survivors_committing_at_s": 12.0,
             "restarted_at_s": 12.0, "rejoined_at_s": 14.0}
HANG = {**RECORD, "detected_kind": "hang", "injected_at_s": 29.0,
        "replica_group": 2, "spec": "hang:at_step=150", "struck_at_s": 30.0,
        "detected_at_s": 31.4, "evicted_at_s": 31.5, "survivors_committing_at_s": 32.0,
        "restarted_at_s": 32.0, "rejoined_at_s": 34.0}
EVICTIONS = [{"replica_group": 1, "decision": "evict", "replica_id": "replica_group_1:x",
              "at_s": 11.5},
             {"replica_group": 2, "decision": "evict", "replica_id": "replica_group_2:x",
              "at_s": 31.5}]


def incident(id_, group, kind, onset, detected, back_at, status, **kw):
    return {"id": id_, "kind": kind, "replica_group": group, "onset_at": T0 + onset,
            "detected_at": T0 + detected, "evicted_at": T0 + detected + 0.1,
            "back_to_pace_at": None if back_at is None else T0 + back_at,
            "back_to_pace": status, "recovery_s": None if back_at is None else back_at - onset,
            "detect_s": detected - onset, "open": False,
            "cost": {"replica_seconds": 30.0, "group_steps": 150.0,
                     "by_cause": {"straggler_drag": 5.0, "recovery": 25.0}}, **kw}


def report(goodput: dict) -> dict:
    faults = [dict(STRAGGLER), dict(HANG)]
    phases = [{"name": "healthy", "start_s": 0.0, "end_s": 10.0, "steps": 50,
               "step_rate": RATE, "vs_healthy": 1.0}]
    recoveries(faults, phases, two_faults_run(), [], EVICTIONS, goodput, T0, 45.0, 3,
               recovery.TORCHFT_DEFAULTS)
    return {"faults": faults, "phases": phases}


def test_back_at_pace_by_the_ranks_stops_at_the_next_faults_onset():
    series = recovery.commit_series(two_faults_run())
    # searched to the end, the straggler's back at pace is the hang's recovery
    assert recovery.back_at_pace(series, 12.0, RATE, last_t=45.0) == 32.2
    st = recovery.stages(STRAGGLER, two_faults_run(), [], EVICTIONS, RATE, end=45.0, until=30.0)
    assert st["back_at_pace"] is None
    assert recovery.next_fault([STRAGGLER, HANG], 0) == 1
    assert recovery.next_fault([STRAGGLER, HANG], 1) is None


def test_the_report_says_a_fault_was_not_back_before_the_next_one():
    goodput = {"at": T0 + 44.0, "incidents": [
        incident(2, 2, "hang", 30.0, 31.4, 32.2, "reached"),
        incident(1, 1, "straggler", 10.0, 11.4, 31.4, "superseded", superseded_by=2)]}
    rep = report(goodput)
    first, second = rep["faults"]
    assert first["stages"]["back_at_pace"] is None and first["recovery_s_ranks"] is None
    assert second["stages"]["back_at_pace"] == 32.2
    story = story_lines(rep)
    assert "not back at pace before fault 2 (30.0s)" in story[0], story[0]
    assert "back at pace at 32.2" not in story[0], story[0]
    row = next(line for line in summary_markdown(rep).splitlines() if line.startswith("| 1 |"))
    assert "| not before #2 |" in row and "32.2s" not in row, row


def test_a_cost_without_back_at_pace_says_what_it_holds():
    # superseded: its cost runs to the next fault's detection
    goodput = {"at": T0 + 44.0, "incidents": [
        incident(2, 2, "hang", 30.0, 31.4, 32.2, "reached"),
        incident(1, 1, "straggler", 10.0, 11.4, 31.4, "superseded", superseded_by=2)]}
    rep = report(goodput)
    assert [f["cost"]["not_back_by_s"] for f in rep["faults"]] == [31.4, None]
    rows = [line for line in cost_markdown(rep).splitlines() if line.startswith(("| 1 ", "| 2 "))]
    assert "not back at pace by 31.4s: includes every slow second until then" in rows[0]
    assert "not back at pace" not in rows[1], rows[1]
    # never back: its cost runs to the ledger's last read
    goodput = {"at": T0 + 44.0, "incidents": [
        incident(1, 1, "straggler", 10.0, 11.4, None, None)]}
    rep = report(goodput)
    assert rep["faults"][0]["cost"]["not_back_by_s"] == 44.0
    assert "not back at pace by 44.0s: includes every slow second" in cost_markdown(rep)


def test_recovery_is_from_the_faults_onset_when_the_ledgers_incident_began_later():
    """A slow link judged only once the job ran slow enough: the ledger's incident began 8 s after
    the strike, and the cost table's recovery (the ledger's own, 4.4 s) contradicted the stage
    table's back at pace (+12.4 s). Both are from the fault's onset now, and the cost says the
    time before the incident is not in it."""
    goodput = {"at": T0 + 44.0, "incidents": [
        incident(2, 2, "hang", 30.0, 31.4, 32.2, "reached"),
        incident(1, 1, "straggler", 18.0, 19.4, 22.4, "reached")]}
    late = {**STRAGGLER, "detected_at_s": 19.4, "evicted_at_s": 19.5,
            "survivors_committing_at_s": 20.0, "restarted_at_s": 20.0, "rejoined_at_s": 22.0}
    faults = [late, dict(HANG)]
    recoveries(faults, [{"name": "healthy", "start_s": 0.0, "end_s": 10.0, "steps": 50,
                         "step_rate": RATE, "vs_healthy": 1.0}], two_faults_run(), [],
               [{**EVICTIONS[0], "at_s": 19.5}, EVICTIONS[1]], goodput, T0, 45.0, 3,
               recovery.TORCHFT_DEFAULTS)
    rep = {"faults": faults}
    first, second = rep["faults"]
    assert first["recovery_s"] == 12.4 and first["stages"]["back_at_pace_ledger"] == 22.4
    assert second["recovery_s"] == 2.2  # the ledger's began at the strike: as before
    rows = [line for line in cost_markdown(rep).splitlines() if line.startswith(("| 1 ", "| 2 "))]
    assert "| 12.4s (ledger)" in rows[0], rows[0]
    assert "from +8.0s, when the ledger's incident began (the job first judged slow): the time " \
        "before is not in it" in rows[0], rows[0]
    assert "when the ledger's incident began" not in rows[1], rows[1]


def paced_run(*pieces):
    """The three groups committing together; ``pieces``: (until, seconds per step) run one after
    another, or a bare number: a gap in which nothing commits, to that time."""
    out, step, t = [], 0, 0.0
    for p in pieces:
        if not isinstance(p, tuple):
            t = p
            continue
        until, dt = p
        while t + dt <= until + 1e-9:
            t = round(t + dt, 3)
            step += 1
            out.extend(sample(t, g, step, t) for g in range(3))
    return out


def test_a_fault_given_at_start_acts_at_its_detection_not_its_arming():
    """A crash armed at the group's launch (2 s) whose rank never reported the strike (the
    demo counts its detection from arming), caught at 40 s; a straggler struck at 10 s before
    it, after which the job runs at 0.78x until the crash; full pace from 42 s."""
    crash = {**RECORD, "given": "start", "detected_kind": "dead", "injected_at_s": 2.0,
             "replica_group": 2, "spec": "crash:at_step=190", "struck_at_s": None,
             "detected_at_s": 40.0, "evicted_at_s": 40.1, "survivors_committing_at_s": 42.0,
             "restarted_at_s": 41.0, "rejoined_at_s": 43.0}
    faults = [crash, dict(STRAGGLER)]
    evictions = [EVICTIONS[0], {**EVICTIONS[1], "at_s": 40.1}]
    assert recovery.next_fault(faults, 0) is None and recovery.next_fault(faults, 1) == 0
    phases = [{"name": "healthy", "start_s": 0.0, "end_s": 10.0, "steps": 50,
               "step_rate": RATE, "vs_healthy": 1.0}]
    run = paced_run((10.0, 1 / RATE), (11.5, 1.0), 12.0, (40.0, 1 / (0.78 * RATE)), 42.0,
                    (60.0, 1 / RATE))
    recoveries(faults, phases, run, [], evictions, None, T0, 60.0, 3, recovery.TORCHFT_DEFAULTS)
    rep = {"faults": faults, "phases": phases}
    # the crash's recovery is its own, the straggler's search stops where the crash acted
    assert faults[0]["stages"]["back_at_pace"] == 42.2
    assert faults[1]["stages"]["back_at_pace"] is None
    story = story_lines(rep)
    assert "back at pace at 42.2s" in story[0] and "not back" not in story[0], story[0]
    assert "not back at pace before fault 1 (40.0s)" in story[1], story[1]
    rows = [line for line in summary_markdown(rep).splitlines()
            if line.startswith(("| 1 | `", "| 2 | `"))]
    assert "| 42.2s |" in rows[0] and "| not before #1 |" in rows[1], rows
    # a fault that never acted (armed, never struck nor caught) cuts nothing
    idle = {**crash, "detected_at_s": None, "evicted_at_s": None}
    assert recovery.next_fault([idle, dict(STRAGGLER)], 1) is None
    assert recovery.pace_until([idle, dict(STRAGGLER)], 1, 60.0) == 60.0


def test_the_last_fault_not_back_reads_so_in_the_story_and_the_table():
    faults = [dict(STRAGGLER)]
    phases = [{"name": "healthy", "start_s": 0.0, "end_s": 10.0, "steps": 50,
               "step_rate": RATE, "vs_healthy": 1.0}]
    run = paced_run((10.0, 1 / RATE), (11.5, 1.0), 12.0, (30.0, 1 / (0.78 * RATE)))
    recoveries(faults, phases, run, [], EVICTIONS[:1], None, T0, 30.0, 3,
               recovery.TORCHFT_DEFAULTS)
    rep = {"faults": faults, "phases": phases}
    assert "not back at pace by the end" in story_lines(rep)[0]
    row = next(line for line in summary_markdown(rep).splitlines() if line.startswith("| 1 | `"))
    assert "| not by the end |" in row, row


def test_a_live_fault_that_never_reported_its_strike_acts_at_its_injection():
    """A crash injected live at 30 s whose rank exited before reporting the strike, caught as
    dead at 36 s; torchft's own recovery runs the survivors at full pace from 31 s. The POST is
    within a step of the strike: the straggler before it is cut there, not at the detection,
    so the crash's recovery is not the straggler's back at pace."""
    crash = {**RECORD, "detected_kind": "dead", "injected_at_s": 30.0, "replica_group": 2,
             "spec": "crash:at_step=150", "struck_at_s": None, "detected_at_s": 36.0,
             "evicted_at_s": 36.1, "survivors_committing_at_s": 31.0, "restarted_at_s": 36.5,
             "rejoined_at_s": 39.0,
             "note": "the rank never reported the strike; detection counted from arming"}
    faults = [dict(STRAGGLER), crash]
    assert recovery.acted_at(crash) == 30.0
    assert recovery.acted_at({**crash, "given": "start"}) == 36.0  # armed at launch: caught
    assert recovery.pace_until(faults, 0, 60.0) == 30.0
    phases = [{"name": "healthy", "start_s": 0.0, "end_s": 10.0, "steps": 50,
               "step_rate": RATE, "vs_healthy": 1.0}]
    run = paced_run((10.0, 1 / RATE), (11.5, 1.0), 12.0, (30.0, 1 / (0.78 * RATE)), 31.0,
                    (60.0, 1 / RATE))
    evictions = [EVICTIONS[0], {**EVICTIONS[1], "at_s": 36.1}]
    recoveries(faults, phases, run, [], evictions, None, T0, 60.0, 3, recovery.TORCHFT_DEFAULTS)
    assert faults[0]["stages"]["back_at_pace"] is None
    story = story_lines({"faults": faults, "phases": phases})
    assert "not back at pace before fault 2 (30.0s)" in story[0], story[0]
