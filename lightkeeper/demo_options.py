"""``lightkeeper demo``'s options, and the checks that refuse what they ask before anything
starts (:func:`lightkeeper.demo.run` says each refusal)."""

from __future__ import annotations

import argparse

from .scenario import Scenario


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


def bad_numbers(args: argparse.Namespace) -> str | None:
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


LINK_KINDS = ("partition", "slow_link")  # placed by comparing hosts' links: a bad one
LINK_MIN_GROUPS = 3  # between two hosts is neither's (monitor/detect/network.py)


def baseline_steps() -> int:
    """Healthy steps ``job_slow`` takes its baseline over at the monitor's defaults (the demo's)."""
    from monitor.config import DetectorConfig

    cfg = DetectorConfig()
    return cfg.job_baseline_windows * cfg.straggler_steps


def check_plans(args: argparse.Namespace, plans: list) -> tuple[str | None, str | None]:
    """(why a fault given by ``--inject`` would never strike, or a network one never be found or
    healed; a line to say before the run), each None when there is nothing to say."""
    from trainer.faults import parse_fault

    held = quarantine_off(args)
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


def quarantine_off(args: argparse.Namespace) -> str | None:
    """The flag that keeps the monitor from quarantining a host (None: it quarantines). The
    demo heals a network fault's host only once it is quarantined, so these runs get none."""
    # --dry-run first: with it the monitor quarantines nothing whatever the others say
    return ("--dry-run" if args.dry_run
            else "--no-quarantine" if args.no_quarantine
            else "--quarantine-dry-run" if args.quarantine_dry_run else None)
