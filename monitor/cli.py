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
from collections.abc import Callable
from dataclasses import fields
from typing import Any

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


def _flag(g: Any, flag: str, cls: type, field: str, help: str, dest: str = "",
          kind: Callable[[str], Any] | None = None) -> None:
    """``flag`` for ``cls``'s ``field`` (``dest``: where config_from_args finds it), with the
    field's default, shown in the help."""
    default = getattr(cls, field)
    g.add_argument(flag, dest=dest or field, type=kind or type(default), default=default,
                   metavar=flag[2:].replace("-", "_").upper(), help=f"{help} (%(default)s)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    c, d, r, qd = MonitorConfig, DetectorConfig, RailsConfig, QuarantineConfig
    p.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"),
                   help="torchft Lighthouse URL used for evictions (env TORCHFT_LIGHTHOUSE); "
                        "without it the monitor only reports")
    _flag(p, "--interval", c, "interval_s", "seconds between sweeps")
    _flag(p, "--bind", c, "bind", "address to serve the API on")
    _flag(p, "--port", c, "port", "API port; 0 = ephemeral")
    p.add_argument("--dry-run", dest="rails_dry_run", action="store_true",
                   help="detect and report, never evict")
    _flag(p, "--min-replicas", r, "min_replicas",
          "never evict below this many replica groups in the quorum", "rails_min_replicas")
    _flag(p, "--cooldown", r, "cooldown_s", "at most one eviction per this many seconds",
          "rails_cooldown_s")
    _flag(p, "--min-reachable", r, "min_reachable_fraction", "hold evictions unless the monitor "
          "reaches more than this fraction of the ranks it knows", "rails_min_reachable_fraction")
    p.add_argument("--evict-on", dest="rails_evict_kinds", metavar="KINDS", type=_csv, default=r.evict_kinds,
                   help=f"finding kinds that evict, comma separated, of "
                        f"{','.join(EVICTABLE_KINDS)} ({','.join(r.evict_kinds)})")
    p.add_argument("--state", dest="state_path", default=c().state_path,
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
    _flag(p, "--forget-after", c, "forget_after_s",
          "forget a self-registered rank unreachable this many seconds")
    _flag(p, "--poll-timeout", c, "poll_timeout_s", "timeout of each /v1/state request, seconds")
    _flag(p, "--fr-timeout", c, "fr_timeout_s", "timeout of each /v1/fr_trace request, seconds")
    p.add_argument("--token", help="admin bearer token for POST /v1/evict and host release "
                                   "(env LIGHTKEEPER_TOKEN); without one they are disabled")
    p.add_argument("--register-token", help="bearer token that admits POST /v1/targets only, "
                                            "the one ranks hold (env LIGHTKEEPER_REGISTER_TOKEN)")
    p.add_argument("--allow-targets", type=_csv,
                   help="without a token, who may register: CIDRs, IPs, host names or patterns "
                        "(default: loopback and the hosts of --targets)")
    _flag(p, "--max-targets", c, "max_targets",
          "most targets the monitor knows; new registrations beyond are refused")
    _flag(p, "--max-state-bytes", c, "max_state_bytes",
          "largest /v1/state answer read from a rank, bytes")
    _flag(p, "--max-fr-bytes", c, "max_fr_bytes",
          "largest /v1/fr_trace answer read from a rank, bytes")
    g = p.add_argument_group("detector thresholds")
    _flag(g, "--straggler-min-lag", d, "straggler_min_lag_s",
          "seconds a group must arrive after its peers")
    _flag(g, "--straggler-rel-lag", d, "straggler_rel_lag",
          "... and at least this fraction of the median step time")
    _flag(g, "--straggler-steps", d, "straggler_steps",
          "newest steps per straggler window, waited for in 3 of 4")
    _flag(g, "--straggler-windows", d, "straggler_windows",
          "consecutive windows to confirm a straggler")
    _flag(g, "--hang-floor", d, "hang_floor_s", "minimum seconds without progress before a hang")
    _flag(g, "--hang-factor", d, "hang_factor", "... or this many median step times if longer")
    _flag(g, "--dead-sweeps", d, "dead_sweeps", "unreachable sweeps before a rank is dead")
    _flag(g, "--starting-timeout", d, "starting_timeout_s", "seconds a rank may answer without "
          "a first quorum before it is stuck_starting")
    _flag(g, "--fr-interval", d, "fr_interval_s",
          "fetch Flight Recorder from every rank at least this often, seconds")
    _flag(g, "--job-slow-factor", d, "job_slow_factor", "job_slow: the job's median step above "
          "this many times its healthy baseline with no group late")
    _flag(g, "--job-slow-windows", d, "job_slow_windows",
          "... in this many consecutive straggler windows")
    _flag(g, "--job-baseline-windows", d, "job_baseline_windows",
          "healthy windows seen before job_slow is judged")
    p.add_argument("--leader-polling", choices=("auto", "on", "off"), default=c.leader_polling,
                   help="poll each group's rank 0 every sweep, the others every --member-interval"
                        f" (auto: from {c.leader_polling_min_ranks:,} targets; docs/scaling.md)")
    _flag(p, "--member-interval", c, "member_interval_s",
          "leader polling: seconds between polls of a non-leader rank")
    p.add_argument("--rank-exit-token",
                   help="the ranks' bearer token (env LIGHTKEEPER_EXIT_TOKEN): an evicted group's "
                        "other ranks are told to exit, survivors to abort; without it, reported")
    p.add_argument("--no-abort-survivors", dest="abort_survivors", action="store_false",
                   help="never tell ranks blocked with a group gone from the quorum to abort")
    _flag(p, "--orphan-grace", c, "orphan_grace_s", "seconds after a kill before the group's "
          "remaining ranks are told to exit or reported")
    p.add_argument("--lighthouse-heartbeat-timeout-ms", type=_positive_int,
                   help="the Lighthouse's heartbeat_timeout_ms, if known (docs/lighthouse.md)")
    p.add_argument("--lighthouse-join-timeout-ms", type=_positive_int,
                   help="the Lighthouse's join_timeout_ms, if known (docs/lighthouse.md)")
    p.add_argument("--expected-groups", type=_positive_int,
                   help="replica groups the job should run with: the goodput ledger's "
                        "capacity (default: the number of replica groups ever seen)")
    pr, pd = p.add_argument_group("network probes (docs/monitor.md, Network faults)"), ProbeConfig
    pr.add_argument("--no-probes", dest="probe_enabled", action="store_false",
                    help="never ask the ranks to probe each other")
    _flag(pr, "--probe-bytes", pd, "size_bytes", "bytes each probed link transfers",
          "probe_size_bytes", _positive_int)
    _flag(pr, "--probe-timeout", pd, "timeout_s", "seconds a rank waits for each peer",
          "probe_timeout_s")
    _flag(pr, "--probe-interval", pd, "interval_s", "at most one probe round per this many "
          "seconds", "probe_interval_s")
    _flag(pr, "--probe-peers", pd, "peers", "peers each host's rank probes per round",
          "probe_peers", _positive_int)
    _flag(pr, "--probe-rounds", pd, "rounds", "rounds naming one host to confirm a network "
          "finding", "probe_rounds", _positive_int)
    _flag(pr, "--probe-slow-ratio", pd, "slow_ratio", "a link below this fraction of the links' "
          "median is bad", "probe_slow_ratio")
    q = p.add_argument_group("host quarantine (docs/quarantine.md)")
    q.add_argument("--quarantine-after", type=_kind_counts, default={},
                   help="quarantine a host after N confirmed findings of a kind within the "
                        "window, kind=N[,kind=N] (0: never), merged over the defaults "
                        f"{','.join(f'{k}={n}' for k, n in QUARANTINE_AFTER.items())}")
    _flag(q, "--quarantine-window", qd, "window_s", "seconds within which offences count",
          "quarantine_window_s")
    _flag(q, "--quarantine-ttl", qd, "ttl_s", "seconds a quarantine lasts before it is released",
          "quarantine_ttl_s")
    _flag(q, "--max-quarantined", qd, "max_quarantined",
          "most hosts quarantined at once: a count or a fraction", "quarantine_max_quarantined")
    q.add_argument("--quarantine-dry-run", action="store_true",
                   help="decide and log quarantines, carry none out")
    q.add_argument("--action", dest="quarantine_actions", metavar="ACTION", action="append",
                   default=[],
                   help="carry out quarantines and releases: k8s, slurm, exec:CMD or "
                        "webhook:URL (repeatable; none: the ledger only)")
    _flag(q, "--action-timeout", qd, "action_timeout_s", "seconds per action attempt",
          "quarantine_action_timeout_s")
    q.add_argument("--webhook-secret",
                   help="HMAC-SHA256 key of webhook signatures (env LIGHTKEEPER_WEBHOOK_SECRET)")
    q.add_argument("--k8s-namespace", dest="quarantine_k8s_namespace", metavar="NAMESPACE",
                   help="namespace of the job's pods (default: the monitor pod's own)")
    q.add_argument("--k8s-pod-selector", dest="quarantine_k8s_pod_selector", metavar="SELECTOR",
                   help="label selector of the job's pods deleted from a quarantined node "
                        "(app.kubernetes.io/component=training)")
    b, bd = p.add_argument_group("incident bundles (docs/monitor.md, Incident bundles)"), \
        BundleConfig
    b.add_argument("--no-bundles", dest="bundle_enabled", action="store_false",
                   help="keep no incident bundle (the ranks' stacks and dumps before a kill)")
    b.add_argument("--bundle-dir", dest="bundle_dir",
                   help="where bundles are kept (default: incidents/ beside --state)")
    _flag(b, "--bundle-timeout", bd, "timeout_s",
          "seconds a kill waits at most for the ranks' evidence", "bundle_timeout_s")
    _flag(b, "--bundle-ranks", bd, "max_ranks", "ranks asked per bundle: the culprit's group, "
          "then its peers", "bundle_max_ranks", _positive_int)
    _flag(b, "--bundle-max-bytes", bd, "max_bytes", "one bundle's content before compression; "
          "beyond, files are left out", "bundle_max_bytes", _positive_int)
    _flag(b, "--bundle-total-bytes", bd, "total_bytes",
          "all bundles on disk; the oldest are deleted beyond", "bundle_total_bytes",
          _positive_int)
    _flag(b, "--bundle-keep", bd, "keep_s", "seconds a bundle is kept, 14 days:",
          "bundle_keep_s")
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
    _flag(sh, "--etcd-prefix", ShardConfig, "etcd_prefix",
          "etcd key prefix; the job's keys are under PREFIX/<job>/")
    _flag(sh, "--lease-ttl", ShardConfig, "lease_ttl_s",
          "seconds of the leader's and shards' etcd leases", kind=_positive_int)
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
                       etcd_prefix=args.etcd_prefix, lease_ttl_s=args.lease_ttl_s)


def _env(value: str | None, name: str) -> str | None:
    return value or os.environ.get(name) or None


def _section(cls: type, given: dict[str, Any], prefix: str = "", **override: Any) -> Any:
    """``cls`` from the flags whose dest is ``prefix`` and one of its fields, then
    ``override``."""
    return cls(**{**{f.name: given[prefix + f.name] for f in fields(cls)
                     if prefix + f.name in given}, **override})


def config_from_args(args: argparse.Namespace) -> MonitorConfig:
    """The config the flags describe (a flag's ``dest`` names its field); raises
    ConfigError."""
    given = vars(args)
    cfg = _section(
        MonitorConfig, given, targets=list(args.targets), shard=_shard_config(args),
        sd_out=args.sd_out or os.path.join(os.path.dirname(os.path.abspath(args.state_path)),
                                           "lightkeeper-targets.json"),
        token=_env(args.token, "LIGHTKEEPER_TOKEN"),
        register_token=_env(args.register_token, "LIGHTKEEPER_REGISTER_TOKEN"),
        rank_exit_token=_env(args.rank_exit_token, "LIGHTKEEPER_EXIT_TOKEN"),
        detectors=_section(DetectorConfig, given),
        rails=_section(RailsConfig, given, "rails_",
                       evict_kinds=tuple(args.rails_evict_kinds)),
        probes=_section(ProbeConfig, given, "probe_"),
        quarantine=_section(
            QuarantineConfig, given, "quarantine_",
            after={**QUARANTINE_AFTER, **args.quarantine_after},
            actions=tuple(args.quarantine_actions),
            webhook_secret=_env(args.webhook_secret, "LIGHTKEEPER_WEBHOOK_SECRET")),
        bundles=_section(BundleConfig, given, "bundle_"))
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
