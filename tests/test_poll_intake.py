"""What the monitor takes in as a target (monitor/poll/discovery.py, admission.py's
Registrations): refusals logged within bounds (an unauthorized one by its
caller's address), https refused up front (a file's other entries kept), another job's rank never
counted as this job's (and said), a rank restarted under --job watched, a dual-stack name polled
at its IPv4 address."""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket

import pytest
import requests

from http_serving import BackgroundWSGIServer
from monitor.api.app import create_app
from monitor.config import BundleConfig, ConfigError, MonitorConfig
from monitor.poll.admission import (
    REFUSAL_EVERY_S,
    REFUSALS_SAID,
    AllowList,
    NotAllowed,
    Unauthorized,
)
from monitor.poll.discovery import BadTarget, Discovery
from monitor.service import Monitor
from monitor.startup import check_config
from tests.support.monitor_sim import SimRanks

TOKEN = "s3cret-intake"


def _hello(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"hello"]


class FakeClock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def monitor(tmp_path, clock=None, **kw) -> Monitor:
    kw.setdefault("job", "A")
    return Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "state.sqlite"),
                                 sd_out=str(tmp_path / "targets.json"),
                                 bundles=BundleConfig(enabled=False), **kw), clock=clock)


def refusal_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "monitor.poll.admission" and "refus" in r.getMessage()]


# --- the refusal log: bounded whatever the callers send -----------------------------------
def test_refusals_of_new_urls_each_time_are_logged_within_a_bound(tmp_path, caplog):
    """Before: each refused URL went into the set of those said (and a log line) until the
    10-minute window rolled: a client with no token could grow both without limit."""
    clock = FakeClock()
    mon = monitor(tmp_path, clock)
    n = 10 * REFUSALS_SAID
    try:
        with caplog.at_level(logging.INFO, logger="monitor.poll.admission"):
            for i in range(n):  # outside --allow-targets (IP literals: no DNS asked)
                with pytest.raises(NotAllowed):
                    mon.register_target({"url": f"10.{i >> 8 & 255}.{i & 255}.1:80"}, None)
            lines = refusal_lines(caplog)
            assert len(lines) == REFUSALS_SAID + 1, len(lines)
            assert "further refusals not logged until" in lines[-1]
            # the next window says them again
            clock.now += REFUSAL_EVERY_S
            caplog.clear()
            with pytest.raises(NotAllowed):
                mon.register_target({"url": "10.0.0.1:80"}, None)
            assert len(refusal_lines(caplog)) == 1
        text = create_app(mon).test_client().get("/metrics").get_data(as_text=True)
        assert f'lightkeeper_monitor_registrations_total{{job="A",outcome="not_allowed"}} ' \
            f'{n + 1}.0' in text  # every one counted
    finally:
        mon.stop()


def test_unauthorized_registrations_are_said_once_whatever_url_they_claim(tmp_path, caplog):
    mon = monitor(tmp_path, FakeClock(), token=TOKEN)
    try:
        with caplog.at_level(logging.INFO, logger="monitor.poll.admission"):
            for i in range(50):
                with pytest.raises(Unauthorized):
                    mon.register_target({"url": f"10.0.{i}.1:80"}, "Bearer wrong")
        assert len(refusal_lines(caplog)) == 1
        assert TOKEN not in caplog.text
    finally:
        mon.stop()


# --- https: never polled, so never accepted ---------------------------------------------------
def test_https_targets_are_refused_wherever_they_come_from(tmp_path):
    """Before: accepted (registered: true, a clean start, __scheme__ https in --sd-out), then
    every poll failed "unsupported target URL": a rank silently never watched."""
    d = Discovery(job="A")
    with pytest.raises(BadTarget, match="https is not supported"):
        d.register({"url": "https://127.0.0.1:1"})
    assert d.targets() == []
    with pytest.raises(ConfigError, match="https is not supported"):
        check_config(MonitorConfig(targets=["https://h:1"], state_path=str(tmp_path / "s.db")))
    sd = tmp_path / "in.json"
    sd.write_text(json.dumps([{"targets": ["h:1"], "labels": {"__scheme__": "https"}}]))
    d = Discovery(targets_file=str(sd), job="A")
    assert "https is not supported" in (d.refresh() or "")
    assert d.targets() == []


# --- another job's rank -----------------------------------------------------------------------
def test_a_rank_of_another_job_is_not_taken_for_this_jobs(tmp_path):
    """A --targets-file without job labels, or a registration without a job, may name another
    job's rank: before, its first answer ("job": "sim" here) was never compared with --job, and
    it sat in this job's groups and --sd-out. A --targets entry the operator named is polled."""
    sim = SimRanks.start(3)  # their /v1/state: "job": "sim"
    listed, registered, named = sim.urls
    sd = tmp_path / "in.json"
    sd.write_text(json.dumps([{"targets": [listed.split("://")[1]]}]))
    mon = monitor(tmp_path, job="A", targets_file=str(sd), targets=[named])
    try:
        mon.register_target({"url": registered}, None)  # loopback: allowed, no job said
        mon.sweep_once()
        ranks = {r["url"]: r for r in
                 create_app(mon).test_client().get("/v1/ranks").get_json()}
        for url in (listed, registered):
            assert (ranks[url]["reachable"], ranks[url]["reason"]) == (False, "bad_response")
            assert "job 'sim'" in ranks[url]["error"] and "--job 'A'" in ranks[url]["error"]
        assert ranks[named]["reachable"] is True
        written = json.loads((tmp_path / "targets.json").read_text())
        assert [g["targets"] for g in written] == [[named.split("://")[1]]]
        # the same ranks under a monitor of their own job: counted, written
        sim.ranks[0].update(job="A")
        mon.sweep_once()
        written = json.loads((tmp_path / "targets.json").read_text())
        assert sorted(g["targets"][0] for g in written) == sorted(
            u.split("://")[1] for u in (listed, named))
    finally:
        mon.stop()
        sim.stop()


# --- a dual-stack name ------------------------------------------------------------------------
def test_a_dual_stack_name_is_polled_at_its_ipv4_address():
    """Before: at the resolver's first address, glibc's IPv6 one, which a WorkerServer on
    0.0.0.0 does not listen on; several: the lowest, so round-robin DNS moves nothing."""
    answers = {"trainer": ["2001:db8::5", "10.0.0.5"],
               "rr": ["10.0.0.9", "10.0.0.3", "2001:db8::1"],
               "v6": ["2001:db8::9", "2001:db8::2"]}
    allow = AllowList.parse(["10.0.0.0/8", "2001:db8::/32"],
                            resolver=lambda h: [ipaddress.ip_address(a) for a in answers[h]])
    assert allow.admit("http://trainer:9500") == "http://10.0.0.5:9500"
    assert allow.admit("http://rr:9500/p") == "http://10.0.0.3:9500/p"
    assert allow.admit("http://v6:9500") == "http://[2001:db8::2]:9500"


def dead_findings(mon, open_only: bool = False) -> list[dict]:
    got = create_app(mon).test_client().get("/v1/findings").get_json()
    return [f for f in got if f["kind"] in ("dead", "dead_rank") and (f["open"] or not open_only)]


@pytest.mark.parametrize("renamed", ["A", "other"])
def test_a_listed_rank_restarted_under_another_job_name_is_watched(tmp_path, renamed):
    """Before: its last state (kept in --state too) named the job it answered as first ('sim',
    a rank started without LIGHTKEEPER_JOB): restarted under the monitor's --job ('A') or any
    other name (llama-v1 as llama-v2), it was refused as "a rank of job ... answers at its
    address", confirmed dead and left out of --sd-out, by a restarted monitor too."""
    sim = SimRanks.start(2)  # their /v1/state: "job": "sim"
    live, dark = sim.urls
    mon = monitor(tmp_path, job="A", targets=[live, dark])
    try:
        mon.sweep_once()
        sim.ranks[0].update(job=renamed)  # restarted under another name, watched meanwhile
        for _ in range(3):
            mon.sweep_once()
        ranks = {r["url"]: r for r in create_app(mon).test_client().get("/v1/ranks").get_json()}
        assert ranks[live]["reachable"] is True, ranks[live]["error"]
        assert dead_findings(mon) == []
        written = json.loads((tmp_path / "targets.json").read_text())
        assert live.split("://")[1] in [g["targets"][0] for g in written]
        sim.ranks[1].set_mode("down")  # the other goes dark as 'sim': kept so in --state
        mon.sweep_once()
    finally:
        mon.stop()
    sim.ranks[1].update(job=renamed)
    sim.ranks[1].set_mode("ok")
    mon = monitor(tmp_path, job="A", targets=[live, dark])  # restarted on the same state
    try:
        for _ in range(3):
            mon.sweep_once()
        ranks = {r["url"]: r for r in create_app(mon).test_client().get("/v1/ranks").get_json()}
        assert all(r["reachable"] for r in ranks.values()), ranks
        assert dead_findings(mon, open_only=True) == []
        # another job's rank of another group on that port is a stranger (port reuse), as before
        sim.ranks[0].update(job="beta", replica_group=7)
        mon.sweep_once()
        ranks = {r["url"]: r for r in create_app(mon).test_client().get("/v1/ranks").get_json()}
        assert (ranks[live]["reachable"], ranks[live]["reason"]) == (False, "bad_response")
        assert "a rank of job 'beta'" in ranks[live]["error"]
    finally:
        mon.stop()
        sim.stop()


def test_another_jobs_rank_in_an_unlabelled_targets_file_is_said_once_a_job(tmp_path, caplog):
    """Before: unreachable (bad_response) in /v1/ranks only, with no log line, where a labelled
    file or a registration of another job is said."""
    sim = SimRanks.start(3)  # "job": "sim"
    sim.ranks[2].update(job="other")
    sd = tmp_path / "in.json"
    sd.write_text(json.dumps([{"targets": [u.split("://")[1] for u in sim.urls[:2]]}]))
    mon = monitor(tmp_path, job="llama", targets_file=str(sd))
    try:
        with caplog.at_level(logging.WARNING, logger="monitor.poll.discovery"):
            mon.register_target({"url": sim.urls[2]}, None)  # no job said: registered
            for _ in range(4):
                mon.sweep_once()
        said = [r.getMessage() for r in caplog.records if "not watched" in r.getMessage()]
        assert len(said) == 2, said
        by_file = [m for m in said if "'sim'" in m]
        assert len(by_file) == 1 and f"targets file {sd}" in by_file[0], said
        assert "not --job 'llama'" in by_file[0]
        by_reg = [m for m in said if "'other'" in m]
        assert len(by_reg) == 1 and f"registered rank {sim.urls[2]}" in by_reg[0], said
    finally:
        mon.stop()
        sim.stop()


# --- a file one entry of which cannot be read -------------------------------------------------
def test_restore_skips_an_https_entry_of_an_older_sd_out_and_says_so(tmp_path, caplog):
    """Before: an older monitor's __scheme__ https entry raised, and restore returned with no
    line: none of the registered targets came back (the next write then replaced them)."""
    path = tmp_path / "sd.json"
    path.write_text(json.dumps([
        {"targets": ["10.0.0.5:9500"], "labels": {"lightkeeper_source": "registered",
                                                  "job": "j", "replica_group": "0"}},
        {"targets": ["10.0.0.9:9443"], "labels": {"lightkeeper_source": "registered",
                                                  "job": "j", "__scheme__": "https"}},
        {"targets": ["10.0.0.6:9500"], "labels": {"lightkeeper_source": "registered",
                                                  "job": "j", "replica_group": "1"}}]))
    d = Discovery(job="j")
    with caplog.at_level(logging.WARNING, logger="monitor.poll.discovery"):
        d.restore(str(path))
    assert sorted(t.url for t in d.targets()) == ["http://10.0.0.5:9500", "http://10.0.0.6:9500"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "https://10.0.0.9:9443" in lines[0], lines
    assert "https is not supported" in lines[0] and str(path) in lines[0]


def test_a_targets_file_with_one_https_group_keeps_its_http_targets(tmp_path, caplog):
    """Before: the whole file was refused (its targets unwatched) for one group."""
    sd = tmp_path / "in.json"
    sd.write_text(json.dumps([{"targets": ["10.0.0.5:9500", "10.0.0.6:9500"]},
                              {"targets": ["10.0.0.9:9443"], "labels": {"__scheme__": "https"}},
                              {"targets": [7]}]))
    d = Discovery(targets_file=str(sd), job="A")
    with caplog.at_level(logging.WARNING, logger="monitor.poll.discovery"):
        assert d.refresh() is None
        assert d.refresh() is None  # unchanged: not read, nor said, again
    assert sorted(t.url for t in d.targets()) == ["http://10.0.0.5:9500", "http://10.0.0.6:9500"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and str(sd) in lines[0], lines
    assert "'https://10.0.0.9:9443': https is not supported" in lines[0]
    assert "7 is not a string" in lines[0] and "2 left out" in lines[0]


def test_a_targets_file_rewritten_alike_says_its_unusable_entries_once(tmp_path, caplog):
    """Before: each rewrite (a generator's timer: same content, new mtime) was read afresh and
    its one unusable entry warned of again, forever."""
    sd = tmp_path / "in.json"
    d = Discovery(targets_file=str(sd), job="A")
    groups = [{"targets": ["10.0.0.5:9500"]},
              {"targets": ["10.0.0.9:9443"], "labels": {"__scheme__": "https"}}]
    with caplog.at_level(logging.WARNING, logger="monitor.poll.discovery"):
        for i in range(3):
            sd.write_text(json.dumps(groups))
            os.utime(sd, (1_800_000_000 + i, 1_800_000_000 + i))  # a new mtime each time
            assert d.refresh() is None
        assert [t.url for t in d.targets()] == ["http://10.0.0.5:9500"]
        assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
        groups[1]["targets"] = ["10.0.0.8:9443"]  # another entry left out: said
        sd.write_text(json.dumps(groups))
        os.utime(sd, (1_800_000_010, 1_800_000_010))
        assert d.refresh() is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "https://10.0.0.8:9443" in lines[1], lines


# --- unauthorized callers, by address ---------------------------------------------------------
def test_unauthorized_registrations_are_said_once_for_each_address_they_come_from(tmp_path,
                                                                                  caplog):
    """Before: keyed on the outcome alone, the first caller in a window was the only one said
    (a scanner's claim, say), and a real rank left with a stale token went unsaid; no line
    named where a caller was."""
    mon = monitor(tmp_path, FakeClock(), token=TOKEN)
    c = create_app(mon).test_client()
    try:
        with caplog.at_level(logging.INFO, logger="monitor.poll.admission"):
            for i in range(20):  # a flood from one address
                r = c.post("/v1/targets", json={"url": f"http://10.0.{i}.1:80"},
                           headers={"Authorization": "Bearer stale"},
                           environ_base={"REMOTE_ADDR": "192.0.2.7"})
                assert r.status_code == 401
            r = c.post("/v1/targets", json={"url": "http://10.1.0.1:80"},
                       environ_base={"REMOTE_ADDR": "198.51.100.9"})
            assert r.status_code == 401
        lines = refusal_lines(caplog)
        assert len(lines) == 2, lines
        assert "from 192.0.2.7" in lines[0] and "from 198.51.100.9" in lines[1], lines
        assert "stale" not in caplog.text and TOKEN not in caplog.text
    finally:
        mon.stop()


def _dual_stack() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind(("::", 0))
        return True
    except (OSError, AttributeError):
        return False


@pytest.mark.skipif(not _dual_stack(), reason="no dual-stack IPv6 on this host")
def test_a_rank_on_the_ipv6_wildcard_is_reachable_at_the_address_admitted():
    """A dual-stack name admitted through --allow-targets is polled at its IPv4 address; a
    WorkerServer on :: heard IPv6 only, so that rank was refused at every poll."""
    server = BackgroundWSGIServer(_hello, host="::", port=0).start()
    try:
        allow = AllowList.parse(["127.0.0.0/8", "::1/128"], resolver=lambda h: [
            ipaddress.ip_address("::1"), ipaddress.ip_address("127.0.0.1")])
        url = allow.admit(f"http://trainer:{server.port}")
        assert url == f"http://127.0.0.1:{server.port}"
        assert requests.get(url + "/", timeout=5).text == "hello"
    finally:
        server.stop()
