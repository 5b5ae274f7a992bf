"""Registrations against the listed targets and the DNS (monitor/poll/discovery.py,
monitor/poll/admission.py): a listed rank that registers stays one target, and names the
resolver is slow to answer neither hold the registrations up nor poison the allow-list."""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
import time
import types

import pytest
import requests

from lightkeeper.processes import wait_until
from monitor.poll import admission
from monitor.poll.admission import AllowList, NotAllowed
from monitor.poll.discovery import Discovery
from tests.test_monitor_trust import bare_monitor

HOSTS = {"localhost": "127.0.0.1", "trainer-a": "10.0.0.7", "alias.example": "10.0.0.7"}


def fake_resolver(host):
    if host in HOSTS:
        return [ipaddress.ip_address(HOSTS[host])]
    return admission.resolve(host)  # an IP literal; a name: refused


def test_a_listed_rank_that_registers_too_is_one_target_polled_as_listed(tmp_path):
    d = Discovery(["localhost:9500"], job="train")
    allow = AllowList.default(["localhost:9500"], resolver=fake_resolver)
    body = {"url": "http://localhost:9500", "job": "train", "replica_group": 1, "rank": 3}
    t = d.register(body, admit=allow.admit, now=10.0)
    first = d.targets()
    assert [x.url for x in first] == ["http://localhost:9500"]  # as the operator spelled it
    assert (t.url, t.source, t.replica_group, t.rank, t.registered_as) == \
        ("http://localhost:9500", "static", 1, 3, None)
    # its re-registration: the same target, registered again, the list unchanged
    again = d.register(body, admit=allow.admit, now=15.0)
    assert again is first[0] and again.last_registered == 15.0
    assert all(a is b for a, b in zip(d.targets(), first, strict=True))
    out = tmp_path / "sd.json"
    d.write_file_sd(str(out))
    assert json.loads(out.read_text()) == [{"targets": ["localhost:9500"], "labels": {
        "lightkeeper_source": "static", "job": "train", "replica_group": "1", "rank": "3"}}]
    # a restart restores no copy of it
    d2 = Discovery(["localhost:9500"], job="train")
    d2.restore(str(out))
    assert [(x.url, x.source) for x in d2.targets()] == [("http://localhost:9500", "static")]

    # listed by address, registered by name: admitted at that address, the listed target
    d = Discovery(["127.0.0.1:9600"])
    t = d.register({"url": "http://localhost:9600", "rank": 0}, admit=allow.admit)
    assert [(x.url, x.registered_as, x.rank) for x in d.targets()] == \
        [("http://127.0.0.1:9600", "http://localhost:9600", 0)]


def test_a_file_sd_rank_that_registers_keeps_the_files_labels(tmp_path):
    path = tmp_path / "in.json"
    path.write_text(json.dumps([{"targets": ["127.0.0.1:9700"], "labels": {"rank": "4"}}]))
    d = Discovery(targets_file=str(path))
    assert d.refresh() is None
    t = d.register({"url": "127.0.0.1:9700", "rank": 9, "replica_group": 2})
    assert [(x.url, x.source, x.rank, x.replica_group) for x in d.targets()] == \
        [("http://127.0.0.1:9700", "file_sd", 4, 2)]
    assert t is d.targets()[0]


@pytest.fixture
def slow_dns(monkeypatch):
    """getaddrinfo with HOSTS; ``slow*`` names hang until ``release``, then fail."""
    release, slow, real = threading.Event(), [], socket.getaddrinfo

    def getaddrinfo(host, *args, **kw):
        if host.startswith("slow"):
            slow.append(host)
            release.wait(10)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        if host not in HOSTS:
            return real(host, *args, **kw)  # the monitor's own 127.0.0.1
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (HOSTS[host], 0))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield types.SimpleNamespace(slow=slow, release=release)
    release.set()


def test_slow_names_are_refused_at_once_and_hold_no_registration_up(tmp_path, slow_dns):
    mon = bare_monitor(tmp_path, allow_targets=["trainer-a"])
    refused = []
    try:
        def register_slow(i):
            try:
                mon.register_target({"url": f"http://slow{i}.example:1"}, None)
            except NotAllowed as e:
                refused.append(str(e))

        threads = [threading.Thread(target=register_slow, args=(i,), daemon=True)
                   for i in range(admission.MAX_LOOKUPS)]
        for th in threads:
            th.start()
        wait_until(lambda: len(slow_dns.slow) == admission.MAX_LOOKUPS, 5,
                   what="the slow lookups")
        # every DNS worker is stuck: a legitimate name is answered at once, to come back
        t0 = time.monotonic()
        r = requests.post(mon.url + "/v1/targets", json={"url": "http://alias.example:9500"},
                          timeout=10)
        assert time.monotonic() - t0 < 1.0
        assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
        assert "resolving" in r.json()["error"]
        text = requests.get(mon.url + "/metrics", timeout=5).text
        assert 'lightkeeper_monitor_registrations_total{job="unit",outcome="resolver_busy"} ' \
               '1.0' in text
        slow_dns.release.set()  # the resolver gives up on them
        for th in threads:
            th.join(5)
        assert len(refused) == admission.MAX_LOOKUPS and all(
            "does not resolve" in e for e in refused), refused
        # the workers are free again, and the allow-list entry (trainer-a) allows its address
        r = requests.post(mon.url + "/v1/targets", json={"url": "http://alias.example:9500"},
                          timeout=10)
        assert r.status_code == 200 and r.json()["url"] == "http://10.0.0.7:9500", r.text
    finally:
        mon.stop()


def test_an_allow_list_names_failed_lookup_is_remembered_briefly(monkeypatch):
    answers = {"trainer-a": NotAllowed("trainer-a did not resolve within 2s")}

    def resolver(host):
        got = answers.pop(host, None) or fake_resolver(host)
        if isinstance(got, Exception):
            raise got
        return got

    clock = types.SimpleNamespace(monotonic=lambda: now)
    monkeypatch.setattr(admission, "time", clock)
    allow = AllowList.parse(["trainer-a"], resolver=resolver)
    now = 100.0
    with pytest.raises(NotAllowed, match="outside --allow-targets"):
        allow.admit("http://alias.example:9500")  # trainer-a's lookup timed out: allows nothing
    now += 6.0  # not 30 s: the failure may be a resolver slow for a moment
    assert allow.admit("http://alias.example:9500") == "http://10.0.0.7:9500"
