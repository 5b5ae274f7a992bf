"""What one monitor shard costs against one monitor over the whole job, side by side in one run.

N simulated WorkerServers (tests/support/monitor_sim.py, 2,500 per process, groups of 8) and a
real etcd on loopback (Debian's etcd-server, started here with a temp data dir, stopped by PID).
For the same targets it measures, one after the other in this process, the sweep of:

- one monitor over every rank (no shard),
- shard 0 of K for each K in ``--shards`` (``--shard 0/K --etcd ...``: it polls only its slice
  and, every sweep, renews its lease, writes its report and its proposals to etcd),

each with ``--leader-polling off`` (every rank of the slice every sweep) unless ``--leader-polling
on``. ``--virtual``: the ranks are bench_monitor_100k.py's virtual ones (2 processes, groups of 8,
1 s steps), for 100,000 ranks (``--ranks 100000 --shards 4,8 --leader-polling on --virtual``);
a monitor's CPU then includes its poller process's, when it runs one. Per configuration: median and worst wall time of a sweep, the monitor process's own CPU
seconds per sweep (all its threads), etcd's CPU seconds per sweep (from /proc), the time the
sweep spent on etcd (report + proposals), and the ratio of the shard's CPU to the single
monitor's: what sharding buys per process. docs/scaling.md, "Beyond one machine".

    .venv/bin/python benchmarks/bench_monitor_shard.py --ranks 4000 --shards 2,4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import bench_monitor_100k as virtual  # noqa: E402
from benchmarks.bench_monitor_sweep import start_sims, stop_sims  # noqa: E402
from lightkeeper.processes import free_port, stop_process, wait_until  # noqa: E402
from monitor.config import MonitorConfig, ShardConfig  # noqa: E402
from monitor.service import Monitor  # noqa: E402
from tests.support.monitor_sim import raise_fd_limit  # noqa: E402


def start_etcd(d: str) -> tuple[subprocess.Popen, str]:
    import requests

    exe = shutil.which("etcd")
    if exe is None:
        raise SystemExit("etcd not found: bin/bootstrap --system installs Debian's etcd-server")
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    proc = subprocess.Popen([exe, "--name", "b", "--data-dir", os.path.join(d, "etcd"),
                             "--listen-client-urls", url, "--advertise-client-urls", url,
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"b=http://127.0.0.1:{peer}",
                             "--log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)

    def up():
        try:
            return requests.post(url + "/v3/kv/range", json={"key": "eA=="}, timeout=1).ok
        except requests.RequestException:
            return False

    wait_until(up, 30, what="etcd")
    return proc, url


def cpu_of(pid: int) -> float:
    """utime + stime of a process, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sweeps(urls: list[str], n: int, d: str, name: str, polling: str,
           shard: ShardConfig | None, etcd_pid: int) -> dict:
    mon = Monitor(MonitorConfig(port=0, targets=urls, state_path=os.path.join(d, f"{name}.db"),
                                sd_out=os.path.join(d, f"{name}.json"), poll_timeout_s=5.0,
                                leader_polling=polling, max_targets=max(10_000, len(urls)),
                                shard=shard))
    etcd_s: list[float] = []
    if mon.shard is not None:  # time the shard's etcd work inside the sweep
        inner = mon.shard.after_sweep

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                etcd_s.append(time.perf_counter() - t)

        mon.shard.after_sweep = timed
    def cpu_now() -> float:  # with the poller process's (from 50,000 targets)
        pid = getattr(mon.polling.poller, "pid", None)
        return time.process_time() + (cpu_of(pid) if pid else 0.0)
    try:
        mon.sweep_once()  # warm up: connect (and, for a shard, learn every target's group)
        mon.sweep_once()
        etcd_s.clear()
        wall, cpu, ecpu = [], [], []
        for _ in range(n):
            t, c, e = time.perf_counter(), cpu_now(), cpu_of(etcd_pid)
            view = mon.sweep_once()
            wall.append(time.perf_counter() - t)
            cpu.append(cpu_now() - c)
            ecpu.append(cpu_of(etcd_pid) - e)
        return {"config": name, "ranks_polled": len(view.ranks),
                "groups": len(view.groups),
                "poller_process": getattr(mon.polling.poller, "pid", None) is not None,
                "error": mon.shard.to_json()["error"] if mon.shard else None,
                "wall_median_s": statistics.median(wall), "wall_max_s": max(wall),
                "cpu_median_s": statistics.median(cpu), "cpu_max_s": max(cpu),
                "etcd_cpu_median_s": statistics.median(ecpu),
                "etcd_in_sweep_median_s": statistics.median(etcd_s) if etcd_s else 0.0}
    finally:
        mon.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4000)
    p.add_argument("--shards", default="2,4", help="shard counts K to measure shard 0/K of")
    p.add_argument("--sweeps", type=int, default=5)
    p.add_argument("--leader-polling", choices=("off", "on"), default="off")
    p.add_argument("--virtual", action="store_true",
                   help="virtual ranks (bench_monitor_100k.py's), for 100,000")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    raise_fd_limit()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        etcd, etcd_url = start_etcd(d)
        if args.virtual:
            procs, urls = virtual.start(args.ranks, 2, 8, 1.0)
        else:
            procs, urls = start_sims(args.ranks, groups=max(1, args.ranks // 8))
        try:
            rows = [sweeps(urls, args.sweeps, d, "one monitor", args.leader_polling, None,
                           etcd.pid)]
            for k in map(int, args.shards.split(",")):
                rows.append(sweeps(urls, args.sweeps, d, f"shard 0/{k}", args.leader_polling,
                                   ShardConfig(shards=k, index=0, etcd=etcd_url,
                                               etcd_prefix=f"/bench{k}"), etcd.pid))
        finally:
            (virtual.stop if args.virtual else stop_sims)(procs)
            stop_process(etcd, grace=2.0)
    base = rows[0]["cpu_median_s"]
    for r in rows:
        r["cpu_ratio"] = r["cpu_median_s"] / base if base else float("nan")
        print(json.dumps(r), flush=True)
    print(f"{args.ranks} ranks, leader polling {args.leader_polling}; load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after, {os.cpu_count()} cores")
    print(f"{'config':>12} {'ranks':>6} {'wall median':>12} {'wall max':>9} {'CPU median':>11} "
          f"{'CPU ratio':>10} {'etcd in sweep':>14} {'etcd CPU':>9}")
    for r in rows:
        print(f"{r['config']:>12} {r['ranks_polled']:>6} {r['wall_median_s']:>11.3f}s "
              f"{r['wall_max_s']:>8.3f}s {r['cpu_median_s']:>10.3f}s {r['cpu_ratio']:>9.2f}x "
              f"{r['etcd_in_sweep_median_s'] * 1e3:>11.1f} ms "
              f"{r['etcd_cpu_median_s'] * 1e3:>6.1f} ms")
    if args.json:  # the figures with the conditions they were taken under
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "leader_polling": args.leader_polling,
                       "virtual": args.virtual, "command": " ".join(sys.argv),
                       "sweeps": args.sweeps, "cores": os.cpu_count(),
                       "load_average": [load_before, os.getloadavg()[0]], "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
