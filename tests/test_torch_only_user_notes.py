"""What the monitor says to the user of a job whose ranks run only torch's debug server
(docs/torch_debug_server.md): a group it cannot watch, a server without torch's handlers, and
what it could not do to such ranks. A real torch ``TCPStore`` runs in this process; answers a
real torch server never gives (a 404 handler list) come from a small HTTP server of the test's."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from monitor.api.app import create_app
from monitor.config import BundleConfig, MonitorConfig, ProbeConfig, RailsConfig
from monitor.evidence.probes import ProbeMesh
from monitor.evidence.verification import verify_ranks
from monitor.evidence.view import ViewBuilder
from monitor.poll.admission import token_warning
from monitor.poll.discovery import Target
from monitor.poll.torch_server import UNWATCHED_AFTER_S, StoreReader, TorchPoller
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob

NOW = 1_800_000_000.0


def test_a_group_whose_ranks_wrote_no_address_is_said_once_and_when_that_ends(caplog, tmp_path):
    """torchft's Manager wrote the group's replica id, but no rank called start_debug_server()
    (or torch is older than 2.10): no rank of it is ever polled, so the store read must say it."""
    dist = pytest.importorskip("torch.distributed")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    addr, rid = f"127.0.0.1:{store.port}", "replica_group_1:uuid"
    store.set("replica_id", rid)
    mon = Monitor(MonitorConfig(port=0, torch_stores=True, lighthouse="http://127.0.0.1:1",
                                state_path=str(tmp_path / "m.db")))  # nothing listens: refused
    try:
        _unwatched_said(mon, mon.torch_ranks.stores, store, addr, rid, caplog)
    finally:
        mon.stop()
    assert any("watched now" in r.getMessage() for r in caplog.records)
    # a group the Lighthouse stops listing: forgotten, and said so if it was unwatched
    reader, caplog.records[:] = StoreReader(timeout_s=5, forget_after_s=30), []
    other = [("replica_group_2:u", addr, 3)]  # its store: the one above, another replica id
    store.set("replica_id", "replica_group_2:u")
    with caplog.at_level("WARNING", logger="monitor.poll.torch_server"):
        reader.read(other, NOW)
        reader.read(other, NOW + UNWATCHED_AFTER_S)
        assert reader.unwatched[("replica_group_2:u", addr)][0] == (2,)
        reader.read([], NOW + UNWATCHED_AFTER_S + 30)
    assert reader.unwatched == {}
    assert "no longer lists its group" in caplog.records[-1].getMessage()


def _unwatched_said(mon, reader, store, addr, rid, caplog) -> None:
    """``reader`` (the monitor's own, fed here as its sweep feeds it) says the group unwatched
    once it has been so UNWATCHED_AFTER_S, in the log, /v1/cluster and the overview."""
    group = [(rid, addr, 2)]
    with caplog.at_level("WARNING", logger="monitor.poll.torch_server"):
        assert reader.read(group, NOW) == {}
        assert reader.unwatched == {}  # a starting group: its ranks may not have started it yet
        for t in (UNWATCHED_AFTER_S, UNWATCHED_AFTER_S + 10):
            assert reader.read(group, NOW + t) == {}
        said = [r.getMessage() for r in caplog.records if "not watched" in r.getMessage()]
        assert len(said) == 1, said
        assert f"store {addr} of {rid!r} holds no debug_server/rank<N> for group rank(s) " \
               "[0, 1]" in said[0] and "start_debug_server() not called" in said[0] \
               and "torch older than 2.10" in said[0]
        mon.sweep_once()  # the Lighthouse unreadable: no store read, what was found stands
        row, = mon.cluster_json()["torch_only"]["unwatched"]
        assert row["replica_id"] == rid and row["store"] == addr, row
        assert row["group_ranks"] == [0, 1] and row["why"] == said[0]
        page = create_app(mon).test_client().get("/").get_data(as_text=True)
        assert "Not watched" in page and addr in page
        store.set("debug_server/rank0", "http://node7:4100")
        store.set("debug_server/rank1", "http://node8:4100")
        assert len(reader.read(group, NOW + 60)) == 2
    assert reader.unwatched == {}


class _NotFound(BaseHTTPRequestHandler):
    """Answers 404 to everything: a server at that address without torch's debug handlers."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_error(404)

    do_POST = do_GET  # noqa: N815

    def log_message(self, *args) -> None:
        pass


def test_a_server_without_torchs_handlers_is_said_so_and_never_asked_for_v1_state():
    """torch older than 2.10 (or another program) at a rank's address: its 404 on GET /handler/
    says what is missing; the verdict does not speak of /v1/state, which it is never asked."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"torch+http://127.0.0.1:{server.server_address[1]}"
    poller = TorchPoller(timeout_s=2)
    try:
        p = poller.sweep([url])[url]
    finally:
        poller.close()
        server.shutdown()
        server.server_close()
    assert not p.ok and p.status == 404, p
    assert "no torch debug handlers at this address (torch older than 2.10" in p.error, p.error
    view = ViewBuilder().update([Target(url, "torch_store")], {url: p}, now=NOW)
    trust = verify_ranks(view.ranks, None, "unreadable", True, NOW)[url]
    assert trust.reason == "never_answered" and "/v1/state" not in trust.detail, trust
    assert "torch's debug server" in trust.detail


@pytest.mark.parametrize("urls, said, unsaid", [
    (["torch+http://h0:1", "torch+http://h1:1"], "Lightkeeper's WorkerServer", "--rank-exit-token"),
    (["torch+http://h0:1", "http://h1:1"], "--rank-exit-token", "torch's debug server")])
def test_no_probe_token_asked_of_a_job_on_torchs_debug_server_alone(urls, said, unsaid):
    """A job stalled with no group to blame, and no ranks' token: ranks on torch's debug server
    alone take no probes, so the note says that instead of asking for a token that would not
    help; a job with Lightkeeper ranks among them is still asked for the token."""
    view = ViewBuilder().update([Target(u, "torch_store") for u in urls], {}, now=NOW)
    mesh = ProbeMesh(ProbeConfig(), None)
    mesh.ask(view, True, None, NOW)
    assert said in mesh.note and unsaid not in mesh.note, mesh.note


def test_the_registration_token_warning_says_whose_registration_it_is():
    """Mixed jobs may register Lightkeeper ranks: the warning stays, and says it is not about
    ranks on torch's debug server alone."""
    line = token_warning(None, "admin")
    assert "Lightkeeper ranks register only with the admin token" in line
    assert "ranks on torch's debug server alone never register" in line


def test_a_confirmed_eviction_names_the_ranks_that_no_call_reached(tmp_path, caplog):
    """A group evicted while one of its ranks (not group rank 0) no longer answers (SIGSTOPped,
    hung): the Lighthouse's kill ends group rank 0 only and no exit reaches a rank that does not
    answer (a torch-only rank takes none at all), so the confirmed eviction says that rank was
    not stopped. Real Lighthouse (``SimJob``), simulated Lightkeeper ranks."""
    job = SimJob(2, ranks_per_group=2)
    mon = Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "m.db"), targets=job.sim.urls,
                                job="sim", lighthouse=job.url, token="adm",
                                rails=RailsConfig(min_replicas=1, cooldown_s=0),
                                bundles=BundleConfig(enabled=False)), clock=time.time)
    try:
        mon.sweep_once()
        rank0, rank1 = job.sim.group(1)
        rank1.set_mode("down")
        mon.sweep_once()  # it no longer answers; its verdict stands, stale
        client = create_app(mon).test_client()
        r = client.post("/v1/evict", json={"replica_group": 1, "reason": "test"},
                        headers={"Authorization": "Bearer adm"})
        assert r.get_json()["sent"] is True, r.get_data(as_text=True)
        deadline = time.monotonic() + 20
        with caplog.at_level(logging.WARNING):
            while True:  # until the Lighthouse stops hearing the killed replica
                mon.sweep_once()
                (row,) = client.get("/v1/evictions").get_json()
                if row["status"] != "sent" or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    finally:
        mon.stop()
        job.stop()
    assert row["status"] == "confirmed", row
    assert "not stopped: rank 3 (group rank 1" in row["detail"] and rank1.url in row["detail"]
    assert rank0.url not in row["detail"].split("not stopped:")[1]  # it answered: killed
    assert sum("not stopped: rank 3" in m for m in caplog.messages) == 1
