"""A ``dead`` group counts against its host when the host dropped off, not when only its
processes ended: a host whose kernel is up refuses a connection to a closed port at once, a host
gone answers nothing (docs/quarantine.md, the ``dead`` row).

A real Monitor (real HTTP, SQLite, host ledger, sweep loop) against a real torchft Lighthouse
that simulated groups join and heartbeat to (``SimJob``, tests/support/monitor_sim.py), each
group on its own host. A group's heartbeats stop, then its ranks either close their ports
(``down``: refused, a crash torchrun tore the group down after) or answer nothing (``silent``:
the connection accepted, no answer ever: its host off the network).
"""

from __future__ import annotations

import pytest
import requests

from lightkeeper.processes import wait_until
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob
from tests.test_liveness_cut_off import mon  # noqa: F401  (the live monitor, fixture)


@pytest.fixture
def job(request):
    j = SimJob(getattr(request, "param", 3), ranks_per_group=2, heartbeat_timeout_ms=1000)
    for r in j.sim.ranks:
        g = r.state["replica_group"]
        r.update(host=f"h{g}", node=f"node-{g}")
    yield j
    j.stop()


def hosts(mon: Monitor) -> dict[str, dict]:  # noqa: F811
    got = requests.get(mon.url + "/v1/hosts", timeout=5).json()
    return {h["host"]: h for h in got["hosts"]}


@pytest.mark.parametrize("mode", ["down", "silent"])
def test_a_dead_group_counts_against_its_host_only_if_the_host_stops_answering(job, mon, mode):  # noqa: F811
    wait_until(lambda: sum((r["verification"] or {}).get("state") == "verified" for r in
                           requests.get(mon.url + "/v1/ranks", timeout=5).json()) == 6, 15,
               what="6 verified ranks")
    job.alive.discard(2)  # its Manager gone: no more heartbeats
    for r in job.sim.group(2):
        r.set_mode(mode)
    h2 = wait_until(lambda: hosts(mon).get("h2"), 20, what="an offence recorded against h2")
    (dead,) = [f for f in requests.get(mon.url + "/v1/findings", timeout=5).json()
               if f["kind"] == "dead"]
    assert dead["replica_group"] == 2
    refused = {r["refused"] for r in dead["evidence"]["unreachable"].values()}
    (o,) = h2["offences"]
    assert o["kind"] == "dead" and o["replica_group"] == 2
    if mode == "down":  # the kernel answered: its processes ended, the host is fine
        assert refused == {True}
        assert not o["counts"] and "refused" in o["note"]
        assert h2["state"] != "quarantined" and hosts(mon)["h2"]["state"] != "quarantined"
    else:
        assert refused == {False}
        assert o["counts"] and o["note"] is None
        wait_until(lambda: hosts(mon)["h2"]["state"] == "quarantined", 10, what="h2 quarantined")
    assert set(hosts(mon)) == {"h2"}



@pytest.mark.parametrize("job", [2], indirect=True)
def test_a_host_gone_in_a_two_group_job_is_quarantined_not_held_blind(job, mon):  # noqa: F811
    """Half the ranks gone with their host: the quarantine rail counted every verified rank, so
    it held ``monitor_blind`` (the monitor reaching 50%) until the dark ranks were forgotten
    (the demo's 2-group ``host_offline``: ~30 s). As the eviction rail, it now leaves out a
    group the Lighthouse stopped hearing while the monitor reaches as many as it lost."""
    wait_until(lambda: sum((r["verification"] or {}).get("state") == "verified" for r in
                           requests.get(mon.url + "/v1/ranks", timeout=5).json()) == 4, 15,
               what="4 verified ranks")
    job.alive.discard(1)  # its Manager gone with its host: no more heartbeats
    for r in job.sim.group(1):
        r.set_mode("silent")
    wait_until(lambda: (hosts(mon).get("h1") or {}).get("state") == "quarantined", 15,
               what="h1 quarantined")
    said = requests.get(mon.url + "/v1/hosts", timeout=5).json()["decisions"]
    assert [d["decision"] for d in said if d["host"] == "h1"] == ["quarantine"], said
