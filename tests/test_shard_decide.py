"""A shard decides its findings as the single monitor's enforcer does (monitor/shard.py,
monitor/act/enforcer.py; docs/monitor.md, Eviction and safety rails): one decide loop, so a
finding of a group no rank of which answers is no proposal either, and one blindness rule.

Monitors of shards in this process on a real etcd (tests/test_monitor_shard.py), simulated ranks
(tests/support/monitor_sim.py), the Lighthouse's status faked (every group in the quorum and
heard); swept by hand.
"""

from __future__ import annotations

import dataclasses

import pytest

from lightkeeper.processes import free_port, wait_until
from monitor.config import BundleConfig, DetectorConfig, MonitorConfig, RailsConfig, ShardConfig
from monitor.detect import Finding
from monitor.lease import Etcd
from monitor.service import Monitor
from monitor.shard import Leader, shard_of
from tests.support.monitor_sim import SimRanks
from tests.test_monitor_shard import _Lighthouse, running_etcd
from tests.test_shard_rails import PREFIX, ROOT
from tests.test_shard_standby_actions import GROUPS, _Reader


@pytest.fixture
def etcd_url(tmp_path):
    with running_etcd(tmp_path) as url:
        yield url


def _shard(tmp_path, sim: SimRanks, etcd_url: str, index: int = 0, shards: int = 1,
           bundles: bool = False, more: tuple[str, ...] = (), lease_ttl_s: int = 5,
           **rails) -> Monitor:
    """Shard ``index``/``shards`` on the real etcd, its ranks ``sim``'s (and the targets
    ``more``); --dead-sweeps 10: no group is judged gone while a test runs. A test that waits
    for the lease to lapse takes the shortest TTL etcd grants (2 s): it waits that TTL out."""
    mon = Monitor(MonitorConfig(
        port=0, state_path=str(tmp_path / f"m{index}.sqlite"), targets=[*sim.urls, *more],
        job="sim",
        lighthouse="http://127.0.0.1:1", bundles=BundleConfig(enabled=bundles, timeout_s=0.5),
        detectors=DetectorConfig(dead_sweeps=10),
        rails=RailsConfig(min_replicas=1, cooldown_s=0, **rails),
        shard=ShardConfig(shards=shards, index=index, etcd=etcd_url, etcd_prefix=PREFIX,
                          lease_ttl_s=lease_ttl_s)))
    mon.lighthouse_reader.close()
    mon.lighthouse_reader = _Reader()
    return mon


def _leader(mon: Monitor, lighthouse: _Lighthouse) -> Leader:
    """A leader candidate beside shard ``mon``, the Lighthouse it reads and kills through faked."""
    leader = Leader(mon.shard.cfg, mon, ROOT)
    leader.lighthouse.close()
    leader.reader.close()
    leader.lighthouse = leader.reader = lighthouse
    return leader


def _resign(leader: Leader) -> None:
    leader.election.resign()
    leader.etcd.close()


def _open_mismatch(mon: Monitor, group: int, rid: str) -> None:
    """A mismatch of ``group`` open in ``mon``, handed in as the sweep's detectors confirm one."""
    f = Finding("mismatch", group, rid, [group], {"culprits": [{"rank": group, "step": 10**9}]},
                mon.clock(), mon.clock())
    assert mon.detectors.report(f)
    mon.enforcer.record([f], mon.clock())


def test_a_shard_that_knows_no_verified_rank_reports_itself_blind(tmp_path, etcd_url):
    """None of its ranks answers yet (none verified): the shard is blind, as the single
    monitor's rails are (nothing shows it is not the one cut off), and its report says so, so
    the leader holds every kill. Once they answer, it is not."""
    sim = SimRanks.start(2 * GROUPS, groups=GROUPS)
    for r in sim.ranks:
        r.set_mode("down")
    etcd = Etcd(etcd_url)
    mon = _shard(tmp_path, sim, etcd_url)

    def reported_blind() -> str | None:
        return etcd.get(f"{ROOT}shards/0").json()["blind"]

    try:
        mon.sweep_once()
        assert reported_blind() == \
            "shard 0 reaches only 0% of the ranks it knows; it may be the problem"
        for r in sim.ranks:
            r.set_mode("ok")
        for _ in range(3):
            mon.sweep_once()
            if reported_blind() is None:
                break
        assert reported_blind() is None
    finally:
        mon.stop()
        etcd.close()
        sim.stop()


@pytest.mark.parametrize("stray", [None, "dead", "groupless"])
def test_a_shard_whose_slice_holds_no_group_is_not_blind(tmp_path, etcd_url, stray):
    """Two shards, one group (group 0, shard 0's): shard 1's slice holds no rank while the job
    has some, every one placed in shard 0's slice. Shard 1 has nothing to be cut off from: it
    reports itself not blind, so the leader kills group 0 on shard 0's proposal (blind, it would
    hold every kill of the job). So too with a stray target no shard can place: one nobody
    listens at (a dead --targets entry), or one answering without a replica group."""
    assert shard_of(0, 2) == 0
    sim = SimRanks.start(2, groups=1)
    other = SimRanks.start(1)
    other.ranks[0].update(replica_group=None)
    more = {None: (), "dead": (f"http://127.0.0.1:{free_port()}",), "groupless": other.urls}
    etcd = Etcd(etcd_url)
    m0 = _shard(tmp_path, sim, etcd_url, evict_kinds=("mismatch",), shards=2, more=more[stray])
    m1 = _shard(tmp_path, sim, etcd_url, evict_kinds=("mismatch",), index=1, shards=2,
                more=more[stray])
    rid = "replica_group_0:sim"
    # the Lighthouse hears more groups than the ranks show: min replicas holds no kill
    lighthouse = _Lighthouse([f"replica_group_{g}:sim" for g in range(GROUPS)])
    leader = _leader(m0, lighthouse)
    try:
        for _ in range(2):
            m0.sweep_once()
            m1.sweep_once()
        _open_mismatch(m0, 0, rid)
        m0.sweep_once()
        m1.sweep_once()
        report = etcd.get(f"{ROOT}shards/1").json()
        assert (report["ranks"], report["blind"]) == (0, None)
        assert [kv.key for kv in etcd.range_prefix(f"{ROOT}proposals/")] == \
            [f"{ROOT}proposals/{rid}"]
        assert leader.election.campaign()
        leader.lead_once()  # one tick of Leader.run, on this thread
        assert lighthouse.kills == [rid]
    finally:
        _resign(leader)
        m0.stop()
        m1.stop()
        etcd.close()
        sim.stop()
        other.stop()


def test_a_shard_proposes_no_eviction_of_a_group_out_of_sight(tmp_path, etcd_url):
    """Group 3's ranks stop answering; a mismatch of group 3 is open (handed in as the sweep's
    detectors confirm one). The shard holding the slice proposes nothing for group 3 while
    nobody sees it (a single monitor would not kill it either); once its ranks answer again,
    it proposes the eviction."""
    sim = SimRanks.start(2 * GROUPS, groups=GROUPS)
    etcd = Etcd(etcd_url)
    mon = _shard(tmp_path, sim, etcd_url, evict_kinds=("mismatch",))
    rid = "replica_group_3:sim"

    def proposals() -> list[str]:
        return [kv.key.rsplit("/", 1)[1] for kv in etcd.range_prefix(f"{ROOT}proposals/")]

    try:
        for _ in range(2):
            mon.sweep_once()
        assert mon.cluster_json()["shard"]["acting"] is True
        for r in sim.group(3):
            r.set_mode("down")
        mon.sweep_once()
        # culprits at a step the group never reaches: not resolved while the test runs
        _open_mismatch(mon, 3, rid)
        for _ in range(2):
            mon.sweep_once()
        assert [g["replica_group"] for g in mon.cluster_json()["groups"]
                if not any(r["reachable"] for r in g["ranks"])] == [3]
        assert [x["kind"] for x in mon.enforcer.open_findings()] == ["mismatch"]
        assert proposals() == []
        for r in sim.group(3):
            r.set_mode("ok")
        for _ in range(3):
            mon.sweep_once()
            if proposals():
                break
        assert proposals() == [rid]
    finally:
        mon.stop()
        etcd.close()
        sim.stop()


def test_a_proposal_stays_while_its_group_flaps_and_goes_once_its_finding_resolves(
        tmp_path, etcd_url):
    """A mismatch of group 3 is open and proposed; the group's ranks then stop answering every
    other sweep. The proposal stays (one proposal, one audit row, one incident bundle), not
    withdrawn and made again each time the group comes back, and no leader acts meanwhile. Out
    of sight for --dead-sweeps sweeps, the finding resolves (left_job) and the proposal goes."""
    sim = SimRanks.start(2 * GROUPS, groups=GROUPS)
    etcd = Etcd(etcd_url)
    mon = _shard(tmp_path, sim, etcd_url, bundles=True, evict_kinds=("mismatch",))
    rid = "replica_group_3:sim"

    def proposals() -> list[str]:
        return [kv.key.rsplit("/", 1)[1] for kv in etcd.range_prefix(f"{ROOT}proposals/")]

    try:
        for _ in range(2):
            mon.sweep_once()
        _open_mismatch(mon, 3, rid)
        mon.sweep_once()
        assert proposals() == [rid]
        for _ in range(3):
            for mode in ("down", "ok"):
                for r in sim.group(3):
                    r.set_mode(mode)
                mon.sweep_once()
                assert proposals() == [rid], mode
        assert [(d["decision"], d["reason"]) for d in mon.store.decisions()] == [
            ("proposed", "mismatch")]
        assert mon.cluster_json()["shard"]["proposals_made"] == len(mon.store.bundles()) == 1
        for r in sim.group(3):
            r.set_mode("down")
        for _ in range(mon.cfg.detectors.dead_sweeps + 2):
            mon.sweep_once()
            if not proposals():
                break
        assert proposals() == []
        assert [x["resolution"] for x in mon.store.findings() if x["kind"] == "mismatch"] == [
            "left_job"]
        assert [d["detail"] for d in mon.store.decisions(decision="withdrawn")] == [
            "no open finding stands behind the proposal, or this shard is blind"]
    finally:
        mon.stop()
        etcd.close()
        sim.stop()


def test_a_proposal_left_by_a_shard_of_an_earlier_shard_count_gives_way_to_the_owner(
        tmp_path, etcd_url):
    """A proposal for group 3 stands from shard 3 of an earlier --shards 4 (stopped: it does
    not report), so the leader holds it as ``stale_proposal``. Group 3's owner under this
    --shards withdraws it and, its own mismatch of group 3 open, proposes the eviction itself:
    the leader kills the group once. One of group 2 by a shard still reporting that run (a
    monitor of another --shards still up) stays: no tug of war between the two."""
    sim = SimRanks.start(2 * GROUPS, groups=GROUPS)
    etcd = Etcd(etcd_url)
    mon = _shard(tmp_path, sim, etcd_url, evict_kinds=("mismatch",))
    rid = "replica_group_3:sim"
    key, live = f"{ROOT}proposals/{rid}", f"{ROOT}proposals/replica_group_2:sim"
    orphan = {"monitor": "http://127.0.0.1:1", "at": 0.0, "source": "auto", "manual": False,
              "kind": "dead", "detail": ""}
    etcd.put(key, {**orphan, "replica_group": 3, "replica_id": rid, "shard": 3, "run": "old"})
    etcd.put(live, {**orphan, "replica_group": 2, "replica_id": "replica_group_2:sim",
                    "shard": 1, "run": "up"})
    etcd.put(f"{ROOT}shards/1", {"shard": 1, "shards": 4, "run": "up"})
    lighthouse = _Lighthouse([f"replica_group_{g}:sim" for g in range(GROUPS)])
    leader = _leader(mon, lighthouse)
    try:
        for _ in range(2):
            mon.sweep_once()
        _open_mismatch(mon, 3, rid)
        for _ in range(3):
            mon.sweep_once()
            if etcd.get(key).json()["run"] == mon.shard.run:
                break
        assert etcd.get(key).json()["shard"] == 0
        assert [(d["replica_id"], d["reason"]) for d in
                mon.store.decisions(decision="withdrawn")] == [(rid, "dead")]
        assert etcd.get(live).json()["run"] == "up"
        assert etcd.delete_if([], f"{ROOT}shards/1")  # that monitor stopped: leader not blind
        assert leader.election.campaign()
        leader.lead_once()  # one tick of Leader.run, on this thread
        assert lighthouse.kills == [rid]
    finally:
        _resign(leader)
        mon.stop()
        etcd.close()
        sim.stop()


def test_the_leader_holds_a_proposal_while_its_group_is_out_of_sight(tmp_path, etcd_url):
    """A proposal for group 3 the leader held (min replicas: the Lighthouse's quorum holds only
    group 3) stays while group 3's ranks stop answering. Once the quorum is whole the leader
    still sends no kill while the shard's report says nobody sees the group (``out_of_sight``,
    as a single monitor holds it); once its ranks answer again, the group is killed."""
    sim = SimRanks.start(2 * GROUPS, groups=GROUPS)
    etcd = Etcd(etcd_url)
    mon = _shard(tmp_path, sim, etcd_url, evict_kinds=("mismatch",))
    rid = "replica_group_3:sim"
    lighthouse = _Lighthouse([rid])
    leader = _leader(mon, lighthouse)

    def leader_holds() -> list[str]:
        return [d["reason"] for d in mon.store.decisions(decision="hold")
                if d["source"] == "leader"]

    try:
        _hold_a_proposal(mon, leader, lighthouse, rid)
        assert leader_holds() == ["min_replicas"]
        for r in sim.group(3):
            r.set_mode("down")
        mon.sweep_once()
        assert etcd.get(f"{ROOT}shards/0").json()["out_of_sight"] == [rid]
        lighthouse.status = _Lighthouse([f"replica_group_{g}:sim" for g in range(GROUPS)]).status
        leader.lead_once()
        assert [kv.key for kv in etcd.range_prefix(f"{ROOT}proposals/")] == \
            [f"{ROOT}proposals/{rid}"]
        assert (lighthouse.kills, leader_holds()) == ([], ["out_of_sight", "min_replicas"])
        for r in sim.group(3):
            r.set_mode("ok")
        for _ in range(3):
            mon.sweep_once()
            if not etcd.get(f"{ROOT}shards/0").json()["out_of_sight"]:
                break
        leader.lead_once()
        assert lighthouse.kills == [rid]
    finally:
        _resign(leader)
        mon.stop()
        etcd.close()
        sim.stop()


def test_a_proposal_stays_while_its_group_flaps_in_a_slice_it_blinds(tmp_path, etcd_url):
    """Shard 0 of 2 owns groups 0 and 2: group 2 out of sight leaves it 50% of its ranks
    (--min-reachable 0.5), blind. A proposal for group 2 stays while the group flaps (one
    proposal, one bundle), listed ``out_of_sight`` while it is away, not withdrawn and made
    again each time the group comes back."""
    assert [shard_of(g, 2) for g in range(3)] == [0, 1, 0]
    sim = SimRanks.start(6, groups=3)
    etcd = Etcd(etcd_url)
    mon = _shard(tmp_path, sim, etcd_url, shards=2, bundles=True, evict_kinds=("mismatch",),
                 min_reachable_fraction=0.5)
    rid = "replica_group_2:sim"

    def report() -> tuple[list[str], list[str], bool]:
        r = etcd.get(f"{ROOT}shards/0").json()
        return ([kv.key.rsplit("/", 1)[1] for kv in etcd.range_prefix(f"{ROOT}proposals/")],
                r["out_of_sight"], r["blind"] is not None)

    try:
        for _ in range(2):
            mon.sweep_once()
        _open_mismatch(mon, 2, rid)
        mon.sweep_once()
        assert report() == ([rid], [], False)
        for _ in range(3):
            for mode, seen in (("down", ([rid], [rid], True)), ("ok", ([rid], [], False))):
                for r in sim.group(2):
                    r.set_mode(mode)
                mon.sweep_once()
                assert report() == seen, mode
        assert [(d["decision"], d["reason"]) for d in mon.store.decisions()] == [
            ("proposed", "mismatch")]
        assert mon.cluster_json()["shard"]["proposals_made"] == len(mon.store.bundles()) == 1
    finally:
        mon.stop()
        etcd.close()
        sim.stop()


def test_a_shard_cut_off_from_a_group_heard_under_a_new_id_stays_blind(tmp_path, etcd_url):
    """Shard 1 of 2 owns only group 1, whose ranks it can no longer reach while the group trains
    on in the Lighthouse under a new replica id (a torchft restart takes a new uuid). The id the
    shard knows is no longer heard, but that is no group gone: shard 1 sees none of its slice
    and must report itself blind (a leader would otherwise kill on other shards' proposals
    while this slice is unseen)."""
    sim = SimRanks.start(6, groups=3)
    etcd = Etcd(etcd_url)
    m1 = _shard(tmp_path, sim, etcd_url, evict_kinds=("mismatch",), index=1, shards=2)
    try:
        for _ in range(2):
            m1.sweep_once()
        assert etcd.get(f"{ROOT}shards/1").json()["blind"] is None
        for r in sim.group(1):
            r.set_mode("down")  # the shard is cut off from them
        status = m1.lighthouse_reader.status  # group 1 restarted: heard under a new id
        member = status.members.pop("replica_group_1:sim")
        status.members["replica_group_1:new"] = dataclasses.replace(
            member, replica_id="replica_group_1:new")
        status.heartbeats["replica_group_1:new"] = status.heartbeats.pop("replica_group_1:sim")
        for _ in range(2):
            m1.sweep_once()
        assert etcd.get(f"{ROOT}shards/1").json()["blind"] is not None
    finally:
        m1.stop()
        etcd.close()
        sim.stop()


def _lapsing(tmp_path, etcd_url):
    """A shard on a 2 s lease (the shortest etcd grants) and a leader whose Lighthouse holds
    group 3's kill (min replicas): (ranks, etcd, shard, Lighthouse, leader)."""
    sim = SimRanks.start(2 * GROUPS, groups=GROUPS)
    etcd = Etcd(etcd_url)
    mon = _shard(tmp_path, sim, etcd_url, evict_kinds=("mismatch",), lease_ttl_s=2)
    lighthouse = _Lighthouse(["replica_group_3:sim"])
    return sim, etcd, mon, lighthouse, _leader(mon, lighthouse)


def _hold_a_proposal(mon, leader, lighthouse, rid: str) -> None:
    """Group 3's mismatch proposed; the leader holds it (min replicas)."""
    for _ in range(2):
        mon.sweep_once()
    _open_mismatch(mon, 3, rid)
    mon.sweep_once()
    assert leader.election.campaign()
    leader.lead_once()
    assert lighthouse.kills == []


def test_a_shard_whose_lease_lapsed_still_lists_its_proposals_out_of_sight(tmp_path, etcd_url):
    """The leader holds group 3's proposal (min replicas), then group 3 goes out of sight; the
    shard's sweeps stall past its lease's TTL. Its first report back (a new lease: not acting
    yet) must still list the proposal out of sight; before, it listed none and the leader,
    its min replicas met, killed a group no rank of which answers."""
    sim, etcd, mon, lighthouse, leader = _lapsing(tmp_path, etcd_url)
    rid = "replica_group_3:sim"
    try:
        _hold_a_proposal(mon, leader, lighthouse, rid)
        for r in sim.group(3):
            r.set_mode("down")
        mon.sweep_once()
        assert etcd.get(f"{ROOT}shards/0").json()["out_of_sight"] == [rid]
        # no sweep for longer than the lease's TTL: etcd drops the report with the lease
        wait_until(lambda: etcd.get(f"{ROOT}shards/0") is None,
                   mon.shard.session.granted_ttl + 10, interval=0.2, what="the lease lapsed")
        mon.sweep_once()
        assert etcd.get(f"{ROOT}shards/0").json()["out_of_sight"] == [rid]
        lighthouse.status = _Lighthouse([f"replica_group_{g}:sim" for g in range(GROUPS)]).status
        assert leader.election.campaign()
        leader.lead_once()
        assert lighthouse.kills == []
    finally:
        _resign(leader)
        mon.stop()
        etcd.close()
        sim.stop()


@pytest.mark.parametrize("lapse", ["between_sweeps", "while_proposing"])
def test_a_finding_resolved_across_a_lapse_is_no_kill(tmp_path, etcd_url, monkeypatch, lapse):
    """The leader holds group 3's proposal (min replicas); its mismatch resolves while the shard's
    lease lapses: between sweeps (a long sweep), or while it proposes group 2 (a bundle longer
    than the lease). That sweep withdraws nothing, so its report (a new lease, the same run)
    must not vouch for group 3's proposal: before, the leader, the quorum whole, killed group 3
    on a finding no longer open. The next sweep withdraws it."""
    sim, etcd, mon, lighthouse, leader = _lapsing(tmp_path, etcd_url)
    rid = "replica_group_3:sim"

    def lapsed() -> None:  # no sweep for longer than the TTL: etcd drops the report
        wait_until(lambda: etcd.get(f"{ROOT}shards/0") is None,
                   mon.shard.session.granted_ttl + 10, interval=0.2, what="the lease lapsed")

    def bundle_outlasting_the_lease(*a):
        lapsed()
        return keep_bundle(*a)

    try:
        _hold_a_proposal(mon, leader, lighthouse, rid)
        # the sweep's detectors resolve it (as mismatch.py does when the culprit goes)
        mon.detectors.findings.resolve(mon.detectors.open_findings()[0].key, "no_longer_seen",
                                       mon.clock())
        if lapse == "between_sweeps":
            lapsed()
        else:
            _open_mismatch(mon, 2, "replica_group_2:sim")
            keep_bundle = mon.enforcer.keep_bundle
            monkeypatch.setattr(mon.enforcer, "keep_bundle", bundle_outlasting_the_lease)
        mon.sweep_once()
        assert etcd.get(f"{ROOT}shards/0") is not None  # reported under a new lease
        lighthouse.status = _Lighthouse([f"replica_group_{g}:sim" for g in range(GROUPS)]).status
        assert leader.election.campaign()
        leader.lead_once()
        assert lighthouse.kills == []
        monkeypatch.undo()
        mon.sweep_once()
        assert etcd.get(f"{ROOT}proposals/{rid}") is None
        assert [d["replica_id"] for d in mon.store.decisions(decision="withdrawn")] == [rid]
    finally:
        _resign(leader)
        mon.stop()
        etcd.close()
        sim.stop()
