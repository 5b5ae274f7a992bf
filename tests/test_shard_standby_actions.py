"""A second monitor started with the same ``--shard I/N`` stands by (monitor/service.py,
monitor/act/enforcer.py; docs/monitor.md, Several monitors): it polls and detects, tells no
orphan to exit and no survivor to abort (the monitor that holds the slice does, once), and keeps
its own host ledger, so that a quarantine is released at its TTL whoever holds the slice then.
A holder whose lease may have lapsed acts on nothing either, but still fetches bundles; one
etcd call that times out is asked again before the hold lapses (monitor/shard.py).

Two monitors of shard 0/1 in this process on an in-memory etcd (``MemEtcd``,
tests/test_shard_rails.py; a real one where a lease must expire by itself), simulated ranks (tests/support/monitor_sim.py) whose
``POST /v1/exit`` and ``POST /v1/abort`` record what they were told, the Lighthouse's status
faked (every group in the quorum and heard), a recording quarantine sink shared by both
(tests/test_hosts.py); swept by hand.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

import monitor.service
import monitor.shard
from monitor.api.views import incidents_json
from monitor.config import BundleConfig, DetectorConfig, MonitorConfig, RailsConfig, ShardConfig
from monitor.evidence.lighthouse_status import LighthouseStatus, QuorumMember
from monitor.lease import Etcd, EtcdError, LeaderLease, SessionLease
from monitor.service import Monitor
from tests.support.monitor_sim import SimRanks
from tests.test_hosts import RecordingSink
from tests.test_monitor_shard import running_etcd
from tests.test_shard_rails import PREFIX, ROOT, MemEtcd

EXIT_TOKEN = "exit-tok"
GROUPS = 4


class _Reader:
    """The Lighthouse as read: every group of the quorum, heard."""

    def __init__(self) -> None:
        rids = [f"replica_group_{g}:sim" for g in range(GROUPS)]
        self.status = LighthouseStatus(1, {r: QuorumMember(r, 100, "store", 2) for r in rids},
                                       dict.fromkeys(rids, 0.1))

    def read(self):
        return self.status, None

    def close(self) -> None:
        pass


@pytest.fixture
def pair(tmp_path, monkeypatch):
    """``holder``, ``standby``, their shared ``sink``, the ranks (``sim``: 2 per group, each on
    its own host), ``etcd`` and the Lighthouse's ``reader``."""
    sink = RecordingSink()
    monkeypatch.setattr(monitor.service, "build_sinks", lambda cfg: [sink])
    sim = SimRanks.start(2 * GROUPS, groups=GROUPS)
    sim.probe_token = EXIT_TOKEN  # the token its POST /v1/exit checks
    for r in sim.ranks:
        r.update(host=f"h{r.state['rank']}", node=f"h{r.state['rank']}")
        r.exits = []
    etcd, reader, mons = MemEtcd(), _Reader(), []
    try:
        for name in ("holder", "standby"):
            mon = Monitor(MonitorConfig(
                port=0, state_path=str(tmp_path / f"{name}.sqlite"), targets=sim.urls, job="sim",
                lighthouse="http://127.0.0.1:1", rank_exit_token=EXIT_TOKEN, orphan_grace_s=0.0,
                bundles=BundleConfig(enabled=False), detectors=DetectorConfig(dead_sweeps=2),
                rails=RailsConfig(min_replicas=1, cooldown_s=0),
                shard=ShardConfig(shards=1, index=0, etcd="http://127.0.0.1:1",
                                  etcd_prefix=PREFIX, lease_ttl_s=5)))
            mons.append(mon)
            mon.lighthouse_reader.close()
            mon.lighthouse_reader = reader
            mon.shard.etcd.close()
            mon.shard.etcd, mon.shard.session = etcd, SessionLease(etcd, 5)
        holder, standby = mons
        holder.sweep_once()  # its report: it holds the slice
        standby.sweep_once()
        assert holder.cluster_json()["shard"]["standby"] is False
        assert standby.cluster_json()["shard"]["standby"] is True
        yield SimpleNamespace(holder=holder, standby=standby, sink=sink, sim=sim, etcd=etcd,
                              reader=reader)
    finally:
        for mon in mons:
            mon.stop()
        sim.stop()


def _sweep(*mons: Monitor, times: int = 1) -> None:
    for _ in range(times):
        for mon in mons:
            mon.sweep_once()


def _until(cond, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _host(mon: Monitor, host: str) -> dict | None:
    """``GET /v1/hosts``' row of ``host``."""
    return next((h for h in mon.enforcer.hosts_json()["hosts"] if h["host"] == host), None)


def test_the_standby_shadows_the_holders_quarantine_so_a_handover_leaks_none(pair):
    """Both monitors find the dead rank and quarantine its host in their own ledgers (the
    sinks' actions are idempotent): after a handover the new holder still knows the host and
    releases it at its TTL, where a standby that charged nothing left it cordoned for good."""
    holder, standby, sink, sim = pair.holder, pair.standby, pair.sink, pair.sim
    manager, dead = sim.group(1)  # group ranks 0 and 1 (rank 5, alone on host h5)
    dead.set_mode("down")
    # its Manager blocked in the group's collective: the group waits for the dead rank
    manager.update(timing={"waiting": {"scope": "group", "seconds": 5.0}})
    _sweep(holder, standby, times=4)
    for mon in (holder, standby):
        assert [(f["kind"], f["replica_group"], f["ranks"]) for f in mon.store.findings()] == \
            [("dead_rank", 1, [5])]
        assert mon.hosts.quarantined() == ["h5"]
        assert _host(mon, "h5")["state"] == "quarantined"
    _until(lambda: len(sink.calls) >= 2, "both monitors' quarantine actions")
    assert {(c["event"], c["host"]) for c in sink.calls} == {("quarantine", "h5")}, sink.calls
    # each monitor numbers its own actions: a receiver tells the two apart by monitor.id
    senders = {(c["monitor"]["id"], c["monitor"]["shard"]) for c in sink.calls}
    assert len(senders) == 2 and {shard for _, shard in senders} == {"0/1"}, senders


def test_the_standby_tells_no_orphan_of_a_leader_kill_to_exit(pair):
    """The leader killed group 2 (its record in etcd, as both monitors copy it): its rank the
    kill does not reach are told to exit by the holder alone (here the kill reached none)."""
    holder, standby, sim = pair.holder, pair.standby, pair.sim
    rid = "replica_group_2:sim"
    pair.etcd.put(f"{ROOT}evictions/{rid}", {
        "state": "sent", "replica_id": rid, "replica_group": 2, "kind": "hang", "shard": 0,
        "attempt": 1, "leader": "http://leader", "at": time.time(), "detail": "killed"})
    _sweep(holder, standby, times=2)
    for mon in (holder, standby):  # both copied the leader's kill into their audit log
        assert [(d["replica_id"], d["source"]) for d in mon.store.decisions(decision="evict")] \
            == [(rid, "leader")]
    told = [{"reason": f"replica {rid} was evicted by the monitor"}]
    assert [r.exits for r in sim.group(2)] == [told, told]  # once each, not once per monitor
    assert [r.exits for g in (0, 1, 3) for r in sim.group(g)] == [[]] * 6


def test_the_standby_tells_no_survivor_to_abort(pair):
    """Group 3's host drops off (its ranks silent, the Lighthouse no longer hears it) while the
    others are blocked with it in the cross-group all-reduce: each survivor is told to abort it
    once, by the holder, not once per monitor."""
    holder, standby, sim = pair.holder, pair.standby, pair.sim
    for r in sim.group(3):
        r.set_mode("down")
    for g in (0, 1, 2):
        for r in sim.group(g):
            r.update(phase="allreduce", timing={"waiting": {"scope": "cross", "seconds": 5.0}})
    st = pair.reader.status
    pair.reader.status = LighthouseStatus(st.quorum_id, st.members, {
        rid: s for rid, s in st.heartbeats.items() if rid != "replica_group_3:sim"})
    _sweep(holder, standby, times=2)
    assert [len(r.aborts) for g in (0, 1, 2) for r in sim.group(g)] == [1] * 6
    assert [d["decision"] for d in standby.store.decisions()] == []


class _Away:
    """An etcd that does not answer (every call raises), in place of ``MemEtcd``."""

    def __getattr__(self, name):
        def away(*args, **kwargs):
            raise EtcdError("etcd unreachable: ConnectionError")
        return away


def test_a_holder_whose_lease_may_have_lapsed_tells_no_survivor_to_abort(tmp_path, monkeypatch):
    """The holder loses etcd; once its lease may have lapsed (another monitor may hold the
    slice by then) it tells no survivor to abort; etcd back, it holds again and tells each once."""
    sink = RecordingSink()
    monkeypatch.setattr(monitor.service, "build_sinks", lambda cfg: [sink])
    sim = SimRanks.start(2 * GROUPS, groups=GROUPS)
    sim.probe_token = EXIT_TOKEN
    etcd, reader = MemEtcd(), _Reader()
    mon = Monitor(MonitorConfig(
        port=0, state_path=str(tmp_path / "holder.sqlite"), targets=sim.urls, job="sim",
        lighthouse="http://127.0.0.1:1", rank_exit_token=EXIT_TOKEN,
        bundles=BundleConfig(enabled=False), detectors=DetectorConfig(dead_sweeps=2),
        rails=RailsConfig(min_replicas=1, cooldown_s=0),
        shard=ShardConfig(shards=1, index=0, etcd="http://127.0.0.1:1", etcd_prefix=PREFIX,
                          lease_ttl_s=2)))
    try:
        mon.lighthouse_reader.close()
        mon.lighthouse_reader = reader
        mon.shard.etcd.close()
        mon.shard.etcd, mon.shard.session = etcd, SessionLease(etcd, 2)
        mon.sweep_once()
        assert mon.cluster_json()["shard"]["acting"] is True
        mon.shard.etcd = mon.shard.session.etcd = _Away()
        _until(lambda: not mon.cluster_json()["shard"]["acting"], "the lease to lapse")
        for r in sim.group(3):
            r.set_mode("down")
        for g in (0, 1, 2):
            for r in sim.group(g):
                r.update(phase="allreduce", timing={"waiting": {"scope": "cross", "seconds": 5.0}})
        st = reader.status
        reader.status = LighthouseStatus(st.quorum_id, st.members, {
            rid: s for rid, s in st.heartbeats.items() if rid != "replica_group_3:sim"})
        _sweep(mon, times=3)
        assert [len(r.aborts) for g in (0, 1, 2) for r in sim.group(g)] == [0] * 6
        mon.shard.etcd = mon.shard.session.etcd = etcd
        _sweep(mon, times=2)
        assert mon.cluster_json()["shard"]["acting"] is True
        assert [len(r.aborts) for g in (0, 1, 2) for r in sim.group(g)] == [1] * 6
    finally:
        mon.stop()
        sim.stop()


class _Clock:
    """``monitor.shard``'s time alone (its leases' holds and back-offs), moved by hand: a hold
    lapses without waiting out the TTL, and nothing else in the process sees the jump."""

    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t


class _TimesOutOnce:
    """``MemEtcd`` behind a hung etcd: once ``hang()`` is called, its next call times out."""

    def __init__(self, etcd: MemEtcd) -> None:
        self.etcd, self.hung, self.calls = etcd, False, 0

    def hang(self) -> None:
        self.hung = True

    def __getattr__(self, name):
        real = getattr(self.etcd, name)

        def call(*args, **kwargs):
            self.calls += 1
            if self.hung:
                self.hung = False
                raise EtcdError("etcd did not answer within 5 s", timed_out=True)
            return real(*args, **kwargs)
        return call


def _holder(tmp_path, sim: SimRanks, etcd, bundles: BundleConfig) -> Monitor:
    """One monitor of shard 0/1 (``--lease-ttl 2``, sweeps a second apart) on ``etcd``."""
    mon = Monitor(MonitorConfig(
        port=0, state_path=str(tmp_path / "holder.sqlite"), targets=sim.urls, job="sim",
        lighthouse="http://127.0.0.1:1", rank_exit_token=EXIT_TOKEN, bundles=bundles,
        detectors=DetectorConfig(dead_sweeps=2), rails=RailsConfig(min_replicas=1, cooldown_s=0),
        interval_s=1.0,
        shard=ShardConfig(shards=1, index=0, etcd="http://127.0.0.1:1", etcd_prefix=PREFIX,
                          lease_ttl_s=2)))
    mon.lighthouse_reader.close()
    mon.lighthouse_reader = _Reader()
    mon.shard.etcd.close()
    mon.shard.etcd, mon.shard.session = etcd, SessionLease(etcd, 2)
    return mon


def test_a_holder_whose_lease_may_have_lapsed_still_bundles_a_confirmed_hang(tmp_path,
                                                                             monkeypatch):
    """The holder loses etcd past --lease-ttl (it acts on nothing), then group 3 hangs: it
    never asks for the next quorum while the others wait for it across groups. The hang's
    confirmation bundle is still fetched (read-only; no other monitor may be there to):
    ``GET /v1/incidents`` lists it with the finding."""
    clock = _Clock()
    monkeypatch.setattr(monitor.shard, "time", clock)
    sim = SimRanks.start(2 * GROUPS, groups=GROUPS)
    sim.probe_token = EXIT_TOKEN
    etcd = MemEtcd()
    mon = _holder(tmp_path, sim, etcd, BundleConfig(timeout_s=1.0))
    try:
        mon.sweep_once()
        assert mon.cluster_json()["shard"]["acting"] is True
        mon.shard.etcd = mon.shard.session.etcd = _Away()
        clock.t += 3  # past the hold: another monitor may hold the slice by now
        shard = mon.cluster_json()["shard"]
        assert (shard["acting"], shard["standby"]) == (False, False), shard
        for g in (0, 1, 2):
            for r in sim.group(g):
                r.update(phase="allreduce", timing={"waiting": {"scope": "cross", "seconds": 5.0}})
        _sweep(mon, times=2)
        [hang] = [f for f in mon.store.findings() if f["kind"] == "hang"]
        assert hang["replica_group"] == 3, hang

        def bundled() -> list:
            return [(b["trigger"], b["kind"], b["replica_group"])
                    for b in incidents_json(mon)["bundles"] if b["finding_id"] == hang["id"]]
        _until(bundled, "the hang's confirmation bundle")
        assert bundled() == [("confirm", "hang", 3)]
        assert mon.cluster_json()["shard"]["acting"] is False  # still lapsed: it bundled anyway
    finally:
        mon.shard.etcd = mon.shard.session.etcd = etcd  # _Away cannot even be closed
        mon.stop()
        sim.stop()


def test_a_timed_out_renewal_is_asked_again_before_the_hold_lapses(tmp_path, monkeypatch):
    """etcd times out once, late in the hold (1.5 s into a 2 s lease): backing off a third of
    the TTL would skip the next sweep's renewal and lapse a healthy holder. It asks again in
    the next sweep, so it acts on without a gap, and reports no error once etcd answers."""
    clock = _Clock()
    monkeypatch.setattr(monitor.shard, "time", clock)
    sim = SimRanks.start(GROUPS, groups=GROUPS)
    etcd = _TimesOutOnce(MemEtcd())
    mon = _holder(tmp_path, sim, etcd, BundleConfig(enabled=False))
    try:
        mon.sweep_once()  # renewed at t: held until t + 2
        assert mon.cluster_json()["shard"]["acting"] is True
        clock.t += 1.5
        etcd.hang()
        mon.sweep_once()
        shard = mon.cluster_json()["shard"]
        assert (shard["acting"], shard["error"]) == (True, "etcd did not answer within 5 s")
        clock.t += 0.3  # the next sweep, before the hold's end
        calls = etcd.calls
        mon.sweep_once()
        clock.t += 0.3  # past the first hold's end: renewed, it holds on
        shard = mon.cluster_json()["shard"]
        assert (shard["acting"], shard["error"], shard["standby"]) == (True, None, False), shard
        assert etcd.calls > calls  # renewed in that sweep, not a third of the TTL later
    finally:
        mon.stop()
        sim.stop()


def test_a_holder_whose_proposal_another_run_withdrew_proposes_it_again(pair):
    """The holder proposes group 1's eviction; its lease lapses (a sweep outlasted it), the
    standby takes the slice and withdraws the proposal as an earlier run's, then lapses in turn
    before proposing anew. The holder, holding again, proposes it again: else no proposal
    stands while the finding does and the leader never evicts."""
    holder, standby, etcd = pair.holder, pair.standby, pair.etcd
    rid = "replica_group_1:sim"
    manager, dead = pair.sim.group(1)
    dead.set_mode("down")
    manager.update(timing={"waiting": {"scope": "group", "seconds": 5.0}})

    def proposed_by() -> str | None:
        p = etcd.value(f"proposals/{rid}")
        return p["run"] if p else None

    def lapse(mon: Monitor) -> None:  # etcd lets its lease go: the report under it goes too
        etcd.call("/v3/lease/revoke", {"ID": str(mon.shard.session.lease)})

    for _ in range(6):
        _sweep(holder, standby)
        if proposed_by():
            break
    assert proposed_by() == holder.shard.run
    lapse(holder)
    _sweep(standby, times=2)  # takes the slice, then withdraws the holder's proposal
    assert proposed_by() is None
    assert [d["detail"] for d in standby.store.decisions(decision="withdrawn")] == [
        "made by an earlier run of this shard: proposed anew while a finding stands behind it"]
    lapse(standby)
    for _ in range(6):
        _sweep(holder)
        if proposed_by():
            break
    shard = holder.cluster_json()["shard"]
    assert (shard["acting"], shard["standby"]) == (True, False), shard
    assert proposed_by() == holder.shard.run


@pytest.fixture
def real_etcd(tmp_path):
    with running_etcd(tmp_path) as url:
        yield url


def test_a_holder_proposing_evictions_for_longer_than_its_lease_keeps_it(tmp_path, real_etcd):
    """Groups 1, 2 and 3 each lose a rank (silent: each proposal's bundle waits out
    --bundle-timeout 1.5 s on the sweep's thread) under --lease-ttl 2: the sweep that proposes
    the three outlasts the lease unless it is renewed between them. The holder's report stands
    after that sweep, with its run, so a leader reads the three proposals as this run's."""
    sim = SimRanks.start(2 * GROUPS, groups=GROUPS)
    mon = _holder(tmp_path, sim, Etcd(real_etcd), BundleConfig(timeout_s=1.5))
    etcd = Etcd(real_etcd)
    leader = LeaderLease(etcd, ROOT + "leader", {"name": "leader"}, 60)  # one acts on it
    assert leader.campaign()
    try:
        mon.sweep_once()
        assert mon.cluster_json()["shard"]["acting"] is True
        for g in (1, 2, 3):
            manager, dead = sim.group(g)
            dead.set_mode("silent")
            manager.update(timing={"waiting": {"scope": "group", "seconds": 5.0}})

        def proposed() -> dict:
            return {kv.key.rsplit("/", 1)[1]: kv.json()["run"]
                    for kv in etcd.range_prefix(f"{ROOT}proposals/")}
        for _ in range(4):
            mon.sweep_once()
            shard = mon.cluster_json()["shard"]
            assert (shard["error"], shard["acting"]) == (None, True), shard
            if len(proposed()) == 3:
                break
        assert proposed() == {f"replica_group_{g}:sim": mon.shard.run for g in (1, 2, 3)}
        report = etcd.get(f"{ROOT}shards/0")
        assert report is not None and report.json()["run"] == mon.shard.run
        assert len(incidents_json(mon)["bundles"]) == 3  # kept before each proposal
    finally:
        leader.resign()
        etcd.close()
        mon.stop()
        sim.stop()
