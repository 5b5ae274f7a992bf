"""``lightkeeper monitor``: poll every rank, detect bad replica groups, evict them.

Every flag is documented in docs/monitor.md; a flag's ``dest`` is the config field it sets. The
monitor serves its API on ``--bind``/``--port`` and sweeps every ``--interval`` seconds until
SIGINT/SIGTERM. A bad flag value exits with status 2 and a message naming it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from dataclasses import fields

from .config import (
    EVICTABLE_KINDS,
    QUARANTINE_AFTER,
    BundleConfig,
    ConfigError,
    DetectorConfig,
    MonitorConfig,
    ProbeConfig,
    QuarantineConfig,
    RailsConfig,
    ShardConfig,
)
from .poll.admission import token_warning


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _kind_counts(value: str) -> dict[str, int]:
    """``hang=1,straggler=2`` -> {"hang": 1, "straggler": 2} (kinds checked by the config)."""
    out = {}
    for part in _csv(value):
        k, sep, n = part.partition("=")
        try:
            out[k.strip()] = int(n)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected kind=N[,kind=N], got {part!r}") from None
        if not sep or not k.strip():
            raise argparse.ArgumentTypeError(f"expected kind=N[,kind=N], got {part!r}")
    return out


def _shard(value: str) -> tuple[int, int]:
    """``I/N`` -> (I, N)."""
    i, sep, n = value.partition("/")
    try:
        out = int(i), int(n)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N (e.g. 0/4), got {value!r}") from None
    if not sep or out[1] < 1 or not 0 <= out[0] < out[1]:
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N, got {value!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    c, d, r, qd = MonitorConfig, DetectorConfig(), RailsConfig(), QuarantineConfig()
    p.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"),
                   help="torchft Lighthouse URL used for evictions (env TORCHFT_LIGHTHOUSE); "
                        "without it the monitor only reports")
    p.add_argument("--interval", dest="interval_s", type=float, default=c.interval_s,
                   help="seconds between sweeps (%(default)s)")
    p.add_argument("--bind", default=c.bind, help="address to serve the API on (%(default)s)")
    p.add_argument("--port", type=int, default=c.port, help="API port; 0 = ephemeral (%(default)s)")
    p.add_argument("--dry-run", action="store_true", help="detect and report, never evict")
    p.add_argument("--min-replicas", type=int, default=r.min_replicas,
                   help="never evict below this many replica groups in the quorum (%(default)s)")
    p.add_argument("--cooldown", type=float, default=r.cooldown_s,
                   help="at most one eviction per this many seconds (%(default)s)")
    p.add_argument("--min-reachable", type=float, default=r.min_reachable_fraction,
                   help="hold evictions unless the monitor reaches more than this fraction of "
                        "the ranks it knows (%(default)s)")
    p.add_argument("--evict-on", type=_csv, default=list(r.evict_kinds),
                   help=f"finding kinds that evict, comma separated, of "
                        f"{','.join(EVICTABLE_KINDS)} ({','.join(r.evict_kinds)})")
    p.add_argument("--state", dest="state_path",
                   default=os.path.join(os.getcwd(), "lightkeeper-monitor.sqlite"),
                   help="SQLite audit log (./lightkeeper-monitor.sqlite)")
    p.add_argument("--job", default=os.environ.get("LIGHTKEEPER_JOB", c.job),
                   help="training job name for metric labels (env LIGHTKEEPER_JOB)")
    p.add_argument("--targets", type=_csv, default=[],
                   help="static WorkerServers, host:port[,host:port...]; torch+http://host:port "
                        "names a rank served by torch's own debug server")
    p.add_argument("--torch-stores", action="store_true",
                   help="also watch ranks that run only torch's debug server "
                        "(torch.distributed.debug.start_debug_server): found through the "
                        "TCPStore of every group the Lighthouse lists; needs torch here "
                        "(docs/torch_debug_server.md)")
    p.add_argument("--targets-file",
                   help="Prometheus file_sd JSON with WorkerServers; re-read when it changes")
    p.add_argument("--sd-out", help="write the targets the monitor knows to this file_sd JSON "
                                    "for Prometheus (default: next to --state)")
    p.add_argument("--forget-after", dest="forget_after_s", type=float, default=c.forget_after_s,
                   help="forget a self-registered rank unreachable this many seconds "
                        "(%(default)s)")
    p.add_argument("--poll-timeout", dest="poll_timeout_s", type=float, default=c.poll_timeout_s,
                   help="timeout of each /v1/state request, seconds (%(default)s)")
    p.add_argument("--fr-timeout", dest="fr_timeout_s", type=float, default=c.fr_timeout_s,
                   help="timeout of each /v1/fr_trace request, seconds (%(default)s)")
    p.add_argument("--token", help="admin bearer token for POST /v1/evict and host release "
                                   "(env LIGHTKEEPER_TOKEN); without one they are disabled")
    p.add_argument("--register-token", help="bearer token that admits POST /v1/targets only, "
                                            "the one ranks hold (env LIGHTKEEPER_REGISTER_TOKEN)")
    p.add_argument("--allow-targets", type=_csv,
                   help="without a token, who may register: CIDRs, IPs, host names or patterns "
                        "(default: loopback and the hosts of --targets)")
    p.add_argument("--max-targets", type=int, default=c.max_targets,
                   help="most targets the monitor knows; new registrations beyond are refused "
                        "(%(default)s)")
    p.add_argument("--max-state-bytes", type=int, default=c.max_state_bytes,
                   help="largest /v1/state answer read from a rank, bytes (%(default)s)")
    p.add_argument("--max-fr-bytes", type=int, default=c.max_fr_bytes,
                   help="largest /v1/fr_trace answer read from a rank, bytes (%(default)s)")
    g = p.add_argument_group("detector thresholds")  # dest: the DetectorConfig field
    g.add_argument("--straggler-min-lag", dest="straggler_min_lag_s", type=float,
                   default=d.straggler_min_lag_s,
                   help="seconds a group must arrive after its peers (%(default)s)")
    g.add_argument("--straggler-rel-lag", type=float, default=d.straggler_rel_lag,
                   help="... and at least this fraction of the median step time (%(default)s)")
    g.add_argument("--straggler-steps", type=int, default=d.straggler_steps,
                   help="newest steps per straggler window, waited for in 3 of 4 (%(default)s)")
    g.add_argument("--straggler-windows", type=int, default=d.straggler_windows,
                   help="consecutive windows to confirm a straggler (%(default)s)")
    g.add_argument("--hang-floor", dest="hang_floor_s", type=float, default=d.hang_floor_s,
                   help="minimum seconds without progress before a hang (%(default)s)")
    g.add_argument("--hang-factor", type=float, default=d.hang_factor,
                   help="... or this many median step times if longer (%(default)s)")
    g.add_argument("--dead-sweeps", type=int, default=d.dead_sweeps,
                   help="unreachable sweeps before a rank is dead (%(default)s)")
    g.add_argument("--starting-timeout", dest="starting_timeout_s", type=float,
                   default=d.starting_timeout_s,
                   help="seconds a rank may answer without a first quorum before it is "
                        "stuck_starting (%(default)s)")
    g.add_argument("--fr-interval", dest="fr_interval_s", type=float, default=d.fr_interval_s,
                   help="fetch Flight Recorder from every rank at least this often, seconds "
                        "(%(default)s)")
    g.add_argument("--job-slow-factor", type=float, default=d.job_slow_factor,
                   help="job_slow: the job's median step above this many times its healthy "
                        "baseline with no group late (%(default)s)")
    g.add_argument("--job-slow-windows", type=int, default=d.job_slow_windows,
                   help="... in this many consecutive straggler windows (%(default)s)")
    g.add_argument("--job-baseline-windows", type=int, default=d.job_baseline_windows,
                   help="healthy windows seen before job_slow is judged (%(default)s)")
    p.add_argument("--leader-polling", choices=("auto", "on", "off"), default=c.leader_polling,
                   help="poll each group's rank 0 every sweep, the others every --member-interval"
                        f" (auto: from {c.leader_polling_min_ranks:,} targets; docs/scaling.md)")
    p.add_argument("--member-interval", dest="member_interval_s", type=float,
                   default=c.member_interval_s,
                   help="leader polling: seconds between polls of a non-leader rank "
                        "(%(default)s)")
    p.add_argument("--rank-exit-token",
                   help="the ranks' bearer token (env LIGHTKEEPER_EXIT_TOKEN): an evicted group's "
                        "other ranks are told to exit, survivors to abort; without it, reported")
    p.add_argument("--no-abort-survivors", dest="abort_survivors", action="store_false",
                   help="never tell ranks blocked with a group gone from the quorum to abort")
    p.add_argument("--orphan-grace", dest="orphan_grace_s", type=float, default=c.orphan_grace_s,
                   help="seconds after a kill before the group's remaining ranks are told to "
                        "exit or reported (%(default)s)")
    p.add_argument("--lighthouse-heartbeat-timeout-ms", type=_positive_int,
                   help="the Lighthouse's heartbeat_timeout_ms, if known (docs/lighthouse.md)")
    p.add_argument("--lighthouse-join-timeout-ms", type=_positive_int,
                   help="the Lighthouse's join_timeout_ms, if known (docs/lighthouse.md)")
    p.add_argument("--expected-groups", type=_positive_int,
                   help="replica groups the job should run with: the goodput ledger's "
                        "capacity (default: the number of replica groups ever seen)")
    pr, pd = p.add_argument_group("network probes (docs/monitor.md, Network faults)"), ProbeConfig()
    pr.add_argument("--no-probes", dest="probe_enabled", action="store_false",
                    help="never ask the ranks to probe each other")
    pr.add_argument("--probe-bytes", dest="probe_size_bytes", type=_positive_int,
                    default=pd.size_bytes,
                    help="bytes each probed link transfers (%(default)s)")
    pr.add_argument("--probe-timeout", dest="probe_timeout_s", type=float, default=pd.timeout_s,
                    help="seconds a rank waits for each peer (%(default)s)")
    pr.add_argument("--probe-interval", dest="probe_interval_s", type=float,
                    default=pd.interval_s,
                    help="at most one probe round per this many seconds (%(default)s)")
    pr.add_argument("--probe-peers", type=_positive_int, default=pd.peers,
                    help="peers each host's rank probes per round (%(default)s)")
    pr.add_argument("--probe-rounds", type=_positive_int, default=pd.rounds,
                    help="rounds naming one host to confirm a network finding (%(default)s)")
    pr.add_argument("--probe-slow-ratio", type=float, default=pd.slow_ratio,
                    help="a link below this fraction of the links' median is bad (%(default)s)")
    q = p.add_argument_group("host quarantine (docs/quarantine.md)")
    q.add_argument("--quarantine-after", type=_kind_counts, default={},
                   help="quarantine a host after N confirmed findings of a kind within the "
                        "window, kind=N[,kind=N] (0: never), merged over the defaults "
                        f"{','.join(f'{k}={n}' for k, n in QUARANTINE_AFTER.items())}")
    q.add_argument("--quarantine-window", type=float, default=qd.window_s,
                   help="seconds within which offences count (%(default)s)")
    q.add_argument("--quarantine-ttl", type=float, default=qd.ttl_s,
                   help="seconds a quarantine lasts before it is released (%(default)s)")
    q.add_argument("--max-quarantined", type=float, default=qd.max_quarantined,
                   help="most hosts quarantined at once: a count or a fraction (%(default)s)")
    q.add_argument("--quarantine-dry-run", action="store_true",
                   help="decide and log quarantines, carry none out")
    q.add_argument("--action", dest="actions", action="append", default=[],
                   help="carry out quarantines and releases: k8s, slurm, exec:CMD or "
                        "webhook:URL (repeatable; none: the ledger only)")
    q.add_argument("--action-timeout", type=float, default=qd.action_timeout_s,
                   help="seconds per action attempt (%(default)s)")
    q.add_argument("--webhook-secret",
                   help="HMAC-SHA256 key of webhook signatures (env LIGHTKEEPER_WEBHOOK_SECRET)")
    q.add_argument("--k8s-namespace",
                   help="namespace of the job's pods (default: the monitor pod's own)")
    q.add_argument("--k8s-pod-selector",
                   help="label selector of the job's pods deleted from a quarantined node "
                        "(app.kubernetes.io/component=training)")
    b, bd = p.add_argument_group("incident bundles (docs/monitor.md, Incident bundles)"), \
        BundleConfig()
    b.add_argument("--no-bundles", dest="bundle_enabled", action="store_false",
                   help="keep no incident bundle (the ranks' stacks and dumps before a kill)")
    b.add_argument("--bundle-dir", dest="bundle_dir",
                   help="where bundles are kept (default: incidents/ beside --state)")
    b.add_argument("--bundle-timeout", dest="bundle_timeout_s", type=float,
                   default=bd.timeout_s,
                   help="seconds a kill waits at most for the ranks' evidence (%(default)s)")
    b.add_argument("--bundle-ranks", dest="bundle_max_ranks", type=_positive_int,
                   default=bd.max_ranks,
                   help="ranks asked per bundle: the culprit's group, then its peers "
                        "(%(default)s)")
    b.add_argument("--bundle-max-bytes", dest="bundle_max_bytes", type=_positive_int,
                   default=bd.max_bytes,
                   help="one bundle's content before compression; beyond, files are left out "
                        "(%(default)s)")
    b.add_argument("--bundle-total-bytes", dest="bundle_total_bytes", type=_positive_int,
                   default=bd.total_bytes,
                   help="all bundles on disk; the oldest are deleted beyond (%(default)s)")
    b.add_argument("--bundle-keep", dest="bundle_keep_s", type=float, default=bd.keep_s,
                   help="seconds a bundle is kept (%(default)s: 14 days)")
    sh = p.add_argument_group("several monitors (docs/scaling.md, Beyond one machine)")
    sh.add_argument("--shard", type=_shard, metavar="I/N",
                    help="poll only slice I of N of the replica groups; propose their evictions "
                         "to the leader in etcd")
    sh.add_argument("--shards", type=_positive_int, metavar="N",
                    help="the slice count, for a leader candidate that owns no slice (--lead)")
    sh.add_argument("--lead", action="store_true",
                    help="campaign for the leader, which applies the global rails and kills")
    sh.add_argument("--etcd", default=os.environ.get("LIGHTKEEPER_ETCD"),
                    help="etcd client URL, http://host:2379 (env LIGHTKEEPER_ETCD)")
    sh.add_argument("--etcd-prefix", default="/lightkeeper",
                    help="etcd key prefix; the job's keys are under PREFIX/<job>/ (%(default)s)")
    sh.add_argument("--lease-ttl", type=_positive_int, default=10,
                    help="seconds of the leader's and shards' etcd leases (%(default)s)")
    p.add_argument("--log-level", default="INFO", help="logging level (%(default)s)")


def _shard_config(args: argparse.Namespace) -> ShardConfig | None:
    if args.shard is None and args.shards is None and not args.lead:
        return None
    index, n = args.shard if args.shard is not None else (None, args.shards)
    if args.shard is not None and args.shards is not None and args.shards != n:
        raise ConfigError(f"--shard {index}/{n} and --shards {args.shards} disagree")
    if n is None:
        raise ConfigError("--lead needs --shards N (or --shard I/N): the leader waits for every "
                          "shard's report")
    return ShardConfig(shards=n, index=index, etcd=args.etcd or "", lead=args.lead,
                       etcd_prefix=args.etcd_prefix, lease_ttl_s=args.lease_ttl)


def _env(value: str | None, name: str) -> str | None:
    return value or os.environ.get(name) or None


def config_from_args(args: argparse.Namespace) -> MonitorConfig:
    """The config the flags describe (every flag whose ``dest`` is a field, then the rest);
    raises ConfigError."""
    given = vars(args)
    top = {f.name: given[f.name] for f in fields(MonitorConfig) if f.name in given}
    top.update(
        targets=list(args.targets), shard=_shard_config(args),
        sd_out=args.sd_out or os.path.join(os.path.dirname(os.path.abspath(args.state_path)),
                                           "lightkeeper-targets.json"),
        token=_env(args.token, "LIGHTKEEPER_TOKEN"),
        register_token=_env(args.register_token, "LIGHTKEEPER_REGISTER_TOKEN"),
        rank_exit_token=_env(args.rank_exit_token, "LIGHTKEEPER_EXIT_TOKEN"))
    cfg = MonitorConfig(
        **top,
        detectors=DetectorConfig(**{f.name: given[f.name] for f in fields(DetectorConfig)}),
        rails=RailsConfig(min_replicas=args.min_replicas, cooldown_s=args.cooldown,
                          min_reachable_fraction=args.min_reachable, dry_run=args.dry_run,
                          evict_kinds=tuple(args.evict_on)),
        probes=ProbeConfig(**{f.name: given[f"probe_{f.name}"] for f in fields(ProbeConfig)
                              if f"probe_{f.name}" in given}),
        quarantine=QuarantineConfig(
            after={**QUARANTINE_AFTER, **args.quarantine_after},
            window_s=args.quarantine_window, ttl_s=args.quarantine_ttl,
            max_quarantined=args.max_quarantined, dry_run=args.quarantine_dry_run,
            actions=tuple(args.actions), action_timeout_s=args.action_timeout,
            webhook_secret=_env(args.webhook_secret, "LIGHTKEEPER_WEBHOOK_SECRET"),
            k8s_namespace=args.k8s_namespace, k8s_pod_selector=args.k8s_pod_selector),
        bundles=BundleConfig(**{f.name: given[f"bundle_{f.name}"] for f in fields(BundleConfig)
                                if f"bundle_{f.name}" in given}))
    from .service import check_config  # the loop's modules only once a monitor is built
    check_config(cfg)
    return cfg


def warn_about_tokens(cfg: MonitorConfig) -> None:
    """Say once, at start-up, when the ranks must hold the admin token to register."""
    if warning := token_warning(cfg.register_token, cfg.token):
        logging.getLogger(__name__).warning(warning)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, str(args.log_level).upper(),
                                                          logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        print(f"lightkeeper monitor: {e}", file=sys.stderr)
        return 2
    from .service import Monitor

    warn_about_tokens(cfg)
    try:
        monitor = Monitor(cfg).start()
    except ConfigError as e:  # e.g. --action k8s without lightkube or a cluster configuration
        print(f"lightkeeper monitor: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"lightkeeper monitor: cannot serve on {cfg.bind}:{cfg.port}: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"[lightkeeper] monitor={monitor.url} state={cfg.state_path} sd_out={cfg.sd_out} "
          f"lighthouse={cfg.lighthouse} dry_run={cfg.rails.dry_run}", flush=True)
    try:
        stop.wait()
    finally:
        monitor.stop()
    return 0
