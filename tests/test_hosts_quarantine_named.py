"""The host ledger (monitor/act/hosts.py) names the offence that quarantined a host, and a release
sent again to clear a failed one leaves a host that offends again to be judged: a real SQLite
store, a fake clock and a recording sink, as in test_hosts.py."""

from __future__ import annotations

from monitor.act.sinks import ActionResult
from tests.test_hosts import Clock, RecordingSink, finding, ledger


def _quarantined(led, sink, now):
    """(the event each sink got, the host as /v1/hosts shows it, the audit log's decision)."""
    [event] = [e for e in sink.calls if e["event"] == "quarantine"]
    [host] = led.to_json(now)
    decision = next(d for d in led.store.host_decisions() if d["decision"] == "quarantine")
    return event, host, decision


def test_a_quarantine_held_then_lifted_names_its_own_kinds_finding(tmp_path):
    """A hang held by --min-replicas, then a straggler in another group (one of two, not due),
    then the rail lifts: the quarantine is the hang's, so its event (the Slurm drain's reason,
    the taint's finding) names the hang's finding and group, not the newer straggler's."""
    clock, sink = Clock(), RecordingSink()
    led = ledger(tmp_path, clock, [sink])
    held = {"h1": "would leave 1 of 2 replica groups"}
    led.record([finding("hang", "h1", 1, group=1, rid="g1:a")], clock())
    assert [d["decision"] for d in led.decide(clock(), None, 10, lambda: held)] == ["hold"]
    clock.t += 60
    led.record([finding("straggler", "h1", 2, group=5, rid="g5:a")], clock())
    held.clear()
    clock.t += 5
    assert [d["decision"] for d in led.decide(clock(), None, 10, lambda: held)] == ["quarantine"]
    led.run_actions(clock())
    event, host, decision = _quarantined(led, sink, clock())
    assert event["kind"] == "hang"
    assert (event["finding"]["id"], event["finding"]["replica_group"],
            event["finding"]["replica_id"]) == (1, 1, "g1:a")
    assert (host["state"], host["kind"], host["finding_id"]) == ("quarantined", "hang", 1)
    assert decision["reason"] == "hang"  # its evidence still lists both offences
    assert {o["finding_id"] for o in decision["evidence"]["offences"]} == {1, 2}


def test_two_findings_of_one_sweep_the_quarantine_names_the_due_kinds(tmp_path):
    clock, sink = Clock(), RecordingSink()
    led = ledger(tmp_path, clock, [sink])
    led.record([finding("hang", "h1", 7, group=2, rid="g2:a"),
                finding("straggler", "h1", 8, group=3, rid="g3:a")], clock())
    led.decide(clock(), None, 10)
    led.run_actions(clock())
    event, host, _ = _quarantined(led, sink, clock())
    assert (event["kind"], event["finding"]["id"], event["finding"]["replica_group"]) \
        == ("hang", 7, 2)
    assert host["finding_id"] == 7


class Refusing(RecordingSink):
    """Releases refused for good (a 403) while ``broken``; everything else carried out."""

    broken = False

    def release(self, event):
        if not self.broken:
            return super().release(event)
        self.calls.append(event)
        return ActionResult(False, "HTTP 403 forbidden", retry=False)


def test_a_release_sent_again_to_clear_a_failure_keeps_the_hosts_new_offences(tmp_path):
    """docs/quarantine.md: a host whose release failed may be released again once its sink is
    fixed. The host meanwhile offended again (suspect): that release is carried out, and the
    host's new straggler still counts, so the next one quarantines it."""
    clock, sink = Clock(), Refusing()
    led = ledger(tmp_path, clock, [sink], window_s=3600)
    led.record([finding("hang", "h1", 1)], clock())
    led.decide(clock(), None, 10)
    led.run_actions(clock())
    clock.t += 100
    sink.broken = True
    led.release("h1", "done with it")
    led.run_actions(clock())
    assert led.to_json(clock())[0]["last_action"]["status"] == "failed"
    clock.t += 100
    led.record([finding("straggler", "h1", 2, rid="g1:b")], clock())
    led.decide(clock(), None, 10)
    assert led.to_json(clock())[0]["state"] == "suspect"
    sink.broken = False
    clock.t += 10
    assert led.release("h1", "sink fixed")["decision"] == "release"
    led.run_actions(clock())
    [host] = led.to_json(clock())
    assert (host["state"], host["last_action"]["op"], host["last_action"]["status"]) \
        == ("suspect", "release", "done")
    assert [o["in_window"] for o in host["offences"]] == [True, False]  # the straggler counts
    clock.t += 100
    led.record([finding("straggler", "h1", 3, rid="g1:c")], clock())
    assert [d["decision"] for d in led.decide(clock(), None, 10)] == ["quarantine"]
    led.run_actions(clock())
    assert [e["event"] for e in sink.calls][-1] == "quarantine"
    assert led.quarantined() == ["h1"]
