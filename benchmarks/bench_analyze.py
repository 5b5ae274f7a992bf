"""Benchmark: ``lightkeeper analyze`` vs torch's ``torchfrtrace`` on the same pickle dumps.

Writes NCCL-flavour pickle dumps of a healthy job (default group, TP groups of 8, DP groups; one
file per rank, ``rank<N>``, as ``TORCH_NCCL_DUMP_ON_TIMEOUT`` names them) and runs each tool in its
own subprocess, so that wall time, CPU time and peak RSS (``ru_maxrss`` from ``wait4``) belong to
that tool alone. Both tools start a fresh interpreter, as a user running them would.

    .venv/bin/python benchmarks/bench_analyze.py            # full run (several minutes)
    .venv/bin/python benchmarks/bench_analyze.py --quick    # a smoke run, seconds

Not a test: numbers depend on the machine. It exits non-zero if a tool fails or reports findings
on the healthy job.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.frgen import steady_dump  # noqa: E402


def write_job(directory: Path, ranks: int, entries: int) -> Path:
    """Pickle dumps for ``ranks`` x ``entries`` into ``directory/<ranks>x<entries>`` (cached)."""
    target = directory / f"{ranks}x{entries}"
    marker = target / ".complete"
    if marker.exists():
        return target
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for rank in range(ranks):
        with open(target / f"rank{rank}", "wb") as f:
            pickle.dump(steady_dump(rank, ranks, entries), f, protocol=pickle.HIGHEST_PROTOCOL)
    marker.touch()
    return target


def measure(cmd: list[str]) -> dict[str, float | int]:
    """Run ``cmd`` in its own process: wall s, CPU s, peak RSS MiB, exit status."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    stderr = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "exit": proc.returncode,
        "stderr_tail": stderr[-300:] if proc.returncode not in (0,) else "",
    }


def lightkeeper_cmd(path: Path) -> list[str]:
    return [sys.executable, "-m", "lightkeeper.cli", "analyze", "--format", "json", str(path)]


def torchfrtrace_cmd(path: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(path), "-p", "rank"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only (smoke run)")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write dumps (default: a temp dir, removed)")
    parser.add_argument("--no-torchfrtrace", action="store_true", help="measure lightkeeper only")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    if args.quick:
        head_to_head = [(32, 500)]
        ranks_sweep = [(16, 500), (32, 500)]
        entries_sweep = [(32, 250), (32, 500)]
        torchfrtrace_sizes = {(32, 500)}
    else:
        head_to_head = [(256, 2000)]
        ranks_sweep = [(64, 2000), (128, 2000), (256, 2000), (512, 2000), (1024, 2000)]
        entries_sweep = [(256, 500), (256, 1000), (256, 2000), (256, 4000)]
        torchfrtrace_sizes = {(64, 2000), (128, 2000), (256, 2000)}
    if args.no_torchfrtrace:
        torchfrtrace_sizes = set()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lk-bench-"))
    results: list[dict] = []
    failed = False
    try:
        sizes = sorted(set(head_to_head + ranks_sweep + entries_sweep))
        for ranks, entries in sizes:
            path = write_job(workdir, ranks, entries)
            row: dict = {"ranks": ranks, "entries": entries}
            row["lightkeeper"] = measure(lightkeeper_cmd(path))
            failed |= row["lightkeeper"]["exit"] != 0  # healthy job: 0 = no findings
            if (ranks, entries) in torchfrtrace_sizes:
                row["torchfrtrace"] = measure(torchfrtrace_cmd(path))
                failed |= row["torchfrtrace"]["exit"] != 0
            results.append(row)
            print(json.dumps(row), flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    print()
    print("| ranks x entries | lightkeeper wall / CPU / peak RSS | torchfrtrace wall / CPU / peak RSS | speedup (wall) | memory ratio |")
    print("| --- | --- | --- | --- | --- |")
    for row in results:
        lk = row["lightkeeper"]
        cell = f"{lk['wall_s']:.2f} s / {lk['cpu_s']:.2f} s / {lk['peak_rss_mib']:.0f} MiB"
        tf = row.get("torchfrtrace")
        if tf:
            other = f"{tf['wall_s']:.2f} s / {tf['cpu_s']:.2f} s / {tf['peak_rss_mib']:.0f} MiB"
            speed = f"{tf['wall_s'] / lk['wall_s']:.1f}x"
            mem = f"{lk['peak_rss_mib'] / tf['peak_rss_mib']:.2f}"
        else:
            other, speed, mem = "-", "-", "-"
        print(f"| {row['ranks']} x {row['entries']} | {cell} | {other} | {speed} | {mem} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if failed:
        print("a tool failed or reported findings on the healthy job", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
