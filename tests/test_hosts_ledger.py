"""The host ledger's rails and actions together (monitor/act/hosts.py): several quarantines
against --min-replicas, several sinks each with its own outcome, an action overtaken before it
was ever attempted, and a decision the audit log refused. A real SQLite store, a fake clock and
fake sinks, as in test_hosts.py."""

from __future__ import annotations

import sqlite3
from types import SimpleNamespace as NS

import pytest
from prometheus_client import generate_latest

from monitor.act.host_actions import monitor_identity
from monitor.act.hosts import HostLedger, protected_hosts
from monitor.act.sinks import ActionResult
from monitor.act.sinks.hooks import ExecSink
from monitor.api.metrics import MonitorMetrics
from monitor.config import QuarantineConfig
from monitor.store import Store
from tests import test_hosts_sinks
from tests.test_hosts import Clock, RecordingSink, finding, ledger

kube = test_hosts_sinks.kube  # the fake API server


class Scripted:
    """A fake sink answering each call with the next of its scripted results."""

    def __init__(self, name: str, *results: ActionResult) -> None:
        self.name, self.results, self.calls = name, list(results), []

    def _do(self, event):
        self.calls.append((event["event"], event["host"]))
        return self.results.pop(0) if self.results else ActionResult(True, "ok")

    quarantine = release = _do


def by_host(led: HostLedger, now: float) -> dict[str, dict]:
    return {h["host"]: h for h in led.to_json(now)}


def failed_series(led: HostLedger, now: float) -> list[str]:
    metrics = MonitorMetrics("job")
    metrics.set_hosts(led.counts(), led.to_json(now))
    return [line for line in generate_latest(metrics.registry).decode().splitlines()
            if line.startswith("lightkeeper_monitor_host_action_failed{")]


def quorum_of_four():
    from tests.test_monitor_detectors import T0, Job

    job = Job(groups=4, ranks=2)  # one host per group (host-g0 ... host-g3), all in the quorum
    job.steps(2, now=T0)
    return job.view(T0)


def test_two_hosts_due_together_never_take_the_quorum_below_min_replicas(tmp_path):
    """4 groups, --min-replicas 3: each of two due hosts alone leaves 3, both together 2. The
    first is quarantined; the second is held, in that sweep and the next."""
    clock, view = Clock(), quorum_of_four()
    led = ledger(tmp_path, clock, max_quarantined=4)
    led.record([finding("hang", "host-g0", 1, group=0), finding("hang", "host-g1", 2, group=1)],
               clock())
    out = led.decide(clock(), None, 40, lambda: protected_hosts(view, 3))
    assert [(d["host"], d["decision"], d["reason"]) for d in out] == [
        ("host-g0", "quarantine", "hang"), ("host-g1", "hold", "min_replicas")]
    assert "leaving 2, fewer than --min-replicas 3" in out[1]["detail"]
    clock.t += 30  # host-g0's group still listed in the quorum: still held
    assert led.decide(clock(), None, 40, lambda: protected_hosts(view, 3)) == []
    assert led.quarantined() == ["host-g0"]
    assert by_host(led, clock())["host-g1"]["hold"]["reason"] == "min_replicas"


def test_a_group_sent_a_kill_counts_as_down(tmp_path):
    clock, view = Clock(), quorum_of_four()
    led = ledger(tmp_path, clock, max_quarantined=4)
    led.store.add_decision(replica_group=2, replica_id=view.groups[2].replica_id,
                           decision="evict", reason="hang", status="sent", at=clock())
    led.record([finding("hang", "host-g0", 1, group=0)], clock())
    out = led.decide(clock(), None, 40, lambda: protected_hosts(view, 3))
    assert [(d["decision"], d["reason"]) for d in out] == [("hold", "min_replicas")]
    assert led.quarantined() == []


def test_one_sinks_permanent_failure_is_not_hidden_by_anothers_later_success(tmp_path):
    """k8s answers 403 at once; the webhook's first attempt fails, its retry succeeds. The
    node was never cordoned: /v1/hosts and the metric must go on saying so, for the quarantine
    and for the release, and the host must stay in the ledger and be releasable again."""
    clock = Clock()
    k8s = Scripted("k8s", ActionResult(False, "HTTP 403: forbidden", retry=False),
                   ActionResult(False, "HTTP 403: nodes is forbidden", retry=False))
    hook = Scripted("webhook:x", ActionResult(False, "unreachable"), ActionResult(True, "200"),
                    ActionResult(False, "unreachable"), ActionResult(True, "200"))
    led = ledger(tmp_path, clock, [k8s, hook], window_s=100)
    led.record([finding("hang", "h1", 1)], clock())
    led.decide(clock(), None, 10)
    led.run_actions(clock())
    clock.t += 10
    led.run_actions(clock())  # the webhook's retry: done
    h = by_host(led, clock())["h1"]
    assert (h["last_action"]["sink"], h["last_action"]["status"]) == ("k8s", "failed")
    assert {s: a["status"] for s, a in h["actions"].items()} == {"k8s": "failed",
                                                                  "webhook:x": "done"}
    assert failed_series(led, clock()) == [
        'lightkeeper_monitor_host_action_failed{host="h1",job="job",sink="k8s"} 1.0']

    led.release("h1", "fixed")
    led.run_actions(clock())
    clock.t += 10
    led.run_actions(clock())
    h = by_host(led, clock())["h1"]
    assert (h["last_action"]["op"], h["last_action"]["sink"], h["last_action"]["status"]) == (
        "release", "k8s", "failed")
    clock.t += 101  # ok again, no rank there: kept, its failed release still shown
    led.decide(clock(), None, 10)
    led.observe(NS(ranks={}), clock())
    assert by_host(led, clock())["h1"]["state"] == "ok"
    assert failed_series(led, clock()) == [
        'lightkeeper_monitor_host_action_failed{host="h1",job="job",sink="k8s"} 1.0']
    assert led.release("h1", "RBAC fixed")["decision"] == "release"  # the way out
    led.run_actions(clock())
    assert failed_series(led, clock()) == []
    # a restarted monitor reads where each sink stands from the audit log
    again = HostLedger(led.store, led.cfg, [k8s, hook], "job", clock)
    assert {s: a["status"] for s, a in by_host(again, clock())["h1"]["actions"].items()} == {
        "k8s": "done", "webhook:x": "done"}


def test_a_quarantine_never_attempted_is_not_carried_out_after_its_release(tmp_path):
    """Run 1 quarantines and dies before the sink is called; run 2 (--dry-run) expires the
    TTL; run 3 acts: neither the day-old drain nor a release of it reaches the sink."""
    clock = Clock()
    store = Store(str(tmp_path / "m.sqlite"))
    sink = Scripted("k8s")
    first = HostLedger(store, QuarantineConfig(), [sink], "job", clock)
    first.record([finding("hang", "h1", 1)], clock())
    first.decide(clock(), None, 10)
    clock.t += 86400 + 5
    dry = HostLedger(store, QuarantineConfig(dry_run=True), [sink], "job", clock)
    assert [d["decision"] for d in dry.decide(clock(), None, 10)] == ["release"]
    acting = HostLedger(store, QuarantineConfig(), [sink], "job", clock)
    acting.run_actions(clock())
    assert sink.calls == []
    acts = {a["op"]: a for a in store.host_actions()}
    assert acts["quarantine"]["status"] == "superseded"
    assert (acts["release"]["status"], acts["release"]["attempts"]) == ("done", 0)
    assert "nothing carried out" in acts["release"]["detail"]
    last = by_host(acting, clock())["h1"]["last_action"]
    assert (last["op"], last["status"]) == ("release", "done")


def test_a_release_queued_while_the_action_thread_is_busy_overtakes_its_quarantine(tmp_path):
    """h1's drain is slow; meanwhile h2 is released by hand. h2's drain, read as due before the
    release was queued, must not run."""
    clock = Clock()

    class Slow(Scripted):
        def _do(self, event):
            if event["host"] == "h1":
                led.release("h2", "a false alarm")
            return super()._do(event)

        quarantine = release = _do

    sink = Slow("k8s")
    led = ledger(tmp_path, clock, [sink])
    led.record([finding("hang", "h1", 1), finding("hang", "h2", 2, group=2, rid="g2:a")],
               clock())
    led.decide(clock(), None, 40)
    led.run_actions(clock())
    led.run_actions(clock())
    assert sink.calls == [("quarantine", "h1")]
    assert {(a["host"], a["op"]): a["status"] for a in led.store.host_actions()} == {
        ("h1", "quarantine"): "done", ("h2", "quarantine"): "superseded",
        ("h2", "release"): "done"}


def test_a_release_the_audit_log_refused_is_made_again(tmp_path, monkeypatch):
    """A full disk at TTL expiry or at a POST /release: nothing changes, so the next sweep
    or POST releases the host (it stayed quarantined in memory and on disk)."""
    clock = Clock()
    sink = RecordingSink()
    led = ledger(tmp_path, clock, [sink], ttl_s=100)
    led.record([finding("hang", "h1", 1), finding("hang", "h2", 2)], clock())
    led.decide(clock(), None, 40)
    led.run_actions(clock())
    write = led.store.add_host_decision

    def full(**kw):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(led.store, "add_host_decision", full)
    with pytest.raises(sqlite3.OperationalError):
        led.release("h1", "by hand")
    clock.t += 101
    with pytest.raises(sqlite3.OperationalError):
        led.decide(clock(), None, 40)
    assert led.quarantined() == ["h1", "h2"]
    assert {h["host"]: h["state"] for h in led.store.load_hosts().values()} == {
        "h1": "quarantined", "h2": "quarantined"}
    monkeypatch.setattr(led.store, "add_host_decision", write)
    assert led.release("h1", "by hand")["decision"] == "release"
    assert [(d["host"], d["reason"]) for d in led.decide(clock(), None, 40)] == [("h2", "ttl")]
    led.run_actions(clock())
    assert sorted(c["host"] for c in sink.calls if c["event"] == "release") == ["h1", "h2"]


def test_a_quarantine_the_audit_log_refused_is_made_again(tmp_path, monkeypatch):
    clock = Clock()
    sink = RecordingSink()
    led = ledger(tmp_path, clock, [sink])
    led.record([finding("hang", "h1", 1)], clock())
    write = led.store.add_host_decision

    def full(**kw):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(led.store, "add_host_decision", full)
    with pytest.raises(sqlite3.OperationalError):
        led.decide(clock(), None, 10)
    assert led.quarantined() == [] and by_host(led, clock())["h1"]["state"] == "suspect"
    monkeypatch.setattr(led.store, "add_host_decision", write)
    assert [d["decision"] for d in led.decide(clock(), None, 10)] == ["quarantine"]
    led.run_actions(clock())
    assert [c["event"] for c in sink.calls] == ["quarantine"]


def test_a_release_after_a_chain_never_attempted_still_undoes_the_quarantine_carried_out(
        tmp_path):
    """Q is carried out (the node cordoned); before the action thread runs again a release, a
    re-quarantine and a second release are queued. The first two are dropped, but the sink
    holds Q's cordon: the last release must reach it."""
    clock = Clock()
    sink = Scripted("k8s")
    led = ledger(tmp_path, clock, [sink], window_s=100)
    led.record([finding("hang", "h1", 1)], clock())
    led.decide(clock(), None, 10)
    led.run_actions(clock())
    clock.t += 5
    led.release("h1", "a false alarm")
    clock.t += 5
    led.record([finding("hang", "h1", 2)], clock())
    assert [d["decision"] for d in led.decide(clock(), None, 10)] == ["quarantine"]
    clock.t += 5
    led.release("h1", "a false alarm again")
    led.run_actions(clock())
    assert sink.calls == [("quarantine", "h1"), ("release", "h1")]
    assert [(a["op"], a["status"], a["attempts"]) for a in
            sorted(led.store.host_actions(), key=lambda a: a["id"])] == [
        ("quarantine", "done", 1), ("release", "superseded", 0),
        ("quarantine", "superseded", 0), ("release", "done", 1)]


def test_a_release_whose_earlier_release_failed_reaches_the_sink(tmp_path):
    """Q0 done, R0 failed (the node still cordoned), Q1 never attempted, R1: R1 runs."""
    clock = Clock()
    sink = Scripted("k8s", ActionResult(True, "cordoned"),
                    ActionResult(False, "HTTP 403: forbidden", retry=False))
    led = ledger(tmp_path, clock, [sink], window_s=100)
    led.record([finding("hang", "h1", 1)], clock())
    led.decide(clock(), None, 10)
    led.run_actions(clock())
    led.release("h1", "a false alarm")
    led.run_actions(clock())
    clock.t += 5
    led.record([finding("hang", "h1", 2)], clock())
    assert [d["decision"] for d in led.decide(clock(), None, 10)] == ["quarantine"]
    clock.t += 5
    led.release("h1", "RBAC fixed")
    led.run_actions(clock())
    assert sink.calls == [("quarantine", "h1"), ("release", "h1"), ("release", "h1")]
    assert failed_series(led, clock()) == []


def test_a_release_after_a_quarantine_the_monitors_death_cut_short_reaches_the_sink(tmp_path):
    """The sink is called for the quarantine and the monitor dies before the answer is written;
    the restarted monitor's release must reach the sink (the node may be cordoned)."""
    clock = Clock()
    store = Store(str(tmp_path / "m.sqlite"))

    class Dies(Scripted):
        def _do(self, event):
            super()._do(event)
            raise KeyboardInterrupt  # the monitor stopped mid-call: nothing after it runs

        quarantine = release = _do

    first = HostLedger(store, QuarantineConfig(), [Dies("k8s")], "job", clock)
    first.record([finding("hang", "h1", 1)], clock())
    first.decide(clock(), None, 10)
    with pytest.raises(KeyboardInterrupt):
        first.run_actions(clock())
    sink = Scripted("k8s")
    again = HostLedger(store, QuarantineConfig(), [sink], "job", clock)
    again.release("h1", "a false alarm")
    again.run_actions(clock())
    assert sink.calls == [("release", "h1")]
    assert {a["op"]: a["status"] for a in store.host_actions()} == {
        "quarantine": "superseded", "release": "done"}


def test_a_sink_no_longer_configured_neither_alerts_nor_keeps_its_host(tmp_path):
    """k8s and webhook A; A's quarantine fails for good. A's URL is swapped for B's (another
    sink name) and the monitor restarted: once released and ok with no rank there, the host is
    forgotten and no host_action_failed series stays; A's action is shown, not counted."""
    clock = Clock()
    store = Store(str(tmp_path / "m.sqlite"))
    cfg = QuarantineConfig(window_s=100, ttl_s=1000)
    k8s = Scripted("k8s")
    a = Scripted("webhook:https://a.example...#aaaa1111",
                 ActionResult(False, "HTTP 410: gone", retry=False))
    led = HostLedger(store, cfg, [k8s, a], "job", clock)
    led.record([finding("hang", "h1", 1)], clock())
    led.decide(clock(), None, 10)
    led.run_actions(clock())
    assert failed_series(led, clock()) == ['lightkeeper_monitor_host_action_failed{host="h1",'
                                           'job="job",sink="webhook:https://a.example...#aaaa1111"'
                                           '} 1.0']
    b = Scripted("webhook:https://b.example...#bbbb2222")
    led = HostLedger(store, cfg, [k8s, b], "job", clock)
    assert failed_series(led, clock()) == []
    h = by_host(led, clock())["h1"]
    assert h["actions"]["webhook:https://a.example...#aaaa1111"]["configured"] is False
    assert h["last_action"]["sink"] == "k8s"
    clock.t += 1001
    assert [d["reason"] for d in led.decide(clock(), None, 10)] == ["ttl"]
    led.run_actions(clock())
    assert b.calls == [("release", "h1")]
    clock.t += 101
    led.decide(clock(), None, 10)
    led.observe(NS(ranks={}), clock())
    assert led.to_json(clock()) == [] and failed_series(led, clock()) == []


def test_a_pending_action_of_a_sink_no_longer_configured_is_shown_never_alerted(tmp_path):
    clock = Clock()
    store = Store(str(tmp_path / "m.sqlite"))
    k8s, gone = Scripted("k8s"), Scripted("exec:/bin/drain...#cccc3333")
    first = HostLedger(store, QuarantineConfig(), [k8s, gone], "job", clock)
    first.record([finding("hang", "h1", 1)], clock())
    first.decide(clock(), None, 10)  # the monitor dies before either sink is called
    led = HostLedger(store, QuarantineConfig(), [k8s], "job", clock)
    led.run_actions(clock())
    assert k8s.calls == [("quarantine", "h1")] and gone.calls == []
    assert failed_series(led, clock()) == []
    assert by_host(led, clock())["h1"]["actions"]["exec:/bin/drain...#cccc3333"][
        "configured"] is False


SECRET_SINK = "webhook:https://hooks.slack.com/services/T0/B0/XXXXSECRET"


def test_an_older_versions_sink_name_never_shows_its_secret(tmp_path):
    """An older version named a sink by its whole --action; that webhook is since removed
    (or its secret rotated): neither /v1/hosts nor the metrics show the URL's path, whether
    the name is in the audit log (h1) or only in a saved host (h2: its rows dropped as old)."""
    clock = Clock()
    store = Store(str(tmp_path / "m.sqlite"))
    aid = store.add_host_action(host="h1", sink=SECRET_SINK, op="quarantine",
                                status="failed", event={}, at=1, next_at=None, detail="HTTP 500")
    done = store.add_host_action(host="h1", sink="k8s", op="quarantine", status="done",
                                 event={}, at=2, next_at=None)
    for host, last in (("h1", {"id": done, "sink": "k8s", "op": "quarantine", "status": "done"}),
                       ("h2", {"id": aid, "sink": SECRET_SINK, "op": "quarantine",
                               "status": "failed"})):
        store.save_host(host, {"host": host, "node": host, "devices": [], "state": "quarantined",
                               "state_since": 1, "last_action": last}, 2)
    led = HostLedger(store, QuarantineConfig(), [], "job", clock)
    shown = repr(led.to_json(clock())) + "\n".join(failed_series(led, clock()))
    assert "SECRET" not in shown and "/services" not in shown
    assert "webhook:https://hooks.slack.com...#" in shown
    assert all("SECRET" not in a["sink"] for a in store.host_actions())


DRAIN = "exec:/bin/drain...#cccc3333"


def test_a_dry_run_without_the_sink_fails_its_waiting_action_so_no_later_run_carries_it_out(
        tmp_path):
    """Run A's drain hook fails and is retried; run B (--dry-run, no --action) fails it ("no
    longer configured"), expires the TTL and forgets the host; run C, the hook configured
    again, must not drain a node nothing tracks any more."""
    clock = Clock()
    store = Store(str(tmp_path / "m.sqlite"))
    cfg = QuarantineConfig(window_s=100, ttl_s=1000)
    hook = Scripted(DRAIN, ActionResult(False, "exit status 1"))
    first = HostLedger(store, cfg, [hook], "job", clock)
    first.record([finding("hang", "h1", 1)], clock())
    first.decide(clock(), None, 10)
    first.run_actions(clock())
    assert by_host(first, clock())["h1"]["actions"][DRAIN]["status"] == "retrying"
    dry = HostLedger(store, QuarantineConfig(window_s=100, ttl_s=1000, dry_run=True), [],
                     "job", clock)
    a = by_host(dry, clock())["h1"]["actions"][DRAIN]
    assert (a["op"], a["status"], a["attempts"], a["configured"]) == (
        "quarantine", "failed", 1, False)
    assert "no longer configured" in a["detail"] and "exit status 1" in a["detail"]
    assert failed_series(dry, clock()) == []
    clock.t += 1001
    assert [d["reason"] for d in dry.decide(clock(), None, 10)] == ["ttl"]
    clock.t += 101
    dry.decide(clock(), None, 10)
    dry.observe(NS(ranks={}), clock())
    assert dry.to_json(clock()) == []
    acting = HostLedger(store, cfg, [hook], "job", clock)
    acting.run_actions(clock())
    assert hook.calls == [("quarantine", "h1")]  # run A's attempt only
    assert [(a["op"], a["status"]) for a in store.host_actions()] == [("quarantine", "failed")]


def test_a_released_host_whose_quarantine_a_dry_run_failed_can_be_released_on_the_sink(
        tmp_path):
    """As above, but the host is still in the ledger (released) when the hook is configured
    again: its failed quarantine alerts, and a release (the way out) reaches the hook."""
    clock = Clock()
    store = Store(str(tmp_path / "m.sqlite"))
    cfg = QuarantineConfig(window_s=100, ttl_s=1000)
    hook = Scripted(DRAIN, ActionResult(False, "exit status 1"))
    first = HostLedger(store, cfg, [hook], "job", clock)
    first.record([finding("hang", "h1", 1)], clock())
    first.decide(clock(), None, 10)
    first.run_actions(clock())
    dry = HostLedger(store, QuarantineConfig(window_s=100, ttl_s=1000, dry_run=True), [],
                     "job", clock)
    clock.t += 1001
    assert [d["reason"] for d in dry.decide(clock(), None, 10)] == ["ttl"]
    acting = HostLedger(store, cfg, [hook], "job", clock)
    acting.run_actions(clock())
    assert hook.calls == [("quarantine", "h1")]
    assert failed_series(acting, clock()) == [
        f'lightkeeper_monitor_host_action_failed{{host="h1",job="job",sink="{DRAIN}"}} 1.0']
    assert acting.release("h1", "undo a partial drain")["decision"] == "release"
    acting.run_actions(clock())
    assert hook.calls == [("quarantine", "h1"), ("release", "h1")]
    assert failed_series(acting, clock()) == []


def test_a_release_after_a_superseded_quarantine_that_was_tried_reaches_the_sink(tmp_path):
    """Q0 tried, then superseded; R0 superseded untried by Q1; Q1 and R1 pending. The sink may
    hold Q0's cordon: R1 must reach it, Q1 must not."""
    clock = Clock()
    store = Store(str(tmp_path / "m.sqlite"))
    ids = []
    for op, status, attempts in (("quarantine", "superseded", 1), ("release", "superseded", 0),
                                 ("quarantine", "pending", 0), ("release", "pending", 0)):
        ids.append(store.add_host_action(host="h1", sink="k8s", op=op, status="pending",
                                         event={"event": op, "host": "h1"}, at=clock(),
                                         next_at=clock()))
        store.update_host_action(ids[-1], status=status, attempts=attempts,
                                 next_at=clock() if status == "pending" else None, detail="",
                                 at=clock())
    store.save_host("h1", {"host": "h1", "node": "h1", "devices": [], "state": "released",
                           "state_since": clock(), "released_at": clock()}, clock())
    sink = Scripted("k8s")
    led = HostLedger(store, QuarantineConfig(), [sink], "job", clock)
    led.run_actions(clock())
    assert sink.calls == [("release", "h1")]
    assert {a["id"]: (a["status"], a["attempts"]) for a in store.host_actions()} == {
        ids[0]: ("superseded", 1), ids[1]: ("superseded", 0), ids[2]: ("superseded", 0),
        ids[3]: ("done", 1)}


def test_a_release_names_the_job_that_quarantined_the_host(tmp_path):
    """Restarted on the same --state under another --job, the monitor releases under the job
    that quarantined the host: its drain and its taint are named for that job. A host saved
    before the ledger kept that job is released under the running monitor's."""
    clock = Clock()
    store = Store(str(tmp_path / "m.sqlite"))
    first = HostLedger(store, QuarantineConfig(max_quarantined=4), [RecordingSink()], "alpha",
                       clock)
    first.record([finding("hang", "h1", 1), finding("hang", "h2", 2)], clock())
    first.decide(clock(), None, 40)
    first.run_actions(clock())
    old = store.load_hosts()["h2"]
    del old["job"]  # as an older version saved it
    store.save_host("h2", old, clock())
    sink = RecordingSink()
    again = HostLedger(store, QuarantineConfig(max_quarantined=4), [sink], "beta", clock)
    assert by_host(again, clock())["h1"]["job"] == "alpha"
    for h in ("h1", "h2"):
        again.release(h, "fixed")
    again.run_actions(clock())
    assert sorted((e["event"], e["host"], e["job"]) for e in sink.calls) == [
        ("release", "h1", "alpha"), ("release", "h2", "beta")]


def test_a_k8s_release_after_a_restart_under_another_job_lifts_the_taint(tmp_path, kube):
    """The same with the k8s sink against the fake API server: job j's taint and cordon are
    lifted by the release of a monitor now running as job ``renamed``."""
    api, rx, sink = kube
    clock = Clock()
    store = Store(str(tmp_path / "m.sqlite"))
    f = finding("hang", "h1", 1)
    f["evidence"]["culprits"][0]["node"] = "node-1"
    first = HostLedger(store, QuarantineConfig(), [sink], "j", clock)
    first.record([f], clock())
    first.decide(clock(), None, 10)
    first.run_actions(clock())
    keys = [t["key"] for t in api.node["spec"]["taints"]]
    assert "lightkeeper.io/quarantined-j" in keys and api.node["spec"]["unschedulable"]
    again = HostLedger(store, QuarantineConfig(), [sink], "renamed", clock)
    again.release("h1", "fixed")
    again.run_actions(clock())
    assert by_host(again, clock())["h1"]["last_action"]["status"] == "done"
    assert [t["key"] for t in api.node["spec"]["taints"]] == ["other"]
    assert api.node["spec"]["unschedulable"] is False


class FlakySlurm(RecordingSink):
    """A per-job sink whose releases fail (retryable) while ``down``."""
    down, per_job = False, True

    def release(self, event):
        self.calls.append(event)
        return ActionResult(False, "slurmctld away") if self.down else ActionResult(True, "ok")


def test_an_old_jobs_release_still_retried_is_not_dropped_for_a_new_jobs_quarantine(tmp_path):
    """h1 quarantined under job alpha; restarted under beta, its release (alpha's drain) is
    retried while slurmctld is away when beta quarantines h1 again. Beta's quarantine holds
    beta's own drain: alpha's release must still reach the sink, else alpha's drain stays."""

    clock = Clock()
    store = Store(str(tmp_path / "m.sqlite"))
    cfg = QuarantineConfig(max_quarantined=4)
    alpha = HostLedger(store, cfg, [FlakySlurm()], "alpha", clock)
    alpha.record([finding("hang", "h1", 1)], clock())
    alpha.decide(clock(), None, 40)
    alpha.run_actions(clock())
    sink = FlakySlurm()
    sink.down = True
    beta = HostLedger(store, cfg, [sink], "beta", clock)
    beta.release("h1", "fixed")
    beta.run_actions(clock())
    clock.t += 10_000  # past the released window
    beta.decide(clock(), None, 40)
    beta.record([finding("hang", "h1", 2)], clock())
    assert [d["decision"] for d in beta.decide(clock(), None, 40)] == ["quarantine"]
    sink.down = False
    clock.t += 1000
    beta.run_actions(clock())
    beta.release("h1", "fixed again")
    beta.run_actions(clock())
    assert sorted((e["event"], e["job"]) for e in sink.calls) == [
        ("quarantine", "beta"), ("release", "alpha"), ("release", "alpha"), ("release", "beta")]
    assert sorted((a["op"], a["event"]["job"], a["status"]) for a in store.host_actions()) == [
        ("quarantine", "alpha", "done"), ("quarantine", "beta", "done"),
        ("release", "alpha", "done"), ("release", "beta", "done")]


def test_an_old_shards_release_still_retried_is_not_dropped_for_a_new_shards_quarantine(
        tmp_path):
    """The same across a --shards change of one job: h1 quarantined by shard 0/2 (entry
    train/shard0), its release retried while slurmctld is away when the unsharded monitor on
    that state quarantines h1 again (entry train): shard 0's release must still reach the sink,
    else train/shard0's drain stays for good."""

    clock = Clock()
    store = Store(str(tmp_path / "m.sqlite"))
    cfg = QuarantineConfig(max_quarantined=4)
    sharded = HostLedger(store, cfg, [FlakySlurm()], "train", clock)
    sharded.sender = monitor_identity("m", "0/2")
    sharded.record([finding("hang", "h1", 1)], clock())
    sharded.decide(clock(), None, 40)
    sharded.run_actions(clock())
    sink = FlakySlurm()
    sink.down = True
    whole = HostLedger(store, cfg, [sink], "train", clock)
    whole.sender = monitor_identity("m", None)
    whole.release("h1", "fixed")
    whole.run_actions(clock())
    clock.t += 10_000  # past the released window
    whole.decide(clock(), None, 40)
    whole.record([finding("hang", "h1", 2)], clock())
    assert [d["decision"] for d in whole.decide(clock(), None, 40)] == ["quarantine"]
    sink.down = False
    clock.t += 1000
    whole.run_actions(clock())
    assert sorted((e["event"], e["shard"]) for e in sink.calls) == [
        ("quarantine", None), ("release", "0/2"), ("release", "0/2")]
    assert sorted((a["op"], a["status"]) for a in store.host_actions()) == [
        ("quarantine", "done"), ("quarantine", "done"), ("release", "done")]


def test_a_hooks_old_release_is_overtaken_by_another_jobs_quarantine(tmp_path):
    """The same with an exec hook, which holds no per-job state (its cordon is the host's):
    alpha's release, retried when beta quarantines h1 again, is overtaken by beta's quarantine,
    never carried out after it (h1 would be uncordoned while quarantined)."""
    log, cordon, down = (tmp_path / n for n in ("log", "cordoned", "down"))
    hook = tmp_path / "cordon.sh"
    hook.write_text(f'#!/bin/sh\n[ -e {down} ] && exit 1\necho "$LIGHTKEEPER_EVENT" >> {log}\n'
                    f'if [ "$LIGHTKEEPER_EVENT" = quarantine ]; then touch {cordon}; '
                    f'else rm -f {cordon}; fi\n')
    hook.chmod(0o755)
    clock = Clock()
    store = Store(str(tmp_path / "m.sqlite"))
    cfg = QuarantineConfig(max_quarantined=4)
    alpha = HostLedger(store, cfg, [ExecSink(str(hook))], "alpha", clock)
    alpha.record([finding("hang", "h1", 1)], clock())
    alpha.decide(clock(), None, 40)
    alpha.run_actions(clock())
    down.touch()  # the hook's API server away: alpha's release is retried
    beta = HostLedger(store, cfg, [ExecSink(str(hook))], "beta", clock)
    beta.release("h1", "fixed")
    beta.run_actions(clock())
    clock.t += 10_000  # past the released window
    beta.decide(clock(), None, 40)
    beta.record([finding("hang", "h1", 2)], clock())
    assert [d["decision"] for d in beta.decide(clock(), None, 40)] == ["quarantine"]
    down.unlink()
    clock.t += 1000
    beta.run_actions(clock())
    assert beta.quarantined() == ["h1"] and cordon.exists()
    assert log.read_text().split() == ["quarantine", "quarantine"]
    assert sorted((a["op"], a["event"]["job"], a["status"]) for a in store.host_actions()) == [
        ("quarantine", "alpha", "done"), ("quarantine", "beta", "done"),
        ("release", "alpha", "superseded")]
