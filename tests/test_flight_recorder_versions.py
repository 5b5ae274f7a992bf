"""The WorkerServer on a torch whose Flight Recorder calls differ from the installed one
(worker_server/flight_recorder.py has the table): the installed torch 2.13 is changed with
monkeypatch to look like an older one (a call removed, an older keyword signature)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from worker_server import RankIdentity, RankState, create_app
from worker_server.flight_recorder import (
    GENERIC_JSON,
    NCCL_JSON,
    FlightRecorderNotAvailable,
    IncarnationTracker,
    raw_dump_json,
)


# fixtures, not imports at collection, where torch would cost every pytest-xdist worker a second
@pytest.fixture
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def c10d(torch):
    return pytest.importorskip("torch._C._distributed_c10d")


@pytest.fixture
def client():
    state = RankState(RankIdentity(job="unit", replica_group=1, group_rank=0))
    return create_app(state, IncarnationTracker(0)).test_client()


@pytest.fixture
def torch_2_7_cpu(monkeypatch, torch, c10d):
    """torch 2.7 without CUDA: no generic recorder dump (it came in 2.8)."""
    monkeypatch.setattr(torch, "__version__", "2.7.1+cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delattr(c10d, GENERIC_JSON)
    monkeypatch.delattr(c10d, NCCL_JSON, raising=False)


def test_missing_call_is_501_with_the_reason_and_the_rest_is_served(client, torch_2_7_cpu):
    r = client.get("/v1/fr_trace")
    assert r.status_code == 501
    body = r.get_json()
    assert body["torch"] == "2.7.1+cpu" and body["missing"] == [GENERIC_JSON]
    assert body["error"].startswith("Flight Recorder JSON dump not available in torch 2.7.1+cpu")
    assert "since torch 2.8" in body["error"] and body["path"] == "/v1/fr_trace"
    assert client.get("/v1/state").status_code == 200
    assert client.get("/v1/stacks").status_code == 200


def test_cuda_build_without_either_json_call_names_both(monkeypatch, torch_2_7_cpu, torch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(FlightRecorderNotAvailable) as e:
        raw_dump_json()
    assert e.value.missing == [NCCL_JSON, GENERIC_JSON]
    assert "since torch 2.5, CUDA builds" in str(e.value)


def test_an_incarnation_is_still_recorded_without_a_dump(torch_2_7_cpu):
    tracker = IncarnationTracker(0)

    class PG:  # torchft's ProcessGroup.configure signature (0.2.x)
        def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None,
                      group_rank=None, group_world_size=None, global_ranks=None):
            return "configured"

    pg = PG()
    assert tracker.hook(SimpleNamespace(_pg=pg)) == "configure"
    assert pg.configure("a", "r", 1, 2, quorum_id=7, global_ranks=[0, 1]) == "configured"
    inc = tracker.current()
    assert (inc["quorum_id"], inc["replica_rank"], inc["first_record_id"]) == (7, 1, 0)


def test_a_dump_call_without_the_newer_keywords_is_called_with_its_defaults(client, monkeypatch,
                                                                            torch, c10d):
    calls = []

    def old_dump():  # positional-only defaults, as an older binding may be
        calls.append(())
        return b'{"version": "2.4", "entries": []}'

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(c10d, GENERIC_JSON, old_dump)
    r = client.get("/v1/fr_trace")
    assert r.status_code == 200, r.get_json()
    body = r.get_json()
    assert body["entries"] == [] and body["incarnations"] == [] and body["replica_group"] == 1
    assert calls == [()]
