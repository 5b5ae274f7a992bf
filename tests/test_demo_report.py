"""The demo report's phases (:func:`lightkeeper.report.phases`) from plain data in the shape the
demo records: ``ticks``, (seconds since the start, the job's highest step), one every 0.5 s while
the demo watches the ranks. The real processes run in ``tests/test_demo_e2e.py``."""

from __future__ import annotations

import pytest

from lightkeeper.report import phases

RATE = 4.0  # steps/s, the job's pace throughout


def steady(start: float, stop: float) -> list[tuple[float, int]]:
    n = int(round((stop - start) / 0.5))
    return [(start + 0.5 * i, int(RATE * 0.5 * i)) for i in range(n + 1)]


FAULT = {"replica_group": 1, "spec": "slow_compute:delay=0.6", "group_rank": 1,
         "struck_at_s": 20.0, "evicted_at_s": None, "rejoined_at_s": 30.2}


def test_the_last_phase_is_paced_up_to_the_last_look_not_to_the_stop():
    """The report is written after the ranks were stopped (3 s here): the job was not seen in
    that time, so it does not count against the last phase's pace."""
    ticks = steady(10.0, 60.0)
    got = phases(10.0, 63.0, [FAULT], groups=3, ticks=ticks)
    assert [p["name"] for p in got] == ["healthy", "slow_compute in group 1 rank 1",
                                        "healthy (group 1 rejoined)"]
    assert got[-1]["end_s"] == 63.0
    assert [p["step_rate"] for p in got] == [RATE, RATE, RATE]
    assert [p["vs_healthy"] for p in got] == [1.0, 1.0, 1.0]


def test_a_rejoin_while_another_group_is_out_of_the_quorum_is_not_called_healthy():
    """Group 1 evicted and back; group 2 hung meanwhile, held, never evicted: the Lighthouse's
    quorum left it out. After group 1's rejoin the job trains on 2 groups, group 2 out."""
    hang = {"replica_group": 2, "spec": "hang:at_step=46", "group_rank": 1,
            "struck_at_s": 31.7, "evicted_at_s": None, "rejoined_at_s": None}
    slow = {**FAULT, "struck_at_s": 26.7, "evicted_at_s": 31.9, "rejoined_at_s": 37.9}
    members = [["replica_group_0:a", "replica_group_1:b", "replica_group_2:c"],
               ["replica_group_0:a", "replica_group_1:d"]]
    lighthouse = [{"t": 15.3, "quorum_id": 2, "members": members[0]},
                  {"t": 37.4, "quorum_id": 3, "members": members[1]}]
    got = phases(16.3, 91.3, [slow, hang], 3, steady(16.0, 91.5), lighthouse=lighthouse)
    assert [(p["name"], p["start_s"], p["end_s"]) for p in got][-2:] == [
        ("group 1 evicted (2 groups)", 31.9, 37.9),
        ("group 1 rejoined, group 2 out (2 groups)", 37.9, 91.3)]


def test_a_phase_is_paced_between_the_looks_that_saw_its_ends():
    """A phase from 20.2 s to 30.4 s is read at the looks of 20.0 s and 30.0 s: its steps over
    those 10 s, not over the phase's own 10.2 s."""
    ticks = steady(10.0, 40.0)
    got = phases(10.0, 40.0, [{**FAULT, "struck_at_s": 20.2, "rejoined_at_s": 30.4}], 3, ticks)
    fault = got[1]
    assert (fault["start_s"], fault["end_s"], fault["steps"]) == (20.2, 30.4, 40)
    assert fault["step_rate"] == pytest.approx(RATE)


def test_a_phase_seen_in_one_look_only_has_no_pace():
    ticks = steady(10.0, 20.0)
    got = phases(10.0, 20.4, [{**FAULT, "struck_at_s": 19.6, "rejoined_at_s": None}], 3, ticks)
    assert got[-1]["step_rate"] is None and got[-1]["vs_healthy"] is None


def test_a_held_quarantine_reads_as_its_reason_and_detail():
    from lightkeeper.report import host_state

    view = {"hosts": [{"host": "node-2", "state": "suspect",
                       "offences": [{"kind": "hang", "in_window": True}],
                       "hold": {"at": 1795745781.47, "reason": "dry_run",
                                "detail": "--quarantine-dry-run: decided, nothing done"}}]}
    assert host_state(view, "node-2") == ("suspect (1 hang offence), held (dry_run): "
                                          "--quarantine-dry-run: decided, nothing done")


def test_a_report_without_its_picture_says_why_and_names_no_png(tmp_path, monkeypatch):
    """matplotlib missing (a job's environment without ``[trainer]``): the report is written,
    says the picture is not drawn and why, and no older run's timeline.png passes for it."""
    import argparse
    from types import SimpleNamespace as NS

    from lightkeeper import demo as demo_cli
    from lightkeeper import report
    from lightkeeper.scenario import Scenario

    def no_matplotlib(*a, **kw):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(report, "plot", no_matplotlib)
    p = argparse.ArgumentParser()
    demo_cli.add_arguments(p)
    demo = NS(args=p.parse_args([]), sc=Scenario(), dir=tmp_path, evictions=[], faults=[],
              goodput=None, lighthouse_log=[], now=lambda: 10.0, samples=[], t=lambda: 10.0,
              ticks=[], train_start_s=None, t0_unix=0.0, hosts=None, waiting={}, soak=None,
              interrupted=False, error=None, monitor_url=None, report_dir=None, pids=dict,
              prom_note=None, prom=None, events=[], findings=[], user_url=lambda u: u,
              cluster=NS(lighthouse_url="http://lh", monitor_url="http://m"))
    (tmp_path / "timeline.png").write_bytes(b"an older run's")
    report.write_report(demo, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "No timeline picture: ImportError: No module named 'matplotlib'" in md
    assert "timeline.png" not in md and not (tmp_path / "timeline.png").exists()
    assert "matplotlib" in (tmp_path / "timeline.error.txt").read_text()
    # the start in UTC, as bundles and the audit log date everything (the on-call lines them up)
    assert "Times are seconds since the demo started (1970-01-01T00:00:00Z)." in md


def test_final_steps_takes_a_groups_furthest_rank_at_its_last_look():
    """The ranks of one look answer at their own times: the furthest of the last look counts,
    not whichever answered last."""
    from lightkeeper.report import final_steps

    samples = [{"replica_group": 0, "tick": 9.5, "t": 9.51, "step": 97},
               {"replica_group": 0, "tick": 10.0, "t": 10.001, "step": 100},
               {"replica_group": 0, "tick": 10.0, "t": 10.002, "step": 99},
               {"replica_group": 1, "t": 10.0, "step": 98}]  # an older timeline: no tick
    assert final_steps(samples) == {"0": 100, "1": 98}


def test_the_steps_short_of_pace_and_the_costs_job_steps_say_what_they_count():
    """A hung group held out (run3): the job stepped at pace on 2 groups, 0 steps behind, while
    the ledger's cost counts the capacity lost, in job steps' worth. One word, two things: no."""
    from lightkeeper.report_text import cost_markdown, summary_markdown

    f = {"replica_group": 2, "group_rank": 1, "spec": "hang:at_step=46", "given": "start",
         "injected_at_s": 16.3, "struck_at_s": 31.7, "detected_kind": "hang",
         "detected_at_s": 33.4, "evicted_at_s": None, "survivors_committing_at_s": None,
         "rejoined_at_s": None, "restarted_at_s": None, "steps_lost": 0,
         "outcome": "detected, not evicted",
         "stages": {}, "recovery_s": 6.1,
         "cost": {"replica_seconds": 63.8, "job_steps": 88.0, "by_cause": {"stall": 9.0}}}
    text = summary_markdown({"faults": [f], "phases": []}) + cost_markdown({"faults": [f]})
    assert "steps lost" not in text
    assert "| steps behind pace |" in text and "| 0 | detected, not evicted |" in text
    assert "63.8 replica-s, 88.0 job steps of capacity (stall 9.0)" in text


def test_a_detection_not_evicted_links_its_confirmation_bundle():
    """A dry run holds every eviction: the findings' bundles were kept at confirmation and the
    goodput incidents list them; the report linked none (only evictions carried a bundle)."""
    from lightkeeper.report import detections

    findings = [{"id": 7, "kind": "hang", "replica_group": 2, "replica_id": "r2", "ranks": [5],
                 "confirmed_at": 1010.0, "evidence": {}},
                {"id": 8, "kind": "straggler", "replica_group": 1, "replica_id": "r1",
                 "ranks": [3], "confirmed_at": 1020.0, "evidence": {}}]
    holds = [{"decision": "hold", "reason": "dry_run", "replica_group": 2, "replica_id": "r2",
              "at": 1010.1, "bundle": None},
             {"decision": "evict", "reason": "straggler", "replica_group": 1,
              "replica_id": "r1", "at": 1020.1, "bundle": "b-evict"}]
    incidents = [{"finding_ids": [7], "bundles": ["b-confirm"]},
                 {"finding_ids": [8], "bundles": ["b-other"]}]
    got = detections(findings, holds, 1000.0, incidents=incidents)
    assert [(d["kind"], d["evicted"], d["bundle"]) for d in got] == [
        ("hang", False, "b-confirm"), ("straggler", True, "b-evict")]
    assert [d["bundle"] for d in detections(findings, holds, 1000.0)] == [None, "b-evict"]
