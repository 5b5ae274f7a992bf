"""The monitor's loop. One sweep (:meth:`Monitor.sweep_once`), top to bottom:

1. poll the ranks (:mod:`monitor.polling`);
2. evidence: the Lighthouse's status, the view, each rank verified (:mod:`monitor.evidence`);
3. detect, on verified ranks only (:mod:`monitor.detect`), with last sweep's probe round;
4. decide and act (:mod:`monitor.act.enforcer`), then ask the next probe round if wanted;
5. account goodput (:mod:`monitor.goodput`);
6. publish the view, the metrics and the file_sd.

A sweep that fails is logged and shown, and the loop goes on; nothing a rank does makes it raise.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from typing import Any

from http_serving import BackgroundWSGIServer, http_url

from .act.actions import Lighthouse
from .act.bundles import Bundles
from .act.enforcer import Enforcer
from .act.host_actions import monitor_identity
from .act.hosts import HostLedger
from .act.trouble import Trouble
from .api import views
from .api.app import create_app
from .api.metrics import MonitorMetrics, publish_sweep
from .config import MonitorConfig
from .detect import Detectors
from .evidence.lighthouse_settings import LighthouseSettingsWatch
from .evidence.lighthouse_status import LighthouseReader, LighthouseStatus
from .evidence.probes import ProbeMesh
from .evidence.torch_rank import TorchRanks, add_stacks
from .evidence.unreachable import Unreachable
from .evidence.verification import Verifier
from .evidence.view import ClusterView, ViewBuilder
from .goodput.account import GoodputAccount
from .locks import hold_state
from .poll.admission import Registrations
from .poll.discovery import Discovery, Target
from .poll.torch_server import StoreReader
from .polling import Polling
from .schedule import LeaderSchedule
from .shard import Shards, expected_in_slice
from .startup import allow_list, build_sinks, check_config, check_paths, steady_clock
from .store import Store

log = logging.getLogger(__name__)

STALLED_AFTER_S = 30.0  # /healthz: no sweep ended this long (or 10 intervals): the loop is stuck


class Monitor:
    def __init__(self, cfg: MonitorConfig, clock=None) -> None:
        check_config(cfg)
        if warning := cfg.forget_after_warning():
            log.warning("%s", warning)
        clock = clock or steady_clock()
        self.cfg, self.clock = cfg, clock
        # what may refuse the configuration, before --state is touched: a refused start made nothing
        sinks = build_sinks(cfg)
        check_paths(cfg)
        # then: a second monitor on this state touches nothing of it (the bundles' prune)
        self._state_lock = hold_state(cfg.state_path)
        try:
            self._build(cfg, clock, sinks)
        except BaseException:
            self._release_state()
            raise

    def _build(self, cfg: MonitorConfig, clock, sinks: list) -> None:
        self.discovery = Discovery(cfg.targets, cfg.targets_file, cfg.forget_after_s, cfg.job,
                                   max_targets=cfg.max_targets)
        if cfg.sd_out:
            self.discovery.restore(cfg.sd_out)  # resume polling what the last run knew
        self.store = Store(cfg.state_path)
        self.metrics = MonitorMetrics(cfg.job)
        self.registrations = Registrations(self.discovery, allow_list(cfg), cfg,
                                           self.metrics.registrations, clock)
        self.metrics.dry_run.labels(cfg.job).set(1 if cfg.rails.dry_run else 0)
        self.metrics.start_time.labels(cfg.job).set(clock())
        self.detectors = Detectors(cfg.detectors, clock=clock, probes=cfg.probes)
        self.schedule = LeaderSchedule(cfg.leader_polling, cfg.leader_polling_min_ranks,
                                       cfg.member_interval_s, cfg.interval_s)
        # ranks on torch's own debug server: found in the groups' stores, read as rank states
        # (and the groups a run before timed: not held again as on their first step)
        self.torch_ranks = TorchRanks(cfg.job, StoreReader(forget_after_s=cfg.forget_after_s)
                                      if cfg.torch_stores else None,
                                      timed=self.store.torch_paces(cfg.job))
        self.polling = Polling(cfg, self.schedule, self.detectors, self._targets, clock,
                               ask_ahead=cfg.shard is None, torch_ranks=self.torch_ranks,
                               has_torch=lambda: self.discovery.has_torch)
        self.views = ViewBuilder()
        kept = self.store.unreachable()  # whose an unreachable rank was, across a restart
        self.views.seed(kept)
        self.unreachable = Unreachable(self.store, self.views, self.discovery, kept,
                                       self.metrics.ranks_lost.labels(cfg.job))
        self.verifier = Verifier()
        self.lighthouse_reader = LighthouseReader(cfg.lighthouse, cfg.lighthouse_timeout_s) \
            if cfg.lighthouse else None
        self.lighthouse_status: LighthouseStatus | None = None
        self.lighthouse_error: str | None = None if cfg.lighthouse else "no --lighthouse"
        self._lighthouse = Trouble("cannot verify ranks, evictions held",
                                   "the Lighthouse answers again: verifying ranks", log=log)
        self._targets_file = Trouble("last good targets kept (none before a good read)",
                                     "the targets file is read again", log=log)
        self._sd_out = Trouble(f"cannot write {cfg.sd_out}", f"{cfg.sd_out} written again",
                               log=log)
        self._sweep_trouble = Trouble("sweep failed", "sweeps succeed again", logging.ERROR, log)
        self._paces_kept = Trouble(
            "cannot keep the torch-only groups' step times in --state (a restarted monitor "
            "would hold them as on their first step)", "the torch-only groups' step times are "
            "kept in --state again", log=log)
        self._torchft_said: frozenset[str] | None = None  # the mixed torchft versions logged
        self.lh_settings = LighthouseSettingsWatch(cfg.lighthouse_heartbeat_timeout_ms,
                                                   cfg.lighthouse_join_timeout_ms, cfg.interval_s)
        self.lighthouse = Lighthouse(cfg.lighthouse, cfg.kill_timeout_s)
        self.hosts = HostLedger(self.store, cfg.quarantine, sinks, cfg.job, clock)
        self.hosts.sender = monitor_identity(
            self.store.identity(), None if cfg.shard is None or cfg.shard.index is None
            else f"{cfg.shard.index}/{cfg.shard.shards}")
        self.bundles = Bundles(cfg, self.store, clock, lambda: self.torch_ranks.dumps,
                               lambda: (self.lighthouse_status, self.lighthouse_error))
        self.enforcer = Enforcer(cfg, self.store, self.detectors, self.hosts, self.lighthouse,
                                 self.lh_settings, self.metrics, self.blind_reason, clock,
                                 self.bundles)
        self.probes = ProbeMesh(cfg.probes, cfg.rank_exit_token, clock, cfg.rank_auth,
                                self.enforcer.claims)  # one Claims for every call to a rank
        self.goodput = GoodputAccount(self.store, expected_in_slice(cfg.expected_groups, cfg.shard),
                                      cfg.interval_s, self.metrics)
        # every rank: what the monitor shows; its evidence_view (the ranks whose answers count:
        # what it acts on) published with it, so no reader pairs one sweep's with another's
        self.view: ClusterView | None = None
        self.sweep_plan = None  # what the last sweep polled (schedule.Plan)
        self.sweeps = 0
        self.last_sweep_error: str | None = None
        # loop_at: when the loop last ended a sweep; swept_at: a good one (/healthz)
        self.started_at = self.loop_at = self.swept_at = clock()
        self._stop = threading.Event()
        self._loop_thread: threading.Thread | None = None
        self._http: BackgroundWSGIServer | None = None
        self.url: str | None = None
        # findings a previous run left open are closed: if still true, found again
        self.detectors.restarted = self.store.restart_marks(clock())
        self.store.interrupt_sending()
        last = self.store.last_eviction_at()
        if last is not None:
            self.metrics.last_eviction.labels(cfg.job).set(last)
        # one monitor of several: a slice of the groups, proposals, maybe the leader
        self.shard = Shards(cfg.shard, self) if cfg.shard is not None else None

    def start(self, serve: bool = True) -> Monitor:
        if serve:
            self._http = BackgroundWSGIServer(create_app(self), host=self.cfg.bind,
                                              port=self.cfg.port, threads=8,
                                              name="lightkeeper-monitor-http")
            host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.cfg.bind,
                                                                              self.cfg.bind)
            self.url = http_url(host, self._http.port)
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
        self.enforcer.close()
        self.probes.close()
        self.goodput.close(self.clock())
        self.polling.close()
        self.lighthouse.close()
        if self.lighthouse_reader is not None:
            self.lighthouse_reader.close()
        self.store.close()
        self._release_state()

    def _release_state(self) -> None:
        if self._state_lock is not None:
            os.close(self._state_lock)
            self._state_lock = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            error = exc = kind = None
            try:
                self.sweep_once()
            except Exception as e:  # a bug in one stage must not end monitoring
                error, kind = f"{type(e).__name__}: {e}", type(e).__name__
                # the audit log unwritable (full, locked) is no bug: one line, no traceback
                exc = None if isinstance(e, sqlite3.OperationalError) else e
            self.loop_at = self.clock()
            self._sweep_trouble.update(error, self.loop_at, exc, kind)
            self.last_sweep_error = error
            if not error:
                self.swept_at = self.loop_at
            self.wait_next(started)

    def stalled_for(self) -> float | None:
        """Seconds since the loop last ended a sweep, when that is too long (/healthz)."""
        idle = self.clock() - self.loop_at
        return idle if idle > max(STALLED_AFTER_S, 10 * self.cfg.interval_s) else None

    def wait_next(self, started: float) -> bool:
        """Wait until ``interval_s`` after ``started`` (time.monotonic); True when stopped."""
        return self.polling.wait(started, self.view, self._stop)

    def sweep_once(self) -> ClusterView:
        try:
            return self._sweep()
        except BaseException:
            self.polling.abort_sweep()  # the collector collect() turned off, on again
            raise

    def _sweep(self) -> ClusterView:
        t0 = time.perf_counter()
        # 1. targets and poll
        targets, plan, polls = self.polling.collect(self.view)
        self.sweep_plan = plan
        # 2. evidence: the Lighthouse after the ranks (a real rank is never ahead of it)
        self._read_lighthouse()
        now = self.clock()
        if (found := self.torch_ranks.sweep(polls, self.lighthouse_status, now)) is not None:
            self.discovery.set_torch(found)  # next sweep's targets
        view = self.views.update(  # verdicts judged again only where claims or status changed
            targets, polls, now=now, polled=None if plan.everything else set(plan.urls),
            judge=lambda ranks, changed: self.verifier.judge(
                ranks, changed, self.lighthouse_status, self.lighthouse_error,
                self.lighthouse_reader is not None, now))
        evidence = view.evidence()
        self.polling.after_view(view)
        lighthouse = None if self.lighthouse_error else self.lighthouse_status  # a good read
        self.unreachable.keep(view, self.detectors.liveness.down_at)
        ended = self.unreachable.forget(view, now, lighthouse)
        if self.shard is None:  # a shard sees its own slice: another one may list the other URL
            self.discovery.fold_same_process(view.ranks, now)  # a listed rank registered too
        else:  # a store's URL and a registered one: one group, so one slice
            self.discovery.shadow_torch(view.ranks)
        if self.views.reshaped:  # a new process, replica id or quorum: its torchft may differ
            self._say_torchft(view)
        # 3. detect
        dumps = self.polling.fr_dumps(evidence, now)
        # the kills this sweep's findings come after (the host ledger: no offence on those)
        told, killed = self.store.told_to_go_replica_ids(), self.store.evicted_replica_ids()
        new = self.detectors.update(
            evidence, dumps, now, full_view=view, evicted=told,
            lighthouse=lighthouse, blind=self.enforcer.cut_off(view, lighthouse))
        # the job stalled or slow with no group to blame: the hosts' ranks probe each other
        blind = self.enforcer.blindness(view)
        new += self.detectors.network(evidence, self.probes.take(), now, blind)
        add_stacks(new, self.polling.torch.stacks)
        # 4. decide and act
        new += self.enforcer.host_findings(view, evidence, now, self.views.reshaped)
        new = self.enforcer.record(new, now)
        if self.shard is not None:  # proposals to the leader, which applies the global rails
            # first: its report says whether this monitor holds its slice (the shard's own
            # rails count no quorum, so no quarantine of this sweep need come before)
            try:
                self.shard.after_sweep(view, evidence, now)
            finally:  # its audit log unwritable: this sweep's offences still reach the ledger
                self._judge_hosts(view, new, now, (told, killed))
        else:
            self._judge_hosts(view, new, now, (told, killed))
            self.enforcer.decide(view, evidence, now, lighthouse=lighthouse)
        standby = not self.enforcer.fetch_bundles  # _judge_hosts: another monitor holds it
        # the evidence of a confirmed hang, mismatch or network fault, kept even when held
        self.enforcer.bundle_confirmed(view, evidence, new)
        self.enforcer.confirm_evictions(view, evidence, now, self.lighthouse_status)
        # a group gone from the quorum (its host off the network, or evicted while partitioned)
        # holds the others in their collective until its timeout: they are told to abort it
        self.enforcer.release_survivors(view, evidence, now, self.lighthouse_status, self.shard)
        # the next probe round, once this sweep's evictions are known: not of their ranks; a
        # standby shard's slice is probed (and exported) by the monitor it stands by for
        wanted = self.detectors.probes_wanted()
        self.probes.ask(evidence, wanted, blind, now,
                        self.store.told_to_go_replica_ids() if wanted else set(), known=view,
                        standby=standby)
        self.polling.after_decisions(view)
        # 5. account
        self.goodput.account(evidence, self.enforcer.open_findings(), now, publish=not standby)
        try:  # a restarted monitor holds no timed group again
            self.torch_ranks.save_paces(now, lambda paces: self.store.save_torch_paces(
                self.cfg.job, paces))
            self._paces_kept.update(None, now)
        except sqlite3.Error as e:  # a full disk: the sweep goes on, tried again in a minute
            self._paces_kept.update(str(e), now)
        # 6. publish
        view.sweep_seconds = evidence.sweep_seconds = time.perf_counter() - t0
        self.view = view
        self.sweeps += 1
        publish_sweep(self.metrics, view, evidence, polls, self.detectors, lighthouse is not None,
                      self.lh_settings, ended)
        if self.cfg.sd_out:
            try:
                self.discovery.write_file_sd(self.cfg.sd_out)
                self._sd_out.update(None, now)
            except OSError as e:
                self._sd_out.update(str(e), now)
        self.polling.end_sweep(len(targets), t0)
        return view

    def _judge_hosts(self, view: ClusterView, new: list, now: float,
                     before: tuple[set[str], set[str]]) -> None:
        """The host ledger's offences, policy and sinks, on a standby too: its ledger shadows the
        holder's, so a handover never leaves a quarantine nobody releases (the sinks' actions are
        idempotent). A standby sends no abort or exit and fetches no bundle; a holder whose lease
        may have lapsed still fetches bundles (docs/monitor.md)."""
        self.enforcer.standby = self.shard is not None and not self.shard.acting()
        self.enforcer.fetch_bundles = self.shard is None or self.shard.holds is not False
        self.enforcer.judge_hosts(view, new, now, self.lighthouse_status, before)

    def _say_torchft(self, view: ClusterView) -> None:
        """Once per set of versions: the job's groups run different torchfts."""
        versions = views.torchft_versions(view)
        said = frozenset(versions) if len(versions) > 1 else None
        if said and said != self._torchft_said:
            log.warning("replica groups of job %s run different torchft versions (%s): every "
                        "group must run the same, or torchft-nightly's reconfigure fails at "
                        "each quorum", self.cfg.job,
                        "; ".join(f"{v}: groups {gs}" for v, gs in versions.items()))
        self._torchft_said = said

    def _targets(self) -> list[Target]:
        """A sweep's targets: discovery's, then this shard's slice."""
        self._targets_file.update(self.discovery.refresh(), self.clock())
        version, targets = self.discovery.version, self.discovery.targets()
        if self.shard is not None:
            targets = self.shard.own_targets(targets, self.polling.poller, self.clock(), version)
        return targets

    def _read_lighthouse(self) -> None:
        """Read the Lighthouse's status; unreadable, warned (Trouble)."""
        if self.lighthouse_reader is None:
            return
        status, error = self.lighthouse_reader.read()
        now = self.clock()
        self._lighthouse.update(error, now)
        self.lighthouse_status, self.lighthouse_error = status, error
        self.lh_settings.observe(status, now, self.view)

    def blind_reason(self) -> str | None:
        """Why ranks cannot be verified right now (the rails then hold as ``monitor_blind``)."""
        if self.lighthouse_reader is None:
            return "no --lighthouse: ranks cannot be verified (findings are reported only)"
        if self.lighthouse_error:
            return f"ranks cannot be verified: {self.lighthouse_error}"
        return None

    # --- the API's calls (monitor/api/app.py)
    def register_target(self, body: Any, authorization: str | None,
                        client: str | None = None) -> Target:
        """``POST /v1/targets`` (:class:`monitor.poll.admission.Registrations`)."""
        return self.registrations.register(body, authorization, client)

    def evict_manual(self, replica_group: int, reason: str) -> dict[str, Any]:
        """``POST /v1/evict`` of the replica id the group's verified ranks report; on a shard,
        a proposal to the leader."""
        view = self.view
        evidence = view.evidence() if view else None
        gv = evidence.groups.get(replica_group) if evidence else None
        replica_id = gv.replica_id if gv else None
        if self.shard is not None:
            out = self.shard.propose_manual(replica_group, replica_id, reason)
        else:
            out = self.enforcer.evict_manual(view, evidence, replica_group, replica_id, reason)
        out.update(replica_group=replica_group, replica_id=replica_id)
        return out

    @property
    def evidence(self) -> ClusterView | None:
        return self.view.evidence() if self.view else None

    def cluster_json(self, ranks: bool = True, view: ClusterView | None = None) -> dict[str, Any]:
        view = view or self.view
        return views.cluster_json(views.cluster_head(self, view), view,
                                  view.evidence() if view else None, self.detectors,
                                  self.clock(), ranks)
