"""A real 2-group ``lightkeeper train`` job on torchft-nightly (opt-in; docs/install.md).

Skipped unless ``LIGHTKEEPER_TORCHFT_NIGHTLY_SITE`` names a directory with torchft-nightly
installed in it (``pip install --target DIR --no-deps torchft-nightly``); that directory goes first
on every process's ``PYTHONPATH``, the Lighthouse's included. Two replica groups of two ranks
train with the explicit WorkerServer API (``WorkerServer.start`` then ``attach``); every rank
must report nightly's version, the current incarnation with its torchft group resolved (gloo on
torch 2.13 names it ``''`` on every group rank: nightly sets the name after creating the backend)
and no ``[lightkeeper]`` line saying it could not instrument something.
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

import pytest

from lightkeeper.cluster import LocalCluster, wait_until
from tests.support.workers import get_json, try_state
from worker_server.flight_recorder import is_torchft_pg_name

pytestmark = pytest.mark.e2e

SITE = os.environ.get("LIGHTKEEPER_TORCHFT_NIGHTLY_SITE", "")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not SITE, reason="LIGHTKEEPER_TORCHFT_NIGHTLY_SITE is not set")
def test_two_groups_train_on_nightly_and_are_observed(tmp_path, monkeypatch):
    nightly = [d.version for d in metadata.distributions(path=[SITE])
               if d.metadata["Name"] == "torchft-nightly"]
    assert nightly, f"no torchft-nightly in {SITE}"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([SITE, str(ROOT)]))
    with LocalCluster(tmp_path, num_groups=2, ranks_per_group=2, launcher="bare", steps=100000,
                      step_pause_s=0.05, pg_timeout_s=30) as cluster:
        cluster.start()
        urls = [u for g in (0, 1) for u in cluster.wait_for_workers(g, timeout=180).values()]
        states = wait_until(lambda: all((s := try_state(u)) and s["step"] >= 5 for u in urls)
                            and [try_state(u) for u in urls], 240, what="5 steps on every rank")
        for url, state in zip(urls, states, strict=True):
            assert state["torchft_version"] == nightly[0]
            dump = get_json(url + "/v1/fr_trace?pg=torchft", timeout=30)
            inc = wait_until(lambda u=url: (i := get_json(u + "/v1/fr_trace", timeout=30)
                                            ["incarnations"]) and i[-1]["pg_id"] is not None
                             and i[-1], 60, what="the current incarnation's pg_id")
            assert inc["replica_world_size"] == 2 and len(inc["global_ranks"]) == 2
            assert inc["quorum_id"] == state["quorum_id"] and is_torchft_pg_name(inc["pg_name"])
            assert dump["entries"], "no entries of torchft's group"
        for g in (0, 1):
            log = cluster.groups[g].log()
            assert "cannot instrument" not in log and "not recorded" not in log, log[-3000:]
