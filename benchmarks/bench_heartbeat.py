"""The Lighthouse's heartbeat and join timeouts: how fast a job recovers, how often a healthy
group is dropped by mistake.

A job shaped like the demo's (3 replica groups x 1 rank, the demo's ``--step-pause 0.1`` and
``pg_timeout`` 20 s; :class:`lightkeeper.cluster.LocalCluster`, real Lighthouse, real gloo
ranks) runs under each setting. Everything is read from what the parts serve: every rank's
``/v1/state`` and the Lighthouse's ``/status`` (:mod:`monitor.evidence.lighthouse_status`), polled at
10 Hz by one sampling thread.

``healthy``: no faults for ``--duration`` seconds per setting. A *false drop* is a quorum in
which a group of the previous quorum is missing (no group was killed, so every such drop is a
mistake), seen on the Lighthouse's ``/status`` or as a rank reporting fewer than 3
participants; a group whose process exits is counted too (and restarted, as the demo's
supervisor would). Steps committed and commit failures are recorded.

``recovery``: per setting and repeat, a fresh healthy job; after ``--healthy-s`` of healthy
pace, group 2 is killed through the Lighthouse (``POST /replica/{id}/kill``, as the monitor's
eviction does) and restarted as soon as its process exits (as the demo's supervisor does).
Stage times, seconds after the kill:

- ``exit``: the killed group's process is gone;
- ``lh_drop``: the Lighthouse's newest quorum no longer lists it;
- ``survivors_quorum``: a survivor reports a new quorum of 2 participants;
- ``back90``: the start of the first ``--window``-second window in which the job (group 0's
  committed step) advances at >= 90% of its healthy pace;
- ``rejoin``: the restarted group takes part in a quorum of 3 within 3 steps of group 0;
- ``rejoin_dip``: around the rejoin (from the restarted group's WorkerServer being up to 5 s
  after ``rejoin``), group 0's pace as a fraction of healthy and its longest gap between
  commits (does the rejoining group stall the survivors?).

Figures are wall-clock on whatever the machine is doing besides; on a shared 2-core VM they
are pessimistic. Every row records the load average.

    .venv/bin/python benchmarks/bench_heartbeat.py healthy --heartbeat-ms 5000,2000,1000 \\
        --duration 600 --out /tmp/hb_healthy.json
    .venv/bin/python benchmarks/bench_heartbeat.py recovery --heartbeat-ms 5000,2000,1000 \\
        --repeats 3 --out /tmp/hb_recovery.json
    .venv/bin/python benchmarks/bench_heartbeat.py recovery --heartbeat-ms 1000 \\
        --join-ms 5000,1000 --repeats 3 --out /tmp/hb_join.json
    .venv/bin/python benchmarks/bench_heartbeat.py table /tmp/hb_recovery.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lightkeeper.cluster import LocalCluster  # noqa: E402
from lightkeeper.processes import wait_until  # noqa: E402
from monitor.evidence.lighthouse_status import LighthouseReader  # noqa: E402

GROUPS = 3
VICTIM = 2
STEP_PAUSE_S = 0.1  # lightkeeper/scenario.py: the demo's step pause
PG_TIMEOUT_S = 20.0  # lightkeeper/scenario.py: the demo's pg_timeout


class Sampler(threading.Thread):
    """Polls every rank's /v1/state and the Lighthouse's /status every ``period`` seconds."""

    def __init__(self, cluster: LocalCluster, period: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.period = period
        self.ranks: list[dict] = []  # {t, group, incarnation, step, quorum_id, ...}
        self.lh: list[dict] = []  # {t, quorum_id, members, stale, heartbeats}
        self.incarnation: dict[int, int] = {}
        self._halt = threading.Event()
        self._http = requests.Session()
        self._reader = LighthouseReader(cluster.lighthouse_url, timeout_s=1.0)

    def run(self) -> None:
        while not self._halt.is_set():
            t0 = time.monotonic()
            for g, grp in sorted(self.cluster.groups.items()):
                url = grp.worker_urls.get(0)
                if not url or not grp.alive():
                    continue
                try:
                    s = self._http.get(url + "/v1/state", timeout=1.0).json()
                except (requests.RequestException, ValueError):
                    continue
                self.ranks.append({"t": time.monotonic(), "group": g,
                                   "incarnation": self.incarnation.get(g, 0),
                                   "step": s.get("step"), "quorum_id": s.get("quorum_id"),
                                   "num_participants": s.get("num_participants"),
                                   "participating": s.get("participating"),
                                   "commits": s.get("commits"),
                                   "commit_failures": s.get("commit_failures"),
                                   "replica_id": s.get("replica_id")})
            st, _ = self._reader.read()
            if st is not None:
                self.lh.append({"t": time.monotonic(), "quorum_id": st.quorum_id,
                                "members": sorted(st.members), "stale": sorted(st.stale),
                                "heartbeats": sorted(st.heartbeats),
                                # the oldest heartbeat of a quorum member: the margin left
                                "member_heartbeat_age": max(
                                    (a for r, a in st.heartbeats.items() if r in st.members),
                                    default=None)})
            self._halt.wait(max(0.0, self.period - (time.monotonic() - t0)))

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)
        self._reader.close()
        self._http.close()

    def latest(self, group: int, incarnation: int | None = None) -> dict | None:
        for s in reversed(self.ranks):
            if s["group"] == group and (incarnation is None or s["incarnation"] == incarnation):
                return s
        return None


def _loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def _start(log_dir: Path, hb_ms: int, join_ms: int, quorum_timeout_s: float,
           connect_timeout_s: float | None) -> tuple[LocalCluster, Sampler]:
    extra = ["--connect-timeout", str(connect_timeout_s)] if connect_timeout_s else []
    cluster = LocalCluster(log_dir, num_groups=GROUPS, ranks_per_group=1, steps=10**7,
                           join_timeout_ms=join_ms, heartbeat_timeout_ms=hb_ms,
                           step_pause_s=STEP_PAUSE_S, pg_timeout_s=PG_TIMEOUT_S,
                           quorum_timeout_s=quorum_timeout_s)
    cluster._extra_train_args = extra  # noqa: SLF001 (kept for restarts below)
    cluster.start_lighthouse()
    for g in range(GROUPS):
        cluster.start_group(g, extra_args=extra)
    for g in range(GROUPS):
        cluster.wait_for_workers(g, timeout=180)
    sampler = Sampler(cluster)
    sampler.start()

    def all_in():
        ss = [sampler.latest(g) for g in range(GROUPS)]
        return all(s and s["num_participants"] == GROUPS and s["participating"]
                   and (s["step"] or 0) >= 3 for s in ss)

    wait_until(all_in, 240, 0.2, "all 3 groups stepping in one quorum")
    return cluster, sampler


def _restart(cluster: LocalCluster, sampler: Sampler, g: int) -> None:
    sampler.incarnation[g] = sampler.incarnation.get(g, 0) + 1
    cluster.start_group(g, extra_args=getattr(cluster, "_extra_train_args", []))


def _steps(sampler: Sampler, group: int, t_from: float, t_to: float,
           incarnation: int | None = None) -> list[tuple[float, int]]:
    return [(s["t"], s["step"]) for s in sampler.ranks
            if s["group"] == group and t_from <= s["t"] <= t_to and s["step"] is not None
            and (incarnation is None or s["incarnation"] == incarnation)]


def _rate(points: list[tuple[float, int]]) -> float | None:
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


_LH_LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+) \[INFO\] "
                      r"\[torchft::lighthouse\] - (.*)$")


def request_spread(lighthouse_log: Path) -> dict | None:
    """Per quorum round, the Lighthouse's own log: seconds from the first group's quorum request
    to the quorum. A healthy group asking more than join_timeout_ms after the first is left out
    of a quorum that is not fast (docs/lighthouse.md), so the largest spread is the margin
    join_timeout_ms must keep. None when the log cannot be read."""
    try:
        first, spreads = None, []
        for line in lighthouse_log.read_text(errors="replace").splitlines():
            m = _LH_LINE.match(line)
            if not m:
                continue
            t = datetime.fromisoformat(m.group(1)).timestamp()
            if m.group(2).startswith("Received quorum request") and first is None:
                first = t
            elif m.group(2).startswith("Quorum! ") and first is not None:
                spreads.append(t - first)
                first = None
    except (OSError, ValueError):
        return None
    if not spreads:
        return None
    spreads.sort()
    return {"rounds": len(spreads), "median_s": round(statistics.median(spreads), 3),
            "p99_s": round(spreads[int(0.99 * (len(spreads) - 1))], 3),
            "max_s": round(spreads[-1], 3)}


# --- healthy: false drops ----------------------------------------------------------------------
def healthy_run(hb_ms: int, join_ms: int, duration_s: float, log_dir: Path,
                quorum_timeout_s: float) -> dict:
    cluster, sampler = _start(log_dir, hb_ms, join_ms, quorum_timeout_s, None)
    exits: list[dict] = []
    load: list[float] = []
    try:
        t0 = time.monotonic()
        step0 = {g: sampler.latest(g)["step"] for g in range(GROUPS)}
        fail0 = {g: sampler.latest(g)["commit_failures"] for g in range(GROUPS)}
        while time.monotonic() - t0 < duration_s:
            for g, grp in list(cluster.groups.items()):
                if not grp.alive():
                    exits.append({"t": round(time.monotonic() - t0, 2), "group": g,
                                  "returncode": grp.proc.returncode})
                    _restart(cluster, sampler, g)
                    cluster.wait_for_workers(g, timeout=180)
            load.append(os.getloadavg()[0])
            time.sleep(1.0)
        t1 = time.monotonic()
    finally:
        sampler.stop()
        cluster.stop()
    # quorum history from the Lighthouse: each quorum id once, with its members
    quorums: list[dict] = []
    for s in sampler.lh:
        if s["t"] < t0 or s["quorum_id"] is None:
            continue
        if not quorums or quorums[-1]["quorum_id"] != s["quorum_id"]:
            quorums.append({"t": round(s["t"] - t0, 2), "quorum_id": s["quorum_id"],
                            "members": s["members"]})
    lh_drops = [{"t": b["t"], "quorum_id": b["quorum_id"],
                 "left": sorted(set(a["members"]) - set(b["members"]))}
                for a, b in zip(quorums, quorums[1:], strict=False) if set(a["members"]) - set(b["members"])]
    # what the ranks saw: a quorum with fewer than all groups
    rank_short = sorted({(s["quorum_id"], s["num_participants"], s["group"])
                         for s in sampler.ranks if s["t"] >= t0
                         and (s["num_participants"] or GROUPS) < GROUPS})
    rank_quorums = sorted({s["quorum_id"] for s in sampler.ranks if s["t"] >= t0})
    stale_seen = sorted({r for s in sampler.lh if s["t"] >= t0 for r in s["stale"]})
    ages = [s["member_heartbeat_age"] for s in sampler.lh
            if s["t"] >= t0 and s["member_heartbeat_age"] is not None]
    last = {g: sampler.latest(g) for g in range(GROUPS)}
    return {
        "mode": "healthy", "heartbeat_timeout_ms": hb_ms, "join_timeout_ms": join_ms,
        "duration_s": round(t1 - t0, 1),
        "steps_committed": max(last[g]["step"] for g in range(GROUPS)) - max(step0.values()),
        "commit_failures": sum((last[g]["commit_failures"] or 0) - (fail0[g] or 0)
                               for g in range(GROUPS)
                               if sampler.incarnation.get(g, 0) == 0),
        "quorum_changes": max(0, len(quorums) - 1), "quorums": quorums,
        "lighthouse_drops": lh_drops, "rank_quorum_ids": rank_quorums,
        "rank_short_quorums": [list(x) for x in rank_short],
        "stale_heartbeats_seen": stale_seen, "group_exits": exits,
        "max_member_heartbeat_age_s": round(max(ages), 3) if ages else None,
        "lighthouse_samples": len(ages),
        "quorum_request_spread": request_spread(log_dir / "lighthouse.log"),
        # a drop the Lighthouse page showed, or one only the ranks saw (a quorum between polls)
        "false_drops": max(len(lh_drops), len({q for q, _, _ in rank_short})) + len(exits),
        "loadavg_mean": round(statistics.mean(load), 2) if load else None,
        "loadavg_max": round(max(load), 2) if load else None,
    }


# --- recovery after a kill ---------------------------------------------------------------------
def recovery_run(hb_ms: int, join_ms: int, log_dir: Path, healthy_s: float, window_s: float,
                 quorum_timeout_s: float, connect_timeout_s: float | None) -> dict:
    cluster, sampler = _start(log_dir, hb_ms, join_ms, quorum_timeout_s, connect_timeout_s)
    load0 = _loadavg()
    out: dict = {"mode": "recovery", "heartbeat_timeout_ms": hb_ms, "join_timeout_ms": join_ms,
                 "quorum_timeout_s": quorum_timeout_s, "connect_timeout_s": connect_timeout_s}
    try:
        t_h0 = time.monotonic()
        time.sleep(healthy_s)  # the healthy baseline is read from the sampler's record
        healthy = _rate(_steps(sampler, 0, t_h0, time.monotonic()))
        victim = sampler.latest(VICTIM)
        rid = victim["replica_id"]
        q_before = sampler.latest(0)["quorum_id"]
        t_kill = time.monotonic()
        try:
            r = requests.post(f"{cluster.lighthouse_url}/replica/{rid}/kill", timeout=5)
            out["kill_http"] = r.status_code
        except requests.RequestException as e:
            out["kill_http"] = f"{type(e).__name__}"
        grp = cluster.groups[VICTIM]
        wait_until(lambda: not grp.alive(), 30, 0.02, "the killed group's process to exit")
        t_exit = time.monotonic()
        _restart(cluster, sampler, VICTIM)
        t_restart = time.monotonic()
        cluster.wait_for_workers(VICTIM, timeout=180)
        t_up = time.monotonic()

        def rejoined():
            s = sampler.latest(VICTIM, sampler.incarnation[VICTIM])
            s0 = sampler.latest(0)
            return (s and s["participating"] and s["num_participants"] == GROUPS
                    and s["quorum_id"] is not None and s0 and s["step"] >= s0["step"] - 3)

        wait_until(rejoined, 180, 0.05, "the restarted group to rejoin")
        t_rejoin = next(s["t"] for s in sampler.ranks
                        if s["group"] == VICTIM and s["incarnation"] == 1
                        and s["participating"] and s["num_participants"] == GROUPS)
        end = max(time.monotonic(), t_rejoin) + max(window_s, 5.0) + 1.0
        while time.monotonic() < end:
            time.sleep(0.2)
    finally:
        sampler.stop()
        cluster.stop()
    rel = lambda t: None if t is None else round(t - t_kill, 2)  # noqa: E731
    lh_drop = next((s["t"] for s in sampler.lh if s["t"] >= t_kill and s["quorum_id"] is not None
                    and rid not in s["members"]), None)
    hb_stale = next((s["t"] for s in sampler.lh if s["t"] >= t_kill
                     and (rid in s["stale"] or rid not in s["heartbeats"])), None)
    surv_q = next((s["t"] for s in sampler.ranks if s["t"] >= t_kill and s["group"] != VICTIM
                   and s["quorum_id"] != q_before and s["num_participants"] == GROUPS - 1), None)
    pts = _steps(sampler, 0, t_kill, float("inf"))
    step_kill = pts[0][1] if pts else None
    first_commit = next((t for t, st in pts if surv_q and t >= surv_q and st > step_kill), None)
    back90 = None
    if healthy:
        # windows start at a commit (a sample whose step moved), so a window never starts inside
        # the stall and borrows the 2-group catch-up that follows it
        for i, (t, st) in enumerate(pts):
            if i == 0 or st == pts[i - 1][1]:
                continue
            later = [(t2, s2) for t2, s2 in pts[i:] if t2 <= t + window_s]
            if later[-1][0] - t >= window_s - 0.3 and \
                    later[-1][1] - st >= 0.9 * healthy * (later[-1][0] - t):
                back90 = t
                break
    dip_pts = _steps(sampler, 0, t_up, t_rejoin + 5.0)
    gaps, last_change = [], None
    for (_ta, sa), (tb, sb) in zip(dip_pts, dip_pts[1:], strict=False):
        if sb != sa:
            if last_change is not None:
                gaps.append(tb - last_change)
            last_change = tb
    dip_rate = _rate(dip_pts)
    after = _rate(_steps(sampler, 0, first_commit, first_commit + window_s)) \
        if first_commit else None
    changes = [(round(t - t_kill, 2), st) for i, (t, st) in enumerate(pts)
               if i == 0 or st != pts[i - 1][1]]
    out.update({
        "healthy_steps_per_s": round(healthy, 3) if healthy else None,
        "kill_to": {"exit": rel(t_exit), "lh_heartbeat_stale": rel(hb_stale),
                    "lh_drop": rel(lh_drop), "survivors_quorum": rel(surv_q),
                    "survivors_commit": rel(first_commit), "back90": rel(back90),
                    "restart": rel(t_restart), "restarted_up": rel(t_up),
                    "rejoin": rel(t_rejoin)},
        "pace_after_vs_healthy": round(after / healthy, 2) if after and healthy else None,
        "group0_commits": changes,  # (seconds after the kill, step) at every step change
        "rejoin_dip": {"pace_vs_healthy": round(dip_rate / healthy, 2)
                       if dip_rate is not None and healthy else None,
                       "longest_commit_gap_s": round(max(gaps), 2) if gaps else None,
                       "healthy_step_s": round(1 / healthy, 2) if healthy else None},
        "loadavg": [load0, _loadavg()],
    })
    return out


# --- table ------------------------------------------------------------------------------------
def _med(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 2) if xs else None


def _spread(r: dict) -> str:
    sp = r.get("quorum_request_spread")
    if not sp and r.get("log_dir"):  # rows written before the benchmark recorded it
        sp = request_spread(Path(r["log_dir"]) / "lighthouse.log")
    if not sp:
        return "n/a"
    return f"{sp['median_s']} / {sp['p99_s']} / {sp['max_s']} ({sp['rounds']})"


def table(rows: list[dict]) -> str:
    lines = []
    rec = [r for r in rows if r.get("mode") == "recovery"]
    if rec:
        keys = ["exit", "lh_heartbeat_stale", "lh_drop", "survivors_quorum", "survivors_commit",
                "back90", "restarted_up", "rejoin"]
        lines.append("| heartbeat_timeout_ms | join_timeout_ms | quorum_timeout_s | runs | "
                     + " | ".join(keys) + " | survivors_commit - exit | pace after vs healthy | rejoin pace vs healthy | rejoin longest gap s "
                     "(healthy step s) | load avg |")
        lines.append("|" + "---|" * (len(keys) + 9))
        settings = []
        for r in rec:
            k = (r["heartbeat_timeout_ms"], r["join_timeout_ms"], r.get("quorum_timeout_s"))
            if k not in settings:
                settings.append(k)
        for k in settings:
            rs = [r for r in rec if (r["heartbeat_timeout_ms"], r["join_timeout_ms"],
                                     r.get("quorum_timeout_s")) == k]
            cells = [str(_med([r["kill_to"][key] for r in rs])) for key in keys]
            lines.append(
                f"| {k[0]} | {k[1]} | {k[2]:g} | {len(rs)} | " + " | ".join(cells)
                + f" | {_med([r['kill_to']['survivors_commit'] - r['kill_to']['exit'] for r in rs if r['kill_to']['survivors_commit'] is not None])}"
                + f" | {_med([r.get('pace_after_vs_healthy') for r in rs])}"
                + f" | {_med([r['rejoin_dip']['pace_vs_healthy'] for r in rs])}"
                f" | {_med([r['rejoin_dip']['longest_commit_gap_s'] for r in rs])}"
                f" ({_med([r['rejoin_dip']['healthy_step_s'] for r in rs])})"
                f" | {_med([r['loadavg'][0] for r in rs])} |")
    hl = [r for r in rows if r.get("mode") == "healthy"]
    if hl:
        lines.append("")
        lines.append("| heartbeat_timeout_ms | join_timeout_ms | duration s | steps committed | "
                     "quorum changes | false drops | group exits | stale heartbeats seen | "
                     "commit failures | oldest member heartbeat s | quorum request spread s "
                     "median / p99 / max (rounds) | load avg mean (max) |")
        lines.append("|" + "---|" * 12)
        for r in hl:
            lines.append(f"| {r['heartbeat_timeout_ms']} | {r['join_timeout_ms']} | "
                         f"{r['duration_s']} | {r['steps_committed']} | {r['quorum_changes']} | "
                         f"{r['false_drops']} | {len(r['group_exits'])} | "
                         f"{len(r['stale_heartbeats_seen'])} | {r['commit_failures']} | "
                         f"{r.get('max_member_heartbeat_age_s')} | {_spread(r)} | "
                         f"{r['loadavg_mean']} ({r['loadavg_max']}) |")
    return "\n".join(lines)


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or any(x <= 0 for x in out):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return out


def _save(path: str | None, rows: list[dict]) -> None:
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(tmp, path)


def _sigterm(*_):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("healthy", "recovery"):
        sp = sub.add_parser(name)
        sp.add_argument("--heartbeat-ms", type=_ints, default=[5000, 2000, 1000],
                        help="Lighthouse heartbeat_timeout_ms values (comma-separated)")
        sp.add_argument("--join-ms", type=_ints, default=[5000],
                        help="Lighthouse join_timeout_ms values (comma-separated; default 5000, "
                             "the demo's)")
        sp.add_argument("--quorum-timeout", type=float, default=60.0,
                        help="the trainer's --quorum-timeout (torchft Manager quorum_timeout), s")
        sp.add_argument("--out", help="write the rows as JSON here (rewritten after every run)")
        sp.add_argument("--log-dir", help="logs (default: a new temp dir)")
    sub.choices["healthy"].add_argument("--duration", type=float, default=600.0,
                                        help="seconds of healthy training per setting")
    rp = sub.choices["recovery"]
    rp.add_argument("--repeats", type=int, default=3)
    rp.add_argument("--healthy-s", type=float, default=10.0,
                    help="seconds of healthy pace measured before the kill")
    rp.add_argument("--window", type=float, default=5.0,
                    help="seconds of the pace window for back90")
    rp.add_argument("--connect-timeout", type=float, default=None,
                    help="the trainer's --connect-timeout (torchft connect_timeout), s")
    tp = sub.add_parser("table")
    tp.add_argument("files", nargs="+")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)  # stop the job's processes on SIGTERM too
    if a.cmd == "table":
        try:
            rows = [r for f in a.files for r in json.loads(Path(f).read_text())
                    if "error" not in r]
        except (OSError, ValueError) as e:
            raise SystemExit(f"bench_heartbeat table: {e}") from None
        print(table(rows))
        return 0
    log_root = Path(a.log_dir or tempfile.mkdtemp(prefix="bench_heartbeat_"))
    rows: list[dict] = []
    n = 0
    # repeats outermost: the settings take turns, so a change in the machine's load over the
    # run falls on all of them alike (side by side, not one after the other)
    plan = [(rep, hb, join) for rep in range(a.repeats if a.cmd == "recovery" else 1)
            for hb in a.heartbeat_ms for join in a.join_ms]
    for rep, hb, join in plan:
        n += 1
        d = log_root / f"run{n}_hb{hb}_join{join}_{rep}"
        t = time.monotonic()
        try:
            if a.cmd == "healthy":
                row = healthy_run(hb, join, a.duration, d, a.quorum_timeout)
            else:
                row = recovery_run(hb, join, d, a.healthy_s, a.window, a.quorum_timeout,
                                   a.connect_timeout)
        except (TimeoutError, RuntimeError) as e:
            row = {"mode": a.cmd, "heartbeat_timeout_ms": hb, "join_timeout_ms": join,
                   "error": f"{type(e).__name__}: {e}", "log_dir": str(d)}
        row["wall_s"] = round(time.monotonic() - t, 1)
        row["log_dir"] = str(d)
        rows.append(row)
        _save(a.out, rows)
        print(json.dumps({k: v for k, v in row.items()
                          if k not in ("quorums", "rank_quorum_ids")}), flush=True)
    ok = [r for r in rows if "error" not in r]
    print(table(ok))
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
