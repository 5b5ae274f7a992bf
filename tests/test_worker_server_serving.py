"""serving(): the WorkerServers of this process that serve now, whether or not the code that
started one kept it (the two-line API written as a bare statement keeps nothing)."""

from __future__ import annotations

import gc

import requests

from worker_server import WorkerServer
from worker_server.checkpoint import busy, checkpointing
from worker_server.server import serving


def _phase(url: str) -> str:
    return requests.get(url + "/v1/state", timeout=2).json()["phase"]


def test_a_server_whose_return_value_is_not_kept_still_serves_its_phases(monkeypatch):
    """Held weakly, the server was collected at once: HTTP still answered, but checkpointing(),
    busy(), dcp.save and a planned SIGTERM stop found no server (a long save read as a hang)."""
    for name in ("LIGHTKEEPER_MONITOR", "LIGHTKEEPER_EXIT_TOKEN", "LIGHTKEEPER_FAULT_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    url = WorkerServer.start(replica_group=0, group_rank=0, group_world_size=1,
                             host="127.0.0.1", port=0).url
    gc.collect()
    try:
        assert url in [s.url for s in serving()]
        with checkpointing():
            assert _phase(url) == "checkpoint"
        with busy():
            assert _phase(url) == "busy"
        assert _phase(url) == "starting"
    finally:
        for s in serving():
            if s.url == url:
                s.stop()
    assert url not in [s.url for s in serving()]  # stop() ends its turn
