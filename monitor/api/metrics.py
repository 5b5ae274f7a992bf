"""The monitor's own Prometheus metrics (docs/CONTRACTS.md), labelled with the ``job``.
Per-group series are made at scrape time, so a sweep does no per-group metrics work."""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from monitor.act.hosts import failing_actions
from monitor.detect import KINDS, Detectors
from monitor.evidence.lighthouse_settings import SETTINGS, LighthouseSettingsWatch
from monitor.evidence.verification import REASONS as TRUST_REASONS
from monitor.evidence.verification import VERIFIED
from monitor.evidence.view import ClusterView
from monitor.goodput import CAUSES, SweepAccount
from monitor.poll.poller import REASONS as POLL_REASONS

SWEEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

GROUP_SERIES = (  # (name, help) of the per-group gauges, labels job and replica_group
    ("arrival_lag_seconds", "How long the other groups wait for this group at the cross-group "
                            "step (median over the straggler window, from the ranks' own "
                            "per-step waits)"),
    ("step", "Committed step of the group"),
    ("in_quorum", "1 when the group takes part in the newest quorum"),
    ("stuck_starting", "1 while an open stuck_starting finding names the group"),
    ("goodput_ratio", "One replica group slot's goodput / its wall seconds since the ledger "
                      "began"))
PREFIX = "lightkeeper_monitor_"
GROUP_PREFIX = PREFIX + "replica_group_"


class GroupSeries(Collector):
    """The per-group gauges of the last sweep's view (held weakly: the one before is freed), its
    lags and the goodput ratios, each replaced whole by a sweep so a scrape reads one sweep."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.view_ref: Callable[[], ClusterView | None] = lambda: None
        self.lags: Mapping[int, float | None] = {}
        self.goodput: Mapping[int, float] = {}
        self.stuck: Collection[int] = ()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = {name: GaugeMetricFamily(GROUP_PREFIX + name, doc,
                                            labels=["job", "replica_group"])
                    for name, doc in GROUP_SERIES}
        view, lags = self.view_ref(), self.lags
        if view is not None:
            in_quorum = {g.replica_group for g in view.in_quorum()}
            for g, gv in view.groups.items():
                for name, v in (("arrival_lag_seconds", lags.get(g)), ("step", gv.step),
                                ("in_quorum", g in in_quorum)):
                    if v is not None:
                        families[name].add_metric([self.job, str(g)], float(v))
            # a group stuck before its first quorum is unverified: in the full view only
            for g in sorted(set(view.groups) | set(self.stuck)):
                families["stuck_starting"].add_metric([self.job, str(g)], float(g in self.stuck))
        for g, ratio in self.goodput.items():
            families["goodput_ratio"].add_metric([self.job, str(g)], ratio)
        yield from families.values()


class HostSeries(Collector):
    """A series per host that is not ok, replaced whole by a sweep so a scrape reads one sweep
    (gauges cleared and set again showed a scrape none in between)."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.hosts: list[dict] = []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = GaugeMetricFamily(
            PREFIX + "host_quarantine_state", "1 per host that is not ok, labelled with its "
            "state (suspect, quarantined, released): bounded by the hosts in trouble",
            labels=["job", "host", "node", "state"])
        offences = GaugeMetricFamily(PREFIX + "host_offences", "Offences counting towards "
                                     "quarantine, per host not ok", labels=["job", "host"])
        failed = GaugeMetricFamily(PREFIX + "host_action_failed", "1 per sink whose newest "
                                   "quarantine/release action for the host failed or is being "
                                   "retried",
                                   labels=["job", "host", "sink"])
        for h in self.hosts:
            if h["state"] != "ok":
                state.add_metric([self.job, h["host"], str(h.get("node") or h["host"]),
                                  h["state"]], 1)
                offences.add_metric([self.job, h["host"]], sum(
                    1 for o in h.get("offences") or [] if o.get("in_window")))
            for a in failing_actions(h):
                failed.add_metric([self.job, h["host"], a.get("sink") or "?"], 1)
        yield from (state, offences, failed)


class MonitorMetrics:
    def __init__(self, job: str) -> None:
        self.job = job
        r = self.registry = CollectorRegistry()

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(PREFIX + name, doc, ["job", *labels], registry=r)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(PREFIX + name, doc, ["job", *labels], registry=r)

        self.sweep_duration = Histogram(PREFIX + "sweep_duration_seconds",
                                        "Wall time of one sweep (poll every rank, detect, decide)",
                                        ["job"], registry=r, buckets=SWEEP_BUCKETS)
        self.sweeps = counter("sweeps", "Sweeps done")
        self.ranks_known = gauge("ranks_known", "Ranks the monitor polls")
        self.ranks_up = gauge("ranks_up", "Ranks that answered the last sweep")
        self.ranks_unreachable = gauge("ranks_unreachable",
                                       "Ranks that did not answer the last sweep, less those "
                                       "whose training finished")
        self.ranks_finished = gauge("ranks_finished", "Ranks that said their training finished, "
                                    "then stopped answering (not unreachable: they ended)")
        self.ranks_lost = counter("ranks_lost", "Self-registered ranks forgotten (unreachable "
                                  "for --forget-after) while other ranks still answered, unless "
                                  "they had said they stopped")
        self.poll_errors = counter("poll_errors", "Failed polls by reason", "reason")
        self.findings = counter("findings", "Confirmed findings", "kind", "replica_group")
        self.open_findings = gauge("open_findings", "Open confirmed findings", "kind")
        self.evictions = counter("evictions", "Kill requests sent to the Lighthouse",
                                 "replica_group")
        self.decisions = counter("eviction_decisions", "Eviction decisions by outcome",
                                 "decision", "reason")
        self.last_eviction = gauge("last_eviction_timestamp_seconds",
                                   "Unix time of the last kill request")
        self.groups = GroupSeries(job)
        r.register(self.groups)
        self.quorum_id = gauge("quorum_id", "Newest quorum id the ranks report")
        self.quorum_participants = gauge("quorum_participants",
                                         "Participants of the newest quorum")
        self.dry_run = gauge("dry_run", "1 when the monitor never evicts")
        self.start_time = gauge("start_time_seconds", "Unix time the monitor started: a "
                                "labelled counter first seen soon after is new, not back "
                                "from a scrape gap")
        self.ranks_verified = gauge("ranks_verified",
                                    "Ranks whose claims the Lighthouse and their peers confirm "
                                    "(their answers are evidence)")
        self.ranks_unverified = gauge("ranks_unverified",
                                      "Known ranks not verified, by reason (shown, never "
                                      "evidence for an eviction)", "reason")
        self.ranks_answering_unverified = gauge(
            "ranks_answering_unverified", "Ranks that answered their last poll and are not "
            "verified, by reason (an unreachable rank's last verdict not counted)", "reason")
        self.lighthouse_up = gauge("lighthouse_up",
                                   "1 when the Lighthouse's status was read and understood at "
                                   "the last sweep (else ranks cannot be verified: no eviction)")
        self.registrations = counter("registrations",
                                     "POST /v1/targets by outcome (accepted, unauthorized, "
                                     "not_allowed, bad_request, too_many_targets, other_job, "
                                     "resolver_busy)",
                                     "outcome")
        self.goodput_ratio = gauge("goodput_ratio",
                                   "Goodput / (expected replica groups x wall seconds) since the "
                                   "goodput ledger began (NaN before it has accounted a sweep)")
        self.goodput_seconds = counter("goodput_seconds",
                                       "Replica-seconds spent in steps committed at healthy "
                                       "pace (this monitor process's accounting)")
        self.badput_seconds = counter("badput_seconds",
                                      "Replica-seconds lost, by cause (straggler_drag, stall, "
                                      "recovery, capacity_lost, startup, unattributed; slow time "
                                      "counts once its cause is settled)", "cause")
        self.expected_groups = gauge("expected_replica_groups",
                                     "Replica groups the goodput ledger expects "
                                     "(--expected-groups, else the number ever seen)")
        self.lighthouse_drop = gauge("lighthouse_drop_seconds",
                                     "The last evicted group: seconds from the kill until the "
                                     "Lighthouse's newest quorum no longer listed it (to within "
                                     "one sweep; NaN before the first)")
        self.lighthouse_heartbeat_timeout = gauge(
            "lighthouse_heartbeat_timeout_seconds",
            "The Lighthouse's heartbeat timeout: declared (--lighthouse-heartbeat-timeout-ms), "
            "and the bounds its /status shows (observed_above < timeout <= observed_at_most); "
            "NaN when not known", "source")
        self.config_warnings = gauge("config_warnings",
                                     "1 while a setting makes recovery slow (docs/lighthouse.md),"
                                     " by setting", "setting")
        # sharded monitors only (--shard, --lead): whether they can act at all
        self.shard_etcd_up = gauge("shard_etcd_up",
                                   "1 when the last exchange with etcd succeeded (role shard: "
                                   "its report and proposals; leader: its campaign and kills); "
                                   "0: this monitor proposes or sends no eviction", "role")
        self.shard_leading = gauge("shard_leading", "A leader candidate (--lead): 1 while it "
                                   "leads (sends the job's kills)")
        self.shard_standby = gauge("shard_standby", "1 while another monitor holds this "
                                   "--shard index: this one polls, and reports or proposes "
                                   "nothing")
        self.hosts = gauge("hosts", "Hosts in the host ledger by state (ok, suspect, "
                           "quarantined, released; only hosts that ever offended are in it)",
                           "state")
        self.host_series = HostSeries(job)
        r.register(self.host_series)
        for state in ("ok", "suspect", "quarantined", "released"):
            self.hosts.labels(job, state).set(0)
        self.lighthouse_drop.labels(job).set(float("nan"))
        for setting in SETTINGS:
            self.config_warnings.labels(job, setting).set(0)
        for source in ("declared", "observed_above", "observed_at_most"):
            self.lighthouse_heartbeat_timeout.labels(job, source).set(float("nan"))
        self.goodput_ratio.labels(job).set(float("nan"))
        self.goodput_seconds.labels(job)
        for cause in CAUSES:
            self.badput_seconds.labels(job, cause)
        self.expected_groups.labels(job).set(0)
        for reason in POLL_REASONS:
            self.poll_errors.labels(job, reason)
        self.ranks_lost.labels(job)
        for kind in ("straggler", "hang", "mismatch", "dead"):
            self.open_findings.labels(job, kind).set(0)

    def set_groups(self, view: ClusterView, lags: Mapping[int, float | None],
                   stuck: Collection[int] = ()) -> None:
        """The per-group series from now on; no argument may change afterwards, and the
        caller keeps ``view`` (only a weak reference is held). ``stuck``: the groups an open
        stuck_starting finding names."""
        self.groups.view_ref, self.groups.lags = weakref.ref(view), lags
        self.groups.stuck = stuck

    def set_hosts(self, counts: dict[str, int], hosts: list[dict]) -> None:
        """Counts by state, and a series per host that is not ``ok`` or one of whose sinks'
        newest action failed."""
        for state, n in counts.items():
            self.hosts.labels(self.job, state).set(n)
        # an ok host whose release failed on a sink (its node left cordoned) too
        self.host_series.hosts = [h for h in hosts if h.get("state") != "ok"
                                  or failing_actions(h)]

    def add_goodput(self, acct: SweepAccount) -> None:
        job = self.job
        if acct.goodput > 0:
            self.goodput_seconds.labels(job).inc(acct.goodput)
        for cause, seconds in acct.badput.items():
            if seconds > 0:
                self.badput_seconds.labels(job, cause).inc(seconds)
        if acct.job_goodput_ratio is not None:
            self.goodput_ratio.labels(job).set(acct.job_goodput_ratio)
        if acct.expected_groups:
            self.expected_groups.labels(job).set(acct.expected_groups)
        if acct.group_goodput_ratio:
            self.groups.goodput = acct.group_goodput_ratio


def publish_sweep(m: MonitorMetrics, view: ClusterView, evidence: ClusterView,
                  polls: Mapping[str, Any], detectors: Detectors, lighthouse_up: bool,
                  lh_settings: LighthouseSettingsWatch, ended: int = 0) -> None:
    """One sweep's series: rank counts of every known rank, the rest of verified ranks;
    ``ended``: unreachable ranks that said their training finished (not counted unreachable)."""
    job = m.job
    known, up, trust = view.counts
    m.ranks_known.labels(job).set(known)
    m.ranks_up.labels(job).set(up)
    m.ranks_unreachable.labels(job).set(known - up - ended)
    m.ranks_finished.labels(job).set(ended)
    m.ranks_verified.labels(job).set(sum(n for k, n in trust.items()
                                         if k is not None and k[0] == VERIFIED))
    by_reason = dict.fromkeys(TRUST_REASONS[1:], 0)
    answering = dict(by_reason)
    for k, n in trust.items():
        if k is not None and k[0] != VERIFIED:
            by_reason[k[1]] = by_reason.get(k[1], 0) + n
            if not k[2]:
                answering[k[1]] = answering.get(k[1], 0) + n
    for reason, n in by_reason.items():
        m.ranks_unverified.labels(job, reason).set(n)
        m.ranks_answering_unverified.labels(job, reason).set(answering.get(reason, 0))
    m.lighthouse_up.labels(job).set(1 if lighthouse_up else 0)
    lh_settings.publish(m, job)
    for url, p in polls.items():
        if not p.ok:
            if p.reason:
                m.poll_errors.labels(job, p.reason).inc()
            continue
        r = view.ranks.get(url)
        if r is not None and r.reachable is False and r.reason == "bad_response":
            m.poll_errors.labels(job, "bad_response").inc()
    found = detectors.open_findings()
    counts = collections.Counter(f.kind for f in found)
    for kind in KINDS:
        m.open_findings.labels(job, kind).set(counts.get(kind, 0))
    m.set_groups(evidence, detectors.last_lags,
                 frozenset(f.replica_group for f in found if f.kind == "stuck_starting"))
    # no verified rank says a quorum: no series, not the last one seen (a panel shows the gap)
    for gauge, value in ((m.quorum_id, evidence.quorum_id),
                         (m.quorum_participants, evidence.quorum_participants())):
        if value is None:
            # prometheus-client < 0.22 raises KeyError for a series never set (a fresh monitor)
            with contextlib.suppress(KeyError):
                gauge.remove(job)
        else:
            gauge.labels(job).set(value)
    # last: a sweep that failed above is not counted (LightkeeperMonitorNotSweeping)
    m.sweep_duration.labels(job).observe(view.sweep_seconds)
    m.sweeps.labels(job).inc()
