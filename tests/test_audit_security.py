"""Trust boundaries an operator checks before a shared cluster: registration through the
allow-list and the tokens' start-up warning, over a real monitor on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import requests

from lightkeeper.processes import wait_until
from monitor.config import MonitorConfig, RailsConfig
from monitor.service import Monitor
from tests.support.fake_rank import FakeRank


def monitor_with(tmp_path, job, stranger, **extra):
    """A monitor of ``job`` (tokens on) with ``stranger`` registered by a registration-token
    holder; the caller stops it."""
    mon = Monitor(MonitorConfig(
        port=0, interval_s=0.2, state_path=str(tmp_path / "state.sqlite"),
        sd_out=str(tmp_path / "targets.json"), job="sim", lighthouse=job.url,
        targets=job.sim.urls, kill_timeout_s=2.0, token="admin-tok", register_token="reg-tok",
        rails=RailsConfig(min_replicas=1, cooldown_s=0), **extra)).start()
    try:
        r = requests.post(mon.url + "/v1/targets", timeout=5,
                          headers={"Authorization": "Bearer reg-tok"},
                          json={"url": stranger.url, "job": "sim"})
        assert r.status_code == 200, r.text
    except BaseException:
        mon.stop()
        raise
    return mon

def test_allow_listed_registration_keeps_the_path_prefix(tmp_path):
    """A rank behind a proxy prefix is polled at that prefix, at the checked address (the
    token path kept it; the allow-list path dropped it and polled the proxy's root)."""
    cfg = MonitorConfig(port=0, interval_s=0.2, state_path=str(tmp_path / "state.sqlite"),
                        sd_out=str(tmp_path / "targets.json"), job="unit")
    mon = Monitor(cfg).start()
    try:
        r = requests.post(mon.url + "/v1/targets", timeout=5,
                          json={"url": "http://localhost:9/rank-0/", "job": "unit"})
        assert r.status_code == 200, r.text
        assert r.json()["url"] == "http://127.0.0.1:9/rank-0"
        known = [t["url"] for t in requests.get(mon.url + "/v1/targets", timeout=5).json()]
        assert known == ["http://127.0.0.1:9/rank-0"]
    finally:
        mon.stop()


@pytest.mark.parametrize("env_name,said", [
    ("LIGHTKEEPER_REGISTER_TOKEN", "--register-token equals --token"),
    ("LIGHTKEEPER_EXIT_TOKEN", "--rank-exit-token equals --token")])
def test_tokens_equal_but_for_a_newline_are_warned_about(tmp_path, env_name, said):
    """The routes strip the tokens (a secret file's final newline), so a registration token
    that differs from the admin one only by it can evict: the start-up warning says so. So
    for the ranks' exit token, which every rank holds too."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTKEEPER_")}
    env.update({"LIGHTKEEPER_TOKEN": "same-token\n", env_name: "same-token"})
    if env_name == "LIGHTKEEPER_EXIT_TOKEN":
        env["LIGHTKEEPER_REGISTER_TOKEN"] = "another-token"
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0",
             "--state", str(tmp_path / "s.sqlite"), "--no-bundles"], env=env, stdout=o, stderr=e)
    try:
        deadline = time.monotonic() + 30
        # the warning comes before the start line
        while "monitor=" not in out.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        assert "monitor=" in out.read_text(), err.read_text()
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert said in err.read_text(), err.read_text()


def claiming(state: dict) -> FakeRank:
    """A process that registered itself with the registration token and claims the replica id
    of a group about to be evicted: it serves that /v1/state and records every POST's path and
    Authorization header (what an attacker would harvest)."""
    stranger = FakeRank()
    stranger.state = {**state, "worker_url": stranger.url}
    return stranger


def test_exit_token_goes_only_to_ranks_verified_with_the_evicted_replica(tmp_path):
    """After a kill the monitor tells the evicted group's ranks still answering to exit, with
    the ranks' exit token. A stranger holding only the registration token (every pod has it)
    that claims the evicted replica id must not be sent that token: with it, it could end every
    rank of the job. The group's real rank the kill missed is still told."""
    from tests.support.monitor_sim import SimJob

    job = SimJob(2, ranks_per_group=2)
    stranger = None
    mon = None
    try:
        real = job.sim.group(1)
        stranger = claiming({**real[1].state, "rank": 301, "host": "elsewhere", "group_rank": 2,
                             "group_world_size": 3})  # unverified: no rival of the real ranks
        mon = monitor_with(tmp_path, job, stranger, rank_exit_token="exit-tok",
                           orphan_grace_s=0.3)

        def group1_verified():
            c = requests.get(mon.url + "/v1/cluster", timeout=5).json()
            g = [g for g in c["groups"] if g["replica_group"] == 1]
            ranks = {x["url"] for x in requests.get(mon.url + "/v1/ranks", timeout=5).json()}
            return g and g[0]["evidence_ranks"] == 2 and stranger.url in ranks
        wait_until(group1_verified, 20, what="group 1 verified, the stranger polled")

        r = requests.post(mon.url + "/v1/evict", timeout=10, json={"replica_group": 1},
                          headers={"Authorization": "Bearer admin-tok"})
        assert r.status_code == 200 and r.json()["decision"] == "evict", r.text
        wait_until(lambda: job.kills, 10, what="the kill")
        real[1].set_mode("ok")  # the kill reached group rank 0 only: group rank 1 lives on

        def told():
            ds = requests.get(mon.url + "/v1/evictions", timeout=5).json()
            return [d for d in ds if d["decision"] == "evict"
                    and "told rank(s)" in (d["detail"] or "")]
        d = wait_until(told, 20, what="the missed rank told to exit")[0]
        assert real[1].url in d["detail"], d
        assert stranger.url not in d["detail"], d
        assert stranger.posts == [], stranger.posts
    finally:
        if mon is not None:
            mon.stop()
        if stranger is not None:
            stranger.stop()
        job.stop()


def test_a_bundle_fetches_no_stacks_url_a_rank_chose(tmp_path):
    """An incident bundle asks the culprit group's ranks for their stacks, a rank on torch's
    server at the handler its ``stacks_url`` names. A stranger in that group (registered, not
    verified) that calls itself torch-only and names another service's URL must not make the
    monitor POST there (the answer would go into a bundle anyone may download)."""
    from tests.support.monitor_sim import SimJob

    job = SimJob(2, ranks_per_group=2)
    victim = stranger = mon = None
    try:
        victim = claiming({})
        real = job.sim.group(1)
        stranger = claiming({**real[1].state, "rank": 301, "group_rank": 2,
                             "group_world_size": 3, "torch_only": {},
                             "stacks_url": victim.url + "/internal/secret"})
        mon = monitor_with(tmp_path, job, stranger)

        def stranger_in_group1():
            c = requests.get(mon.url + "/v1/cluster", timeout=5).json()
            g = [g for g in c["groups"] if g["replica_group"] == 1]
            return g and g[0]["evidence_ranks"] == 2 and \
                stranger.url in [x["url"] for x in g[0]["ranks"] if x["reachable"]]
        wait_until(stranger_in_group1, 20, what="group 1 verified, the stranger shown in it")

        r = requests.post(mon.url + "/v1/evict", timeout=10, json={"replica_group": 1},
                          headers={"Authorization": "Bearer admin-tok"})
        assert r.status_code == 200 and r.json()["bundle"], r.text  # kept before the kill
        assert victim.posts == [], victim.posts
    finally:
        for x in (mon, stranger, victim):
            if x is not None:
                x.stop()
        job.stop()


def test_registered_dead_addresses_do_not_blind_the_rails(tmp_path):
    """--min-reachable holds evictions while the monitor reaches too few ranks (it may be the
    one cut off). A registration-token holder that registers addresses nobody answers on must
    not count as ranks the monitor fails to reach: a real group dying is still evicted."""
    from monitor.config import DetectorConfig, RailsConfig
    from tests.support.monitor_sim import SimJob

    job = SimJob(3)
    mon = None
    try:
        cfg = MonitorConfig(
            port=0, interval_s=0.2, state_path=str(tmp_path / "state.sqlite"),
            sd_out=str(tmp_path / "targets.json"), job="sim", lighthouse=job.url,
            targets=job.sim.urls, kill_timeout_s=2.0, register_token="reg-tok",
            detectors=DetectorConfig(dead_sweeps=2),
            rails=RailsConfig(min_replicas=1, cooldown_s=0, evict_kinds=("dead", "dead_rank")))
        mon = Monitor(cfg).start()
        wait_until(lambda: requests.get(mon.url + "/v1/cluster", timeout=5).json()
                   ["verification"]["ranks"].get("verified") == 3, 20, what="3 ranks verified")
        for port in range(2, 10):  # nothing listens on these
            r = requests.post(mon.url + "/v1/targets", timeout=5,
                              headers={"Authorization": "Bearer reg-tok"},
                              json={"url": f"http://127.0.0.1:{port}", "job": "sim"})
            assert r.status_code == 200, r.text
        wait_until(lambda: requests.get(mon.url + "/v1/cluster", timeout=5).json()
                   ["reachable_fraction"] < 0.5, 10, what="the dead addresses polled")
        job.sim.group(2)[0].set_mode("down")
        job.alive.discard(2)  # its heartbeats stop too
        wait_until(lambda: job.kills, 20, what="the dead group evicted")
        assert job.kills == [job.replica_ids[2]]
        ds = requests.get(mon.url + "/v1/evictions", timeout=5).json()
        assert not [d for d in ds if d["reason"] == "monitor_blind"], ds
    finally:
        if mon is not None:
            mon.stop()
        job.stop()


def test_a_prefixed_target_is_scraped_and_restored_from_sd_out(tmp_path):
    """``--sd-out`` is Prometheus ``file_sd``, whose targets are host:port only: a registered
    ``http://host:port/prefix`` goes there as host:port with ``__metrics_path__`` (it was
    written whole, and real Prometheus refused it as "not a valid hostname"), and a restarted
    monitor re-adopts it with its prefix."""
    from lightkeeper import prometheus

    rank = FakeRank(get=lambda path: (200, b"lk_prefixed 1\n") if path == "/rank-0/metrics"
                    else (404, b""))
    url = f"{rank.url}/rank-0"
    sd = tmp_path / "targets.json"
    cfg = dict(port=0, interval_s=0.2, state_path=str(tmp_path / "state.sqlite"),
               sd_out=str(sd), job="unit")
    mon = prom = None
    try:
        mon = Monitor(MonitorConfig(**cfg)).start()
        r = requests.post(mon.url + "/v1/targets", json={"url": url, "job": "unit"}, timeout=5)
        assert r.status_code == 200 and r.json()["url"] == url, r.text
        wait_until(lambda: sd.exists() and url.split("//")[1].split("/")[0] in sd.read_text(),
                   10, what="the target in --sd-out")
        mon.stop()
        mon = None
        prom = prometheus.start({"global": {"scrape_interval": "1s"}, "scrape_configs": [{
            "job_name": "lk", "honor_labels": True,
            "file_sd_configs": [{"files": [str(sd)], "refresh_interval": "1s"}]}]},
            tmp_path / "prom")
        up = prom.wait_for_targets(1, timeout=30)
        assert [t["scrapeUrl"] for t in up] == [url + "/metrics"]
        mon = Monitor(MonitorConfig(**cfg)).start()  # the same --sd-out: re-adopted
        known = [t["url"] for t in requests.get(mon.url + "/v1/targets", timeout=5).json()]
        assert known == [url]
    finally:
        if mon is not None:
            mon.stop()
        if prom is not None:
            prom.stop()
        rank.stop()
