"""``lightkeeper demo``: a fault-tolerant job on this machine, faults, detection, eviction, report.

Starts a torchft Lighthouse, ``--groups`` replica groups of ``--ranks-per-group`` ranks (real
processes, gloo on CPU, a WorkerServer on every rank), ``lightkeeper monitor`` and, when the
binary is there, Prometheus with the shipped configuration. Then it plays the scenario
(:mod:`lightkeeper.scenario`): by default healthy -> ``slow_compute`` on one rank of group 1 ->
detected -> evicted -> the demo's supervisor restarts the group (as Kubernetes would) -> it heals
and rejoins -> an in-group ``hang`` on one rank of group 2 -> ... -> healthy end; with
``--inject`` the faults given to the groups at start. Each fault's story (struck, caught,
evicted, back) is followed by a :class:`~lightkeeper.faulttrack.FaultTrack` from what the ranks
and the monitor serve; the scenario ends when every story has ended (each stage has a deadline).
The main loop samples every rank's ``/v1/state`` and the monitor's findings/evictions at ~2 Hz
and records a timeline; at the end (Ctrl-C, SIGTERM and failures included) it writes
``report.json``, ``report.md`` and ``timeline.png`` to ``--report-dir`` and stops every process
it started, by PID. ``--keep-running`` leaves everything up after the scenario until Ctrl-C or
SIGTERM. Each evicted fault's recovery is told stage by stage with its cost from the monitor's
goodput ledger and torchft alone's computed beside it (:mod:`lightkeeper.recovery`); the
supervisor restarts an evicted group from a warm spare (``LocalCluster.start_spare``). Each
group runs on a host of its own (a node name as ``NODE_NAME``, a loopback address for its
ranks' servers) and there are ``--spare-hosts``; the monitor quarantines a bad host and the
supervisor restarts its group on a host that is not quarantined (``HostPool``, reading the
monitor's ``GET /v1/hosts``), or lets it wait when none is free. See docs/demo.md.

This module is the command: its options and their checks, the lock, the hosts built and the
run told top to bottom (:func:`run`, :func:`_run`). The running demo is
:class:`~lightkeeper.demo_loop.Demo`: its loop in :mod:`lightkeeper.demo_loop`, its parts in
:mod:`lightkeeper.demo_processes`, :mod:`lightkeeper.demo_sampling`,
:mod:`lightkeeper.demo_supervisor` and :mod:`lightkeeper.demo_stories`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import secrets
import shlex
import signal
import stat
import sys
import tempfile
from pathlib import Path

from .demo_loop import Demo, Stop
from .demo_output import mute, reader_gone, say
from .scenario import Scenario, Schedule, default_faults, parse_inject, soak_faults

LOCK_NAME = "lightkeeper-demo.lock"
MAX_LOOPBACK_HOSTS = 250  # 127.0.0.2..127.0.0.251
LEDGER_WAIT_S = Scenario.ledger_wait_s  # the default wait for the ledger's back-at-pace verdicts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", type=int, default=3, help="replica groups (default 3)")
    p.add_argument("--ranks-per-group", type=int, default=2,
                   help="ranks per group (default 2; FSDP inside the group, torchrun)")
    p.add_argument("--steps", type=int, default=None,
                   help="committed steps each group trains; the demo ends when all are done "
                        "(default: unbounded, the scenario decides)")
    p.add_argument("--duration", type=float, default=None,
                   help="stop after this many seconds of training (default: when the scenario "
                        "ends; 60 s with --no-faults)")
    p.add_argument("--inject", action="append", default=[], metavar="GROUP[.RANK]:SPEC",
                   help="give SPEC (as the trainer's --inject, e.g. 1:slow:delay=0.5,"
                        "from_step=40) to GROUP from its start, on every rank or on RANK only "
                        "(1.1:slow_compute:factor=3,from_step=30); repeatable; replaces the "
                        "default scenario")
    p.add_argument("--no-faults", action="store_true", help="run the job healthy")
    p.add_argument("--dry-run", action="store_true",
                   help="the monitor detects and reports but never evicts (nor quarantines)")
    p.add_argument("--report-dir", default=None,
                   help="report and logs (default: a new directory under the system temp dir)")
    p.add_argument("--keep-running", action="store_true",
                   help="after the scenario, leave everything up (Ctrl-C or SIGTERM stops "
                        "it and every process the demo started)")
    p.add_argument("--no-prometheus", action="store_true", help="do not start Prometheus")
    p.add_argument("--spare-hosts", type=int, default=2,
                   help="hosts beyond one per group, for a group whose host is quarantined "
                        "(default 2: each of the default story's two faulty hosts can be "
                        "replaced; docs/demo.md)")
    p.add_argument("--hosts", choices=("auto", "netns", "loopback"), default="auto",
                   help="what a host is: a network namespace of its own on a bridge (netns: "
                        "needs root and iproute2; network faults need it), a loopback address "
                        "(loopback), or netns where it can be built (auto, the default)")
    p.add_argument("--one-host", action="store_true",
                   help="run every group on this machine as it is (no NODE_NAME, 127.0.0.1): "
                        "no other host to move to, so host quarantine is off")
    p.add_argument("--no-quarantine", action="store_true",
                   help="the monitor never quarantines a host (evictions only)")
    p.add_argument("--quarantine-dry-run", action="store_true",
                   help="the monitor decides quarantines and logs them, carries none out")
    p.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                   help="a soak: random faults of every kind, one at a time, for SECONDS of "
                        "training, the monitor restarted half-way; writes soak.json "
                        "(lightkeeper/soak.py, docs/demo.md)")
    p.add_argument("--seed", type=int, default=None,
                   help="the soak's schedule seed (default: a random one, printed)")
    p.add_argument("--cold-restarts", action="store_true",
                   help="restart an evicted group from scratch (default: from a warm spare the "
                        "supervisor started ahead, already imported; docs/demo.md)")
    # stage timings (tests and impatient people); see lightkeeper/scenario.py
    s = Scenario()
    for flag, attr in TIMING_FLAGS:
        p.add_argument(flag, dest=attr, type=float, default=getattr(s, attr),
                       help=argparse.SUPPRESS)
    for flag, attr in LIGHTHOUSE_FLAGS:
        p.add_argument(flag, dest=attr, type=int, default=getattr(s, attr),
                       help=argparse.SUPPRESS)


TIMING_FLAGS = (("--healthy-s", "healthy_s"), ("--end-s", "end_s"),
                ("--ledger-wait", "ledger_wait_s"),
                ("--slow-delay", "slow_delay_s"), ("--strike-timeout", "strike_timeout_s"),
                ("--detect-timeout", "detect_timeout_s"), ("--evict-timeout", "evict_timeout_s"),
                ("--rejoin-timeout", "rejoin_timeout_s"), ("--step-pause", "step_pause_s"),
                ("--hang-floor", "hang_floor_s"), ("--pg-timeout", "pg_timeout_s"))
# the Lighthouse's timeouts (the recovery study, docs/demo.md and docs/lighthouse.md)
LIGHTHOUSE_FLAGS = (("--heartbeat-timeout-ms", "heartbeat_timeout_ms"),
                    ("--join-timeout-ms", "join_timeout_ms"))


def _bad_numbers(args: argparse.Namespace) -> str | None:
    """The first flag whose number cannot run a demo, said with its bound."""
    checks = [("--groups", args.groups, 2), ("--ranks-per-group", args.ranks_per_group, 1),
              ("--steps", args.steps, 1)]
    for flag, value, least in checks:
        if value is not None and value < least:
            return f"{flag} must be >= {least}, got {value}"
    if args.duration is not None and not 0 < args.duration < float("inf"):
        return f"--duration must be a number of seconds > 0, got {args.duration:g}"
    for flag, attr in TIMING_FLAGS + LIGHTHOUSE_FLAGS:
        value = getattr(args, attr)
        if not 0 <= value < float("inf"):  # NaN too
            return f"{flag} must be a number >= 0, got {value:g}"
    return None


def _report_dir(given: str | None) -> Path | None:
    """``--report-dir`` as a path the demo can create or write, or ValueError saying why not;
    nothing is created yet. One that holds a run already is refused: its monitor would reopen
    that run's audit log and quarantines."""
    if given is None:
        return None
    path = Path(given).resolve()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{given}: not a directory")
    held = [n for n in ("report.json", "monitor.sqlite") if (path / n).exists()]
    if held:
        raise ValueError(f"{given}: holds a run already ({', '.join(held)}); give a new or "
                         "empty directory")
    base = next(p for p in (path, *path.parents) if p.exists())
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):  # EROFS too
        raise ValueError(f"{given}: cannot write in {base}")
    _check_parents(path, given)
    if path.exists():
        _check_owner(path.stat(), given)
    return path


def _check_owner(st: os.stat_result, given: str | Path) -> None:
    """As root, ValueError unless ``st`` is a directory root owns that no one else may write in:
    root's spare hosts read what to run from files in it."""
    if os.geteuid() == 0 and (not stat.S_ISDIR(st.st_mode) or st.st_uid != 0
                              or st.st_mode & 0o022):
        raise ValueError(f"{given}: a directory another user owns or may write in; as root "
                         "the demo runs what it reads there: give one of root's")


def _check_parents(path: Path, given: str | Path) -> None:
    """As root, ValueError naming the first directory above ``path`` (those that exist, up to
    /) that root, or the user who ran sudo, does not own, or that others may write in without
    the sticky bit (/tmp has it): whoever may could move ``path`` away and put their own
    directory or a link in its place."""
    if os.geteuid() != 0:
        return
    sudo = os.environ.get("SUDO_UID", "")
    ours = {0, int(sudo)} if sudo.isdigit() else {0}  # `sudo ... --report-dir ~/x` works
    for parent in path.parents:
        try:
            st = parent.lstat()  # ``path`` is resolved: a link here was put in since
        except (FileNotFoundError, NotADirectoryError):
            continue  # made by the demo, root's
        if not stat.S_ISDIR(st.st_mode):
            why = "is no directory (a link?)"
        elif st.st_uid not in ours:
            why = f"is owned by another user (uid {st.st_uid})"
        elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            why = "may be written in by group or others (and has no sticky bit)"
        else:
            continue
        raise ValueError(f"{given}: {parent} {why}; as root the demo runs what it reads in "
                         "the report directory: give one under directories only root"
                         + (" or you" if len(ours) > 1 else "") + " may change")


def _make_report_dir(path: Path) -> None:
    """Create ``--report-dir`` (0o700), or take the one there, and look at it again: since
    :func:`_report_dir` looked, another user may have made it or put a link in its place.
    ValueError (as root) when what is there now is not root's own directory, or lies under a
    directory :func:`_check_parents` refuses."""
    # a parent missing at the check may be another user's (or a link) now: make nothing in it
    _check_parents(path, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = path.lstat()  # a link is not followed: it is refused
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{path}: not a directory")
    _check_owner(st, path)
    _check_parents(path, path)  # and again: it may have appeared meanwhile


# --------------------------------------------------------------------------------------------
class DemoLocked(RuntimeError):
    pass


def acquire_lock():
    """Hold an exclusive lock for this demo's lifetime; DemoLocked names the running one."""
    from monitor.store import LockHeld, pid_lock

    path = Path(tempfile.gettempdir()) / LOCK_NAME
    try:
        return pid_lock(str(path))
    except LockHeld as e:
        raise DemoLocked(f"another lightkeeper demo is running (PID {e.holder}; lock {path}); "
                         "stop it first (Ctrl-C in its terminal, or kill that PID)") from None
    except OSError as e:  # a link or another user's file where the lock goes
        raise DemoLocked(f"cannot hold the demo's lock {path}: {e.strerror or e}") from None


def _sigterm(*_):
    raise KeyboardInterrupt


def _hangup(*_):
    """SIGHUP, the terminal closed: a Ctrl-C whose output goes nowhere."""
    mute()
    raise KeyboardInterrupt


def _stop_handlers() -> dict:
    """Make SIGTERM and SIGHUP end the demo as Ctrl-C does (a SIGHUP ignored already, as under
    nohup, stays ignored); return the handlers they had."""
    old = {signal.SIGTERM: signal.signal(signal.SIGTERM, _sigterm),
           signal.SIGHUP: signal.getsignal(signal.SIGHUP)}
    if old[signal.SIGHUP] != signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _hangup)
    return old


# --------------------------------------------------------------------------------------------
def missing_trainer_packages() -> list[str]:
    """The packages the demo's ranks import that this environment lacks (found, not imported)."""
    import importlib.util

    return [name for name in ("torch", "torchft") if importlib.util.find_spec(name) is None]


def run(args: argparse.Namespace) -> int:
    bad = _bad_numbers(args)
    if bad:
        print(f"lightkeeper demo: {bad}", file=sys.stderr)
        return 2
    from .fabric import MAX_HOSTS

    most, each = ((MAX_HOSTS, "namespace") if args.hosts == "netns" and not args.one_host
                  else (MAX_LOOPBACK_HOSTS, "loopback address"))
    if not 0 <= args.spare_hosts or args.groups + args.spare_hosts > most:
        print(f"lightkeeper demo: --spare-hosts must be >= 0, and --groups plus --spare-hosts "
              f"at most {most} (one {each} each)", file=sys.stderr)
        return 2
    try:  # every placement is checked before anything starts
        plans = [parse_inject(v, args.groups, args.ranks_per_group) for v in args.inject]
    except ValueError as e:
        print(f"lightkeeper demo: {e}", file=sys.stderr)
        return 2
    if args.no_faults and plans:
        print("lightkeeper demo: --no-faults and --inject exclude each other", file=sys.stderr)
        return 2
    for given, flag, other in ((args.seed is not None and args.soak is None, "--seed",
                                "needs --soak (it seeds the soak's schedule)"),
                               (args.one_host and args.hosts == "netns", "--one-host",
                                "and --hosts netns exclude each other")):
        if given:
            print(f"lightkeeper demo: {flag} {other}", file=sys.stderr)
            return 2
    if args.soak is not None and (not 0 < args.soak < math.inf or plans or args.no_faults):
        print("lightkeeper demo: --soak takes seconds > 0 and draws its own faults (no "
              "--inject, no --no-faults)", file=sys.stderr)
        return 2
    refused, note = _check_plans(args, plans)
    if refused:
        print(f"lightkeeper demo: {refused}", file=sys.stderr)
        return 2
    try:  # before the lock and the hosts: a run never starts without a place for its report
        report_dir = _report_dir(args.report_dir)
    except ValueError as e:
        print(f"lightkeeper demo: --report-dir {e}", file=sys.stderr)
        return 2
    missing = missing_trainer_packages()
    if missing:  # a core install (monitor, analyze, dashboards) has neither
        print(f"lightkeeper demo: needs {' and '.join(missing)} to train; install them with "
              "pip install 'lightkeeper[trainer]' (docs/install.md)", file=sys.stderr)
        return 2
    # From here a SIGTERM or SIGHUP (the terminal closed) is a Ctrl-C: the default action would
    # leave the namespaces being built, and every process started (in sessions of their own), behind
    old = _stop_handlers()
    try:
        return _run(args, plans, report_dir, old, note)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


LINK_KINDS = ("partition", "slow_link")  # placed by comparing hosts' links: a bad one
LINK_MIN_GROUPS = 3  # between two hosts is neither's (monitor/detect/network.py)


def baseline_steps() -> int:
    """Healthy steps ``job_slow`` takes its baseline over at the monitor's defaults (the demo's)."""
    from monitor.config import DetectorConfig

    cfg = DetectorConfig()
    return cfg.job_baseline_windows * cfg.straggler_steps


def _check_plans(args: argparse.Namespace, plans: list) -> tuple[str | None, str | None]:
    """(why a fault given by ``--inject`` would never strike, or a network one never be found or
    healed; a line to say before the run), each None when there is nothing to say."""
    from trainer.faults import parse_fault

    held = _quarantine_off(args)
    # --dry-run evicts nothing and its run ends; kept running, its group returns to a broken host
    kept = " --keep-running" if held == "--dry-run" and args.keep_running else ""
    faults = [parse_fault(p.spec) for p in plans]
    network = [f for f in faults if f.network]
    for f in faults:  # a step the run never reaches: never struck (an at_step, trainers refuse)
        if args.steps and max(f.at_step, f.from_step) >= args.steps:
            step = "at_step" if f.at_step >= 0 else "from_step"
            return (f"--inject {f.spec!r}: {step} is never reached with --steps {args.steps} "
                    f"(steps 0 to {args.steps - 1})", None)
    for f in network:
        if args.one_host or args.hosts == "loopback":
            why = "not with --one-host" if args.one_host else "not with --hosts loopback"
            return (f"{f.spec} is a network fault: it needs hosts that are network namespaces "
                    f"(--hosts netns; {why})", None)
        if held and (held != "--dry-run" or kept):
            return (f"{f.spec} is a network fault, and with {held}{kept} its host is never "
                    "healed (only a quarantined host is): its group would be restarted onto the "
                    f"broken host again and again; drop {kept.strip() or held} or the fault", None)
        if f.kind in LINK_KINDS and args.groups < LINK_MIN_GROUPS:
            return (f"{f.spec} with --groups {args.groups}: the monitor places a bad link among "
                    f"{LINK_MIN_GROUPS} hosts or more, so it would never be found and its "
                    f"group never moved off it; give --groups {LINK_MIN_GROUPS} or more", None)
        if f.kind == "slow_link" and f.from_step < baseline_steps():
            return (f"{f.spec}: from_step below {baseline_steps()}, the healthy steps job_slow "
                    "takes its baseline over first: it would never be judged", None)
    if not held and len(network) > args.spare_hosts:  # --max-quarantined is the spares
        return (f"{len(network)} network faults with --spare-hosts {args.spare_hosts}: each "
                "quarantines its host and moves its group to a spare; past the spares the "
                "quarantine is held and the group restarted onto the broken host; give "
                f"--spare-hosts {len(network)} or fewer network faults", None)
    return None, (f"{network[0].spec}: with --dry-run its host is never quarantined nor healed: "
                  "it stays broken until the run's end" if held and network else None)


def _quarantine_off(args: argparse.Namespace) -> str | None:
    """The flag that keeps the monitor from quarantining a host (None: it quarantines). The
    demo heals a network fault's host only once it is quarantined, so these runs get none."""
    # --dry-run first: with it the monitor quarantines nothing whatever the others say
    return ("--dry-run" if args.dry_run
            else "--no-quarantine" if args.no_quarantine
            else "--quarantine-dry-run" if args.quarantine_dry_run else None)


def _run(args: argparse.Namespace, plans: list, report_dir: Path | None, old: dict,
         note: str | None) -> int:
    from trainer.faults import NETWORK_KINDS

    from .processes import ClusterError
    from .report import write_report

    namespaced = not args.one_host and args.hosts != "loopback"
    try:  # before the hosts: a second demo exits before building any
        lock = acquire_lock()
    except DemoLocked as e:
        print(f"lightkeeper demo: {e}", file=sys.stderr)
        return 1
    fabric, hosts_note = None, None
    if namespaced:
        try:
            fabric, hosts_note = build_fabric(args.groups + args.spare_hosts)
        except KeyboardInterrupt:  # what was made of the hosts is removed already
            print("\nlightkeeper demo: interrupted while building the hosts; nothing started",
                  file=sys.stderr)
            os.close(lock)
            return 130
        if fabric is None and args.hosts == "netns":
            print(f"lightkeeper demo: --hosts netns: {hosts_note}", file=sys.stderr)
            os.close(lock)
            return 2
    # a network fault's host is healed only once quarantined: none without quarantine
    held = _quarantine_off(args)
    network_ok = fabric is not None and not held
    if fabric is not None and held and not args.no_faults and not plans \
            and (args.soak or args.groups > 2):  # where it would have had one
        print(f"lightkeeper demo: no network fault in the scenario: with {held} a host "
              "is never quarantined, so a broken one would never be healed", flush=True)
    if args.soak:
        if args.seed is None:
            args.seed = secrets.randbelow(2**31)
        plans = soak_faults(args.seed, args.groups, args.ranks_per_group, network=network_ok)
        if args.groups < LINK_MIN_GROUPS:  # never placed (_check_plans): not drawn
            drawn = (filter(lambda p: p.kind not in LINK_KINDS, x) for x in (plans, plans.rest))
            plans = Schedule(*drawn)
        print(f"lightkeeper demo: soak of {args.soak:g}s, seed {args.seed} (--seed "
              f"{args.seed} repeats the schedule)", flush=True)
    faults = [] if args.no_faults else plans or default_faults(
        args.groups, args.ranks_per_group, network=network_ok)
    network = [p.spec for p in faults if p.kind in NETWORK_KINDS]
    if network and fabric is None:  # --hosts auto where namespaces cannot be made
        print(f"lightkeeper demo: {network[0]} is a network fault: it needs hosts that are "
              f"network namespaces (--hosts netns; {hosts_note})", file=sys.stderr)
        os.close(lock)
        return 2
    if note:  # said once the run's hosts can take its faults
        print(f"lightkeeper demo: {note}", flush=True)
    try:
        if report_dir is None:  # made 0o700, root's own when root runs it
            report_dir = Path(tempfile.mkdtemp(prefix="lightkeeper-demo-")).resolve()
        else:
            _make_report_dir(report_dir)
        refused = None
    except OSError as e:
        refused = f"{report_dir}: {e.strerror or e}"
    except ValueError as e:
        refused = str(e)
    if refused:
        print(f"lightkeeper demo: --report-dir {refused}", file=sys.stderr)
        if fabric:
            fabric.close()
        os.close(lock)
        return 2
    sc = Scenario(faults=faults, healthy_s=args.healthy_s, end_s=args.end_s,
                  ledger_wait_s=args.ledger_wait_s,
                  slow_delay_s=args.slow_delay_s, strike_timeout_s=args.strike_timeout_s,
                  detect_timeout_s=args.detect_timeout_s,
                  evict_timeout_s=args.evict_timeout_s, rejoin_timeout_s=args.rejoin_timeout_s,
                  step_pause_s=args.step_pause_s, hang_floor_s=args.hang_floor_s,
                  pg_timeout_s=args.pg_timeout_s, heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                  join_timeout_ms=args.join_timeout_ms,
                  # nothing is evicted with --no-faults or --dry-run: no restart to be ready for
                  warm_spares=not (args.cold_restarts or args.no_faults or args.dry_run))
    demo = Demo(args, sc, report_dir, fabric)
    inside = fabric.entered() if fabric else contextlib.nullcontext()
    inside.__enter__()  # the demo's own requests reach the job's network
    demo.deadline = args.duration if args.duration is not None else (
        60.0 if not faults and not args.steps else None)
    code, bug = 0, None
    try:
        print(f"lightkeeper demo: {args.groups} replica groups x {args.ranks_per_group} rank(s); "
              f"report and logs in {report_dir}", flush=True)
        if hosts_note:
            print(f"lightkeeper demo: {hosts_note}", flush=True)
        elif fabric:
            print(f"lightkeeper demo: hosts are network namespaces "
                  f"({', '.join(f'{h.node} {h.addr}' for h in fabric.hosts)}; the Lighthouse "
                  f"and monitor on {fabric.ctl_addr})", flush=True)
        try:
            demo.start()
            if args.soak:
                from .soak import rss_kb

                demo.soak["rss"].append({"life": 1, "start_kb": rss_kb(demo.monitor_proc.pid)})
            demo.run_scenario()
        except Stop as e:
            demo.event("stop", None, str(e))
        if args.keep_running:
            demo.keeping = True  # from here only Ctrl-C or SIGTERM ends it
            demo.refill_spares(wait=False)  # an eviction by hand restarts warm too
            write_report(demo, report_dir, final=False)
            print_keep_running(demo)
            while True:
                demo.tick()
    except Stop:
        pass
    except KeyboardInterrupt:
        if demo.keeping:  # the way --keep-running ends: the scenario itself completed
            say("\nlightkeeper demo: stopping everything")
        else:
            demo.interrupted = True
            code = 130
            say("\nlightkeeper demo: interrupted; stopping everything")  # `| tee` dies with it
    except (ClusterError, TimeoutError, OSError) as e:
        if isinstance(e, BrokenPipeError) and reader_gone():
            mute()  # `| head` stopped reading: the cleanup and the report go on without it
            demo.error, code = f"its output's reader went away ({e})", 141  # 128 + SIGPIPE
        else:
            demo.error = str(e)
            code = 1
            print(f"lightkeeper demo: {e}", file=sys.stderr, flush=True)
    except Exception as e:  # a bug: stopped and reported as any failure, raised after the report
        demo.error, code, bug = f"{type(e).__name__}: {e}", 1, e
    finally:
        # a second Ctrl-C (or SIGTERM, SIGHUP) would lose the report: everything is being
        # stopped already, and they stay ignored until the report is written (a late SIGHUP
        # still mutes the output it would break)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN if old.get(signal.SIGHUP) == signal.SIG_IGN
                      else mute)
        if reader_gone():  # the reader left after the last line: the stop's lines would fail
            mute()
            code = code or 141
        try:
            for tr in demo.tracks:
                tr.stop(demo.now())
            if demo.monitor_url and demo.monitor_proc and demo.monitor_proc.poll() is None:
                demo.poll_goodput()  # the ledger's last word, before the monitor stops
                if args.soak:
                    from .soak import rss_kb

                    demo.soak["rss"].append({"life": 1 + ("restart" in demo.soak),
                                             "end_kb": rss_kb(demo.monitor_proc.pid)})
            demo.stop()
        finally:
            inside.__exit__(None, None, None)
            if fabric:
                fabric.close()  # after its processes: nothing is left inside
            os.close(lock)
    summary = write_report(demo, report_dir, final=True)
    say(summary)
    if args.soak:
        import json

        from . import soak

        out = soak.summary(json.loads((report_dir / "report.json").read_text()), demo.soak,
                           demo.samples)
        out["command"] = " ".join(["lightkeeper", *sys.argv[1:]])
        (report_dir / "soak.json").write_text(json.dumps(out, indent=1))
        say(soak.table(out))
    picture = report_dir / "timeline.png"
    say(f"report: {report_dir / 'report.md'}  json: {report_dir / 'report.json'}  timeline: "
         + (str(picture) if picture.exists() else
            f"not drawn ({report_dir / 'timeline.error.txt'})"))
    for sig, handler in old.items():
        signal.signal(sig, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if bug is not None:
        raise bug
    if code == 0 and demo.faults and any(f["outcome"] != "recovered" for f in demo.faults) \
            and not args.dry_run:
        print("lightkeeper demo: not every fault went the whole way; see the table",
              file=sys.stderr)
    return code


def build_fabric(hosts: int):
    """(a fabric of ``hosts`` namespaced hosts, None) or (None, the one line that says why not
    and that loopback addresses stand in)."""
    from .fabric import MAX_HOSTS, Fabric, FabricError

    why = Fabric.unavailable()
    if why is None and hosts > MAX_HOSTS:  # --hosts auto: more than a fabric has addresses for
        why = f"{hosts} hosts, a fabric has at most {MAX_HOSTS}"
    if why is None:
        stale = Fabric.sweep_stale()  # what a killed earlier run left
        if stale:
            print(f"lightkeeper demo: removed what a killed earlier demo left: {', '.join(stale)}",
                  flush=True)
        try:
            return Fabric.create([f"node-{i}" for i in range(hosts)]), None
        except FabricError as e:
            why = str(e).splitlines()[0]
    return None, f"hosts are loopback addresses, not network namespaces ({why})"


def print_keep_running(demo: Demo) -> None:
    token = shlex.quote(str(demo.admin_token_path))
    lines = ["", f"the cluster keeps running (Ctrl-C or SIGTERM to PID {os.getpid()} stops it); "
                 f"report so far in {demo.dir}. Try:",
             f"  curl {demo.user_url(demo.monitor_url)}/v1/cluster",
             f"  curl {demo.user_url(demo.monitor_url)}/v1/findings",
             f"  curl {demo.user_url(demo.monitor_url)}/v1/evictions",
             f"  curl {demo.user_url(demo.monitor_url)}/v1/hosts",
             # the admin token stays in its file (the header line; curl >= 7.55 reads it, so it
             # is in no argv either): this output is also demo.log's
             f"  curl -X POST -H @{token} "
             f"{demo.user_url(demo.monitor_url)}/v1/hosts/<host>/release   # admin token",
             f"  open {demo.user_url(demo.monitor_url)}/   (monitor overview)",
             f"  Lighthouse status: {demo.user_url(demo.cluster.lighthouse_url)}/status"]
    for g, grp in sorted(demo.cluster.groups.items()):
        for r, u in sorted(grp.worker_urls.items()):
            lines.append(f"  curl {demo.user_url(u)}/v1/state      # group {g} rank {r}")
    if demo.fabric:
        lines.append(f"  (hosts are network namespaces {demo.fabric.ctl_ns} and "
                     f"{', '.join(h.netns for h in demo.fabric.hosts)}: these URLs are forwards "
                     "into them; `ip netns exec <ns> ...` reaches the rest)")
    lines.append(f"  Prometheus: {demo.prom_note or 'not started'}")
    lines.append("  Grafana: import the dashboards from dashboards/generated/ with that Prometheus "
                 "as data source (see docs/dashboards.md or `lightkeeper dashboards --help`)")
    demo.say("\n".join(lines))
