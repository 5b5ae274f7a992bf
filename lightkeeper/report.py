"""The demo's report: ``report.json`` (a documented interface, see docs/demo.md), ``report.md``
(the summary table) and ``timeline.png`` (step rate per group over time, events marked).

Times are seconds since the demo started; null when it did not happen. A fault's phase starts
when it *struck* (the rank's own report), not when it was armed: a fault given at start may
strike long after the group started, or never.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from pathlib import Path
from typing import Any

from . import recovery
from .faulttrack import FINDING_SLACK_S, finding_culprits
from .report_text import fault_kind, markdown, plot, summary_markdown, where

REPORT_VERSION = 1
MIN_HEALTHY_S = 3.0  # a shorter healthy phase is a few steps at the demo's pace: no baseline


def _tick_at(ticks: list[tuple[float, int]], t: float) -> tuple[float, int] | None:
    """The last tick at or before ``t`` that saw a step: (its time, the job's step)."""
    best = None
    for tt, step in ticks:
        if tt > t:
            break
        if step >= 0:
            best = (tt, step)
    return best


def _job_step_at(ticks: list[tuple[float, int]], t: float) -> int | None:
    got = _tick_at(ticks, t)
    return None if got is None else got[1]


def _rate(ticks, start: float, end: float) -> float | None:
    """Steps per second between the ticks that saw ``start`` and ``end``: over the time
    between those observations, not past the last one (the job stopped, nothing was seen)."""
    a, b = _tick_at(ticks, start), _tick_at(ticks, end)
    if a is None or b is None or end - start < 1.0 or b[0] - a[0] < 1.0:
        return None
    return round((b[1] - a[1]) / (b[0] - a[0]), 3)


def _others(cpu, start: float, end: float) -> float | None:
    """The cores the machine's other processes took between the demo's samples (``cpu``: its
    ``cpu_ticks``, (t, the machine's busy CPU s, the demo's own processes') at or before
    ``start`` and ``end``: busy less the demo's own; None where not measured."""
    i, j = (bisect_right(cpu, t, key=lambda c: c[0]) for t in (start, end))  # a soak's hours of them
    if not i or not j or cpu[j - 1][0] - cpu[i - 1][0] < 1.0:
        return None
    a, b = cpu[i - 1], cpu[j - 1]
    return round(max(0.0, (b[1] - a[1] - (b[2] - a[2])) / (b[0] - a[0])), 2)


def no_baseline(train_start: float | None, faults: list[dict]) -> str | None:
    """Why the run has no healthy pace to compare with (None: it has one): a fault struck before
    training, or within ``MIN_HEALTHY_S`` of its start, so the first phase is the fault's."""
    early = [(f["struck_at_s"], i, f) for i, f in enumerate(faults, 1)
             if train_start is not None and f["struck_at_s"] is not None
             and f["struck_at_s"] < train_start + MIN_HEALTHY_S]
    if not early:
        return None
    at, i, f = min(early, key=lambda e: e[0])
    when = ("before training started" if at <= train_start
            else f"{at - train_start:.1f}s after training started")
    return (f"no healthy baseline: fault {i} ({fault_kind(f)} in {where(f)}) struck at "
            f"{at:.1f}s, {when} ({train_start:.1f}s): the job never trained "
            f"{MIN_HEALTHY_S:g}s without a fault to pace the rest against")


def healthy_rate(ph: list[dict]) -> float | None:
    """The healthy pace :func:`phases` compared the others with: the first phase's, None when
    it had none (:func:`no_baseline`, or a first phase too short to pace)."""
    return ph[0]["step_rate"] if ph and ph[0]["vs_healthy"] is not None else None


def _out(t: float, faults: list[dict], groups: int, lighthouse) -> set[int]:
    """Groups out of the job at ``t``: evicted and not back, or left out of the Lighthouse's
    newest quorum by then (a hung group nobody evicted; its replica ids name their group)."""
    out = {f["replica_group"] for f in faults if f["evicted_at_s"] is not None
           and f["evicted_at_s"] <= t and (f["rejoined_at_s"] is None or f["rejoined_at_s"] > t)}
    seen = [e for e in lighthouse if e["t"] <= t and e.get("members")]
    if seen:
        ids = {m.split(":")[0].removeprefix("replica_group_") for m in seen[-1]["members"]}
        out |= {g for g in range(groups) if str(g) not in ids}
    return out


def phases(train_start: float | None, end: float, faults: list[dict], groups: int,
           ticks, lighthouse=(), cpu=()) -> list[dict]:
    """Consecutive phases between the scenario's events, with the job's committed step rate;
    ``vs_healthy`` against the first phase unless :func:`no_baseline` says there is none.
    ``lighthouse``: the demo's log of the Lighthouse's quorums, which says who else is out;
    ``cpu``: the demo's CPU samples, which give ``others_cores`` (:func:`_others`)."""
    if train_start is None:
        return []
    marks: list[tuple[float, str]] = [(train_start, "healthy")]
    for f in faults:
        g = f["replica_group"]
        if f["struck_at_s"] is not None:
            marks.append((max(train_start, f["struck_at_s"]), f"{fault_kind(f)} in {where(f)}"))
        if f["evicted_at_s"] is not None:
            n = groups - len(_out(f["evicted_at_s"], faults, groups, lighthouse) | {g})
            marks.append((f["evicted_at_s"], f"group {g} evicted ({n} groups)"))
        if f["rejoined_at_s"] is not None:
            out = sorted(_out(f["rejoined_at_s"], faults, groups, lighthouse) - {g})
            marks.append((f["rejoined_at_s"], f"healthy (group {g} rejoined)" if not out else
                          f"group {g} rejoined, group{'s' * (len(out) > 1)} "
                          f"{', '.join(map(str, out))} out ({groups - len(out)} groups)"))
    marks.sort()
    out = []
    for i, (start, name) in enumerate(marks):
        stop = marks[i + 1][0] if i + 1 < len(marks) else end
        if stop <= start:
            continue
        a, b = _job_step_at(ticks, start), _job_step_at(ticks, stop)
        out.append({"name": name, "start_s": round(start, 2), "end_s": round(stop, 2),
                    "steps": None if a is None or b is None else b - a,
                    "step_rate": _rate(ticks, start, stop),
                    "others_cores": _others(cpu, start, stop)})
    healthy = out[0]["step_rate"] if out and not no_baseline(train_start, faults) else None
    for p in out:
        p["vs_healthy"] = (round(p["step_rate"] / healthy, 2)
                           if healthy and p["step_rate"] is not None else None)
    return out


def attributed_fault(d: dict, faults: list[dict], end: float) -> int | None:
    """The fault (1-based) that explains detection ``d``: confirmed in the fault's window
    (:func:`lightkeeper.recovery.fault_windows`, 1 s slack) in the same group, or for a
    job-wide finding (the survivors' stall) the one that acted last of those whose window holds
    it (:func:`lightkeeper.recovery.last_acted`), as :func:`~lightkeeper.recovery.job_wide_owners`
    gives the cost."""
    held = [k for k, (f, w) in enumerate(zip(faults, recovery.fault_windows(faults, end),
                                             strict=True))
            if w is not None and d["replica_group"] in (None, f["replica_group"])
            and w[0] - FINDING_SLACK_S <= d["at_s"] <= w[1] + FINDING_SLACK_S]
    k = recovery.last_acted(faults, held)
    return None if k is None else k + 1


def detections(findings: list[dict], evictions: list[dict], t0_unix: float,
               faults: list[dict] | None = None, end: float = float("inf"),
               incidents: list[dict] | None = None) -> list[dict]:
    """Every finding the monitor confirmed, with the culprits it named, the fault it is
    attributed to (``fault``: 1-based index into ``faults``, null when no fault explains it)
    and its bundle: its eviction's, else one the goodput ``incidents`` list for it (a finding
    confirmed but not evicted, a dry run: its confirmation's)."""
    by_finding = {fid: i["bundles"][0] for i in incidents or [] if i.get("bundles")
                  for fid in i.get("finding_ids") or []}
    out = []
    for f in findings:
        if not f.get("confirmed_at"):
            continue
        ev = [d for d in evictions if d["decision"] == "evict"
              and d["replica_group"] == f["replica_group"]
              and (d.get("replica_id") is None or d.get("replica_id") == f.get("replica_id"))
              and d["at"] >= f["confirmed_at"] - 1.0 and d.get("reason") == f["kind"]]
        culprit_ranks, culprit_hosts = finding_culprits(f)
        d = {"kind": f["kind"], "replica_group": f["replica_group"],
             "ranks": f.get("ranks"), "culprit_ranks": culprit_ranks,
             "culprit_hosts": culprit_hosts, "replica_id": f.get("replica_id"),
             "at_s": round(f["confirmed_at"] - t0_unix, 2), "evicted": bool(ev),
             "bundle": next((e["bundle"] for e in ev if e.get("bundle")),
                            by_finding.get(f.get("id")))}
        d["fault"] = attributed_fault(d, faults or [], end)
        out.append(d)
    return sorted(out, key=lambda d: d["at_s"])


def bundle_file(report_dir: Path, bundle_id: str | None) -> str | None:
    """An eviction's incident bundle, relative to the report (the demo's monitor keeps its
    bundles in ``incidents/`` beside its ``--state``, inside the report folder); None: none."""
    if not bundle_id:
        return None
    rel = f"incidents/{bundle_id}.tar.gz"
    return rel if (Path(report_dir) / rel).is_file() else None


def final_steps(samples: list[dict]) -> dict[str, int]:
    """Each group's furthest rank at its last look (a group that finished its --steps has no
    live rank to ask any more); a look is a tick (``tick``), its ranks answering at their own
    times (``t``)."""
    last: dict[int, tuple[float, int]] = {}
    for s in samples:
        t, step = last.get(s["replica_group"], (-1.0, -1))
        look = s.get("tick", s["t"])  # an older timeline's samples share their tick's t
        if look > t:
            last[s["replica_group"]] = (look, s["step"])
        elif look == t:
            last[s["replica_group"]] = (t, max(step, s["step"]))
    return {str(g): step for g, (_, step) in sorted(last.items())}


def settings(demo) -> dict[str, Any]:
    """The timeouts and thresholds the run used (torchft's, the monitor's)."""
    sc = demo.sc
    return {"pg_timeout_s": sc.pg_timeout_s, "quorum_timeout_s": sc.quorum_timeout_s,
            "join_timeout_ms": sc.join_timeout_ms,
            "heartbeat_timeout_ms": sc.heartbeat_timeout_ms, "hang_floor_s": sc.hang_floor_s,
            "step_pause_s": sc.step_pause_s, "warm_spares": sc.warm_spares}


def recoveries(faults: list[dict], ph: list[dict], samples: list[dict], lighthouse: list[dict],
               evictions: list[dict], goodput: dict | None, t0_unix: float, end: float,
               groups: int, cfg: dict[str, Any]) -> None:
    """Add each fault's ``stages``, ``recovery_s``, measured ``cost`` and computed
    ``torchft_alone`` (:mod:`lightkeeper.recovery`) in place."""
    healthy = healthy_rate(ph)
    job_wide = recovery.job_wide_owners(faults, goodput, t0_unix, end)
    windows = recovery.fault_windows(faults, end)
    detected = [recovery.detected_incident(f, goodput, t0_unix) for f in faults]
    for k, f in enumerate(faults):
        st = recovery.stages(f, samples, lighthouse, evictions, healthy, end,
                             until=recovery.pace_until(faults, k, end))
        # an incident another fault's detection matched is not this one's too
        taken = {i.get("id") for j, i in enumerate(detected) if i is not None and j != k}
        inc = recovery.ledger_incident(f, goodput, t0_unix,
                                       until=None if windows[k] is None else windows[k][1],
                                       taken=taken)
        cost = recovery.measured_cost(inc, t0_unix, groups, job_wide.get(k, []),
                                      ledger_at=(goodput or {}).get("at") or t0_unix + end)
        # a recovery another fault's confirmation cut short: its end is that detection, not
        # the job back at pace
        superseded = bool(cost) and cost.get("back_to_pace") == "superseded"
        # settled below pace: the start of a steady period at a new level, no time the job
        # was back at 90% of healthy pace, which the ranks' back_at_pace is
        settled = bool(cost) and cost.get("back_to_pace") == "settled"
        st["back_at_pace_ledger"] = cost["back_to_pace_s"] if cost and not superseded \
            and not settled else None
        f["stages"] = st
        f["cost"] = cost
        onset = f.get("struck_at_s")
        # from the fault's onset, as every stage: the ledger's incident may begin later (a slow
        # link judged only once the job ran slow enough), its own recovery_s with it
        back = st["back_at_pace_ledger"]
        measured = bool(cost) and cost.get("recovery_s") is not None and not superseded
        f["recovery_s"] = (round(back - onset, 2) if back is not None and onset is not None
                           else cost["recovery_s"]) if measured else None
        f["superseded_by"] = cost.get("superseded_by") if superseded else None
        f["settled_pace"] = (inc or {}).get("settled_pace") if settled else None
        f["recovery_s_ranks"] = (round(st["back_at_pace"] - onset, 2)
                                 if st["back_at_pace"] is not None and onset is not None
                                 else None)
        slow = next((p["step_rate"] for p in ph if p["name"] == f"{fault_kind(f)} in {where(f)}"
                     and onset is not None and abs(p["start_s"] - onset) < 0.5), None)
        # survivors held in the collective the gone host left: the monitor told them to abort
        blocked = any(d["decision"] == "abort" and d["replica_group"] == f["replica_group"]
                      and onset is not None and d["at_s"] >= onset - 1.0
                      for d in evictions)
        for key, settings in (("torchft_alone", cfg),
                              ("torchft_alone_at_defaults", recovery.TORCHFT_DEFAULTS)):
            f[key] = recovery.torchft_alone(
                f, groups=groups, horizon_s=None if onset is None else round(end - onset, 2),
                healthy_rate=healthy, slow_rate=slow, settings=settings, blocked=blocked)


def _goodput_summary(g: dict | None) -> dict | None:
    """The job's goodput as the monitor's ledger had it at the end (null without a ledger)."""
    if not isinstance(g, dict) or not isinstance(g.get("job"), dict):
        return None
    job = g["job"]
    return {"source": "measured: the monitor's ledger (GET /v1/goodput)",
            "goodput_ratio": job.get("goodput_ratio"),
            "goodput_seconds": job.get("goodput_seconds"),
            "expected_seconds": job.get("expected_seconds"),
            "badput_seconds": job.get("badput_seconds"),
            "pending_seconds": job.get("pending_seconds"),
            "baseline_step_seconds": (g.get("baseline") or {}).get("step_seconds")}


def build_report(demo) -> dict[str, Any]:
    now = demo.now()
    # what is measured ends with the last look at the ranks, not after stopping them
    end = demo.ticks[-1][0] if demo.ticks else now
    faults = [dict(f) for f in demo.faults]
    ph = phases(demo.train_start_s, end, faults, demo.args.groups, demo.ticks,
                demo.lighthouse_log, getattr(demo, "cpu_ticks", ()))
    healthy = healthy_rate(ph)
    for f, w in zip(faults, recovery.fault_windows(faults, end), strict=True):
        start = f["struck_at_s"]
        stop = None if w is None else w[1]
        if healthy and start is not None and stop is not None:
            a, b = _job_step_at(demo.ticks, start), _job_step_at(demo.ticks, stop)
            if a is not None and b is not None:
                f["steps_lost"] = max(0, round(healthy * (stop - start) - (b - a)))
    evictions = [{"replica_group": d["replica_group"], "replica_id": d.get("replica_id"),
                  "decision": d["decision"], "reason": d.get("reason"),
                  "at_s": round(d["at"] - demo.t0_unix, 2), "status": d.get("status"),
                  "detail": d.get("detail"), "bundle": d.get("bundle"),
                  "bundle_file": bundle_file(demo.dir, d.get("bundle"))}
                 for d in demo.evictions]
    cfg = settings(demo)
    hosts_view = getattr(demo, "hosts_view", None)
    for f in faults:
        f["host_state"] = host_state(hosts_view, f.get("host"))
    recoveries(faults, ph, demo.samples, demo.lighthouse_log, evictions, demo.goodput,
               demo.t0_unix, end, demo.args.groups, cfg)
    return {
        "version": REPORT_VERSION,
        "started_at_unix": round(demo.t0_unix, 3),
        "duration_s": now,
        "training_started_at_s": demo.train_start_s,
        "config": {"groups": demo.args.groups, "ranks_per_group": demo.args.ranks_per_group,
                   "dry_run": bool(demo.args.dry_run), "no_faults": bool(demo.args.no_faults),
                   "steps": demo.args.steps, "duration": demo.args.duration, **cfg},
        "outcome": ("interrupted" if demo.interrupted else "error" if demo.error else "completed"),
        "error": demo.error,
        "faults": faults,
        "detections": [{**d, "bundle_file": bundle_file(demo.dir, d["bundle"])} for d in
                       detections(demo.findings, demo.evictions, demo.t0_unix, faults, now,
                                  (demo.goodput or {}).get("incidents"))],
        "evictions": evictions,
        "restarts": [{"replica_group": e["replica_group"], "at_s": e["t"]}
                     for e in demo.events if e["kind"] == "restarted"],
        "hosts": hosts_summary(demo),
        "placements": list(getattr(demo, "placements", [])),
        "phases": ph,
        "healthy_step_rate": healthy,
        "no_baseline": no_baseline(demo.train_start_s, faults),
        "goodput": _goodput_summary(demo.goodput),
        "final_steps": final_steps(demo.samples),
        "events": demo.events,
        # as a user on this machine reaches them (on a fabric: forwards from 127.0.0.1)
        "urls": {"lighthouse": demo.user_url(demo.cluster.lighthouse_url),
                 "monitor": demo.user_url(demo.monitor_url),
                 "prometheus": demo.user_url(demo.prom.url) if demo.prom else None},
        "prometheus": demo.prom_note or None,
        "pids": demo.pids(),
    }


def host_state(hosts_view: dict | None, host: str | None) -> str | None:
    """A host's state in the monitor's ledger at the end (``ok`` when it is not in the ledger:
    it never offended), with its offences that count: "suspect (1 straggler offence)"."""
    if not host or not isinstance(hosts_view, dict):
        return None
    h = next((h for h in hosts_view.get("hosts") or [] if h.get("host") == host), None)
    if h is None:
        return "ok"
    counted: dict[str, int] = {}
    for o in h.get("offences") or []:
        if o.get("in_window"):
            counted[o["kind"]] = counted.get(o["kind"], 0) + 1
    out = h.get("state") or "?"
    if counted:
        out += " (" + ", ".join(f"{n} {k} offence{'s' if n > 1 else ''}"
                                for k, n in counted.items()) + ")"
    hold = h.get("hold")
    if isinstance(hold, dict):
        out += f", held ({hold.get('reason')}): {hold.get('detail')}"
    return out


def hosts_summary(demo) -> dict[str, Any] | None:
    """The demo's hosts (node, address), which group ran where at the end, and the monitor's
    quarantine list and policy as ``GET /v1/hosts`` last served them."""
    pool = getattr(demo, "pool", None)
    if pool is None:
        return None
    view = getattr(demo, "hosts_view", None) or {}
    return {"hosts": [{"node": h.node, "addr": h.addr} for h in pool.hosts],
            "groups": {str(g): h.node for g, h in sorted(pool.assigned.items())},
            "quarantined": view.get("quarantined"),
            "quarantined_at_s": dict(getattr(demo, "quarantines", {})),
            "states": {h["host"]: h.get("state") for h in view.get("hosts") or []},
            "policy": view.get("policy"), "dry_run": view.get("dry_run"),
            "waiting": {str(g): t for g, t in getattr(demo, "waiting", {}).items()}}


def write_report(demo, report_dir: Path, final: bool = True) -> str:
    """Write report.json, report.md, timeline.png and timeline.json; return the summary table."""
    report_dir = Path(report_dir)
    rep = build_report(demo)
    picture, error = report_dir / "timeline.png", report_dir / "timeline.error.txt"
    try:
        plot(demo.samples, demo.args.ranks_per_group, rep, picture)
        error.unlink(missing_ok=True)
    except Exception as e:  # a report without its picture beats no report
        picture.unlink(missing_ok=True)  # an older run's would pass for this one's
        rep["timeline_error"] = f"{type(e).__name__}: {e}"
        error.write_text(repr(e))
    (report_dir / "report.json").write_text(json.dumps(rep, indent=1))
    (report_dir / "timeline.json").write_text(json.dumps(
        {"samples": demo.samples, "ticks": demo.ticks, "lighthouse": demo.lighthouse_log,
         "goodput": demo.goodput, "t0_unix": demo.t0_unix}))
    (report_dir / "report.md").write_text(markdown(rep))
    return summary_markdown(rep)
