"""IPv6 literals in ``http://host:port``: bracketed where URLs are built (the WorkerServer's own
URL, which it registers; the monitor's; the targets it polls, their ``Host`` header), parsed back
unbracketed where sockets take them. The pure rules first; then a rank and a monitor really
serving on ``::1`` (skipped, with the reason, where the box has no IPv6 loopback).
"""

from __future__ import annotations

import socket

import pytest
import requests

from http_serving import host_for_url, http_url, split_host_port
from lightkeeper.processes import free_port, wait_until
from monitor.api.views import ranks_json
from monitor.poll.admission import AllowList
from monitor.poll.discovery import BadTarget, normalize_url
from monitor.poll.http11 import _split


@pytest.mark.parametrize(("host", "shown"), [
    ("::1", "[::1]"), ("2001:db8::7", "[2001:db8::7]"), ("fe80::1%eth0", "[fe80::1%25eth0]"),
    ("[::1]", "[::1]"), ("127.0.0.1", "127.0.0.1"), ("trainer-3.example", "trainer-3.example"),
    ("::ffff:10.0.0.1", "[::ffff:10.0.0.1]"),
])
def test_ipv6_literals_are_bracketed_and_nothing_else_is(host, shown):
    assert host_for_url(host) == shown
    assert http_url(host, 9400) == f"http://{shown}:9400"


@pytest.mark.parametrize(("address", "parsed"), [
    ("[::1]:9400", ("::1", 9400)), ("http://[::1]:9400/v1/state", ("::1", 9400)),
    ("http://[2001:db8::7]:80", ("2001:db8::7", 80)), ("127.0.0.1:1", ("127.0.0.1", 1)),
    ("https://trainer-3.example:9500", ("trainer-3.example", 9500)),
    ("http://[fe80::1%25eth0]:9500", ("fe80::1%eth0", 9500)),
])
def test_addresses_parse_back_to_what_sockets_take(address, parsed):
    assert split_host_port(address) == parsed
    host, port = parsed
    assert split_host_port(http_url(host, port)) == parsed  # a round trip


@pytest.mark.parametrize(("address", "why"), [
    ("::1:9400", "needs brackets"), ("http://2001:db8::7:80", "needs brackets"),
    ("[::1]", "expected host:port"), ("[::1]:99999", "bad port"), ("host:port", "bad port"),
])
def test_unparseable_addresses_say_why(address, why):
    with pytest.raises(ValueError, match=why):
        split_host_port(address)


def test_targets_keep_their_brackets_and_the_poller_connects_without():
    assert normalize_url("[::1]:9500") == "http://[::1]:9500"
    assert normalize_url("http://[2001:DB8::7]:9500/") == "http://[2001:db8::7]:9500"
    with pytest.raises(BadTarget, match="needs brackets"):
        normalize_url("::1:9500")
    with pytest.raises(BadTarget):
        normalize_url("http://[::1:9500")  # unbalanced: a 400, never a crash
    assert _split("http://[::1]:9500/prefix") == ("::1", 9500, "/prefix")
    assert _split("http://[fe80::1%25eth0]:9500") == ("fe80::1%eth0", 9500, "")
    # a static target on an IPv6 address allows registrations from it without a token
    allow = AllowList.default(["[2001:db8::7]:9500"])
    assert allow.admit("http://[2001:db8::7]:9501") == "http://[2001:db8::7]:9501"


def _has_ipv6_loopback() -> str | None:
    """None when ::1 can be bound and reached, else why not."""
    if not socket.has_ipv6:
        return "Python was built without IPv6"
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            s.listen(1)
            with socket.create_connection(s.getsockname()[:2], timeout=2):
                pass
    except OSError as e:
        return f"no IPv6 loopback here: {e}"
    return None


NO_IPV6 = _has_ipv6_loopback()


@pytest.mark.skipif(NO_IPV6 is not None, reason=str(NO_IPV6))
def test_rank_and_monitor_serve_register_and_poll_on_ipv6_loopback(tmp_path):
    from monitor.config import MonitorConfig
    from monitor.service import Monitor
    from worker_server import RankIdentity, RankState, WorkerServer

    port = free_port("::1")
    assert 0 < port < 65536
    state = RankState(RankIdentity(job="v6", replica_group=0, group_rank=0, group_world_size=1))
    srv = WorkerServer(state, host="::1", port=0).serve()
    mon = None
    try:
        assert srv.url.startswith("http://[::1]:")
        assert requests.get(srv.url + "/v1/state", timeout=5).json()["job"] == "v6"
        mon = Monitor(MonitorConfig(bind="::1", port=0, interval_s=0.2, job="v6",
                                    state_path=str(tmp_path / "m.sqlite"),
                                    sd_out=str(tmp_path / "targets.json"))).start()
        assert mon.url.startswith("http://[::1]:")
        srv.register_with(mon.url)  # ::1 is loopback: allowed without a token
        wait_until(lambda: any(r["url"] == srv.url and r["reachable"]
                               for r in ranks_json(mon.view, mon.clock())),
                   20, what="the monitor polling the rank at its bracketed IPv6 URL")
        # Prometheus' file_sd names the target as host:port, brackets kept (the file is
        # written at the end of the sweep that polled it, after the view the wait above read)
        sd = tmp_path / "targets.json"
        wait_until(lambda: sd.exists() and srv.url.split("://", 1)[1] in sd.read_text(), 10,
                   what="the bracketed target in the file_sd output")
    finally:
        srv.stop()
        if mon is not None:
            mon.stop()


def test_an_unbracketed_ipv6_static_target_is_a_config_error_not_a_crash():
    from monitor.config import ConfigError, MonitorConfig
    from monitor.service import check_config

    with pytest.raises(ConfigError, match="needs brackets"):
        check_config(MonitorConfig(targets=["::1:9000"]))
    check_config(MonitorConfig(targets=["[::1]:9000"]))
