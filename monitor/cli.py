"""``lightkeeper monitor``: poll every rank, detect bad replica groups, evict them.

Every flag is documented in docs/monitor.md; a flag's ``dest`` is the config field it sets. The
monitor serves its API on ``--bind``/``--port`` and sweeps every ``--interval`` seconds until
SIGINT/SIGTERM. A bad flag value exits with status 2 and a message naming it.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import socket
import sqlite3
import sys
import threading
import time
from dataclasses import fields
from typing import Any
from urllib.parse import urlsplit

from http_serving import host_for_url, http_url, on_command_line, printable, redact_url

from .config import (
    EVICTABLE_KINDS,
    QUARANTINE_AFTER,
    RANK_AUTH,
    BundleConfig,
    ConfigError,
    DetectorConfig,
    MonitorConfig,
    ProbeConfig,
    QuarantineConfig,
    RailsConfig,
    ShardConfig,
)
from .locks import StateInUse
from .poll.admission import token_warning
from .store import StateTooNew

log = logging.getLogger(__name__)


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


MAX_FLOAT = 1e8  # ~3 years: a longer wait overflows the sweep loop's timed waits


def _finite(value: str) -> float:
    """A float flag: finite (nan passes every bound check, inf overflows a count) and within
    MAX_FLOAT."""
    try:
        if math.isfinite(v := float(value)) and abs(v) <= MAX_FLOAT:
            return v
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected a finite number of at most {MAX_FLOAT:g}, got "
                                     f"{value!r}")


def _arg_line(line: str) -> list[str]:
    """One line of an @FILE: without its surrounding blanks (a trailing space would end up in
    a webhook URL); a blank line is no argument."""
    return [line.strip()] if line.strip() else []


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


def _flags(g: Any, cls: type, prefix: str = "") -> None:
    """A flag for each of ``cls``'s fields made with config.flag, its dest ``prefix`` + the
    field's name (what config_from_args reads), its default the field's, shown in the help."""
    for f in fields(cls):
        if "flag" not in f.metadata:
            continue
        name, help = f.metadata["flag"], f.metadata["help"]
        metavar = name[2:].replace("-", "_").upper()
        if isinstance(f.default, bool):  # the flag turns the default over
            g.add_argument(name, dest=prefix + f.name, default=f.default, help=help,
                           action="store_false" if f.default else "store_true")
        elif f.default is None:
            g.add_argument(name, dest=prefix + f.name, metavar=metavar, help=help)
        else:
            g.add_argument(name, dest=prefix + f.name, default=f.default,
                           type=_finite if isinstance(f.default, float) else type(f.default),
                           metavar=metavar, help=f"{help} (%(default)s)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    c, r = MonitorConfig, RailsConfig
    p.fromfile_prefix_chars = "@"  # @FILE: flags that hold a secret (a webhook URL) off the argv
    p.convert_arg_line_to_args = _arg_line
    p.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"),
                   help="torchft Lighthouse URL used for evictions (env TORCHFT_LIGHTHOUSE); "
                        "without it the monitor only reports")
    _flags(p, MonitorConfig)
    _flags(p, RailsConfig, "rails_")
    p.add_argument("--evict-on", dest="rails_evict_kinds", metavar="KINDS", type=_csv,
                   default=r.evict_kinds,
                   help=f"finding kinds that evict, comma separated, of "
                        f"{','.join(EVICTABLE_KINDS)} ({','.join(r.evict_kinds)})")
    p.add_argument("--state", dest="state_path", default=c().state_path,
                   help="SQLite audit log (./lightkeeper-monitor.sqlite)")
    p.add_argument("--job", default=os.environ.get("LIGHTKEEPER_JOB") or c.job,
                   help="training job name for metric labels (env LIGHTKEEPER_JOB)")
    p.add_argument("--targets", type=_csv, action="append", default=[],
                   help="static WorkerServers, host:port[,host:port...] (repeatable); "
                        "torch+http://host:port names a rank served by torch's own debug server")
    p.add_argument("--sd-out", help="write the targets the monitor knows to this file_sd JSON "
                                    "for Prometheus (default: next to --state)")
    p.add_argument("--token", help="admin bearer token for POST /v1/evict and host release "
                                   "(env LIGHTKEEPER_TOKEN); without one they are disabled")
    p.add_argument("--register-token", help="bearer token that admits POST /v1/targets only, "
                                            "the one ranks hold (env LIGHTKEEPER_REGISTER_TOKEN)")
    p.add_argument("--allow-targets", type=_csv,
                   help="without a token, who may register: CIDRs, IPs, host names or patterns "
                        "(default: loopback and the hosts of --targets)")
    p.add_argument("--leader-polling", choices=("auto", "on", "off"), default=c.leader_polling,
                   help="poll each group's rank 0 every sweep, the others every --member-interval"
                        f" (auto: from {c.leader_polling_min_ranks:,} targets; docs/scaling.md)")
    p.add_argument("--rank-exit-token",
                   help="the ranks' token (env LIGHTKEEPER_EXIT_TOKEN): an evicted group's "
                        "other ranks are told to exit, survivors to abort; without it, reported")
    p.add_argument("--rank-auth", choices=RANK_AUTH, default=c.rank_auth,
                   help="how calls to ranks carry that token: hmac signs each for the one rank "
                        "it is for, the token never sent; bearer sends the token itself "
                        "(deprecated: for ranks of an older Lightkeeper, mid-upgrade) "
                        "(%(default)s)")
    p.add_argument("--lighthouse-heartbeat-timeout-ms", type=_positive_int,
                   help="the Lighthouse's heartbeat_timeout_ms, if known (docs/lighthouse.md)")
    p.add_argument("--lighthouse-join-timeout-ms", type=_positive_int,
                   help="the Lighthouse's join_timeout_ms, if known (docs/lighthouse.md)")
    p.add_argument("--expected-groups", type=_positive_int,
                   help="replica groups the job should run with: the goodput ledger's "
                        "capacity (default: the number of replica groups ever seen)")
    _flags(p.add_argument_group("detector thresholds"), DetectorConfig)
    _flags(p.add_argument_group("network probes (docs/monitor.md, Network faults)"),
           ProbeConfig, "probe_")
    q = p.add_argument_group("host quarantine (docs/quarantine.md)")
    q.add_argument("--quarantine-after", type=_kind_counts, default={},
                   help="quarantine a host after N confirmed findings of a kind within the "
                        "window, kind=N[,kind=N] (0: never), merged over the defaults "
                        f"{','.join(f'{k}={n}' for k, n in QUARANTINE_AFTER.items())}")
    _flags(q, QuarantineConfig, "quarantine_")
    q.add_argument("--action", dest="quarantine_actions", metavar="ACTION", action="append",
                   default=[],
                   help="carry out quarantines and releases: k8s, slurm, exec:CMD or "
                        "webhook:URL (repeatable; none: the ledger only)")
    q.add_argument("--webhook-secret",
                   help="HMAC-SHA256 key of webhook signatures (env LIGHTKEEPER_WEBHOOK_SECRET)")
    _flags(p.add_argument_group("incident bundles (docs/monitor.md, Incident bundles)"),
           BundleConfig, "bundle_")
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
    _flags(sh, ShardConfig)
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="logging level (%(default)s)")


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


def _said(value: str | None, name: str, what: str = "a secret flag") -> None:
    """Warn when the secret ``value`` is on the command line (not an @FILE or a variable)."""
    if on_command_line(value):
        log.warning("%s on the command line: every user of this host can read it (ps); set %s "
                    "instead", what, name)


def _env(value: str | None, name: str) -> str | None:
    """A secret: its flag's ``value`` (said) or the variable ``name``'s, stripped (a secret
    file's final newline is no header value nor a token anyone sends); blank: unset."""
    _said(value, name)
    return (value or "").strip() or (os.environ.get(name) or "").strip() or None


def _section(cls: type, given: dict[str, Any], prefix: str = "", **override: Any) -> Any:
    """``cls`` from the flags whose dest is ``prefix`` + one of its fields, then ``override``."""
    return cls(**{**{f.name: given[prefix + f.name] for f in fields(cls)
                     if prefix + f.name in given}, **override})


def config_from_args(args: argparse.Namespace) -> MonitorConfig:
    """The config the flags describe (a flag's ``dest`` names its field); raises ConfigError."""
    given = vars(args)
    for flag, url, name in (("--lighthouse", args.lighthouse, "TORCHFT_LIGHTHOUSE"),
                            ("--etcd", args.etcd, "LIGHTKEEPER_ETCD")):
        if url and redact_url(url) != url:
            _said(url, name, f"{flag}'s password")
    cfg = _section(
        MonitorConfig, given, targets=[t for ts in args.targets for t in ts], shard=_shard_config(args),
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
            webhook_secret=_env(args.webhook_secret, "LIGHTKEEPER_WEBHOOK_SECRET"),
            # --dry-run acts on nothing: a drain, a cordon or a pod delete is an eviction too
            dry_run=args.quarantine_dry_run or args.rails_dry_run),
        bundles=_section(BundleConfig, given, "bundle_"))
    from .startup import check_config  # the loop's modules only once a monitor is built
    check_config(cfg)
    return cfg


def warn_about_tokens(cfg: MonitorConfig) -> None:
    """Warn at start-up when the ranks must hold the admin token to register, when an
    eviction of a group out of the quorum could end nothing (no token to tell its ranks), and
    when a node's drain or taint is held under the default ``--job``, which any other job's
    monitor left at it shares: its release lifts this one's."""
    if warning := token_warning(cfg.register_token, cfg.token, cfg.rank_exit_token):
        log.warning(warning)
    if "stuck_starting" in cfg.rails.evict_kinds and not cfg.rank_exit_token:
        log.warning("--evict-on stuck_starting without --rank-exit-token: the Lighthouse's kill "
                    "cannot reach a group out of its quorum, so such an eviction ends nothing "
                    "(docs/monitor.md)")
    if cfg.job == MonitorConfig.job and {"slurm", "k8s", "kubernetes"} & set(
            cfg.quarantine.actions):
        log.warning("--action slurm/k8s with the default --job %s: another job's monitor left "
                    "at it shares this one's drain or taint, and its release lifts both; name "
                    "the job (docs/quarantine.md)", cfg.job)


def start_line(url: str, cfg: MonitorConfig) -> str:
    """``monitor=`` a URL for this host; ``bind=`` what it serves on and, on every address,
    ``remote=`` the URL by this host's name, for ranks elsewhere."""
    port = urlsplit(url).port
    line = f"[lightkeeper] monitor={url} bind={host_for_url(cfg.bind or '0.0.0.0')}:{port}"
    if cfg.bind in ("0.0.0.0", "", "::"):
        line += f" remote={http_url(socket.gethostname(), port)}"
    return (f"{line} state={cfg.state_path} sd_out={cfg.sd_out} "
            f"lighthouse={redact_url(cfg.lighthouse)} dry_run={cfg.rails.dry_run}")


class _Escaped(logging.Formatter):
    """A line's control characters escaped: a rank's text (a host name, an error) may hold a
    terminal escape, or a newline that forges a line. A traceback's lines are escaped and
    indented: none reads as a line of the log."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:
        return "\n".join("    " + printable(line)
                         for line in super().formatException(ei).split("\n"))

    def formatStack(self, stack_info: str) -> str:
        return "\n".join("    " + printable(line) for line in stack_info.split("\n"))


def log_formatter() -> logging.Formatter:
    """The monitor log's lines: UTC time, logger, level, the message escaped."""
    utc = _Escaped("%(asctime)s.%(msecs)03dZ %(name)s %(levelname)s %(message)s",
                   "%Y-%m-%dT%H:%M:%S")
    utc.converter = time.gmtime  # UTC, and said so: not the host's unnamed local time
    return utc


def run(args: argparse.Namespace) -> int:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(log_formatter())
    logging.basicConfig(level=getattr(logging, args.log_level), handlers=[handler])
    from .service import Monitor

    try:
        cfg = config_from_args(args)
        warn_about_tokens(cfg)
        monitor = Monitor(cfg)
    except ConfigError as e:  # also --action k8s without lightkube or a cluster configuration
        print(f"lightkeeper monitor: {e}", file=sys.stderr)
        return 2
    except (OSError, sqlite3.Error, StateInUse, StateTooNew) as e:  # the state file, its folder
        print(f"lightkeeper monitor: --state {args.state_path}: {e}", file=sys.stderr)
        return 1
    try:
        monitor.start()
    except (OSError, ValueError) as e:  # waitress: ValueError for a host it cannot resolve
        monitor.stop()
        print(f"lightkeeper monitor: cannot serve on {args.bind}:{args.port}: {e}",
              file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(start_line(monitor.url, cfg), flush=True)
    try:
        stop.wait()
    finally:
        monitor.stop()
    return 0
