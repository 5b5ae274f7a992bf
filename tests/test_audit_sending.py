"""An eviction's outcome that the audit log cannot take when the kill has been sent (a full
disk, a locked file) is kept and written by the next write: its row never stays ``sending``.

A real monitor over a real torchft Lighthouse (tests/support/monitor_sim.SimJob) and a real
SQLite state file. The write fails through a trigger another connection puts on the file
between the eviction's two writes: a full disk would fail the first one too.
"""

from __future__ import annotations

import sqlite3
import time

import pytest

from lightkeeper.processes import wait_until
from monitor.api.app import create_app
from monitor.config import BundleConfig, MonitorConfig, RailsConfig
from monitor.evidence.lighthouse_status import LighthouseReader
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob

TOKEN = "s3cret"
FAIL = ("CREATE TRIGGER no_updates BEFORE UPDATE ON decisions "
        "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END")


@pytest.fixture
def job():
    j = SimJob(3, heartbeat_timeout_ms=1000)  # a killed group's heartbeat old 1 s after
    yield j
    j.stop()


def test_a_kill_whose_outcome_cannot_be_written_is_not_left_sending(tmp_path, job):
    """A failed kill whose ``failed`` could not be written reads ``failed`` and may be sent
    again; a sent one reads ``sent`` and is confirmed; both are written by the next write.
    Before: the request answered 500, the row stayed ``sending``, the replica was held as
    ``already_evicted`` and the sent kill was never confirmed."""
    state = str(tmp_path / "state.sqlite")
    mon = Monitor(MonitorConfig(port=0, state_path=state, targets=job.sim.urls, job="sim",
                                lighthouse=job.url, token=TOKEN,
                                rails=RailsConfig(min_replicas=1, cooldown_s=0),
                                bundles=BundleConfig(enabled=False)))
    other = sqlite3.connect(state)
    try:
        client = create_app(mon).test_client()
        mon.sweep_once()
        other.execute(FAIL)

        def evict(group: int) -> dict:
            r = client.post("/v1/evict", json={"replica_group": group, "reason": "test"},
                            headers={"Authorization": f"Bearer {TOKEN}"})
            # 502: the Lighthouse unreachable, no kill went out
            assert r.status_code == (200 if r.get_json()["sent"] else 502), \
                r.get_data(as_text=True)
            return r.get_json()

        def statuses() -> list[str]:
            return [r["status"] for r in client.get("/v1/evictions").get_json()]

        job.front_down()  # the Lighthouse unreachable: the kill fails
        assert evict(1)["sent"] is False
        assert statuses() == ["failed"]
        mon.sweep_once()
        assert client.get("/v1/goodput").get_json()["incidents"] == []  # no eviction booked
        other.execute("DROP TRIGGER no_updates")
        job.front_up()
        assert evict(1)["sent"] is True  # not held as already_evicted
        assert other.execute("SELECT status FROM decisions").fetchall() == [("failed",),
                                                                          ("sent",)]
        other.execute(FAIL)
        assert evict(2)["sent"] is True
        assert job.kills == [job.replica_ids[1], job.replica_ids[2]]
        assert statuses() == ["sent", "sent", "failed"]

        other.execute("DROP TRIGGER no_updates")
        reader = LighthouseReader(job.url)
        try:  # a kill is confirmed once the Lighthouse no longer hears the replica
            wait_until(lambda: (s := reader.read()[0]) is not None and not any(
                s.heartbeating(job.replica_ids[g]) for g in (1, 2)), 10, interval=0.05,
                what="the Lighthouse to drop the killed replicas")
        finally:
            reader.close()
        mon.sweep_once()  # the groups are gone: confirmed, and every outcome written
        written = other.execute("SELECT status FROM decisions ORDER BY id").fetchall()
        assert written == [("failed",), ("confirmed",), ("confirmed",)]
    finally:
        other.close()
        mon.stop()


def test_a_kill_in_flight_is_no_goodput_eviction_until_it_is_sent(tmp_path, job):
    """A sweep that accounts goodput while a manual kill is still ``sending`` (its bundle
    being kept, up to --bundle-timeout) books no eviction: the kill may fail. Before, it was
    booked for good. The sweep is run from inside the kill call (the real Lighthouse's,
    called right after) to land in that window every time."""
    mon = Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "state.sqlite"),
                                targets=job.sim.urls, job="sim", lighthouse=job.url,
                                token=TOKEN, rails=RailsConfig(min_replicas=1, cooldown_s=0),
                                bundles=BundleConfig(enabled=False)))
    try:
        client = create_app(mon).test_client()
        mon.sweep_once()
        kill = mon.enforcer.lighthouse.kill

        def swept_then_killed(replica_id):
            mon.sweep_once()
            job.front_down()  # the Lighthouse unreachable: the kill fails
            return kill(replica_id)

        mon.enforcer.lighthouse.kill = swept_then_killed
        r = client.post("/v1/evict", json={"replica_group": 1, "reason": "test"},
                        headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 502 and r.get_json()["sent"] is False, r.get_data(as_text=True)
        job.front_up()
        mon.sweep_once()
        assert client.get("/v1/goodput").get_json()["incidents"] == []
    finally:
        mon.stop()


def test_an_unconfirmed_kill_is_no_goodput_eviction(tmp_path, job):
    """A kill the Lighthouse took (sent) that never landed (the group still answers after the
    confirmation window: the Lighthouse could not reach its Manager) is taken back from the
    goodput ledger once ``unconfirmed``: the report claims no eviction. Before, the incident
    kept ``evicted_at`` and ``eviction_id`` for good. The front's kill is made a no-op: the
    simulated group has no Manager for a kill to miss."""
    skew = [0.0]
    mon = Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "state.sqlite"),
                                targets=job.sim.urls, job="sim", lighthouse=job.url,
                                token=TOKEN, confirm_timeout_s=1.0,
                                rails=RailsConfig(min_replicas=1, cooldown_s=0),
                                bundles=BundleConfig(enabled=False)),
                  clock=lambda: time.time() + skew[0])
    job.kill = lambda replica_id: False
    try:
        client = create_app(mon).test_client()
        mon.sweep_once()
        r = client.post("/v1/evict", json={"replica_group": 1, "reason": "test"},
                        headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.get_json()["sent"] is True, r.get_data(as_text=True)
        mon.sweep_once()
        [inc] = client.get("/v1/goodput").get_json()["incidents"]
        assert inc["eviction_id"] == r.get_json()["id"]  # booked while not judged yet
        skew[0] += 2.0  # past confirm_timeout_s, the group still answering
        mon.sweep_once()
        assert client.get("/v1/evictions").get_json()[0]["status"] == "unconfirmed"
        [inc] = client.get("/v1/goodput").get_json()["incidents"]
        assert (inc["eviction_id"], inc["evicted_at"], inc["evict_s"]) == (None, None, None)
    finally:
        mon.stop()


def test_an_outcome_owed_is_written_by_an_atomic_block_with_no_write_of_its_own(tmp_path):
    """The real store: a kill's ``failed`` a locked table refused is written by the next commit,
    even one of an atomic block that wrote nothing itself."""
    from monitor.store import Store

    path = str(tmp_path / "state.sqlite")
    store, other = Store(path), sqlite3.connect(path)
    try:
        did = store.add_decision(replica_group=1, replica_id="r1", decision="evict",
                                 reason="hang", detail="", status="sending")
        other.execute(FAIL)
        with pytest.raises(sqlite3.Error):
            store.update_decision(did, status="failed")
        assert [d["status"] for d in store.decisions()] == ["failed"]  # read as written
        other.execute("DROP TRIGGER no_updates")
        with store.atomic():
            pass
        assert other.execute("SELECT status FROM decisions").fetchall() == [("failed",)]
    finally:
        other.close()
        store.close()
