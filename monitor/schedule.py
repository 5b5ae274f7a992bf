"""Leader polling: a sweep asks each group's leader, the other ranks every ``member_interval_s``;
a group whose leader looks wrong is *drilled* (all ranks every sweep). docs/scaling.md.
"""

from __future__ import annotations

import math
import operator
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache

from .config import MonitorConfig
from .detect import current_wait
from .evidence.view import ClusterView, GroupView
from .poll.discovery import Target
from .poll.poller import RankPoll

# the drill reason of a group whose leader waits inside its own group (also in Plan.blocked)
BLOCKED_IN_GROUP = "leader blocked in an in-group collective"
SUSPECT = "finding or straggler candidate"  # the drill reason of the monitor's suspect groups


@dataclass
class Plan:
    """One sweep's plan: the URLs to poll, and why groups are drilled (group -> reason)."""

    urls: list[str]
    drilled: dict[int, str] = field(default_factory=dict)
    everything: bool = True  # leader polling off: every target polled
    # drilled groups whose leader was found blocked in an in-group collective, within the hold
    blocked: set[int] = field(default_factory=set)


class LeaderSchedule:
    """Decides each sweep's URLs from the previous sweep's view; its settings are checked by
    MonitorConfig.validate."""

    def __init__(self, mode: str = "auto",
                 min_ranks: int = MonitorConfig.leader_polling_min_ranks,
                 member_interval_s: float = 10.0,
                 interval_s: float = 1.0, hold_s: float = 10.0, suspect_floor_s: float = 1.0,
                 suspect_factor: float = 2.0) -> None:
        self.mode = mode
        self.min_ranks = min_ranks
        self.member_interval_s = member_interval_s
        self.interval_s = interval_s
        self.hold_s = hold_s
        self.suspect_floor_s = suspect_floor_s
        self.suspect_factor = suspect_factor
        self._sweep = 0
        self._drilled_until: dict[int, tuple[float, str, bool]] = {}  # until, why, blocked
        # group -> (its leader's step, when the first answer showing it came: answered_at)
        self._leader_step: dict[int, tuple[int, float]] = {}
        self._targets: list[Target] = []
        self._period = 0
        self._url_set: set[str] = set()
        self._buckets: list[list[str]] = []
        self._leader_urls: dict[int, str | None] = {}  # the last plan's, group -> leader URL
        self.last: Plan | None = None

    def active(self, n_targets: int) -> bool:
        return self.mode == "on" or (self.mode == "auto" and n_targets >= self.min_ranks)

    def suspect_s(self, view: ClusterView | None) -> float:
        med = view.median_step_seconds() if view is not None else None
        return max(self.suspect_floor_s, self.suspect_factor * (med or 0.0))

    def plan(self, targets: list[Target], view: ClusterView | None, now: float,
             suspects: Iterable[int] = ()) -> Plan:
        """The URLs this sweep polls (``view``: the previous sweep's, None: first), in work
        proportional to the groups and ranks asked, not the ranks known."""
        self._sweep += 1
        if view is None or not self.active(len(targets)):
            self.last = Plan([t.url for t in targets])
            return self.last
        period = max(1, math.ceil(self.member_interval_s / self.interval_s))
        self._rebucket(targets, period)
        known = view.ranks
        # never answered (or not in the view yet) or replaced: asked every sweep
        always = list(self._url_set - known.keys())
        always += [r.url for r in view.ungrouped if r.url in self._url_set]
        groups = {}
        for g, gv in view.groups.items():  # one pass; a group's answered ranks are usually all
            answered = gv.answered
            if answered:
                groups[g] = gv
            if len(answered) != len(gv.ranks):
                always += [r.url for r in gv.ranks if r.state is None]
            if gv.superseded:
                always += [r.url for r in gv.superseded]
        reasons, blocked, leader_urls = self._reasons(view, groups, now, set(suspects))
        self._leader_urls = leader_urls  # drill_now reads this sweep's answers of these
        for g, why in reasons.items():
            self._drilled_until[g] = (now + self.hold_s, why, g in blocked)
        drilled = {g: why for g, (until, why, _) in self._drilled_until.items()
                   if until >= now and g in groups}
        blocked = {g for g in drilled if self._drilled_until[g][2]} if drilled else set()
        if len(drilled) != len(self._drilled_until):
            self._drilled_until = {g: v for g, v in self._drilled_until.items() if v[0] >= now}
        out = always
        for g, url in leader_urls.items():
            if g in drilled:
                out += [r.url for r in groups[g].answered]
            elif url is not None:
                out.append(url)
        leaders = {u for g, u in leader_urls.items() if u is not None and g not in drilled}
        for u in self._buckets[(-self._sweep) % period]:
            rv = known.get(u)
            if rv is None or rv.superseded or u in leaders:
                continue
            st = rv.state
            if st is None:
                continue
            g = int(st["replica_group"])  # RankView.replica_group, read once
            if g in drilled or g not in groups:
                continue
            out.append(u)
        self.last = Plan(out, drilled, everything=False, blocked=blocked)
        return self.last

    def drill_now(self, polls: dict[str, RankPoll], view: ClusterView | None,
                  now: float) -> list[str]:
        """The other ranks of each group whose leader answered blocked in an in-group collective for
        ``suspect_s``: polled in this sweep, not the next, and held as if planned."""
        plan = self.last
        if plan is None or plan.everything or view is None:
            return []
        suspect = cache(lambda: self.suspect_s(view))  # a healthy sweep never needs it
        extra: list[str] = []
        drilled = plan.drilled
        for g, url in self._leader_urls.items():  # the leaders this plan asked (and drilled)
            p = polls.get(url)
            if p is None or not p.ok or g in drilled:
                continue
            st = p.data
            if type(st) is not dict:
                continue
            scope, secs = current_wait(st)
            if scope != "group" or (secs or 0.0) < suspect() or st.get("replica_group") != g:
                continue
            gv = view.groups.get(g)
            if gv is None:
                continue
            why = drilled[g] = f"{BLOCKED_IN_GROUP} {secs:.1f}s"
            plan.blocked.add(g)
            self._drilled_until[g] = (now + self.hold_s, why, True)
            extra += [r.url for r in gv.ranks if r.url not in polls]
        if extra:
            plan.urls = plan.urls + extra
        return extra

    def drill_suspects(self, plan: Plan, view: ClusterView | None, now: float,
                       suspects: Iterable[int]) -> list[str]:
        """The URLs to add to ``plan`` (made before ``suspects`` were known) so that it drills
        them as :meth:`plan` would have; ``plan`` is extended in place."""
        if plan.everything or view is None:
            return []
        groups = view.groups
        new = [g for g in suspects if g not in plan.drilled and g in groups
               and groups[g].answered]
        if not new:
            return []
        asked = set(plan.urls)
        extra: list[str] = []
        for g in new:
            plan.drilled[g] = SUSPECT
            self._drilled_until[g] = (now + self.hold_s, SUSPECT, False)
            extra += [r.url for r in groups[g].answered if r.url not in asked]
        plan.urls = plan.urls + extra
        return extra

    def _rebucket(self, targets: list[Target], period: int) -> None:
        """URLs by member slot ``crc32(url) % period``, kept while the targets are the same."""
        if period == self._period and len(targets) == len(self._targets) \
                and all(map(operator.is_, targets, self._targets)):
            return
        self._targets, self._period = list(targets), period
        urls = [t.url for t in targets]
        self._url_set = set(urls)
        self._buckets = [[] for _ in range(period)]
        for u in urls:
            self._buckets[zlib.crc32(u.encode()) % period].append(u)

    def _reasons(self, view: ClusterView, groups: dict[int, GroupView], now: float,
                 suspects: set[int]
                 ) -> tuple[dict[int, str], set[int], dict[int, str | None]]:
        """(group -> why it is drilled, those whose leader is blocked in the group, group ->
        its leader's URL or None), in one pass over the groups."""
        suspect = cache(lambda: self.suspect_s(view))
        out: dict[int, str] = {g: SUSPECT for g in suspects if g in groups}
        # arrived: the leader waits in the cross-group collective at all (it is not the late one)
        cross_waiting, arrived, moving, others, newest = [], set(), 0, [], -1
        in_leaders: list[int] = []  # groups whose leader answered this sweep
        step_of: dict[int, int] = {}  # ... and the step each reported
        blocked: set[int] = set()
        leader_urls: dict[int, str | None] = {}
        last_step = self._leader_step
        for g, gv in groups.items():
            lead = gv.leader
            if lead is None:
                leader_urls[g] = None
                out.setdefault(g, "no leader (group rank 0) known")
                continue
            leader_urls[g] = lead.url
            if not lead.reachable:
                out.setdefault(g, f"leader unreachable ({lead.reason})")
                continue
            if lead.fresh:
                in_leaders.append(g)
            if gv.fresh_failed:
                out.setdefault(g, "a rank did not answer")
                continue
            if not lead.fresh:
                continue
            st = lead.state
            try:
                scope, secs = current_wait(st)
                step = int(st["step"])
            except (TypeError, ValueError, KeyError, AttributeError):
                out.setdefault(g, "leader state unreadable")
                continue
            step_of[g] = step
            if scope == "group" and (secs or 0.0) >= suspect():
                if g not in out:  # a suspect group stays one
                    out[g] = f"{BLOCKED_IN_GROUP} {secs:.1f}s"
                    blocked.add(g)
                continue
            # how long its step has not moved, between the answers that showed it
            at = now if lead.answered_at is None else lead.answered_at
            prev = last_step.get(g)
            if prev is None or prev[0] != step:
                last_step[g] = (step, at)
                moving += 1
            elif scope != "cross" and at - prev[1] >= suspect():
                # (one waiting in the cross-group collective arrived: it waits for another)
                others.append((g, step, f"leader at step {step} for {at - prev[1]:.1f}s"))
            newest = max(newest, step)
            if scope == "cross":
                arrived.add(g)
                if (secs or 0.0) >= suspect():
                    cross_waiting.append(g)
        for g in [g for g in last_step if g not in groups]:  # gone, or no rank answered
            del last_step[g]
        if moving:  # a stuck leader behind moving ones (a job-wide stall holds every step)
            for g, step, why in others:
                if step < newest:
                    out.setdefault(g, why)
        if in_leaders and len(cross_waiting) * 2 > len(in_leaders):
            # one that did not arrive but is past the waiting ones' step was polled after the
            # stall ended: ahead, not late, and the job is not stalled
            waiting_at = sorted(step_of[g] for g in cross_waiting)[len(cross_waiting) // 2]
            late, ahead = [], False
            for g in in_leaders:
                if g not in arrived:
                    if step_of.get(g, -1) > waiting_at:
                        ahead = True
                    else:
                        late.append(g)
            if late:
                for g in late:
                    out.setdefault(g, "the others wait for it in the cross-group collective")
            elif not ahead:
                for g in groups:
                    out.setdefault(g, "every leader waits in the cross-group collective")
        return out, blocked, leader_urls
