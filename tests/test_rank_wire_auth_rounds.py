"""The signed calls' edges (rank_wire.auth): a probe round completes though a rank is busy with
another monitor's probe (429), a standby shard asks no round, a rank known under two URLs of one
listener is still called, a skipped abort is no failed try, a bearer refusal says the rank's
words, and a POST without its JSON content type is told which header is missing.
"""

from __future__ import annotations

import json
import logging
import time

import pytest

from monitor.act.actions import RankCalls
from monitor.act.survivors import ABORT_TRIES, Survivors
from monitor.api.metrics import MonitorMetrics
from monitor.config import ProbeConfig
from monitor.evidence.claims import Claims
from monitor.evidence.lighthouse_status import LighthouseStatus, QuorumMember
from monitor.evidence.probes import ProbeMesh
from monitor.evidence.view import ViewBuilder
from monitor.poll.discovery import Target
from monitor.poll.packed_state import pack_state
from monitor.poll.poller import RankPoll
from monitor.store import Store
from tests.support.fake_rank import FakeRanks
from worker_server.app import create_app
from worker_server.state import RankIdentity, RankState

TOKEN = "s3cret-exit-token"


@pytest.fixture
def fakes():
    ranks = FakeRanks(2)
    yield ranks
    ranks.stop()


def state_of(url: str, g: int, **more) -> dict:
    """Group ``g``'s rank 0 on host h<g>, in quorum 1."""
    s = RankState(RankIdentity(job="auth", replica_group=g, group_rank=0, group_world_size=1,
                               host=f"h{g}")).snapshot()
    s.update(replica_id=f"replica_group_{g}:auth", worker_url=url, quorum_id=1,
             participating=True, num_participants=2, **more)
    return s


def view_of(answering: dict[str, dict], unreachable: dict[str, dict] | None = None):
    """A sweep's view: ``answering`` (URL -> state) answered; ``unreachable``'s answered the
    sweep before (their last state is known) and not this one."""
    unreachable = unreachable or {}
    targets = [Target(u, "static") for u in (*answering, *unreachable)]
    polls = {u: RankPoll(u, True, data=pack_state(s)) for u, s in answering.items()}
    b = ViewBuilder()
    b.update(targets, {**polls, **{u: RankPoll(u, True, data=pack_state(s))
                                   for u, s in unreachable.items()}}, now=time.time() - 5)
    return b.update(targets, {**polls, **{u: RankPoll(u, False, error="refused")
                                          for u in unreachable}}, now=time.time())


# --- 1. a probe round with a rank busy with another monitor's probe ---------------------------

def test_a_rank_busy_with_another_probe_is_asked_again_and_the_round_is_whole(fakes):
    """Two monitors of one job probing the same ranks (a standby, a rolling update): the rank
    answers the second 429; asked again within the round, its row is there (a missing row names
    no network culprit)."""
    fakes[0].answers = [(429, {"error": "another probe is running on this rank"})]
    urls = fakes.urls
    mesh = ProbeMesh(ProbeConfig(timeout_s=0.1), TOKEN)
    view = view_of({u: state_of(u, g) for g, u in enumerate(urls)})
    mesh.ask(view, True, None, time.time())
    assert mesh.wait(10)
    rnd = mesh.take()
    assert rnd is not None and rnd.missing() == {}
    assert fakes[0].paths == ["/v1/probe"] * 2 and fakes[1].paths == ["/v1/probe"]
    # busy on every try: asked BUSY_RETRIES times more, then named busy
    fakes[0].answers = [(429, {"error": "busy"})] * 5
    mesh.ask(view, True, None, time.time() + 10)  # past --probe-interval
    assert mesh.wait(10)
    assert "busy" in mesh.take().missing()["h0"] and len(fakes[0].paths) == 2 + 3


def test_a_bearer_refusal_says_the_ranks_words(fakes):
    """--rank-auth bearer against a rank with LIGHTKEEPER_EXIT_AUTH=hmac: not only "the token
    differs"."""
    refusal = ("the bearer token is not taken on this rank (LIGHTKEEPER_EXIT_AUTH=hmac): the "
               "monitor must sign its calls")
    fakes[0].answers = [(401, {"error": refusal, "status": 401})]
    urls = fakes.urls
    mesh = ProbeMesh(ProbeConfig(timeout_s=0.1), TOKEN, auth="bearer")
    mesh.ask(view_of({u: state_of(u, g) for g, u in enumerate(urls)}), True, None, time.time())
    assert mesh.wait(10)
    why = mesh.take().missing()["h0"]
    assert "signed calls" in why and refusal[:100] in why and TOKEN not in why


# --- 1b. a standby shard asks no probe round -------------------------------------------------

class StandbyShard:
    """A fake of monitor.shard.Shards (no etcd) whose ``--shard`` another monitor holds: it
    keeps the targets, proposes nothing, hears nothing of the other shards."""

    holds = False
    sent_kills: set = set()

    def own_targets(self, targets, poller, now, version):
        return targets

    def after_sweep(self, view, evidence, now):
        pass

    def reported_elsewhere(self):
        return set(), False

    def acting(self):
        return self.holds

    def to_json(self):
        return {"standby": not self.holds}

    def start(self):
        pass

    def stop(self):
        pass


def test_a_standby_shard_asks_no_probe_round(tmp_path):
    from tests.support.monitor_sim import SimJob
    from tests.test_monitor_network import TOKEN as SIM_TOKEN
    from tests.test_monitor_network import (
        Clock,
        Driver,
        Training,
        links,
        monitor,
        probes_asked,
        round_started,
    )

    job = SimJob(4, ranks_per_group=2, heartbeat_timeout_ms=1000)
    mon = None
    try:
        job.sim.probe_token, job.sim.links = SIM_TOKEN, links(job)
        clock = Clock()
        mon = monitor(tmp_path, job, clock, rank_exit_token=SIM_TOKEN)
        mon.shard = shard = StandbyShard()
        d = Driver(mon, Training(job), clock)
        d.sweeps(4)
        d.train.stall(0.6, d.clock.t)  # half way to a job stall: a round is wanted
        d.sweeps(3, steps=0)
        assert probes_asked(job) == 0 and not round_started(d)
        assert "stands by" in mon.probes.to_json()["note"]
        shard.holds = True  # the other monitor's lease ended: this one probes
        d.until(lambda: round_started(d), "a probe round", steps=0)
        assert mon.probes.wait(10) and probes_asked(job) > 0
    finally:
        if mon is not None:
            mon.stop()
        job.stop()


# --- 2. a rank known under two URLs of one listener; a skipped abort -------------------------

def test_one_listener_spelled_alike_is_called_and_any_other_url_is_a_stranger(fakes):
    """A rank known twice by one listener (the same host, port and path, an address spelled
    two ways) is called; a URL of another port or path, or a name for its address (no name is
    looked up: no DNS on the monitor's sweep), claiming its identity is a stranger: skipped."""
    live = fakes[0].url
    port = fakes[0].port
    calls = RankCalls(TOKEN, timeout_s=5)
    try:
        same = f"http://127.0.0.1:{port}/"
        view = view_of({live: state_of(live, 0)}, {same: state_of(same, 0)})
        assert calls.exit(view.ranks[live], "evicted", view).sent
        assert calls.abort(view.ranks[live], "gone", 1, 1, view).sent
        for other in (f"http://127.0.0.1:{port + 1 if port < 65535 else port - 1}",
                      f"{live}/rank5", f"http://localhost:{port}"):
            view = view_of({live: state_of(live, 0)}, {other: state_of(other, 0)})
            res = calls.exit(view.ranks[live], "evicted", view)
            assert not res.sent and res.skipped and "claims the same rank" in res.detail
    finally:
        calls.close()
    assert fakes[0].paths == ["/v1/exit", "/v1/abort"]


def test_an_abort_skipped_for_a_claimed_identity_is_no_failed_try(fakes, tmp_path):
    """A survivor whose identity another target claims is not called, ABORT_TRIES sweeps and
    more: one decision says so (status skipped), it is not given up on, and is told once the
    claim is gone."""
    live, stranger = fakes[0].url, "http://127.0.0.1:9"
    blocked = {"phase": "allreduce",
               "timing": {"waiting": {"scope": "cross", "seconds": 5.0}}}
    gone = "replica_group_1:auth"
    status = LighthouseStatus(
        quorum_id=1, members={r: QuorumMember(r, 10, "store", 1)
                              for r in ("replica_group_0:auth", gone)},
        heartbeats={"replica_group_0:auth": 0.1, gone: 30.0}, stale=frozenset({gone}))
    store = Store(str(tmp_path / "state.sqlite"))
    survivors = Survivors(RankCalls(TOKEN, timeout_s=5), store, MonitorMetrics("auth"), "auth")
    try:
        claimed = view_of({live: state_of(live, 0, **blocked)},
                          {stranger: state_of(stranger, 0, **blocked)})
        (skip,) = survivors.release(claimed, claimed, status, None, set(), time.time())
        for _ in range(ABORT_TRIES):
            assert survivors.release(claimed, claimed, status, None, set(), time.time()) == []
        assert skip["ranks"] == [] and skip["skipped"] == [0] and live in skip["detail"]
        assert [d["status"] for d in store.decisions(decision="abort")] == ["skipped"]
        assert fakes[0].paths == []
        alone = view_of({live: state_of(live, 0, **blocked)})
        (made,) = survivors.release(alone, alone, status, None, set(), time.time())
        assert fakes[0].paths == ["/v1/abort"]
        assert sorted(d["status"] for d in store.decisions(decision="abort")) == [
            "sent", "skipped"]
        assert made["replica_id"] == gone
    finally:
        survivors.close()
        store.close()


# --- 6. a POST without its JSON content type -------------------------------------------------

def test_a_post_without_the_json_content_type_is_told_the_header():
    """A plain ``curl -d`` sends valid JSON as a form: "body must be JSON" misled."""
    state = RankState(RankIdentity(replica_group=2, group_rank=1, group_world_size=2))
    aborts = []
    c = create_app(state, exit_token=TOKEN, fault_handler=lambda spec: None, fault_token="f",
                   abort_handler=lambda *a: aborts.append(a) or {}).test_client()
    for path, body, token in (("/v1/abort", {"reason": "x"}, TOKEN),
                              ("/v1/probe", {"peers": ["http://127.0.0.1:9"]}, TOKEN),
                              ("/v1/faults", {"spec": "hang:step=1"}, "f")):
        r = c.post(path, data=json.dumps(body), headers={"Authorization": f"Bearer {token}"},
                   content_type="application/x-www-form-urlencoded")
        assert r.status_code == 400, (path, r.get_json())
        assert "Content-Type: application/json" in r.get_json()["error"], path
    assert aborts == []


# --- 7. host names looked up off the sweep, once per name, bounded ----------------------------

def quorum_status(gone: str, live: tuple[str, ...]) -> LighthouseStatus:
    return LighthouseStatus(
        quorum_id=1, members={r: QuorumMember(r, 10, "store", 1) for r in (*live, gone)},
        heartbeats={**{r: 0.1 for r in live}, gone: 30.0}, stale=frozenset({gone}))


def test_a_skipped_abort_is_said_again_for_a_new_gone_group(fakes, caplog):
    live, other, stranger = fakes[0].url, fakes[1].url, "http://127.0.0.1:9"
    blocked = {"phase": "allreduce", "timing": {"waiting": {"scope": "cross", "seconds": 5.0}}}
    claims = Claims()
    store = Store(":memory:")
    survivors = Survivors(RankCalls(TOKEN, timeout_s=5, claims=claims), store,
                          MonitorMetrics("auth"), "auth")
    claimed = view_of({live: state_of(live, 0, **blocked)},
                      {stranger: state_of(stranger, 0, **blocked)})
    alone = view_of({live: state_of(live, 0, **blocked)})
    first, second = quorum_status("replica_group_1:auth", ("replica_group_0:auth",)), \
        quorum_status("replica_group_2:auth", ("replica_group_0:auth",))
    try:
        with caplog.at_level(logging.WARNING):
            for view, status in ((claimed, first), (alone, first), (claimed, second)):
                claims.keep(view)  # what the enforcer does each sweep
                survivors.release(view, view, status, None, set(), time.time())
        said = [r.getMessage() for r in caplog.records if r.name == "monitor.evidence.claims"]
        assert len(said) == 2 and all(live in m and stranger in m for m in said)
        rows = sorted(store.decisions(decision="abort"), key=lambda d: d["id"])
        assert [(d["replica_id"], d["status"]) for d in rows] == [
            ("replica_group_1:auth", "skipped"), ("replica_group_1:auth", "sent"),
            ("replica_group_2:auth", "skipped")]
        assert live in rows[2]["detail"] and "not told" in rows[2]["detail"]
        # a partial skip: the decision for the rank told names the one left out, and why
        both = view_of({live: state_of(live, 0, **blocked), other: state_of(other, 3, **blocked)},
                       {stranger: state_of(stranger, 0, **blocked)})
        third = quorum_status("replica_group_4:auth",
                              ("replica_group_0:auth", "replica_group_3:auth"))
        (made,) = survivors.release(both, both, third, None, set(), time.time())
        assert made["ranks"] == [3] and made["skipped"] == [0]
        assert f"{live})" in made["detail"] and "claims the same rank" in made["detail"]
        assert {d["id"]: d["status"] for d in store.decisions(decision="abort")}[made["id"]] \
            == "sent"
        assert survivors.release(both, both, third, None, set(), time.time()) == []
    finally:
        survivors.close()
        store.close()


def test_an_orphan_retold_while_another_is_skipped_adds_no_note(fakes):
    """Orphans of one eviction: A is told (and told again every 5 s), B's identity is claimed
    by a stranger's URL too (skipped). The eviction's note changes when an answer or the ranks
    left out do, not at every retell: the audit row's detail does not grow every 5 s."""
    from monitor.act.actions import Orphans

    a, b = fakes[0].url, fakes[1].url
    stranger = "http://127.0.0.1:9"
    view = view_of({a: state_of(a, 0), b: {**state_of(b, 0), "group_rank": 1}},
                   {stranger: {**state_of(stranger, 0), "group_rank": 1}})
    orphans = Orphans(RankCalls(TOKEN, timeout_s=5), grace_s=3.0)
    try:
        ranks = [view.ranks[a], view.ranks[b]]
        notes = [n for t in range(3, 61) if (n := orphans.follow(
            1, "replica_group_0:abc", ranks, float(t), view)) is not None]
    finally:
        orphans.exits.close()
    assert len(notes) == 1, notes
    assert "exiting" in notes[0] and "not told to exit yet" in notes[0]
    assert fakes[0].paths.count("/v1/exit") == 12 and fakes[1].paths == []  # A retold every 5 s
