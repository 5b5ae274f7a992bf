"""The poller alone: CPU per request, old and new side by side, against old and new virtual ranks.

N keep-alive targets (``http://127.0.0.1:<port>/r/<rank>``) served by ``--procs`` virtual-rank
processes (tests/support/virtual_ranks.py, the server of bench_monitor_100k.py), once with the
servers of this tree (``new``: uvloop where installed; ``new-asyncio``: the stdlib loop) and
once with the servers of ``--baseline`` (``old``: a git revision; its
``tests/support/virtual_ranks.py`` run with ``-m`` from a git archive of it). The pollers: ``new``, the ``Poller`` of
this tree in this process; ``old``, the one of ``--baseline``'s ``monitor/poll/poller.py`` (imported
from a git archive of it as package ``baseline_poll``); ``process``, this tree's ``ProcessPoller`` (its child on
uvloop where installed; ``process-asyncio``: on the stdlib loop); ``process-old``, the
``ProcessPoller`` of ``--baseline`` (its ``monitor/`` poller files, ``http_serving`` and
``rank_wire`` taken out of git into a temporary folder; the child imports them from there; the
in-process ``old`` poller shares this tree's ``rank_wire``, already imported here). ``--pairs`` picks (poller, servers) pairs; every round sweeps every target once with
each pair, in alternating order, after a warm-up sweep that opens the pooled connections; per
pair it reports the medians over rounds of:

- ``poller_us``: this process's CPU seconds (``time.process_time``, every thread: the poller's
  event loop, JSON parsing included) per request; ``poller_sys_us`` the part in the kernel
  (send, recv, epoll);
- ``child_us``: for ``process`` (this tree's Poller in its own process, monitor/poll/poll_process.py,
  the answers' JSON parsed in this one: ``poller_us``), the child's CPU seconds per request;
- ``server_us``: the virtual-rank processes' CPU seconds (user + system, /proc) per request;
- ``wall_s``: the sweep's wall time (both sides share the machine's cores);

and, as references measured in the same rounds (``references_us``): ``json_us``, ``json.loads``
of one rank's ``/v1/state`` answer (part of every poller's CPU per request: the monitor needs
the parsed document), and the cost of making one answer in either revision's virtual ranks. The cyclic GC is off during the sweeps and collects between them, as in a monitor of
20,000 targets or more (monitor/service.py).

CPU, not wall time, is the figure that matters on a loaded 2-core box; the load average is
printed with it.

    .venv/bin/python benchmarks/bench_poller.py --ranks 20000 --procs 2 --also-procs 8 --rounds 5
    .venv/bin/python benchmarks/bench_poller.py --baseline REV --rounds 7 \
        --pairs process:new,process-old:old,process-asyncio:new-asyncio,process:old,process-old:new
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_monitor_100k import cpu_of, proc_cpu, save, start, stop  # noqa: E402
from monitor.poll.poll_process import ProcessPoller  # noqa: E402
from monitor.poll.poller import Poller  # noqa: E402
from tests.support.monitor_sim import raise_fd_limit  # noqa: E402
from tests.support.virtual_ranks import VirtualRanks  # noqa: E402

BASELINE = "HEAD"  # the work tree against its last commit


def git_source(rev: str, path: str) -> str:
    got = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True,
                         text=True)
    if got.returncode:
        raise SystemExit(baseline_error(rev, f"it has no {path}"))
    return got.stdout


def baseline_error(rev: str, why: str) -> str:
    """One line for a --baseline this script cannot compare against."""
    return (f"--baseline {rev}: {why}; compare against a revision whose tree this script "
            "loads (e.g. HEAD: the work tree against its last commit). The figures measured "
            "against older revisions are in benchmarks/results/, each with its command")


def baseline_module(rev: str, path: str, name: str) -> Any:
    """The module at ``path`` as of ``rev``, imported from its source as ``name``."""
    spec = importlib.util.spec_from_loader(name, loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod.__name__] = mod  # dataclasses look their module up while decorating
    exec(compile(git_source(rev, path), f"{rev}:{path}", "exec"), mod.__dict__)
    return mod


def baseline_poll(root: str, name: str) -> Any:
    """Module ``name`` of the baseline's ``monitor/poll`` in ``root`` (:func:`baseline_tree`),
    imported as ``baseline_poll.<name>``: its relative imports then resolve in its own tree."""
    if "baseline_poll" not in sys.modules:
        path = os.path.join(root, "monitor", "poll")
        spec = importlib.util.spec_from_file_location(
            "baseline_poll", os.path.join(path, "__init__.py"), submodule_search_locations=[path])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules["baseline_poll"] = pkg
        spec.loader.exec_module(pkg)
    return importlib.import_module(f"baseline_poll.{name}")


def baseline_tree(rev: str, root: str) -> None:
    """What the baseline's poller process and virtual ranks run, taken out of git into
    ``root``: its ``monitor``, ``worker_server``, ``http_serving``, ``tests/support`` and, where
    it has one, ``rank_wire`` (else they would import this tree's)."""
    paths = ["monitor", "worker_server", "http_serving", "tests/support"]
    if subprocess.run(["git", "ls-tree", "--name-only", rev, "rank_wire"], cwd=ROOT, check=True,
                      capture_output=True, text=True).stdout.strip():
        paths.append("rank_wire")
    tar = subprocess.run(["git", "archive", rev, *paths], cwd=ROOT, check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", root], input=tar, check=True)


def module_source(root: str, args: list[str]) -> str:
    """``python -c`` source that becomes ``python -m tests.support.virtual_ranks <args> ...``
    run from ``root`` (the same process: its CPU is the server's), as bench_monitor_100k.py
    starts this tree's. Not run from source with ``-c``: a stdlib-loop server started that way
    paid mmap + mremap + munmap on every request here (glibc's mmap threshold: its 256 KiB
    receive buffer), ~2x its CPU per request, and one started with ``-m`` did not."""
    return ("import os, sys\n"
            f"os.chdir({root!r})\n"
            "os.execv(sys.executable, [sys.executable, '-m', 'tests.support.virtual_ranks', "
            f"*{args!r}, *sys.argv[1:]])\n")


def baseline_process_poller(rev: str, root: str) -> type:
    """``ProcessPoller`` of ``rev``'s ``monitor/poll/poll_process.py`` (:func:`baseline_poll`):
    its ``_ROOT`` is ``root``, from where its child runs ``rev``'s poller files."""
    if "cwd=_ROOT" not in git_source(rev, "monitor/poll/poll_process.py"):
        # its child's `python -m` would find this tree's monitor in the working folder
        raise SystemExit(baseline_error(rev, "its poller process starts in the working folder"))
    return baseline_poll(root, "poll_process").ProcessPoller


def references_us(n: int, group_size: int, old_ranks: type,
                  samples: int = 2000) -> dict[str, float | None]:
    """CPU microseconds per answer of: making a ``/v1/state`` answer with this tree's and the
    baseline's virtual ranks (``answer_us``, ``answer_old_us``), ``json.loads`` of it
    (``json_us``), and ``msgspec.json.decode`` of it where msgspec is installed (``msgspec_us``;
    not a dependency of the monitor)."""
    out: dict[str, float | None] = {}
    for key, cls in (("answer_us", VirtualRanks), ("answer_old_us", old_ranks)):
        vr = cls(n, 0, group_size, 0.5)
        vr.t0 -= 100  # 200 steps in: every answer carries its 8 timing rows
        ranks = [r * n // samples for r in range(samples)]
        for r in ranks:
            vr.state(r)  # templates made once, as in a running server
        c = time.process_time()
        bodies = [vr.state(r) for r in ranks]
        out[key] = (time.process_time() - c) / samples * 1e6
    decoders: dict[str, Any] = {"json_us": json.loads}
    try:
        import msgspec

        decoders["msgspec_us"] = msgspec.json.decode
    except ImportError:
        out["msgspec_us"] = None
    for key, decode in decoders.items():
        c = time.process_time()
        for b in bodies:
            decode(b)
        out[key] = (time.process_time() - c) / samples * 1e6
    return out


def child_stat(poller: Any) -> str | None:
    """/proc stat path of a ProcessPoller's child (None for an in-thread poller)."""
    pid = getattr(poller, "pid", None)
    return f"/proc/{pid}/stat" if pid else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=20_000)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--also-procs", type=lambda v: [int(x) for x in v.split(",")], default=[],
                    help="also this tree's servers split over these many processes (e.g. 8), "
                         "polled by the new poller: servers 'new/8'")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=1024)
    ap.add_argument("--baseline", default=BASELINE, help="git revision to compare with")
    ap.add_argument("--pairs", default=None,
                    help="poller:servers,... (pollers: new, old, process, process-asyncio, "
                         "process-old; servers: new, new-asyncio, old, new/K); default: new and "
                         "old on new and old servers, process on new, new on new/K")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    raise_fd_limit()
    if args.pairs:
        pairs = [tuple(p.split(":")) for p in args.pairs.split(",")]
    else:
        pairs = [(p, s) for p in ("new", "process", "old") for s in ("new", "old")
                 if p != "process" or s == "new"]
        pairs += [("new", f"new/{k}") for k in args.also_procs]
    git_source(args.baseline, "monitor/poll/poller.py")  # a revision it can load, or one line
    old_root = tempfile.mkdtemp(prefix="bench_poller_baseline_")
    baseline_tree(args.baseline, old_root)
    bound = {"timeout_s": 10.0, "max_concurrency": args.concurrency, "max_idle": 4 * args.ranks}
    makers = {"new": lambda: Poller(**bound),
              "old": lambda: baseline_poll(old_root, "poller").Poller(**bound),
              "process": lambda: ProcessPoller(**bound, event_loop="auto"),
              "process-asyncio": lambda: ProcessPoller(**bound, event_loop="asyncio"),
              "process-old": lambda: baseline_process_poller(args.baseline, old_root)(**bound)}
    sources = {"new": None, "new-asyncio": module_source(ROOT, ["--event-loop", "asyncio"]),
               "old": module_source(old_root, [])}
    servers, pollers = {}, {}
    figures: dict[tuple[str, str], dict[str, list[float]]] = {}
    try:
        for poller, side in pairs:
            if poller not in pollers:
                pollers[poller] = makers[poller]()
            if side not in servers:
                procs = int(side.split("/")[1]) if "/" in side else args.procs
                servers[side] = start(args.ranks, procs, args.group_size, 0.5,
                                      sources[side.split("/")[0]])
        for poller, side in pairs:  # warm up: open the pooled connections
            got = pollers[poller].sweep(servers[side][1])
            bad = [r for r in got.values() if not r.ok]
            if bad:
                raise RuntimeError(f"{poller} poller on {side} servers: {len(bad)} failed, "
                                   f"e.g. {bad[0]}")
        refs: list[dict] = []
        old_ranks = baseline_module(args.baseline, "tests/support/virtual_ranks.py",
                                    "baseline_virtual_ranks").VirtualRanks
        for rnd in range(args.rounds):
            refs.append(references_us(args.ranks, args.group_size, old_ranks))
            for poller, side in pairs if rnd % 2 == 0 else pairs[::-1]:
                procs, urls = servers[side]
                gc.collect()
                gc.disable()
                child = child_stat(pollers[poller])
                c, s, t = time.process_time(), cpu_of(procs), time.perf_counter()
                k = resource.getrusage(resource.RUSAGE_SELF).ru_stime
                ch = proc_cpu(child) if child else 0.0
                got = pollers[poller].sweep(urls)
                wall = time.perf_counter() - t
                cpu, server = time.process_time() - c, cpu_of(procs) - s
                kernel = resource.getrusage(resource.RUSAGE_SELF).ru_stime - k
                ch = proc_cpu(child) - ch if child else 0.0
                gc.enable()
                ok = sum(r.ok for r in got.values())
                f = figures.setdefault((poller, side), {"poller_us": [], "poller_sys_us": [],
                                                        "child_us": [], "server_us": [],
                                                        "wall_s": [], "ok": []})
                f["poller_us"].append(cpu / len(urls) * 1e6)
                f["child_us"].append(ch / len(urls) * 1e6)
                f["poller_sys_us"].append(kernel / len(urls) * 1e6)
                f["server_us"].append(server / len(urls) * 1e6)
                f["wall_s"].append(wall)
                f["ok"].append(ok)
    finally:
        for p in pollers.values():
            p.close()
        for procs, _ in servers.values():
            stop(procs)
        shutil.rmtree(old_root, ignore_errors=True)
    rows = [{"poller": p, "servers": s, "requests": args.ranks,
             **{k: round(statistics.median(v), 3) for k, v in f.items() if k != "ok"},
             "answered_min": min(f["ok"])} for (p, s), f in figures.items()]
    load = os.getloadavg()
    out = {"ranks": args.ranks, "procs": args.procs, "rounds": args.rounds,
           **{k: None if refs[0][k] is None else round(statistics.median(r[k] for r in refs), 2)
              for k in refs[0]},
           "concurrency": args.concurrency, "baseline": args.baseline,
           "load_average": [round(x, 2) for x in load], "cores": os.cpu_count(), "rows": rows}
    print(f"{args.ranks} keep-alive targets on {args.procs} virtual-rank processes, medians of "
          f"{args.rounds} rounds; load average {load[0]:.1f} on {os.cpu_count()} cores; "
          f"json.loads of one answer: {out['json_us']:.1f}us (msgspec: {out['msgspec_us']}); "
          f"making one: {out['answer_us']:.1f}us (old virtual ranks: {out['answer_old_us']:.1f}us)")
    print(f"{'poller':>7} {'servers':>7} {'poller CPU/req':>15} {'of it kernel':>13} "
          f"{'child CPU/req':>14} {'server CPU/req':>15} {'sweep wall':>11}")
    for r in rows:
        print(f"{r['poller']:>7} {r['servers']:>7} {r['poller_us']:>13.1f}us "
              f"{r['poller_sys_us']:>11.1f}us {r['child_us']:>12.1f}us {r['server_us']:>13.1f}us "
              f"{r['wall_s']:>10.3f}s")
    return save(out, args.json)


if __name__ == "__main__":
    sys.exit(main())
