"""A rank listed by host name that registers by address (or the other way round) is one target
(monitor/poll/discovery.py): polled, counted and shown once, under the name it was listed by."""

from __future__ import annotations

import ipaddress
import threading
import time

import requests

from lightkeeper.cluster import wait_until
from monitor.poll.admission import AllowList, NotAllowed, ResolverBusy
from monitor.poll.discovery import Discovery
from tests.test_monitor_trust import bare_monitor
from worker_server import RankIdentity, RankState, WorkerServer


def _metric(text: str, name: str, labels: str = "") -> float:
    """The value of ``lightkeeper_monitor_<name>{...}`` whose labels contain ``labels``; 0
    when there is none."""
    for line in text.splitlines():
        if line.startswith(f"lightkeeper_monitor_{name}{{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_rank_listed_by_name_that_registers_by_address_is_one_target(tmp_path):
    state = RankState(RankIdentity(job="unit", replica_group=0, group_rank=0, group_world_size=1))
    srv = WorkerServer(state, host="127.0.0.1", port=0).serve()
    port = srv.url.rsplit(":", 1)[1]
    assert srv.url == f"http://127.0.0.1:{port}"
    mon = bare_monitor(tmp_path, targets=[f"localhost:{port}"])  # /etc/hosts: 127.0.0.1
    try:
        mon.discovery.refresh_names()  # else merged at the rank's next registration, 5 s on
        srv.register_with(mon.url)  # as every WorkerServer given the monitor's URL does

        def polled_since_registered() -> list:  # a sweep after the registration published
            ranks = requests.get(mon.url + "/v1/ranks", timeout=5).json()
            return ranks if any(srv.url in (r["url"], r["registered_as"]) for r in ranks) else []

        ranks = wait_until(polled_since_registered, 10, interval=0.05,
                           what="the monitor polling the registered rank")
        assert [(r["url"], r["registered_as"], r["reachable"]) for r in ranks] == \
            [(f"http://localhost:{port}", srv.url, True)], ranks
        targets = requests.get(mon.url + "/v1/targets", timeout=5).json()
        assert [(t["url"], t["source"], t["rank"]) for t in targets] == \
            [(f"http://localhost:{port}", "static", 0)], targets  # the name the operator gave
        text = requests.get(mon.url + "/metrics", timeout=5).text
        assert _metric(text, "registrations_total", 'outcome="accepted"') >= 1
        assert _metric(text, "ranks_known") == 1
    finally:
        srv.stop()
        mon.stop()
    # the names' lookups stop with the monitor
    wait_until(lambda: not [t for t in threading.enumerate()
                            if t.name.startswith("lightkeeper-names")], 5, interval=0.02,
               what="the name refresher's threads ending")


HOSTS = {"trainer-a": ["10.0.0.7"], "trainer-b": ["10.0.0.8"],
         "both": ["10.0.0.7", "10.0.0.8"]}


def resolver(host: str) -> list:
    if host in HOSTS:
        return [ipaddress.ip_address(a) for a in HOSTS[host]]
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        raise NotAllowed(f"{host} does not resolve") from None


def listed(d: Discovery) -> list[tuple]:
    return [(t.url, t.source, t.rank, t.registered_as) for t in d.targets()]


def test_the_address_a_listed_name_resolves_to_is_its_identity():
    allow = AllowList.parse(["10.0.0.0/24"], resolver=resolver)
    d = Discovery(["trainer-a:9500"], resolver=resolver)
    d.refresh_names()  # as the monitor's refresher does in the background
    # registered by address, before and after a copy of it was registered on its own
    d.register({"url": "http://10.0.0.7:9500", "rank": 3}, admit=allow.admit, now=1.0)
    assert listed(d) == [("http://trainer-a:9500", "static", 3, "http://10.0.0.7:9500")]
    # another port or path on that address is another rank
    d.register({"url": "http://10.0.0.7:9501", "rank": 4}, admit=allow.admit, now=1.0)
    assert [t.url for t in d.targets()] == ["http://trainer-a:9500", "http://10.0.0.7:9501"]

    # listed by address, registered by name with the token (polled as registered): the name
    # is looked up off the registration path, then matched at its next registration
    d = Discovery(["10.0.0.8:9500"], resolver=resolver)
    d.register({"url": "http://trainer-b:9500", "rank": 1}, admit=lambda url: url, now=1.0)
    assert sorted(listed(d)) == [("http://10.0.0.8:9500", "static", None, None),
                                 ("http://trainer-b:9500", "registered", 1, None)]
    d.refresh_names()
    d.register({"url": "http://trainer-b:9500", "rank": 1}, admit=lambda url: url, now=6.0)
    assert listed(d) == [("http://10.0.0.8:9500", "static", 1, "http://trainer-b:9500")]

    # a name that does not resolve matches nothing; the rank is still polled, on its own
    d = Discovery(["gone:9500"], resolver=resolver)
    d.refresh_names()
    d.register({"url": "http://10.0.0.7:9500", "rank": 2}, admit=allow.admit, now=1.0)
    assert sorted(t.url for t in d.targets()) == ["http://10.0.0.7:9500", "http://gone:9500"]


def test_a_name_of_several_addresses_is_one_rank_the_first_to_register():
    allow = AllowList.parse(["10.0.0.0/24"], resolver=resolver)
    d = Discovery(["both:9500"], resolver=resolver, forget_after_s=30)
    d.refresh_names()
    d.register({"url": "http://10.0.0.8:9500", "rank": 1}, admit=allow.admit, now=1.0)
    d.register({"url": "http://10.0.0.7:9500", "rank": 2}, admit=allow.admit, now=2.0)
    d.register({"url": "http://10.0.0.8:9500", "rank": 1}, admit=allow.admit, now=6.0)
    assert listed(d) == [("http://both:9500", "static", 1, "http://10.0.0.8:9500"),
                         ("http://10.0.0.7:9500", "registered", 2, None)]
    # the first stopped registering: the other takes the name over, its own copy gone
    d.register({"url": "http://10.0.0.7:9500", "rank": 2}, admit=allow.admit, now=40.0)
    assert listed(d) == [("http://both:9500", "static", 2, "http://10.0.0.7:9500")]


def test_a_name_that_moves_hands_its_target_to_the_new_address_at_once(monkeypatch):
    monkeypatch.setitem(HOSTS, "mover", ["10.0.0.7"])
    allow = AllowList.parse(["10.0.0.0/24"], resolver=resolver)
    d = Discovery(["mover:9500"], resolver=resolver, forget_after_s=30)
    d.refresh_names()
    d.register({"url": "http://10.0.0.7:9500", "rank": 5}, admit=allow.admit, now=100.0)
    assert listed(d) == [("http://mover:9500", "static", 5, "http://10.0.0.7:9500")]
    HOSTS["mover"] = ["10.0.0.9"]  # rescheduled: the old pod's rank still registers a while
    d.refresh_names()
    assert listed(d) == [("http://mover:9500", "static", None, None)]  # not its hints now
    # the new pod's rank takes the name at its first registration, not --forget-after later
    d.register({"url": "http://10.0.0.9:9500", "rank": 6}, admit=allow.admit, now=101.0)
    d.register({"url": "http://10.0.0.7:9500", "rank": 5}, admit=allow.admit, now=102.0)
    assert sorted(listed(d)) == [("http://10.0.0.7:9500", "registered", 5, None),
                                 ("http://mover:9500", "static", 6, "http://10.0.0.9:9500")]


def test_a_failed_lookup_keeps_the_names_addresses():
    answers = {"trainer-a": [NotAllowed("trainer-a did not resolve within 2s"),
                             ResolverBusy("busy"), []]}

    def blipping(host):
        if answers.get(host):
            got = answers[host].pop(0)
            if isinstance(got, Exception):
                raise got
            return got
        return resolver(host)

    allow = AllowList.parse(["10.0.0.0/24"], resolver=resolver)
    d = Discovery(["trainer-a:9500"], resolver=blipping)
    d.refresh_names()  # the first answer a timeout: nothing known, nothing matched yet
    d.register({"url": "http://10.0.0.7:9500", "rank": 3}, admit=allow.admit, now=1.0)
    assert sorted(t.url for t in d.targets()) == ["http://10.0.0.7:9500",
                                                  "http://trainer-a:9500"]
    d.refresh_names()  # busy, still nothing; then an empty answer: nothing either
    d.refresh_names()
    d.refresh_names()  # resolved: merged at the rank's next registration
    d.register({"url": "http://10.0.0.7:9500", "rank": 3}, admit=allow.admit, now=6.0)
    assert listed(d) == [("http://trainer-a:9500", "static", 3, "http://10.0.0.7:9500")]
    answers["trainer-a"] = [NotAllowed("trainer-a did not resolve within 2s"), []]
    d.refresh_names()
    d.refresh_names()
    for now in (11.0, 16.0):  # a blip moves no claim: the rank stays one target
        d.register({"url": "http://10.0.0.7:9500", "rank": 3}, admit=allow.admit, now=now)
        assert listed(d) == [("http://trainer-a:9500", "static", 3, "http://10.0.0.7:9500")]


def test_a_hanging_resolver_holds_no_registration_up():
    release, asked = threading.Event(), []

    def hanging(host):
        asked.append((host, threading.current_thread() is threading.main_thread()))
        if not release.wait(5):
            raise NotAllowed(f"{host} did not resolve")
        return resolver(host)

    allow = AllowList.parse(["10.0.0.0/24"], resolver=resolver)
    d = Discovery([f"node-{i}:9500" for i in range(10)] + ["trainer-a:9500"],
                  resolver=hanging).start()
    try:
        started = time.monotonic()
        for now in (1.0, 2.0):
            t = d.register({"url": "http://10.0.0.7:9500", "rank": 3}, admit=allow.admit,
                           now=now)
            assert (t.url, t.source) == ("http://10.0.0.7:9500", "registered")
        assert time.monotonic() - started < 0.5
        wait_until(lambda: asked, 5, interval=0.01, what="the refresher asking")
        release.set()

        def merged():
            t = d.register({"url": "http://10.0.0.7:9500", "rank": 3}, admit=allow.admit,
                           now=time.monotonic())
            return t.source == "static"

        wait_until(merged, 5, interval=0.01, what="the registration matching trainer-a")
        assert listed(d) == [("http://trainer-a:9500", "static", 3, "http://10.0.0.7:9500")] \
            + [(f"http://node-{i}:9500", "static", None, None) for i in range(10)]
        assert not [h for h, on_main in asked if on_main]  # never on a registration's thread
    finally:
        release.set()
        d.close()
