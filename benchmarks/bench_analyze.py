"""Benchmark: ``lightkeeper analyze`` vs torch's ``torchfrtrace`` on the same pickle dumps.

Two shapes of NCCL-flavour pickle dumps of a healthy job (one file per rank, ``rank<N>``, as
``TORCH_NCCL_DUMP_ON_TIMEOUT`` names them), both from ``tests/support/frgen.py``, seeded:

- ``steady``: default group, TP groups of 8, DP groups; 8 stack frames shared by every entry
  (:func:`~tests.support.frgen.steady_dump`);
- ``plain``: one process group, one stack frame per entry, fresh containers per entry as torch's
  pickler writes them (:func:`~tests.support.frgen.plain_dump`).

Every command runs in its own fresh interpreter, as a user would run it. For each shape and size:

- ``torchfrtrace``: ``python -m torch.distributed.flight_recorder.fr_trace DIR -p rank``, once
  (stopped after ``--tf-timeout`` s, 300 by default: at 1024 ranks of the steady shape it takes
  about 5.5 minutes of CPU; its wall time and peak RSS are then lower bounds, marked ``>``);
- ``lightkeeper``: ``lightkeeper analyze --format json DIR`` (workers: the cores available),
  with the pickle reader it has (the C reader where built: ``reader`` in each row);
- ``python``: the same with ``LIGHTKEEPER_ANALYZE_PURE_PYTHON=1`` (every pickle read by Python's
  unpickler: the C reader's side-by-side comparison; ``c vs python`` in each row);
- ``serial``: the same with ``--jobs 1`` (no worker processes), once, for reference;
- ``floor``: the parallel load and nothing else: the same worker pool reading and unpickling
  every file with C ``pickle.load`` (``run_pool`` of :func:`read_only`), no normalizing, no
  analysis;
- ``fields floor``: the floor plus the least any loader must add: reading, in each entry, the
  fields the analysis needs (one ``itemgetter`` of them per entry, :func:`read_fields`), and
  nothing else: no columns, no checks, no answer sent back.

lightkeeper, its pure-Python run and the floors run ``--repeat`` times, side by side in
rotating order; the median run of each is kept, and "vs floor" ("vs fields") is the median of
the per-run ratios of lightkeeper to the floor (fields floor) run next to it.
Wall time is the root process's; CPU time is the whole tree's (``wait4``: the root and every
child it waited for); peak RSS is the whole tree's, the sum over its processes of each one's
peak (``VmHWM``, sampled every 25 ms from /proc: a high-water mark needs no finer sampling, and
on 2 cores a busier sampler would take CPU from the measured processes), which bounds the
tree's peak from above.

    .venv/bin/python benchmarks/bench_analyze.py --workdir /tmp/lk-dumps   # 256 and 1024 ranks x 2000:
        # about 10 minutes on 2 cores (5 of them torchfrtrace at 1024 ranks), plus 1.5 minutes
        # to write the dumps the first time (kept in --workdir for the next run)
    .venv/bin/python benchmarks/bench_analyze.py --quick        # a smoke run, seconds
    .venv/bin/python benchmarks/bench_analyze.py --threshold    # where worker processes pay off
    .venv/bin/python benchmarks/bench_analyze.py --workdir /tmp/lk-dumps --ranks 256 --stages 32
        # per-dump CPU time of each stage (in this process, process_time, A/B per file): the
        # floor's read, the C reader's parse / columns / normalize+pack, the Python path's

Targets checked and printed (issue 10): lightkeeper >= 10x faster than torchfrtrace (wall),
<= 1/2 of its peak RSS, and within 1.2x of the parallel load floor (wall). Not a test: numbers
depend on the machine, and on what else runs on it (the load average is printed). Exits non-zero
if a tool fails, or if lightkeeper reports findings on the healthy job.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = ("steady", "plain")
TARGET_SPEEDUP = 10.0
TARGET_MEMORY = 0.5
TARGET_FLOOR = 1.2


def write_job(directory: Path, shape: str, ranks: int, entries: int, protocol: int = pickle.HIGHEST_PROTOCOL) -> Path:
    """Pickle dumps of ``shape`` into ``directory/<shape>-<ranks>x<entries>[-p<protocol>]`` (cached)."""
    from tests.support.frgen import plain_dump, steady_dump

    make = {"steady": steady_dump, "plain": plain_dump}[shape]
    suffix = "" if protocol == pickle.HIGHEST_PROTOCOL else f"-p{protocol}"
    target = directory / f"{shape}-{ranks}x{entries}{suffix}"
    marker = target / ".complete"
    if marker.exists():
        return target
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for rank in range(ranks):
        with open(target / f"rank{rank}", "wb") as f:
            pickle.dump(make(rank, ranks, entries), f, protocol=protocol)
    marker.touch()
    return target


# ---- measuring one command -----------------------------------------------------------------


def _tree(root: int) -> list[int]:
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:  # gone meanwhile
            pass
    return pids


def _status_kib(pid: int, keys: tuple[str, ...]) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in keys:
                    out[name] = int(value.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


class _TreeMemory(threading.Thread):
    """Samples a process tree: each process's peak RSS (VmHWM) and the tree's total RSS."""

    def __init__(self, root: int, interval: float = 0.025) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.hwm: dict[int, int] = {}
        self.concurrent_kib = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            total = 0
            for pid in _tree(self.root):
                status = _status_kib(pid, ("VmHWM", "VmRSS"))
                if "VmHWM" in status:
                    self.hwm[pid] = max(self.hwm.get(pid, 0), status["VmHWM"])
                total += status.get("VmRSS", 0)
            self.concurrent_kib = max(self.concurrent_kib, total)
            self.done.wait(self.interval)


def measure(cmd: list[str], timeout: float | None = None, env: dict[str, str] | None = None) -> dict:
    """Run ``cmd`` in its own process tree: wall s, tree CPU s, tree peak RSS MiB, exit status.
    ``env``: variables set for it on top of this process's."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, **env} if env else None)
    sampler = _TreeMemory(proc.pid)
    sampler.start()
    killer = threading.Timer(timeout, proc.kill) if timeout else None
    if killer:
        killer.start()
    stderr: list[bytes] = []  # drained on a thread: a full pipe would stall the command
    reader = threading.Thread(target=lambda: stderr.append(proc.stderr.read()), daemon=True)
    reader.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if killer:
        killer.cancel()
    sampler.done.set()
    sampler.join()
    reader.join()
    code = os.waitstatus_to_exitcode(status)
    timed_out = bool(timeout) and code == -9 and wall >= timeout
    # wait4's ru_maxrss is the largest single process of the tree; the tree's is their sum
    root_kib = usage.ru_maxrss
    tree_kib = max(sum(sampler.hwm.values()), root_kib)
    return {
        "wall_s": round(wall, 3),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
        "peak_rss_mib": round(tree_kib / 1024, 1),
        "peak_rss_concurrent_mib": round(max(sampler.concurrent_kib, root_kib) / 1024, 1),
        "processes": len(sampler.hwm),
        "exit": code,
        "timed_out": timed_out,
        "stderr_tail": b"".join(stderr).decode(errors="replace")[-300:] if code != 0 and not timed_out else "",
    }


def lightkeeper_cmd(path: Path, jobs: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "lightkeeper.cli", "analyze", "--format", "json", str(path)]
    return cmd + ["--jobs", str(jobs)] if jobs else cmd


def floor_cmd(path: Path, task: str = "read") -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--floor", str(path), "--floor-task", task]


def torchfrtrace_cmd(path: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(path), "-p", "rank"]


def unpickle(path: str) -> dict:
    """A bench dump by Python's C ``pickle.load``: the fastest read of a pickle there is. The
    dumps are this bench's own, trusted; the loader's safe unpickler (``read_dump``) is pure
    Python, several times slower, and a floor made of it would be no floor."""
    with open(path, "rb") as f:
        return pickle.load(f)


def read_only(path: str) -> tuple[None, str | None]:
    """The floor's task: a file read and unpickled (:func:`unpickle`), then dropped. A pool
    task (``run_pool``): ``(None, None)``, or ``(None, error)`` for a file that is not a dump."""
    try:
        unpickle(path)
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return None, None


def read_fields(path: str) -> tuple[None, str | None]:
    """The fields floor's task: a file read and unpickled (:func:`unpickle`), then the fields the
    analysis needs taken from every entry (as the loader's first step takes them), then dropped.
    A pool task (``run_pool``): ``(None, None)``, or ``(None, error)`` for a file that is not a dump."""
    from operator import itemgetter

    from monitor.analysis.columnar import _KEYS

    try:
        entries = unpickle(path)["entries"]
        own = {k: k for k in entries[0]}
        keys = _KEYS + ("duration_ms",) if "duration_ms" in own else _KEYS
        list(map(itemgetter(*(own.get(k, k) for k in keys)), entries))
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return None, None


# pool tasks by floor (imported by name in each worker)
FLOOR_TASKS = {
    "read": f"{Path(__file__).parent.name}.{Path(__file__).stem}:read_only",
    "fields": f"{Path(__file__).parent.name}.{Path(__file__).stem}:read_fields",
}


def run_floor(path: Path, task: str = "read") -> int:
    """A floor, in this (fresh) process: every file read and unpickled (by the loader's pool, or
    here when the loader would not start one), and nothing else (``read``), or then the fields
    the analysis needs taken from each entry (``fields``)."""
    from monitor.analysis.loader import POOL_MIN_BYTES, _candidates, _total_size
    from monitor.analysis.pool import available_cores, resolve, run_pool

    files = _candidates([path], [], [], None)
    jobs = available_cores()
    if jobs > 1 and len(files) > 1 and _total_size(files) >= POOL_MIN_BYTES:
        outcomes = run_pool(files, jobs, FLOOR_TASKS[task])
    else:
        work = resolve(FLOOR_TASKS[task])
        outcomes = [work(str(file)) for file in files]
    return 1 if any(error for _, error in outcomes) else 0


def _median_run(runs: list[dict]) -> dict:
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    chosen = dict(ordered[len(ordered) // 2])
    chosen["walls_s"] = [r["wall_s"] for r in runs]
    return chosen


# ---- the comparison --------------------------------------------------------------------------


def compare(workdir: Path, shapes: list[str], sizes: list[tuple[int, int]], repeat: int, tf_timeout: float,
            torchfrtrace: bool, protocol: int) -> tuple[list[dict], bool]:
    rows, failed = [], False
    for ranks, entries in sizes:
        for shape in shapes:
            path = write_job(workdir, shape, ranks, entries, protocol)
            row: dict = {"shape": shape, "ranks": ranks, "entries": entries, "protocol": protocol,
                         "dump_mib": round(sum(p.stat().st_size for p in path.iterdir()) / 2**20, 1),
                         "load_before": os.getloadavg()[0]}
            from monitor.analysis.loader import PURE_PYTHON_ENV, pickle_reader

            row["reader"] = pickle_reader()
            runs: dict[str, list[dict]] = {"lightkeeper": [], "python": [], "serial": [], "floor": [], "fields": []}
            pure = {PURE_PYTHON_ENV: "1"}
            for i in range(repeat):
                # rotate which of the four goes first
                four = [("floor", floor_cmd(path), None), ("fields", floor_cmd(path, "fields"), None),
                        ("lightkeeper", lightkeeper_cmd(path), None), ("python", lightkeeper_cmd(path), pure)]
                for name, cmd, env in four[i % 4:] + four[: i % 4]:
                    runs[name].append(measure(cmd, env=env))
            runs["serial"].append(measure(lightkeeper_cmd(path, jobs=1)))  # for reference: once
            for name, measured in runs.items():
                row[name] = _median_run(measured)
                failed |= any(r["exit"] != 0 for r in measured)  # healthy job: 0 = no findings
            if torchfrtrace:
                row["torchfrtrace"] = measure(torchfrtrace_cmd(path), timeout=tf_timeout)
                failed |= row["torchfrtrace"]["exit"] != 0 and not row["torchfrtrace"]["timed_out"]
            row["load_after"] = os.getloadavg()[0]
            _ratios(row, runs)
            rows.append(row)
            print(json.dumps(row), flush=True)
            print(f"# {shape} {ranks} x {entries}: lightkeeper ({row['reader']} reader) vs load floor: wall "
                  f"{row['vs_floor']:.2f}x, CPU {row['vs_floor_cpu']:.2f}x (target <= {TARGET_FLOOR}x); pure Python "
                  f"vs load floor: wall {row['python_vs_floor']:.2f}x, CPU {row['python_vs_floor_cpu']:.2f}x; "
                  f"{row['reader']} vs pure Python: wall {row['vs_python']:.2f}x, CPU {row['vs_python_cpu']:.2f}x; "
                  f"vs fields floor: wall {row['vs_fields']:.2f}x, CPU {row['vs_fields_cpu']:.2f}x; load "
                  f"{row['load_before']:.1f} -> {row['load_after']:.1f}", flush=True)
    return rows, failed


def _ratios(row: dict, runs: dict[str, list[dict]]) -> None:
    # runs of lightkeeper and a floor next to each other share the machine's mood: the median
    # of their ratios is steadier than a ratio of medians on a shared machine
    # wall ratios (the criterion's measure) and CPU ratios (the whole tree's CPU time: what a
    # loaded machine disturbs least), each the median of the pairs' ratios
    pairs = (("lightkeeper", "floor", "vs_floor"), ("lightkeeper", "fields", "vs_fields"),
             ("python", "floor", "python_vs_floor"), ("lightkeeper", "python", "vs_python"))
    for run, floor, name in pairs:
        if not runs.get(run):  # runs from before the pure-Python run existed (--table of an old --json)
            continue
        for measure_key, suffix in (("wall_s", ""), ("cpu_s", "_cpu")):
            ratios = sorted(lk[measure_key] / f[measure_key] for lk, f in zip(runs[run], runs[floor], strict=True))
            row[name + suffix] = round(ratios[len(ratios) // 2], 3)
            row[f"{name}{suffix}_runs"] = [round(r, 3) for r in ratios]
    lk, tf = row["lightkeeper"], row.get("torchfrtrace")
    if tf:
        row["speedup"] = round(tf["wall_s"] / lk["wall_s"], 2)
        row["memory_ratio"] = round(lk["peak_rss_mib"] / tf["peak_rss_mib"], 3)


def table(rows: list[dict]) -> str:
    """Medians (best run in brackets), the targets' verdicts and the load average around each row."""
    lines = [
        "| dumps (ranks x entries) | torchfrtrace wall / CPU / peak RSS | lightkeeper (reader) wall (best) / CPU / peak RSS | "
        "pure Python wall (best) / CPU | --jobs 1 wall | load floor wall (best) / CPU | fields floor wall (best) / CPU | "
        "speedup | memory | vs floor wall | vs floor CPU | pure Python vs floor wall / CPU | reader vs pure Python wall / CPU | "
        "vs fields wall / CPU | load avg |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lk, serial, floor, fields = row["lightkeeper"], row["serial"], row["floor"], row.get("fields")
        tf, python = row.get("torchfrtrace"), row.get("python")
        bound = ">" if tf and tf["timed_out"] else ""
        tf_cell = f"{bound}{tf['wall_s']:.1f} s / {tf['cpu_s']:.1f} s / {bound}{tf['peak_rss_mib']:.0f} MiB" if tf else "-"
        speed = f"{bound}{row['speedup']:.1f}x {_mark(row['speedup'] >= TARGET_SPEEDUP)}" if tf else "-"
        mem = f"1/{1 / row['memory_ratio']:.0f} {_mark(row['memory_ratio'] <= TARGET_MEMORY)}" if tf else "-"
        # runs from before the fields floor, the CPU ratios or the pure-Python run existed
        # (--table of an old --json) have none
        fields_cell = f"{fields['wall_s']:.2f} s ({min(fields['walls_s']):.2f}) / {fields['cpu_s']:.2f} s" if fields else "-"
        python_cell = f"{python['wall_s']:.2f} s ({min(python['walls_s']):.2f}) / {python['cpu_s']:.2f} s" if python else "-"
        vs_fields = f"{row['vs_fields']:.2f}x" if "vs_fields" in row else "-"
        if "vs_fields_cpu" in row:
            vs_fields += f" / {row['vs_fields_cpu']:.2f}x"
        vs_cpu = f"{row['vs_floor_cpu']:.2f}x {_mark(row['vs_floor_cpu'] <= TARGET_FLOOR)}" if "vs_floor_cpu" in row else "-"
        python_vs = f"{row['python_vs_floor']:.2f}x / {row['python_vs_floor_cpu']:.2f}x" if "python_vs_floor" in row else "-"
        vs_python = f"{row['vs_python']:.2f}x / {row['vs_python_cpu']:.2f}x" if "vs_python" in row else "-"
        lines.append(
            f"| {row['shape']} {row['ranks']} x {row['entries']} ({row['dump_mib']:.0f} MiB) | {tf_cell} | "
            f"({row.get('reader', '?')}) {lk['wall_s']:.2f} s ({min(lk['walls_s']):.2f}) / {lk['cpu_s']:.2f} s / "
            f"{lk['peak_rss_mib']:.0f} MiB | {python_cell} | "
            f"{serial['wall_s']:.2f} s | {floor['wall_s']:.2f} s ({min(floor['walls_s']):.2f}) / {floor['cpu_s']:.2f} s | "
            f"{fields_cell} | {speed} | {mem} | {row['vs_floor']:.2f}x {_mark(row['vs_floor'] <= TARGET_FLOOR)} | "
            f"{vs_cpu} | {python_vs} | {vs_python} | {vs_fields} | "
            f"{row['load_before']:.1f} -> {row['load_after']:.1f} |"
        )
    return "\n".join(lines)


def _mark(ok: bool) -> str:
    return "(ok)" if ok else "(MISSED)"


# ---- the pool threshold ----------------------------------------------------------------------


def threshold(workdir: Path, repeat: int) -> list[dict]:
    """Small inputs: in-process loading vs the worker pool forced on, by total dump size."""
    forced = (
        "import sys; import monitor.analysis.loader as loader; loader.POOL_MIN_BYTES = 0; "
        "from lightkeeper.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    rows = []
    for ranks, entries in [(4, 500), (8, 500), (8, 1000), (16, 1000), (16, 2000), (32, 2000), (64, 2000)]:
        path = write_job(workdir, "plain", ranks, entries)
        size = sum(p.stat().st_size for p in path.iterdir())
        here, pool = [], []
        for _ in range(repeat):
            here.append(measure(lightkeeper_cmd(path, jobs=1)))
            pool.append(measure([sys.executable, "-c", forced, "analyze", "--format", "json", str(path)]))
        row = {"ranks": ranks, "entries": entries, "dump_mib": round(size / 2**20, 2),
               "in_process_s": _median_run(here)["wall_s"], "pool_s": _median_run(pool)["wall_s"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# ---- per-dump stages ---------------------------------------------------------------------------


def stages(workdir: Path, shapes: list[str], ranks_list: list[int], entries: int, sample: int) -> list[dict]:
    """Per-dump CPU time (``process_time``, in this process, cyclic GC off as in the loader) of
    each stage, on ``sample`` files of each job, the tasks run one after another on each file in
    rotating order: the floor's task (read and C-unpickle, :func:`read_only`); the C
    reader's parse and its columns alone; the worker's whole task (``loader.load_packed``: read,
    normalize, pack, pickle) with the C reader and with Python's (``LIGHTKEEPER_ANALYZE_PURE_PYTHON=1``).
    Medians per dump in ms."""
    import gc
    import statistics

    from monitor.analysis import loader
    from monitor.analysis.columnar import _KEYS

    reader = loader._c_reader()
    rows = []
    for ranks in ranks_list:
        for shape in shapes:
            path = write_job(workdir, shape, ranks, entries)
            files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
            files = files[:: max(1, len(files) // sample)][:sample]
            times: dict[str, list[float]] = {"floor": [], "c_parse": [], "c_columns": [], "c_task": [], "python_task": []}

            def task(pure: str, file: Path) -> None:
                os.environ[loader.PURE_PYTHON_ENV] = pure
                try:
                    loader.load_packed(file)
                finally:
                    del os.environ[loader.PURE_PYTHON_ENV]

            def parts(file: Path, times: dict[str, list[float]] = times) -> None:
                start = time.process_time()
                doc = reader.parse(file.read_bytes())
                mid = time.process_time()
                doc.columns(_KEYS, "duration_ms")
                times["c_columns"].append(time.process_time() - mid)
                times["c_parse"].append(mid - start)

            steps: list[tuple[str | None, object]] = [("floor", read_only), ("python_task", lambda f: task("1", f))]
            if reader is not None:
                steps += [("c_task", lambda f: task("", f)), (None, parts)]
            load_before = os.getloadavg()[0]
            was = gc.isenabled()
            gc.disable()
            try:
                for i, file in enumerate(files):
                    for name, step in steps[i % len(steps):] + steps[: i % len(steps)]:
                        start = time.process_time()
                        step(file)  # type: ignore[operator]
                        if name:
                            times[name].append(time.process_time() - start)
            finally:
                if was:
                    gc.enable()
            row: dict = {"shape": shape, "ranks": ranks, "entries": entries, "files": len(files),
                         "reader": "c" if reader is not None else "python", "load_before": load_before,
                         "load_after": os.getloadavg()[0]}
            for name, values in times.items():
                if values:
                    row[f"{name}_ms"] = round(statistics.median(values) * 1e3, 3)
            for name in ("c_task", "python_task"):
                if f"{name}_ms" in row:
                    row[f"{name}_vs_floor"] = round(row[f"{name}_ms"] / row["floor_ms"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only (smoke run)")
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help="rank counts (default 256 1024)")
    parser.add_argument("--entries", type=int, default=2000, help="entries per dump (default 2000)")
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--protocol", type=int, default=pickle.HIGHEST_PROTOCOL,
                        help="pickle protocol of the dumps (default: the highest, framed; torch's own pickler writes 2)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of lightkeeper and of each floor (medians kept)")
    parser.add_argument("--tf-timeout", type=float, default=300.0,
                        help="seconds before torchfrtrace is stopped; its figures are then lower bounds (default 300)")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write dumps (default: a temp dir, removed); reused when given")
    parser.add_argument("--no-torchfrtrace", action="store_true", help="measure lightkeeper only")
    parser.add_argument("--threshold", action="store_true", help="measure where the worker pool pays off, and stop")
    parser.add_argument("--stages", type=int, default=None, metavar="FILES",
                        help="per-dump CPU time of each stage on FILES dumps of each job, in this process, and stop")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here, with the command")
    parser.add_argument("--table", type=Path, default=None, metavar="JSON",
                        help="print the table of an earlier run's --json file, and stop")
    parser.add_argument("--floor", type=Path, default=None, help=argparse.SUPPRESS)  # a floor's own process
    parser.add_argument("--floor-task", choices=sorted(FLOOR_TASKS), default="read", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.floor:
        return run_floor(args.floor, args.floor_task)
    if args.table:
        data = json.loads(args.table.read_text())
        rows = data["rows"] if isinstance(data, dict) else data  # a list: an older --json
        if not all(isinstance(r, dict) and "lightkeeper" in r for r in rows):
            raise SystemExit(f"--table {args.table}: not rows of a comparison run (a --stages or "
                             "--threshold run prints its own table)")
        print(table(rows))
        return 0

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lk-bench-"))
    started = time.perf_counter()
    print(f"# cores available: {len(os.sched_getaffinity(0))}, load average before: {os.getloadavg()[0]:.2f}", flush=True)
    try:
        if args.threshold:
            rows = threshold(workdir, args.repeat)
            failed = False
        elif args.stages:
            rows = stages(workdir, args.shapes, [32] if args.quick else (args.ranks or [256, 1024]),
                          500 if args.quick else args.entries, args.stages)
            failed = False
        else:
            ranks = [32] if args.quick else (args.ranks or [256, 1024])
            entries = 500 if args.quick else args.entries
            rows, failed = compare(workdir, args.shapes, [(r, entries) for r in ranks], args.repeat,
                                   args.tf_timeout, not args.no_torchfrtrace, args.protocol)
            print()
            print(table(rows))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n# took {time.perf_counter() - started:.0f} s; load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        command = " ".join([Path(sys.executable).name, *map(str, sys.argv)])
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip()
        args.json.write_text(json.dumps({"command": command, "commit": commit, "rows": rows}, indent=2))
    if failed:
        print("a tool failed or lightkeeper reported findings on the healthy job", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
