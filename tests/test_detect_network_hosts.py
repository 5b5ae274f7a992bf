"""A replica group on two hosts the probe mesh names: one network finding for the group, its
culprits the group's ranks on both hosts (so each host is charged), kept in step with the
rounds. Network.judge on rounds built here, as tests/test_audit_network_resolve.py does."""

from __future__ import annotations

from monitor.act.hosts import culprit_hosts
from monitor.config import ProbeConfig
from monitor.detect.findings import Findings
from monitor.detect.network import Network
from monitor.evidence.rank import RankView
from tests.support.views import scratch_view
from tests.test_monitor_network import CUT, SLOW, a_round

HOSTS = list("abcdef")
# (url, replica group, rank, group rank, host): group 1 runs on b and c, group 2 on c
RANKS = [("a", 0, 0, 0, "a"), ("b", 1, 1, 0, "b"), ("c1", 1, 2, 1, "c"), ("c2", 2, 3, 0, "c"),
         ("d", 3, 4, 0, "d"), ("e", 4, 5, 0, "e"), ("f", 5, 6, 0, "f")]


def view_at(now: float):
    ranks = {}
    for name, g, rank, group_rank, host in RANKS:
        url = f"http://{name}:1"
        ranks[url] = RankView(url, True, {
            "replica_group": g, "rank": rank, "group_rank": group_rank, "group_world_size": 2,
            "replica_id": f"rg{g}:x", "quorum_id": 7, "participating": True, "step": 10,
            "host": host}, answered_at=now)
    return scratch_view(now, ranks)


def cut(*hosts: str):
    return a_round(HOSTS, lambda s, d: CUT if {s, d} & set(hosts) else {})


def network(findings: Findings) -> dict[int, object]:
    return {k[1]: f for k, f in findings.open.items() if k[0] == "network"}


def test_a_group_on_two_named_hosts_has_one_finding_naming_both():
    findings = Findings()
    net = Network(ProbeConfig(), findings)  # --probe-rounds 2
    now = 100.0
    view = view_at(now)
    findings.confirm("job_stall", None, [], {"summary": "stalled", "probe": None, "step": 10},
                     now, now, view)
    new = []
    for _ in range(2):
        now += 1.0
        new += net.judge(view, cut("b", "c"), now, None)
    assert sorted(f.replica_group for f in new) == [1, 2]  # one finding a group
    f = network(findings)[1]
    assert f.ranks == f.evidence["culprit_ranks"] == [1, 2]
    assert sorted(culprit_hosts(f.to_dict())) == ["b", "c"]  # each host charged
    assert f.evidence["hosts"] == ["b", "c"] and f.evidence["host"] == "b"
    assert network(findings)[2].evidence["hosts"] == ["c"]
    # c's links recover: group 1's finding stays, on b alone; group 2's is over after as many
    # clear rounds as named it
    for _ in range(2):
        now += 1.0
        assert net.judge(view, cut("b"), now, None) == []
    assert network(findings) == {1: f}
    assert f.ranks == f.evidence["culprit_ranks"] == [1]
    assert f.evidence["hosts"] == ["b"] and f.evidence["culprit_hosts"] == ["b"]
    assert [(x.replica_group, x.resolution) for x in findings.resolved] == [(2, "links_good")]
    for _ in range(2):
        now += 1.0
        net.judge(view, cut(), now, None)
    assert network(findings) == {} and f.resolution == "links_good"


def test_one_alike_round_does_not_end_a_finding_moved_to_a_second_host():
    """Group 1 on hosts b and c: b clear the round c is confirmed, the finding moved to c kept
    the clear round b earned, and one round of every link slow alike then ended it while c was
    still bad (c's next rounds opened a second finding: c charged twice, a second bundle). The
    count starts afresh when the finding's hosts change."""
    findings = Findings()
    net = Network(ProbeConfig(), findings)  # --probe-rounds 2
    now = 100.0
    view = view_at(now)
    findings.confirm("job_slow", None, [], {"summary": "slow", "probe": None}, now, now, view)
    alike = a_round(HOSTS, lambda s, d: {"mbit_s": 7.0})
    hosts = []
    for rnd in (cut_slow("b"), cut_slow("b"), cut_slow("b", "c"), cut_slow("c"), alike,
                cut_slow("c"), cut_slow("c")):
        now += 1.0
        net.judge(view, rnd, now, None)
        f = network(findings).get(1)
        hosts.append(f.evidence["hosts"] if f else None)
    assert hosts[1:] == [["b"], ["b"], ["c"], ["c"], ["c"], ["c"]], hosts
    assert not [x for x in findings.resolved if x.replica_group == 1]


def cut_slow(*hosts):
    """A round whose links touching ``hosts`` are slow."""
    return a_round(HOSTS, lambda s, d: SLOW if {s, d} & set(hosts) else {})
