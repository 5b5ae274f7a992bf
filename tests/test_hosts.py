"""The host ledger and quarantine policy (monitor/act/hosts.py) on plain inputs: a real SQLite store
in tmp_path, a fake clock, findings as the detectors emit them, and a recording sink (a fake:
the real sinks are tested in test_hosts_sinks.py). Plus the routes through Flask's test client
on a Monitor that polls nothing."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import types
from types import SimpleNamespace as NS

import pytest

from monitor.act.hosts import HostLedger, culprit_hosts
from monitor.act.sinks import ActionResult
from monitor.config import ConfigError, MonitorConfig, QuarantineConfig, RailsConfig
from monitor.service import check_config
from monitor.store import Store
from worker_server.state import RankIdentity, RankState, library_versions, rank_device


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class RecordingSink:
    """A fake sink: records each call, fails the first ``fail`` attempts."""

    def __init__(self, name: str = "rec", fail: int = 0, retry: bool = True) -> None:
        self.name, self.fail, self.retry, self.calls = name, fail, retry, []

    def _do(self, event):
        self.calls.append(event)
        if len(self.calls) <= self.fail:
            return ActionResult(False, "boom", retry=self.retry)
        return ActionResult(True, "ok")

    def quarantine(self, event):
        return self._do(event)

    def release(self, event):
        return self._do(event)


def finding(kind: str, host: str, fid: int, group: int = 1, rid: str = "g1:a") -> dict:
    return {"id": fid, "kind": kind, "replica_group": group, "replica_id": rid, "ranks": [2],
            "evidence": {"culprits": [{"rank": 2, "host": host, "node": f"node-{host}",
                                       "device": {"type": "cuda", "index": 1, "uuid": "GPU-x"}}]}}


def ledger(tmp_path, clock, sinks=(), **kw) -> HostLedger:
    return HostLedger(Store(str(tmp_path / "m.sqlite")), QuarantineConfig(**kw), list(sinks),
                      "job", clock)


def test_culprit_hosts_groups_ranks_and_devices():
    f = finding("hang", "h1", 1)
    f["evidence"]["culprits"].append({"rank": 3, "host": "h1", "device": {"type": "cpu"}})
    got = culprit_hosts(f)
    assert list(got) == ["h1"] and got["h1"]["ranks"] == [2, 3]
    assert got["h1"]["node"] == "node-h1" and len(got["h1"]["devices"]) == 2
    assert culprit_hosts({"ranks": [4], "evidence": {"culprits": [{"rank": 4}]}}) == {}


def test_one_hang_quarantines_two_stragglers_needed_and_actions_run(tmp_path):
    clock = Clock()
    sink = RecordingSink()
    led = ledger(tmp_path, clock, [sink])
    led.record([finding("straggler", "h1", 1)], clock())
    assert led.decide(clock(), None, 10) == [] and led.hosts["h1"]["state"] == "suspect"
    clock.t += 10
    led.record([finding("straggler", "h1", 2)], clock())
    led.record([finding("hang", "h2", 3)], clock())
    out = {d["host"]: d for d in led.decide(clock(), None, 40)}  # cap: 4 of 40 hosts
    assert out["h1"]["decision"] == out["h2"]["decision"] == "quarantine"
    h = led.hosts["h2"]
    assert h["state"] == "quarantined" and h["node"] == "node-h2"
    assert h["devices"] == ["cuda:1 GPU-x"] and h["expires_at"] == clock() + 86400
    assert led.run_actions(clock()) == 2
    assert {c["host"] for c in sink.calls} == {"h1", "h2"}
    ev = next(c for c in sink.calls if c["host"] == "h2")
    assert ev["event"] == "quarantine" and ev["kind"] == "hang" and ev["node"] == "node-h2"
    assert ev["finding"]["id"] == 3 and ev["attempt"] == 1
    assert led.hosts["h2"]["last_action"]["status"] == "done"
    decisions = led.store.host_decisions()
    assert {d["decision"] for d in decisions} == {"quarantine"}
    assert all(d["evidence"]["offences"] for d in decisions)  # every decision with evidence


def test_window_forgets_old_offences(tmp_path):
    clock = Clock()
    led = ledger(tmp_path, clock, window_s=60)
    led.record([finding("straggler", "h1", 1)], clock())
    clock.t += 61
    led.record([finding("straggler", "h1", 2)], clock())
    assert led.decide(clock(), None, 10) == []
    assert led.hosts["h1"]["state"] == "suspect"
    clock.t += 61
    led.decide(clock(), None, 10)
    assert led.hosts["h1"]["state"] == "ok"


def test_blind_monitor_quarantines_nothing_and_logs_once(tmp_path):
    clock = Clock()
    led = ledger(tmp_path, clock)
    led.record([finding("hang", "h1", 1)], clock())
    first = led.decide(clock(), "ranks cannot be verified: Lighthouse down", 10)
    assert [(d["decision"], d["reason"]) for d in first] == [("hold", "monitor_blind")]
    assert led.decide(clock() + 1, "ranks cannot be verified: Lighthouse down", 10) == []
    assert led.hosts["h1"]["state"] == "suspect" and led.quarantined() == []
    assert len(led.store.host_decisions()) == 1
    # sight back: quarantined on the same evidence
    assert led.decide(clock() + 2, None, 10)[0]["decision"] == "quarantine"


def test_cap_count_and_fraction(tmp_path):
    assert QuarantineConfig(max_quarantined=0.1).cap(125) == 12
    assert QuarantineConfig(max_quarantined=0.1).cap(4) == 1  # at least one
    assert QuarantineConfig(max_quarantined=3).cap(4) == 3
    clock = Clock()
    led = ledger(tmp_path, clock, max_quarantined=1)
    led.record([finding("hang", "h1", 1), finding("hang", "h2", 2)], clock())
    out = sorted((d["host"], d["decision"], d["reason"]) for d in led.decide(clock(), None, 40))
    assert out == [("h1", "quarantine", "hang"), ("h2", "hold", "cap")]
    assert led.quarantined() == ["h1"]


def test_dry_run_decides_logs_and_acts_on_nothing(tmp_path):
    clock = Clock()
    sink = RecordingSink()
    led = ledger(tmp_path, clock, [sink], dry_run=True)
    led.record([finding("mismatch", "h1", 1)], clock())
    out = led.decide(clock(), None, 10)
    assert [(d["decision"], d["reason"]) for d in out] == [("quarantine", "dry_run")]
    assert led.hosts["h1"]["state"] == "suspect" and led.hosts["h1"]["would_quarantine"]
    assert led.run_actions(clock()) == 0 and sink.calls == []
    assert led.store.host_decisions()[0]["reason"] == "dry_run"


def test_a_dry_run_holds_what_a_real_run_would(tmp_path):
    """With no host ever quarantined in a dry run, its cap and no_other_host rails held
    nothing: a trial showed every due host as a would-be drain, the last one too."""
    decided = {}
    for dry in (False, True):
        clock = Clock()
        led = ledger(tmp_path / str(dry), clock, max_quarantined=1, dry_run=dry)
        led.record([finding("hang", h, i) for i, h in enumerate(("h1", "h2", "h3"))], clock())
        decided[dry] = sorted((d["host"], d["reason"]) for d in led.decide(clock(), None, 3))
    assert decided[False] == [("h1", "hang"), ("h2", "cap"), ("h3", "cap")]
    assert decided[True] == [("h1", "dry_run"), ("h2", "cap"), ("h3", "cap")]
    # past --quarantine-window a would-be quarantine still counts, as a real one lasts its TTL
    for dry in (False, True):
        clock = Clock()
        led = ledger(tmp_path / f"later{dry}", clock, max_quarantined=1, dry_run=dry)
        led.record([finding("hang", "h1", 1)], clock())
        led.decide(clock(), None, 3)
        clock.t += 3601
        led.decide(clock(), None, 3)
        led.record([finding("hang", "h2", 2)], clock())
        decided[dry] = [(d["host"], d["reason"]) for d in led.decide(clock(), None, 3)]
    assert decided[False] == decided[True] == [("h2", "cap")]


def test_a_failing_action_is_retried_until_it_is_done(tmp_path):
    """An outage longer than the first backoffs (the API server, slurmctld, the receiver)
    must not lose the cordon or drain for good: retried every 5 min at most, until done."""
    clock = Clock()
    sink = RecordingSink(fail=20)
    led = ledger(tmp_path, clock, [sink])
    led.record([finding("hang", "h1", 1)], clock())
    led.decide(clock(), None, 10)
    for _ in range(3600):  # an hour of a sink that fails
        led.run_actions(clock())
        clock.t += 1
    last = led.hosts["h1"]["last_action"]
    assert last["status"] == "retrying" and last["attempts"] > 6, last
    assert last["next_at"] - last["at"] <= 300
    for _ in range(20 * 300):
        led.run_actions(clock())
        clock.t += 1
    assert led.hosts["h1"]["last_action"]["status"] == "done"


def test_a_failed_release_stays_exported_once_its_host_is_ok(tmp_path):
    """A released host turns ok after --quarantine-window; its failed release (the node still
    cordoned) kept the host in the ledger but dropped its series, and the alert resolved."""
    from prometheus_client import generate_latest

    from monitor.api.metrics import MonitorMetrics

    clock = Clock()
    sink = RecordingSink(fail=0)
    led = ledger(tmp_path, clock, [sink], window_s=100)
    led.record([finding("hang", "h1", 1)], clock())
    led.decide(clock(), None, 10)
    led.run_actions(clock())
    sink.fail, sink.retry = len(sink.calls) + 1, False  # the release refused: not retried
    led.release("h1", "fixed")
    led.run_actions(clock())
    clock.t += 101
    led.decide(clock(), None, 10)
    assert led.hosts["h1"]["state"] == "ok"
    assert led.hosts["h1"]["last_action"]["status"] == "failed"
    metrics = MonitorMetrics("job")
    metrics.set_hosts(led.counts(), led.to_json(clock()))
    text = generate_latest(metrics.registry).decode()
    assert 'lightkeeper_monitor_host_action_failed{host="h1",job="job",sink="rec"} 1.0' in text
    assert 'host_quarantine_state{' not in text  # an ok host has no state series
    # the way out once the sink is fixed: released again by hand
    sink.fail = 0
    assert led.release("h1", "sink fixed")["decision"] == "release"
    led.run_actions(clock())
    assert led.hosts["h1"]["last_action"]["status"] == "done"
    with pytest.raises(ValueError, match="not quarantined"):  # and only then
        led.release("h1", "again")


def test_a_retry_years_on_still_has_a_next_time(tmp_path):
    """2.0 * 2**1024 overflows: after ~3.5 days of retries the action thread raised before
    saving the attempt, called the sink every sweep and never ran the actions behind it."""
    clock = Clock()
    sink = RecordingSink(fail=10**9)
    led = ledger(tmp_path, clock, [sink])
    led.record([finding("hang", "h1", 1), finding("hang", "h2", 2)], clock())
    led.decide(clock(), None, 40)
    first = min(led.store.host_actions(), key=lambda a: a["id"])  # run first of the two
    led.store.update_host_action(first["id"], status="retrying", attempts=2000,
                                 next_at=clock(), detail="boom", at=clock())
    led.run_actions(clock())
    acts = {a["host"]: a for a in led.store.host_actions()}
    assert acts[first["host"]]["attempts"] == 2001
    assert acts[first["host"]]["next_at"] == pytest.approx(clock() + 300, abs=1)
    assert {a["attempts"] for a in acts.values()} == {1, 2001}  # the one behind it ran too


def test_ttl_expiry_and_manual_release_queue_releases(tmp_path):
    clock = Clock()
    sink = RecordingSink()
    led = ledger(tmp_path, clock, [sink], ttl_s=100)
    led.record([finding("hang", "h1", 1), finding("hang", "h2", 2)], clock())
    led.decide(clock(), None, 40)
    led.run_actions(clock())  # carried out: a quarantine never attempted has nothing to undo
    assert led.release("h1", "DIMM replaced")["decision"] == "release"
    with pytest.raises(ValueError):
        led.release("h1", "again")
    assert led.hosts["h1"]["state"] == "released"
    with pytest.raises(KeyError):
        led.release("h3", "x")
    clock.t += 101
    out = led.decide(clock(), None, 10)
    assert [(d["host"], d["decision"], d["reason"]) for d in out] == [("h2", "release", "ttl")]
    led.run_actions(clock())
    assert sorted((c["host"], c["event"]) for c in sink.calls) == [
        ("h1", "quarantine"), ("h1", "release"), ("h2", "quarantine"), ("h2", "release")]
    # offences before the release no longer count: not quarantined again on old evidence
    assert led.decide(clock() + 1, None, 10) == [] and led.quarantined() == []
    led.record([finding("hang", "h1", 9)], clock())
    assert led.decide(clock() + 2, None, 10)[0]["host"] == "h1"


def test_failing_action_retried_with_backoff_until_done_never_raises(tmp_path):
    """Retried until done, however long (an outage must not lose a cordon); a refusal (not
    retryable) fails at once."""
    clock = Clock()

    class Raising(RecordingSink):
        def quarantine(self, event):
            raise RuntimeError("sink bug")

    flaky, broken = RecordingSink("flaky", fail=2), Raising("broken")
    led = ledger(tmp_path, clock, [flaky, broken])
    led.record([finding("hang", "h1", 1)], clock())
    led.decide(clock(), None, 10)
    assert led.run_actions(clock()) == 2
    acts = {a["sink"]: a for a in led.store.host_actions()}
    assert acts["flaky"]["status"] == acts["broken"]["status"] == "retrying"
    assert acts["flaky"]["next_at"] == pytest.approx(clock() + 2, abs=1e-6)
    assert led.run_actions(clock() + 1) == 0  # not due yet
    clock.t += 2
    led.run_actions(clock())
    clock.t += 4
    led.run_actions(clock())
    acts = {a["sink"]: a for a in led.store.host_actions()}
    assert (acts["flaky"]["status"], acts["flaky"]["attempts"]) == ("done", 3)
    assert (acts["broken"]["status"], acts["broken"]["attempts"]) == ("retrying", 3)
    assert acts["broken"]["next_at"] == pytest.approx(clock() + 8, abs=1e-6)
    assert "RuntimeError: sink bug" in acts["broken"]["detail"]
    # not retryable: given up at once
    led2 = ledger(tmp_path / "b", clock, [RecordingSink("no", fail=9, retry=False)])
    led2.record([finding("hang", "h1", 1)], clock())
    led2.decide(clock(), None, 10)
    led2.run_actions(clock())
    assert led2.hosts["h1"]["last_action"]["status"] == "failed"


def test_restart_keeps_the_ledger(tmp_path):
    clock = Clock()
    led = ledger(tmp_path, clock)
    led.record([finding("hang", "h1", 1), finding("straggler", "h2", 2)], clock())
    led.decide(clock(), None, 10)
    led.store.close()
    again = ledger(tmp_path, clock)
    assert again.quarantined() == ["h1"] and again.hosts["h2"]["state"] == "suspect"
    assert [o["kind"] for o in again.store.host_offences("h2")] == ["straggler"]
    again.record([finding("straggler", "h2", 3)], clock())  # the old offence still counts
    assert again.decide(clock(), None, 10)[0]["host"] == "h2"


def test_a_monitor_killed_while_quarantining_leaves_no_quarantine_without_its_actions(
        tmp_path, monkeypatch):
    """The monitor dies (SIGKILL cannot be aimed between two writes: an exception escaping
    stands in) after the first sink's action was queued, before the second's. Before, the
    host was saved quarantined with one action and never drained by the other sink; now the
    restarted monitor finds no quarantine, quarantines again on the same offence and queues
    both."""
    class Killed(BaseException):
        pass

    clock = Clock()
    sinks = [RecordingSink("a"), RecordingSink("b")]
    led = ledger(tmp_path, clock, sinks)
    led.record([finding("hang", "h1", 1)], clock())
    add = led.store.add_host_action
    calls = []

    def dies_on_the_second(**kw):
        calls.append(kw)
        if len(calls) == 2:
            raise Killed
        return add(**kw)
    monkeypatch.setattr(led.store, "add_host_action", dies_on_the_second)
    with pytest.raises(Killed):
        led.decide(clock(), None, 10)
    again = ledger(tmp_path, clock, sinks)
    assert again.store.host_actions() == [] and again.store.host_decisions() == []
    assert again.hosts["h1"]["state"] == "suspect" and again.quarantined() == []
    assert again.decide(clock(), None, 10)[0]["decision"] == "quarantine"
    assert sorted(a["sink"] for a in again.store.host_actions()) == ["a", "b"]


def test_a_monitor_killed_between_an_offence_and_its_host_row_still_quarantines(tmp_path):
    """A real SIGKILL in a forked monitor as it writes the host's row after the hang's offence.
    Before, the offence alone was kept: the restarted monitor took the same hang, confirmed
    again, as seen before the restart (not counted), and never judged the rowless host; now
    neither is kept and the hang quarantines the host as it does without the kill."""
    clock, path = Clock(), str(tmp_path / "m.sqlite")
    pid = os.fork()
    if pid == 0:  # the monitor that dies: the finding written (as Enforcer.record does), then
        try:      # its offence
            store = Store(path)
            f = finding("hang", "h1", None)
            f["id"] = store.add_finding({**f, "first_seen": clock()})
            store.save_host = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
            HostLedger(store, QuarantineConfig(), [], "job", clock).record([f], clock())
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    store = Store(path)
    marks = store.restart_marks(clock())  # what the restarted monitor does
    clock.t += 10
    led = HostLedger(store, QuarantineConfig(), [], "job", clock)
    f = finding("hang", "h1", None)
    f["reconfirms"] = marks[("hang", 1, "g1:a")][0]  # the episode the restart closed
    f["id"] = store.add_finding({**f, "first_seen": clock()})
    led.record([f], clock())
    assert [d["decision"] for d in led.decide(clock(), None, 10)] == ["quarantine"]
    assert led.quarantined() == ["h1"]


def _view(groups: dict[int, tuple[str, list[str]]]):
    gs, ranks = {}, {}
    for g, (rid, hosts) in groups.items():
        rs = []
        for i, h in enumerate(hosts):
            r = NS(url=f"http://{h}:{9500 + i}/{g}", rank=g * 10 + i, reachable=True,
                   superseded=False, state={"host": h, "node": h, "replica_id": rid,
                                            "group_rank": i, "pid": 1})
            rs.append(r)
            ranks[r.url] = r
        gs[g] = NS(replica_id=rid, ranks=rs)
    return NS(groups=gs, ranks=ranks)


def test_quarantined_host_on_a_new_incarnation_only(tmp_path):
    clock = Clock()
    led = ledger(tmp_path, clock)
    before = _view({1: ("g1:a", ["h1"]), 2: ("g2:a", ["h2"])})
    led.observe(before, clock())
    led.record([finding("hang", "h1", 1, group=1, rid="g1:a")], clock())
    led.decide(clock(), None, 10)
    assert led.group_findings(before, clock()) == []  # the offender itself: evicted as before
    after = _view({1: ("g1:b", ["h1"]), 2: ("g2:a", ["h2"])})
    (f,) = led.group_findings(after, clock())
    assert (f.kind, f.replica_group, f.replica_id, f.ranks) == ("quarantined_host", 1, "g1:b",
                                                                [10])
    assert f.evidence["culprit_hosts"] == ["h1"] and "h1" in f.evidence["hosts"]


def test_a_gpu_hosts_devices_never_keep_the_cpu_its_rank_reports_before_cuda(tmp_path):
    """A rank reports {"type": "cpu"} until its process initializes CUDA: an offence or a poll
    during start-up left "cpu" in a GPU host's devices for good, the host blamed on a CPU."""
    clock = Clock()
    led = ledger(tmp_path, clock)
    f = finding("hang", "h1", 1)
    f["evidence"]["culprits"][0]["device"] = {"type": "cpu"}  # confirmed before CUDA init
    led.record([f], clock())

    def rank(device):
        state = {"host": "h1", "node": "h1", "replica_id": "g1:a", "device": device}
        return NS(ranks={"http://h1:9500": NS(rank=0, superseded=False, state=state)})

    led.observe(rank({"type": "cpu"}), clock())
    led.observe(rank({"type": "cuda", "index": 0, "uuid": "GPU-x"}), clock())
    (h,) = led.to_json(clock())
    assert h["devices"] == ["cuda:0 GPU-x"]


def test_config_validation():
    with pytest.raises(ConfigError, match="unknown kind"):
        QuarantineConfig(after={"bogus": 1}).validate()
    with pytest.raises(ConfigError, match="max-quarantined"):
        QuarantineConfig(max_quarantined=2.5).validate()
    with pytest.raises(ConfigError, match="expected k8s"):
        check_config(MonitorConfig(quarantine=QuarantineConfig(actions=("ftp:x",))))
    with pytest.raises(ConfigError, match="secret"):
        QuarantineConfig(actions=("webhook:http://127.0.0.1:1/",)).validate()
    QuarantineConfig(actions=("slurm", "exec:/bin/true --x", "webhook:https://x/"),
                     webhook_secret="s").validate()


def test_cli_flags():
    import argparse

    from monitor.cli import add_arguments, config_from_args
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args([
        "--quarantine-after", "straggler=3,dead_rank=0", "--quarantine-window", "600",
        "--quarantine-ttl", "7200", "--max-quarantined", "2", "--quarantine-dry-run",
        "--action", "slurm", "--action", "exec:/usr/local/bin/hook --x"]))
    q = cfg.quarantine
    assert q.after == {"hang": 1, "mismatch": 1, "dead_rank": 0, "straggler": 3, "network": 1,
                       "dead": 1}
    assert (q.window_s, q.ttl_s, q.max_quarantined, q.dry_run) == (600, 7200, 2, True)
    assert q.actions == ("slurm", "exec:/usr/local/bin/hook --x")
    with pytest.raises(SystemExit):
        p.parse_args(["--quarantine-after", "hang"])


def test_rank_device_cpu_and_cuda_from_a_stand_in_module(monkeypatch):
    """rank_device never imports torch; a stand-in torch module (a fake: no GPU here) checks
    the CUDA branch; the real one is this process's torch when imported."""
    assert rank_device(0)["type"] in ("cpu", "cuda")
    # the versions are read once per process: read them before the stand-in (else this
    # worker's later ranks would serve torch_version "unknown")
    library_versions()
    props = NS(uuid="GPU-1234")
    cuda = NS(is_available=lambda: True, device_count=lambda: 2, is_initialized=lambda: True,
              get_device_properties=lambda i: props)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert rank_device(3) == {"type": "cuda", "index": 1, "uuid": "GPU-1234"}
    s = RankState(RankIdentity(host="node-a")).snapshot()
    assert (s["host"], s["node"], s["device"]["index"]) == ("node-a", "node-a", 0)
    assert s["hostname"]


def test_routes_hosts_and_release(tmp_path):
    from monitor.api.app import create_app
    from monitor.service import Monitor
    clock = Clock()
    cfg = MonitorConfig(state_path=str(tmp_path / "m.sqlite"), token="tok", port=0,
                        rails=RailsConfig(min_replicas=1))
    m = Monitor(cfg, clock=clock)
    try:
        m.hosts.record([finding("hang", "h1", 1)], clock())
        m.hosts.decide(clock(), None, 10)
        c = create_app(m).test_client()
        body = c.get("/v1/hosts").get_json()
        assert body["quarantined"] == ["h1"] and body["hosts"][0]["offences"][0]["kind"] == "hang"
        assert c.post("/v1/hosts/h1/release").status_code == 401
        assert c.post("/v1/hosts/zz/release", headers={"Authorization": "Bearer tok"}
                      ).status_code == 404
        # curl -d without -H: the reason was dropped unsaid; now refused, saying why
        r = c.post("/v1/hosts/h1/release", headers={"Authorization": "Bearer tok"},
                   data='{"reason": "DIMM replaced"}')
        assert r.status_code == 400 and "Content-Type: application/json" in r.get_json()["error"]
        assert m.hosts.hosts["h1"]["state"] == "quarantined"
        # a broken JSON body (a missing brace) was read as none: released, its reason lost
        r = c.post("/v1/hosts/h1/release", headers={"Authorization": "Bearer tok"},
                   data='{"reason": "DIMM replaced"', content_type="application/json")
        assert r.status_code == 400 and "not valid JSON" in r.get_json()["error"]
        assert m.hosts.hosts["h1"]["state"] == "quarantined"
        r = c.post("/v1/hosts/h1/release", headers={"Authorization": "Bearer tok"},
                   json={"reason": "DIMM replaced"})
        assert r.status_code == 200 and r.get_json()["decision"] == "release"
        assert c.post("/v1/hosts/h1/release", headers={"Authorization": "Bearer tok"}
                      ).status_code == 409
        assert c.get("/").status_code == 200
        m.metrics.set_hosts(m.hosts.counts(), m.hosts.to_json(clock()))
        text = c.get("/metrics").get_data(as_text=True)
        assert 'lightkeeper_monitor_hosts{job="lightkeeper",state="released"} 1.0' in text
        assert 'host_quarantine_state{host="h1"' in text
        assert json.loads(json.dumps(body))  # serializable
    finally:
        m.stop()


def test_a_release_with_a_null_body_or_a_long_reason(tmp_path):
    """``null`` is JSON (no reason: the default one); a reason is kept as one printable line of
    at most 500 characters (it goes into the log and the audit row)."""
    from monitor.api.app import create_app
    from monitor.service import Monitor
    clock = Clock()
    cfg = MonitorConfig(state_path=str(tmp_path / "m.sqlite"), token="tok", port=0,
                        rails=RailsConfig(min_replicas=1))
    m = Monitor(cfg, clock=clock)
    try:
        for h in ("h1", "h2"):
            m.hosts.record([finding("hang", h, 1)], clock())
        m.hosts.decide(clock(), None, 100)  # of 100 hosts: both within the quarantine cap
        c = create_app(m).test_client()
        auth = {"Authorization": "Bearer tok"}
        r = c.post("/v1/hosts/h1/release", headers=auth, data="null",
                   content_type="application/json")
        assert r.status_code == 200 and r.get_json()["decision"] == "release", r.get_json()
        r = c.post("/v1/hosts/h2/release", headers=auth, json={"reason": "a\nb" * 1000})
        assert r.status_code == 200
        (h2,) = [h for h in c.get("/v1/hosts").get_json()["hosts"] if h["host"] == "h2"]
        why = h2["release_reason"]
        assert "\n" not in why and "a\\nb" in why and len(why) <= 600, why
    finally:
        m.stop()


def test_an_episode_confirmed_again_after_a_monitor_restart_is_not_a_second_offence(tmp_path):
    clock = Clock()
    led = ledger(tmp_path, clock)
    f = finding("straggler", "h1", None)
    f["id"] = led.store.add_finding({**f, "first_seen": clock()})
    led.record([f], clock())
    led.store.restart_marks(clock())  # what a restart does
    again = finding("straggler", "h1", None)
    again["reconfirms"] = f["id"]  # the episode the restart closed
    again["id"] = led.store.add_finding({**again, "first_seen": clock()})
    led.record([again], clock())
    assert [(o["counts"], o["note"]) for o in led.to_json(clock())[0]["offences"]] == [
        (False, "re-confirmed after a monitor restart"), (True, None)]
    assert led.decide(clock(), None, 40) == []
    other = finding("straggler", "h1", None, rid="g1:b")  # a new incarnation straggles too
    other["id"] = led.store.add_finding({**other, "first_seen": clock()})
    led.record([other], clock())
    assert led.decide(clock(), None, 40)[0]["decision"] == "quarantine"


def test_after_a_restart_only_the_reconfirmed_episode_of_an_incarnation_is_skipped(tmp_path):
    """The episode a restart closed, confirmed again, is not counted twice, but the same
    incarnation's later episodes are offences again."""
    clock = Clock()
    led = ledger(tmp_path, clock, after={"straggler": 2})

    def episode(reconfirms: int | None = None) -> int:
        f = finding("straggler", "h1", None)
        f["reconfirms"] = reconfirms
        f["id"] = led.store.add_finding({**f, "first_seen": clock()})
        led.record([f], clock())
        clock.t += 10
        return f["id"]

    first = episode()
    for _ in range(2):  # restarted twice, the episode confirmed again each time: not counted
        marks = led.store.restart_marks(clock())
        assert marks == {("straggler", 1, "g1:a"): (first, None)}  # the episode's first
        led = HostLedger(led.store, led.cfg, [], "job", clock)  # the restarted monitor's
        episode(reconfirms=first)
        assert led.decide(clock(), None, 40) == []
    episode()  # a new episode of the same incarnation: the second offence
    assert [d["decision"] for d in led.decide(clock(), None, 40)] == ["quarantine"]
    assert led.quarantined() == ["h1"]


def test_a_finding_naming_every_host_of_a_multi_host_group_singles_out_none(tmp_path):
    clock = Clock()
    led = ledger(tmp_path, clock)
    f = finding("hang", "h1", 1)
    f["evidence"]["culprits"].append({"rank": 3, "host": "h2"})
    led.record([f], clock(), group_hosts={1: {"h1", "h2"}})
    assert led.decide(clock(), None, 40) == [] and led.quarantined() == []
    assert [o["counts"] for o in led.to_json(clock())[0]["offences"]] == [False]
    # one host of the two named: that one is singled out
    led.record([finding("hang", "h1", 2)], clock(), group_hosts={1: {"h1", "h2"}})
    assert [d["host"] for d in led.decide(clock(), None, 40)] == ["h1"]
    # a group on one host: naming all its ranks names that host
    led.record([finding("hang", "h3", 3, group=3)], clock(), group_hosts={3: {"h3"}})
    assert [d["host"] for d in led.decide(clock(), None, 40)] == ["h3"]


def test_a_network_finding_counts_against_every_host_it_names(tmp_path):
    """The probe mesh measured each named host's links: a network finding naming both hosts of
    a two-host group singles out each of them (a hang naming both singles out neither)."""
    clock = Clock()
    led = ledger(tmp_path, clock, max_quarantined=5)
    f = finding("network", "h1", 1)
    f["evidence"]["culprits"].append({"rank": 3, "host": "h2"})
    led.record([f], clock(), group_hosts={1: {"h1", "h2"}})
    assert {h["host"]: [o["counts"] for o in h["offences"]] for h in led.to_json(clock())} \
        == {"h1": [True], "h2": [True]}


def test_never_the_last_host_a_one_host_job_quarantines_nothing(tmp_path):
    """On a one-host job (the demo without NODE_NAMEs, a laptop) quarantining the host would
    only evict every restarted group again: held as no_other_host."""
    clock = Clock()
    led = ledger(tmp_path, clock, max_quarantined=5)
    led.record([finding("hang", "vm", 1)], clock())
    out = led.decide(clock(), None, 1)
    assert [(d["decision"], d["reason"]) for d in out] == [("hold", "no_other_host")]
    assert led.quarantined() == []
    # two hosts: one may go; the second then is the last one
    led.record([finding("hang", "h2", 2)], clock())
    out = {d["host"]: d["reason"] for d in led.decide(clock(), None, 2)}
    assert out == {"vm": "hang", "h2": "no_other_host"}  # hosts judged in the ledger's order
    assert led.quarantined() == ["vm"]


def test_a_group_back_on_a_host_held_as_the_last_one_is_held_for_host_faults_only(tmp_path):
    """One host (no_other_host): a group evicted off it for a network fault and back there is
    held (a restart there cannot help); a hang, which a restart may cure, never is, nor is the
    group's first incarnation, nor one that runs elsewhere."""
    clock = Clock()
    led = ledger(tmp_path, clock, max_quarantined=5)
    led.record([finding("network", "vm", 1, rid="g1:a")], clock())
    assert [d["reason"] for d in led.decide(clock(), None, 1)] == ["no_other_host"]
    back = finding("network", "vm", 2, rid="g1:b")
    assert led.held_back_on(back, set(), clock()) is None  # g1:a was never evicted
    led.record([back], clock())
    why = led.held_back_on(back, {"g1:a"}, clock())
    assert why.startswith("replica group 1 was evicted off vm already (g1:a)"), why
    assert "(no_other_host: quarantining vm would leave none" in why, why
    assert led.held_back_on(finding("network", "vm", 3, rid="g1:a"), {"g1:a"}, clock()) is None
    assert led.held_back_on(finding("hang", "vm", 4, rid="g1:b"), {"g1:a"}, clock()) is None
    assert led.held_back_on(finding("network", "h2", 5, rid="g1:b"), {"g1:a"}, clock()) is None


def test_a_group_back_on_a_host_min_replicas_holds_is_held_too(tmp_path):
    """A host running several groups, its quarantine held by min_replicas (draining it would
    take them all down) while evicting one of them goes ahead: that group, back on the host
    for a network fault, is held as under the cap, not evicted onto it again and again."""
    clock = Clock()
    led = ledger(tmp_path, clock)
    led.record([finding("network", "h1", 1, rid="g1:a")], clock())
    why = {"h1": "quarantining h1 would take down group(s) [1, 2] of the quorum, leaving 1"}
    assert [d["reason"] for d in led.decide(clock(), None, 10, lambda: why)] == ["min_replicas"]
    back = finding("network", "h1", 2, rid="g1:b")
    led.record([back], clock())
    held = led.held_back_on(back, {"g1:a"}, clock())
    assert held is not None and "(min_replicas: quarantining h1 would take down" in held, held
    assert led.decide(clock() + 1, None, 10, dict)[0]["decision"] == "quarantine"
    assert led.held_back_on(back, {"g1:a"}, clock()) is None  # quarantined: evicted off it


def test_a_host_whose_groups_the_rails_protect_is_held_then_quarantined(tmp_path):
    """Quarantining drains the host's groups, so min_replicas holds it as it holds an eviction
    (said once), until the quorum can spare them."""
    clock = Clock()
    led = ledger(tmp_path, clock)
    led.record([finding("hang", "h1", 1)], clock())
    why = {"h1": "quarantining h1 would take down group(s) [1] of the quorum, leaving 1"}
    first = led.decide(clock(), None, 10, lambda: why)
    assert [(d["decision"], d["reason"]) for d in first] == [("hold", "min_replicas")]
    assert led.decide(clock() + 1, None, 10, lambda: why) == [] and led.quarantined() == []
    assert led.hosts["h1"]["hold"]["reason"] == "min_replicas"
    assert led.decide(clock() + 2, None, 10, dict)[0]["decision"] == "quarantine"


def test_protected_hosts_are_those_min_replicas_cannot_spare():
    from monitor.act.hosts import protected_hosts
    from tests.test_monitor_detectors import T0, Job

    job = Job(groups=3, ranks=2)  # one host per group, all three in the quorum
    job.steps(2, now=T0)
    view = job.view(T0)
    assert protected_hosts(view, 2) == {}  # one group's host can go: two remain
    held = protected_hosts(view, 3)
    assert sorted(held) == ["host-g0", "host-g1", "host-g2"]
    assert "group(s) [1] of the quorum, leaving 2, fewer than --min-replicas 3" in held["host-g1"]


def test_a_quarantine_still_retried_is_not_carried_out_after_its_release(tmp_path):
    """The drain failed once (retried in 2 s); the host is released before the retry: the
    retry must not drain the released host again, nor a retried release undo a new quarantine."""
    clock = Clock()
    sink = RecordingSink(fail=1)
    led = ledger(tmp_path, clock, [sink])
    led.record([finding("hang", "h1", 1)], clock())
    led.decide(clock(), None, 10)
    led.run_actions(clock())  # the drain fails: retrying
    clock.t += 1
    led.release("h1", "DIMM replaced")
    led.run_actions(clock())
    for _ in range(3):
        clock.t += 300
        led.run_actions(clock())
    assert [c["event"] for c in sink.calls] == ["quarantine", "release"]
    acts = {a["op"]: a for a in led.store.host_actions()}
    assert acts["quarantine"]["status"] == "superseded" and acts["release"]["status"] == "done"
    assert led.to_json(clock())[0]["last_action"]["op"] == "release"


def test_two_hooks_of_one_program_each_run_once(tmp_path):
    """``--action 'exec:hook a' --action 'exec:hook b'``: each hook gets the event once (the
    sinks were told apart by the program alone, so ``a`` ran twice and ``b`` never)."""
    from monitor.act.sinks import build_sink

    out = tmp_path / "ran"
    hook = tmp_path / "hook.sh"
    hook.write_text(f'#!/bin/sh\necho "$1" >> {out}\n')
    hook.chmod(0o755)
    clock = Clock()
    led = ledger(tmp_path, clock, [build_sink(f"exec:{hook} a"), build_sink(f"exec:{hook} b")])
    led.record([finding("hang", "h1", 1)], clock())
    led.decide(clock(), None, 10)
    led.run_actions(clock())
    assert sorted(out.read_text().split()) == ["a", "b"]
    names = {a["sink"] for a in led.store.host_actions()}  # the program, not its arguments
    assert len(names) == 2 and all(n.startswith(f"exec:{hook}...#") for n in names), names
    # an action queued by an older version, which named the sink by the whole command, still
    # finds it after an upgrade (the monitor restarted on that state)
    led.store.add_host_action(host="h1", sink=f"exec:{hook} a", op="quarantine",
                              status="pending", event={"event": "quarantine", "host": "h1"},
                              at=clock(), next_at=clock())
    led = HostLedger(led.store, led.cfg, led.sinks, "job", clock)
    led.run_actions(clock())
    assert sorted(out.read_text().split()) == ["a", "a", "b"]


def test_one_failing_sink_of_two_shows_on_the_host_and_its_metric(tmp_path):
    """``--action k8s --action exec:notify``: the drain fails, the notification succeeds after
    it; /v1/hosts' last_action and lightkeeper_monitor_host_action_failed (the alert
    LightkeeperQuarantineActionFailing) must still say the drain failed."""
    from prometheus_client import generate_latest

    from monitor.api.metrics import MonitorMetrics

    clock = Clock()
    led = ledger(tmp_path, clock, [RecordingSink("k8s", fail=9, retry=False),
                                   RecordingSink("exec:notify")])
    led.record([finding("hang", "h1", 1)], clock())
    led.decide(clock(), None, 10)
    led.run_actions(clock())
    (h,) = led.to_json(clock())
    assert (h["last_action"]["sink"], h["last_action"]["status"]) == ("k8s", "failed")
    metrics = MonitorMetrics("job")
    metrics.set_hosts(led.counts(), led.to_json(clock()))
    text = generate_latest(metrics.registry).decode()
    assert 'host_action_failed{host="h1",job="job",sink="k8s"} 1.0' in text


def test_a_new_quarantine_goes_before_a_round_of_slow_retries(tmp_path):
    """Actions run one at a time: with a receiver timing out (10 s) on three hosts' retries, a
    fourth host's new quarantine waited for the whole round. It now goes next."""
    clock = Clock()
    order = []

    class SlowForSome(RecordingSink):
        def _do(self, event):
            order.append(event["host"])
            if event["host"] == "h4":
                return ActionResult(True, "ok")
            clock.t += 10  # the receiver's timeout
            if order.count("h1") == 2:  # during the first retry, a new fault on h4
                led.record([finding("hang", "h4", 4, group=4, rid="g4:a")], clock())
                led.decide(clock(), None, 10)
            return ActionResult(False, "timed out", retry=True)

    led = ledger(tmp_path, clock, [SlowForSome()], max_quarantined=10)
    led.record([finding("hang", f"h{i}", i, group=i, rid=f"g{i}:a") for i in (1, 2, 3)],
               clock())
    led.decide(clock(), None, 10)
    led.run_actions(clock())
    assert order == ["h1", "h2", "h3"]
    clock.t += 600  # every retry due
    led.run_actions(clock())
    led.run_actions(clock())
    assert order[3:] == ["h1", "h4", "h2", "h3"]
    assert led.hosts["h4"]["last_action"]["status"] == "done"


def test_sink_events_name_the_monitor_by_its_state_files_id_across_hosts(tmp_path, monkeypatch):
    """A monitor restarted on another host (a pod rescheduled: a new host name) with its state
    file numbers actions on from where it was; its events keep the same ``monitor.id``, so a
    receiver deduplicating on (monitor.id, action_id) neither drops nor repeats one. Another
    state file is another monitor."""
    from monitor.config import MonitorConfig
    from monitor.service import Monitor

    ids = []
    for host, state in (("pod-a", "m.sqlite"), ("pod-b", "m.sqlite"), ("pod-a", "n.sqlite")):
        monkeypatch.setattr(socket, "gethostname", lambda host=host: host)
        mon = Monitor(MonitorConfig(port=0, state_path=str(tmp_path / state), targets=[]))
        try:
            sender = mon.hosts.sender
        finally:
            mon.stop()
        assert sender["host"] == host and sender["shard"] is None
        ids.append(sender["id"])
    assert ids[0] == ids[1] != ids[2]
