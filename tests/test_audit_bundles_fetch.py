"""The bound a kill waits for its bundle (docs/monitor.md, Incident bundles: every request at
once, each ended at --bundle-timeout), also when --bundle-ranks is raised past 32. The ranks
are simulated WorkerServers (tests/support/monitor_sim.py) that never answer."""

from __future__ import annotations

import time

from tests.support.monitor_sim import SimRanks
from tests.test_bundles import bundles_for, finding, view_of


def test_more_than_32_silent_ranks_still_end_at_one_timeout(tmp_path):
    sim = SimRanks.start(40)  # 40 single-rank groups: the culprit and 39 peers, 80 requests
    try:
        view = view_of(sim)
        for r in sim.ranks:
            r.set_mode("silent")
        bundles, store = bundles_for(tmp_path, timeout_s=1.0, max_ranks=40)
        try:
            t0 = time.monotonic()
            got = bundles.capture("evict", view, view, finding(1, [1]), 1, {"id": 1}, [])
            took = time.monotonic() - t0
            assert got is not None and got["ranks_asked"] == 40
            assert took < 1.9, took  # one timeout and the write, not two timeouts (2 s)
            assert got["ranks_complete"] == 0
        finally:
            bundles.close()
            store.close()
    finally:
        sim.stop()
