"""An incident bundle for an incarnation that another one has replaced (monitor/act/bundles.py):
a crash found at its restart (monitor.detect.liveness: a ``dead`` finding for the earlier
replica id, its culprit as last seen) whose address the replacement answers now, a fixed
``--worker-port``. The ranks are simulated WorkerServers (tests/support/monitor_sim.py) on real
sockets; the bundle is the real writer's file.
"""

from __future__ import annotations

import json

from tests.support.monitor_sim import SimRanks
from tests.test_bundles import bundles_for, hang_dumps, members, view_of


def test_a_bundle_for_a_replaced_incarnation_names_its_culprit_gone_not_the_replacement(
        tmp_path):
    """The culprit is recorded gone, where it ran (its last host, pid and address); the
    replacement's ranks are never asked, so no stacks or dump of theirs is filed as the
    culprit's (view.json still shows who holds the ranks now)."""
    sim = SimRanks.start(4, groups=2)  # group 1: ranks 1 and 3, now of replica_group_1:sim
    dumps = hang_dumps(4, absent=3)
    for r in sim.ranks:
        r.fr = dumps[r.state["rank"]]
    view = view_of(sim)
    url3 = sim.ranks[3].url
    old = "replica_group_1:old"
    finding = {"kind": "dead", "replica_group": 1, "replica_id": old, "ranks": [3],
               "evidence": {"culprit_hosts": ["host-old"], "culprits": [
                   {"rank": 3, "group_rank": 1, "host": "host-old", "pid": 4242, "url": url3,
                    "reachable": False}]}}
    bundles, store = bundles_for(tmp_path, timeout_s=1.0)
    try:
        got = bundles.capture("evict", view, view, finding, 9,
                              {"id": 1, "decision": "evict", "status": "sending"}, [])
        assert got is not None
        files = members(bundles.store.path(got["id"]))
        m = json.loads(files["manifest.json"])
        assert m["replica_id"] == old and m["culprit_hosts"] == ["host-old"]
        gone = [x for x in m["ranks"] if x["rank"] in (1, 3)]
        assert len(gone) == 1 and gone[0]["gone"] is True, m["ranks"]
        assert (gone[0]["role"], gone[0]["replica_id"], gone[0]["host"], gone[0]["pid"],
                gone[0]["url"]) == ("culprit", old, "host-old", 4242, url3)
        assert gone[0]["stacks"] == gone[0]["fr_trace"] and gone[0]["stacks"].startswith("gone")
        assert not [n for n in files if n.endswith(("rank1.json", "rank3.json"))], sorted(files)
        assert sim.ranks[1].requests == sim.ranks[3].requests == 0  # never asked
        assert m["fetch"]["ranks_asked"] == len(m["ranks"]) - 1
        assert [x["rank"] for x in got["not_fetched"]] == [3]
        [g1] = [g for g in json.loads(files["view.json"])["groups"] if g["replica_group"] == 1]
        assert {r["replica_id"] for r in g1["ranks"]} == {"replica_group_1:sim"}
    finally:
        bundles.close()
        store.close()
        sim.stop()
