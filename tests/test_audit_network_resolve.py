"""A network finding is over only when a round measured its host again: a full round that left
the host out (its rank not polled this sweep, or its group between quorums) says nothing of its
links. Network.judge on rounds built here, as tests/test_monitor_network.py's verdict tests do."""

from __future__ import annotations

from monitor.config import ProbeConfig
from monitor.detect.findings import Findings
from monitor.detect.network import Network
from monitor.evidence.rank import RankView
from tests.support.views import scratch_view
from tests.test_monitor_network import SLOW, a_round

HOSTS = ["a", "b", "c", "d"]


def view_at(now: float):
    ranks = {}
    for g, h in enumerate(HOSTS):
        url = f"http://{h}:1"
        ranks[url] = RankView(url, True, {
            "replica_group": g, "rank": g, "group_rank": 0, "group_world_size": 1,
            "replica_id": f"rg{g}:x", "quorum_id": 7, "participating": True, "step": 10,
            "host": h}, answered_at=now)
    return scratch_view(now, ranks)


def b_slow_job():
    """(findings with a job_slow open, Network at --probe-rounds 2, the view, now, a round whose
    links of host b are slow)."""
    findings = Findings()
    net = Network(ProbeConfig(), findings)
    now = 100.0
    view = view_at(now)
    findings.confirm("job_slow", None, [], {"summary": "slow", "probe": None}, now, now, view)
    return findings, net, view, now, a_round(HOSTS, lambda s, d: SLOW if "b" in (s, d) else {})


def test_a_round_without_the_host_does_not_resolve_its_network_finding():
    findings, net, view, now, b_slow = b_slow_job()
    for _ in range(2):
        now += 1.0
        net.judge(view, b_slow, now, None)
    assert [(k[0], f.evidence["host"]) for k, f in findings.open.items()
            if k[0] == "network"] == [("network", "b")]
    # a full round of the other hosts only: b was not measured, its finding stays open
    now += 1.0
    net.judge(view, a_round(["a", "c", "d"], lambda s, d: {}), now, None)
    assert [k[1] for k in findings.open if k[0] == "network"] == [1]
    # as many rounds in a row that measured b and found its links good as named it end it
    for left in ([1], []):
        now += 1.0
        net.judge(view, a_round(HOSTS, lambda s, d: {}), now, None)
        assert [k[1] for k in findings.open if k[0] == "network"] == left
    assert [f.resolution for f in findings.resolved if f.kind == "network"] == ["links_good"]


def test_one_round_of_every_link_slow_alike_does_not_end_a_hosts_finding():
    """A round with every link slow alike (the ranks busy serving an incident bundle: the demo's
    dry run read 7 Mbit/s on every link) names no host, and ended b's finding at once: b named
    again two rounds later was a second offence, a second bundle and a second detection of one
    fault. Ending it takes as many clear rounds in a row as naming it did."""
    findings, net, view, now, b_slow = b_slow_job()
    alike = a_round(HOSTS, lambda s, d: {"mbit_s": 7.0})
    for rnd in (b_slow, b_slow, alike, b_slow, alike, b_slow):
        now += 1.0
        net.judge(view, rnd, now, None)
    [f] = [f for k, f in findings.open.items() if k[0] == "network"]
    assert f.evidence["host"] == "b" and not findings.resolved


def test_heal_rounds_between_two_rounds_naming_a_host_do_not_restart_its_count():
    """A heal's rounds judge no rate: a slow host's run of rounds waits through them, so the
    round after the heal confirms it (the count restarted; a host whose groups healed in turn
    was never confirmed). A host cut off is named during the heal all the same."""
    findings, net, view, now, b_slow = b_slow_job()
    net.judge(view, b_slow, now + 1, None)
    healing = view_at(now)
    healing.ranks["http://d:1"].state["phase"] = "healing"
    for i in range(3):
        net.judge(healing, b_slow, now + 2 + i, None)
    assert [k for k in findings.open if k[0] == "network"] == []  # no rate judged meanwhile
    net.judge(view, b_slow, now + 6, None)
    assert [f.evidence["host"] for k, f in findings.open.items() if k[0] == "network"] == ["b"]
