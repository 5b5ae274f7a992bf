"""Detectors: from the cluster view (and live Flight Recorder dumps) to findings, one module per
kind. A failing detector is logged and skipped for that sweep, never fatal.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any

from monitor.analysis import RankTrace, analyze, normalize_dumps
from monitor.config import DetectorConfig, ProbeConfig
from monitor.detect import mismatch
from monitor.detect.findings import JOB_KINDS, Finding, Findings, engine_findings
from monitor.detect.hang import Hang
from monitor.detect.jobwide import JobWide
from monitor.detect.liveness import Liveness
from monitor.detect.network import Network
from monitor.detect.pre_quorum import PreQuorum
from monitor.detect.rank_state import SeenGroups
from monitor.detect.straggler import GroupMemory, Straggler, from_flight_recorder
from monitor.evidence.lighthouse_status import LighthouseStatus
from monitor.evidence.probes import ProbeRound
from monitor.evidence.view import ClusterView

log = logging.getLogger(__name__)

Analyzer = Callable[[Mapping[int, RankTrace]], Any]  # normalized traces -> result with .findings
FR_MIN_INTERVAL_S = 1.0  # the periodic look never comes more often, however short the window


class Detectors:
    """Every detector over one memory of findings; a failing one is logged, skipped that sweep
    and named in ``last_error``."""

    def __init__(self, cfg: DetectorConfig | None = None, analyzer: Analyzer | None = None,
                 clock: Callable[[], float] = time.time,
                 probes: ProbeConfig | None = None) -> None:
        self.cfg = cfg or DetectorConfig()
        self.analyzer = analyzer or analyze
        self.clock = clock
        self.findings = Findings()
        self._groups: dict[int, GroupMemory] = {}  # per group: its incarnation's memory
        self.liveness = Liveness(self.cfg, self.findings)
        self.hang = Hang(self.cfg, self.findings)
        self.straggler = Straggler(self.cfg, self.findings, self._groups)
        self.jobwide = JobWide(self.cfg, self.findings)
        self.pre_quorum = PreQuorum(self.cfg, self.findings, self.jobwide)
        self.net = Network(probes or ProbeConfig(), self.findings)
        self._seen = SeenGroups()
        self._commit_failures: dict[str, int] = {}
        self._last_fr_at = 0.0
        self._periodic_held: tuple[float, bool] | None = None  # (now, held) of that sweep
        self.fr_window_s: float | None = None  # what a look's entries span (None: unmeasured)
        # a look reads every rank's dump (set by monitor.polling): only then may fr_window_s
        # shorten fr_interval
        self.fr_window_adapts = True
        self.last_error: str | None = None
        self._noted: tuple[ClusterView, float] | None = None  # the sweep _note_sweep last noted
        # [now, the dumps, their traces, errors, the engine's findings or None] of the last look
        self._look: list | None = None
        # keys of the findings a previous run left open (Store.restart_marks) -> (their
        # episode's first finding id, their group's lowest step seen since, a stall's from its
        # finding's): their first confirmation here is that episode again (counted by the run
        # that found it), until _episodes_over
        self.restarted: dict[tuple, tuple[int, int | None]] = {}

    @property
    def last_lags(self) -> dict[int, float]:
        """replica_group -> how long the others waited for it (s) at the last evaluation."""
        return self.straggler.last_lags

    @property
    def lag_floor(self) -> float:
        """The least lag of a straggler at the last evaluation (straggler.lag_floor)."""
        return self.straggler.lag_floor

    def state_queries(self, urls: Iterable[str], kept: Container[str] | None = None,
                      view: ClusterView | None = None) -> list[str]:
        return self.straggler.state_queries(urls, kept, view)

    def open_findings(self) -> list[Finding]:
        return sorted(self.findings.open.values(), key=lambda f: (f.confirmed_at or 0, f.kind))

    def job_findings(self) -> list[Finding]:
        """The open job-wide findings (job_stall, job_slow)."""
        return [f for k, f in self.findings.open.items() if k[0] in JOB_KINDS]

    def probes_wanted(self) -> bool:
        """A job-wide finding open, or one pending (its first slow window seen)."""
        return bool(self.job_findings()) or self.jobwide.suspected()

    def network(self, view: ClusterView, rnd: ProbeRound | None, now: float,
                blind: str | None) -> list[Finding]:
        """The network findings a finished probe round confirms (monitor.detect.network)."""
        return self._guarded("network", lambda: self.net.judge(
            view, rnd, now, blind, self.jobwide.suspected()))

    def network_hosts_added(self) -> list[tuple[Finding, list[str]]]:
        """Once each: open network findings whose refresh named hosts they had not charged,
        with those hosts (Network.added_hosts)."""
        return self.net.added_hosts()

    def _guarded(self, name: str, step: Callable[[], list[Finding]]) -> list[Finding]:
        try:
            return step()
        except Exception as e:
            log.exception("detector %s failed", name)
            self.last_error = f"{name}: {type(e).__name__}: {e}"
            return []

    def resolved_findings(self) -> list[Finding]:
        return list(self.findings.resolved)

    def report(self, f: Finding) -> bool:
        """Open a finding confirmed elsewhere (monitor.act.hosts); False when already open."""
        return self.findings.report(f)

    def resolve(self, key: tuple, how: str, now: float) -> None:
        self.findings.resolve(key, how, now)

    def in_group_hangs(self, view: ClusterView, dumps: Mapping[int, dict],
                       now: float) -> set[int]:
        """The groups whose in-group hang ``dumps`` alone confirm (Hang.in_group_hangs); its
        analysis is kept for :meth:`update` of the same dumps at the same ``now``."""
        return self.hang.in_group_hangs(view, dumps, now,
                                        lambda: self._engine(self._looked(dumps, now)))

    def fr_interval(self) -> float:
        """Seconds between periodic looks: ``fr_interval_s``, or a third of :attr:`fr_window_s`
        when shorter (at least FR_MIN_INTERVAL_S), so a look held twice as long still reads each
        entry before it leaves the window: a mismatch that stalls nothing is seen only there."""
        w = self.fr_window_s
        if w is None or not self.fr_window_adapts:
            return self.cfg.fr_interval_s
        return min(self.cfg.fr_interval_s, max(FR_MIN_INTERVAL_S, w / 3))

    def fr_wanted(self, view: ClusterView, now: float | None = None) -> list[str]:
        """URLs whose ``/v1/fr_trace`` this sweep needs: on a stall, when commit failures rose,
        or every :meth:`fr_interval` unless :meth:`periodic_look_held`; none if a trigger fails."""
        now = self.clock() if now is None else now
        reason = None
        try:
            self._note_sweep(view, now)
            if self.hang.stall(view, now)[0]:
                reason = "hang"
            elif self._commit_failures_rose(view):
                reason = "commit_failures"
            elif now - self._last_fr_at >= self.fr_interval() \
                    and not self.periodic_look_held(view, now):
                reason = "periodic"
        except Exception as e:
            log.exception("Flight Recorder trigger failed")
            self.last_error = f"{type(e).__name__}: {e}"
        if reason is None:
            return []
        self._last_fr_at = now  # asked for, answered or not: the periodic clock restarts
        # polled this sweep: a carried rank's dump would describe the past
        return [r.url for r in view.polled_ranks if r.reachable and not r.superseded
                and r.replica_group in view.groups]

    def periodic_look_held(self, view: ClusterView, now: float,
                           states: Iterable[Any] | None = None) -> bool:
        """Whether the periodic look due at ``now`` waits (up to 2 x :meth:`fr_interval`) for a hang
        look that may follow; decided once per ``now``, so the service and fr_wanted agree."""
        held = self._periodic_held
        if held is not None and held[0] == now:
            return held[1]
        out = False
        if now - self._last_fr_at < 2 * self.fr_interval():
            out = self.hang.longest_wait(view, now, states) >= self.hang.threshold(view) / 3
        self._periodic_held = (now, out)
        return out

    def hang_look_possible(self, view: ClusterView, now: float) -> bool:
        """False: :meth:`fr_wanted` asks for no hang's dumps at ``now``."""
        return self.hang.longest_wait(view, now) >= self.hang.threshold(view)

    def update(self, view: ClusterView, dumps: Mapping[int, dict] | None = None,
               now: float | None = None, full_view: ClusterView | None = None,
               evicted: Container[str] = (),
               lighthouse: LighthouseStatus | None = None,
               blind: str | None = None) -> list[Finding]:
        """The findings newly confirmed by one sweep and its dumps. ``view``: the evidence ranks;
        ``full_view``: every rank polled; ``evicted``: replica ids killed; ``lighthouse``: its
        status (None: unread); ``blind``: why the monitor may be the one cut off. Blind, or
        reaching no group it knows, no finding ends for its groups being out of sight, nor is
        one found ``dead`` but where its hosts refused the connections."""
        now = self.clock() if now is None else now
        full, dumps = full_view or view, dumps or {}
        cut_off = bool(blind) or (bool(view.groups) and not any(
            gv.reachable for gv in view.groups.values()))
        self._note_sweep(view, now)
        traces: dict[int, RankTrace] = {}
        analysis = None
        if dumps:
            self._note_fr_window(dumps)
            try:
                look = self._looked(dumps, now)
                traces = look[2]
                for err in look[3]:
                    log.warning("Flight Recorder dump of rank %s left out: %s", err["rank"],
                                err["error"])
                analysis = self._engine(look)
            except Exception as e:
                log.exception("Flight Recorder analysis failed")
                self.last_error = f"analysis: {type(e).__name__}: {e}"
        self._look = None  # read: the dumps are not kept past their sweep
        steps = (
            ("dead", lambda: self.liveness.dead(view, now, evicted, full, cut_off, lighthouse)),
            ("hang", lambda: self.hang.judge(view, dumps, analysis, now, evicted)),
            ("straggler", lambda: self.straggler.judge(view, now, cut_off)),
            ("straggler_fr", lambda: from_flight_recorder(view, analysis, now, self.findings,
                                                                 self.cfg)),
            ("mismatch", lambda: mismatch.judge(view, dumps, traces, analysis, now,
                                                self.findings)),
            ("stuck_starting", lambda: self.liveness.stuck_starting(
                full, now, self._starting_urls(full), self._groups, view, lighthouse, evicted)),
            # after the per-group detectors: a group they name explains the job
            ("job", lambda: self.jobwide.judge(view, now, self.hang, self.straggler, evicted,
                                               lighthouse, cut_off, full)),
            # job_slow's group late at its quorum: a straggler once its rank's work explains it
            ("pre_quorum", lambda: self.pre_quorum.judge(
                self.straggler.last_window, view, now,
                self.findings.open.get(("job_slow", None, None)),
                (self.jobwide.baseline_medians() or (None,))[0])))
        new = [f for name, step in steps for f in self._guarded(name, step)]
        self.findings.resolve_gone(view, full, now, self.cfg.dead_sweeps, cut_off)
        self._note_commit_failures(view)
        self._episodes_over(full)
        return new

    def _episodes_over(self, full: ClusterView) -> None:
        """Forget a restarted key once its group (a job-wide one: each group of the quorum)
        committed a step past the lowest it showed since, or a stall's finding showed (a
        restart from a checkpoint goes back), every rank of it answering and nothing of that
        kind open there or pending (a straggler's late window, a job-wide finding): a stall
        commits none, a dead rank does not answer; a fault back later is a new episode."""
        for key, (episode, was) in list(self.restarted.items()):
            kind, g, _ = key
            gv = full.groups.get(g)
            if g is None:
                step = min((q.step for q in full.in_quorum() if q.step is not None), default=None)
            else:
                step = gv.step if gv else None
            if step is None:
                continue
            if was is None or step < was:
                self.restarted[key] = (episode, step)
            elif step > was and (gv is None or len(gv.reachable) == len(gv.ranks)) \
                    and g not in self.findings.groups(kind) \
                    and not (kind in (*JOB_KINDS, "network") and self.probes_wanted()) \
                    and not (kind == "straggler" and g in self._groups
                             and self._groups[g].straggler_windows):
                del self.restarted[key]

    def _note_fr_window(self, dumps: Mapping[int, dict]) -> None:
        """:attr:`fr_window_s`: the shortest time any rank's newest ``filter.last`` entries span
        (a dump with fewer: scaled); dumps of one ``pg``, whole or without times left out."""
        if not self.fr_window_adapts:
            self.fr_window_s = None
            return
        spans = []
        for d in dumps.values():
            f = d.get("filter") if isinstance(d, dict) else None
            if not isinstance(f, dict) or f.get("pg") is not None or type(f.get("last")) is not int:
                continue
            entries = d.get("entries")
            if not isinstance(entries, list) or len(entries) < 16 \
                    or not isinstance(entries[0], dict) or not isinstance(entries[-1], dict):
                continue
            t0, t1 = entries[0].get("time_created_ns"), entries[-1].get("time_created_ns")
            if type(t0) is int and type(t1) is int and t1 > t0:
                spans.append((t1 - t0) / 1e9 * max(1.0, f["last"] / len(entries)))
        if spans:
            self.fr_window_s = min(spans)

    def _note_sweep(self, view: ClusterView, now: float) -> None:
        """New groups and the hang's progress, once a sweep (fr_wanted, then update)."""
        if self._noted is not None and self._noted[0] is view and self._noted[1] == now:
            return
        self._remember_groups(view)
        self.hang.note_progress(view, now)
        self._noted = (view, now)

    def _looked(self, dumps: Mapping[int, dict], now: float) -> list:
        """The look at ``dumps`` (see ``_look``), normalized once for the same dump objects at
        the same ``now``: a hang's confirming sweep analyses its dumps before fetching more."""
        got = self._look
        if got is None or got[0] != now or got[1].keys() != dumps.keys() \
                or any(dumps[r] is not d for r, d in got[1].items()):
            got = self._look = [now, dict(dumps), *normalize_dumps(dumps), None]
        return got

    def _engine(self, look: list) -> list[dict]:
        """The engine's findings of a look, run once; a failed run is not kept, nor its traces
        (the engine renumbers them as it goes)."""
        if look[4] is None:
            self._look = None
            look[4] = engine_findings(self.analyzer(look[2]))
            self._look = look
        return look[4]

    def _remember_groups(self, view: ClusterView) -> None:
        """A new group or replica id: a fresh memory, the earlier incarnation's findings
        ``replaced`` (but ``dead`` and ``stuck_starting``, which judge that alone)."""
        for g in self._seen.changed(view)[0]:
            rid, mem = view.groups[g].replica_id, self._groups.get(g)
            if mem is None or (rid is not None and mem.replica_id != rid):
                if mem is not None:
                    self.findings.resolve_where("replaced", self.clock(), group=g,
                                                keep=("dead", "stuck_starting"))
                self._groups[g] = GroupMemory(rid)

    def _starting_urls(self, full: ClusterView) -> list[str] | None:
        """The ranks without a quorum from the pass over the evidence, if it read all of ``full``."""
        got = self.straggler.last_answers
        if got is not None and (got.view is full or (
                full.evidence_view is got.view and len(got.view.ranks) == len(full.ranks))):
            return got.starting
        return None

    def _commit_failures_rose(self, view: ClusterView) -> bool:
        prev = self._commit_failures
        return any(n > prev.get(u, n) for u, n in self.straggler.answers(view).counts.items())

    def _note_commit_failures(self, view: ClusterView) -> None:
        if view.polled is None:
            self._commit_failures = {}
        cf, got = self._commit_failures, self.straggler.answers(view)
        cf.update(got.counts)
        for u in got.silent:
            cf.pop(u, None)
        for u in cf.keys() - view.ranks.keys():
            del cf[u]
