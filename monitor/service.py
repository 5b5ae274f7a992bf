"""The monitor's loop: ranks -> poller -> detectors -> decisions -> actions, once per interval.

:class:`Monitor` wires the stages together and owns nothing else: discovery says whom to poll,
the poller fetches ``/v1/state`` (and ``/v1/fr_trace`` when a detector asks), the view builder
folds answers into groups x ranks, the detectors turn views into confirmed findings, the rails
decide, the Lighthouse client acts, and the store keeps the audit log. The HTTP API
(:mod:`monitor.app`) only reads what the loop published, plus two writes (registration and
manual eviction) that go through the same objects.

A sweep that fails anywhere is logged and counted; the loop goes on with the next one. The
monitor never raises out of :meth:`Monitor.sweep_once` because of a rank.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from typing import Any

from http_serving import BackgroundWSGIServer, bearer_token_matches

from .actions import Lighthouse
from .admission import NotAllowed, Unauthorized
from .app import create_app
from .config import MonitorConfig
from .decisions import Situation, decide
from .detectors import Analyzer, Detectors, Finding
from .discovery import BadTarget, Discovery, Target, TooManyTargets
from .metrics import MonitorMetrics
from .poller import Poller
from .store import Store
from .view import ClusterView, ViewBuilder

log = logging.getLogger(__name__)

REFUSALS = {Unauthorized: "unauthorized", NotAllowed: "not_allowed", BadTarget: "bad_request",
            TooManyTargets: "too_many_targets"}


class Monitor:
    def __init__(self, cfg: MonitorConfig, analyzer: Analyzer | None = None,
                 clock=time.time) -> None:
        cfg.validate()
        self.cfg = cfg
        self.clock = clock
        self.discovery = Discovery(cfg.targets, cfg.targets_file, cfg.forget_after_s, cfg.job,
                                   max_targets=cfg.max_targets)
        self.allow_list = cfg.allow_list()
        if cfg.sd_out:
            self.discovery.restore(cfg.sd_out)  # resume polling what the last run knew
        self.poller = Poller(cfg.poll_timeout_s, cfg.max_concurrency,
                             max_bytes=cfg.max_state_bytes)
        self.views = ViewBuilder()
        self.detectors = Detectors(cfg.detectors, analyzer, clock=clock)
        self.store = Store(cfg.state_path)
        self.lighthouse = Lighthouse(cfg.lighthouse, cfg.kill_timeout_s)
        self.metrics = MonitorMetrics(cfg.job)
        self.metrics.dry_run.labels(cfg.job).set(1 if cfg.rails.dry_run else 0)
        self.view: ClusterView | None = None
        self.sweeps = 0
        self.last_sweep_error: str | None = None
        self.started_at = clock()
        self._finding_ids: dict[tuple, int] = {}
        self._last_decision: dict[tuple, str] = {}
        self._act_lock = threading.Lock()  # one decision/eviction at a time (loop vs. API)
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

    # --- lifecycle -------------------------------------------------------------------
    def start(self, serve: bool = True) -> Monitor:
        if serve:
            self._http = BackgroundWSGIServer(create_app(self), host=self.cfg.bind,
                                              port=self.cfg.port, threads=8,
                                              name="lightkeeper-monitor-http")
            port = self._http.port
            host = self.cfg.bind if self.cfg.bind not in ("0.0.0.0", "::", "") else "127.0.0.1"
            self.url = f"http://{host}:{port}"
            self._http.start()
        self._loop_thread = threading.Thread(target=self._loop, name="lightkeeper-monitor-loop",
                                             daemon=True)
        self._loop_thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._loop_thread is not None:
            self._loop_thread.join(timeout=30)
        if self._http is not None:
            self._http.stop()
        self.poller.close()
        self.lighthouse.close()
        self.store.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.sweep_once()
            except Exception as e:  # a bug in one stage must not end monitoring
                log.exception("sweep failed")
                self.last_sweep_error = f"{type(e).__name__}: {e}"
            self._stop.wait(max(0.0, self.cfg.interval_s - (time.monotonic() - started)))

    # --- one sweep -------------------------------------------------------------------
    def sweep_once(self) -> ClusterView:
        t0 = time.perf_counter()
        err = self.discovery.refresh()
        if err:
            log.warning("%s", err)
        targets = self.discovery.targets()
        polls = self.poller.sweep([t.url for t in targets])
        now = self.clock()
        view = self.views.update(targets, polls, now=now)
        for url in self.discovery.forget_unreachable(self.views.unreachable_since(), now):
            log.info("forgot %s: unreachable for %.0fs", url, self.cfg.forget_after_s)
        dumps = self._fetch_fr(view, now)
        new = self.detectors.update(view, dumps, now)
        self._record_findings(new, now)
        self._decide_all(view, now)
        self._confirm_evictions(view, now)
        view.sweep_seconds = time.perf_counter() - t0
        self.view = view
        self.sweeps += 1
        self._publish_metrics(view, polls)
        if self.cfg.sd_out:
            try:
                self.discovery.write_file_sd(self.cfg.sd_out)
            except OSError as e:
                log.warning("cannot write %s: %s", self.cfg.sd_out, e)
        return view

    def _fetch_fr(self, view: ClusterView, now: float) -> dict[int, dict]:
        urls = self.detectors.fr_wanted(view, now)
        if not urls:
            return {}
        dumps: dict[int, dict] = {}
        for url, p in self.poller.sweep(urls, "/v1/fr_trace", self.cfg.fr_timeout_s,
                                        self.cfg.max_fr_bytes).items():
            if not p.ok or not isinstance(p.data, dict):
                continue
            rank = p.data.get("rank")
            if not isinstance(rank, int):
                rv = view.ranks.get(url)
                rank = rv.rank if rv else None
            if isinstance(rank, int):
                dumps[rank] = p.data
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

    # --- decisions and actions -------------------------------------------------------
    def _situation(self, view: ClusterView, now: float) -> Situation:
        return Situation(now=now, reachable_fraction=view.reachable_fraction,
                         groups_in_quorum={g.replica_group for g in view.in_quorum()},
                         evicted_replica_ids=self.store.evicted_replica_ids(),
                         last_eviction_at=self.store.last_eviction_at())

    def _decide_all(self, view: ClusterView, now: float) -> None:
        for f in self.detectors.open_findings():
            if f.kind not in self.cfg.rails.evict_kinds:
                continue  # reported only (e.g. dead): nothing to decide
            with self._act_lock:
                s = self._situation(view, now)
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
                                          finding_id=finding_id, finding=finding, source=source)
            return {"id": did, "decision": "hold", "reason": d.reason, "detail": d.detail}
        log.warning("evicting replica group %s (%s): %s", replica_group, replica_id, d.detail)
        did = self.store.add_decision(replica_group=replica_group, replica_id=replica_id,
                                      decision="evict", reason=(finding or {}).get("kind", source),
                                      detail=d.detail, finding_id=finding_id, finding=finding,
                                      status="sending", source=source)
        result = self.lighthouse.kill(replica_id)
        self.store.update_decision(did, status="sent" if result.sent else "failed",
                                   http_status=result.http_status,
                                   detail=f"{d.detail}; kill: {result.detail}")
        if result.sent:
            self.metrics.evictions.labels(self.cfg.job, str(replica_group)).inc()
        self.metrics.last_eviction.labels(self.cfg.job).set(self.clock())
        return {"id": did, "decision": "evict", "reason": d.reason, "sent": result.sent,
                "detail": result.detail}

    def register_target(self, body: Any, authorization: str | None) -> Target:
        """``POST /v1/targets``. With a token configured the registration must carry it (any
        address then); without one, the target must resolve into ``--allow-targets``.

        Raises Unauthorized, NotAllowed, BadTarget or TooManyTargets; nothing is added then.
        """
        try:
            if self.cfg.token:
                if not bearer_token_matches(authorization, self.cfg.token):
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
        """``POST /v1/evict``: the same rails minus evidence, cooldown and blindness."""
        view = self.view
        gv = view.groups.get(replica_group) if view else None
        replica_id = gv.replica_id if gv else None
        with self._act_lock:
            now = self.clock()
            s = self._situation(view, now) if view else Situation(now, 0.0, set())
            d = decide("manual", replica_group, replica_id, s, self.cfg.rails, manual=True)
            out = self._apply(d, replica_group, replica_id, None,
                              {"kind": "manual", "reason": reason}, "manual")
        out.update(replica_group=replica_group, replica_id=replica_id)
        return out

    def _confirm_evictions(self, view: ClusterView, now: float) -> None:
        """An eviction is confirmed once no reachable rank reports the evicted replica_id."""
        for d in self.store.pending_confirmations():
            rid = d["replica_id"]
            still = [r for r in view.ranks.values() if r.reachable and r.replica_id == rid]
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

    # --- publishing ------------------------------------------------------------------
    def _publish_metrics(self, view: ClusterView, polls) -> None:
        m, job = self.metrics, self.cfg.job
        m.sweeps.labels(job).inc()
        m.sweep_duration.labels(job).observe(view.sweep_seconds)
        known = [r for r in view.ranks.values() if not r.superseded]
        up = sum(r.reachable for r in known)
        m.ranks_known.labels(job).set(len(known))
        m.ranks_up.labels(job).set(up)
        m.ranks_unreachable.labels(job).set(len(known) - up)
        for p in polls.values():
            if not p.ok and p.reason:
                m.poll_errors.labels(job, p.reason).inc()
        for r in view.ranks.values():
            if r.reachable is False and r.reason == "bad_response" and r.url in polls \
                    and polls[r.url].ok:
                m.poll_errors.labels(job, "bad_response").inc()
        counts: dict[str, int] = {}
        for f in self.detectors.open_findings():
            counts[f.kind] = counts.get(f.kind, 0) + 1
        for kind in ("straggler", "hang", "mismatch", "dead"):
            m.open_findings.labels(job, kind).set(counts.get(kind, 0))
        in_quorum = {g.replica_group for g in view.in_quorum()}
        meds = {g: gv.median_step_seconds() for g, gv in view.groups.items()}
        valid = [v for v in meds.values() if v]
        overall = statistics.median(valid) if valid else None
        rows = {}
        for g, gv in view.groups.items():
            rows[g] = {"relative": (meds[g] / overall) if meds[g] and overall else None,
                       "lag": self.detectors.last_lags.get(g), "step": gv.step,
                       "in_quorum": g in in_quorum}
        m.set_groups(rows)
        if view.quorum_id is not None:
            m.quorum_id.labels(job).set(view.quorum_id)
        qp = view.quorum_participants()
        if qp is not None:
            m.quorum_participants.labels(job).set(qp)

    def cluster_json(self) -> dict[str, Any]:
        view = self.view
        now = self.clock()
        out: dict[str, Any] = {"job": self.cfg.job, "lighthouse": self.cfg.lighthouse,
                               "dry_run": self.cfg.rails.dry_run, "sweeps": self.sweeps,
                               "monitor_started_at": self.started_at, "groups": [],
                               "quorum_id": None, "quorum_participants": None,
                               "reachable_fraction": None, "sweep_seconds": None, "at": None,
                               "ungrouped": [],
                               "last_error": self.last_sweep_error or self.detectors.last_error,
                               "targets_file_error": self.discovery.file_error}
        if view is None:
            return out
        open_by_group: dict[int, list[str]] = {}
        for f in self.detectors.open_findings():
            open_by_group.setdefault(f.replica_group, []).append(f.kind)
        in_quorum = {g.replica_group for g in view.in_quorum()}
        out.update(quorum_id=view.quorum_id, quorum_participants=view.quorum_participants(),
                   reachable_fraction=view.reachable_fraction, sweep_seconds=view.sweep_seconds,
                   at=view.at)
        for g, gv in view.groups.items():
            ranks = []
            for r in gv.ranks:
                s = r.state or {}
                ranks.append({
                    "url": r.url, "rank": r.rank, "group_rank": s.get("group_rank"),
                    "reachable": r.reachable, "reason": r.reason, "error": r.error,
                    "step": s.get("step"), "phase": s.get("phase"),
                    "phase_for_s": (now - s["phase_since"]) if s.get("phase_since") else None,
                    "quorum_id": s.get("quorum_id"), "participating": s.get("participating"),
                    "last_step_seconds": s.get("last_step_seconds"), "host": s.get("host"),
                    "pid": s.get("pid"), "replica_id": s.get("replica_id"),
                    "faults": s.get("faults"), "unreachable_sweeps": r.failures})
            out["groups"].append({
                "replica_group": g, "replica_id": gv.replica_id, "status": gv.status,
                "step": gv.step, "in_quorum": g in in_quorum,
                "median_step_seconds": gv.median_step_seconds(),
                "arrival_lag_seconds": self.detectors.last_lags.get(g),
                "open_findings": sorted(open_by_group.get(g, [])), "ranks": ranks})
        out["ungrouped"] = [{"url": r.url, "reachable": r.reachable, "reason": r.reason,
                             "error": r.error, "unreachable_sweeps": r.failures}
                            for r in view.ranks.values()
                            if r.replica_group is None and not r.superseded]
        return out
