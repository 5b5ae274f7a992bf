"""No confirmation bundle for a group incarnation the monitor sent a kill for
(monitor/act/enforcer.py, ``bundle_confirmed``; docs/monitor.md, Incident bundles).

A monitor swept by hand on its injected clock over a real torchft Lighthouse that simulated
groups join (``SimJob``, tests/support/monitor_sim.py: the kill takes the group's ranks down as
its exiting Manager would). Group 2's second rank stops answering (SIGSTOPped): ``dead_rank`` is
confirmed and evicted. The hang and mismatch findings beside it are added to the detectors' own
output, as the Flight Recorder engine confirms them on a real job (a Manager rank blocked on the
stopped one); the other groups' findings, held by ``--min-replicas``, get their confirmation
bundles and, the bundles' helper taking them in order, say when every earlier one is written.
"""

from __future__ import annotations

import time

import pytest

from monitor.api.app import create_app
from monitor.config import BundleConfig, DetectorConfig, MonitorConfig, RailsConfig
from monitor.detect import Finding
from monitor.service import Monitor
from tests.support.monitor_sim import SimJob


@pytest.fixture
def job():
    j = SimJob(3, ranks_per_group=2)
    yield j
    j.stop()


def test_no_confirmation_bundle_for_a_group_already_sent_a_kill(tmp_path, job):
    clock = [time.time()]
    mon = Monitor(MonitorConfig(
        port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"),
        targets=job.sim.urls, job="sim", lighthouse=job.url,
        rails=RailsConfig(min_replicas=2, cooldown_s=0),
        detectors=DetectorConfig(dead_sweeps=2), bundles=BundleConfig(timeout_s=1.0)),
        clock=lambda: clock[0])
    client = create_app(mon).test_client()
    # (kind, group, culprit ranks) added in the sweep that confirms dead_rank, then in the next
    extra = [[("hang", 2, [4]), ("hang", 1, [2])], [("mismatch", 2, [4]), ("mismatch", 0, [0])]]
    _add_findings(mon, job, clock, extra,
                  when=lambda new: any(f.kind == "dead_rank" for f in new) or len(extra) == 1)

    def bundles() -> set[tuple]:
        rows = client.get("/v1/incidents").get_json()["bundles"]
        return {(b["trigger"], b["kind"], b["replica_group"]) for b in rows}

    try:
        job.train_and_sweep(mon, clock, 10)
        job.sim.group(2)[1].set_mode("silent")
        for _ in range(6):
            clock[0] += 1.0
            mon.sweep_once()
            if not extra:
                break
        assert not extra, "dead_rank never confirmed"
        [kill] = client.get("/v1/evictions?decision=evict").get_json()
        assert (kill["replica_group"], kill["reason"], kill["status"]) == (2, "dead_rank", "sent")
        assert job.kills == [job.replica_ids[2]]
        deadline = time.monotonic() + 20
        while ("confirm", "mismatch", 0) not in bundles():  # the helper's last one
            assert time.monotonic() < deadline, bundles()
            time.sleep(0.05)
        # the kill's bundle is group 2's evidence: none fetched after it, of ranks going down
        assert bundles() == {("evict", "dead_rank", 2), ("confirm", "hang", 1),
                             ("confirm", "mismatch", 0)}, bundles()
    finally:
        mon.stop()


def _confirm_bundles(client) -> set[tuple]:
    return {(b["trigger"], b["kind"], b["replica_group"])
            for b in client.get("/v1/incidents").get_json()["bundles"]}


def _wait_for(client, row: tuple) -> None:
    """The helper writes bundles in order: ``row`` there, every earlier one is written too."""
    deadline = time.monotonic() + 20
    while row not in _confirm_bundles(client):
        assert time.monotonic() < deadline, _confirm_bundles(client)
        time.sleep(0.05)


def _add_findings(mon, job, clock, extra: list[list[tuple]], when=lambda new: True) -> None:
    """Findings the engine would confirm, ``extra``'s first batch of (kind, group, culprit
    ranks) added to the detectors' output at the next sweep whose own findings ``when`` takes."""
    real = mon.detectors.update

    def update(*args, **kwargs):
        new = real(*args, **kwargs)
        for kind, g, ranks in extra.pop(0) if extra and when(new) else []:
            f = Finding(kind, g, job.replica_ids[g], ranks, {"summary": "as the engine"},
                        clock[0], clock[0])
            if mon.detectors.report(f):
                new.append(f)
        return new

    mon.detectors.update = update


def test_a_live_group_whose_kill_turned_unconfirmed_keeps_its_confirmation_bundles(tmp_path):
    """The kill never reached the group (the Lighthouse cannot resolve its host): it turns
    ``unconfirmed`` and the group trains on; its next hang is evidence worth keeping."""
    job = SimJob(3)
    job.kill = lambda rid: False  # sent, but the group lives on
    clock = [time.time()]
    mon = Monitor(MonitorConfig(
        port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"), token="s3cret",
        targets=job.sim.urls, job="sim", lighthouse=job.url,
        rails=RailsConfig(min_replicas=2, cooldown_s=0), bundles=BundleConfig(timeout_s=1.0)),
        clock=lambda: clock[0])
    client = create_app(mon).test_client()
    extra: list[list[tuple]] = []
    _add_findings(mon, job, clock, extra)
    try:
        job.train_and_sweep(mon, clock, 5)
        r = client.post("/v1/evict", json={"replica_group": 2, "reason": "test"},
                        headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200, r.get_data(as_text=True)
        job.train_and_sweep(mon, clock, 70)  # past the confirmation window: still training
        [kill] = client.get("/v1/evictions?decision=evict").get_json()
        assert kill["status"] == "unconfirmed"
        extra[:] = [[("hang", 2, [2])]]
        job.train_and_sweep(mon, clock, 1)
        _wait_for(client, ("confirm", "hang", 2))
    finally:
        mon.stop()
        job.stop()


def test_no_confirmation_bundle_for_a_group_a_shard_proposed_that_sweep(tmp_path, job):
    """A shard keeps its proposal's bundle (``keep_bundle``, as monitor/shard.py does) and the
    leader may kill at any moment: the group's other new finding gets no bundle fetched after."""
    clock = [time.time()]
    mon = Monitor(MonitorConfig(
        port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"),
        targets=job.sim.urls, job="sim", lighthouse=job.url,
        rails=RailsConfig(min_replicas=2, cooldown_s=0, evict_kinds=("mismatch",)),
        bundles=BundleConfig(timeout_s=1.0)), clock=lambda: clock[0])
    client = create_app(mon).test_client()
    extra: list[list[tuple]] = []
    _add_findings(mon, job, clock, extra)
    real = mon.enforcer.bundle_confirmed

    def bundle_confirmed(view, evidence, new):
        for f in new:
            if f.kind == "straggler":  # proposed to the leader, bundled first
                mon.enforcer.keep_bundle(view, evidence, f.to_dict(), mon.enforcer.finding_id(f.key), {
                    "decision": "proposed", "reason": f.kind, "source": "auto",
                    "status": "proposing", "replica_group": f.replica_group,
                    "replica_id": f.replica_id, "at": clock[0]})
        real(view, evidence, new)

    mon.enforcer.bundle_confirmed = bundle_confirmed
    try:
        job.train_and_sweep(mon, clock, 5)
        extra[:] = [[("straggler", 2, [4]), ("hang", 2, [4]), ("hang", 1, [2])]]
        job.train_and_sweep(mon, clock, 1)
        _wait_for(client, ("confirm", "hang", 1))
        assert _confirm_bundles(client) == {("evict", "straggler", 2), ("confirm", "hang", 1)}
    finally:
        mon.stop()
