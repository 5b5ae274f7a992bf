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

This module is the command: the lock, the hosts built and the run told top to bottom
(:func:`run`, :func:`_run`); its options and their checks are in :mod:`lightkeeper.demo_options`,
``--report-dir``'s in :mod:`lightkeeper.demo_reportdir`. The running demo is
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
import sys
import tempfile
from pathlib import Path

from .demo_loop import Demo, Stop
from .demo_options import (
    LINK_KINDS,
    LINK_MIN_GROUPS,
    add_arguments,
    bad_numbers,
    check_plans,
    quarantine_off,
)
from .demo_output import mute, reader_gone, say
from .demo_reportdir import check_report_dir, make_report_dir
from .scenario import Scenario, Schedule, default_faults, parse_inject, soak_faults

__all__ = ["add_arguments", "run"]  # the command, as lightkeeper/cli.py runs it

LOCK_NAME = "lightkeeper-demo.lock"
MAX_LOOPBACK_HOSTS = 250  # 127.0.0.2..127.0.0.251
LEDGER_WAIT_S = Scenario.ledger_wait_s  # the default wait for the ledger's back-at-pace verdicts


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
    bad = bad_numbers(args)
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
    refused, note = check_plans(args, plans)
    if refused:
        print(f"lightkeeper demo: {refused}", file=sys.stderr)
        return 2
    try:  # before the lock and the hosts: a run never starts without a place for its report
        report_dir = check_report_dir(args.report_dir)
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
    held = quarantine_off(args)
    network_ok = fabric is not None and not held
    if fabric is not None and held and not args.no_faults and not plans \
            and (args.soak or args.groups > 2):  # where it would have had one
        print(f"lightkeeper demo: no network fault in the scenario: with {held} a host "
              "is never quarantined, so a broken one would never be healed", flush=True)
    if args.soak:
        if args.seed is None:
            args.seed = secrets.randbelow(2**31)
        plans = soak_faults(args.seed, args.groups, args.ranks_per_group, network=network_ok)
        if args.groups < LINK_MIN_GROUPS:  # never placed (check_plans): not drawn
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
            make_report_dir(report_dir)
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
