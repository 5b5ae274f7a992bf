"""Which ranks a sweep asks and when: the seam behind which the large-scale modes live (a poller
process, asking ahead, GC freezing; docs/scaling.md). Nothing here raises because of a rank.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .config import MonitorConfig
from .detect import Detectors, collective_wait
from .evidence.torch_rank import FR_LAST, TorchRanks
from .evidence.view import ClusterView, GroupView
from .poll import fd_budget
from .poll.discovery import Target
from .poll.fr_bound import FrBound
from .poll.poll_process import PollHandle, ProcessPoller
from .poll.poller import Poller, RankPoll
from .poll.torch_server import TorchPoller
from .poll.torch_target import is_torch
from .schedule import LeaderSchedule, Plan

log = logging.getLogger(__name__)

FR_LAST_LEADERS = 64  # entries asked of the leaders of groups not drilled: torchft's only
FR_DRILLED_QUERY, FR_LEADERS_QUERY = f"?last={FR_LAST}", f"?pg=torchft&last={FR_LAST_LEADERS}"
_FR_ASKED = {FR_DRILLED_QUERY: FR_LAST, FR_LEADERS_QUERY: FR_LAST_LEADERS}
# an answer to ?last=N: N entries of 32 KiB (torch's JSON entry is ~0.5 KB, no stack frames:
# room for a coalesced collective of ~1,000 tensors) after a head (pg_config, ...) of 1 MiB;
# --max-fr-bytes bounds the whole dump (a 400's fallback); the head also carries up to 256
# torchft incarnations, each naming one global rank a replica group (~16 bytes of JSON each)
FR_ENTRY_BYTES, FR_HEAD_BYTES, FR_GROUP_HEAD_BYTES = 32 << 10, 1 << 20, 256 * 16
EARLY_FR_GROUPS = 8  # more blocked groups at once is no single hang: not asked early
ASK_LEAD = 1.25  # the next sweep is asked this many last polling times before it starts
GC_FULL_EVERY = 100  # sweeps between full collections while frozen


@dataclass
class _Ahead:
    """The next sweep's targets, plan and poll handles, asked during this one."""

    targets: list[Target]
    plan: Plan
    handles: list[PollHandle]

    def result(self) -> dict[str, RankPoll]:
        polls = self.handles[0].result()  # no copy: 100k entries a sweep
        for handle in self.handles[1:]:
            polls.update(handle.result())
        return polls


def _leads(view: ClusterView, url: str) -> bool:
    gv = view.groups.get(view.ranks[url].replica_group)
    return gv is not None and gv.leader is not None and gv.leader.url == url


def _blocked_in_group(gv: GroupView) -> bool:
    lead = gv.leader
    return lead is not None and lead.fresh and bool(lead.reachable) \
        and collective_wait(lead.state)[0] == "group"


class Polling:
    """A sweep's polls and Flight Recorder dumps. ``ask_ahead``: whether the next sweep may be
    asked before it starts (not on a shard, whose targets follow its lease)."""

    def __init__(self, cfg: MonitorConfig, schedule: LeaderSchedule, detectors: Detectors,
                 targets: Callable[[], list[Target]], clock: Callable[[], float],
                 ask_ahead: bool, torch_ranks: TorchRanks, has_torch: Callable[[], bool]) -> None:
        self.cfg, self.schedule, self.detectors = cfg, schedule, detectors
        self.targets, self.clock, self.ask_ahead = targets, clock, ask_ahead
        self.poller: Poller | ProcessPoller = Poller(cfg.poll_timeout_s, cfg.max_concurrency,
                                                     max_bytes=cfg.max_state_bytes)
        # ranks on torch's own debug server (torch+http://): read apart, made states in evidence
        self.torch = TorchPoller(cfg.poll_timeout_s, cfg.fr_timeout_s, cfg.max_state_bytes,
                                 cfg.max_fr_bytes)
        self.torch_ranks = torch_ranks
        self.has_torch = has_torch  # whether any target is one: else no URL is looked at
        self.plan: Plan | None = None  # the plan of the sweep collected last
        self.fr_leaders_skipped = False  # the last fetch skipped the leaders' dumps (benchmarks)
        self._ahead: _Ahead | None = None
        # query -> (asked early, its handle, the wait it was given)
        self._fr_ahead: dict[str, tuple[set[str], PollHandle, float]] = {}
        self.fr_bound = FrBound(cfg.fr_timeout_s)
        self._fr_looked_at = float("-inf")
        self._poll_s: float | None = None  # the last sweep's polling, asked -> last answer
        self._sweep_started = 0.0  # time.monotonic()
        self._last_sweep_s = 0.0
        self._gc_frozen = 0  # sweeps since the last full collection (0: not freezing)
        self._fd_advised = False
        self._fr_refused: set[str] = set()  # ranks whose refused dump was said (said once)
        self._closed = False

    def collect(self, view: ClusterView | None) -> tuple[list[Target], Plan, dict[str, RankPoll]]:
        """This sweep's targets, plan and answers (``view``: the last sweep's), asked ahead if
        still fresh; then the ranks of groups whose leader answered blocked inside them."""
        self._sweep_started = time.monotonic()
        if self._gc_frozen:
            gc.disable()  # on again once what survived the sweep is frozen (end_sweep)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and time.monotonic() - ahead.handles[0].sent_at > max(
                self.cfg.interval_s, self._last_sweep_s):
            ahead.result()  # asked too long ago: asked again
            ahead = None
        if ahead is not None:
            targets, plan = ahead.targets, ahead.plan
            polls = self._states(plan.urls, view, ahead.result())
            first = ahead.handles[0]
            if first.finished_at is not None:
                self._poll_s = (first.finished_at - first.sent_at) or self._poll_s
        else:
            targets, plan = self._new_plan(view)
            asked = time.monotonic()
            polls = self._states(plan.urls, view)
            self._poll_s = time.monotonic() - asked
        self.plan = plan
        drill = self.schedule.drill_now(polls, view, self.clock())
        if drill:
            polls.update(self._states(drill, view))
        self.ask_fr_early(plan, polls, self.clock(), view)
        return targets, plan, polls

    def after_view(self, view: ClusterView) -> None:
        """Ask the next sweep now when due, to overlap this sweep's detectors; not while a hang
        may be building (its dumps must not share the poller process). Never raises."""
        plan = self.plan
        if not self._may_ask_ahead() or plan is None or not self._due_to_ask():
            return
        try:
            if plan.drilled and (plan.blocked or self.detectors.hang_look_possible(
                    view.evidence(), view.at)):
                return
        except Exception:
            log.exception("could not tell whether a hang may be building")
            return
        self._ask_ahead(view, None if view.polled is None else set(view.polled))

    def after_decisions(self, view: ClusterView) -> None:
        """Add the newly suspect groups to the next sweep asked already, else ask it if due.
        Never raises."""
        if self._ahead is not None:
            try:
                extra = self._split(self.schedule.drill_suspects(
                    self._ahead.plan, view, self.clock(), self._suspects()))[0]
                if extra:
                    self._ahead.handles.append(self.poller.start(
                        extra, queries=self.detectors.state_queries(extra, view=view)))
            except Exception:  # its plan may name URLs nobody asked
                self._ahead = None
                log.exception("could not ask the next sweep's suspect groups ahead")
        elif self._may_ask_ahead() and self._due_to_ask():
            self._ask_ahead(view)

    def end_sweep(self, n_targets: int, started: float) -> None:
        """From ``gc_freeze_min_targets`` on, freeze what survived the sweep (``started``:
        perf_counter), with a full collection every GC_FULL_EVERY sweeps."""
        self._last_sweep_s = time.perf_counter() - started
        # closed: a sweep outlasting stop()'s wait would freeze what no one thaws again
        if n_targets < self.cfg.gc_freeze_min_targets or self._closed:
            self._thaw_gc()
            return
        self._gc_frozen += 1
        if self._gc_frozen > GC_FULL_EVERY:
            gc.unfreeze()
            gc.collect()
            self._gc_frozen = 1
        gc.freeze()
        gc.enable()

    def abort_sweep(self) -> None:
        """A sweep that raised after :meth:`collect` (a full ``--state`` fails every one): the
        collector on again, as end_sweep would have, what was frozen left so."""
        if self._gc_frozen:
            gc.enable()

    def wait(self, started: float, view: ClusterView | None, stop: threading.Event) -> bool:
        """Wait until ``interval_s`` after ``started`` (monotonic), asking the next sweep ahead
        on the way when it may be; True when ``stop`` was set."""
        next_start = started + self.cfg.interval_s
        if self._ahead is None and view is not None and self._may_ask_ahead():
            lead = ASK_LEAD * (self._poll_s or 0.0)
            if stop.wait(max(0.0, next_start - lead - time.monotonic())):
                return True
            self._ask_ahead(view)
        return stop.wait(max(0.0, next_start - time.monotonic()))

    def close(self) -> None:
        self._closed = True
        self._thaw_gc()
        self.poller.close()
        self.torch.close()

    def _split(self, urls: list[str]) -> tuple[list[str], list[str]]:
        """(the poller's URLs, those on torch's debug server); without any of the latter,
        ``urls`` as they are (no URL looked at: a sweep of 100k)."""
        if not self.has_torch():
            return urls, []
        return [u for u in urls if not is_torch(u)], [u for u in urls if is_torch(u)]

    def _states(self, urls: list[str], view: ClusterView | None,
                polls: dict[str, RankPoll] | None = None) -> dict[str, RankPoll]:
        """The state answers of ``urls``: the poller's (``polls`` when asked ahead), and those
        of ranks on torch's debug server from :attr:`torch`."""
        lk, torch = self._split(urls)
        if polls is None:
            polls = self.poller.sweep(lk, queries=self.detectors.state_queries(lk, view=view))
        if torch:
            polls.update(self.torch.sweep(torch, self.detectors.state_queries(torch, view=view)))
        return polls

    def _may_ask_ahead(self) -> bool:
        return self.ask_ahead and isinstance(self.poller, ProcessPoller)

    def _due_to_ask(self) -> bool:
        """The next sweep starts within ASK_LEAD x the last polling time."""
        if self._poll_s is None:
            return True
        next_start = self._sweep_started + self.cfg.interval_s
        return next_start - time.monotonic() <= ASK_LEAD * self._poll_s

    def _ask_ahead(self, view: ClusterView, kept: set[str] | None = None) -> None:
        """Plan the next sweep from ``view`` and send its requests (``kept``: as
        Detectors.state_queries takes it). Never raises: a failure asks nothing ahead."""
        try:
            targets, plan = self._new_plan(view)
            lk = self._split(plan.urls)[0]
            self._ahead = _Ahead(targets, plan, [self.poller.start(
                lk, queries=self.detectors.state_queries(lk, kept, view))])
        except Exception:
            self._ahead = None
            log.exception("could not ask the next sweep's ranks ahead")

    def _new_plan(self, view: ClusterView | None) -> tuple[list[Target], Plan]:
        targets = self.targets()
        self._fit_poller(len(targets))
        return targets, self.schedule.plan(targets, view, self.clock(), self._suspects())

    def _suspects(self) -> set[int]:
        """Groups drilled whatever their leader says: open findings, straggler candidates."""
        floor = self.detectors.lag_floor
        return {f.replica_group for f in self.detectors.open_findings()} | {
            g for g, lag in self.detectors.last_lags.items() if lag is not None and lag >= floor}

    def _fit_poller(self, n_targets: int) -> None:
        """From ``poll_process_min_targets`` poll from a child process, for good; keep a
        connection per target (said once when the descriptor limit does not allow it)."""
        if n_targets >= self.cfg.poll_process_min_targets and type(self.poller) is Poller:
            old = self.poller
            self.poller = ProcessPoller(old.timeout_s, old.max_concurrency, old.max_idle,
                                        old.max_bytes)
            old.close()
        self.poller.max_idle = max(self.poller.max_idle, n_targets + fd_budget.SPARE_IDLE)
        if not self._fd_advised:
            advice = fd_budget.advice(n_targets, fd_budget.soft_limit(), self.cfg.max_concurrency)
            if advice:
                self._fd_advised = True
                log.warning("%s", advice)

    def _thaw_gc(self) -> None:
        if self._gc_frozen:
            gc.unfreeze()
            gc.enable()
            self._gc_frozen = 0

    def ask_fr_early(self, plan: Plan, polls: dict[str, RankPoll], now: float,
                     view: ClusterView | None) -> None:
        """With a poller process, ask now the dumps :meth:`fr_dumps` will want: a periodic look
        that is due, else those of up to EARLY_FR_GROUPS blocked groups. Never raises."""
        if not isinstance(self.poller, ProcessPoller) or view is None or plan.everything:
            return
        try:
            periodic = now - self._fr_looked_at >= self.detectors.fr_interval() \
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
                resting = self.fr_bound.resting(urls)
                urls = [u for u in self._split(urls)[0]
                        if u in polls and polls[u].ok and u not in resting]
                if urls:
                    wait = self.fr_bound.wait_s(urls)
                    self._fr_ahead[query] = (set(urls), self.poller.start(
                        urls, "/v1/fr_trace" + query, wait,
                        self.fr_answer_bytes(query, job_groups(view))), wait)
        except Exception:
            log.exception("could not ask the Flight Recorder early")

    def fr_dumps(self, view: ClusterView, now: float) -> dict[int, dict]:
        """This sweep's Flight Recorder dumps by rank: whole from drilled groups, torchft's from
        other leaders (never every rank: gigabytes), skipped when the drilled ones confirm hangs."""
        urls = [u for u in self.detectors.fr_wanted(view, now) if view.ranks[u].fresh]
        self.fr_leaders_skipped = False
        ahead, self._fr_ahead = self._fr_ahead, {}  # what is not read is dropped
        if not urls:
            return {}
        self._fr_looked_at = now
        self.fr_bound.keep(view.ranks)
        self._fr_refused &= view.ranks.keys()  # forgotten ranks
        plan = self.plan if self.plan is not None else self.schedule.last
        every_rank = plan is None or not self.schedule.active(len(view.ranks))
        # only a look at every rank is hastened by a short window (Detectors.fr_interval): with
        # leader polling the leaders' dumps are torchft's alone, an in-group entry never read
        self.detectors.fr_window_adapts = every_rank
        if every_rank:
            drilled, drilled_urls = set(), set(urls)
        else:  # leaders and drilled groups only, even on a sweep that asked every rank
            drilled = {g for g in plan.drilled if g in view.groups}
            drilled_urls = {r.url for g in drilled for r in view.groups[g].ranks}
            urls = [u for u in urls if u in drilled_urls or _leads(view, u)]
        dumps = self._fr_read(view, [u for u in urls if u in drilled_urls], FR_DRILLED_QUERY,
                              ahead.get(FR_DRILLED_QUERY))
        leaders = [u for u in urls if u not in drilled_urls]
        if leaders and drilled and dumps and all(
                _blocked_in_group(view.groups[g]) for g in drilled) \
                and drilled <= self.detectors.in_group_hangs(view, dumps, now):
            self.fr_leaders_skipped = True
            leaders = []
        dumps.update(self._fr_read(view, leaders, FR_LEADERS_QUERY, ahead.get(FR_LEADERS_QUERY)))
        return dumps

    def _fr_read(self, view: ClusterView, urls: list[str], query: str,
                 early: tuple[set[str], PollHandle, float] | None) -> dict[int, dict]:
        """``/v1/fr_trace`` + ``query`` of ``urls`` (those in ``early`` from its answers), by
        rank: only dumps of the verified rank that served them. A 400 (no filter) asks the
        whole dump. Each fetch waits as long as :attr:`fr_bound` allows the ranks it asks."""
        if not urls:
            return {}
        dumps: dict[int, dict] = {}
        got: dict[str, RankPoll] = {}
        if early is not None:
            asked, handle, wait = early
            answered = handle.result()
            self.fr_bound.learn(answered, wait)
            got = {u: answered[u] for u in urls if u in asked}
        rest, torch = self._split([u for u in urls if u not in got])
        for url in torch:
            rv = view.ranks.get(url)
            if rv is None or rv.rank is None or not rv.state:
                continue
            if "torch_only" not in rv.state:  # Lightkeeper's handlers: lightkeeper_fr_trace
                rest.append(url)
                continue
            d = self.torch_ranks.dumps.get(url)  # came with its state this sweep
            if d is not None and d["rank"] == rv.rank:
                dumps[rv.rank] = d
        if rest:
            got.update(self._fetch(rest, "/v1/fr_trace" + query, None,
                                   self.fr_answer_bytes(query, job_groups(view))))
        refused = self._split([u for u, p in got.items() if p.status == 400])[0]
        if refused:  # their whole dumps: no earlier answer says how long those take
            got.update(self._fetch(refused, "/v1/fr_trace", self.cfg.fr_timeout_s))
        whole = set(refused)
        for url, p in got.items():
            rv = view.ranks.get(url)
            if not p.ok and p.reason == "bad_response":
                if url not in self._fr_refused:  # once while it lasts: it is asked every look
                    self._fr_refused.add(url)
                    log.warning("ignoring %s/v1/fr_trace%s: %s", url,
                                "" if url in whole else query, p.error)
            elif p.ok:
                self._fr_refused.discard(url)
            if not p.ok or not isinstance(p.data, dict) or rv is None or rv.rank is None:
                continue
            if url not in whole:
                _newest(p.data, _FR_ASKED.get(query))
            claimed = p.data.get("rank", rv.rank)
            if claimed != rv.rank or p.data.get("replica_group", rv.replica_group) \
                    != rv.replica_group:
                log.warning("ignoring %s/v1/fr_trace: it claims rank %r of group %r, its "
                            "/v1/state rank %s of group %s", url, claimed,
                            p.data.get("replica_group"), rv.rank, rv.replica_group)
                continue
            dumps[rv.rank] = p.data
        return dumps

    def fr_answer_bytes(self, query: str, groups: int) -> int:
        """The largest answer to ``/v1/fr_trace`` + ``query`` read in a job of ``groups``
        replica groups: what its head and ``last`` entries need, at most ``--max-fr-bytes``."""
        last = _FR_ASKED.get(query)
        most = self.cfg.max_fr_bytes
        return most if last is None else min(
            most, FR_HEAD_BYTES + groups * FR_GROUP_HEAD_BYTES + last * FR_ENTRY_BYTES)

    def _fetch(self, urls: list[str], path: str, wait: float | None = None,
               max_bytes: int | None = None) -> dict[str, RankPoll]:
        most = self.cfg.max_fr_bytes if max_bytes is None else max_bytes
        return self.fr_bound.fetch(
            urls, lambda live, w: self.poller.sweep(live, path, w, most), wait)


def job_groups(view: ClusterView) -> int:
    """The job's replica groups: a shard's view holds only its slice, while every rank's
    incarnations name one global rank for each group of the job."""
    return max(len(view.groups), view.quorum_participants() or 0)


def _newest(dump: dict, last: int | None) -> None:
    """A dump asked for its ``last`` entries that sent more (a server ignoring the query) keeps
    the newest ``last``, its ``filter`` saying so (older entries may be left out)."""
    entries = dump.get("entries")
    if last is None or not isinstance(entries, list) or len(entries) <= last:
        return
    filt = dump.get("filter")
    filt = dict(filt) if isinstance(filt, dict) else {"pg": None}
    total = filt.get("entries_total")
    filt["last"] = last
    filt["entries_total"] = max(len(entries), total if type(total) is int else 0)
    dump["entries"] = entries[-last:]
    dump["filter"] = filt
