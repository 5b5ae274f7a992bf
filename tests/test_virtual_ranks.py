"""The benchmarks' virtual ranks (tests/support/virtual_ranks.py): a rank's answer made from
shared cached parts is the one made from scratch."""

from __future__ import annotations

import json
import types

from tests.support import virtual_ranks
from tests.support.virtual_ranks import VirtualRanks


def unstamped(doc: dict) -> dict:
    """The document less its wall-clock stamps (each server's template has its own)."""
    return {k: v for k, v in doc.items() if not (isinstance(v, float) and v > 1e9)}


def test_cached_answers_equal_answers_made_afresh(monkeypatch):
    """One server answering many ranks (its values shared between ranks with the same step,
    rows and wait) gives each rank the bytes a new server gives it, healthy, with a slow group
    and with a hung rank; the request line's route is cached the same way."""
    clock = types.SimpleNamespace(now=1000.0)
    monkeypatch.setattr(virtual_ranks, "time",
                        types.SimpleNamespace(monotonic=lambda: clock.now))
    n, size = 96, 8
    shared = VirtualRanks(n, 0, size, 0.5, epoch=900.0)

    def afresh(rank: int, line: bytes) -> tuple[bytes, bytes]:
        vr = VirtualRanks(n, 0, size, 0.5, epoch=900.0)
        vr.hung, vr.slow = dict(shared.hung), dict(shared.slow)
        return vr.answer(line)

    seen = 0
    for phase in ("healthy", "slow", "hung"):
        if phase == "slow":
            shared.slow[3] = (int((clock.now - 900.0) / 0.5) + 1, 0.7)
        if phase == "hung":
            shared.hung[5 * size + 2] = clock.now - 4.0
        for tick in range(3):
            clock.now += 0.5 * tick + 0.013
            for rank in range(n):
                line = b"GET /r/%d/v1/state HTTP/1.1\r" % rank
                got, want = shared.answer(line), afresh(rank, line)
                assert got[0] == want[0] == b"200 OK"
                doc, fresh = (unstamped(json.loads(b)) for b in (got[1], want[1]))
                assert doc == fresh, (phase, tick, rank)
                assert doc["rank"] == rank and doc["group_rank"] == rank % size
                seen += 1
    assert seen == 3 * 3 * n
    assert shared.answer(b"GET /r/999/v1/state HTTP/1.1")[0] == b"404 Not Found"
    assert shared.answer(b"GET /r/x/v1/state HTTP/1.1")[0] == b"404 Not Found"
    assert shared.answer(b"GET /r/1/v1/other HTTP/1.1")[0] == b"404 Not Found"


def test_since_serves_the_rows_a_worker_server_would(monkeypatch):
    """``?since=N`` cuts ``timing.recent`` to the steps after N, as worker_server.app's
    state_since does, and leaves the rest of the document as the whole answer has it."""
    from worker_server.app import state_since

    clock = types.SimpleNamespace(now=1000.0)
    monkeypatch.setattr(virtual_ranks, "time",
                        types.SimpleNamespace(monotonic=lambda: clock.now))
    vr = VirtualRanks(16, 0, 8, 0.5, epoch=900.0)
    whole = json.loads(vr.answer(b"GET /r/5/v1/state HTTP/1.1")[1])
    steps = [r["step"] for r in whole["timing"]["recent"]]
    assert len(steps) == virtual_ranks.KEEP_STEPS
    for since in (steps[0] - 3, steps[0], steps[3], steps[-1] - 1, steps[-1], steps[-1] + 9):
        status, body = vr.answer(b"GET /r/5/v1/state?since=%d HTTP/1.1" % since)
        cut = json.loads(body)
        want = state_since(json.loads(json.dumps(whole)), since)
        assert status == b"200 OK"
        assert cut["timing"]["recent"] == want["timing"]["recent"], since
        assert {k: v for k, v in cut.items() if k != "timing"} == \
            {k: v for k, v in whole.items() if k != "timing"}
    assert vr.answer(b"GET /r/5/v1/state?since=x HTTP/1.1")[0] == b"400 Bad Request"


def test_documents_are_a_worker_servers(monkeypatch):
    """A virtual rank's ``/v1/state`` has a WorkerServer's keys and sizes (64 step times, 16
    timing rows, floats of full precision), and ``?recent=N`` / ``?since=N&recent=M`` cut it as
    worker_server.app's state_recent and state_since do."""
    from worker_server.app import state_recent, state_since
    from worker_server.state import RankIdentity, RankState

    clock = types.SimpleNamespace(now=1000.0)
    monkeypatch.setattr(virtual_ranks, "time",
                        types.SimpleNamespace(monotonic=lambda: clock.now))
    vr = VirtualRanks(16, 0, 8, 1.0, epoch=900.0)
    whole = json.loads(vr.answer(b"GET /r/5/v1/state HTTP/1.1")[1])
    real = RankState(RankIdentity(replica_group=0, group_rank=5, group_world_size=8)).snapshot()
    assert whole.keys() == real.keys()
    assert len(whole["recent_step_seconds"]) == 64
    assert len(whole["timing"]["recent"]) == 16
    assert all(len(repr(v)) >= 12 for v in whole["recent_step_seconds"])  # not "0.6315"
    for query, since, recent in ((b"?recent=16", None, 16), (b"?since=95&recent=3", 95, 3),
                                 (b"?recent=0&since=200", 200, 0)):
        status, body = vr.answer(b"GET /r/5/v1/state%s HTTP/1.1" % query)
        want = json.loads(json.dumps(whole))
        if since is not None:
            want = state_since(want, since)
        want = state_recent(want, recent)
        assert status == b"200 OK"
        cut = json.loads(body)
        assert cut["recent_step_seconds"] == want["recent_step_seconds"], query
        assert cut["timing"]["recent"] == want["timing"]["recent"], query
    for bad in (b"?recent=x", b"?recent=-1", b"?since=2&recent=", b"?since=&recent=2"):
        assert vr.answer(b"GET /r/5/v1/state%s HTTP/1.1" % bad)[0] == b"400 Bad Request", bad
