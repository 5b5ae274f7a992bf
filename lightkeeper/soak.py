"""``lightkeeper demo --soak SECONDS``: a long run of random faults, and what it shows.

The demo injects a seeded random schedule (:func:`lightkeeper.scenario.soak_schedule`, endless)
one fault at a time, as its default story does, until SECONDS of training are up. On top of
the story the soak:

- restarts the monitor once, half-way (same port, same ``--state``), and checks that its audit
  log still holds every decision made before the restart;
- repairs a host whose network fault moved its group away (the fault is lifted once the host is
  quarantined and empty, as a technician would), and the monitor's quarantine expires after
  ``SOAK_QUARANTINE_TTL_S`` so the host returns to the pool;
- records the monitor's resident memory at the start and the end of each of its lives;
- injects each fault once nothing of the last one goes on (its drains, restarts, held
  quarantines: :meth:`lightkeeper.demo_stories.Stories.unsettled`), so each is measured alone.

:func:`summary` turns the demo's report into ``soak.json``: per fault, found (group, rank,
host), time to detect, time back at pace, cost; goodput against the same job without faults
(its healthy pace over the same time) and against torchft alone (:func:`torchft_alone_steps`,
from each fault's :func:`lightkeeper.recovery.torchft_alone`); evictions no fault explains; the
restart's check.
"""

from __future__ import annotations

import time
from itertools import pairwise
from typing import Any


def rss_kb(pid: int | None) -> int | None:
    """Resident memory of ``pid`` in KiB (``/proc/<pid>/status``), None when unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, TypeError):
        pass
    return None


def audit_ids(demo) -> set | None:
    """Every decision id in the monitor's audit log (``GET /v1/evictions``), None if unread."""
    rows = demo.monitor_get("/v1/evictions?limit=100000")
    if not isinstance(rows, list):
        return None
    return {r.get("id") for r in rows}


def restart_monitor(demo) -> dict:
    """Stop the monitor (SIGTERM) and start it again on the same port and state file; the
    record says what its audit log held before and after and the memory it had grown to."""
    from urllib.parse import urlsplit

    from .processes import stop_process

    before = audit_ids(demo)
    rec: dict[str, Any] = {"at_s": demo.now(), "rss_kb_before_stop": rss_kb(demo.monitor_proc.pid),
                           "decisions_before": None if before is None else len(before)}
    port = urlsplit(demo.monitor_url).port
    stop_process(demo.monitor_proc, grace=10.0)
    rec["stopped_exit_code"] = demo.monitor_proc.returncode
    demo.start_monitor(port=port)
    rec["rss_kb_after_start"] = rss_kb(demo.monitor_proc.pid)
    after = audit_ids(demo)
    rec["missing_after_restart"] = (None if before is None or after is None
                                    else sorted(before - after, key=str))
    rec["restarted_in_s"] = round(demo.now() - rec["at_s"], 2)
    demo.event("monitor", None, f"restarted half-way through the soak in "
                                f"{rec['restarted_in_s']:.1f}s; audit log "
                                + ("unreadable" if rec["missing_after_restart"] is None else
                                   f"{len(after)} decisions, none of the {len(before)} before "
                                   "lost" if not rec["missing_after_restart"] else
                                   f"LOST {rec['missing_after_restart']}"))
    return rec


def repair_hosts(demo) -> None:
    """Lift the network fault of a host the monitor quarantined once no group runs on it."""
    if not demo.fabric or not demo.pool:
        return
    bad = set((demo.hosts_view or {}).get("quarantined") or [])
    used = {demo.pool.host_of(g).node for g in demo.cluster.groups
            if demo.pool.host_of(g) is not None}
    for host in demo.fabric.hosts:
        if host.node in bad and host.node not in used and demo.fabric.faults(host.node):
            act = demo.fabric.heal(host.node)
            demo.event("repaired", None, f"host {host.node}: {act.detail if act.ok else act.error}"
                                         " (quarantined and empty: its network fault lifted)")


def _story_ends(faults: list[dict], events: list[dict], end: float) -> list[float]:
    """When each fault's story ended: its ``outcome`` event (``fault N: ...``), else when the
    next fault was injected (a soak's stories run one at a time), else the run's end."""
    told: dict[int, float] = {}
    for e in events:
        head = str(e.get("detail", "")).split(":", 1)[0].removeprefix("fault ")
        if e.get("kind") == "outcome" and head.isdigit():
            told.setdefault(int(head), e["t"])
    nexts = [f.get("injected_at_s") for f in faults[1:]] + [None]
    return [told.get(i, nxt if nxt is not None else end)
            for i, nxt in enumerate(nexts, 1)]


def _attributed(ev: dict, faults: list[dict], ends: list[float],
                repaired: dict[str, list[float]], restarts: dict[int, list[float]], end: float,
                slack_s: float = 5.0) -> bool:
    """An eviction that follows a fault of its group: from its strike to the group's next
    restart (the fault lives in its processes: a story that ended with it still there, not
    detected or held, explains that incarnation's later eviction), else the run's end; a fault
    that never struck until its story's end; and for a network fault until its host was
    repaired (the fault stays on the host: a group restarted there, when the quarantine cap
    holds the host's quarantine, meets it again)."""
    from trainer.faults import NETWORK_KINDS

    for f, story_end in zip(faults, ends, strict=True):
        struck = f.get("struck_at_s")
        start = struck or f.get("injected_at_s")
        stop = story_end if struck is None else min(
            (t for t in restarts.get(f["replica_group"], []) if t > struck), default=end)
        if (f.get("spec") or "").split(":", 1)[0] in NETWORK_KINDS and start is not None:
            stop = max(stop, min((t for t in repaired.get(f.get("host"), []) if t >= start),
                                 default=end))
        if f["replica_group"] == ev["replica_group"] and start is not None \
                and start - slack_s <= ev["at_s"] <= stop + slack_s:
            return True
    return False


def torchft_alone_steps(faults: list[dict], healthy: float | None, start: float,
                        end: float) -> tuple[int | None, float]:
    """Steps the same job would have committed with torchft alone, and when it stopped for
    good (``end`` if it did not): its pace integrated piece by piece, the healthy rate times
    the slowest straggler's factor in force (a straggler drags to the end, and stragglers
    overlap: the job runs at the slowest one's pace), 0 inside any stall (a hang's, a gone
    host's: overlapping stalls count once), 0 after the first fault it never recovers from (a
    partition; a hang the quorum timeout kills). Each fault's part comes from its
    ``torchft_alone`` (:func:`lightkeeper.recovery.torchft_alone`); a fault it does not
    compute costs nothing here."""
    struck = sorted((f for f in faults if f.get("struck_at_s") is not None
                     and f.get("torchft_alone")), key=lambda f: f["struck_at_s"])
    stop = next((f["struck_at_s"] for f in struck if f["torchft_alone"].get("recovery_s") is None
                 and (f["torchft_alone"].get("stall_s") or 0) > 0), end)
    if not healthy:
        return None, stop
    stalls: list[tuple[float, float]] = []  # (from, to)
    slow: list[tuple[float, float]] = []  # (from, the job's pace / the healthy pace)
    for f in struck:
        t, tf = f["struck_at_s"], f["torchft_alone"]
        if t >= stop:
            continue
        if tf.get("recovery_s") is not None:
            stalls.append((t, t + float(tf.get("stall_s") or 0.0)))
        elif tf.get("job_steps") and end > t:  # its drag, measured to the end of the run
            slow.append((t, min(1.0, max(0.0, 1.0 - tf["job_steps"] / (healthy * (end - t))))))
    cuts = sorted({start, stop, *(x for w in stalls for x in w), *(t for t, _ in slow)})
    cuts = [c for c in cuts if start <= c <= stop]
    steps = 0.0
    for a, b in pairwise(cuts):
        if any(s0 <= a and b <= s1 for s0, s1 in stalls):
            continue
        steps += healthy * min((k for t, k in slow if t <= a), default=1.0) * (b - a)
    return round(steps), stop


def own_pace_back(series: list, onset: float | None, end: float,
                  before_s: float = 10.0) -> float | None:
    """Seconds from ``onset`` until the job is back at 90% of its own pace in the ``before_s``
    seconds before it (the pace varies over a long run: spares importing, groups moved), that
    searched until ``end`` (:func:`lightkeeper.recovery.pace_until`)."""
    from .recovery import back_at_pace, step_at

    if onset is None:
        return None
    a, b = step_at(series, onset - before_s), step_at(series, onset)
    if a is None or b is None or b <= a:
        return None
    t = back_at_pace(series, onset, (b - a) / before_s, end)
    return None if t is None else round(t - onset, 2)


def summary(rep: dict, soak: dict, samples: list[dict]) -> dict:
    """The soak's figures from the demo's ``report.json`` (``rep``), its own record and the
    ranks' samples (``timeline.json``)."""
    from .recovery import commit_series, pace_until, step_at

    faults, end = rep["faults"], rep["duration_s"]
    series = commit_series(samples)
    healthy = rep.get("healthy_step_rate")
    rows = []
    for k, f in enumerate(faults):
        onset, det = f.get("struck_at_s"), f.get("detected_at_s")
        tf = f.get("torchft_alone") or {}
        rows.append({
            "kind": (f.get("spec") or "").split(":", 1)[0], "spec": f.get("spec"),
            "replica_group": f["replica_group"], "group_rank": f.get("group_rank"),
            "host": f.get("host"), "outcome": f.get("outcome"),
            "detected_kind": f.get("detected_kind"),
            "right_rank": (None if f.get("group_rank") is None or f.get("culprit_ranks") is None
                           else f.get("rank") in f["culprit_ranks"]),
            # a rank that never reported its strike leaves its host unknown, not wrong
            "right_host": (None if not f.get("culprit_hosts") or f.get("host") is None else
                           f["host"] in f["culprit_hosts"]),
            "detect_s": None if onset is None or det is None else round(det - onset, 2),
            "back_at_pace_s": f.get("recovery_s_ranks"),
            "back_at_own_pace_s": own_pace_back(series, onset, pace_until(faults, k, end)),
            "steps_lost": f.get("steps_lost"),
            "host_quarantined": f.get("host_quarantined_at_s") is not None,
            "restarted_on": f.get("restarted_on"),
            "torchft_alone": tf.get("outcome"),
            # commits lost, as ``steps_lost``: a fault it recovers from costs its stall (its
            # ``job_steps`` also count the capacity lost after it)
            "torchft_alone_steps_lost": tf.get("job_steps") if tf.get("recovery_s") is None
            else None if not healthy else round(float(tf.get("stall_s") or 0.0) * healthy),
        })
    start = rep.get("training_started_at_s") or 0.0
    a, b = step_at(series, start), step_at(series, end)
    committed = None if a is None or b is None else b - a
    fault_free = None if not healthy else round(healthy * (end - start))
    tf_steps, stop = torchft_alone_steps(faults, healthy, start, end)
    # kinds torchft_alone does not compute (a crash is torchft's own) cost that job nothing here
    free = sorted({r["kind"] for r, f in zip(rows, faults, strict=True) if r["kind"] != "crash"
                   and f.get("struck_at_s") is not None and not f.get("torchft_alone")})
    stopped_at = None if stop == end else stop
    evictions = [e for e in rep["evictions"] if e["decision"] == "evict"]
    repaired: dict[str, list[float]] = {}
    for e in rep.get("events", []):
        if e["kind"] == "repaired":
            repaired.setdefault(e["detail"].split(":", 1)[0].removeprefix("host "), []).append(
                e["t"])
    restarts: dict[int, list[float]] = {}
    for e in rep.get("events", []):
        if e["kind"] == "restarted" and e.get("replica_group") is not None:
            restarts.setdefault(e["replica_group"], []).append(e["t"])
    ends = _story_ends(faults, rep.get("events", []), end)
    false = [e for e in evictions if not _attributed(e, faults, ends, repaired, restarts, end)]
    return {
        "seed": soak["seed"], "soak_s": soak["soak_s"], "training_s": round(end - start, 1)
        if rep.get("training_started_at_s") is not None else 0.0,  # stopped before it trained
        "outcome": rep.get("outcome"),  # "interrupted": cut short by Ctrl-C or SIGTERM
        # its time ends a soak; true only if a finite schedule ran out before it
        "schedule_exhausted": bool(soak.get("schedule_exhausted")),
        "faults": rows, "fault_count": len(rows),
        "kinds": sorted({r["kind"] for r in rows}),
        "recovered": sum(1 for r in rows if r["outcome"] == "recovered"),
        "goodput": {
            "healthy_steps_per_s": healthy, "committed_steps": committed,
            "fault_free_steps": fault_free,
            "vs_fault_free": None if not committed or not fault_free
            else round(committed / fault_free, 3),
            "torchft_alone_steps": tf_steps,
            "torchft_alone_stopped_for_good_at_s": stopped_at,
            "vs_torchft_alone": None if not committed or not tf_steps
            else round(committed / tf_steps, 2),
            "torchft_alone_not_computed": free,
        },
        "evictions": len(evictions), "false_evictions": false,
        "quarantines": sorted((rep.get("hosts") or {}).get("quarantined_at_s") or {}),
        "monitor_restart": soak.get("restart"),
        "monitor_rss_kb": soak.get("rss"),
        "made_at_unix": round(time.time()),
    }


def table(s: dict) -> str:
    """The soak in a few lines: one per fault, then the totals."""
    def fmt(v, unit="s"):
        return "-" if v is None else f"{v:.1f}{unit}" if isinstance(v, float) else str(v)

    cut = "" if s.get("outcome") in (None, "completed") else f" ({s['outcome'].upper()})"
    lines = [f"soak{cut}: seed {s['seed']}, {s['training_s']:g}s of training, {s['fault_count']} "
             f"faults ({', '.join(s['kinds'])}), {s['recovered']} recovered",
             "at pace: 90% of the run's first healthy pace; own: of the 10 s before the fault",
             f"{'#':>2} {'fault':<13} {'group':>5} {'rank':>4} {'host':<7} {'found as':<13} "
             f"{'detect':>7} {'at pace':>8} {'own':>6} {'lost':>5}  outcome"]
    for i, r in enumerate(s["faults"], 1):
        lines.append(f"{i:>2} {r['kind']:<13} {r['replica_group']:>5} "
                     f"{fmt(r['group_rank']):>4} {fmt(r['host']):<7} "
                     f"{fmt(r['detected_kind']):<13} {fmt(r['detect_s']):>7} "
                     f"{fmt(r['back_at_pace_s']):>8} {fmt(r['back_at_own_pace_s']):>6} "
                     f"{fmt(r['steps_lost']):>5}  {r['outcome']}")
    g = s["goodput"]
    lines.append(f"goodput: {fmt(g['committed_steps'])} steps committed; "
                 f"{fmt(g['vs_fault_free'], 'x')} of the same time without faults "
                 f"({fmt(g['fault_free_steps'])}), {fmt(g['vs_torchft_alone'], 'x')} torchft "
                 f"alone ({fmt(g['torchft_alone_steps'])}"
                 + (f"; {', '.join(g['torchft_alone_not_computed'])} not computed, counted as "
                    "costing it nothing" if g.get("torchft_alone_not_computed") else "") + ")")
    r = s.get("monitor_restart") or {}
    lines.append(f"evictions {s['evictions']}, false {len(s['false_evictions'])}; monitor "
                 f"restarted at {fmt(r.get('at_s'))}, audit decisions lost: "
                 f"{fmt(r.get('missing_after_restart'))}; monitor RSS (KiB) "
                 + ", ".join(f"life {x['life']} " + ", ".join(f"{k} {v}" for k, v in x.items()
                                                               if k != "life")
                             for x in s.get("monitor_rss_kb") or []))
    return "\n".join(lines)
