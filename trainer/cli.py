"""``lightkeeper train``: one rank of one replica group (several ranks per group under torchrun)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import traceback
from collections.abc import Mapping
from urllib.parse import urlsplit

from http_serving import is_http_url, redact_url
from worker_server.state import env_local_rank
from worker_server.timing import cuda_timing_mode

from .config import ModelConfig, TrainConfig
from .faults import (
    FaultSpecError,
    check_fits_group,
    check_process_fault,
    check_reached,
    fault_key,
    parse_fault,
)
from .loop import env_local_world_size
from .store import is_loopback, is_wildcard, uses_agent_store


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"lightkeeper train: {name}={raw!r} is not an integer") from None


def fault_spec(value: str) -> str:
    try:
        check_process_fault(parse_fault(value))
    except FaultSpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    # a value argparse refuses (--inject hang:at=3, --steps x) in one line, as the values
    # config_from_args refuses: no usage block before it
    p.error = lambda message: p.exit(2, f"{p.prog}: error: {message}\n")  # type: ignore[method-assign]
    p.add_argument("--replica-group", type=int, default=None,
                   help="replica group index (env REPLICA_GROUP_ID; default 0)")
    p.add_argument("--num-replica-groups", type=int, default=None,
                   help="number of replica groups in the job (env NUM_REPLICA_GROUPS; default 2)")
    p.add_argument("--lighthouse", default=None,
                   help="Lighthouse URL (env TORCHFT_LIGHTHOUSE)")
    p.add_argument("--steps", type=int, default=100, help="committed steps to train (default 100)")
    p.add_argument("--worker-port", type=int, default=None,
                   help="WorkerServer port; 0 = ephemeral; with several local ranks each gets "
                        "port+group_rank (env LIGHTKEEPER_WORKER_PORT; default 0)")
    p.add_argument("--worker-host", default=os.environ.get("LIGHTKEEPER_WORKER_HOST") or "127.0.0.1",
                   help="WorkerServer bind address, and torchft's for this rank (env "
                        "LIGHTKEEPER_WORKER_HOST; 127.0.0.1: this host only)")
    p.add_argument("--job", default=os.environ.get("LIGHTKEEPER_JOB") or "lightkeeper",
                   help="job name used in labels and state (env LIGHTKEEPER_JOB)")
    p.add_argument("--inject", action="append", default=[], type=fault_spec, metavar="SPEC",
                   help="inject a fault (repeatable): slow:delay=S[,from_step=N] | "
                        "slow_compute:factor=F|delay=S[,from_step=N] | "
                        "hang:at_step=N[,where=cross|group] | mismatch:at_step=N[,where=cross|group]"
                        " | crash:at_step=N; each also takes rank=R (group rank; default: all)")
    p.add_argument("--pg-timeout", type=float, default=60.0,
                   help="torchft collective/process-group timeout, seconds (default 60)")
    p.add_argument("--quorum-timeout", type=float, default=60.0,
                   help="torchft quorum timeout, seconds (default 60)")
    p.add_argument("--connect-timeout", type=float, default=60.0,
                   help="seconds to wait for the replica group's TCPStore (MASTER_ADDR:MASTER_PORT) "
                        "and for torchft's connections (default 60)")
    p.add_argument("--step-pause", type=float, default=0.0,
                   help="extra seconds per step standing in for data loading (default 0)")
    p.add_argument("--min-replica-size", type=int, default=1,
                   help="torchft min_replica_size: fewest groups that may commit a step")
    p.add_argument("--cross-group", choices=("auto", "nccl", "gloo"), default="auto",
                   help="torchft's process group across replica groups (auto: NCCL on CUDA, "
                        "else gloo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-worker-server", dest="worker_server", action="store_false",
                   help="start no WorkerServer of its own (the job is run under `lightkeeper "
                        "run`, whose hook serves the torchft Manager)")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    lighthouse = args.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not lighthouse:
        raise SystemExit("lightkeeper train: no Lighthouse: pass --lighthouse URL or set "
                         "TORCHFT_LIGHTHOUSE")
    if not is_http_url(lighthouse):  # else torchft fails with a traceback after its timeout
        raise SystemExit(f"lightkeeper train: Lighthouse {redact_url(lighthouse)!r} is not an "
                         "http(s)://host:port URL")
    replica_group = (args.replica_group if args.replica_group is not None
                     else _env_int("REPLICA_GROUP_ID", 0))
    num_groups = (args.num_replica_groups if args.num_replica_groups is not None
                  else _env_int("NUM_REPLICA_GROUPS", 2))
    if num_groups < 1:
        raise SystemExit(f"lightkeeper train: --num-replica-groups {num_groups} must be >= 1")
    if not 0 <= replica_group < num_groups:
        raise SystemExit(f"lightkeeper train: replica group {replica_group} is not in "
                         f"[0, {num_groups})")
    if args.steps < 0:
        raise SystemExit("lightkeeper train: --steps must be >= 0")
    for flag, value in (("--connect-timeout", args.connect_timeout),
                        ("--pg-timeout", args.pg_timeout),
                        ("--quorum-timeout", args.quorum_timeout)):
        if not value > 0 or value == float("inf"):  # NaN too
            raise SystemExit(f"lightkeeper train: {flag} must be a number of seconds > 0")
    if not args.step_pause >= 0 or args.step_pause == float("inf"):
        raise SystemExit("lightkeeper train: --step-pause must be a number of seconds >= 0")
    if args.min_replica_size < 1:
        raise SystemExit("lightkeeper train: --min-replica-size must be >= 1")
    worker_port = (args.worker_port if args.worker_port is not None
                   else _env_int("LIGHTKEEPER_WORKER_PORT", 0))
    if not 0 <= worker_port <= 65535:
        raise SystemExit(f"lightkeeper train: --worker-port {worker_port} is not a port "
                         "(0-65535; 0: ephemeral)")
    try:  # else the store it advertises waits out --connect-timeout on an address not here
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            args.worker_host.strip().strip("[]"), 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(sockaddr)
    except OSError as e:
        raise SystemExit(f"lightkeeper train: --worker-host {args.worker_host!r} cannot be bound "
                         f"on this host: {e.strerror or e}") from None
    group_rank, group_world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if group_world_size < 1 or not 0 <= group_rank < group_world_size:
        raise SystemExit(f"lightkeeper train: RANK={group_rank} is not in [0, WORLD_SIZE="
                         f"{group_world_size})")
    if worker_port and worker_port + group_rank > 65535:
        raise SystemExit(f"lightkeeper train: --worker-port {worker_port} + group rank "
                         f"{group_rank} is past 65535 (each local rank takes port+group_rank)")
    try:  # torch's device pick reads them, after the import this check saves
        env_local_rank()
        env_local_world_size()
        cuda_timing_mode()  # the step timer's, also without a WorkerServer
    except ValueError as e:
        raise SystemExit(f"lightkeeper train: {e}") from None
    given = set()
    for spec in args.inject:  # what the grammar alone cannot check: does it fit this group?
        try:
            fault = parse_fault(spec)
            check_fits_group(fault, group_world_size)
            check_reached(fault, args.steps)  # the injector checks a live post the same way
        except FaultSpecError as e:
            raise SystemExit(f"lightkeeper train: --inject: {e}") from None
        key = fault_key(fault, group_world_size)
        if key in given:  # two would stack, as a post again is refused
            raise SystemExit(f"lightkeeper train: --inject: {spec!r} given twice")
        given.add(key)
    return TrainConfig(
        replica_group=replica_group, num_replica_groups=num_groups, lighthouse=lighthouse,
        group_rank=group_rank, group_world_size=group_world_size,
        connect_timeout_s=args.connect_timeout,
        steps=args.steps, worker_host=args.worker_host, worker_port=worker_port,
        job=args.job, pg_timeout_s=args.pg_timeout, quorum_timeout_s=args.quorum_timeout,
        step_pause_s=args.step_pause, min_replica_size=args.min_replica_size, seed=args.seed,
        cross_group=args.cross_group,
        faults=list(args.inject), model=ModelConfig(), worker_server=args.worker_server,
    )


def unreachable(cfg: TrainConfig, env: Mapping[str, str] = os.environ) -> str | None:
    """Why ranks on other hosts, which the Lighthouse or ``MASTER_ADDR`` says there are, cannot
    reach this rank through torchft: it advertises loopback (the default --worker-host)."""
    if is_wildcard(cfg.worker_host) or not is_loopback(cfg.worker_host):
        return None
    for what, where in (("the Lighthouse", cfg.lighthouse), ("MASTER_ADDR", env.get("MASTER_ADDR"))):
        if what == "MASTER_ADDR" and uses_agent_store(env):
            continue  # torchrun's own: the agent's host name, also on one host
        if where and not is_loopback(urlsplit(where).hostname or where):
            return (f"{what} {redact_url(where)} is not on loopback, but this rank advertises "
                    f"{cfg.worker_host} to torchft: ranks on other hosts cannot reach it or heal "
                    "from it (--worker-host 0.0.0.0 or this host's address; docs/run.md)")
    return None


def run(args: argparse.Namespace) -> int:
    from .loop import end_process, setup_logging, train

    try:
        cfg = config_from_args(args)
    except SystemExit as e:  # a bad value or setting: a usage error, as argparse's (status 2)
        if not isinstance(e.code, str):
            raise
        sys.stderr.write(f"{e.code}\n")
        return 2
    if why := unreachable(cfg):  # else a group elsewhere waits, unsaid, for 127.0.0.1
        sys.stderr.write(f"[lightkeeper] {why}\n")
    if cfg.worker_server:  # before torch, whose import starts a thread
        from worker_server.stop_signal import watch_sigterm

        unarmed = watch_sigterm()
        if unarmed:
            sys.stdout.write(f"[lightkeeper] SIGTERM will end this rank unsaid (a monitor counts "
                             f"it dead): {unarmed}\n")
    try:  # a core install (monitor, analyze) has neither
        import torch  # noqa: F401
        import torchft  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"lightkeeper train: needs torch and torchft ({e}); install them with "
                         "pip install 'lightkeeper[trainer]' (docs/install.md)") from None
    setup_logging()
    try:
        code = train(cfg)
    except KeyboardInterrupt:
        code = 130  # as `lightkeeper` answers an interrupt
    except Exception:
        traceback.print_exc()  # what an uncaught exception would have printed
        code = 1
    end_process(code)
