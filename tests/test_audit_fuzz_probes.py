"""A rank's ``POST /v1/probe`` answer, malformed: that rank's row is left out, the round goes on.

Before, a result whose ``peer`` was a list (unhashable) or an answer nested past the recursion
limit raised out of the rank's request and ended the whole probe round ("probe round failed"):
one rank blinded the monitor's search for a network fault's host, round after round. The ranks
are tests/test_monitor_network.py's simulated ones (a real WorkerServer cannot be made to
answer garbage); the monitor and the Lighthouse are real.
"""

from __future__ import annotations

import logging

from tests.test_monitor_network import (  # noqa: F401  (fixtures)
    BASELINE_SWEEPS,
    NETWORK_SLOW,
    THROTTLED,
    job,
    links,
    probing,
)


def test_a_malformed_probe_answer_loses_that_row_not_the_round(probing, caplog):  # noqa: F811
    d = probing
    sim_job = d.train.job
    d.sweeps(BASELINE_SWEEPS)  # healthy first: the pace a slow job is measured against
    host_of = {r.url: r.state["host"] for r in sim_job.sim.ranks}
    good = links(sim_job, "h2", THROTTLED)

    def link(src: str, dst: str) -> dict:  # h3's rank answers its row for h0 with a bad peer
        bad = host_of[src] == "h3" and host_of[dst] == "h0"
        return {**good(src, dst), **({"peer": [dst]} if bad else {})}

    sim_job.sim.links = link
    with caplog.at_level(logging.ERROR, logger="monitor.evidence.probes"):
        d.until(lambda: d.mon.probes.to_json()["rounds"] >= 1, "a probe round", **NETWORK_SLOW)
    assert not [r for r in caplog.records if "probe round failed" in r.getMessage()]
    matrix = d.mon.probes.to_json()["last"]["matrix"]
    assert matrix["h3"]["h0"] == {"ok": False, "connect_s": None, "transfer_s": None,
                                  "mbit_s": None, "error": "not in the rank's answer"}
    assert matrix["h3"]["h1"]["ok"] is True
