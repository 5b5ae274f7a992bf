"""A live monitor (real HTTP, real loop) against simulated ranks.

Evictions need ranks the monitor can verify: there the simulated groups join a real torchft
Lighthouse (``SimJob``); kill requests reach a recording front, since a simulated group has no
torchft Manager to exit (see tests/support/monitor_sim.py).
"""

from __future__ import annotations

import pytest
import requests

from lightkeeper.processes import wait_until
from monitor.config import DetectorConfig, MonitorConfig, RailsConfig
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob, SimRanks

TOKEN = "s3cret"


@pytest.fixture
def sim():
    s = SimRanks.start(3)
    yield s
    s.stop()


@pytest.fixture
def job():
    # like torchft: a killed group's process exits (its rank stops answering)
    j = SimJob(3)
    yield j
    j.stop()


def make_monitor(tmp_path, sim, lighthouse=None, **kw):
    rails = kw.pop("rails", RailsConfig(min_replicas=1, cooldown_s=0))
    cfg = MonitorConfig(port=0, interval_s=0.2, state_path=str(tmp_path / "state.sqlite"),
                        targets=[] if kw.get("register") else sim.urls,
                        sd_out=str(tmp_path / "targets.json"), job="sim",
                        lighthouse=lighthouse.url if lighthouse else None, rails=rails,
                        detectors=DetectorConfig(dead_sweeps=2), **{k: v for k, v in kw.items()
                                                                     if k != "register"})
    return Monitor(cfg).start()


def get(mon, path, **kw):
    return requests.get(mon.url + path, timeout=5, **kw)


def test_cluster_metrics_and_file_sd(tmp_path, sim):
    mon = make_monitor(tmp_path, sim)
    try:
        wait_until(lambda: mon.sweeps >= 2, 10, what="two sweeps")
        c = get(mon, "/v1/cluster").json()
        assert [g["replica_group"] for g in c["groups"]] == [0, 1, 2]
        assert all(g["status"] == "up" and g["step"] == 100 for g in c["groups"])
        text = get(mon, "/metrics").text
        for name in ("lightkeeper_monitor_sweep_duration_seconds_bucket",
                     "lightkeeper_monitor_sweeps_total", 'lightkeeper_monitor_ranks_up{job="sim"} 3.0',
                     "lightkeeper_monitor_ranks_known", "lightkeeper_monitor_ranks_unreachable",
                     "lightkeeper_monitor_poll_errors_total", "lightkeeper_monitor_open_findings",
                     "lightkeeper_monitor_replica_group_step", "lightkeeper_monitor_quorum_id",
                     "lightkeeper_monitor_replica_group_in_quorum",
                     'lightkeeper_monitor_dry_run{job="sim"} 0.0'):
            assert name in text, name
        import json
        sd = json.loads((tmp_path / "targets.json").read_text())
        assert sorted(t for g in sd for t in g["targets"]) == sorted(
            u.split("//")[1] for u in sim.urls)
        assert get(mon, "/v1/findings").json() == []
        for bad in ("x", "1_0", "+5"):
            assert get(mon, f"/v1/findings?limit={bad}").status_code == 400, bad
        r = requests.post(mon.url + "/v1/findings", timeout=5)  # read-only: a JSON 405 that says what is allowed
        assert r.status_code == 405 and "GET" in r.headers["Allow"] and r.json()["status"] == 405
        # no rank answers: the quorum's series go, rather than show the last quorum for ever
        for rank in sim.ranks:
            rank.set_mode("garbage")
        wait_until(lambda: "lightkeeper_monitor_quorum_id{" not in get(mon, "/metrics").text, 10,
                   what="the quorum id's series gone")
        assert "lightkeeper_monitor_quorum_participants{" not in get(mon, "/metrics").text
    finally:
        mon.stop()


def test_bad_rank_does_not_stop_the_monitor(tmp_path, sim):
    mon = make_monitor(tmp_path, sim)
    try:
        wait_until(lambda: mon.sweeps >= 1, 10, what="a sweep")
        sim.ranks[0].set_mode("garbage")
        sim.ranks[1].set_mode("slow", delay=10)
        n = mon.sweeps
        wait_until(lambda: mon.sweeps >= n + 3, 15, what="sweeps with broken ranks")
        c = get(mon, "/v1/cluster").json()
        by_url = {r["url"]: r for g in c["groups"] for r in g["ranks"]}
        assert by_url[sim.ranks[0].url]["reason"] == "bad_response"
        assert by_url[sim.ranks[1].url]["reason"] == "timeout"
        assert by_url[sim.ranks[2].url]["reachable"]
        assert 'reason="timeout"' in get(mon, "/metrics").text
    finally:
        mon.stop()


def test_registration_needs_the_token_when_one_is_set(tmp_path, sim):
    mon = make_monitor(tmp_path, sim, register=True, token=TOKEN)
    try:
        body = {"url": sim.urls[1], "job": "sim", "replica_group": 1, "rank": 1}
        assert requests.post(mon.url + "/v1/targets", json=body, timeout=5).status_code == 401
        r = requests.post(mon.url + "/v1/targets", json=body, timeout=5,
                          headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200
        bad = requests.post(mon.url + "/v1/targets", json={"url": "nope"}, timeout=5,
                            headers={"Authorization": f"Bearer {TOKEN}"})
        assert bad.status_code == 400
        wait_until(lambda: [g["replica_group"] for g in get(mon, "/v1/cluster").json()["groups"]]
                   == [1], 10, what="the registered rank in the cluster view")
    finally:
        mon.stop()


def test_manual_eviction_disabled_without_token(tmp_path, job):
    mon = make_monitor(tmp_path, job.sim, job)
    try:
        r = requests.post(mon.url + "/v1/evict", json={"replica_group": 1}, timeout=5)
        assert r.status_code == 403
        assert job.kills == []
    finally:
        mon.stop()


def test_manual_eviction_confirmed_and_not_repeated_after_restart(tmp_path, job):
    sim, lighthouse = job.sim, job
    rid = job.replica_ids[1]
    mon = make_monitor(tmp_path, sim, lighthouse, token=TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        wait_until(lambda: mon.evidence and 1 in mon.evidence.groups, 10,
                   what="group 1 verified")
        assert requests.post(mon.url + "/v1/evict", json={"replica_group": 1}, timeout=5,
                             headers={"Authorization": "Bearer wrong"}).status_code == 401
        r = requests.post(mon.url + "/v1/evict", json={"replica_group": 1, "reason": "test"},
                          headers=auth, timeout=5)
        assert r.status_code == 200, r.text
        assert r.json()["sent"] is True  # the 500 from torchft 0.2.0 counts as sent
        assert lighthouse.kills == [rid]
        wait_until(lambda: get(mon, "/v1/evictions?decision=evict").json()[0]["status"]
                   == "confirmed", 10, what="the eviction confirmed")
        assert get(mon, "/v1/evictions?decision=hold").json() == []  # filtered: no hold yet
        # counted by what it was for, as its audit row says
        [counted] = [line for line in get(mon, "/metrics").text.splitlines()
                     if line.startswith("lightkeeper_monitor_eviction_decisions_total{")]
        assert 'decision="evict"' in counted and 'reason="manual"' in counted, counted
        # its rank gone for dead_sweeps and more: asked for, no finding
        n = mon.sweeps
        wait_until(lambda: mon.sweeps >= n + 3, 10, what="sweeps after the kill")
        assert get(mon, "/v1/findings").json() == []
    finally:
        mon.stop()
    # say the kill did not take: the same replica id is back (still in the Lighthouse's quorum)
    sim.ranks[1].set_mode("ok")
    mon = make_monitor(tmp_path, sim, lighthouse, token=TOKEN)
    try:
        wait_until(lambda: mon.evidence and 1 in mon.evidence.groups, 10,
                   what="group 1 seen and verified")
        ev = get(mon, "/v1/evictions").json()
        assert [(e["decision"], e["replica_id"], e["status"]) for e in ev] == [
            ("evict", rid, "confirmed")]
        r = requests.post(mon.url + "/v1/evict", json={"replica_group": 1}, headers=auth,
                          timeout=5)
        assert r.status_code == 409 and r.json()["reason"] == "already_evicted"
        assert lighthouse.kills == [rid]
    finally:
        mon.stop()


def test_auto_eviction_rails_and_audit_across_restart(tmp_path):
    """dead evicts here (--evict-on dead) so the whole loop runs without a trainer."""
    lighthouse = SimJob(5)
    sim = lighthouse.sim
    rails = RailsConfig(min_replicas=4, cooldown_s=0, evict_kinds=("dead",))
    sim.ranks[4].set_mode("down")
    mon = make_monitor(tmp_path, sim, lighthouse, rails=rails)
    try:
        # a rank that never answered has no group and no replica id: nothing to decide
        wait_until(lambda: mon.sweeps >= 4, 10, what="sweeps")
        assert lighthouse.kills == []
        sim.ranks[4].set_mode("ok")
        wait_until(lambda: mon.view and mon.view.groups.get(4) is not None
                   and mon.view.groups[4].status == "up", 10, what="group 4 up")
        sim.ranks[4].set_mode("down")
        lighthouse.alive.discard(4)  # its heartbeats stop too
        wait_until(lambda: lighthouse.kills, 10, what="the dead group's eviction")
        assert lighthouse.kills == [lighthouse.replica_ids[4]]
        # the next dead group would leave 3 < --min-replicas 4 groups: held back
        sim.ranks[3].set_mode("down")
        lighthouse.alive.discard(3)
        wait_until(lambda: any(d["reason"] == "min_replicas"
                               for d in get(mon, "/v1/evictions").json()), 10,
                   what="a min_replicas hold")
        assert lighthouse.kills == [lighthouse.replica_ids[4]]
        findings = get(mon, "/v1/findings").json()
        assert {(f["kind"], f["replica_group"]) for f in findings} >= {("dead", 3), ("dead", 4)}
        # the kill confirmed (or not) before the restart: a record still changing is no check
        wait_until(lambda: all(d["status"] in (None, "confirmed", "unconfirmed", "failed")
                               for d in get(mon, "/v1/evictions").json()), 15,
                   what="the eviction's confirmation")
        before = get(mon, "/v1/evictions").json()
    finally:
        mon.stop()
    mon = make_monitor(tmp_path, sim, lighthouse, rails=rails)
    try:
        wait_until(lambda: mon.sweeps >= 5, 10, what="sweeps after the restart")
        after = get(mon, "/v1/evictions").json()
        assert after[-len(before):] == before  # the audit log is intact
        assert lighthouse.kills == [lighthouse.replica_ids[4]]  # not evicted twice
    finally:
        mon.stop()
        lighthouse.stop()


def test_dry_run_never_evicts(tmp_path, job):
    sim, lighthouse = job.sim, job
    rails = RailsConfig(min_replicas=1, cooldown_s=0, evict_kinds=("dead",), dry_run=True)
    mon = make_monitor(tmp_path, sim, lighthouse, rails=rails)
    try:
        wait_until(lambda: mon.sweeps >= 1, 10, what="a sweep")
        sim.ranks[0].set_mode("down")
        lighthouse.alive.discard(0)  # its heartbeats stop too
        wait_until(lambda: any(d["reason"] == "dry_run"
                               for d in get(mon, "/v1/evictions").json()), 10, what="dry-run hold")
        assert lighthouse.kills == []
        assert 'lightkeeper_monitor_dry_run{job="sim"} 1.0' in get(mon, "/metrics").text
    finally:
        mon.stop()


def test_two_evictions_in_one_sweep_respect_min_replicas(tmp_path):
    """A group a kill was sent to still looks in the quorum until the Lighthouse drops it; it
    must not count towards --min-replicas, or two decisions made on one sweep's view (two
    findings, or two requests) take the job below it. With cooldown 0 nothing else holds."""
    lighthouse = SimJob(5)
    rails = RailsConfig(min_replicas=4, cooldown_s=0)
    mon = make_monitor(tmp_path, lighthouse.sim, lighthouse, rails=rails)
    try:
        wait_until(lambda: mon.evidence is not None and len(mon.evidence.in_quorum()) == 5, 15,
                   what="five verified groups in the quorum")
        first = mon.evict_manual(3, "test")
        second = mon.evict_manual(4, "test")  # on the same view: group 3 still in its quorum
        assert first["decision"] == "evict", first
        assert (second["decision"], second["reason"]) == ("hold", "min_replicas"), second
        assert lighthouse.kills == [lighthouse.replica_ids[3]]
    finally:
        mon.stop()
        lighthouse.stop()


def test_healthz_says_503_while_the_sweeps_are_stuck(tmp_path):
    """A liveness probe restarts a monitor whose loop hangs: /healthz answers 503 ``stalled``
    once no sweep ended for 30 s (the monitor's clock, stepped here), and ok again after."""
    import threading

    clock = [1000.0]
    mon = Monitor(MonitorConfig(port=0, interval_s=0.2, state_path=str(tmp_path / "m.db")),
                  clock=lambda: clock[0])
    gate, real = threading.Event(), mon.sweep_once
    mon.sweep_once = lambda: (gate.wait(30), real())[1]  # the loop hangs in its sweep
    mon.start()
    try:
        assert get(mon, "/healthz").json()["status"] == "ok"
        clock[0] += 29.0
        assert get(mon, "/healthz").status_code == 200
        clock[0] += 2.0
        r = get(mon, "/healthz")
        assert (r.status_code, r.json()["status"], r.json()["since_s"]) == (503, "stalled", 31.0)
        gate.set()
        wait_until(lambda: get(mon, "/healthz").status_code == 200, 10, what="sweeping again")
    finally:
        gate.set()
        mon.stop()


def _lost(mon) -> float:
    for line in get(mon, "/metrics").text.splitlines():
        if line.startswith('lightkeeper_monitor_ranks_lost_total{job="sim"}'):
            return float(line.split()[-1])
    raise AssertionError("no lightkeeper_monitor_ranks_lost_total series")


def test_a_rank_forgotten_while_the_job_goes_on_is_counted_lost(tmp_path):
    """Prometheus stops scraping a self-registered rank once the monitor forgets it, so its
    ``up == 0`` never lasts long enough to alert: the monitor counts it lost instead. A rank
    that said it stopped is not lost; nor are the last ranks of a job that said it ended, one
    of them gone before the monitor read it say so."""
    sim = SimRanks.start(4)
    mon = make_monitor(tmp_path, sim, register=True, forget_after_s=0.6)
    try:
        for r in sim.ranks:
            requests.post(mon.url + "/v1/targets", json={"url": r.url}, timeout=5)
        wait_until(lambda: sum(r["reachable"] for r in _ranks(mon).values()) == 4, 10,
                   what="4 registered ranks up")
        assert _lost(mon) == 0
        sim.ranks[0].set_mode("down")  # dies while the others train
        sim.ranks[1].update(phase="stopped")  # says it stopped, then goes
        wait_until(lambda: _ranks(mon)[sim.ranks[1].url]["phase"] == "stopped", 10,
                   what="the stop seen")
        sim.ranks[1].set_mode("down")
        wait_until(lambda: len(_ranks(mon)) == 2, 10, what="both forgotten")
        assert _lost(mon) == 1
        sim.ranks[2].update(finished=True, phase="stopped")  # the job ends: one says so
        wait_until(lambda: _ranks(mon)[sim.ranks[2].url]["phase"] == "stopped", 10,
                   what="the end seen")
        for r in sim.ranks[2:]:  # rank 3 goes before the monitor read its end
            r.set_mode("down")
        wait_until(lambda: not _ranks(mon), 10, what="the last ranks forgotten")
        assert _lost(mon) == 1
    finally:
        mon.stop()
        sim.stop()


def test_a_rank_stopped_while_no_monitor_ran_is_lost_only_if_its_group_is_not_back(tmp_path):
    """A node drain takes the monitor's pod with a group's: that rank stops unsaid. The
    restarted monitor re-adopts its URL (--sd-out) and never reads it: with its group back
    (a new incarnation elsewhere) it is not lost; a group that never comes back still is."""
    sim = SimRanks.start(3)  # groups 0, 1, 2
    back = None
    mon = make_monitor(tmp_path, sim, register=True, forget_after_s=0.6)

    def register(r) -> None:  # as a WorkerServer registers
        requests.post(mon.url + "/v1/targets", timeout=5, json={
            "url": r.url, "job": "sim", "replica_group": r.state["replica_group"],
            "rank": r.state["rank"]})
    try:
        for r in sim.ranks:
            register(r)
        wait_until(lambda: sum(r["reachable"] for r in _ranks(mon).values()) == 3, 10,
                   what="3 registered ranks up")
    finally:
        mon.stop()
    sim.ranks[0].set_mode("down")  # group 0 drained, restarted elsewhere
    sim.ranks[1].set_mode("down")  # group 1 gone for good
    back = SimRanks.start(1)  # group 0's new incarnation, another address
    mon = make_monitor(tmp_path, sim, register=True, forget_after_s=0.6)
    try:
        register(back.ranks[0])
        gone = {sim.ranks[0].url, sim.ranks[1].url}
        wait_until(lambda: _lost(mon) > 0 or not gone & set(_ranks(mon)) and mon.sweeps > 10,
                   15, what="both re-adopted URLs forgotten")
        assert _lost(mon) == 1
    finally:
        mon.stop()
        sim.stop()
        back.stop()


@pytest.mark.parametrize("lighthouse_hears_them", [False, True])
def test_a_whole_job_gone_without_a_word_is_counted_lost(tmp_path, lighthouse_hears_them):
    """Every rank of the job goes at once and none said the job ended (host loss, an OOM kill,
    a SIGKILL): Prometheus stops scraping them once they are forgotten, so only the monitor's
    count can alert (LightkeeperRanksLost). Unless the Lighthouse still hears them: then the
    monitor is the one cut off (its ranks' registrations lost too), and the job lives on."""
    job = SimJob(2, heartbeat_timeout_ms=1000)
    mon = make_monitor(tmp_path, job.sim, job, register=True, forget_after_s=2.0)
    try:
        for r in job.sim.ranks:
            requests.post(mon.url + "/v1/targets", json={"url": r.url}, timeout=5)
        wait_until(lambda: sum(r["reachable"] for r in _ranks(mon).values()) == 2, 10,
                   what="2 registered ranks up")
        if not lighthouse_hears_them:
            job.alive.clear()  # their heartbeats stop with them (1 s timeout)
        for r in job.sim.ranks:
            r.set_mode("down")
        wait_until(lambda: not _ranks(mon), 15, what="both forgotten")
        assert _lost(mon) == (0 if lighthouse_hears_them else 2)
    finally:
        mon.stop()
        job.stop()


def test_the_ranks_of_an_evicted_replica_are_not_lost(tmp_path):
    """The monitor's own eviction ends a group's ranks without their saying so: they went
    because they were told to, not lost (LightkeeperRanksLost does not page for each kill)."""
    job = SimJob(3)
    mon = make_monitor(tmp_path, job.sim, job, register=True, forget_after_s=0.6, token="tok")
    try:
        for r in job.sim.ranks:
            requests.post(mon.url + "/v1/targets", json={"url": r.url}, timeout=5,
                          headers={"Authorization": "Bearer tok"})
        wait_until(lambda: sum((r["verification"] or {}).get("state") == "verified"
                               for r in _ranks(mon).values()) == 3, 15,
                   what="3 registered ranks verified")
        r = requests.post(mon.url + "/v1/evict", json={"replica_group": 1}, timeout=10,
                          headers={"Authorization": "Bearer tok"})
        assert r.status_code == 200 and r.json()["sent"] is True, r.text
        job.alive.discard(1)
        job.sim.group(1)[0].set_mode("down")
        wait_until(lambda: len(_ranks(mon)) == 2, 15, what="the evicted rank forgotten")
        assert _lost(mon) == 0
    finally:
        mon.stop()
        job.stop()


def _ranks(mon) -> dict[str, dict]:
    return {r["url"]: r for r in get(mon, "/v1/ranks").json()}


def test_a_rank_of_another_job_is_refused_with_the_reason(tmp_path, sim, caplog):
    mon = make_monitor(tmp_path, sim, register=True)
    try:
        for _ in range(3):  # every 5 s from each rank: said once in the monitor's log
            r = requests.post(mon.url + "/v1/targets", timeout=5,
                              json={"url": sim.urls[0], "job": "other", "replica_group": 0})
            assert r.status_code == 409
        assert "'sim'" in r.json()["error"] and "'other'" in r.json()["error"]
        said = [m for m in caplog.messages if "refusing ranks of job 'other'" in m]
        assert len(said) == 1 and "--job is 'sim'" in said[0]
        # a registration may name any job: the log says the first 20, then no more
        with requests.Session() as http:
            for i in range(30):
                assert http.post(mon.url + "/v1/targets", timeout=5, json={
                    "url": sim.urls[0], "job": f"job-{i}"}).status_code == 409
        said = [m for m in caplog.messages if "refusing ranks of job" in m]
        assert len(said) == 20 and "refused unsaid from now" in said[-1], said[-3:]
        ok = requests.post(mon.url + "/v1/targets", json={"url": sim.urls[1], "job": "sim"},
                           timeout=5)
        assert ok.status_code == 200
        assert [t["url"] for t in get(mon, "/v1/targets").json()] == [sim.urls[1]]
    finally:
        mon.stop()
