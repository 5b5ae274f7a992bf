"""Which ranks a sweep asks and when: the one seam behind which the large-scale modes live.

The loop calls :meth:`Polling.collect` for a sweep's answers, :meth:`Polling.fr_dumps` for its
Flight Recorder dumps, and tells the seam where the sweep stands (:meth:`Polling.after_view`,
:meth:`Polling.after_decisions`, :meth:`Polling.end_sweep`, :meth:`Polling.wait`). Below the
sizes in :class:`~monitor.config.MonitorConfig` every call is the plain path: plan, poll, wait.
From them on, the seam also:

- polls from its own process (``poll_process_min_targets``, monitor/poll/poll_process.py), and
  then asks the next sweep's ranks ahead: while this sweep's detectors, ledgers and metrics run
  when the next sweep is due within ``ASK_LEAD`` x the polling time, else in the loop's wait just
  before it, so its answers are in when it starts and no older than they must be;
- asks the Flight Recorder dumps the sweep will want right after the states (a periodic look
  that is due, or the groups whose leader is blocked inside them), beside the view's build;
- keeps the cyclic garbage collector off during a sweep and freezes what survives it
  (``gc_freeze_min_targets``): at 100,000 ranks a full collection walks millions of acyclic
  objects (docs/scaling.md).

It lives beside the loop, not in ``poll/``, because it plans with the schedule and the detectors.
Nothing here raises because of a rank; a failure of a mode is logged and the sweep falls back to
asking for itself.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable

from .config import MonitorConfig
from .detect import Detectors, collective_wait
from .evidence.view import ClusterView, GroupView
from .poll import fd_budget
from .poll.discovery import Target
from .poll.poll_process import PollHandle, ProcessPoller
from .poll.poller import Poller, RankPoll
from .schedule import LeaderSchedule, Plan

log = logging.getLogger(__name__)

# Flight Recorder entries asked of each rank: the analysis' verdicts are the same from dumps cut
# to 64 entries as from whole ones (tests/test_monitor_fr_filter.py); 4x that
FR_LAST = 256
# ... and of torchft's cross-group group only, from the leaders of groups not drilled
FR_LAST_LEADERS = 64
FR_LEADERS_QUERY = f"?pg=torchft&last={FR_LAST_LEADERS}"
FR_DRILLED_QUERY = f"?last={FR_LAST}"
# between periodic looks, at most this many blocked groups' dumps are asked early: more at once
# is no single hang
EARLY_FR_GROUPS = 8
# the next sweep's ranks are asked this many times the last polling time before it starts
ASK_LEAD = 1.25
GC_FULL_EVERY = 100  # sweeps between full collections while frozen (cyclic garbage meanwhile)


class _Ahead:
    """The next sweep's polls, asked during this one: its targets, plan and poll handles."""

    __slots__ = ("targets", "plan", "handles")

    def __init__(self, targets: list[Target], plan: Plan, handle: PollHandle) -> None:
        self.targets, self.plan, self.handles = targets, plan, [handle]

    @property
    def sent_at(self) -> float:
        return self.handles[0].sent_at

    @property
    def poll_s(self) -> float | None:
        h = self.handles[0]
        return None if h.finished_at is None else h.finished_at - h.sent_at

    def result(self) -> dict[str, RankPoll]:
        polls = self.handles[0].result()
        for handle in self.handles[1:]:
            polls.update(handle.result())
        return polls


def _leads(view: ClusterView, url: str) -> bool:
    gv = view.groups.get(view.ranks[url].replica_group)
    return gv is not None and gv.leader is not None and gv.leader.url == url


def _blocked_in_group(gv: GroupView, now: float) -> bool:
    """The group's leader answered this sweep blocked in an in-group collective."""
    lead = gv.leader
    return lead is not None and lead.fresh and bool(lead.reachable) \
        and collective_wait(lead.state, now)[0] == "group"


class Polling:
    """A sweep's polls and Flight Recorder dumps; see the module docstring.

    ``targets()`` gives a sweep's targets (discovery's, this shard's); ``ask_ahead``: whether the
    next sweep may be asked before it starts (not on a shard, whose targets follow its lease)."""

    def __init__(self, cfg: MonitorConfig, schedule: LeaderSchedule, detectors: Detectors,
                 targets: Callable[[], list[Target]], clock: Callable[[], float],
                 ask_ahead: bool = True) -> None:
        self.cfg, self.schedule, self.detectors = cfg, schedule, detectors
        self.targets, self.clock, self.ask_ahead = targets, clock, ask_ahead
        self.poller: Poller | ProcessPoller = Poller(cfg.poll_timeout_s, cfg.max_concurrency,
                                                     max_bytes=cfg.max_state_bytes)
        self.plan: Plan | None = None  # the plan of the sweep collected last
        self.fr_leaders_skipped = False  # the last fetch skipped the leaders' dumps
        self._ahead: _Ahead | None = None
        self._fr_ahead: dict[str, tuple[set[str], PollHandle]] = {}  # query -> asked early
        self._fr_looked_at = float("-inf")
        self._poll_s: float | None = None  # the last sweep's polling, asked -> last answer
        self._sweep_started = 0.0  # time.monotonic()
        self._last_sweep_s = 0.0
        self._gc_frozen = 0  # sweeps since the last full collection (0: not freezing)
        self._fd_advised = False

    # --- the loop's calls ------------------------------------------------------------------
    def collect(self, view: ClusterView | None) -> tuple[list[Target], Plan, dict[str, RankPoll]]:
        """This sweep's targets, plan and answers (``view``: the last sweep's): those asked
        ahead if still fresh, else asked now; then the other ranks of any group whose leader
        answered blocked inside it (drilled in this sweep, not the next)."""
        self._sweep_started = time.monotonic()
        if self._gc_frozen:
            gc.disable()  # on again once what survived the sweep is frozen (end_sweep)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and time.monotonic() - ahead.sent_at > max(self.cfg.interval_s,
                                                                         self._last_sweep_s):
            ahead.result()  # asked too long ago: asked again
            ahead = None
        if ahead is not None:
            targets, plan = ahead.targets, ahead.plan
            polls = ahead.result()
            self._poll_s = ahead.poll_s or self._poll_s
        else:
            targets = self.targets()
            self._fit_poller(len(targets))
            plan = self.schedule.plan(targets, view, self.clock(), self._suspects())
            asked = time.monotonic()
            polls = self.poller.sweep(plan.urls, queries=self.detectors.state_queries(
                plan.urls, view=view))
            self._poll_s = time.monotonic() - asked
        self.plan = plan
        drill = self.schedule.drill_now(polls, view, self.clock())
        if drill:
            polls.update(self.poller.sweep(drill, queries=self.detectors.state_queries(
                drill, view=view)))
        self.ask_fr_early(plan, polls, self.clock(), view)
        return targets, plan, polls

    def after_view(self, view: ClusterView) -> None:
        """The view is built: ask the next sweep now when it is due, so its polling overlaps
        this sweep's detectors. Not while a hang may be building (a drilled group's leader is
        blocked inside it, or a hang's dumps may be fetched in this sweep): the next sweep's
        answers, which may confirm it, then come as late as before, and the dumps do not share
        the poller process with its requests. Never raises."""
        plan = self.plan
        if not self._may_ask_ahead() or plan is None or not self._due_to_ask():
            return
        try:
            if plan.drilled and (plan.blocked or self.detectors.hang_look_possible(
                    view.evidence(), view.at)):
                return
            self._ahead = self._plan_ahead(view, None if view.polled is None
                                           else set(view.polled))
        except Exception:
            self._ahead = None
            log.exception("could not ask the next sweep's ranks ahead")

    def after_decisions(self, view: ClusterView) -> None:
        """The decisions are made: when the next sweep was asked already, add the groups the
        detectors newly suspect (drilled, as its plan would have); else ask it now if due.
        Never raises: the next sweep then asks for itself."""
        if self._ahead is not None:
            try:
                extra = self.schedule.drill_suspects(self._ahead.plan, view, self.clock(),
                                                     self._suspects())
                if extra:
                    self._ahead.handles.append(self.poller.start(
                        extra, queries=self.detectors.state_queries(extra, view=view)))
            except Exception:  # its plan may name URLs nobody asked
                self._ahead = None
                log.exception("could not ask the next sweep's suspect groups ahead")
        elif self._may_ask_ahead() and self._due_to_ask():
            self._ask_ahead(view)

    def end_sweep(self, n_targets: int, started: float) -> None:
        """The sweep (begun at ``started``, perf_counter) is over: freeze what survived it from
        ``gc_freeze_min_targets`` on, with a full collection every GC_FULL_EVERY sweeps."""
        self._last_sweep_s = time.perf_counter() - started
        if n_targets < self.cfg.gc_freeze_min_targets:
            self._thaw_gc()
            return
        self._gc_frozen += 1
        if self._gc_frozen > GC_FULL_EVERY:
            gc.unfreeze()
            gc.collect()
            self._gc_frozen = 1
        gc.freeze()
        gc.enable()

    def wait(self, started: float, view: ClusterView | None, stop: threading.Event) -> bool:
        """Wait for the next sweep, ``interval_s`` after ``started`` (monotonic); when it may be
        asked ahead and was not yet, ask it ASK_LEAD x the last polling time before. True when
        ``stop`` was set meanwhile."""
        next_start = started + self.cfg.interval_s
        if self._ahead is None and view is not None and self._may_ask_ahead():
            lead = ASK_LEAD * (self._poll_s or 0.0)
            if stop.wait(max(0.0, next_start - lead - time.monotonic())):
                return True
            self._ask_ahead(view)
        return stop.wait(max(0.0, next_start - time.monotonic()))

    def close(self) -> None:
        self._thaw_gc()
        self.poller.close()

    # --- asking ahead ----------------------------------------------------------------------
    def _may_ask_ahead(self) -> bool:
        return self.ask_ahead and isinstance(self.poller, ProcessPoller)

    def _due_to_ask(self) -> bool:
        """The next sweep starts within ASK_LEAD x the last polling time: asked later it would
        wait for its answers, asked sooner they would be older than they must be."""
        if self._poll_s is None:
            return True
        next_start = self._sweep_started + self.cfg.interval_s
        return next_start - time.monotonic() <= ASK_LEAD * self._poll_s

    def _ask_ahead(self, view: ClusterView) -> None:
        try:
            self._ahead = self._plan_ahead(view)
        except Exception:
            log.exception("could not ask the next sweep's ranks ahead")

    def _plan_ahead(self, view: ClusterView, kept: set[str] | None = None) -> _Ahead:
        """The next sweep's plan, made from ``view`` as that sweep would, and its requests sent
        (``kept``: the ranks whose folded rows this view keeps, Detectors.state_queries)."""
        targets = self.targets()
        self._fit_poller(len(targets))
        plan = self.schedule.plan(targets, view, self.clock(), self._suspects())
        return _Ahead(targets, plan, self.poller.start(
            plan.urls, queries=self.detectors.state_queries(plan.urls, kept, view)))

    def _suspects(self) -> set[int]:
        """Groups drilled whatever their leader says: open findings, straggler candidates."""
        floor = self.cfg.detectors.straggler_min_lag_s
        return {f.replica_group for f in self.detectors.open_findings()} | {
            g for g, lag in self.detectors.last_lags.items() if lag is not None and lag >= floor}

    def _fit_poller(self, n_targets: int) -> None:
        """From ``poll_process_min_targets`` the poller runs in its own process (for good); its
        pool keeps a connection per target, within what the descriptor limit leaves (said once
        when the targets do not fit)."""
        if n_targets >= self.cfg.poll_process_min_targets and type(self.poller) is Poller:
            old = self.poller
            self.poller = ProcessPoller(old.timeout_s, old.max_concurrency, old.max_idle,
                                        old.max_bytes)
            old.close()
        self.poller.max_idle = max(self.poller.max_idle, n_targets + 1024)
        if not self._fd_advised:
            limit = fd_budget.soft_limit()
            advice = fd_budget.advice(n_targets, fd_budget.budget(
                limit, self.cfg.max_concurrency)[1], limit, self.cfg.max_concurrency)
            if advice:
                self._fd_advised = True
                log.warning("%s", advice)

    def _thaw_gc(self) -> None:
        if self._gc_frozen:
            gc.unfreeze()
            gc.enable()
            self._gc_frozen = 0

    # --- Flight Recorder -------------------------------------------------------------------
    def ask_fr_early(self, plan: Plan, polls: dict[str, RankPoll], now: float,
                     view: ClusterView | None) -> None:
        """With the poller in its own process, ask the dumps :meth:`fr_dumps` will want right
        after the states (groups and leaders of the last view): a periodic look that is due
        and not held by the detectors, else those of up to EARLY_FR_GROUPS groups whose leader
        is blocked inside them. Never raises."""
        if not isinstance(self.poller, ProcessPoller) or view is None or plan.everything:
            return
        try:
            periodic = now - self._fr_looked_at >= self.cfg.detectors.fr_interval_s \
                and not self.detectors.periodic_look_held(
                    view, now, [p.data for p in polls.values() if p.ok])
            if periodic:
                groups = [g for g in plan.drilled if g in view.groups]
            else:
                groups = [g for g in plan.drilled if g in plan.blocked and g in view.groups]
                if not groups or len(groups) > EARLY_FR_GROUPS:
                    return
            drilled = [r.url for g in groups for r in view.groups[g].ranks]
            leaders = [gv.leader.url for g, gv in view.groups.items()
                       if gv.leader is not None and g not in plan.drilled] if periodic else []
            for urls, query in ((drilled, FR_DRILLED_QUERY), (leaders, FR_LEADERS_QUERY)):
                urls = [u for u in urls if u in polls and polls[u].ok]
                if urls:
                    self._fr_ahead[query] = (set(urls), self.poller.start(
                        urls, "/v1/fr_trace" + query, self.cfg.fr_timeout_s,
                        self.cfg.max_fr_bytes))
        except Exception:
            log.exception("could not ask the Flight Recorder early")

    def fr_dumps(self, view: ClusterView, now: float) -> dict[int, dict]:
        """This sweep's Flight Recorder dumps, by rank, of the ranks the detectors want and
        this sweep polled: the newest FR_LAST entries of every process group from the drilled
        groups' ranks, torchft's cross-group group only from the other leaders (never every
        rank at once: gigabytes at scale). When every drilled group's leader is blocked inside
        it and its own dumps confirm its hang there, no other dump changes a finding: the
        leaders' fetch is skipped."""
        urls = [u for u in self.detectors.fr_wanted(view, now) if view.ranks[u].fresh]
        self.fr_leaders_skipped = False
        ahead, self._fr_ahead = self._fr_ahead, {}  # what is not read is dropped
        if not urls:
            return {}
        self._fr_looked_at = now
        plan = self.plan if self.plan is not None else self.schedule.last
        if plan is None or not self.schedule.active(len(view.ranks)):
            drilled, drilled_urls = set(), set(urls)
        else:  # leaders and drilled groups only, even on a sweep that asked every rank
            drilled = {g for g in plan.drilled if g in view.groups}
            drilled_urls = {r.url for g in drilled for r in view.groups[g].ranks}
            urls = [u for u in urls if u in drilled_urls or _leads(view, u)]
        dumps = self._fr_part(view, [u for u in urls if u in drilled_urls], FR_DRILLED_QUERY,
                              ahead)
        leaders = [u for u in urls if u not in drilled_urls]
        if leaders and drilled and dumps and all(
                _blocked_in_group(view.groups[g], now) for g in drilled) \
                and drilled <= self.detectors.in_group_hangs(view, dumps, now):
            self.fr_leaders_skipped = True
            leaders = []
        dumps.update(self._fr_part(view, leaders, FR_LEADERS_QUERY, ahead))
        return dumps

    def _fr_part(self, view: ClusterView, urls: list[str], query: str,
                 ahead: dict[str, tuple[set[str], PollHandle]]) -> dict[int, dict]:
        """The dumps of ``urls``: from the answers asked early where there are some."""
        early = ahead.get(query)
        if early is None or not urls:
            return self._fr_read(view, urls, query)
        asked, handle = early
        dumps = self._fr_read(view, [u for u in urls if u not in asked], query)
        got = handle.result()
        wanted = [u for u in urls if u in asked]
        dumps.update(self._fr_read(view, wanted, query, {u: got[u] for u in wanted}))
        return dumps

    def _fr_read(self, view: ClusterView, urls: list[str], query: str,
                 got: dict[str, RankPoll] | None = None) -> dict[int, dict]:
        """``/v1/fr_trace`` + ``query`` of ``urls`` (or their answers ``got``), by rank: only
        dumps that describe the verified rank that served them. A server that refuses the
        filter (400) is asked for its whole dump."""
        if not urls:
            return {}
        if got is None:
            got = self.poller.sweep(urls, "/v1/fr_trace" + query, self.cfg.fr_timeout_s,
                                    self.cfg.max_fr_bytes)
        refused = [u for u, p in got.items() if p.status == 400]
        if refused:
            got.update(self.poller.sweep(refused, "/v1/fr_trace", self.cfg.fr_timeout_s,
                                         self.cfg.max_fr_bytes))
        dumps: dict[int, dict] = {}
        for url, p in got.items():
            rv = view.ranks.get(url)
            if not p.ok or not isinstance(p.data, dict) or rv is None or rv.rank is None:
                continue
            claimed = p.data.get("rank", rv.rank)
            if claimed != rv.rank or p.data.get("replica_group", rv.replica_group) \
                    != rv.replica_group:
                log.warning("ignoring %s/v1/fr_trace: it claims rank %r of group %r, its "
                            "/v1/state rank %s of group %s", url, claimed,
                            p.data.get("replica_group"), rv.rank, rv.replica_group)
                continue
            dumps[rv.rank] = p.data
        return dumps
