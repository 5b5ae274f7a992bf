"""The sharded monitor (monitor/shard.py, monitor/lease.py; docs/scaling.md, Beyond one machine).

Real parts: a real etcd (Debian's etcd-server, on 127.0.0.1 with ephemeral ports and a temp data
dir, stopped by PID), a real torchft Lighthouse that simulated replica groups join for real
(``SimJob``: a simulated group has no Manager to exit, so kill requests reach a recording front
that takes the group down as an exiting Manager would; tests/support/monitor_sim.py), and
``lightkeeper monitor`` processes. Without etcd the tests skip locally and fail in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from lightkeeper.processes import free_port, start_monitor_process, stop_process, wait_until
from monitor.api.views import ranks_json
from monitor.cli import add_arguments, config_from_args
from monitor.config import ConfigError
from monitor.lease import Etcd, LeaderLease
from monitor.shard import shard_of
from tests.conftest import require_binary

ROOT = Path(__file__).resolve().parents[1]


def start_etcd(data: Path, client: int, peer: int) -> subprocess.Popen:
    """A real etcd on 127.0.0.1, serving once this returns (the caller stops it by PID); the
    same ``data`` and ports start it again with its keys and leases."""
    exe = require_binary("etcd")
    url = f"http://127.0.0.1:{client}"
    with open(data / "etcd.log", "ab") as log:
        proc = subprocess.Popen(
            [exe, "--name", "lk", "--data-dir", str(data / "data"),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"lk=http://127.0.0.1:{peer}", "--log-level", "error"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def up():
        if proc.poll() is not None:
            raise RuntimeError(f"etcd exited: {(data / 'etcd.log').read_text()[-2000:]}")
        try:
            return requests.post(url + "/v3/kv/range", json={"key": "eA=="}, timeout=1).ok
        except requests.RequestException:
            return False

    try:
        wait_until(up, 30, what="etcd to serve")
    except BaseException:
        stop_process(proc, grace=2.0)
        raise
    return proc


@contextlib.contextmanager
def running_etcd(data: Path) -> Iterator[str]:
    """A real etcd's client URL while the block runs (its leases expire by themselves)."""
    client = free_port()
    proc = start_etcd(data, client, free_port())
    try:
        yield f"http://127.0.0.1:{client}"
    finally:
        stop_process(proc, grace=2.0)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with running_etcd(tmp_path_factory.mktemp("etcd")) as url:
        yield url


def keys(etcd_url: str, prefix: str) -> dict[str, dict]:
    e = Etcd(etcd_url)
    try:
        return {kv.key[len(prefix):]: {"value": kv.json(), "create_revision": kv.create_revision,
                                       "mod_revision": kv.mod_revision}
                for kv in e.range_prefix(prefix)}
    finally:
        e.close()


# --- cheap: the hash, the flags, the election ----------------------------------------------------
def test_shard_of_is_prometheus_hashmod_and_splits_the_groups():
    # Prometheus' hashmod: the last 8 bytes of the label value's MD5, big-endian, mod N
    for g in (0, 7, 1234):
        want = int.from_bytes(hashlib.md5(str(g).encode()).digest()[8:], "big") % 4
        assert shard_of(g, 4) == want
    counts = [0] * 4
    for g in range(4000):
        counts[shard_of(g, 4)] += 1
    assert min(counts) > 900, counts  # roughly even
    assert {shard_of(g, 1) for g in range(100)} == {0}


def parse(*argv: str):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--state", "/tmp/x.sqlite", *argv])


@pytest.mark.parametrize("argv,error", [
    (["--shard", "0/2"], "--etcd"),
    (["--shards", "2", "--etcd", "http://127.0.0.1:2379"], "would do nothing"),
    (["--lead", "--etcd", "http://127.0.0.1:2379"], "--lead needs --shards"),
    (["--shard", "1/2", "--shards", "3", "--etcd", "http://e:2379"], "disagree"),
    (["--shard", "0/2", "--etcd", "http://e:2379", "--lease-ttl", "1"], "--lease-ttl"),
    (["--shard", "0/2", "--etcd", "e:2379"], "http(s)://"),
    (["--shard", "0/2", "--etcd", "http://"], "http(s)://"),  # no host: one line, not a loop
    (["--shard", "0/2", "--etcd", "http://[::1"], "http(s)://"),
    (["--shards", "2", "--lead", "--etcd", "http://e:2379"], "--lead needs --lighthouse"),
])
def test_bad_shard_flags_are_refused_with_a_message(argv, error, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match=re.escape(error)):
        config_from_args(parse(*argv))


@pytest.mark.parametrize("bad", ["2/2", "x/2", "1", "=-1/2", "0/0"])
def test_bad_shard_value_exits_2(bad, capsys):
    """The error line names I/N (not only the usage line above it). argparse reads a bare
    ``--shard -1/2`` as a flag: ``--shard=-1/2`` reaches the check."""
    argv = ("--shard" + bad,) if bad.startswith("=") else ("--shard", bad)
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and "expected I/N" in last, last


def test_shard_flags_fill_the_config():
    cfg = config_from_args(parse("--shard", "1/3", "--lead", "--etcd", "http://127.0.0.1:2379",
                                 "--lease-ttl", "5", "--etcd-prefix", "/lk",
                                 "--lighthouse", "http://lh:29510"))
    s = cfg.shard
    assert (s.index, s.shards, s.lead, s.lease_ttl_s, s.etcd_prefix) == (1, 3, True, 5, "/lk")
    leader_only = config_from_args(parse("--shards", "3", "--lead", "--etcd", "http://e:2379",
                                         "--lighthouse", "http://lh:29510"))
    assert leader_only.shard.index is None and config_from_args(parse()).shard is None


def test_one_leader_and_a_lapsed_leader_cannot_write(etcd):
    """Two candidates: one leads; the other's guarded txn fails. The leader stops renewing
    (as a paused or killed process would): the other takes over once the lease lapses, and the
    old leader's txn now fails in etcd although it still believes it leads."""
    key = f"/lktest/{uuid.uuid4().hex}/leader"
    ea, eb = Etcd(etcd), Etcd(etcd)
    a = LeaderLease(ea, key, {"name": "a"}, ttl_s=2)
    b = LeaderLease(eb, key, {"name": "b"}, ttl_s=2)
    try:
        assert a.campaign() and not b.campaign()
        assert b.leader["id"] == a.id
        out = key + "-x"
        assert ea.put_if([a.guard()], out, {"by": "a"})[0]
        assert not eb.put_if([b.guard()], out, {"by": "b"})[0]
        # a stops renewing; b keeps campaigning
        wait_until(b.campaign, 10, interval=0.2, what="b to take over after a's lease lapsed")
        assert a.leading  # a's own belief, never refreshed ...
        assert not a.valid()  # ... which its own clock already distrusts ...
        assert not ea.put_if([a.guard()], out, {"by": "a"})[0]  # ... and etcd refuses
        assert ea.get(out).json() == {"by": "a"}  # the first write only
        b.resign()
        assert eb.get(key) is None  # a clean stop frees the key at once
    finally:
        ea.close()
        eb.close()


def test_a_rank_registers_with_every_shard_and_only_its_owner_polls_it(tmp_path, etcd):
    """LIGHTKEEPER_MONITOR with a comma-separated list registers the rank with each shard;
    every shard accepts it, only the shard that owns its replica group polls it."""
    from monitor.config import MonitorConfig, ShardConfig
    from monitor.service import Monitor
    from worker_server.server import WorkerServer

    prefix = f"/lktest-{uuid.uuid4().hex[:8]}"
    mons = [Monitor(MonitorConfig(
        port=0, interval_s=0.2, state_path=str(tmp_path / f"m{i}.sqlite"),
        sd_out=str(tmp_path / f"m{i}.json"),
        shard=ShardConfig(shards=2, index=i, etcd=etcd, etcd_prefix=prefix))).start()
        for i in (0, 1)]
    srv = None
    try:
        srv = WorkerServer.start(replica_group=5, group_rank=0, group_world_size=1, port=0,
                                 monitor_url=f"{mons[0].url}, {mons[1].url}")
        owner = shard_of(5, 2)
        wait_until(lambda: all(srv.url in [t["url"] for t in requests.get(
            m.url + "/v1/targets", timeout=5).json()] for m in mons), 20,
            what="the rank registered with both shards")
        owned = mons[owner]
        wait_until(lambda: srv.url in [r["url"] for r in ranks_json(owned.view, owned.clock())], 20,
                   what="the owner polling it")
        n = mons[1 - owner].sweeps
        wait_until(lambda: mons[1 - owner].sweeps >= n + 3, 10, what="the other shard sweeping")
        assert ranks_json(mons[1 - owner].view, mons[1 - owner].clock()) == []
        assert mons[owner].cluster_json()["shard"]["owned_groups"] == [5]
    finally:
        if srv is not None:
            srv.stop()
        for m in mons:
            m.stop()


def test_a_rank_restarted_for_another_group_moves_to_that_groups_shard(tmp_path, etcd,
                                                                      monkeypatch):
    """The slice follows what a rank answers, not what it first registered: the same address
    serving another shard's group leaves its old shard and is found by the new one (on its
    reprobe, made 1 s here instead of 60 s)."""
    import monitor.shard
    from monitor.config import MonitorConfig, ShardConfig
    from monitor.service import Monitor
    from worker_server.server import WorkerServer

    monkeypatch.setattr(monitor.shard, "REPROBE_S", 1.0)
    g0 = next(g for g in range(100) if shard_of(g, 2) == 0)
    g1 = next(g for g in range(100) if shard_of(g, 2) == 1)
    port = free_port()
    prefix = f"/lktest-{uuid.uuid4().hex[:8]}"
    mons = [Monitor(MonitorConfig(
        port=0, interval_s=0.2, state_path=str(tmp_path / f"m{i}.sqlite"),
        targets=[f"127.0.0.1:{port}"], sd_out=str(tmp_path / f"m{i}.json"),
        shard=ShardConfig(shards=2, index=i, etcd=etcd, etcd_prefix=prefix))).start()
        for i in (0, 1)]
    srv = None

    def polled_by(i: int) -> list:
        return [r.get("replica_group") for r in ranks_json(mons[i].view, mons[i].clock())
                if r.get("reachable")]

    try:
        srv = WorkerServer.start(replica_group=g0, group_rank=0, group_world_size=1, port=port)
        wait_until(lambda: polled_by(0) == [g0], 20, what="shard 0 polling its group's rank")
        assert polled_by(1) == []
        srv.stop()
        srv = WorkerServer.start(replica_group=g1, group_rank=0, group_world_size=1, port=port)
        wait_until(lambda: polled_by(1) == [g1], 20, what="shard 1 polling the rank, now its")
        wait_until(lambda: polled_by(0) == [], 20, what="shard 0 leaving it")
        assert mons[1].cluster_json()["shard"]["owned_groups"] == [g1]
    finally:
        if srv is not None:
            srv.stop()
        for m in mons:
            m.stop()


# --- a shard restarted with its --state ---------------------------------------------------------
def _shard0(tmp_path: Path, job, etcd_url: str, prefix: str):
    from monitor.config import DetectorConfig, MonitorConfig, RailsConfig, ShardConfig
    from monitor.service import Monitor

    return Monitor(MonitorConfig(  # shard 0 owns 1 group of 4: one rank down is half its slice
        port=0, interval_s=0.2, state_path=str(tmp_path / "s0.sqlite"),
        sd_out=str(tmp_path / "s0.json"), job="sim", lighthouse=job.url, targets=job.sim.urls,
        detectors=DetectorConfig(dead_sweeps=2), rails=RailsConfig(min_reachable_fraction=0.3),
        shard=ShardConfig(shards=2, index=0, etcd=etcd_url, etcd_prefix=prefix,
                          lease_ttl_s=2))).start()


def _proposer(etcd_url: str, key: str) -> str | None:
    """The monitor URL the proposal at ``key`` names (None: none)."""
    e = Etcd(etcd_url)
    try:
        kv = e.get(key)
        return kv.json().get("monitor") if kv is not None else None
    finally:
        e.close()


def _polled(mon, g: int) -> int:
    return sum(1 for r in ranks_json(mon.view, mon.clock())
               if r.get("reachable") and r["replica_group"] == g)


def _dead_rank_open(mon, g: int) -> bool:
    return any(f["kind"] == "dead_rank" and f["replica_group"] == g and not f.get("resolved_at")
               for f in requests.get(mon.url + "/v1/findings", timeout=5).json())


def _dead_rank_proposed(tmp_path: Path, job, etcd_url: str, prefix: str, monitor=None):
    """Shard 0 of 2 (``monitor``, else one started here) polls a group of its slice, one of the
    group's ranks goes down, and the shard proposes the eviction: (the monitor, the group, the
    proposal's key)."""
    x = next(g for g in range(4) if shard_of(g, 2) == 0)
    key = f"{prefix}/sim/proposals/{job.replica_ids[x]}"
    mon = monitor or _shard0(tmp_path, job, etcd_url, prefix)
    wait_until(lambda: _polled(mon, x) == 2, 20, what="shard 0 polling the group's ranks")
    next(r for r in job.sim.group(x) if r.state["group_rank"] == 1).set_mode("down")
    wait_until(lambda: _proposer(etcd_url, key) == mon.url, 20, what="the proposal")
    return mon, x, key


def test_a_shard_restarted_with_its_state_finds_a_dead_rank_again(tmp_path, etcd):
    """A rank of a live group stops answering; its shard proposes the eviction, then restarts with
    the same --state before any leader acted. As a single monitor does, the new run still polls
    the dead rank (kept with its group in the state file), finds it again and proposes it."""
    from tests.support.monitor_sim import SimJob

    job = SimJob(4, ranks_per_group=2)
    prefix = f"/lktest-{uuid.uuid4().hex[:8]}"
    mon = None
    try:
        mon, x, key = _dead_rank_proposed(tmp_path, job, etcd, prefix)
        mon.stop()
        mon = _shard0(tmp_path, job, etcd, prefix)
        wait_until(lambda: _dead_rank_open(mon, x), 20, what="the dead rank found again")
        wait_until(lambda: _proposer(etcd, key) == mon.url, 20,
                   what="the restarted shard's own proposal")
    finally:
        if mon is not None:
            mon.stop()
        job.stop()


def _accounted_seconds(mon) -> float:
    """The replica-seconds a monitor's goodput series have counted, goodput and badput."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(mon.metrics.registry).decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name in ("lightkeeper_monitor_goodput_seconds_total",
                             "lightkeeper_monitor_badput_seconds_total"))


def test_a_second_monitor_with_the_same_shard_stands_by_until_the_first_goes(tmp_path, etcd):
    """Two monitors started with the same --shard 0/2 (a copy-paste, or a rolling update): the
    second neither overwrites the first's report nor proposes; it stands by, says so in
    /v1/cluster, and takes the shard over once the first one's lease ends."""
    from tests.support.monitor_sim import SimJob

    job = SimJob(4, ranks_per_group=2)
    prefix = f"/lktest-{uuid.uuid4().hex[:8]}"
    report = "/sim/shards/0"
    first = second = None
    for d in "ab":
        (tmp_path / d).mkdir()
    try:
        first = _shard0(tmp_path / "a", job, etcd, prefix)
        wait_until(lambda: (keys(etcd, prefix).get(report) or {}).get("value", {})
                   .get("monitor") == first.url, 20, what="the first shard's report")
        second = _shard0(tmp_path / "b", job, etcd, prefix)
        wait_until(lambda: second.cluster_json()["shard"]["standby"], 20,
                   what="the second shard standing by")
        assert second.cluster_json()["shard"]["held_by"]["monitor"] == first.url
        _, x, key = _dead_rank_proposed(tmp_path, job, etcd, prefix, monitor=first)
        n = second.sweeps
        wait_until(lambda: second.sweeps >= n + 5 and _dead_rank_open(second, x), 20,
                   what="the standby finding the dead rank too")
        assert _proposer(etcd, key) == first.url
        assert second.cluster_json()["shard"]["proposals_made"] == 0
        assert keys(etcd, prefix)[report]["value"]["monitor"] == first.url
        # the slice's goodput is the first's to export: summed across shards, once
        assert _accounted_seconds(first) > 0 and _accounted_seconds(second) == 0
        first.stop()  # its lease revoked: the standby reports and proposes from now
        first = None
        wait_until(lambda: not second.cluster_json()["shard"]["standby"], 20,
                   what="the standby taking the shard over")
        wait_until(lambda: keys(etcd, prefix)[report]["value"]["monitor"] == second.url, 20,
                   what="the second shard's report")
    finally:
        for m in (first, second):
            if m is not None:
                m.stop()
        job.stop()


class _EtcdAway:
    """An etcd of the test's own, on one data dir and ports, that can go away and come back."""

    def __init__(self, tmp_path: Path) -> None:
        self.data, self.client, self.peer = tmp_path / "etcd", free_port(), free_port()
        self.data.mkdir()
        self.url = f"http://127.0.0.1:{self.client}"
        self.proc = start_etcd(self.data, self.client, self.peer)

    def away(self) -> None:
        stop_process(self.proc, grace=5.0)

    def back(self) -> None:
        self.proc = start_etcd(self.data, self.client, self.peer)

    def close(self) -> None:
        stop_process(self.proc, grace=2.0)


def test_a_shard_restarted_while_etcd_is_away_proposes_anew(tmp_path, caplog):
    """etcd goes away, the shard restarts (its finding stands again before etcd is back), etcd
    comes back: the proposal of the shard's earlier run, which the leader would hold forever as
    ``stale_proposal``, is replaced by this run's. etcd being away is logged once, not every
    sweep."""
    import logging

    from tests.support.monitor_sim import SimJob

    caplog.set_level(logging.WARNING, logger="monitor.shard")
    etcd = _EtcdAway(tmp_path)
    url = etcd.url
    job = SimJob(4, ranks_per_group=2)
    prefix = f"/lktest-{uuid.uuid4().hex[:8]}"
    mon = None
    try:
        mon, x, key = _dead_rank_proposed(tmp_path, job, url, prefix)
        mon.stop()
        etcd.away()
        caplog.clear()
        mon = _shard0(tmp_path, job, url, prefix)
        wait_until(lambda: _dead_rank_open(mon, x), 20, what="the dead rank found again")
        n = mon.sweeps
        wait_until(lambda: mon.sweeps >= n + 5, 10, what="more sweeps without etcd")
        away = [r.getMessage() for r in caplog.records if "cannot report" in r.getMessage()]
        assert len(away) == 1, away
        assert mon.cluster_json()["shard"]["error"].endswith("unreachable: ConnectionError")
        etcd.back()
        wait_until(lambda: _proposer(url, key) == mon.url, 20,
                   what="this run's proposal in place of the earlier run's")
        assert any(d["decision"] == "withdrawn" and "earlier run" in d["detail"]
                   for d in requests.get(mon.url + "/v1/evictions", timeout=5).json())
    finally:
        if mon is not None:
            mon.stop()
        job.stop()
        etcd.close()


def test_a_holder_cut_off_from_etcd_past_its_lease_acts_on_nothing_until_etcd_answers(
        tmp_path, caplog):
    """etcd stops answering the shard holding slice 0: once its lease may have lapsed (another
    monitor may hold the slice by then) it says so once and acts on nothing (no abort, no exit,
    no bundle, no proposal); etcd back, it holds and acts again."""
    import logging

    from tests.support.monitor_sim import SimJob

    caplog.set_level(logging.WARNING, logger="monitor.shard")
    etcd = _EtcdAway(tmp_path)
    url = etcd.url
    job = SimJob(4, ranks_per_group=2)
    prefix = f"/lktest-{uuid.uuid4().hex[:8]}"
    mon = None

    def shard() -> dict:
        return mon.cluster_json()["shard"]

    try:
        mon = _shard0(tmp_path, job, url, prefix)
        wait_until(lambda: shard()["acting"], 20, what="the shard holding its slice")
        etcd.away()
        wait_until(lambda: not shard()["acting"], 20, what="the holder standing down")
        assert shard()["error"] and not shard()["standby"]  # not another's: its own lease
        n = mon.sweeps
        wait_until(lambda: mon.sweeps >= n + 5, 10, what="more sweeps without etcd")
        lapsed = [r.getMessage() for r in caplog.records if "may have lapsed" in r.getMessage()]
        assert len(lapsed) == 1, lapsed
        etcd.back()
        wait_until(lambda: shard()["acting"], 20, what="the shard acting again")
    finally:
        if mon is not None:
            mon.stop()
        job.stop()
        etcd.close()


def _etcd_txns(etcd_url: str) -> int:
    """Transactions etcd has served (its own /metrics)."""
    text = requests.get(etcd_url + "/metrics", timeout=5).text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("grpc_server_handled_total{") and 'grpc_method="Txn"' in line)


def test_evictions_a_leader_sent_cost_a_shard_no_txn_a_sweep(tmp_path, etcd):
    """Proposals and eviction records stay in etcd for good; a shard does not try to withdraw
    the proposals a leader acted on every sweep (a failing txn each, growing with every
    eviction the job ever had): its one txn a sweep is its report (written only where the key
    is free or its own)."""
    from monitor.config import MonitorConfig, ShardConfig
    from monitor.service import Monitor

    prefix = f"/lktest-{uuid.uuid4().hex[:8]}"
    root = f"{prefix}/sim/"
    e = Etcd(etcd)
    for g in range(20):
        rid = f"replica_group_{g}:old"
        e.put(root + f"proposals/{rid}", {"replica_group": g, "replica_id": rid,
                                          "kind": "hang", "shard": 0, "run": "earlier"})
        e.put(root + f"evictions/{rid}", {"state": "sent", "replica_id": rid, "shard": 0,
                                          "replica_group": g, "kind": "hang", "attempt": 1})
    e.close()
    mon = Monitor(MonitorConfig(
        port=0, interval_s=0.2, state_path=str(tmp_path / "m.sqlite"),
        sd_out=str(tmp_path / "m.json"), job="sim",
        shard=ShardConfig(shards=1, index=0, etcd=etcd, etcd_prefix=prefix,
                          lease_ttl_s=2))).start()
    try:
        wait_until(lambda: mon.sweeps >= 2, 10, what="the first sweeps")
        n, txns = mon.sweeps, _etcd_txns(etcd)
        wait_until(lambda: mon.sweeps >= n + 10, 15, what="ten more sweeps")
        spent, swept = _etcd_txns(etcd) - txns, mon.sweeps - n
        assert spent <= swept + 2, (spent, swept)  # the report's own txn a sweep, no more
        assert len(keys(etcd, root + "proposals/")) == 20
    finally:
        mon.stop()


# --- a leader in this process: a kill lost in flight, manual proposals -------------------------
def test_a_kill_lost_in_flight_is_sent_again_and_manual_evictions_are_proposals(tmp_path, etcd):
    """A ``sending`` left by a leader that died before its request left (the group still
    heartbeats) is sent again, once, only after the grace, as its (manual) proposal still stands
    (tests/test_shard_rails.py: through the rails); ``POST /v1/evict`` on a shard is a
    proposal (202) for its own groups and a 409 for another shard's, and the leader carries it
    out. Proposals of an earlier run of a shard are never acted on: shard 0 withdraws its own
    (no open finding stands behind them), the leader holds shard 1's as ``stale_proposal``."""
    from monitor.config import DetectorConfig, MonitorConfig, RailsConfig, ShardConfig
    from monitor.lease import SessionLease
    from monitor.service import Monitor
    from tests.support.monitor_sim import SimJob

    job = SimJob(6, heartbeat_timeout_ms=1000)
    prefix = f"/lktest-{uuid.uuid4().hex[:8]}"
    root = f"{prefix}/sim/"
    mine = sorted(g for g in range(6) if shard_of(g, 2) == 0)
    other = next(g for g in range(6) if shard_of(g, 2) == 1)
    assert len(mine) >= 3
    rid = job.replica_ids
    e = Etcd(etcd)
    other_shard = SessionLease(e, 30)  # shard 1 reports once and stays "alive" for the test
    e.put(root + "shards/1", {"shard": 1, "shards": 2, "blind": None, "groups": {},
                              "run": "now"}, other_shard.refresh())
    for g, shard in ((mine[2], 0), (other, 1)):  # left by earlier runs of the shards
        e.put(root + f"proposals/{rid[g]}", {"replica_group": g, "replica_id": rid[g],
                                             "kind": "dead", "shard": shard, "run": "earlier"})
    e.put(root + f"proposals/{rid[mine[1]]}", {"replica_group": mine[1], "replica_id": rid[mine[1]],
                                               "kind": "hang", "shard": 0, "manual": True})
    lost = {"state": "sending", "replica_id": rid[mine[1]], "replica_group": mine[1],
            "kind": "hang", "attempt": 1, "leader": "dead-leader", "at": time.time()}
    e.put(root + f"evictions/{rid[mine[1]]}", lost)
    mon = Monitor(MonitorConfig(
        port=0, interval_s=0.2, state_path=str(tmp_path / "m.sqlite"),
        sd_out=str(tmp_path / "m.json"), job="sim", lighthouse=job.url, targets=job.sim.urls,
        token="t0ken", detectors=DetectorConfig(dead_sweeps=2),
        rails=RailsConfig(min_replicas=1, cooldown_s=0),
        lighthouse_heartbeat_timeout_ms=1000,  # SimJob's: a kill in flight is lost 3 s on
        shard=ShardConfig(shards=2, index=0, etcd=etcd, lead=True, etcd_prefix=prefix,
                          lease_ttl_s=2))).start()
    try:
        wait_until(lambda: mon.cluster_json()["shard"]["leading"], 15, what="leadership")
        led_at = time.time()
        # what an alert reads: etcd answers both roles, this one leads and does not stand by
        def shard_metrics():
            text = requests.get(mon.url + "/metrics", timeout=5).text
            return text if 'role="shard"' in text and "shard_leading{" in text else None

        metrics = wait_until(shard_metrics, 10, what="the shard metrics")
        for line in ('lightkeeper_monitor_shard_etcd_up{job="sim",role="shard"} 1.0',
                     'lightkeeper_monitor_shard_etcd_up{job="sim",role="leader"} 1.0',
                     'lightkeeper_monitor_shard_leading{job="sim"} 1.0',
                     'lightkeeper_monitor_shard_standby{job="sim"} 0.0'):
            assert line in metrics, line
        auth = {"Authorization": "Bearer t0ken"}
        r = requests.post(mon.url + "/v1/evict", json={"replica_group": other}, headers=auth,
                          timeout=5)
        assert r.status_code == 409 and r.json()["reason"] == "other_shard"
        wait_until(lambda: {g["replica_group"] for g in mon.cluster_json()["groups"]}
                   == set(mine) and mon.cluster_json()["groups"][0]["replica_id"], 15,
                   what="shard 0 polling its groups")
        r = requests.post(mon.url + "/v1/evict", json={"replica_group": mine[0],
                                                       "reason": "operator"},
                          headers=auth, timeout=5)
        assert r.status_code == 202 and r.json()["decision"] == "proposed", r.text
        wait_until(lambda: len(job.kills) >= 2, 20, what="the manual eviction and the resend")
        assert sorted(job.kills) == sorted([rid[mine[0]], rid[mine[1]]])
        # the kill is seen by the Lighthouse before the leader records it as sent
        wait_until(lambda: all(keys(etcd, root).get(f"evictions/{rid[g]}", {}).get("value", {})
                               .get("state") == "sent" for g in mine[:2]), 10,
                   what="both evictions recorded as sent")
        k = keys(etcd, root)
        assert f"proposals/{rid[mine[2]]}" not in k  # withdrawn by shard 0
        assert f"evictions/{rid[mine[2]]}" not in k and f"evictions/{rid[other]}" not in k
        ev = requests.get(mon.url + "/v1/evictions", timeout=5).json()
        # (the leader may have read them before shard 0 first reported: then held, as blind)
        stale = [d["decision"] for d in ev if d["replica_id"] == rid[mine[2]]]
        assert "withdrawn" in stale and "evict" not in stale
        stale = [(d["decision"], d["reason"]) for d in ev if d["replica_id"] == rid[other]]
        assert ("hold", "stale_proposal") in stale and {d for d, _ in stale} == {"hold"}
        resent = k[f"evictions/{rid[mine[1]]}"]["value"]
        assert (resent["state"], resent["attempt"]) == ("sent", 2)
        assert resent["at"] - led_at >= 2.0  # not before the grace (3 s)
        assert k[f"proposals/{rid[mine[0]]}"]["value"]["manual"] is True
        assert k[f"evictions/{rid[mine[0]]}"]["value"]["state"] == "sent"
        n = mon.sweeps
        wait_until(lambda: mon.sweeps >= n + 5, 10, what="more sweeps")
        assert len(job.kills) == 2
    finally:
        mon.stop()
        other_shard.revoke()
        e.close()
        job.stop()


def test_min_replicas_holds_across_proposals_decided_in_one_tick(tmp_path, etcd):
    """Two proposals waiting when a leader takes over (cooldown 0, min replicas 2, 3 groups):
    the first is sent, the second held as min_replicas, although the Lighthouse read of that
    tick still shows the first group heartbeating."""
    from monitor.config import MonitorConfig, RailsConfig, ShardConfig
    from monitor.lease import SessionLease
    from monitor.service import Monitor
    from tests.support.monitor_sim import SimJob

    job = SimJob(3)
    prefix = f"/lktest-{uuid.uuid4().hex[:8]}"
    root = f"{prefix}/sim/"
    rid = job.replica_ids
    e = Etcd(etcd)
    shard = SessionLease(e, 30)  # one shard that reports every group, as shard 0 of 1
    e.put(root + "shards/0", {"shard": 0, "shards": 1, "blind": None, "run": "r",
                              "groups": {str(g): rid[g] for g in range(3)}}, shard.refresh())
    for g in (0, 1):
        e.put(root + f"proposals/{rid[g]}", {"replica_group": g, "replica_id": rid[g],
                                             "kind": "hang", "shard": 0, "run": "r"})
    mon = Monitor(MonitorConfig(
        port=0, interval_s=0.2, state_path=str(tmp_path / "m.sqlite"),
        sd_out=str(tmp_path / "m.json"), job="sim", lighthouse=job.url,
        rails=RailsConfig(min_replicas=2, cooldown_s=0, evict_kinds=("hang",)),
        shard=ShardConfig(shards=1, index=None, etcd=etcd, lead=True, etcd_prefix=prefix,
                          lease_ttl_s=2))).start()
    try:
        def held():
            return [d for d in mon.store.decisions() if d["replica_id"] == rid[1]]

        wait_until(held, 15, what="the second proposal decided")
        assert job.kills == [rid[0]]
        assert [(d["decision"], d["reason"]) for d in held()] == [("hold", "min_replicas")]
        assert f"evictions/{rid[1]}" not in keys(etcd, root)
    finally:
        mon.stop()
        shard.revoke()
        e.close()
        job.stop()


def test_a_proposal_of_a_shard_that_does_not_report_is_never_acted_on(tmp_path, etcd):
    """A proposal left by shard 3 of an earlier 4-shard deployment (the job now runs 2 shards,
    both reporting, the leader not blind): no shard holds its evidence, so the leader holds it
    (``stale_proposal``) and kills nothing. A manual eviction asked of the leader names the
    shard to ask."""
    from monitor.config import MonitorConfig, RailsConfig, ShardConfig
    from monitor.lease import SessionLease
    from monitor.service import Monitor
    from tests.support.monitor_sim import SimJob

    job = SimJob(3)
    prefix = f"/lktest-{uuid.uuid4().hex[:8]}"
    root = f"{prefix}/sim/"
    rid = job.replica_ids
    e = Etcd(etcd)
    shards = SessionLease(e, 30)
    for i in (0, 1):
        e.put(root + f"shards/{i}", {"shard": i, "shards": 2, "blind": None, "run": f"r{i}",
                                     "groups": {}}, shards.refresh())
    e.put(root + f"proposals/{rid[1]}", {"replica_group": 1, "replica_id": rid[1],
                                         "kind": "dead_rank", "shard": 3, "run": "old"})
    mon = Monitor(MonitorConfig(
        port=0, interval_s=0.2, state_path=str(tmp_path / "m.sqlite"),
        sd_out=str(tmp_path / "m.json"), job="sim", lighthouse=job.url,
        rails=RailsConfig(min_replicas=1, cooldown_s=0), token="t0ken",
        shard=ShardConfig(shards=2, index=None, etcd=etcd, lead=True, etcd_prefix=prefix,
                          lease_ttl_s=2))).start()
    try:
        r = requests.post(mon.url + "/v1/evict", json={"replica_group": 1}, timeout=5,
                          headers={"Authorization": "Bearer t0ken"})
        assert r.status_code == 409 and r.json()["reason"] == "other_shard", r.text
        assert r.json()["detail"] == (f"replica group 1 belongs to shard {shard_of(1, 2)}, not "
                                      "this leader candidate (it owns none): ask that shard")

        def decided():
            return [(d["decision"], d["reason"]) for d in requests.get(
                mon.url + "/v1/evictions", timeout=5).json() if d["replica_id"] == rid[1]]

        wait_until(decided, 15, what="the leader deciding the proposal")
        n = mon.sweeps
        wait_until(lambda: mon.sweeps >= n + 5, 10, what="more leader ticks")
        assert decided() == [("hold", "stale_proposal")] and job.kills == []
        assert f"evictions/{rid[1]}" not in keys(etcd, root)
    finally:
        mon.stop()
        shards.revoke()
        e.close()
        job.stop()


def test_a_shard_of_another_shard_count_blinds_the_leader(tmp_path, etcd):
    """Shard 1 runs --shard 1/3 beside a leader and shard 0 of --shards 2 (a half-done change of
    N): the slices no longer cover the job, so the leader holds as blind and kills nothing."""
    from monitor.config import MonitorConfig, RailsConfig, ShardConfig
    from monitor.lease import SessionLease
    from monitor.service import Monitor
    from tests.support.monitor_sim import SimJob

    job = SimJob(3)
    prefix = f"/lktest-{uuid.uuid4().hex[:8]}"
    root = f"{prefix}/sim/"
    rid = job.replica_ids
    e = Etcd(etcd)
    shards = SessionLease(e, 30)
    for i, n in ((0, 2), (1, 3)):
        e.put(root + f"shards/{i}", {"shard": i, "shards": n, "blind": None, "run": f"r{i}",
                                     "groups": {}}, shards.refresh())
    g = next(g for g in range(3) if shard_of(g, 2) == 0)
    e.put(root + f"proposals/{rid[g]}", {"replica_group": g, "replica_id": rid[g],
                                         "kind": "dead_rank", "shard": 0, "run": "r0"})
    mon = Monitor(MonitorConfig(
        port=0, interval_s=0.2, state_path=str(tmp_path / "m.sqlite"),
        sd_out=str(tmp_path / "m.json"), job="sim", lighthouse=job.url,
        rails=RailsConfig(min_replicas=1, cooldown_s=0),
        shard=ShardConfig(shards=2, index=None, etcd=etcd, lead=True, etcd_prefix=prefix,
                          lease_ttl_s=2))).start()
    try:
        def decided():
            return [(d["decision"], d["reason"]) for d in requests.get(
                mon.url + "/v1/evictions", timeout=5).json() if d["replica_id"] == rid[g]]

        wait_until(decided, 15, what="the leader deciding the proposal")
        n = mon.sweeps
        wait_until(lambda: mon.sweeps >= n + 5, 10, what="more leader ticks")
        assert decided() == [("hold", "monitor_blind")] and job.kills == []
        assert mon.cluster_json()["shard"]["leader_blind"] == \
            "shard(s) 1 (3) run another --shards than 2"
    finally:
        mon.stop()
        shards.revoke()
        e.close()
        job.stop()


# --- a failed kill, goodput of a leader's kill, a shard that also leads (in this process) -------
class _Lighthouse:
    """The leader's Lighthouse: every heartbeating replica id; kills recorded, failing (no
    connection) while ``down``."""

    def __init__(self, rids) -> None:
        from monitor.evidence.lighthouse_status import LighthouseStatus, QuorumMember

        self.status = LighthouseStatus(
            quorum_id=1, members={r: QuorumMember(r, 100, "store", 1) for r in rids},
            heartbeats=dict.fromkeys(rids, 0.1))
        self.down, self.kills = False, []

    def read(self):
        return self.status, None

    def kill(self, rid):
        from monitor.act.actions import Outcome

        self.kills.append(rid)
        return Outcome(False, None, "Lighthouse unreachable: refused") if self.down \
            else Outcome(True, 200, "killed")


class _Monitor:
    """What Shards and Leader use of a monitor: a real store and metrics; the test's clock and
    open findings, the shard's own rails always passing (the leader applies the real ones)."""

    def __init__(self, etcd_url: str, prefix: str, index: int | None) -> None:
        from types import SimpleNamespace

        from monitor.act.enforcer import Enforcer
        from monitor.api.metrics import MonitorMetrics
        from monitor.config import MonitorConfig, RailsConfig, ShardConfig
        from monitor.store import Store

        self.shard_cfg = ShardConfig(shards=1, index=index, etcd=etcd_url, etcd_prefix=prefix,
                                     lease_ttl_s=5, lead=index is None)
        self.cfg = MonitorConfig(job="sim", lighthouse="http://127.0.0.1:1", interval_s=0.2,
                                 rails=RailsConfig(min_replicas=1, cooldown_s=60),
                                 shard=self.shard_cfg)
        self.store, self.metrics = Store(":memory:"), MonitorMetrics("sim")
        self.now, self.url, self.sweeps = 1000.0, f"http://monitor-{index}", 0
        self.open: dict = {}  # the open findings' keys -> (finding, its store id)
        self.views = SimpleNamespace(changed=[])
        self.detectors = SimpleNamespace(open_findings=lambda: [f for f, _ in
                                                                self.open.values()])
        self.lighthouse_status = None  # the sweep's read: none, so no group is heard gone
        rule = SimpleNamespace(store=self.store, blind=self.blind_reason, cfg=self.cfg)
        self.enforcer = SimpleNamespace(
            decide=self._decide, keep_bundle=lambda *a: None,
            blind_to_kills=lambda *a, **k: Enforcer.blind_to_kills(rule, *a, **k),
            finding_id=lambda key: self.open[key][1])

    def _decide(self, view, evidence, now, rails, evict, blind=None) -> bool:
        """Enforcer.decide's rails for a finding in sight (the quorum: groups 0, 1, 2)."""
        from monitor.act.decisions import Situation, decide

        s = Situation(now=now, groups_in_quorum={0, 1, 2},
                      evicted_replica_ids=self.store.evicted_replica_ids())
        return all(not decide(f.kind, f.replica_group, f.replica_id, s, rails).evict or evict(f)
                   for f, _ in list(self.open.values()))

    def clock(self) -> float:
        return self.now

    def blind_reason(self):
        return None

    def find(self, rid: str):
        from monitor.detect.findings import Finding

        f = Finding("hang", 1, rid, [1], {"culprit_ranks": [1]}, self.now - 5, self.now)
        self.open[f.key] = (f, self.store.add_finding(f.to_dict()))
        return f

    def fid(self, f) -> int:
        return self.open[f.key][1]


def swept(up: int = 1):
    """A sweep's evidence as ``Shards.after_sweep`` reads it: one verified rank known (of group
    1, the findings' group), ``up`` of it reachable (none known is blind; none up, out of
    sight)."""
    from types import SimpleNamespace

    group = SimpleNamespace(replica_id=None, ranks=[1], reachable=[1][:up])
    return SimpleNamespace(evidence_view=None, counts=(1, up, {}), groups={1: group})


@pytest.fixture
def sharded(etcd):
    """Shard 0 of 1 (its monitor ``.mon``) and a leader (``.leader_mon``) on the real etcd, the
    leader's Lighthouse faked; ``sweep()`` is one shard sweep, ``tick()`` one leader tick."""
    from types import SimpleNamespace

    from monitor.shard import Leader, Shards

    prefix = f"/lktest-{uuid.uuid4().hex[:8]}"
    rid = f"replica_group_1:{uuid.uuid4()}"
    h = SimpleNamespace(rid=rid, etcd_url=etcd, root=f"{prefix}/sim/",
                        lighthouse=_Lighthouse([rid, "a", "b"]), mon=_Monitor(etcd, prefix, 0), leader_mon=_Monitor(etcd, prefix, None))
    h.shard = Shards(h.mon.shard_cfg, h.mon)

    def leader_for(mon):  # the leader's own monitor, or the shard's (--shard 0/1 --lead)
        if getattr(h, "leader", None) is not None:
            h.leader.etcd.close()
        h.leader = Leader(h.leader_mon.shard_cfg, mon, h.root)
        h.leader.lighthouse = h.leader.reader = h.lighthouse

    def sweep():
        h.mon.sweeps += 1
        h.shard.after_sweep(SimpleNamespace(ranks={}, groups={}), swept(), h.mon.now)
        assert h.shard.to_json()["error"] is None

    def tick():  # one tick of Leader.run, on this thread: the test orders it with the sweeps
        h.leader_mon.now = h.mon.now
        assert h.leader.election.campaign()
        h.leader.lead_once()

    def etcd_value(kind):
        return keys(etcd, h.root).get(f"{kind}/{rid}", {}).get("value")

    h.leader_for, h.sweep, h.tick, h.etcd_value = leader_for, sweep, tick, etcd_value
    leader_for(h.leader_mon)
    try:
        yield h
    finally:
        h.leader.election.resign()
        h.leader.etcd.close()
        h.shard.stop()
        h.mon.store.close()
        h.leader_mon.store.close()


def _proposed_then_failed(h) -> None:
    h.mon.find(h.rid)
    h.sweep()  # the report first, then the proposal
    h.sweep()
    assert h.etcd_value("proposals")["kind"] == "hang"
    h.lighthouse.down = True
    h.tick()
    assert h.etcd_value("evictions")["state"] == "failed" and h.lighthouse.kills == [h.rid]


def test_a_failed_kill_whose_finding_resolved_is_withdrawn_and_never_sent(sharded):
    """The leader's kill fails (the Lighthouse unreachable); within the cooldown the group
    recovers and its finding resolves: the shard withdraws the proposal, so the leader, past the
    cooldown with the Lighthouse back, kills nothing."""
    h = sharded
    _proposed_then_failed(h)
    h.mon.open.clear()
    h.mon.now += 10
    h.sweep()
    assert h.etcd_value("proposals") is None
    assert [d["decision"] for d in h.mon.store.decisions() if d["replica_id"] == h.rid] == \
        ["withdrawn", "proposed"]
    h.lighthouse.down = False
    h.mon.now += 120
    h.tick()
    h.tick()
    assert h.lighthouse.kills == [h.rid] and h.etcd_value("evictions")["state"] == "failed"


def test_a_failed_manual_kill_is_tried_again_after_the_cooldown_not_every_tick(sharded):
    """A manual eviction skips the cooldown, but the retry of its failed kill is no new request:
    the leader does not send it every tick while the Lighthouse is unreachable."""
    h = sharded
    h.sweep()  # the shard's report
    assert h.shard.propose_manual(1, h.rid, "drain")["decision"] == "proposed"
    h.lighthouse.down = True
    h.tick()
    assert h.lighthouse.kills == [h.rid] and h.etcd_value("evictions")["state"] == "failed"
    for _ in range(3):
        h.mon.now += 5
        h.tick()
    assert h.lighthouse.kills == [h.rid]
    h.lighthouse.down = False
    h.mon.now += 60
    h.tick()
    assert h.lighthouse.kills == [h.rid, h.rid] and h.etcd_value("evictions")["state"] == "sent"


def test_a_shard_restarted_after_a_failed_kill_proposes_anew_and_the_leader_sends(sharded):
    """A kill fails, then the shard restarts (a new run) and finds the fault again: the earlier
    run's proposal (held by the leader as ``stale_proposal``) is replaced by this run's, and the
    leader sends the kill once the cooldown is over."""
    from monitor.shard import Shards

    h = sharded
    _proposed_then_failed(h)
    first = h.etcd_value("proposals")["run"]
    h.shard.stop()
    h.shard = Shards(h.mon.shard_cfg, h.mon)  # its --state kept: the finding stands again
    h.mon.now += 10
    for _ in range(5):  # its report, the earlier run's proposal withdrawn, its own proposal
        h.sweep()
        if (h.etcd_value("proposals") or {}).get("run") not in (None, first):
            break
    assert h.etcd_value("proposals")["run"] != first
    h.lighthouse.down = False
    h.mon.now += 120
    h.tick()
    assert h.lighthouse.kills == [h.rid, h.rid]
    rec = h.etcd_value("evictions")
    assert (rec["state"], rec["attempt"]) == ("sent", 2)


def _incidents(mon, finding, since: float):
    """The goodput incidents of ``mon``'s open ``finding`` and its eviction decisions."""
    from monitor.goodput.columns import Slots
    from monitor.goodput.incidents import Incidents
    from monitor.goodput.model import GoodputConfig
    from tests.support.views import scratch_view

    incs = Incidents(GoodputConfig(), Slots(), lambda i: None)
    incs.ingest_findings(scratch_view(mon.now, {}), [{**finding.to_dict(), "id": mon.fid(finding)}], mon.now, since,
                         GoodputConfig().horizon_s)
    incs.ingest_evictions(mon.store.decisions(decision="evict"), mon.now, since)
    return [(i.kind, i.finding_ids, i.evicted_at) for i in incs.values()]


def test_a_leader_kill_copied_by_its_shard_evicts_the_findings_incident(sharded):
    """A hang proposed and killed by the leader: the shard's copy of the kill names the finding,
    so its goodput ledger has one incident, the hang's, evicted (not a second, manual one)."""
    h = sharded
    f = h.mon.find(h.rid)
    h.sweep()
    h.sweep()
    h.tick()
    assert h.etcd_value("evictions")["state"] == "sent"
    h.mon.now += 1
    h.sweep()
    ev = h.mon.store.decisions(decision="evict")
    assert [(d["status"], d["source"], d["finding_id"]) for d in ev] == \
        [("sent", "leader", h.mon.fid(f))]
    assert _incidents(h.mon, f, 900.0) == [("hang", [h.mon.fid(f)], ev[0]["at"])]


def test_a_shard_that_leads_retries_its_failed_kill_and_confirms_its_own_kills(sharded):
    """``--shard 0/1 --lead``: the leader's rows share the shard's store. A failed kill is no
    eviction (the finding still stands, so the proposal stays and is sent after the cooldown);
    the sent one is copied as the shard's ``sent``, to be confirmed, and is one incident."""
    h = sharded
    h.leader_for(h.mon)
    f = h.mon.find(h.rid)
    h.sweep()
    h.sweep()
    h.lighthouse.down = True
    h.tick()
    assert [d["status"] for d in h.mon.store.decisions(decision="evict")] == ["leader_failed"]
    assert h.rid not in h.mon.store.evicted_replica_ids()
    h.mon.now += 120
    h.sweep()
    assert h.etcd_value("proposals") is not None
    h.lighthouse.down = False
    h.tick()
    assert h.lighthouse.kills == [h.rid, h.rid]
    h.mon.now += 1
    h.sweep()
    assert [(d["status"], d["source"]) for d in h.mon.store.pending_confirmations()] == \
        [("sent", "leader")]
    assert h.rid in h.mon.store.evicted_replica_ids()
    sent = next(d for d in h.mon.store.decisions(decision="evict") if d["status"] == "sent")
    assert _incidents(h.mon, f, 900.0) == [("hang", [h.mon.fid(f)], sent["at"])]


# --- the real thing: shards, a leader, a standby, a SIGKILL mid-kill ---------------------------
def monitor_cmd(tmp_path: Path, name: str, job, etcd_url: str, prefix: str, *extra: str):
    return [sys.executable, "-u", "-m", "lightkeeper.cli", "monitor", "--port", "0",
            "--job", "sim", "--lighthouse", job.url, "--state", str(tmp_path / f"{name}.sqlite"),
            "--sd-out", str(tmp_path / f"{name}.json"), "--targets", ",".join(job.sim.urls),
            "--interval", "0.2", "--dead-sweeps", "2", "--evict-on", "dead,dead_rank",
            "--min-replicas", "1", "--cooldown", "0", "--min-reachable", "0.3",
            "--etcd", etcd_url,
            "--etcd-prefix", prefix, "--lease-ttl", "3",
            "--lighthouse-heartbeat-timeout-ms", "1000", *extra]


@pytest.mark.e2e
def test_leader_killed_mid_kill_standby_takes_over_nothing_sent_twice_nothing_lost(
        tmp_path, etcd):
    from tests.support.monitor_sim import SimJob

    job = SimJob(6, heartbeat_timeout_ms=1000)
    prefix = f"/lktest-{uuid.uuid4().hex[:8]}"
    root = f"{prefix}/sim/"
    procs: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    try:
        def start(name, *extra):
            procs[name], urls[name] = start_monitor_process(
                monitor_cmd(tmp_path, name, job, etcd, prefix, *extra),
                tmp_path / f"{name}.out", tmp_path / f"{name}.log")

        start("leader", "--shards", "2", "--lead")
        wait_until(lambda: "leader" in keys(etcd, root), 30, what="the first leader elected")
        # the other three at once: each start is a monitor's imports, waited for one by one
        with ThreadPoolExecutor(3) as pool:
            for f in [pool.submit(start, *a) for a in (
                    ("standby", "--shards", "2", "--lead"), ("shard0", "--shard", "0/2"),
                    ("shard1", "--shard", "1/2"))]:
                f.result()
        term1 = keys(etcd, root)["leader"]
        assert term1["value"]["monitor"] == urls["leader"]

        def cluster(name):
            return requests.get(urls[name] + "/v1/cluster", timeout=5).json()

        # each shard polls its own groups only, and together they cover the job
        owned = {i: {g for g in range(6) if shard_of(g, 2) == i} for i in (0, 1)}
        assert len(owned[0]) >= 2 and len(owned[1]) >= 3
        for i in (0, 1):
            wait_until(lambda i=i: {g["replica_group"] for g in cluster(f"shard{i}")["groups"]}
                       == owned[i] and f"shards/{i}" in keys(etcd, root), 30,
                       what=f"shard {i} polling and reporting its groups")
        wait_until(lambda: cluster("leader")["shard"]["leader_blind"] is None, 15,
                   what="the leader seeing every shard and the Lighthouse")
        x, y, z = min(owned[0]), *sorted(owned[1])[:2]  # faults in both shards
        rid = job.replica_ids

        # The leader's kill reaches the Lighthouse front: SIGKILL the leader right there (it
        # has written `sending`, it will never write `sent`), fault y while no leader lives,
        # wait for y's proposal, then let the kill land.
        events = {}
        kill_group = job.kill

        def kill_hook(replica_id):
            if "killed_leader" not in events:
                events["killed_leader"] = True
                events["record"] = keys(etcd, root).get(f"evictions/{replica_id}")
                events["killed_at"] = time.time()
                os.kill(procs["leader"].pid, signal.SIGKILL)
                procs["leader"].wait(timeout=10)
                job.sim.group(y)[0].set_mode("down")
                job.alive.discard(y)  # its heartbeats stop too: dead, not only out of sight
                wait_until(lambda: f"proposals/{rid[y]}" in keys(etcd, root), 15,
                           what="the proposal for y, made while no leader lives")
            return kill_group(replica_id)

        job.kill = kill_hook
        job.sim.group(x)[0].set_mode("down")
        job.alive.discard(x)  # its heartbeats stop too: dead, not only out of sight
        wait_until(lambda: len(job.kills) >= 2, 30, what="both evictions carried out")
        # the standby took over and carried out y's proposal; x was killed once
        assert job.kills == [rid[x], rid[y]]
        assert events["record"]["value"]["state"] == "sending"
        k = keys(etcd, root)
        term2 = k["leader"]
        assert term2["value"]["monitor"] == urls["standby"]
        assert term2["create_revision"] > term1["create_revision"]
        takeover_s = term2["value"]["since"] - events["killed_at"]
        print(f"standby took over {takeover_s:.2f}s after the SIGKILL (lease TTL 3 s)")
        # the TTL, plus etcd's expiry sweep (500 ms) and one candidate tick, plus load
        assert takeover_s < 3 + 2.5
        # y was proposed after the old leader died and before the standby led
        assert k[f"proposals/{rid[y]}"]["create_revision"] < term2["create_revision"]
        assert k[f"proposals/{rid[y]}"]["value"]["shard"] == shard_of(y, 2)
        # the kill reaches the Lighthouse before the leader records it as sent
        wait_until(lambda: all(keys(etcd, root)[f"evictions/{rid[g]}"]["value"]["state"]
                               == "sent" for g in (x, y)), 15,
                   what="x's in-flight eviction resolved and y's recorded")
        k = keys(etcd, root)
        ex, ey = k[f"evictions/{rid[x]}"]["value"], k[f"evictions/{rid[y]}"]["value"]
        assert ex["attempt"] == 1 and ex["leader"] == term1["value"]["id"]
        assert ex["resolved_by"] == term2["value"]["id"] and "not sent again" in ex["detail"]
        assert (ey["state"], ey["attempt"], ey["leader"]) == ("sent", 1, term2["value"]["id"])
        # each proposing shard kept the group's incident bundle before it proposed
        for g in (x, y):
            shard = f"shard{shard_of(g, 2)}"
            got = requests.get(urls[shard] + "/v1/incidents", timeout=5).json()["bundles"]
            assert [b["trigger"] for b in got if b["replica_id"] == rid[g]] == ["evict"], got
        # the standby's audit log says the same; a few more leader ticks send nothing more
        ev = requests.get(urls["standby"] + "/v1/evictions", timeout=5).json()
        assert sorted((d["replica_id"], d["status"]) for d in ev
                      if d["decision"] == "evict") == sorted(
            [(rid[x], "leader_resolved"), (rid[y], "leader_sent")])
        ticks = cluster("standby")["sweeps"]
        wait_until(lambda: cluster("standby")["sweeps"] >= ticks + 5, 15, what="more sweeps")
        assert job.kills == [rid[x], rid[y]]
        # each owning shard copied its kill and saw its group leave (confirmed)
        for i, g in ((0, x), (1, y)):
            wait_until(lambda i=i, g=g: [(d["status"], d["source"]) for d in requests.get(
                urls[f"shard{i}"] + "/v1/evictions?decision=evict", timeout=5).json()
                if d["replica_id"] == rid[g]] == [("confirmed", "leader")], 15,
                what=f"shard {i} confirming the leader's kill of group {g}")

        # a shard gone (a clean stop revokes its report's lease) blinds the leader: a fault in
        # the other shard is proposed and held, never sent
        stop_process(procs.pop("shard0"), grace=5.0)
        job.sim.group(z)[0].set_mode("down")
        job.alive.discard(z)  # its heartbeats stop too: dead, not only out of sight
        wait_until(lambda: f"proposals/{rid[z]}" in keys(etcd, root), 15,
                   what="the proposal for z")

        def holds():
            return [d for d in requests.get(urls["standby"] + "/v1/evictions",
                                            timeout=5).json()
                    if d["replica_id"] == rid[z] and d["decision"] == "hold"]

        wait_until(holds, 15, what="the leader holding z")
        assert holds()[0]["reason"] == "monitor_blind" and "shard(s) 0 of 2" in \
            holds()[0]["detail"]
        ticks = cluster("standby")["sweeps"]
        wait_until(lambda: cluster("standby")["sweeps"] >= ticks + 5, 15, what="more sweeps")
        assert job.kills == [rid[x], rid[y]] and f"evictions/{rid[z]}" not in keys(etcd, root)
    finally:
        for p in procs.values():
            stop_process(p, grace=2.0)
        job.stop()


# --- Prometheus sharded by the same hash (docs/scaling.md) -------------------------------------
def doc_blocks() -> dict[str, str]:
    """The YAML blocks of docs/scaling.md named by their first line (``# name.yml: ...``)."""
    text = (ROOT / "docs" / "scaling.md").read_text()
    return {m.group(1): m.group(0)[len("```yaml\n"):-len("```")]
            for m in re.finditer(r"```yaml\n# (shard-[a-z]+\.yml):.*?```", text, re.S)}


def write_doc_config(tmp_path: Path, groups: int) -> Path:
    blocks = doc_blocks()
    assert set(blocks) == {"shard-prometheus.yml", "shard-rules.yml"}
    for name, text in blocks.items():
        (tmp_path / name).write_text(text)
    # loaded beside shard-rules.yml: together they must not record a series twice
    shutil.copy(ROOT / "dashboards" / "prometheus" / "rules.yml", tmp_path / "rules.yml")
    (tmp_path / "file_sd").mkdir()
    (tmp_path / "file_sd" / "ranks.json").write_text(json.dumps([
        {"targets": [f"127.0.0.1:{20000 + g}"],
         "labels": {"job": "sim", "replica_group": str(g), "rank": str(g)}}
        for g in range(groups)]))
    return tmp_path / "shard-prometheus.yml"


def test_documented_shard_config_passes_promtool(tmp_path):
    exe = require_binary("promtool")
    config = write_doc_config(tmp_path, 4)
    r = subprocess.run([exe, "check", "config", str(config)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "shard-rules.yml" in r.stdout and "2 rules found" in r.stdout
    assert "rules.yml" in r.stdout
    recorded = re.findall(r"record: '?([a-z_:0-9]+)", (tmp_path / "rules.yml").read_text()
                          + (tmp_path / "shard-rules.yml").read_text())
    assert len(recorded) == len(set(recorded)), recorded


def test_documented_prometheus_shard_keeps_the_monitor_shards_groups(tmp_path):
    """A real Prometheus with the documented config (shard 0 of 2) keeps exactly the targets
    of the groups monitor shard 0/2 owns: the same hash."""
    require_binary("prometheus")
    from tests.support.prometheus import start

    config = write_doc_config(tmp_path, 12)
    want = {g for g in range(12) if shard_of(g, 2) == 0}
    assert 0 < len(want) < 12
    with start(config, tmp_path / "prom") as prom:
        def kept():
            active = [t for t in prom.api("targets", state="active")["activeTargets"]
                      if t["scrapePool"] == "lightkeeper-workers"]
            return len(active) + len(prom.api("targets", state="dropped")["droppedTargets"]) \
                == 12 and {int(t["labels"]["replica_group"]) for t in active}

        assert wait_until(kept, 30, what="Prometheus to load the file_sd targets") == want


def test_a_leader_renews_its_lease_between_slow_kills(sharded):
    """Kills that each take most of the kill timeout, several in one tick: the leader renewed
    only at the tick's start, its lease lapsed mid-tick and the later kills waited (refused by
    etcd's guard) while a standby could take over. It now renews between kills."""
    import dataclasses
    import time as _time

    h = sharded
    rids = [h.rid, "a", "b"]
    h.leader_mon.shard_cfg = dataclasses.replace(h.leader_mon.shard_cfg, lease_ttl_s=2)
    h.leader_mon.cfg = dataclasses.replace(h.leader_mon.cfg, rails=dataclasses.replace(
        h.leader_mon.cfg.rails, min_replicas=0, cooldown_s=0))
    h.leader_for(h.leader_mon)
    kill = h.lighthouse.kill

    def slow_kill(rid):  # 0.9 s each: three outlast the 2 s lease
        _time.sleep(0.9)
        return kill(rid)

    h.lighthouse.kill = slow_kill
    for rid in rids:
        h.mon.find(rid)
    h.sweep()
    h.sweep()
    h.tick()
    assert sorted(h.lighthouse.kills) == sorted(rids)
    states = {k: v["value"]["state"] for k, v in keys(h.etcd_url, h.root).items()
              if k.startswith("evictions/")}
    assert sorted(states.values()) == ["sent"] * 3, states
    assert h.leader.election.valid() and h.leader.election.campaign()


def test_a_shard_waits_a_third_of_the_lease_before_asking_a_hung_etcd_again(tmp_path):
    """An etcd that accepts and never answers cost every sweep its 2 s timeout (sweeps 3 s
    apart): after a failure the shard asks again only after a third of the lease TTL."""
    import socket
    import threading
    from types import SimpleNamespace

    from monitor.shard import Shards

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    accepted, conns = [], []

    def accept():
        while True:
            try:
                conns.append(hole.accept()[0])
            except OSError:
                return
            accepted.append(1)

    threading.Thread(target=accept, daemon=True).start()
    mon = _Monitor(f"http://127.0.0.1:{hole.getsockname()[1]}", "/lk", 0)
    shard = Shards(mon.shard_cfg, mon)  # lease TTL 5 s
    view = SimpleNamespace(ranks={}, groups={})
    evidence = swept()
    try:
        shard.after_sweep(view, evidence, mon.now)
        assert shard.to_json()["error"] and len(accepted) == 1
        for _ in range(3):  # the next sweeps
            shard.after_sweep(view, evidence, mon.now)
        # ... and the survivors' second vantage point in those sweeps does not ask it either
        assert shard.reported_elsewhere() == (set(), False)
        assert len(accepted) == 1 and shard.to_json()["error"]
        from prometheus_client import generate_latest

        assert 'lightkeeper_monitor_shard_etcd_up{job="sim",role="shard"} 0.0' in \
            generate_latest(mon.metrics.registry).decode()
    finally:
        hole.close()
        for c in conns:
            c.close()
        shard.etcd.close()
        mon.store.close()


def test_a_shard_reads_what_the_other_shards_ranks_answer_as(etcd):
    """The second vantage point for a group of another slice the Lighthouse no longer hears
    (monitor.act.survivors): the other shards' reports, on the real etcd."""
    from types import SimpleNamespace

    from monitor.shard import Shards

    prefix = f"/lktest-{uuid.uuid4().hex[:8]}"
    mons = [_Monitor(etcd, prefix, i) for i in (0, 1)]
    shards = []
    for m in mons:
        m.shard_cfg = dataclasses.replace(m.shard_cfg, shards=2)
        shards.append(Shards(m.shard_cfg, m))
    ranks = {1: [SimpleNamespace(replica_id="replica_group_1:x"),
                 SimpleNamespace(replica_id=None)]}

    def sweep(i: int, reachable: int = 1) -> None:
        groups = {g: SimpleNamespace(reported_replica_ids=frozenset(r.replica_id for r in rs))
                  for g, rs in ranks.items()} if i == 1 else {}
        polled = {"http://127.0.0.1:1": None}  # its slice has ranks
        shards[i].after_sweep(SimpleNamespace(ranks=polled, groups=groups), swept(reachable),
                              mons[i].now)
        assert shards[i].to_json()["error"] is None

    try:
        sweep(0)
        assert shards[0].reported_elsewhere() == (set(), False)  # shard 1 has not said yet
        sweep(1)
        assert shards[0].reported_elsewhere() == ({"replica_group_1:x"}, True)
        assert shards[1].reported_elsewhere() == (set(), True)
        ranks[1] = []  # its ranks no longer answer
        sweep(1)
        assert shards[0].reported_elsewhere() == (set(), True)
        sweep(1, reachable=0)  # blind: cut off from its slice, it vouches for nothing
        assert shards[0].reported_elsewhere() == (set(), False)
    finally:
        for s, m in zip(shards, mons, strict=True):
            s.stop()
            m.store.close()


def test_an_etcd_that_answers_an_error_at_once_is_asked_again_next_sweep():
    """Only a hang is waited out: an error answered at once (etcd's own leader election, a 5xx)
    is asked again the next sweep, else a shard with --interval near a third of --lease-ttl
    could let its lease lapse waiting."""
    from types import SimpleNamespace

    from monitor.shard import Shards
    from tests.support.http_stub import HttpStub

    etcd = HttpStub({"POST": (503, b"{}")})
    mon = _Monitor(etcd.url, "/lk", 0)
    shard = Shards(mon.shard_cfg, mon)
    try:
        for _ in range(2):
            shard.after_sweep(SimpleNamespace(ranks={}, groups={}), swept(), mon.now)
            assert "HTTP 503" in (shard.to_json()["error"] or "")
        asked = [r.target for r in etcd.requests]
        assert len(asked) == 2, asked
    finally:
        etcd.close()
        shard.etcd.close()
        mon.store.close()
