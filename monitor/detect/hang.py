"""``hang``: the job stopped inside a collective, and who never entered it. A culprit is never
itself waiting in the collective it is blamed for, nor in its own quorum call; a group that said
it works outside the collectives on purpose (phase ``checkpoint`` or ``busy``) is held, and one
that has not timed a step yet (its first step compiles; a restarted group's heal step aside) is
judged at --starting-timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any

from monitor.config import DetectorConfig
from monitor.evidence.view import ClusterView, GroupView
from monitor.poll.torch_target import is_torch

from .findings import Finding, Findings
from .rank_state import (
    SaveClock,
    SeenGroups,
    collective_wait,
    current_wait,
    phases,
    rank_groups,
    torch_step_seconds,
)

log = logging.getLogger(__name__)

# a slot's first-step hold is forgotten after it held nobody this long, however short
# --starting-timeout: a crash loop's restart (process start, imports, rejoining) takes a while
HOLD_GAP_S = 600.0


def _wait(view: ClusterView, rank: int) -> tuple[str | None, float]:
    """The rank's collective wait; (None, 0.0) when unreachable or not polled now."""
    r = view.rank_view(rank)
    if r is None or not r.reachable or not r.fresh:
        return None, 0.0
    return collective_wait(r.state)


def _timed(st: Mapping[str, Any], recent: list[float]) -> bool:
    """The rank timed a step other than its heal's: a process restarted into a running job
    heals in its first step, and its warm-up (first optimizer step, next forward) goes on."""
    if not (isinstance(st.get("last_step_seconds"), (int, float)) or recent):
        return False
    heals, commits = st.get("heals"), st.get("commits")
    # held while every step it finished was a heal's (the counters do not say in which order)
    # and at most one committed: its warm-up may be ahead (a delay, never an eviction); one that
    # committed a step past its heal's, or more than one healing, has trained
    return not (type(heals) is int and type(commits) is int and heals > 0 and commits <= 1
                and commits + (st.get("commit_failures") or 0) <= heals)


def untimed(gv: GroupView) -> bool:
    """No rank of the group has timed a step yet, its heal's aside (a rank on torch's debug
    server times none: its incarnation not seen stepping past its heal on the Lighthouse)."""
    ranks = gv.reachable
    return bool(ranks) and not any(
        (r.state.get("torch_only") or {}).get("timed", True) if is_torch(r.url)
        else _timed(r.state, r.recent_steps()) for r in ranks)


def _killed(view: ClusterView, ranks: list[int], evicted: Container[str],
            every: bool = True) -> bool:
    """Every rank named (``every`` False: any) reports an incarnation the monitor killed: the
    others wait for it until torchft drops it from the quorum, the monitor's own doing, not a
    hang (nor an offence of its host). Asked of each rank: a group may show its replacement's
    ranks beside the old ones."""
    got = [view.rank_view(r) for r in ranks]
    return bool(got) and (all if every else any)(
        rv is not None and rv.replica_id in evicted for rv in got)


def _over(held: Mapping[str, Any]) -> str:
    """The summary's note of a first-step hold over incarnations (``Hang._judged_at``)."""
    return f", held {held['held_s']:.0f}s over {held['incarnations']} incarnation(s)" if held \
        else ""


def _inner(analysis: list[dict]) -> dict[int, dict]:
    """Each replica group's first hang within it, one naming a culprit first (a hang whose
    ranks are only blocked in another names none)."""
    inner: dict[int, dict] = {}
    for h in sorted(analysis, key=lambda h: not h.get("culprits")):
        if h["kind"] == "hang" and h["replica_group"] is not None:
            inner.setdefault(int(h["replica_group"]), h)
    return inner


def left_hung(view: ClusterView, f: Finding, now: float) -> bool:
    """``f``'s group answering still where it hung, out of the newest quorum: the others going
    on without it is no recovery of its own, and its eviction waits on the rails only. The same
    incarnation at the step and quorum id it hung at, none of its ranks asking for a quorum or
    healing; on torch's debug server (no step or quorum id once the Lighthouse drops it), its
    ranks the hang found blocked in the group still blocked since before it was confirmed."""
    gv = view.groups.get(f.replica_group)
    if gv is None or not gv.reachable or gv.replica_id != f.replica_id \
            or view.quorum_id in gv.taking_part \
            or any(r.state and r.state.get("phase") in ("quorum", "healing") for r in gv.reachable):
        return False
    ev = f.evidence
    if (gv.step, gv.quorum_id) == (ev.get("step"), ev.get("quorum_id")):
        return True
    waits = ev.get("waits") or {}
    blocked = [r for r in gv.reachable if str(r.rank) in waits]
    return bool(blocked) and f.confirmed_at is not None and all(
        r.state and "torch_only" in r.state
        and collective_wait(r.state)[1] > now - f.confirmed_at
        for r in blocked)


def step_seconds(view: ClusterView) -> float | None:
    """The median step the hang threshold is a multiple of: the ranks' own, else (torch-only
    ranks serve none) the Lighthouse's step time of their groups."""
    return view.median_step_seconds() or torch_step_seconds(view)


class Hang:
    def __init__(self, cfg: DetectorConfig, findings: Findings) -> None:
        self.cfg, self.findings = cfg, findings
        self.progress_steps: dict[int, int] = {}  # each in-quorum group's step
        self._progress_quorum: int | None = None  # the quorum id of progress_steps
        self._progress_at: float | None = None
        self._noted_at: float | None = None
        self._seen = SeenGroups()
        self.stalled_sweeps = 0
        self._blocked: tuple | None = None  # (view, now, {rank: (scope, seconds)} blocked)
        self._longest: tuple[float, float] | None = None  # (now, seconds)
        self._saving: dict[int, float] = {}  # group -> start of the save last said held
        self._saves = SaveClock(cfg.checkpoint_timeout_s)  # noted as its group changes
        # untimed group -> (last held, replica ids, incarnations, named, the earlier
        # incarnations' waits summed, their longest, this one's longest)
        self._first_held: dict[int, tuple] = {}

    def threshold(self, view: ClusterView) -> float:
        return max(self.cfg.hang_floor_s, self.cfg.hang_factor * (step_seconds(view) or 0))

    def group_threshold(self, view: ClusterView, gv: GroupView) -> float:
        """The hang threshold for naming ``gv``: at least --starting-timeout while none of its
        ranks has timed a step, as a first step compiles (minutes) while the others wait for it;
        evicting it then would loop (its replacement compiles again)."""
        threshold = self.threshold(view)
        return max(threshold, self.cfg.starting_timeout_s) if untimed(gv) else threshold

    def _judged_at(self, view: ClusterView, gv: GroupView, ranks: list[int], longest: float,
                   now: float, evicted: Container[str]) -> tuple[float, dict] | None:
        """(``gv``'s :meth:`group_threshold`, evidence of a hold over incarnations) once the
        others' wait of ``longest`` s (past the hang threshold) and the group's hold reach it;
        None while it is held as on its first step (said once an incarnation). The hold counts
        across the slot's untimed incarnations: one hung in every first step is restarted under
        a new replica id each time the others' process-group timeout cuts their wait; one that
        holds them past that cut is timed on its own. ``evicted``: replica ids killed."""
        threshold, g, ids = self.group_threshold(view, gv), gv.replica_group, \
            gv.reported_replica_ids
        if not untimed(gv):
            self._first_held.pop(g, None)
            return threshold, {}
        # held: the seconds the slot's incarnations held the others, summed (acc: the earlier
        # ones'; own: this one's), not wall time: a restart's gap holds nobody
        last, was, n, named, acc, cut, own = self._first_held.get(g) or (
            now, None, 0, False, 0.0, 0.0, 0.0)
        if now - last > max(self.cfg.starting_timeout_s, HOLD_GAP_S) or (
                named and ids != was and any(i in evicted for i in was)):
            n, named, acc, cut, own = 0, False, 0.0, 0.0, 0.0  # held nobody, or named, evicted
        elif ids != was:
            acc, cut, own = acc + own, max(cut, own), 0.0
        elif not named and cut and longest > cut + now - last:
            n, acc, cut = 1, 0.0, 0.0  # waited for past the earlier ones' cut, by over a sweep
        n, own = n + (ids != was), max(own, longest)
        held = acc + own
        named = named or held >= threshold
        self._first_held[g] = (now, ids, n, named, acc, cut, own)
        if named:
            return threshold, {"held_s": round(held, 3), "incarnations": n} \
                if held > longest + 1.0 else {}
        if ids != was:
            log.warning("hang held: replica group %d rank(s) %s have timed no step since the "
                        "monitor first saw them (a first step compiles); the others have waited "
                        "%.0fs, held %.0fs over %d "
                        "incarnation(s), judged at %.0fs (--starting-timeout)", g, ranks,
                        longest, held, n, threshold)
        return None

    def note_progress(self, view: ClusterView, now: float) -> None:
        """Count the sweeps since an in-quorum group's step moved (once per ``now``)."""
        if self._noted_at == now:
            return
        self._noted_at = now
        changed, gone = self._seen.changed(view)
        for g in gone:
            self._saves.forget(g)
            self._first_held.pop(g, None)  # relaunched: its slot may be another job's
        for g in changed:
            self._saves.note(view.groups[g], now, reachable=False)
            if g in self._first_held and view.groups[g].reachable and not untimed(view.groups[g]):
                del self._first_held[g]  # it trained: a later first step is held afresh
        q, groups, steps = view.quorum_id, view.groups, self.progress_steps
        moved = False
        if q != self._progress_quorum:
            self._progress_quorum = q
            now_steps = {g: gv.step or 0 for g, gv in groups.items() if q in gv.taking_part}
            moved, self.progress_steps = now_steps != steps, now_steps
        else:  # only a changed group can have moved
            for g in gone:
                moved = steps.pop(g, None) is not None or moved
            for g in changed:
                gv = groups[g]
                if q in gv.taking_part:
                    step = gv.step or 0
                    if steps.get(g) != step:
                        steps[g], moved = step, True
                elif steps.pop(g, None) is not None:
                    moved = True
        if self._progress_at is None or moved:
            self._progress_at = now
            self.stalled_sweeps = 0
        else:
            self.stalled_sweeps += 1

    def stall(self, view: ClusterView, now: float,
              ratio: float = 1.0) -> tuple[bool, float, float, dict[int, tuple]]:
        """(stalled, longest wait (s), threshold, {rank: (scope, seconds)} blocked that long);
        ``ratio``: of the hang threshold (below 1: a stall on its way). The ranks' waits are
        read once a sweep, whatever the ratios asked."""
        if self.stalled_sweeps < 1:
            return False, 0.0, 0.0, {}  # a group moved: not stalled whatever the waits
        seen = self._blocked
        if seen is None or seen[0] is not view or seen[1] != now:
            blocked: dict[int, tuple[str, float]] = {}
            in_quorum = {g.replica_group for g in view.in_quorum()}
            for r in view.polled_ranks:  # a wait carried from an older poll is not a wait now
                if not r.reachable or not r.fresh or r.replica_group not in in_quorum \
                        or r.rank is None:
                    continue
                scope, secs = collective_wait(r.state)
                if scope is not None:
                    blocked[r.rank] = (scope, secs)
            seen = self._blocked = (view, now, blocked)
        threshold = self.threshold(view) * ratio
        waits = {rank: w for rank, w in seen[2].items() if w[1] >= threshold}
        longest = max((s for _, s in waits.values()), default=0.0)
        return bool(waits), longest, threshold, waits

    def longest_wait(self, view: ClusterView, now: float,
                     states: Iterable[Any] | None = None) -> float:
        """The longest a rank polled this sweep has been blocked in a collective (s), once per
        ``now``; ``states``: this sweep's answers."""
        got = self._longest
        if got is not None and got[0] == now:
            return got[1]
        if states is None:
            states = [r.state for r in view.polled_ranks if r.reachable]
        longest = max((collective_wait(st)[1] for st in states), default=0.0)
        self._longest = (now, longest)
        return longest

    def judge(self, view: ClusterView, dumps: Mapping[int, dict], analysis: list[dict] | None,
              now: float, evicted: Container[str] = ()) -> list[Finding]:
        stalled, longest, threshold, waits = self.stall(view, now)
        findings = self.findings
        if not stalled:
            new = self._unasked(view, now, evicted=evicted)
            if not new:
                # one gone from the view, or no rank of which answers: resolve_gone's to close
                for key in [k for k, f in findings.open.items() if k[0] == "hang"
                            and getattr(view.groups.get(f.replica_group), "reachable", None)
                            and not left_hung(view, f, now)]:
                    findings.resolve(key, "progress", now)
            return [f for f in new if f]
        if analysis is None:  # no dumps (a torch without the Flight Recorder): the states alone
            return [f for f in self._unasked(view, now, evicted, findings.groups("hang")) if f]
        new = []
        newest_q = view.quorum_id
        rank_group = rank_groups(view, dumps)
        # a culprit may report the newest quorum without taking part: healing into it, it is in
        # its process group (a replacement hung in its first step; held as untimed)
        candidates = {g for g, gv in view.groups.items() if newest_q in gv.quorums}
        inner, cross = _inner(analysis), {}
        for h in analysis:
            if h["kind"] == "hang" and h["replica_group"] is None \
                    and h["quorum_id"] in (None, newest_q):
                for r in h["culprits"]:
                    g = rank_group(r)
                    if g is not None and h not in cross.setdefault(g, []):
                        cross[g].append(h)
        for g in sorted(set(cross) | set(inner)):
            gv = view.groups.get(g)
            if gv is None or g not in candidates:
                continue
            h_in = inner.get(g)
            waiting = self._in_group_blocked(view, g, h_in, waits, rank_group)
            if waiting:
                level, ranks, found = "in_group", list(h_in["culprits"]), [h_in]
            else:
                ranks = sorted({r for h in cross.get(g, []) for r in h["culprits"]
                                if rank_group(r) == g})
                waiting = sorted({r for h in cross.get(g, []) for r in h["waiting"]
                                  if r in waits})
                if not ranks or not waiting or not self._not_waiting(view, ranks, "cross"):
                    continue
                level, found = "cross_group", cross[g]
                # in the group the job waits for, the ranks that never entered the collective
                # its others are blocked in now, however briefly (they began after the others)
                blocked = {r: w for r in (h_in["waiting"] if h_in else ())
                           if (w := _wait(view, r))[0] == "group" and w[1] > 0}
                inner_peers = self._in_group_blocked(view, g, h_in, blocked, rank_group)
                if inner_peers:
                    level, ranks, found = "in_group", list(h_in["culprits"]), [h_in]
                    waiting, waits = inner_peers, {**blocked, **waits}
            if _killed(view, ranks, evicted) or self._held(view, g, ranks, now):
                continue
            if (judged := self._judged_at(view, gv, ranks, longest, now, evicted)) is None:
                continue
            (threshold, held), pending = judged, found[0]["raw"]
            ev = {"summary": f"rank(s) {ranks} never entered {pending.get('op')} (seq "
                             f"{pending.get('seq')}, {level.replace('_', '-')}) that rank(s) "
                             f"{waiting} have waited in for {longest:.1f}s (threshold "
                             f"{threshold:.1f}s{_over(held)})", **held,
                  "level": level, "stalled_s": round(longest, 3),
                  "threshold_s": round(threshold, 3),
                  "median_step_s": step_seconds(view),
                  "pending": {k: pending.get(k)
                              for k in ("pg", "replica_group", "quorum_id", "seq", "op")},
                  "quorum_id": newest_q, "step": gv.step,
                  "never_arrived": ranks, "waiting_ranks": waiting,
                  "waits": {str(r): {"scope": waits[r][0], "seconds": round(waits[r][1], 3)}
                            for r in waiting},
                  "phases": phases(view, ranks + waiting),
                  "analysis": [h["raw"] for h in found]
                  + [h["raw"] for h in cross.get(g, []) if h not in found]}
            new.append(findings.confirm("hang", gv, ranks, ev, now - longest, now, view))
        new += self._unasked(view, now, evicted, findings.groups("hang"))  # engine's named first
        return [f for f in new if f]

    def _unasked(self, view: ClusterView, now: float, evicted: Container[str] = (),
                 named: set[int] = frozenset()) -> list:
        """Hangs of the groups of the newest quorum that never asked for the next one while the
        others, at the same step, wait across groups for it (the longest past the threshold):
        LocalSGD and DiLoCo meet at a quorum before their all_reduce, so the Flight Recorder
        holds nothing the hung group never entered."""
        if self.stalled_sweeps < 1:
            return []
        idle, waited, steps = [], {}, set()
        for gv in view.in_quorum():
            fresh = [r for r in gv.ranks if r.fresh]
            if not fresh or len(gv.reachable) != len(gv.ranks):
                return []
            steps.add(gv.step)
            w = [current_wait(r.state) for r in fresh]
            if all(scope is None for scope, _ in w):
                idle.append(gv)
            elif cross := [(secs, r.rank) for (scope, secs), r in zip(w, fresh, strict=True)
                           if scope == "cross"]:
                waited[gv.replica_group] = max(cross, key=lambda c: c[0])
            else:
                return []
        threshold = self.threshold(view)
        longest = max((s for s, _ in waited.values()), default=0.0)
        if not idle or longest < threshold or len(steps) != 1:
            return []
        waiting = sorted(r for _, r in waited.values() if r is not None)
        out = []
        for gv in idle:
            ranks = sorted(r.rank for r in gv.ranks if r.rank is not None)
            # a whole group is named here: one still being killed is left to its next sweeps
            if gv.replica_group in named or _killed(view, ranks, evicted, every=False) \
                    or self._held(view, gv.replica_group, ranks, now):
                continue
            if (judged := self._judged_at(view, gv, ranks, longest, now, evicted)) is None:
                continue
            threshold, held = judged
            ev = {"summary": f"rank(s) {ranks} never asked for the quorum of step "
                             f"{gv.step + 1 if gv.step is not None else '?'} that replica "
                             f"group(s) {sorted(waited)} have waited for, across groups, for "
                             f"{longest:.1f}s (threshold {threshold:.1f}s{_over(held)})", **held,
                  "level": "quorum", "stalled_s": round(longest, 3),
                  "threshold_s": round(threshold, 3), "median_step_s": step_seconds(view),
                  "quorum_id": view.quorum_id, "step": gv.step, "never_arrived": ranks,
                  "waiting_ranks": waiting,
                  "phases": phases(view, ranks + waiting)}
            out.append(self.findings.confirm("hang", gv, ranks, ev, now - longest, now, view))
        return out

    def in_group_hangs(self, view: ClusterView, dumps: Mapping[int, dict], now: float,
                       analysis: Callable[[], list[dict]]) -> set[int]:
        """The groups whose in-group hang ``dumps`` alone confirm (the service then skips the
        other groups' dumps); ``analysis``: the engine's findings of ``dumps``, asked only on a
        stall. Empty on any error."""
        try:
            stalled, _, _, waits = self.stall(view, now)
            if not stalled or not dumps:
                return set()
            inner = _inner(analysis())
            in_quorum = {gv.replica_group for gv in view.in_quorum()}
            rank_group = rank_groups(view, dumps)
            return {g for g, h in inner.items() if g in in_quorum and g in view.groups
                    and self._in_group_blocked(view, g, h, waits, rank_group)}
        except Exception:  # the caller then fetches every dump
            log.exception("in-group hang check failed")
            return set()

    def _in_group_blocked(self, view: ClusterView, g: int, h_in: dict | None,
                          waits: dict[int, tuple], rank_group: Callable[[int], int | None]
                          ) -> list[int]:
        """The peers blocked in ``h_in`` (the engine's hang inside ``g``) when its culprits are
        all of ``g`` and none is itself blocked in the group."""
        if not h_in or not h_in["culprits"]:
            return []
        blocked = [r for r in h_in["waiting"] if r in waits and waits[r][0] == "group"]
        if blocked and all(rank_group(r) == g for r in h_in["culprits"]) and \
                self._not_waiting(view, h_in["culprits"], "group"):
            return blocked
        return []

    def _held(self, view: ClusterView, g: int, ranks: list[int], now: float) -> bool:
        """Every culprit answers now in a held phase (``checkpoint``, ``busy``), first seen so
        under --checkpoint-timeout ago by the monitor's clock: a group saving or running its own
        marked work (an eval) while the others wait is not hung (logged once a spell)."""
        now_seen = [rv if (rv := view.rank_view(r)) and rv.reachable and rv.fresh else None
                    for r in ranks]
        if not (held := self._saves.held(g, now_seen, now)) or not held[1]:
            return False
        since, said = held[0], {rv.state["phase"] for rv in now_seen}
        if self._saving.get(g) != since:
            self._saving[g] = since
            what = "write a checkpoint" if said == {"checkpoint"} else \
                "are busy outside the step (phase busy)" if said == {"busy"} else \
                "write a checkpoint or are busy outside the step"
            log.warning("hang held: replica group %d rank(s) %s %s (%.0fs of "
                        "--checkpoint-timeout %.0fs), the others wait for it", g, ranks, what,
                        now - since, self.cfg.checkpoint_timeout_s)
        return True

    @staticmethod
    def _not_waiting(view: ClusterView, ranks: list[int], scope: str) -> bool:
        """None of ``ranks`` is blocked in ``scope``: for ``cross`` in any call, its own quorum's
        too (a group healing from a peer of the same quorum receives the checkpoint inside its
        quorum call while the others wait in the all_reduce: recovery, not a culprit)."""
        return not any((rv := view.rank_view(rank)) is not None and rv.reachable
                       and current_wait(rv.state)[0] == scope for rank in ranks)
