"""One monitor over 100,000 simulated ranks (12,500 replica groups x 8) with leader polling.

The ranks are virtual: ``--procs`` (2) server processes (tests/support/virtual_ranks.py) each answer
``/v1/state`` for a slice of them, every rank addressed as ``http://127.0.0.1:<port>/r/<rank>``
(this machine allows 20,000 open files per process, not 100,000 ports). The monitor is the real
one (discovery, poller, view, schedule, verification off, detectors, goodput, metrics), in
this process, with ``--leader-polling on``. It reports:

- the first sweep (every rank), then the leader sweeps' ``sweep_once`` wall time and the period
  from one's start to the next's (the monitor's loop is played by ``Monitor.wait_next``: the
  interval, and the next sweep's ranks asked in time for it);
- a hang planted in a non-leader rank of one group: how long until that group is drilled
  (every one of its ranks polled in one sweep), how long the drilled sweep takes, and when
  the hang is confirmed (from the drilled group's Flight Recorder: the virtual ranks serve a
  small generated one), against the target max(5 s, 5 x step): the moment the detectors
  return it (``hang_detected_after_s``) and the end of that sweep (``hang_confirmed_after_s``),
  with a timeline per sweep (``hang_timeline``: the leader's reported wait, the drill, the
  Flight Recorder fetch, seconds per stage);
- a straggler group (``--straggler-lag`` seconds late from one step on): how many of its steps
  until the straggler finding is confirmed (the ranks serve per-step timings), counted from
  the start of its first slow step, with a timeline per sweep (``straggler_timeline``);
- ``healthy_drilled_groups``: the groups drilled in each healthy leader sweep (none expected),
  and for each sweep that drilled any, why and which polls failed (``healthy_drill_reasons``);
- the monitor process's RSS, and its own CPU seconds per sweep and the wait after it (all its
  threads; the virtual ranks' processes excluded), and the seconds its cyclic garbage
  collector took per sweep; of it, the thread that polls (the in-thread poller: HTTP and
  JSON) or reads the poller process's answers (JSON); the poller process's CPU (monitor/poll/poll_process.py, from 50,000
  targets) and the virtual ranks' processes' CPU seconds per leader sweep beside it;
- ``poll_to_findings``: per leader sweep, the seconds from asking its ranks to its detectors'
  end (with the poller process the next sweep is asked during this one, in time for it: this
  is how old the answers are when the findings are made).

Members are polled every ``--member-interval`` 30 s (the monitor's default is 10 s): at 100,000
ranks 12,500 leaders + 2,900 members a sweep instead of + 8,750 (~15,400 requests instead of
~21,250, each costing the poller and the ranks' servers CPU on the same cores). What a sweep
must find does not come from members: a non-leader's hang shows on its leader (blocked in the
in-group collective: the group is drilled, every rank polled every sweep), a straggler group on
its leader's step timings, and a member that stops answering is polled again every sweep from
its first failed poll (docs/scaling.md, "Leader polling"). 30 s bounds how late a rank-level
change with a healthy leader is seen (a member's WorkerServer gone while training goes on).

The simulated ranks share the machine's cores with the monitor, so on a small box the figures
are pessimistic; the load average is printed with them. ``--ranks-nice N`` starts the virtual
ranks' processes at that niceness: the kernel then gives the monitor (and its poller process)
the cores first and the simulated ranks what is left, nearer a real job's ranks, which run on
other machines. Their CPU is still spent on the same cores, so the figures stay an upper bound.
``--ranks-cpus 1`` confines the virtual ranks to those CPUs (the monitor and its poller process
may use every core): on a 2-core box the ranks then take their CPU from one core, as a real
job's ranks take none of the monitor host's. The leader sweep's wall time is the sweeping
thread's own CPU plus what other processes take from its core
(``leader_main_cpu_median_s``: that thread's CPU in ``sweep_once``).

    .venv/bin/python benchmarks/bench_monitor_100k.py --groups 12500 --group-size 8
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_monitor_sweep import rss_mib  # noqa: E402
from monitor.config import MonitorConfig  # noqa: E402
from monitor.detect import current_wait  # noqa: E402
from monitor.service import Monitor  # noqa: E402
from tests.support.monitor_sim import raise_fd_limit  # noqa: E402


class GcClock:
    """Seconds this process's cyclic garbage collector has run since :meth:`take`."""

    def __init__(self) -> None:
        self.seconds, self._began = 0.0, None
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began

    def take(self) -> float:
        out, self.seconds = self.seconds, 0.0
        return out


def save(row: dict, path: str | None) -> int:
    """Write the results as JSON when ``path`` is given; the exit status."""
    if path:
        with open(path, "w") as f:
            json.dump(row, f, indent=1)
    return 0


def start(n: int, procs: int, group_size: int, step_s: float,
          source: str | None = None, nice: int = 0, cpus: set[int] | None = None
          ) -> tuple[list, list[str]]:
    """``procs`` virtual-rank processes serving ranks 0..n-1, whole groups each: this tree's
    tests/support/virtual_ranks.py, or ``source`` (another revision's) run with ``-c``;
    ((process, first rank, ranks), URLs). ``nice``: their niceness; ``cpus``: the CPUs they
    may run on (default: any)."""
    per = -(-n // procs)
    per = -(-per // group_size) * group_size  # whole groups per process
    out, urls = [], []
    epoch = time.monotonic()  # one step clock for every process: groups step in lockstep
    for offset in range(0, n, per):
        k = min(per, n - offset)
        argv = ["--ranks", str(k), "--offset", str(offset), "--group-size", str(group_size),
                "--step-s", str(step_s)]
        if source is None:  # another revision's server may not know it
            argv += ["--epoch", repr(epoch)]
        cmd = [sys.executable, "-m", "tests.support.virtual_ranks", *argv] if source is None \
            else [sys.executable, "-c", source, *argv]
        p = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, preexec_fn=partial(_lower, nice, cpus))
        out.append((p, offset, k))
    for p, offset, k in out:
        line = p.stdout.readline()
        if not line.startswith("VRANKS "):
            raise RuntimeError(f"virtual ranks failed: {line!r}")
        port = int(line.split()[1])
        urls += [f"http://127.0.0.1:{port}/r/{r}" for r in range(offset, offset + k)]
    return out, urls


def anon_huge_mib() -> float | None:
    """This process's memory on transparent huge pages (smaps_rollup's AnonHugePages), MiB."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def box_reference_s(n: int = 15_000, repeats: int = 5) -> float:
    """The cores' speed now: the least thread CPU seconds, of ``repeats``, that a fixed workload
    takes: ``json.loads`` of ``n`` documents of a packed ``/v1/state``'s keys and size (written
    here, once) and a dict of what a view reads of each. Only the standard library and fixed
    input, so it does not change when this tree's code does. A record, not a yardstick: on this
    box it moved 10 % between two hours in which the sweep's CPU halved, since what drifts here
    is the cost of reaching memory (docs/scaling.md, round 18). The GC is off while it runs, as
    in a leader sweep."""
    docs = [json.dumps({
        "job": "ref", "replica_group": i // 8, "replica_id": f"replica_group_{i // 8}:ref",
        "group_rank": i % 8, "group_world_size": 8, "rank": i, "host": f"node-{i // 8}",
        "pid": 1000 + i, "worker_url": None, "step": 1000 + i % 7, "quorum_id": 3,
        "num_participants": 12, "participating": True, "phase": "forward",
        "phase_since": 1.7e9 + i / 7, "finished": False, "stopped_by": None,
        "last_step_seconds": 1.0 + i / 1e6,
        "last_step_at": 1.7e9 + i / 9, "recent_step_seconds": "zeIjIQAA8D82Z/bPAQDwP5/ryH4D",
        "commits": 1000, "commit_failures": 0, "heals": 0, "quorum_changes": 0, "loss": 1.0,
        "lighthouse": None, "torch_version": "ref", "torchft_version": "ref",
        "started_at": 1.7e9, "faults": [], "node": f"node-{i // 8}",
        "hostname": f"node-{i // 8}", "local_rank": i % 8,
        "device": {"type": "cuda", "index": i % 8, "uuid": f"GPU-{i:08d}-0000-4c3a-9d1e"},
        "faults_struck_at": {}, "timing": {
            "recent": "AAAAAAAAAADN4iMhAADwP3ARXC49Cu8/u8emkOl6lD/6ep/Z8XqEPwEAAAAAAAAANmf2zw",
            "waiting": None, "last_step": {"step": 999, "step_s": 1.0 + i / 3e6,
                                           "compute_s": 0.96 + i / 5e6,
                                           "wait_cross_s": 0.026, "wait_group_s": 0.013},
            "window": None}, "packed": 1}).encode() for i in range(n)]
    best = float("inf")
    was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            t = time.thread_time()
            index = {}
            for d in map(json.loads, docs):
                index[d["rank"]] = (d["replica_group"], d["step"], d["phase"], d.get("host"))
            best = min(best, time.thread_time() - t)
            del index
    finally:
        if was:
            gc.enable()
    return best


def _lower(nice: int, cpus: set[int] | None) -> None:
    """In a virtual-rank process before it runs: its niceness and the CPUs it may use."""
    if nice:
        os.nice(nice)
    if cpus:
        os.sched_setaffinity(0, cpus)


def cpu_of(procs: list) -> float:
    """User + system CPU seconds the virtual-rank processes have used."""
    return sum(proc_cpu(f"/proc/{p.pid}/stat") for p, _, _ in procs)


def proc_cpu(stat_path: str) -> float:
    """User + system CPU seconds of a process or thread (/proc/.../stat)."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def stop(procs: list) -> None:
    for p, _, _ in procs:
        try:
            p.stdin.close()
        except OSError:
            pass
    for p, _, _ in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def tell(procs: list, line: str) -> None:
    for p, _, _ in procs:
        p.stdin.write(line + "\n")
        p.stdin.flush()


def sweep_plan(mon: Monitor):
    """The plan the last sweep polled (``schedule.last`` may already be the next sweep's, asked
    ahead; a tree before that has no ``sweep_plan``)."""
    return getattr(mon, "sweep_plan", None) or mon.schedule.last


def drill_reasons(plan) -> dict[str, int]:
    """Why ``plan``'s groups were drilled (its reasons, numbers cut), groups each, the four
    most common."""
    reasons: dict[str, int] = {}
    for why in (plan.drilled.values() if plan is not None else ()):
        key = why.split(" for ")[0].rstrip("0123456789.s ")
        reasons[key] = reasons.get(key, 0) + 1
    return dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:4])


def unanswered(view) -> dict[str, int]:
    """The ranks ``view``'s sweep polled that did not answer, by reason."""
    out: dict[str, int] = {}
    for url in view.polled or ():
        r = view.ranks.get(url)
        if r is not None and not r.reachable:
            out[r.reason or "?"] = out.get(r.reason or "?", 0) + 1
    return out


class PollerCpu:
    """CPU seconds of the polling, apart from the rest of the monitor: ``child`` the poller
    process's (monitor/poll/poll_process.py; 0 with the in-thread poller), ``thread`` the monitor
    process's thread that polls (the in-thread poller's event loop) or reads the child's
    answers (parsing their JSON)."""

    def __init__(self, mon: Monitor) -> None:
        self.mon = mon

    def read(self) -> tuple[float, float]:
        poller = self.mon.polling.poller
        child = getattr(poller, "_child", None)
        if child is not None:
            return (proc_cpu(f"/proc/{child.proc.pid}/stat"),
                    proc_cpu(f"/proc/self/task/{child.reader.native_id}/stat"))
        return 0.0, proc_cpu(f"/proc/self/task/{poller._thread.native_id}/stat")


def child_peak_rss_mib(mon: Monitor) -> float | None:
    """The poller process's peak resident memory, MiB (None with the in-thread poller)."""
    pid = getattr(mon.polling.poller, "pid", None)
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))


class PollToFindings:
    """Seconds from a sweep's asking its ranks (/v1/state: the first such request after the
    previous sweep's detectors, which with the poller process may be sent during the previous
    sweep) to its detectors' end: how old the answers are when the findings are made."""

    def __init__(self, mon: Monitor) -> None:
        self.asked: list[float] = []
        self.decided: list[float] = []
        poller = mon.polling.poller
        name = "start" if hasattr(poller, "start") else "sweep"
        ask = getattr(poller, name)

        def asking(urls, path="/v1/state", *a, **k):
            if path == "/v1/state":
                self.asked.append(time.monotonic())
            return ask(urls, path, *a, **k)

        setattr(poller, name, asking)
        update = mon.detectors.update

        def detecting(*a, **k):
            try:
                return update(*a, **k)
            finally:
                self.decided.append(time.monotonic())

        mon.detectors.update = detecting

    def ages(self) -> list[float]:
        out = []
        for before, end in zip(self.decided, self.decided[1:], strict=False):
            asked = [t for t in self.asked if before < t < end]
            if asked:
                out.append(end - asked[0])
        return out


class StageClock:
    """Wall seconds per stage of the monitor's sweeps (its poller's sweeps, the view, the
    Flight Recorder fetch, the detectors, the goodput ledger with its write), by wrapping those
    methods on the instances; :meth:`take` returns and restarts them. With the poller process,
    ``poll`` is the time spent waiting for and parsing answers (``PollHandle.result``), not the
    time a sweep asked ahead was in flight meanwhile; ``poll_wait``, of it, how long after the
    sweep asked for them its last answers came (the poll path's round trip the sweep waits on;
    the answers that came before are read meanwhile)."""

    def __init__(self, mon: Monitor) -> None:
        self.seconds: dict[str, float] = {}
        ask = ("start", self._timed_start) if hasattr(mon.polling.poller, "start") \
            else ("sweep", self._timed)
        for name, obj, attr, wrap in (("poll", mon.polling.poller, *ask),
                                      ("view", mon.views, "update", self._timed),
                                      ("fr", mon.polling, "fr_dumps", self._timed),
                                      ("detect", mon.detectors, "update", self._timed),
                                      # the goodput ledger and its write, in the sweep's tail
                                      ("goodput", mon.goodput, "account", self._timed)):
            setattr(obj, attr, wrap(name, getattr(obj, attr)))

    def _timed_start(self, name: str, fn):
        clock = self

        class Timed:  # the handle, its result() timed
            def __init__(self, handle) -> None:
                self.handle = handle

            def __getattr__(self, attr: str):
                return getattr(self.handle, attr)

            def result(self):
                called = time.monotonic()
                try:
                    return clock._timed(name, self.handle.result)()
                finally:
                    came = getattr(self.handle, "finished_at", None)
                    if came is not None:
                        clock.seconds["poll_wait"] = clock.seconds.get("poll_wait", 0.0) \
                            + max(0.0, came - called)

        return lambda *a, **k: Timed(fn(*a, **k))

    def _timed(self, name: str, fn):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
        return timed

    def take(self) -> dict[str, float]:
        out, self.seconds = {k: round(v, 3) for k, v in self.seconds.items()}, {}
        return out


def unwrap(mon: Monitor) -> None:
    """The classes' own methods again where a phase wrapped them on the instances."""
    for obj, attr in ((mon.polling, "fr_dumps"), (mon.detectors, "update"),
                      (mon.polling.poller, "sweep"), (mon.polling.poller, "start"),
                      (mon.views, "update"), (mon.goodput, "account")):
        obj.__dict__.pop(attr, None)


class SweepFacts:
    """Per sweep, what lengthens it besides its polls: the Flight Recorder fetch's reason and
    whether it skipped the leaders' dumps (monitor/polling.py), whether the goodput ledger's
    snapshot was written, and the CPU of the monitor's process and of the poller process."""

    def __init__(self, mon: Monitor) -> None:
        self.mon = mon
        self.pollers = PollerCpu(mon)

    def before(self) -> None:
        self._cpu, self._child = time.process_time(), self.pollers.read()[0]
        self._saved = getattr(self.mon.goodput, "_saved_at", None)

    def after(self) -> dict:
        mon = self.mon
        plan = sweep_plan(mon)
        return {"polled": len(plan.urls) if plan is not None else None,
                "drilled": drill_reasons(plan),
                "fr": getattr(mon.detectors, "_fr_reason", None),
                "fr_leaders_skipped": mon.polling.fr_leaders_skipped,
                "goodput_saved": getattr(mon.goodput, "_saved_at", None) != self._saved,
                "cpu_s": round(time.process_time() - self._cpu, 3),
                "child_cpu_s": round(self.pollers.read()[0] - self._child, 3)}


def hang_phase(mon: Monitor, procs: list, g: int, victim: int, args,
               sweep_s: float = 1.0) -> dict:
    """Plant a hang in ``victim`` (a non-leader of group ``g``) and sweep until it is confirmed:
    the timeline, in seconds after the onset (the moment the virtual ranks hear it and stop):
    each sweep's start and end, the wait group g's leader reported in it, whether g was
    drilled (and why), when its Flight Recorder was fetched, and when the hang was confirmed
    (the end of the sweep that confirmed it; and the finding's own confirmed_at, the monitor's
    clock when that sweep's detectors ran).

    ``--hang-onset start`` (the default, every earlier round's) plants it right before a sweep
    starts, so which sweep first reads a wait over the hang threshold is set by the first
    sweeps' lengths; ``random`` plants it from a timer after a uniformly random part of a leader
    sweep (``sweep_s``) while the monitor sweeps, as a real hang starts at any point of a sweep:
    over runs, the average (the timeline's first sweep may then start before the onset)."""
    fetched: list[float] = []
    fetch_fr = mon.polling.fr_dumps
    ranks = set(range(g * args.group_size, (g + 1) * args.group_size))

    def timed_fetch(view, now):  # when the drilled group's dumps are in
        dumps = fetch_fr(view, now)
        if ranks & dumps.keys():
            fetched.append(time.perf_counter())
        return dumps

    mon.polling.fr_dumps = timed_fetch
    stages = StageClock(mon)  # the FR fetch's stage includes the drilled group's
    confirmed_at: list[float] = []
    update = mon.detectors.update

    def timed_update(*a, **k):  # the moment the detectors return the hang: confirmed
        new = update(*a, **k)
        if any(f.kind == "hang" for f in new):
            confirmed_at.append(time.perf_counter())
        return new

    mon.detectors.update = timed_update
    facts = SweepFacts(mon)
    timeline, out = [], {"hang_target_s": max(5.0, 5 * args.step_s),
                         "hang_onset": args.hang_onset}
    planted: list[tuple[float, float]] = []  # (perf_counter, time.time) once the ranks heard it

    def plant() -> None:
        tell(procs, f"hang {victim}")  # every group stops stepping, as in a real job
        planted.append((time.perf_counter(), time.time()))

    began = time.perf_counter()
    if args.hang_onset == "random":
        delay = random.uniform(0.0, sweep_s)
        timer = threading.Timer(delay, plant)
        timer.start()
        out["hang_onset_delay_s"] = round(delay, 3)
    else:
        timer = None
        plant()
    try:
        while time.perf_counter() - began < 60:
            t, started = time.perf_counter(), time.monotonic()
            facts.before()
            mon.sweep_once()
            end = time.perf_counter()
            plan = sweep_plan(mon)
            lead = mon.view.groups[g].leader if g in mon.view.groups else None
            scope, secs = current_wait(lead.state) if lead is not None and lead.fresh \
                else (None, None)
            hangs = [f for f in mon.detectors.open_findings() if f.kind == "hang"]
            # perf_counter times, made seconds after the onset at the end
            timeline.append({"start": t, "end": end,
                             "leader_wait": None if scope is None else [scope, secs],
                             "drilled": plan.drilled.get(g),
                             "fr_fetched": fetched[-1] if fetched and fetched[-1] >= t else None,
                             "confirmed": bool(hangs), "stages_s": stages.take(),
                             **facts.after()})
            if not planted:  # a sweep before the onset (--hang-onset random)
                mon.wait_next(started)
                continue
            onset, onset_wall = planted[0]
            if plan.drilled.get(g) and "hang_drilled_after_s" not in out:
                out.update(hang_drilled_after_s=end - onset, drilled_sweep_s=end - t,
                           drill_reason=plan.drilled[g], drilled_groups=len(plan.drilled))
            if hangs:
                out.update(hang_confirmed_after_s=end - onset,
                           hang_detected_after_s=confirmed_at[0] - onset if confirmed_at
                           else None,
                           hang_confirmed_at_s=min(f.confirmed_at for f in hangs) - onset_wall,
                           hang_findings=[(f.replica_group, f.ranks, f.evidence.get("level"))
                                          for f in hangs][:5])
                break
            mon.wait_next(started)  # the monitor's loop: its interval, the next polls asked
    finally:
        if timer is not None:
            timer.join()
        unwrap(mon)
    onset = planted[0][0] if planted else began
    for row in timeline:  # seconds after the onset
        for k in ("start", "end", "fr_fetched"):
            if row[k] is not None:
                row[k] = round(row[k] - onset, 3)
    out["hang_timeline"] = timeline
    return out


def straggler_phase(mon: Monitor, procs: list, slow: int, args) -> dict:
    """Heal the hang, then make group ``slow`` late by ``--straggler-lag`` from its next step on
    and sweep until the straggler is confirmed. Steps are counted from the start of its first
    slow step (the virtual ranks say when that is: ``SLOW <step> <monotonic start>``), and also
    from the command. The timeline: per sweep its end, the group's lag as judged, the windows
    counted so far."""
    tell(procs, "heal")
    settle = time.perf_counter()
    while time.perf_counter() - settle < 20 and mon.detectors.open_findings():
        mon.sweep_once()  # findings of the hang resolve once every group steps
    tell(procs, f"slow {slow} {args.straggler_lag}")
    commanded = time.perf_counter()
    starts = [float(p.stdout.readline().split()[2]) for p, _, _ in procs]
    onset = min(starts)  # the earliest process's first slow step: the longer latency
    confirmed, sweeps_s, timeline = None, [], []
    stages, facts, detected = StageClock(mon), SweepFacts(mon), []
    update = mon.detectors.update

    def timed_update(*a, **k):  # the moment the detectors return the straggler: confirmed
        new = update(*a, **k)
        if any(f.kind == "straggler" and f.replica_group == slow for f in new):
            detected.append(time.perf_counter())
        return new

    mon.detectors.update = timed_update
    try:
        while time.perf_counter() - commanded < args.straggler_wait:
            t, started = time.perf_counter(), time.monotonic()
            facts.before()
            mon.sweep_once()
            end = time.perf_counter()
            sweeps_s.append(end - t)
            mem = mon.detectors._groups.get(slow)
            timeline.append({"end": round(end - onset, 3), "sweep_s": round(end - t, 3),
                             "lag": mon.detectors.last_lags.get(slow),
                             "windows": mem.straggler_windows if mem is not None else None,
                             "newest_step_judged": mem.straggler_newest if mem is not None
                             else None, "stages_s": stages.take(), **facts.after()})
            if any(f.kind == "straggler" and f.replica_group == slow
                   for f in mon.detectors.open_findings()):
                confirmed = end
                break
            mon.wait_next(started)
    finally:
        unwrap(mon)
    return {"straggler_group": slow, "straggler_lag_s": args.straggler_lag,
            # the moment its detectors returned it, in the confirming sweep (before its end)
            "straggler_detected_after_steps": (detected[0] - onset) / args.step_s
            if detected else None,
            "straggler_onset_after_command_s": onset - commanded,
            "straggler_confirmed_after_s": None if confirmed is None else confirmed - onset,
            "straggler_confirmed_after_steps": None if confirmed is None
            else (confirmed - onset) / args.step_s,
            "straggler_confirmed_after_command_steps": None if confirmed is None
            else (confirmed - commanded) / args.step_s,
            "straggler_sweeps_median_s": statistics.median(sweeps_s),
            "straggler_timeline": timeline,
            "other_findings": sorted({(f.kind, f.replica_group)
                                      for f in mon.detectors.open_findings()
                                      if f.replica_group != slow})[:10]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=12_500)
    ap.add_argument("--group-size", type=int, default=8)
    # 2 server processes, not 8: a little cheaper per answer (each wakes for more answers at
    # once: 34-40 us against 42.5 us in two runs of bench_poller.py --also-procs 8, results/
    # poller_vm2core.json), and a quarter of the processes' memory
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--sweeps", type=int, default=10)
    ap.add_argument("--step-s", type=float, default=0.5)
    ap.add_argument("--member-interval", type=float, default=30.0)
    ap.add_argument("--straggler-lag", type=float, default=0.5)
    ap.add_argument("--hang-onset", choices=("start", "random"), default="start",
                    help="start: the hang planted right before a sweep (every earlier round's); "
                         "random: at a uniformly random point of a leader sweep (the average)")
    ap.add_argument("--straggler-wait", type=float, default=120.0,
                    help="give up on the straggler's confirmation after this many seconds")
    ap.add_argument("--poller", choices=("auto", "thread"), default="auto",
                    help="thread: keep the in-thread poller at any size (the monitor's before "
                         "monitor/poll/poll_process.py), for side-by-side runs; auto: the monitor's "
                         "choice (its own process from poll_process_min_targets)")
    ap.add_argument("--ranks-nice", type=int, default=0,
                    help="niceness of the virtual ranks' processes (0: as the monitor's; 19: "
                         "the monitor first, nearer ranks on other machines)")
    ap.add_argument("--ranks-cpus", default=None,
                    help="CPUs the virtual ranks' processes may run on, e.g. 1 or 2,3 "
                         "(default: any; the monitor may always use every CPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    raise_fd_limit()
    gc_clock = GcClock()
    n = args.groups * args.group_size
    reference = box_reference_s()  # before the ranks' processes start: nothing else runs
    cpus = {int(c) for c in args.ranks_cpus.split(",")} if args.ranks_cpus else None
    procs, urls = start(n, args.procs, args.group_size, args.step_s, nice=args.ranks_nice,
                        cpus=cpus)
    row: dict = {"load_average_start": os.getloadavg()[0],
                 "ranks": n, "groups": args.groups, "group_size": args.group_size,
                 "procs": len(procs), "step_s": args.step_s, "poller": args.poller,
                 "member_interval_s": args.member_interval,
                 "ranks_nice": args.ranks_nice,
                 "ranks_cpus": sorted(cpus) if cpus else None}
    try:
        with tempfile.TemporaryDirectory() as d:
            mon = Monitor(MonitorConfig(port=0, targets=urls, state_path=os.path.join(d, "m.db"),
                                        sd_out=os.path.join(d, "sd.json"),  # as the CLI does
                                        poll_timeout_s=10.0, leader_polling="on",
                                        member_interval_s=args.member_interval,
                                        max_targets=n, poll_process_min_targets=1 << 62
                                        if args.poller == "thread"
                                        else MonitorConfig.poll_process_min_targets))
            try:
                t = time.perf_counter()
                view = mon.sweep_once()
                row["first_sweep_s"] = time.perf_counter() - t
                row["first_up"] = sum(r.reachable for r in view.ranks.values())
                # main_cpu: the sweeping thread's own CPU in sweep_once
                times, cpu, main_cpu, polled, gcs, ranks_cpu, child_cpu, thread_cpu, periods = (
                    [] for _ in range(9))
                drilled = []  # groups drilled per healthy sweep (should be none)
                # of the sweeps that drilled any: which sweep, why, and the polls that failed
                drill_facts = []
                pollers = PollerCpu(mon)
                ages = PollToFindings(mon)
                stages, stage_rows = StageClock(mon), []  # wall seconds per stage
                for _ in range(args.sweeps):
                    t, c, r = time.perf_counter(), time.process_time(), cpu_of(procs)
                    started = time.monotonic()
                    pc = pollers.read()
                    gc_clock.take()
                    main = time.thread_time()
                    mon.sweep_once()
                    main_cpu.append(time.thread_time() - main)
                    stage_rows.append(stages.take())
                    gcs.append(gc_clock.take())
                    times.append(time.perf_counter() - t)
                    polled.append(len(sweep_plan(mon).urls))
                    drilled.append(len(sweep_plan(mon).drilled))
                    if drilled[-1]:
                        drill_facts.append({"sweep": len(drilled) - 1,
                                            "why": drill_reasons(sweep_plan(mon)),
                                            "unanswered": unanswered(mon.view)})
                    # the monitor's loop (Monitor._loop): its 1 s interval, the next sweep's
                    # ranks asked in time for it. The CPU figures are per sweep and the wait
                    # after it (what asking ahead costs counts, wherever it is done)
                    mon.wait_next(started)
                    periods.append(time.perf_counter() - t)
                    cpu.append(time.process_time() - c)
                    ranks_cpu.append(cpu_of(procs) - r)
                    child, thread = pollers.read()
                    child_cpu.append(child - pc[0])
                    thread_cpu.append(thread - pc[1])
                unwrap(mon)
                row.update(leader_median_s=statistics.median(times), leader_max_s=max(times),
                           # start to start: the interval, or the sweep where it outlasts it
                           leader_period_median_s=statistics.median(periods),
                           leader_cpu_median_s=statistics.median(cpu),
                           leader_cpu_max_s=max(cpu), polled_median=statistics.median(polled),
                           # of it, the sweeping thread's own in sweep_once (the rest of the
                           # sweep's wall time: other processes on its core, the GIL, answers)
                           leader_main_cpu_median_s=statistics.median(main_cpu),
                           leader_main_cpu_s=[round(x, 3) for x in main_cpu],
                           # wall seconds per stage (StageClock; poll: waiting for and reading
                           # the answers)
                           leader_stages_median_s={
                               k: round(statistics.median(r.get(k, 0.0) for r in stage_rows), 3)
                               for k in sorted({k for r in stage_rows for k in r})},
                           leader_stages_s=stage_rows,  # the same, sweep by sweep
                           leader_gc_s=[round(x, 3) for x in gcs],
                           ranks_cpu_median_s=statistics.median(ranks_cpu),
                           # the monitor process's CPU (all its threads) = leader_cpu_*; of it
                           # the thread that polls or reads the poller process's answers; the
                           # poller process's own beside it (0 with the in-thread poller)
                           poller_cpu_median_s=statistics.median(thread_cpu),
                           poller_process_cpu_median_s=statistics.median(child_cpu),
                           poller_process=type(mon.polling.poller).__name__,
                           poll_to_findings_median_s=statistics.median(ages.ages()),
                           poll_to_findings_s=[round(x, 3) for x in ages.ages()],
                           leader_sweeps_s=[round(x, 3) for x in times],
                           healthy_drilled_groups=drilled,
                           healthy_drill_reasons=drill_facts)
                # a hang in a non-leader rank of a group in the middle of the job
                g = args.groups // 2
                victim = g * args.group_size + 3
                row.update(hang_phase(mon, procs, g, victim, args,
                                      sweep_s=statistics.median(times)))
                # a straggler group: every process hears it (the others wait for it)
                for p, _, _ in procs:
                    p.stdin.write("heal\n")
                    p.stdin.flush()
                settle = time.perf_counter()
                while time.perf_counter() - settle < 20 and mon.detectors.open_findings():
                    mon.sweep_once()  # findings of the hang resolve once every group steps
                row.update(straggler_phase(mon, procs, args.groups // 3, args))
                row["poller_process_peak_rss_mib"] = child_peak_rss_mib(mon)
                row["anon_huge_pages_mib"] = anon_huge_mib()  # the kernel's transparent ones
            finally:
                mon.stop()
    finally:
        stop(procs)
    # the cores' speed at the start and the end (box_reference_s)
    row["box_reference_s"] = [round(reference, 4), round(box_reference_s(), 4)]
    if "leader_median_s" in row:
        # every process's CPU a leader period (the monitor's, its poller process's, the
        # simulated ranks'), spread over every core: no period on this box can be shorter
        # (while the sweeps outlast the interval, a period is a sweep)
        row["leader_cpu_floor_s"] = round(
            (row["leader_cpu_median_s"] + row["poller_process_cpu_median_s"]
             + row["ranks_cpu_median_s"]) / (os.cpu_count() or 1), 3)
    row["rss_mib"], row["peak_rss_mib"] = rss_mib()
    row["load_average"] = os.getloadavg()[0]
    row["cores"] = os.cpu_count()
    print(json.dumps(row, indent=1))
    return save(row, args.json)


if __name__ == "__main__":
    sys.exit(main())
