"""The monitor's configuration: dataclasses filled from ``lightkeeper monitor`` flags (a field
made with :func:`flag` gets its flag in monitor/cli.py; docs/monitor.md explains each). A value
that makes no sense raises :class:`ConfigError` at start-up, never in the middle of a run.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

from http_serving import is_http_url, redact_url
from rank_wire import TIMING_ROWS

EVICTABLE_KINDS = ("straggler", "hang", "mismatch", "dead_rank", "dead", "stuck_starting",
                   "network", "quarantined_host")
# --quarantine-after defaults: a straggler may be the job's own jitter, so it takes two; a dead
# group counts once the Lighthouse agrees it is gone (monitor.act.enforcer)
QUARANTINE_AFTER = {"hang": 1, "mismatch": 1, "dead_rank": 1, "straggler": 2, "network": 1,
                    "dead": 1}
QUARANTINE_KINDS = EVICTABLE_KINDS[:-1]  # not quarantined_host
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?")  # Kubernetes'
RANK_AUTH = ("hmac", "bearer")  # --rank-auth: how the monitor's calls to ranks carry their token
# a rank answered 401 to a signed call: said once per rank URL and identity, and on the outcome
REFUSED_SIGNATURE = ("the rank's identity changed since the monitor's last read (e.g. its "
                     "group restarted at the same port with a new replica id: nothing to do, "
                     "the signature binds the rank's slot and its group's incarnation, so the "
                     "new group refuses a call meant for the old one), or its "
                     "LIGHTKEEPER_EXIT_TOKEN differs, or it runs an older Lightkeeper that takes "
                     "only the bearer token (restart it on this version); --rank-auth bearer "
                     "only as a last resort: it sends the token to every rank called and ends "
                     "whatever process answers at the URL")


class ConfigError(ValueError):
    """A configuration value the monitor cannot run with."""


def flag(default: Any, name: str, help: str) -> Any:
    """A field set by the flag ``name`` (a bool's flag turns the default over)."""
    return field(default=default, metadata={"flag": name, "help": help})


def _named(cfg: object, name: str) -> str:
    """The flag that sets field ``name`` of ``cfg`` (``--interval``), else the field's name."""
    return next((f.metadata.get("flag") or name for f in fields(cfg)  # type: ignore[arg-type]
                 if f.name == name), name)


def _at_least(cfg: object, low: float, *names: str, strict: bool = False) -> None:
    """Raise ConfigError naming (by its flag) the first of ``names`` below ``low`` (``strict``:
    not above); None is allowed."""
    for name in names:
        value = getattr(cfg, name)
        if value is not None and (value <= low if strict else value < low):
            raise ConfigError(f"{_named(cfg, name)} must be {'>' if strict else '>='} {low}, "
                              f"got {value!r}")


@dataclass
class DetectorConfig:
    # straggler: how long the others wait for a group at the cross-group step
    straggler_min_lag_s: float = flag(0.1, "--straggler-min-lag",
                                      "seconds a group must arrive after its peers (or the "
                                      "median group's own work a step, when shorter)")
    straggler_rel_lag: float = flag(0.25, "--straggler-rel-lag",
                                    "... and at least this fraction of the median step time")
    straggler_steps: int = flag(6, "--straggler-steps",
                                "newest steps per straggler window, waited for in 3 of 4")
    straggler_windows: int = flag(2, "--straggler-windows",
                                  "consecutive windows to confirm a straggler")
    # hang: no step progress for max(hang_floor_s, hang_factor * median step time)
    hang_floor_s: float = flag(3.0, "--hang-floor",
                               "minimum seconds without progress before a hang")
    hang_factor: float = flag(3.0, "--hang-factor",
                              "... or this many median step times if longer")
    checkpoint_timeout_s: float = flag(1800.0, "--checkpoint-timeout", "seconds a group whose "
                                       "ranks say phase checkpoint or busy is not hung (0: "
                                       "never)")
    dead_sweeps: int = flag(3, "--dead-sweeps", "unreachable sweeps before a rank is dead")
    starting_timeout_s: float = flag(300.0, "--starting-timeout", "seconds a rank may answer "
                                     "without a first quorum (or a group stays out of the "
                                     "quorum, its step unmoved, while the others step) before "
                                     "it is stuck_starting, and a group on its first step is "
                                     "waited for before a hang")
    fr_interval_s: float = flag(15.0, "--fr-interval", "fetch Flight Recorder from every rank "
                                "at least this often, seconds (mismatch)")
    # job_slow: the healthy baseline is the median of the job's first healthy windows
    job_slow_factor: float = flag(1.5, "--job-slow-factor", "job_slow: the job's median step "
                                  "above this many times its healthy baseline, no group late")
    job_slow_windows: int = flag(2, "--job-slow-windows",
                                 "... in this many consecutive straggler windows")
    job_baseline_windows: int = flag(5, "--job-baseline-windows",
                                     "healthy windows seen before job_slow is judged")

    def validate(self) -> None:
        _at_least(self, 0, "straggler_min_lag_s", "straggler_rel_lag", "hang_floor_s",
                  "hang_factor", "fr_interval_s", "starting_timeout_s", strict=True)
        _at_least(self, 1, "straggler_steps", "straggler_windows", "dead_sweeps",
                  "job_slow_windows", "job_baseline_windows")
        if self.straggler_steps > STRAGGLER_MAX_STEPS:  # never a window: never judged, unsaid
            raise ConfigError(f"--straggler-steps must be at most {STRAGGLER_MAX_STEPS} (the "
                              f"steps a rank serves and the monitor keeps), got "
                              f"{self.straggler_steps}")
        _at_least(self, 0, "checkpoint_timeout_s")
        _at_least(self, 1, "job_slow_factor", strict=True)


@dataclass
class RailsConfig:
    min_replicas: int = flag(2, "--min-replicas",
                             "never evict below this many replica groups in the quorum")
    cooldown_s: float = flag(60.0, "--cooldown", "at most one eviction per this many seconds")
    min_reachable_fraction: float = flag(0.5, "--min-reachable", "hold evictions unless the "
                                         "monitor reaches more than this fraction of the "
                                         "verified ranks of the groups not gone (sent a kill, "
                                         "or lost: unreached, their heartbeat old)")
    dry_run: bool = flag(False, "--dry-run", "detect and report, never evict")
    evict_kinds: tuple[str, ...] = ("straggler", "hang", "mismatch", "dead_rank", "network",
                                    "quarantined_host")

    def validate(self) -> None:
        _at_least(self, 1, "min_replicas")
        _at_least(self, 0, "cooldown_s")
        if not 0 <= self.min_reachable_fraction < 1:
            raise ConfigError("--min-reachable must be in [0, 1), got "
                              f"{self.min_reachable_fraction}")
        unknown = [k for k in self.evict_kinds if k not in EVICTABLE_KINDS]
        if unknown:
            raise ConfigError(f"unknown finding kind(s) to evict on: {', '.join(unknown)}; "
                              f"expected some of {', '.join(EVICTABLE_KINDS)}")


# a rank's POST /v1/probe bounds (worker_server/probe.py; the monitor does not import it)
STRAGGLER_MAX_STEPS = TIMING_ROWS  # the timing rows a rank serves and the monitor keeps
PROBE_MAX_BYTES, PROBE_MAX_TIMEOUT_S, PROBE_MAX_PEERS = 4 * 1024 * 1024, 10.0, 64


@dataclass
class ProbeConfig:
    """The probe mesh, asked only while a job-wide finding is open (monitor/evidence/probes.py,
    monitor/detect/network.py; docs/monitor.md, Network faults)."""

    enabled: bool = flag(True, "--no-probes",  # needs the ranks' token too (rank_exit_token)
                         "never ask the ranks to probe each other")
    size_bytes: int = flag(262144, "--probe-bytes", "bytes each probed link transfers")
    timeout_s: float = flag(1.0, "--probe-timeout", "seconds a rank waits for each peer")
    interval_s: float = flag(1.0, "--probe-interval",
                             "at most one probe round per this many seconds")
    # beyond peers + 1 hosts: a ring
    peers: int = flag(8, "--probe-peers", "peers each host's rank probes per round")
    rounds: int = flag(2, "--probe-rounds",
                       "consecutive rounds naming one host to confirm a network finding")
    slow_ratio: float = flag(0.25, "--probe-slow-ratio",
                             "a link below this fraction of the links' median is bad")
    workers: int = 32  # probe requests in flight at once

    def validate(self) -> None:
        _at_least(self, 0, "timeout_s", "interval_s", strict=True)
        _at_least(self, 1, "size_bytes", "peers", "rounds", "workers")
        # what a rank's POST /v1/probe accepts (worker_server/probe.py): beyond it, a 400
        for name, most in (("size_bytes", PROBE_MAX_BYTES), ("timeout_s", PROBE_MAX_TIMEOUT_S),
                           ("peers", PROBE_MAX_PEERS)):
            if getattr(self, name) > most:
                raise ConfigError(f"{_named(self, name)} must be <= {most:.0f} (what a rank accepts), "
                                  f"got {getattr(self, name)!r}")
        if not 0 < self.slow_ratio < 1:
            raise ConfigError(f"probe slow_ratio must be in (0, 1), got {self.slow_ratio}")


@dataclass
class QuarantineConfig:
    """The host ledger's policy (monitor/act/hosts.py, docs/quarantine.md)."""

    after: dict[str, int] = field(default_factory=lambda: dict(QUARANTINE_AFTER))
    window_s: float = flag(3600.0, "--quarantine-window",
                           "seconds within which offences count")
    ttl_s: float = flag(86400.0, "--quarantine-ttl",
                        "seconds a quarantine lasts before it is released")
    max_quarantined: float = flag(0.1, "--max-quarantined", "most hosts quarantined at once: a "
                                  "count (>= 1) or a fraction (< 1) of the known hosts")
    dry_run: bool = flag(False, "--quarantine-dry-run",
                         "decide and log quarantines, carry none out")
    actions: tuple[str, ...] = ()  # k8s, slurm, exec:CMD, webhook:URL
    action_timeout_s: float = flag(10.0, "--action-timeout", "seconds per action attempt")
    webhook_secret: str | None = None
    k8s_namespace: str | None = flag(None, "--k8s-namespace",
                                     "namespace of the job's pods (default: the monitor pod's)")
    k8s_pod_selector: str | None = flag(None, "--k8s-pod-selector",
                                        "label selector of the job's pods deleted from a "
                                        "quarantined node (app.kubernetes.io/component="
                                        "training,lightkeeper/job=<--job>)")

    def cap(self, known_hosts: int) -> int:
        if self.max_quarantined >= 1:
            return int(self.max_quarantined)
        return max(1, int(self.max_quarantined * known_hosts))

    def validate(self) -> None:
        bad = [k for k in self.after if k not in QUARANTINE_KINDS]
        if bad:
            raise ConfigError(f"--quarantine-after: unknown kind(s) {', '.join(bad)}; expected "
                              f"some of {', '.join(QUARANTINE_KINDS)}")
        for k, n in self.after.items():
            if not isinstance(n, int) or n < 0:
                raise ConfigError(f"--quarantine-after {k}={n!r}: expected a count >= 0 "
                                  "(0: never)")
        _at_least(self, 0, "window_s", "ttl_s", "action_timeout_s", strict=True)
        if self.max_quarantined <= 0 or (self.max_quarantined >= 1
                                         and self.max_quarantined != int(self.max_quarantined)):
            raise ConfigError("--max-quarantined: a whole count >= 1 or a fraction in (0, 1), "
                              f"got {self.max_quarantined!r}")
        for a in self.actions:  # the grammar: monitor.startup.check_config
            if a.startswith("webhook:") and not self.webhook_secret:
                raise ConfigError(f"--action {shown_action(a)}: a signing secret is required "
                                  "(--webhook-secret or LIGHTKEEPER_WEBHOOK_SECRET)")


def url_host_port(url: str) -> str:
    """``host[:port]`` of ``url``: what a webhook's name and errors show of it after its
    scheme (its path is often its secret)."""
    p = urlsplit(url)
    try:
        port = f":{p.port}" if p.port else ""
    except ValueError:  # a port that is no number, or out of range
        port = ""
    return f"{p.hostname or ''}{port}"


def shown_action(spec: str) -> str:
    """An ``--action`` as errors and logs show it: a webhook URL without its path (often its
    secret, as a Slack-style URL's is), an exec hook without its arguments (they may hold one)."""
    kind, _, arg = spec.partition(":")
    if "://" in spec and kind != "exec":  # a webhook, or a typo of one (webhooks:, Webhook:)
        before, _, rest = spec.partition("://")
        return f"{before}://{url_host_port('x://' + rest.strip())}..."
    if kind == "exec" and arg.split():
        words = arg.split()
        return f"exec:{words[0]}" + (" ..." if len(words) > 1 else "")
    return redact_url(spec) or spec


@dataclass
class BundleConfig:
    """Incident bundles: the evidence kept for the post-mortem (monitor/act/bundles.py,
    docs/monitor.md, Incident bundles)."""

    enabled: bool = flag(True, "--no-bundles", "keep no incident bundle (the ranks' stacks "
                         "and dumps before a kill)")
    dir: str | None = flag(None, "--bundle-dir",
                           "where bundles are kept (default: incidents/ beside --state)")
    timeout_s: float = flag(2.0, "--bundle-timeout",
                            "seconds a kill waits at most for the ranks' stacks and dumps")
    max_ranks: int = flag(32, "--bundle-ranks", "ranks asked per bundle: the culprit's group, "
                          "then its peers")
    max_bytes: int = flag(64 << 20, "--bundle-max-bytes", "one bundle's content before "
                          "compression; beyond, files are left out")
    total_bytes: int = flag(1 << 30, "--bundle-total-bytes",
                            "all bundles on disk; the oldest are deleted beyond")
    keep_s: float = flag(14 * 86400.0, "--bundle-keep",
                         "seconds a bundle is kept, 14 days by default")

    def directory(self, state_path: str) -> str | None:
        """Where bundles go (None: nowhere, an in-memory audit log and no --bundle-dir)."""
        if self.dir:
            return self.dir
        if state_path == ":memory:":
            return None
        return os.path.join(os.path.dirname(os.path.abspath(state_path)), "incidents")

    def validate(self) -> None:
        _at_least(self, 0, "timeout_s", "keep_s", strict=True)
        _at_least(self, 1, "max_ranks", "max_bytes", "total_bytes")
        if self.total_bytes < self.max_bytes:
            raise ConfigError(f"--bundle-total-bytes ({self.total_bytes}) must be >= "
                              f"--bundle-max-bytes ({self.max_bytes})")


@dataclass
class ShardConfig:
    """One monitor of several (monitor/shard.py, docs/scaling.md "Beyond one machine")."""

    shards: int  # N: the replica groups are split into N slices
    index: int | None  # the slice this monitor polls (None: a leader candidate only)
    etcd: str  # etcd client URL (its v3 JSON gateway)
    lead: bool = False  # campaign for the one leader, which applies the global rails
    etcd_prefix: str = flag("/lightkeeper", "--etcd-prefix",
                            "etcd key prefix; the job's keys are under PREFIX/<job>/")
    lease_ttl_s: int = flag(10, "--lease-ttl", "seconds of the leader's and shards' etcd leases")

    def validate(self, interval_s: float) -> None:
        if self.shards < 1:
            raise ConfigError(f"--shards must be >= 1, got {self.shards}")
        if self.index is not None and not 0 <= self.index < self.shards:
            raise ConfigError(f"--shard {self.index}/{self.shards}: the index must be in "
                              f"[0, {self.shards})")
        if self.index is None and not self.lead:
            raise ConfigError("--shards without --shard I/N or --lead: this monitor would do "
                              "nothing")
        if not is_http_url(self.etcd):
            raise ConfigError(f"--etcd: an http(s):// client URL is required with --shard/"
                              f"--lead, got {redact_url(self.etcd)!r}")
        if self.lease_ttl_s < 2 or self.lease_ttl_s < 2 * interval_s:
            raise ConfigError(f"--lease-ttl must be >= 2 s and >= 2 sweep intervals "
                              f"({2 * interval_s:g} s), got {self.lease_ttl_s}")


@dataclass
class MonitorConfig:
    lighthouse: str | None = None
    interval_s: float = flag(1.0, "--interval", "seconds between sweeps")
    bind: str = flag("127.0.0.1", "--bind", "address to serve the API on")
    # clear of the exporters' 9100-9999 (9400: NVIDIA DCGM)
    port: int = flag(19400, "--port", "API port; 0 = ephemeral")
    state_path: str = field(default_factory=lambda: os.path.join(os.getcwd(),
                                                                 "lightkeeper-monitor.sqlite"))
    job: str = "lightkeeper"
    targets: list[str] = field(default_factory=list)  # static host:port or URLs
    targets_file: str | None = flag(None, "--targets-file", "Prometheus file_sd JSON with "
                                    "WorkerServers; re-read when it changes")
    torch_stores: bool = flag(False, "--torch-stores", "also watch ranks that run only torch's "
                              "debug server (torch.distributed.debug.start_debug_server): found "
                              "through the TCPStore of every group the Lighthouse lists; needs "
                              "torch here (docs/torch_debug_server.md)")
    sd_out: str | None = None  # where the monitor writes the set it knows (file_sd JSON)
    forget_after_s: float = flag(30.0, "--forget-after", "forget a self-registered rank "
                                 "unreachable this many seconds")
    poll_timeout_s: float = flag(0.8, "--poll-timeout",
                                 "timeout of each /v1/state request, seconds")
    fr_timeout_s: float = flag(5.0, "--fr-timeout", "longest wait for a /v1/fr_trace answer, "
                               "seconds; a rank that answered before is given 4x its slowest "
                               "recent answer, at least 1 s")
    max_concurrency: int = 1024  # requests in flight at once
    token: str | None = None  # admin: POST /v1/evict, host release (and registration)
    register_token: str | None = None  # POST /v1/targets only: what every rank holds
    # registration without a token: hosts/networks allowed (None: loopback + static hosts)
    allow_targets: list[str] | None = None
    max_targets: int = flag(10_000, "--max-targets", "most targets the monitor knows; new "
                            "registrations beyond are refused (429)")
    max_state_bytes: int = flag(1 << 20, "--max-state-bytes",
                                "largest /v1/state answer read from a rank, bytes")
    max_fr_bytes: int = flag(64 << 20, "--max-fr-bytes",
                             "largest whole /v1/fr_trace dump read from a rank, bytes (an "
                             "answer to ?last=N: at most 1 MiB + 4 KiB a replica group + N x 32 KiB)")
    lighthouse_timeout_s: float = 2.0  # reading the Lighthouse's status page
    # as the operator declares them (None: not stated): the slow-recovery warning only
    lighthouse_heartbeat_timeout_ms: int | None = None
    lighthouse_join_timeout_ms: int | None = None
    kill_timeout_s: float = 5.0
    confirm_timeout_s: float = 60.0  # an eviction not seen leaving the quorum by then: unconfirmed
    # the kill reaches group rank 0 only: the rest of the group is told to exit (POST /v1/exit)
    # ``orphan_grace_s`` later with this token, else reported
    rank_exit_token: str | None = None
    rank_auth: str = "hmac"  # --rank-auth (RANK_AUTH): signed calls, or the deprecated bearer
    orphan_grace_s: float = flag(3.0, "--orphan-grace", "seconds after a kill before the "
                                 "group's remaining ranks are told to exit or reported")
    # with that token too (monitor/act/survivors.py)
    abort_survivors: bool = flag(True, "--no-abort-survivors", "never tell ranks blocked with "
                                 "a group gone from the quorum to abort")
    expected_groups: int | None = None  # goodput ledger's capacity (None: groups ever seen)
    # the large-scale modes and the sizes they start at (docs/scaling.md)
    leader_polling: str = "auto"
    member_interval_s: float = flag(10.0, "--member-interval", "leader polling: seconds "
                                    "between polls of a non-leader rank")
    leader_polling_min_ranks: int = 2000
    poll_process_min_targets: int = 50_000  # the poller in its own process, asking ahead
    gc_freeze_min_targets: int = 10_000  # no cyclic GC during a sweep; survivors frozen
    detectors: DetectorConfig = field(default_factory=DetectorConfig)
    rails: RailsConfig = field(default_factory=RailsConfig)
    probes: ProbeConfig = field(default_factory=ProbeConfig)
    quarantine: QuarantineConfig = field(default_factory=QuarantineConfig)
    bundles: BundleConfig = field(default_factory=BundleConfig)
    shard: ShardConfig | None = None  # one of several monitors (monitor/shard.py)

    def forget_after_warning(self) -> str | None:
        """Why ``forget_after_s`` forgets a dead self-registered rank before it can be found dead,
        else None; a warning, not an error (tests that sweep by hand set a short one)."""
        takes = self.detectors.dead_sweeps * self.interval_s
        if self.forget_after_s > takes:
            return None
        return (f"--forget-after {self.forget_after_s:g}s is not above --dead-sweeps "
                f"{self.detectors.dead_sweeps} x --interval {self.interval_s:g}s: a "
                "self-registered rank that dies is forgotten before it can be found dead")

    def validate(self) -> None:
        _at_least(self, 0, "interval_s", "poll_timeout_s", "fr_timeout_s", "lighthouse_timeout_s",
                  "member_interval_s", "forget_after_s", strict=True)
        _at_least(self, 1, "max_concurrency", "max_targets", "max_state_bytes", "max_fr_bytes",
                  "lighthouse_heartbeat_timeout_ms", "lighthouse_join_timeout_ms")
        _at_least(self, 0, "leader_polling_min_ranks", "poll_process_min_targets",
                  "gc_freeze_min_targets", "orphan_grace_s")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if self.rank_auth not in RANK_AUTH:
            raise ConfigError(f"--rank-auth must be one of {', '.join(RANK_AUTH)}, got "
                              f"{self.rank_auth!r}")
        if self.leader_polling not in ("auto", "on", "off"):
            raise ConfigError(f"leader_polling must be auto, on or off, got "
                              f"{self.leader_polling!r}")
        self.detectors.validate()
        self.rails.validate()
        self.probes.validate()
        self.quarantine.validate()
        self.bundles.validate()
        # the k8s sink selects the job's pods by the label lightkeeper/job=<job>
        if ({"k8s", "kubernetes"} & set(self.quarantine.actions)
                and not self.quarantine.k8s_pod_selector
                and not LABEL_VALUE.fullmatch(self.job)):
            raise ConfigError(f"--job {self.job!r}: --action k8s needs a Kubernetes label value "
                              "(at most 63 of A-Z a-z 0-9 - _ ., first and last a letter or "
                              "digit), the job's pods' lightkeeper/job; or give "
                              "--k8s-pod-selector")
        if self.torch_stores and not self.lighthouse:
            raise ConfigError("--torch-stores needs --lighthouse: each group's TCPStore address "
                              "is read from the Lighthouse's status page")
        if self.shard is not None:
            self.shard.validate(self.interval_s)
            if self.shard.lead and not self.lighthouse:
                raise ConfigError("--lead needs --lighthouse: the leader verifies the quorum "
                                  "there and sends the kills")
