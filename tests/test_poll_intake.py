"""What the monitor takes in as a target (monitor/poll/discovery.py, admission.py,
monitor/service.py's register_target): refusals logged within bounds, https refused up front,
another job's rank never counted as this job's, a dual-stack name polled at its IPv4 address."""

from __future__ import annotations

import ipaddress
import json
import logging

import pytest

from monitor.api.app import create_app
from monitor.config import BundleConfig, ConfigError, MonitorConfig
from monitor.poll.admission import AllowList, NotAllowed, Unauthorized
from monitor.poll.discovery import BadTarget, Discovery
from monitor.service import REFUSAL_EVERY_S, REFUSALS_SAID, Monitor
from monitor.startup import check_config
from tests.support.monitor_sim import SimRanks

TOKEN = "s3cret-intake"


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
            if r.name == "monitor.service" and "refus" in r.getMessage()]


# --- the refusal log: bounded whatever the callers send -----------------------------------
def test_refusals_of_new_urls_each_time_are_logged_within_a_bound(tmp_path, caplog):
    """Before: each refused URL went into the set of those said (and a log line) until the
    10-minute window rolled: a client with no token could grow both without limit."""
    clock = FakeClock()
    mon = monitor(tmp_path, clock)
    n = 10 * REFUSALS_SAID
    try:
        with caplog.at_level(logging.INFO, logger="monitor.service"):
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
        with caplog.at_level(logging.INFO, logger="monitor.service"):
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
