"""The monitor's loop: ranks -> poller -> verification -> detectors -> decisions -> actions.

:class:`Monitor` wires the stages together and owns nothing else: discovery says whom to poll,
the poller fetches ``/v1/state`` (and ``/v1/fr_trace`` when a detector asks), the view builder
folds answers into groups x ranks, verification checks each rank's claims against the
Lighthouse's ``/status`` (read right after the ranks), the detectors turn the *evidence* view
(verified ranks only) into confirmed findings, the rails decide, the Lighthouse client acts, and
the store keeps the audit log. The full view, unverified ranks included, is only shown. The HTTP
API (:mod:`monitor.api.app`) only reads what the loop published, plus two writes (registration and
manual eviction) that go through the same objects.

A sweep that fails anywhere is logged and counted; the loop goes on with the next one. The
monitor never raises out of :meth:`Monitor.sweep_once` because of a rank.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any

from http_serving import BackgroundWSGIServer, http_url

from .act.actions import Lighthouse, Orphans, RankExits
from .act.decisions import Situation, decide
from .act.hosts import HostLedger
from .act.sinks import SinkConfigError, build_sink, validate_action
from .api.app import create_app
from .api.metrics import MonitorMetrics
from .config import ConfigError, MonitorConfig
from .detect import KINDS, Analyzer, Detectors, Finding, collective_wait
from .evidence.lighthouse_settings import LighthouseSettingsWatch
from .evidence.lighthouse_status import LighthouseReader, LighthouseStatus
from .evidence.verification import REASONS as TRUST_REASONS
from .evidence.verification import VERIFIED, Verifier
from .evidence.view import ClusterView, GroupView, ViewBuilder
from .goodput.ledger import GoodputConfig, GoodputLedger
from .goodput.writer import GoodputWriter
from .poll import fd_budget
from .poll.admission import AllowList, NotAllowed, Unauthorized, registration_authorized
from .poll.discovery import BadTarget, Discovery, Target, TooManyTargets, normalize_url
from .poll.poll_process import PollHandle, ProcessPoller
from .poll.poller import Poller, RankPoll
from .schedule import LeaderSchedule, Plan
from .shard import Shards
from .store import Store

log = logging.getLogger(__name__)

GOODPUT_SAVE_S = 5.0  # the goodput ledger's state is written at least this often
# Flight Recorder entries a fetch asks each rank for (``/v1/fr_trace?last=N``, the newest N of
# all its process groups): the analysis engine's verdicts on the gloo/frgen scenarios are the
# same from dumps cut to 64 entries as from whole ones (tests/test_monitor_fr_filter.py); 4x that
FR_LAST = 256
# ... and of torchft's cross-group group only, from the leaders of groups not drilled (the same
# verdicts on the single-rank-group scenarios from dumps cut to 16 entries of it)
FR_LAST_LEADERS = 64
FR_LEADERS_QUERY = f"?pg=torchft&last={FR_LAST_LEADERS}"
FR_DRILLED_QUERY = f"?last={FR_LAST}"
# From this many targets the cyclic garbage collector is kept off during a sweep and what
# survived it is then moved out of its reach (gc.freeze): with 100,000 ranks' states held, each
# full collection walked millions of objects, 1-17 s on this box, about once a sweep
# (docs/scaling.md). The states are acyclic and still freed by reference counting; a full
# collection of everything runs every GC_FULL_EVERY sweeps, so cyclic garbage made meanwhile is
# collected then.
GC_FREEZE_MIN_TARGETS = 20_000
GC_FULL_EVERY = 100
# From this many targets the poller runs in its own process (monitor/poll/poll_process.py): its
# ~0.4 s of CPU a sweep at 100,000 ranks then leaves the monitor's interpreter and overlaps the
# end of the sweep before (Monitor._ask_ahead). The process costs more CPU per request in all
# (its IPC: 50 -> 28 + 40 us at 2,000 ranks, load 15.6, bench_poller.py) and gains only where
# sweeps outlast the interval, which with leader polling on this 2-core box starts at about
# 50,000-60,000 ranks (docs/scaling.md)
POLL_PROCESS_MIN_TARGETS = 50_000
# Between periodic looks, the Flight Recorder of up to this many groups whose leader is blocked
# inside the group is asked right after the states (Monitor._ask_fr_early): a hang's evidence
# sooner. More such groups at once is no single hang: their dumps are asked after the view.
EARLY_FR_GROUPS = 8
# With the poller in its own process, the next sweep's ranks are asked this many times the last
# sweep's polling time (asked -> last answer) before the next sweep starts (Monitor._due_to_ask):
# in when it starts, no older than they must be
ASK_LEAD = 1.25

class _Ahead:
    """The next sweep's polls, asked during this one (Monitor._ask_ahead_early, _ask_ahead):
    its targets, its plan and the poller process's handles (the plan's URLs, then any added
    for groups suspected later)."""

    __slots__ = ("targets", "plan", "handles")

    def __init__(self, targets: list[Target], plan: Plan, handle: PollHandle) -> None:
        self.targets, self.plan, self.handles = targets, plan, [handle]

    @property
    def sent_at(self) -> float:
        return self.handles[0].sent_at

    @property
    def poll_s(self) -> float | None:
        """Seconds from asking the plan's ranks to their last answer (None: not all in)."""
        h = self.handles[0]
        return None if h.finished_at is None else h.finished_at - h.sent_at

    def result(self) -> dict[str, RankPoll]:
        polls = self.handles[0].result()
        for handle in self.handles[1:]:
            polls.update(handle.result())
        return polls


def _leads(view: ClusterView, url: str) -> bool:
    """The rank at ``url`` is its group's leader in ``view`` (its group's, not every group's,
    leader looked at)."""
    gv = view.groups.get(view.ranks[url].replica_group)
    return gv is not None and gv.leader is not None and gv.leader.url == url


def _blocked_in_group(gv: GroupView, now: float) -> bool:
    """The group's leader answered this sweep blocked in an in-group collective (on a member:
    what drills a group for a hang inside it, not for being the one the others wait for)."""
    lead = gv.leader
    return lead is not None and lead.fresh and bool(lead.reachable) \
        and collective_wait(lead.state, now)[0] == "group"


def _in_quorum_by_replica_id(evidence: ClusterView) -> dict[str | None, set[int]]:
    """The evidence's groups in the newest quorum, by the replica id they report."""
    out: dict[str | None, set[int]] = {}
    for gv in evidence.in_quorum():
        out.setdefault(gv.replica_id, set()).add(gv.replica_group)
    return out


def _reporting(view: ClusterView, replica_id: str | None) -> list:
    """The reachable ranks reporting ``replica_id``, in the targets' order (rank hint, URL):
    looked for in the groups whose reachable ranks report it (a per-group set kept while the
    group only progresses), not rank by rank over every rank known."""
    found = [r for gv in view.groups.values() if replica_id in gv.reported_replica_ids
             for r in gv.reachable if r.replica_id == replica_id]
    return sorted(found, key=lambda r: (r.target.rank if r.target is not None
                                        and r.target.rank is not None else 1 << 62, r.url))


REFUSALS = {Unauthorized: "unauthorized", NotAllowed: "not_allowed", BadTarget: "bad_request",
            TooManyTargets: "too_many_targets"}


def allow_list(cfg: MonitorConfig) -> AllowList:
    """Who may register without the token (raises ValueError on a bad entry)."""
    if cfg.allow_targets is None:
        return AllowList.default(cfg.targets)
    return AllowList.parse(cfg.allow_targets)


def check_config(cfg: MonitorConfig) -> None:
    """``cfg.validate()`` and the checks that need a stage's own grammar (targets, allow list,
    quarantine actions). Raises ConfigError; nothing starts then."""
    cfg.validate()
    try:
        allow_list(cfg)
        for t in cfg.targets:
            normalize_url(t)  # e.g. an IPv6 literal without brackets: said here, not a crash
        for a in cfg.quarantine.actions:
            validate_action(a)
    except (ValueError, SinkConfigError) as e:  # BadTarget is a ValueError
        raise ConfigError(str(e)) from None


class Monitor:
    def __init__(self, cfg: MonitorConfig, analyzer: Analyzer | None = None,
                 clock=time.time) -> None:
        check_config(cfg)
        self.cfg = cfg
        self.clock = clock
        self.discovery = Discovery(cfg.targets, cfg.targets_file, cfg.forget_after_s, cfg.job,
                                   max_targets=cfg.max_targets)
        self.allow_list = allow_list(cfg)
        if cfg.sd_out:
            self.discovery.restore(cfg.sd_out)  # resume polling what the last run knew
        self.poller = Poller(cfg.poll_timeout_s, cfg.max_concurrency,
                             max_bytes=cfg.max_state_bytes)
        self.views = ViewBuilder()
        self.verifier = Verifier()
        self.schedule = LeaderSchedule(cfg.leader_polling, cfg.leader_polling_min_ranks,
                                       cfg.member_interval_s, cfg.interval_s)
        self.detectors = Detectors(cfg.detectors, analyzer, clock=clock)
        self.store = Store(cfg.state_path)
        self.lighthouse = Lighthouse(cfg.lighthouse, cfg.kill_timeout_s)
        self.orphans = Orphans(RankExits(cfg.rank_exit_token, cfg.kill_timeout_s),
                               cfg.orphan_grace_s)
        self.lighthouse_reader = LighthouseReader(cfg.lighthouse, cfg.lighthouse_timeout_s) \
            if cfg.lighthouse else None
        self.lighthouse_status: LighthouseStatus | None = None
        self.lighthouse_error: str | None = None if cfg.lighthouse else "no --lighthouse"
        self.metrics = MonitorMetrics(cfg.job)
        self.hosts = HostLedger(self.store, cfg.quarantine, self._build_sinks(), cfg.job, clock)
        self.hosts_error: str | None = None
        self._host_actions: threading.Thread | None = None
        # slow-recovery warning from the Lighthouse's settings (docs/lighthouse.md)
        self.lh_settings = LighthouseSettingsWatch(cfg.lighthouse_heartbeat_timeout_ms,
                                                   cfg.lighthouse_join_timeout_ms, cfg.interval_s)
        self.metrics.dry_run.labels(cfg.job).set(1 if cfg.rails.dry_run else 0)
        self.view: ClusterView | None = None  # every rank: what the monitor shows
        self.evidence: ClusterView | None = None  # ranks whose answers count: what it acts on
        self.sweeps = 0
        self.last_sweep_error: str | None = None
        self.started_at = clock()
        self._finding_ids: dict[tuple, int] = {}
        self._last_decision: dict[tuple, str] = {}
        self._act_lock = threading.Lock()  # one decision/eviction at a time (loop vs. API)
        self._goodput_lock = threading.Lock()  # the loop updates the ledger, the API reads it
        self.goodput = self._restore_goodput()
        self.goodput_error: str | None = None
        self._goodput_saved_at = float("-inf")
        self._goodput_save_s = 0.0  # how long the last save took (snapshot and write)
        self._goodput_writer = GoodputWriter(self.store)  # writes beside the next sweep
        self._gc_frozen = 0  # sweeps since the last full collection (0: not freezing)
        self._fd_advised = False  # the file descriptor warning (_fit_poller) said once
        self.sweep_plan = None  # what the last sweep polled (schedule.last may be the next's)
        self._ahead: _Ahead | None = None  # the next sweep's polls, already asked
        self._last_sweep_s = 0.0  # the last sweep's seconds, start to end
        self._sweep_started = 0.0  # time.monotonic() at the start of the current or last sweep
        self._poll_s: float | None = None  # the last sweep's polling, asked -> last answer
        self.fr_leaders_skipped = False  # the last Flight Recorder fetch skipped the leaders'
        # query -> (URLs, PollHandle): dumps asked before the view (the periodic look's)
        self._fr_ahead: dict[str, tuple] = {}
        self._fr_looked_at = float("-inf")  # when the detectors last wanted Flight Recorder
        self._tail_s = 0.0  # the last sweep's seconds after its decisions
        self._stop = threading.Event()
        self._loop_thread: threading.Thread | None = None
        self._http = None
        self.url: str | None = None
        # Findings a previous run left open are not known to this run's detectors: close them;
        # if still true they are confirmed again on fresh evidence.
        for fid in self.store.open_finding_ids().values():
            self.store.resolve_finding(fid, clock(), "monitor_restarted")
        last = self.store.last_eviction_at()
        if last is not None:
            self.metrics.last_eviction.labels(cfg.job).set(last)
        # one monitor of several: a slice of the groups, proposals, maybe the leader
        self.shard = Shards(cfg.shard, self) if cfg.shard is not None else None

    # --- lifecycle -------------------------------------------------------------------
    def start(self, serve: bool = True) -> Monitor:
        if serve:
            self._http = BackgroundWSGIServer(create_app(self), host=self.cfg.bind,
                                              port=self.cfg.port, threads=8,
                                              name="lightkeeper-monitor-http")
            port = self._http.port
            host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.cfg.bind,
                                                                              self.cfg.bind)
            self.url = http_url(host, port)
            self._http.start()
        self._loop_thread = threading.Thread(target=self._loop, name="lightkeeper-monitor-loop",
                                             daemon=True)
        self._loop_thread.start()
        if self.shard is not None:
            self.shard.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._loop_thread is not None:
            self._loop_thread.join(timeout=30)
        if self.shard is not None:
            self.shard.stop()
        if self._http is not None:
            self._http.stop()
        if self._host_actions is not None:  # an attempt under way finishes (bounded by its timeout)
            self._host_actions.join(timeout=self.cfg.quarantine.action_timeout_s + 5)
        try:
            with self._goodput_lock:
                self._save_goodput(self.clock(), force=True)
        except Exception:  # a ledger that cannot be saved: logged, the stop goes on
            log.exception("could not save the goodput ledger")
        self._goodput_writer.close(timeout=30)  # every save written (a failure is logged)
        self._thaw_gc()
        self.poller.close()
        self.lighthouse.close()
        if self.lighthouse_reader is not None:
            self.lighthouse_reader.close()
        self.store.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.sweep_once()
            except Exception as e:  # a bug in one stage must not end monitoring
                log.exception("sweep failed")
                self.last_sweep_error = f"{type(e).__name__}: {e}"
            self.wait_next(started)

    def wait_next(self, started: float) -> bool:
        """Wait for the next sweep: ``interval_s`` after ``started`` (the last sweep's start,
        on ``time.monotonic``). With the poller in its own process and the next sweep's ranks
        not asked yet, they are asked ASK_LEAD times the last sweep's polling time before it
        (:meth:`_due_to_ask`), so that their answers are in when it starts: a sweep shorter
        than the interval no longer makes the next one wait for its polls (at 100,000 ranks
        0.4-0.7 s, docs/scaling.md). True when the monitor was stopped meanwhile."""
        next_start = started + self.cfg.interval_s
        if self._ahead is None and self.view is not None and self._may_ask_ahead():
            lead = ASK_LEAD * (self._poll_s or 0.0)
            if self._stop.wait(max(0.0, next_start - lead - time.monotonic())):
                return True
            try:
                self._ahead = self._plan_ahead(self.view)
            except Exception:
                log.exception("could not ask the next sweep's ranks ahead")
        return self._stop.wait(max(0.0, next_start - time.monotonic()))

    def _may_ask_ahead(self) -> bool:
        """The next sweep's ranks can be asked before it starts: the poller runs in its own
        process (asking does not hold this one) and this monitor is not a shard (its targets
        may change with its lease)."""
        return isinstance(self.poller, ProcessPoller) and self.shard is None

    def _due_to_ask(self) -> bool:
        """Whether the next sweep's ranks are due to be asked now: the next sweep may start
        (the interval after this one's start) within ASK_LEAD times the last sweep's polling
        time. Asked later, the next sweep would wait for them; asked sooner, its answers would
        be older than they must be. Not "when this sweep will end": a sweep's length is mostly
        whether its answers were in when it began (measured at 100,000 ranks: 0.6 s with them
        in, 1.3-1.8 s without, alternating when predicted from the last one's)."""
        if self._poll_s is None:
            return True
        next_start = self._sweep_started + self.cfg.interval_s
        return next_start - time.monotonic() <= ASK_LEAD * self._poll_s

    # --- one sweep -------------------------------------------------------------------
    def sweep_once(self) -> ClusterView:
        t0 = time.perf_counter()
        self._sweep_started = time.monotonic()
        if self._gc_frozen:
            gc.disable()  # re-enabled once what survived the sweep is frozen (_freeze_gc)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and time.monotonic() - ahead.sent_at > max(self.cfg.interval_s,
                                                                         self._last_sweep_s):
            ahead.result()  # asked too long ago (the loop waited after all): ask again
            ahead = None
        if ahead is not None:  # asked during the last sweep (_ask_ahead_early, _ask_ahead)
            targets, plan = ahead.targets, ahead.plan
            polls = ahead.result()
            self._poll_s = ahead.poll_s or self._poll_s
        else:
            targets = self._targets()
            self._fit_poller(len(targets))
            plan = self.schedule.plan(targets, self.view, self.clock(), self._suspect_groups())
            asked = time.monotonic()
            polls = self.poller.sweep(plan.urls, queries=self.detectors.state_queries(
                plan.urls, view=self.view))
            self._poll_s = time.monotonic() - asked
        self.sweep_plan = plan
        # a leader blocked on its group: that group's other ranks now, not next sweep
        drill = self.schedule.drill_now(polls, self.view, self.clock())
        if drill:
            polls.update(self.poller.sweep(drill, queries=self.detectors.state_queries(
                drill, view=self.view)))
        # after the ranks: a real rank is never ahead of the Lighthouse read after it
        if self.lighthouse_reader is not None:
            status, error = self.lighthouse_reader.read()
            if error and error != self.lighthouse_error:  # once per new error, not per sweep
                log.warning("cannot verify ranks, evictions held: %s", error)
            elif not error and self.lighthouse_error:
                log.warning("the Lighthouse answers again: verifying ranks")
            self.lighthouse_status, self.lighthouse_error = status, error
            self.lh_settings.observe(status, self.clock())
        now = self.clock()
        self._ask_fr_early(plan, polls, now)
        # verdicts judged again only where claims or the Lighthouse changed (docs/scaling.md)
        view = self.views.update(
            targets, polls, now=now, polled=None if plan.everything else set(plan.urls),
            judge=lambda ranks, changed: self.verifier.judge(
                ranks, changed, self.lighthouse_status, self.lighthouse_error,
                self.lighthouse_reader is not None, now))
        evidence = view.evidence()
        self._ask_ahead_early(view)
        for url in self.discovery.forget_unreachable(self.views.unreachable_since(), now):
            log.info("forgot %s: unreachable for %.0fs", url, self.cfg.forget_after_s)
        dumps = self._fetch_fr(evidence, now)
        new = self.detectors.update(evidence, dumps, now, full_view=view)
        new += self._host_findings(view, evidence, now)
        self._record_findings(new, now)
        self._judge_hosts(view, new, now)
        self._decide_all(view, evidence, now)
        self._confirm_evictions(view, now)
        tail = time.perf_counter()
        self._ask_ahead(view)
        self._account_goodput(evidence, now)
        view.sweep_seconds = evidence.sweep_seconds = time.perf_counter() - t0
        self.view, self.evidence = view, evidence
        self.sweeps += 1
        self._freeze_gc(len(targets))
        self._publish_metrics(view, evidence, polls)
        if self.cfg.sd_out:
            try:
                self.discovery.write_file_sd(self.cfg.sd_out)
            except OSError as e:
                log.warning("cannot write %s: %s", self.cfg.sd_out, e)
        self._tail_s = time.perf_counter() - tail
        self._last_sweep_s = time.perf_counter() - t0
        return view

    def _targets(self) -> list[Target]:
        """This sweep's targets: discovery's, then this shard's slice."""
        err = self.discovery.refresh()
        if err:
            log.warning("%s", err)
        targets = self.discovery.targets()
        if self.shard is not None:  # this shard's replica groups only (monitor/shard.py)
            targets = self.shard.own_targets(targets, self.poller, self.clock())
        return targets

    def _fit_poller(self, n_targets: int) -> None:
        """Make the poller ready for a sweep of ``n_targets``: from POLL_PROCESS_MIN_TARGETS
        it runs in its own process (for good), and its pool keeps a connection per target."""
        if n_targets >= POLL_PROCESS_MIN_TARGETS and type(self.poller) is Poller:
            old = self.poller  # from here on the polling runs in its own process
            self.poller = ProcessPoller(old.timeout_s, old.max_concurrency, old.max_idle,
                                        old.max_bytes)
            old.close()
        # one pooled keep-alive connection per target (+ its Flight Recorder fetch): a smaller
        # pool reconnects every sweep (docs/scaling.md); at most what the file descriptor
        # limit leaves (monitor/poll/fd_budget.py: the poller, in this process or its own, keeps
        # its idle pool under it), said once when the targets do not fit
        self.poller.max_idle = max(self.poller.max_idle, n_targets + 1024)
        if not self._fd_advised:
            limit = fd_budget.soft_limit()
            advice = fd_budget.advice(n_targets, fd_budget.budget(
                limit, self.cfg.max_concurrency)[1], limit, self.cfg.max_concurrency)
            if advice:
                self._fd_advised = True
                log.warning("%s", advice)

    def _ask_ahead_early(self, view: ClusterView) -> None:
        """With the poller in its own process, when the next sweep's ranks are due to be asked
        (:meth:`_due_to_ask`: it starts within ASK_LEAD times the polling time, as when the
        last sweep outlasted the interval and the next one starts as soon as this one ends),
        ask them as soon as this sweep's view is built: their polling (the poller process and the ranks, ~0.9 s
        of CPU at 100,000 ranks on this 2-core box) then runs beside this sweep's Flight
        Recorder fetch, detectors, ledgers and metrics, not after them. The plan is made from
        this sweep's view, as the next sweep would make it, with the groups the detectors
        suspected at their last update; :meth:`_ask_ahead` adds those this sweep's detectors
        newly suspect. A rank is asked ``?since=`` its folded rows only where this sweep's
        fold keeps them (Detectors.state_queries' ``kept``). Not while this sweep drills a
        group whose leader is blocked inside it (a hang may be building: the next sweep's
        answers, which may confirm it, are then asked as late as before, so the waits they
        carry are as long), nor while it drills and may fetch a hang's dumps (a rank it
        polled has been blocked in a collective for the hang threshold:
        Detectors.hang_look_possible; that Flight Recorder fetch, which the confirmation waits
        for, would share the poller process and the ranks with the next sweep's ~15,000
        requests, measured: the dumps 0.6 s later): :meth:`_ask_ahead` asks after it, as
        before. A sweep that drills for anything else (a group held drilled, a straggler
        candidate) asks early like any other: asked at the old point, its next sweep began by
        waiting 0.3-0.6 s for its answers (docs/scaling.md, round 16). Never raises: a failure
        is logged and :meth:`_ask_ahead` or the next sweep asks instead."""
        plan = self.sweep_plan
        if not self._may_ask_ahead() or plan is None or not self._due_to_ask():
            return
        try:
            # the view the detectors read (the Flight Recorder trigger's), built with this one
            if plan.drilled and (plan.blocked or self.detectors.hang_look_possible(
                    view.evidence(), view.at)):
                return
        except Exception:  # the rule unreadable: as before, not asked while it drills
            log.exception("could not tell whether this sweep may fetch a hang's dumps")
            return
        try:
            self._ahead = self._plan_ahead(view, None if view.polled is None
                                           else set(view.polled))
        except Exception:
            self._ahead = None
            log.exception("could not ask the next sweep's ranks ahead")

    def _plan_ahead(self, view: ClusterView, kept: set[str] | None = None) -> _Ahead:
        """The next sweep's plan, made from ``view`` as that sweep would make it, and its
        requests sent to the poller process (``kept``: Detectors.state_queries')."""
        targets = self._targets()
        self._fit_poller(len(targets))
        plan = self.schedule.plan(targets, view, self.clock(), self._suspect_groups())
        return _Ahead(targets, plan, self.poller.start(
            plan.urls, queries=self.detectors.state_queries(plan.urls, kept, view)))

    def _ask_ahead(self, view: ClusterView) -> None:
        """With the poller in its own process, send the next sweep's requests now, while this
        sweep does what no finding waits for (the goodput ledger, metrics, file_sd: ~0.3 s at
        100,000 ranks), when they are due (:meth:`_due_to_ask`; else :meth:`wait_next` asks
        them before the next sweep). The next sweep then uses those answers: its plan is made
        from this sweep's view, as it would be then, and its answers are no older when its
        detectors read them (the same poll, view, detectors path), so findings come sooner by
        what the two overlap. When :meth:`_ask_ahead_early` already asked them, only the
        groups this sweep's detectors newly suspect are added (drilled, as the plan would
        have). Never raises: a failure here is logged and the next sweep asks for itself."""
        if self._ahead is not None:
            try:
                extra = self.schedule.drill_suspects(self._ahead.plan, view, self.clock(),
                                                     self._suspect_groups())
                if extra:
                    self._ahead.handles.append(self.poller.start(
                        extra, queries=self.detectors.state_queries(extra, view=view)))
            except Exception:  # its plan may name URLs nobody asked: the next sweep asks
                self._ahead = None
                log.exception("could not ask the next sweep's suspect groups ahead")
            return
        if not self._may_ask_ahead() or not self._due_to_ask():
            return
        try:
            self._ahead = self._plan_ahead(view)
        except Exception:
            log.exception("could not ask the next sweep's ranks ahead")

    def _ask_fr_early(self, plan, polls: dict, now: float) -> None:
        """With the poller in its own process, when this sweep's periodic Flight Recorder look
        is due (``fr_interval_s`` since the last look, on the clock the detectors read), ask
        the dumps ``_fetch_fr`` will want now, right after the states: the drilled groups'
        ranks', then the leaders' cross-group ones, of the ranks that answered. The child asks
        them while this sweep builds its view, and ``_fetch_fr`` reads answers already in
        instead of waiting for 12,500 more requests at 100,000 ranks (~0.6-0.9 s, one sweep in
        ~8). Groups and leaders of the last view; ``_fetch_fr`` asks any others itself and
        drops what it does not want. Between looks, the dumps of a group drilled because its
        leader is blocked inside it (a rank of it hung: what a hang's confirmation reads) are
        asked the same way, for at most EARLY_FR_GROUPS such groups: they come while the view
        and the fold run, not after them (a few dumps; dropped unread if the detectors do not
        want them). A periodic look the detectors hold (a rank of this sweep blocked in a
        collective: Detectors.periodic_look_held) is not asked. Never raises."""
        view = self.view
        if not isinstance(self.poller, ProcessPoller) or view is None or plan.everything:
            return
        try:
            # held while a stall may be building (Detectors.periodic_look_held)
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

    def _freeze_gc(self, n_targets: int) -> None:
        """See GC_FREEZE_MIN_TARGETS; below it (and on a monitor that shrank) nothing is
        frozen."""
        if n_targets < GC_FREEZE_MIN_TARGETS:
            self._thaw_gc()
            return
        self._gc_frozen += 1
        if self._gc_frozen > GC_FULL_EVERY:
            gc.unfreeze()
            gc.collect()
            self._gc_frozen = 1
        gc.freeze()
        gc.enable()

    def _thaw_gc(self) -> None:
        """Give the collector back everything frozen, switched on (stop, or a monitor that
        shrank below GC_FREEZE_MIN_TARGETS)."""
        if self._gc_frozen:
            gc.unfreeze()
            gc.enable()
            self._gc_frozen = 0

    def _suspect_groups(self) -> set[int]:
        """Groups leader polling drills into whatever their leader says: open findings and
        straggler candidates (a lag over the straggler floor)."""
        floor = self.cfg.detectors.straggler_min_lag_s
        return {f.replica_group for f in self.detectors.open_findings()} | {
            g for g, lag in self.detectors.last_lags.items() if lag is not None and lag >= floor}

    def _fetch_fr(self, view: ClusterView, now: float) -> dict[int, dict]:
        """This sweep's Flight Recorder dumps, by rank, of the ranks the detectors want.

        The newest FR_LAST entries of every process group from the ranks of drilled groups
        (every rank, without leader polling); from the leaders of the others only torchft's
        cross-group group (a cross-group hang or mismatch is judged on those). Kilobytes, not
        whole ring buffers. The drilled groups' come first: when every drilled group's leader
        is blocked in an in-group collective and the group's hang is confirmed inside it from
        its own dumps (``Detectors.in_group_hangs``: a member never entered the collective),
        no other group's dump changes a finding of this sweep, and the leaders' fetch (~0.9 s
        and its analysis at 100,000 ranks) is skipped; a group drilled for anything else (the
        one the others wait for in the cross-group collective) gets the leaders' fetch
        (docs/scaling.md)."""
        # only ranks polled this sweep (leader polling: leaders and drilled groups)
        urls = [u for u in self.detectors.fr_wanted(view, now) if view.ranks[u].fresh]
        self.fr_leaders_skipped = False
        ahead, self._fr_ahead = self._fr_ahead, {}  # not read: dropped (the child finishes it)
        if not urls:
            return {}
        self._fr_looked_at = now
        plan = self.sweep_plan if self.sweep_plan is not None else self.schedule.last
        if plan is None or not self.schedule.active(len(view.ranks)):
            drilled, drilled_urls = set(), set(urls)
        else:  # leader polling: the leaders and the drilled groups only, even on a sweep that
            # asked every rank (the first: 100,000 dumps at once would be gigabytes)
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
                 ahead: dict[str, tuple]) -> dict[int, dict]:
        """The dumps of ``urls``: of those asked early (``ahead[query]``, _ask_fr_early) from
        their answers, of the others asked now."""
        early = ahead.get(query)
        if early is None or not urls:
            return self._fr_dumps(view, urls, query)
        asked, handle = early
        dumps = self._fr_dumps(view, [u for u in urls if u not in asked], query)
        got = handle.result()
        wanted = [u for u in urls if u in asked]
        dumps.update(self._fr_dumps(view, wanted, query, {u: got[u] for u in wanted}))
        return dumps

    def _fr_dumps(self, view: ClusterView, urls: list[str], query: str,
                  got: dict | None = None) -> dict[int, dict]:
        """``/v1/fr_trace`` + ``query`` of ``urls`` (or their answers ``got``, asked early),
        by rank: the dumps that describe the rank that served them. A rank whose server
        refuses the filter (400) is asked for its whole dump (a server that does not know it
        ignores it and sends the whole dump)."""
        dumps: dict[int, dict] = {}
        if not urls:
            return dumps
        if got is None:
            got = self.poller.sweep(urls, "/v1/fr_trace" + query, self.cfg.fr_timeout_s,
                                    self.cfg.max_fr_bytes)
        refused = [u for u, p in got.items() if p.status == 400]
        if refused:
            got.update(self.poller.sweep(refused, "/v1/fr_trace", self.cfg.fr_timeout_s,
                                         self.cfg.max_fr_bytes))
        for url, p in got.items():
            rv = view.ranks.get(url)
            if not p.ok or not isinstance(p.data, dict) or rv is None or rv.rank is None:
                continue
            claimed = p.data.get("rank", rv.rank)
            if claimed != rv.rank or p.data.get("replica_group", rv.replica_group) \
                    != rv.replica_group:
                # the dump must describe the verified rank that served it, or it is no evidence
                log.warning("ignoring %s/v1/fr_trace: it claims rank %r of group %r, its "
                            "/v1/state rank %s of group %s", url, claimed,
                            p.data.get("replica_group"), rv.rank, rv.replica_group)
                continue
            dumps[rv.rank] = p.data
        return dumps

    def _record_findings(self, new: list[Finding], now: float) -> None:
        for f in new:
            self._finding_ids[f.key] = self.store.add_finding(f.to_dict())
            self.metrics.findings.labels(self.cfg.job, f.kind, str(f.replica_group)).inc()
        open_keys = {f.key for f in self.detectors.open_findings()}
        resolved = {f.key: f for f in self.detectors.resolved_findings()}
        for key in [k for k in self._finding_ids if k not in open_keys]:
            fid = self._finding_ids.pop(key)
            f = resolved.get(key)
            self.store.resolve_finding(fid, f.resolved_at if f else now,
                                       f.resolution if f else "cleared")
            self._last_decision.pop(key, None)

    # --- host ledger and quarantine (monitor/act/hosts.py, docs/quarantine.md) -------------
    def _build_sinks(self) -> list:
        q = self.cfg.quarantine
        try:
            return [build_sink(a, timeout_s=q.action_timeout_s, webhook_secret=q.webhook_secret,
                               k8s_namespace=q.k8s_namespace, k8s_pod_selector=q.k8s_pod_selector)
                    for a in q.actions]
        except SinkConfigError as e:
            raise ConfigError(str(e)) from None

    def _host_findings(self, view: ClusterView, evidence: ClusterView, now: float) -> list:
        """quarantined_host findings (opened in the detectors, so they resolve like others);
        those whose hosts are no longer quarantined are resolved. Never raises."""
        try:
            # only the ranks whose RankView did more than progress this sweep (docs/scaling.md)
            self.hosts.observe(view, now, self.views.reshaped)
            bad = set(self.hosts.quarantined())
            for f in self.detectors.open_findings():
                if f.kind == "quarantined_host" and not bad & set(f.evidence.get("hosts", {})):
                    self.detectors.resolve(f.key, "host_released", now)
            return [f for f in self.hosts.group_findings(evidence, now)
                    if self.detectors.report(f)]
        except Exception as e:  # the ledger must never end monitoring
            log.exception("host ledger failed")
            self.hosts_error = f"{type(e).__name__}: {e}"
            return []

    def _judge_hosts(self, view: ClusterView, new: list[Finding], now: float) -> None:
        """Offences from this sweep's new findings, the quarantine policy, then the due sink
        actions on a background thread (a slow sink never delays a sweep). Never raises."""
        try:
            # the hosts of the new findings' groups only (every group's was ~10 us a group)
            group_hosts = {f.replica_group: view.groups[f.replica_group].hosts for f in new
                           if f.replica_group in view.groups}
            self.hosts.record([{**f.to_dict(), "id": self._finding_ids.get(f.key)}
                               for f in new], now, group_hosts)
            blind = self.blind_reason()
            if not blind and view.reachable_fraction <= self.cfg.rails.min_reachable_fraction:
                blind = (f"the monitor reaches only {view.reachable_fraction:.0%} of the ranks "
                         "it knows; it may be the problem")
            self.hosts.decide(now, blind, len(self.hosts.known_hosts(view)))
            if self.hosts.sinks and self.store.host_actions(due_at=now, limit=1):
                self._start_host_actions()
            self.metrics.set_hosts(self.hosts.counts(), self.hosts.to_json(now))
            self.hosts_error = None
        except Exception as e:
            log.exception("host ledger failed")
            self.hosts_error = f"{type(e).__name__}: {e}"

    def hosts_json(self) -> dict[str, Any]:
        """``GET /v1/hosts``."""
        q = self.cfg.quarantine
        return {"hosts": self.hosts.to_json(self.clock()), "counts": self.hosts.counts(),
                "quarantined": self.hosts.quarantined(), "dry_run": q.dry_run,
                "actions": [s.name for s in self.hosts.sinks],
                "policy": {"after": q.after, "window_s": q.window_s, "ttl_s": q.ttl_s,
                           "max_quarantined": q.max_quarantined,
                           "cap": q.cap(len(self.hosts.known_hosts(self.view)))},
                "decisions": self.store.host_decisions(limit=50), "error": self.hosts_error}

    def release_host(self, host: str, reason: str) -> dict[str, Any]:
        """``POST /v1/hosts/{host}/release``; KeyError / ValueError as HostLedger.release."""
        out = self.hosts.release(host, reason)
        if self.hosts.sinks:
            self._start_host_actions()
        return out

    def _start_host_actions(self) -> None:
        """Carry out due sink actions on a background thread (one at a time: run_actions
        returns at once while another call runs)."""
        t = self._host_actions
        if t is not None and t.is_alive():
            return
        self._host_actions = threading.Thread(target=self.hosts.run_actions,
                                              name="lightkeeper-host-actions", daemon=True)
        self._host_actions.start()

    # --- decisions and actions -------------------------------------------------------
    def blind_reason(self) -> str | None:
        """Why ranks cannot be verified right now (the rails then hold as ``monitor_blind``)."""
        if self.lighthouse_reader is None:
            return "no --lighthouse: ranks cannot be verified (findings are reported only)"
        if self.lighthouse_error:
            return f"ranks cannot be verified: {self.lighthouse_error}"
        return None

    def _situation(self, view: ClusterView, evidence: ClusterView, now: float,
                   in_quorum: dict[str | None, set[int]] | None = None) -> Situation:
        """Reachability from every known rank; the quorum from verified ranks only, less the
        groups a kill was already sent to (they still look in the quorum until the Lighthouse
        drops them: counting them would let two findings of one sweep, or of two sweeps
        inside the drop time, take the job below --min-replicas). ``in_quorum``:
        _in_quorum_by_replica_id(evidence) when the caller has it (one per sweep)."""
        evicted = self.store.evicted_replica_ids()
        if in_quorum is None:
            in_quorum = _in_quorum_by_replica_id(evidence)
        groups = set().union(*in_quorum.values())
        for rid in evicted:
            groups -= in_quorum.get(rid, set())
        return Situation(now=now, reachable_fraction=view.reachable_fraction,
                         groups_in_quorum=groups,
                         evicted_replica_ids=evicted,
                         last_eviction_at=self.store.last_eviction_at(),
                         blind_reason=self.blind_reason())

    def _decide_all(self, view: ClusterView, evidence: ClusterView, now: float) -> None:
        if self.shard is not None:  # proposals to the leader, which applies the global rails
            self.shard.after_sweep(view, evidence, now)
            return
        in_quorum = None  # the evidence's groups in the quorum, once per sweep (if asked)
        for f in self.detectors.open_findings():
            if f.kind not in self.cfg.rails.evict_kinds:
                continue  # reported only (e.g. dead): nothing to decide
            with self._act_lock:
                if in_quorum is None:
                    in_quorum = _in_quorum_by_replica_id(evidence)
                s = self._situation(view, evidence, now, in_quorum)
                d = decide(f.kind, f.replica_group, f.replica_id, s, self.cfg.rails)
                if not d.evict and self._last_decision.get(f.key) == d.reason:
                    continue  # the same hold as last sweep: logged once
                self._last_decision[f.key] = d.reason
                self._apply(d, f.replica_group, f.replica_id, self._finding_ids.get(f.key),
                            f.to_dict(), "auto")

    def _apply(self, d, replica_group: int, replica_id: str | None, finding_id: int | None,
               finding: dict[str, Any] | None, source: str) -> dict[str, Any]:
        self.metrics.decisions.labels(self.cfg.job, d.decision, d.reason).inc()
        if not d.evict:
            log.info("hold replica group %s (%s): %s", replica_group, d.reason, d.detail)
            did = self.store.add_decision(replica_group=replica_group, replica_id=replica_id,
                                          decision="hold", reason=d.reason, detail=d.detail,
                                          finding_id=finding_id, finding=finding, source=source,
                                          at=self.clock())
            return {"id": did, "decision": "hold", "reason": d.reason, "detail": d.detail}
        log.warning("evicting replica group %s (%s): %s", replica_group, replica_id, d.detail)
        did = self.store.add_decision(replica_group=replica_group, replica_id=replica_id,
                                      decision="evict", reason=(finding or {}).get("kind", source),
                                      detail=d.detail, finding_id=finding_id, finding=finding,
                                      status="sending", source=source, at=self.clock())
        result = self.lighthouse.kill(replica_id)
        self.store.update_decision(did, status="sent" if result.sent else "failed",
                                   http_status=result.http_status,
                                   detail=f"{d.detail}; kill: {result.detail}")
        if result.sent:
            self.metrics.evictions.labels(self.cfg.job, str(replica_group)).inc()
            self.lh_settings.kill_sent(replica_id, self.clock())
        self.metrics.last_eviction.labels(self.cfg.job).set(self.clock())
        return {"id": did, "decision": "evict", "reason": d.reason, "sent": result.sent,
                "detail": result.detail}

    def register_target(self, body: Any, authorization: str | None) -> Target:
        """``POST /v1/targets``. With a registration or admin token configured the registration
        must carry one of them (any address then); without, the target must resolve into
        ``--allow-targets``.

        Raises Unauthorized, NotAllowed, BadTarget or TooManyTargets; nothing is added then.
        """
        try:
            if self.cfg.token or self.cfg.register_token:
                if not registration_authorized(authorization, self.cfg.register_token,
                                               self.cfg.token):
                    raise Unauthorized("missing or wrong bearer token")
                target = self.discovery.register(body)
            else:
                target = self.discovery.register(body, admit=self.allow_list.admit)
        except (Unauthorized, NotAllowed, BadTarget, TooManyTargets) as e:
            outcome = REFUSALS[type(e)]
            self.metrics.registrations.labels(self.cfg.job, outcome).inc()
            log.info("registration refused (%s): %s", outcome, e)
            raise
        self.metrics.registrations.labels(self.cfg.job, "accepted").inc()
        return target

    def evict_manual(self, replica_group: int, reason: str) -> dict[str, Any]:
        """``POST /v1/evict``: the same rails minus evidence, cooldown and blindness.

        The replica id to kill is the one the group's *verified* ranks report."""
        view, evidence = self.view, self.evidence
        gv = evidence.groups.get(replica_group) if evidence else None
        replica_id = gv.replica_id if gv else None
        if self.shard is not None:  # the leader applies it (docs/scaling.md); EtcdError: 503
            out = self.shard.propose_manual(replica_group, replica_id, reason)
            out.update(replica_group=replica_group, replica_id=replica_id)
            return out
        with self._act_lock:
            now = self.clock()
            s = self._situation(view, evidence, now) if view and evidence \
                else Situation(now, 0.0, set())
            d = decide("manual", replica_group, replica_id, s, self.cfg.rails, manual=True)
            out = self._apply(d, replica_group, replica_id, None,
                              {"kind": "manual", "reason": reason}, "manual")
        out.update(replica_group=replica_group, replica_id=replica_id)
        return out

    def _confirm_evictions(self, view: ClusterView, now: float) -> None:
        """An eviction is confirmed once no reachable rank reports the evicted replica_id."""
        for d in self.store.pending_confirmations():
            rid = d["replica_id"]
            still = _reporting(view, rid)
            note = self.orphans.follow(d["id"], rid, still, now - d["at"])  # ranks kill misses
            if note:
                d["detail"] = f"{d['detail']}; {note}"
                self.store.update_decision(d["id"], detail=d["detail"])
            if not still:
                q = view.quorum_id
                self.store.update_decision(d["id"], status="confirmed", confirmed_at=now,
                                           detail=f"{d['detail']}; left the quorum "
                                                  f"(quorum_id now {q}, "
                                                  f"{view.quorum_participants()} participants)")
                log.info("eviction of %s confirmed after %.1fs", rid, now - d["at"])
            elif now - d["at"] > self.cfg.confirm_timeout_s:
                self.store.update_decision(d["id"], status="unconfirmed",
                                           detail=f"{d['detail']}; still reporting after "
                                                  f"{self.cfg.confirm_timeout_s:g}s")

    # --- goodput ledger ---------------------------------------------------------------
    def _restore_goodput(self) -> GoodputLedger:
        """The ledger as the previous run left it in ``--state`` (a fresh one if none, or if
        what is stored cannot be read: logged, the old rows stay in the file)."""
        gcfg = GoodputConfig(expected_groups=self.cfg.expected_groups,
                             max_gap_s=max(30.0, 10 * self.cfg.interval_s))
        try:
            return GoodputLedger.restore(gcfg, *self.store.load_goodput())
        except (ValueError, TypeError, KeyError) as e:
            log.warning("goodput ledger not resumed from %s (%s: %s): starting afresh",
                        self.cfg.state_path, type(e).__name__, e)
            return GoodputLedger(gcfg)

    def _account_goodput(self, evidence: ClusterView, now: float) -> None:
        """Split this sweep's wall time (verified ranks only); a failure here is logged and
        never stops the sweep."""
        findings = [{**f.to_dict(), "id": self._finding_ids.get(f.key)}
                    for f in self.detectors.open_findings()]
        try:
            with self._goodput_lock:
                acct = self.goodput.update(evidence, findings,
                                           self.store.decisions(limit=100, evictions_only=True),
                                           now)
                self._save_goodput(now)
            self.metrics.add_goodput(acct)
            self.goodput_error = None
        except Exception as e:  # the ledger must never end monitoring
            error = f"{type(e).__name__}: {e}"
            if error != self.goodput_error:  # once per new error, not per sweep
                log.exception("goodput ledger failed")
            self.goodput_error = error

    def _save_goodput(self, now: float, force: bool = False) -> None:
        """State, changed incidents and closed intervals, one transaction (written by
        :class:`GoodputWriter` beside the next sweep): when an incident changed, else every
        GOODPUT_SAVE_S (a crash loses at most that much, which a restarted ledger then accounts
        as the time since its last saved sweep)."""
        incidents, intervals = self.goodput.unsaved()
        # the snapshot grows with the groups: at 12,500 groups a save is ~25-55 ms of CPU
        # (columns, msgspec; benchmarks/bench_goodput_snapshot.py), more in wall time on a
        # loaded box, so it is made at most once per 20 of its own durations
        every = max(GOODPUT_SAVE_S, 20 * self._goodput_save_s)
        if force or incidents or now - self._goodput_saved_at >= every:
            t = time.perf_counter()
            self._goodput_writer.submit(self.goodput.snapshot(), incidents, intervals, now)
            self.goodput.saved()  # the writer keeps it until written (a failure: retried)
            self._goodput_saved_at = now
            self._goodput_save_s = time.perf_counter() - t + self._goodput_writer.write_s

    def goodput_json(self, incidents: int = 50, intervals: int = 200) -> dict[str, Any]:
        """``GET /v1/goodput``."""
        with self._goodput_lock:
            out = self.goodput.to_json(incidents=incidents, intervals=intervals)
        out["error"] = self.goodput_error or self._goodput_writer.error
        return out

    # --- publishing ------------------------------------------------------------------
    def _publish_metrics(self, view: ClusterView, evidence: ClusterView, polls) -> None:
        """Rank counts from every known rank; everything about groups from verified ranks."""
        m, job = self.metrics, self.cfg.job
        m.sweeps.labels(job).inc()
        m.sweep_duration.labels(job).observe(view.sweep_seconds)
        known, up, trust = view.counts  # summed per group (docs/scaling.md)
        m.ranks_known.labels(job).set(known)
        m.ranks_up.labels(job).set(up)
        m.ranks_unreachable.labels(job).set(known - up)
        by_reason = dict.fromkeys(TRUST_REASONS[1:], 0)
        verified = 0
        for k, n in trust.items():
            if k is None:
                continue
            if k[0] == VERIFIED:
                verified += n
            else:
                by_reason[k[1]] = by_reason.get(k[1], 0) + n
        m.ranks_verified.labels(job).set(verified)
        for reason, n in by_reason.items():
            m.ranks_unverified.labels(job, reason).set(n)
        m.lighthouse_up.labels(job).set(1 if self.lighthouse_status is not None
                                        and not self.lighthouse_error else 0)
        self.lh_settings.publish(m, job)
        for p in polls.values():
            if not p.ok and p.reason:
                m.poll_errors.labels(job, p.reason).inc()
        for url, p in polls.items():
            r = view.ranks.get(url) if p.ok else None
            if r is not None and r.reachable is False and r.reason == "bad_response":
                m.poll_errors.labels(job, "bad_response").inc()
        counts: dict[str, int] = {}
        for f in self.detectors.open_findings():
            counts[f.kind] = counts.get(f.kind, 0) + 1
        for kind in KINDS:
            m.open_findings.labels(job, kind).set(counts.get(kind, 0))
        m.set_groups(evidence, self.detectors.last_lags)  # per-group series: at scrape time
        if evidence.quorum_id is not None:
            m.quorum_id.labels(job).set(evidence.quorum_id)
        qp = evidence.quorum_participants()
        if qp is not None:
            m.quorum_participants.labels(job).set(qp)

    def verification_json(self) -> dict[str, Any]:
        """What the Lighthouse said at the last sweep, and how many ranks are verified."""
        st, view = self.lighthouse_status, self.view
        known = [r for r in view.ranks.values() if not r.superseded] if view else []
        counts: dict[str, int] = {}
        for r in known:
            key = r.trust.state if r.trust is not None else "unchecked"
            counts[key] = counts.get(key, 0) + 1
        return {"lighthouse_ok": st is not None and not self.lighthouse_error,
                "lighthouse_error": self.lighthouse_error,
                "lighthouse_quorum_id": st.quorum_id if st else None,
                "lighthouse_participants": sorted(st.members) if st else [],
                "lighthouse_heartbeating": sorted(r for r in st.heartbeats
                                                  if st.heartbeating(r)) if st else [],
                "read_at": st.at if st else None, "ranks": counts,
                "blind": self.blind_reason()}

    @staticmethod
    def _rank_json(r, now: float) -> dict[str, Any]:
        s = r.state or {}
        return {
            "url": r.url, "rank": r.rank, "replica_group": r.replica_group,
            "group_rank": s.get("group_rank"), "group_world_size": s.get("group_world_size"),
            "reachable": r.reachable, "reason": r.reason, "error": r.error,
            "step": s.get("step"), "phase": s.get("phase"),
            "phase_for_s": (now - s["phase_since"]) if s.get("phase_since") else None,
            "quorum_id": s.get("quorum_id"), "participating": s.get("participating"),
            "last_step_seconds": s.get("last_step_seconds"), "host": s.get("host"),
            "pid": s.get("pid"), "replica_id": s.get("replica_id"),
            "faults": s.get("faults"), "unreachable_sweeps": r.failures,
            "verification": r.trust.to_dict() if r.trust is not None else None}

    def ranks_json(self) -> list[dict[str, Any]]:
        """``GET /v1/ranks``: every target the monitor polls, with the verdict on its claims."""
        view, now = self.view, self.clock()
        if view is None:
            return []
        out = []
        for r in view.ranks.values():
            row = self._rank_json(r, now)
            t = r.target
            row.update(source=t.source if t else None,
                       registered_as=t.registered_as if t else None, superseded=r.superseded)
            out.append(row)
        return sorted(out, key=lambda x: (x["rank"] is None, x["rank"] or 0, x["url"]))

    def cluster_json(self) -> dict[str, Any]:
        """``GET /v1/cluster``: every rank as seen (unverified ones too, marked); the quorum,
        the groups' quorum membership and replica ids from verified ranks only."""
        view, evidence = self.view, self.evidence
        now = self.clock()
        out: dict[str, Any] = {"job": self.cfg.job, "lighthouse": self.cfg.lighthouse,
                               "dry_run": self.cfg.rails.dry_run, "sweeps": self.sweeps,
                               "monitor_started_at": self.started_at, "groups": [],
                               "quorum_id": None, "quorum_participants": None,
                               "reachable_fraction": None, "sweep_seconds": None, "at": None,
                               "ungrouped": [],
                               "last_error": self.last_sweep_error or self.detectors.last_error,
                               "targets_file_error": self.discovery.file_error,
                               "verification": self.verification_json(),
                               "lighthouse_settings": self.lh_settings.to_dict(),
                               "shard": self.shard.to_json() if self.shard else None}
        if view is None or evidence is None:
            return out
        open_by_group: dict[int, list[str]] = {}
        for f in self.detectors.open_findings():
            open_by_group.setdefault(f.replica_group, []).append(f.kind)
        in_quorum = {g.replica_group for g in evidence.in_quorum()}
        out.update(quorum_id=evidence.quorum_id,
                   quorum_participants=evidence.quorum_participants(),
                   reachable_fraction=view.reachable_fraction, sweep_seconds=view.sweep_seconds,
                   at=view.at)
        for g, gv in view.groups.items():
            verified = evidence.groups.get(g)
            out["groups"].append({
                "replica_group": g, "replica_id": verified.replica_id if verified else None,
                "status": gv.status, "step": gv.step, "in_quorum": g in in_quorum,
                "median_step_seconds": gv.median_step_seconds(),
                "arrival_lag_seconds": self.detectors.last_lags.get(g),
                "open_findings": sorted(open_by_group.get(g, [])),
                "evidence_ranks": len(verified.ranks) if verified else 0,
                "ranks": [self._rank_json(r, now) for r in gv.ranks]})
        out["ungrouped"] = [{"url": r.url, "reachable": r.reachable, "reason": r.reason,
                             "error": r.error, "unreachable_sweeps": r.failures,
                             "verification": r.trust.to_dict() if r.trust else None}
                            for r in view.ranks.values()
                            if r.replica_group is None and not r.superseded]
        return out
