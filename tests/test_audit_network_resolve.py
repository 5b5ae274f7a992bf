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


def test_a_round_without_the_host_does_not_resolve_its_network_finding():
    findings = Findings()
    net = Network(ProbeConfig(), findings)
    now = 100.0
    view = view_at(now)
    findings.confirm("job_slow", None, [], {"summary": "slow", "probe": None}, now, now, view)
    b_slow = a_round(HOSTS, lambda s, d: SLOW if "b" in (s, d) else {})
    for _ in range(2):
        now += 1.0
        net.judge(view, b_slow, now, None)
    assert [(k[0], f.evidence["host"]) for k, f in findings.open.items()
            if k[0] == "network"] == [("network", "b")]
    # a full round of the other hosts only: b was not measured, its finding stays open
    now += 1.0
    net.judge(view, a_round(["a", "c", "d"], lambda s, d: {}), now, None)
    assert [k[1] for k in findings.open if k[0] == "network"] == [1]
    # a round that measured b and found its links good ends it
    now += 1.0
    net.judge(view, a_round(HOSTS, lambda s, d: {}), now, None)
    assert [k for k in findings.open if k[0] == "network"] == []
    assert [f.resolution for f in findings.resolved if f.kind == "network"] == ["links_good"]
