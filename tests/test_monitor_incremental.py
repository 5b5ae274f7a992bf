"""The sweep's incremental parts (docs/scaling.md) give what the from-scratch ones give.

ViewBuilder, given the URLs a sweep asked, reuses carried RankViews and regroups only the
touched groups; Verifier judges again only the ranks whose claims changed (and every rank
those checks involve). Both are compared here, sweep after sweep, with the from-scratch
results on the same ranks: a view grouped afresh (ClusterView from the ranks) and verify_ranks()
over every rank. Synthetic /v1/state documents (no server needed: what is compared is the
monitor's own bookkeeping), with the changes that move verdicts and groups: a rank going
down and a new process taking its slot, a replica id claimed by two groups, a rank moving
group, a Lighthouse quorum change.
"""

from __future__ import annotations

import operator
import random

from monitor.evidence.lighthouse_status import LighthouseStatus, QuorumMember
from monitor.evidence.verification import Verifier, verify_ranks
from monitor.evidence.view import ClusterView, RankView, ViewBuilder
from monitor.poll.discovery import Target
from monitor.poll.poller import RankPoll
from tests.support.monitor_sim import rank_state
from tests.support.views import scratch_view

GROUPS, SIZE = 6, 4


def state(rank: int, group: int, step: int, quorum: int = 3, rid: str | None = None) -> dict:
    s = rank_state(rank, group, step=step, quorum_id=quorum, participants=GROUPS, now=1000.0)
    s.update(group_rank=rank % SIZE, group_world_size=SIZE, host=f"h{group}",
             replica_id=rid or f"replica_group_{group}:x")
    return s


def lighthouse(quorum: int = 3) -> LighthouseStatus:
    members = {f"replica_group_{g}:x": QuorumMember(f"replica_group_{g}:x", 0, "s", SIZE)
               for g in range(GROUPS)}
    return LighthouseStatus(quorum, members, {rid: 0.1 for rid in members})


def trust_fields(t):
    return None if t is None else (t.state, t.reason, t.evidence, t.stale)


def group_summary(view: ClusterView) -> dict:
    return {g: ([(r.url, r.reachable, r.fresh) for r in gv.ranks],
                sorted(r.url for r in gv.superseded), len(gv.reachable), gv.replica_id,
                gv.step, gv.quorum_id, gv.leader.url if gv.leader else None)
            for g, gv in view.groups.items()}



def sweep_verified(vb, verifier, targets, states, asked, down, lh, now, sweep):
    """One incremental sweep over ``asked`` (``down`` refusing); its verdicts must be
    verify_ranks()'s on the same ranks."""
    polls = {u: (RankPoll(u, True, data=dict(states[u])) if u not in down
                 else RankPoll(u, False, reason="connection", error="refused"))
             for u in asked}
    view = vb.update(targets, polls, now=now, polled=asked,
                     judge=lambda ranks, changed: verifier.judge(
                         ranks, changed, lh, None, True, now))
    full = verify_ranks(view.ranks, lh, None, True, now)
    assert {u: trust_fields(r.trust) for u, r in view.ranks.items()} == \
        {u: trust_fields(t) for u, t in full.items()}, f"sweep {sweep}"
    return view

def test_incremental_view_and_verdicts_match_the_from_scratch_ones_sweep_after_sweep():
    rng = random.Random(7)
    targets = [Target(f"http://127.0.0.1:{9000 + r}", "static") for r in range(GROUPS * SIZE)]
    states = {t.url: state(r, r // SIZE, 0) for r, t in enumerate(targets)}
    spare = Target("http://127.0.0.1:9999", "static")  # silent until it takes rank 5's slot
    targets.append(spare)
    down: set[str] = {spare.url}
    vb, verifier = ViewBuilder(), Verifier()
    lh = lighthouse()
    leaders = {t.url for r, t in enumerate(targets[:-1]) if r % SIZE == 0}
    for sweep in range(40):
        now = 1000.0 + sweep
        # what changes this sweep
        if sweep == 8:
            down.add(targets[5].url)  # group 1's rank 5 stops answering
        if sweep == 12:  # a new process in its slot, at another address: the old superseded
            states[spare.url] = state(5, 1, sweep)
            down.discard(spare.url)
        if sweep == 15:  # group 2's rank 9 claims group 3's replica id: both unverified
            states[targets[9].url]["replica_id"] = "replica_group_3:x"
        if sweep == 20:
            states[targets[9].url]["replica_id"] = "replica_group_2:x"
        if sweep == 24:  # the Lighthouse moves on to a new quorum; ranks follow as polled
            lh = lighthouse(4)
        if sweep >= 24:
            for s in states.values():
                if rng.random() < 0.3:
                    s["quorum_id"] = 4
        if sweep == 30:  # rank 13 reports another group (a restarted process elsewhere)
            states[targets[13].url].update(replica_group=5, rank=13)
        if sweep == 34:  # rank 5's new process stops answering too (its host gone)
            down.add(spare.url)
        for s in states.values():
            s["step"] = sweep
        asked = set(leaders) | {t.url for t in rng.sample(targets, 5)} | down
        if sweep % 10 == 0:
            asked = {t.url for t in targets}
        view = sweep_verified(vb, verifier, targets, states, asked, down, lh, now, sweep)
        # the view is the one grouped afresh from the same ranks
        fresh = scratch_view(now, ranks={u: r.copy() for u, r in view.ranks.items()})
        assert group_summary(view) == group_summary(fresh), f"sweep {sweep}"
        assert view.counts == fresh.counts
        assert view.reachable_fraction == fresh.reachable_fraction
        assert view.quorum_id == fresh.quorum_id
        assert view.quorum_participants() == fresh.quorum_participants()
        assert [g.replica_group for g in view.in_quorum()] == \
            [g.replica_group for g in fresh.in_quorum()]
        # and so is its evidence view
        ev = view.evidence()
        for r in fresh.ranks.values():
            r.trust = view.ranks[r.url].trust
        fresh_ev = scratch_view(now, ranks={u: r.copy() for u, r in fresh.ranks.items()
                                              if r.trust is not None and r.trust.evidence})
        assert sorted(ev.ranks) == sorted(fresh_ev.ranks), f"sweep {sweep}"
        assert group_summary(ev) == group_summary(fresh_ev), f"sweep {sweep}"
        if sweep == 16:  # the conflict is seen and judged: neither claimant is evidence
            assert view.ranks[targets[9].url].trust.reason == "replica_id_conflict"
        if sweep == 9:
            assert view.ranks[targets[5].url].trust.stale
        if sweep == 13 or sweep >= 35:  # the old process stays superseded by the newer one
            assert view.ranks[targets[5].url].superseded
            assert targets[5].url not in [r.url for r in view.groups[1].ranks]
        if sweep >= 35:
            assert spare.url in [r.url for r in view.groups[1].ranks]
    # only what changed was judged again: a quiet sweep leaves every verdict as it was
    before, last = {u: r.trust for u, r in view.ranks.items()}, view
    asked = set(leaders)
    polls = {u: RankPoll(u, True, data=dict(states[u])) for u in asked}
    view = vb.update(targets, polls, now=now + 1, polled=asked,
                     judge=lambda ranks, changed: verifier.judge(ranks, changed, lh, None,
                                                                 True, now + 1))
    assert all(view.ranks[u].trust is t for u, t in before.items())
    # carried ranks are the same objects as in the previous view (nothing copied)
    carried = [u for u, r in last.ranks.items() if u not in asked and not r.fresh]
    assert carried and all(view.ranks[u] is last.ranks[u] for u in carried)


def derived(gv) -> tuple:
    """Every derived value of a GroupView (computing them all: what a moved group carries is
    what its predecessor computed)."""
    return ([r.url for r in gv.ranks], [r.url for r in gv.superseded],
            [r.url for r in gv.answered], [r.url for r in gv.reachable], gv.fresh_failed,
            gv.replica_id, gv.step, gv.quorum_id, gv.quorums, gv.taking_part, gv.trust_counts,
            gv.hosts, gv.reported_replica_ids, gv.leader.url if gv.leader else None, gv.status,
            gv.median_step_seconds(), gv.median_step_seconds(4))


def view_summary(view: ClusterView) -> tuple:
    return ({g: derived(gv) for g, gv in view.groups.items()}, view.counts, view.quorum_id,
            view.quorum_participants(), [g.replica_group for g in view.in_quorum()],
            sorted(view.ranks))


def test_moved_groups_carry_what_a_from_scratch_view_computes_over_random_sweeps():
    """Random leader-polling sweeps (mostly progress; now and then a rank down or back, a new
    quorum, a host, replica id or world size changing, a rank changing group, the Lighthouse
    changing): after every sweep the incremental view, its evidence view and every group's
    derived values equal those of views grouped afresh, a group none of whose ranks changed
    is the previous view's object (consumers tell changed groups by identity), and a moved
    group keeps its ranks' slots."""
    rng = random.Random(17)
    n = GROUPS * SIZE
    targets = [Target(f"http://127.0.0.1:{9000 + r}", "static") for r in range(n)]
    states = {t.url: state(r, r // SIZE, 0) for r, t in enumerate(targets)}
    for s in states.values():
        s["recent_step_seconds"] = [0.5]
    leaders = [t.url for r, t in enumerate(targets) if r % SIZE == 0]
    down: set[str] = set()
    vb, verifier = ViewBuilder(), Verifier()
    lh, quorum = lighthouse(), 3
    prev: ClusterView | None = None
    moved_seen = unchanged_seen = 0

    def fresh_groups(v: ClusterView) -> dict:
        return scratch_view(v.at, ranks={u: r.copy() for u, r in v.ranks.items()},
                           polled=v.polled).groups

    for sweep in range(150):
        now = 1000.0 + sweep
        for s in states.values():  # progress: every rank a step on, a new step time
            s["step"] += 1
            s["recent_step_seconds"] = s["recent_step_seconds"][-3:] + [rng.choice((0.4, 0.5,
                                                                                    0.9))]
        event = rng.random()
        victim = rng.choice(targets).url
        if event < 0.05:
            down.add(victim)
        elif event < 0.12 and down:
            down.discard(rng.choice(sorted(down)))
        elif event < 0.15:
            states[victim]["host"] = f"h{rng.randrange(GROUPS + 2)}"
        elif event < 0.18:
            states[victim]["replica_id"] = rng.choice(("replica_group_0:x", "replica_group_1:x",
                                                       None))
        elif event < 0.2:
            states[victim]["group_world_size"] = rng.choice((SIZE, SIZE + 1))
        elif event < 0.22:
            states[victim]["step"] -= 3  # a step back (a restarted process)
        elif event < 0.24:
            g = rng.randrange(GROUPS)
            states[victim].update(replica_group=g, replica_id=f"replica_group_{g}:x")
        elif event < 0.27:
            quorum += 1
            lh = lighthouse(quorum)
        if rng.random() < 0.3:
            states[victim]["quorum_id"] = quorum
        asked = set(leaders) | {t.url for t in rng.sample(targets, 4)} | down
        if sweep % 25 == 0:
            asked = {t.url for t in targets}
        view = sweep_verified(vb, verifier, targets, states, asked, down, lh, now, sweep)
        fresh = scratch_view(now, ranks={u: r.copy() for u, r in view.ranks.items()},
                            polled=view.polled)
        assert view_summary(view) == view_summary(fresh), f"sweep {sweep}"
        ev = view.evidence()
        fresh_ev = scratch_view(now, ranks={u: r.copy() for u, r in view.ranks.items()
                                              if r.trust is not None and r.trust.evidence},
                               polled=view.polled)
        assert view_summary(ev) == view_summary(fresh_ev), f"sweep {sweep}"
        assert view.median_step_seconds() == fresh.median_step_seconds()
        for v, last in ((view, prev), (ev, prev.evidence() if prev else None)):
            if last is None:
                continue
            for g, gv in v.groups.items():
                was = last.groups.get(g)
                if was is None or gv is was:
                    continue  # new, or the very same object (its derived values: above)
                carry = gv.__dict__.get("_carry")
                if carry is not None and carry is was.__dict__.get("_carry"):
                    # a moved group (GroupView.progressed): same ranks in the same slots
                    moved_seen += 1
                    assert [r.url for r in gv.ranks] == [r.url for r in was.ranks]
                    assert derived(gv) == derived(fresh_groups(v)[g]), f"sweep {sweep}"
            # a group whose every rank is the previous view's object is that view's GroupView
            for g, was in last.groups.items():
                gv = v.groups.get(g)
                if gv is not None and len(gv.ranks) == len(was.ranks) and all(
                        map(operator.is_, gv.ranks, was.ranks)) and gv.superseded == was.superseded:
                    assert gv is was, f"sweep {sweep} group {g}"
                    unchanged_seen += 1
        prev = view
    assert moved_seen > 500  # the fast path was taken, not only the full regroup
    assert unchanged_seen > 100  # and groups nothing touched were kept as they were


def test_step_times_and_their_median_are_the_general_paths():
    """RankView.recent_steps of an answer as the poller keeps it (rank_wire bytes) and the
    view's median by numpy give what rank_wire's rule and statistics.median give, odd lists
    included."""
    import statistics

    from monitor.evidence.cluster import median
    from monitor.evidence.view import RankView
    from monitor.poll.packed_state import pack_state
    from rank_wire import valid_seconds

    nan, inf = float("nan"), float("inf")
    for vals in ([1.0, 2.0], [1.0, nan, 2.0], [nan, 1.0], [-0.5, 1.0], [1, 2.0], [True, 1.0],
                 [], [inf, 1.0], [1.0, -inf], "x", None, [0.0, -0.0]):
        general = [float(v) for v in vals if valid_seconds(v)] if isinstance(vals, list) else []
        kept = pack_state({"recent_step_seconds": vals})
        assert type(kept["recent_step_seconds"]) is bytes
        assert repr(RankView("u", True, kept).recent_steps()) == repr(general), vals
    rng = random.Random(3)
    for n in (0, 1, 2, 63, 64, 65, 1000, 1001):
        for _ in range(10):
            vals = [rng.choice((0.5, 1.0, 3.0, rng.random())) for _ in range(n)]
            assert median(iter(vals)) == (statistics.median(vals) if vals else None), n


def rank_fields(view: ClusterView) -> dict:
    """Every field of every RankView (verdicts by their fields: each builder judges its own)."""
    return {u: (r.reachable, r.reason, r.error, r.failures, r.unreachable_since,
                r.superseded, r.fresh, trust_fields(r.trust),
                r.state["step"] if r.state else None)
            for u, r in view.ranks.items()}


def test_answers_read_in_any_order_give_the_view_of_explicit_failures():
    """ViewBuilder reads a sweep's answers in the order they came (polls' order), then the
    URLs asked that have no poll (failed: "not polled"). Over random leader-polling sweeps,
    polls in a shuffled order with some asked URLs missing, or with a URL not asked, give
    the view (ranks, groups, derived values, verdicts) of a builder given the same sweeps
    with an explicit failed poll for each missing URL; ``polled`` lists the answered URLs in
    their order, then the others."""
    rng = random.Random(29)
    n = GROUPS * SIZE
    targets = [Target(f"http://127.0.0.1:{9000 + r}", "static") for r in range(n)]
    states = {t.url: state(r, r // SIZE, 0) for r, t in enumerate(targets)}
    leaders = [t.url for r, t in enumerate(targets) if r % SIZE == 0]
    lh = lighthouse()
    got, want = (ViewBuilder(), Verifier()), (ViewBuilder(), Verifier())
    missing_seen = stray_seen = 0
    for sweep in range(60):
        now = 1000.0 + sweep
        for s in states.values():
            s["step"] += 1
        if rng.random() < 0.1:
            states[rng.choice(targets).url]["host"] = f"h{rng.randrange(GROUPS + 2)}"
        asked = set(leaders) | {t.url for t in rng.sample(targets, 5)}
        if sweep % 20 == 0:
            asked = {t.url for t in targets}
        answered = sorted(asked)
        rng.shuffle(answered)
        missing = set(rng.sample(answered, 2)) if sweep % 3 == 1 else set()
        polls = {u: RankPoll(u, True, data=dict(states[u])) for u in answered
                 if u not in missing}
        if sweep % 7 == 3:  # an answer from a URL this sweep did not ask: not read
            stray = next(t.url for t in targets if t.url not in asked)
            polls[stray] = RankPoll(stray, True, data=dict(states[stray]))
            stray_seen += 1
        explicit = {u: polls[u] if u not in missing else
                    RankPoll(u, False, reason="connection", error="not polled")
                    for u in sorted(asked)}
        missing_seen += len(missing)
        views = []
        for (vb, verifier), p in ((got, polls), (want, explicit)):
            views.append(vb.update(targets, p, now=now, polled=asked,
                                   judge=lambda ranks, changed, v=verifier, t=now: v.judge(
                                       ranks, changed, lh, None, True, t)))
        view, ref = views
        assert rank_fields(view) == rank_fields(ref), f"sweep {sweep}"
        assert view_summary(view) == view_summary(ref), f"sweep {sweep}"
        assert view_summary(view.evidence()) == view_summary(ref.evidence()), f"sweep {sweep}"
        for u in missing:
            assert not view.ranks[u].reachable and view.ranks[u].error == "not polled"
        in_order = [u for u in polls if u in asked]
        assert view.polled[:len(in_order)] == in_order and sorted(view.polled) == sorted(asked)
    assert missing_seen and stray_seen


def test_rank_views_are_slotted_and_their_copies_carry_every_field():
    """RankView has no __dict__ (~150 bytes, not ~530: ~30,000 are made a sweep at 100,000
    ranks); clone() copies every field, copy() every field but ``superseded``."""
    import dataclasses

    from monitor.evidence.view import RankView

    rv = RankView("u", True, {"recent_step_seconds": [1.0]}, reason="r", error="e",
                  failures=3, unreachable_since=1.0, target=object(),
                  superseded=True, trust=object(), fresh=False)
    rv.recent_steps()
    assert not hasattr(rv, "__dict__")
    names = [f.name for f in dataclasses.fields(RankView)]
    assert "_recent" in names
    c = rv.clone()
    assert c is not rv and [getattr(c, k) for k in names] == [getattr(rv, k) for k in names]
    c = rv.copy()
    assert not c.superseded
    assert [getattr(c, k) for k in names if k != "superseded"] == \
        [getattr(rv, k) for k in names if k != "superseded"]


def test_verifier_judges_everything_again_when_a_judged_rank_is_gone():
    """Verifier.judge tells a rank set that lost a judged URL by counting (the URLs new to
    it are in ``changed``), not a subset test over every rank: a target replaced by another
    in the same sweep (same count), a target gone, one added, all give verify_ranks()'s verdicts
    over random sweeps."""
    rng = random.Random(41)
    lh = lighthouse()
    pool = [(f"http://127.0.0.1:{9000 + r}", r) for r in range(GROUPS * SIZE + 8)]
    live = dict(pool[:GROUPS * SIZE])
    verifier, views = Verifier(), {}
    swaps = 0
    for sweep in range(80):
        now = 1000.0 + sweep
        event = rng.random()
        spare = [u for u, _ in pool if u not in live]
        if event < 0.3 and spare:  # one target replaced by another (the count stays)
            gone = rng.choice(sorted(live))
            new = rng.choice(spare)
            live[new] = live.pop(gone)  # the new address claims the gone one's rank
            swaps += 1
        elif event < 0.4 and spare:
            live[rng.choice(spare)] = rng.randrange(GROUPS * SIZE)  # a rival claimant
        elif event < 0.5 and len(live) > GROUPS:
            live.pop(rng.choice(sorted(live)))
        ranks = {}
        for u, r in live.items():
            rv = views.get(u)
            if rv is None or rv.state["rank"] != r:
                rv = views[u] = RankView(u, True, state(r, r // SIZE, sweep))
            ranks[u] = rv
        changed = {u for u in ranks if views[u].state["step"] == sweep}
        got = verifier.judge(ranks, changed, lh, None, True, now)
        for u, t in got.items():
            ranks[u].trust = t
        want = verify_ranks(ranks, lh, None, True, now)
        assert {u: trust_fields(r.trust) for u, r in ranks.items()} == \
            {u: trust_fields(t) for u, t in want.items()}, f"sweep {sweep}"
    assert swaps > 10
