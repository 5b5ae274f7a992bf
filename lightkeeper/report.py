"""The demo's report: ``report.json`` (a documented interface, see docs/demo.md), ``report.md``
(the summary table) and ``timeline.png`` (step rate per group over time, events marked).

Times are seconds since the demo started; null when it did not happen. A fault's phase starts
when it *struck* (the rank's own report), not when it was armed: a fault given at start may
strike long after the group started, or never.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import recovery
from .faulttrack import FINDING_SLACK_S, finding_culprits

REPORT_VERSION = 1


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


def phases(train_start: float | None, end: float, faults: list[dict], groups: int,
           ticks) -> list[dict]:
    """Consecutive phases between the scenario's events, with the job's committed step rate."""
    if train_start is None:
        return []
    marks: list[tuple[float, str]] = [(train_start, "healthy")]
    for f in faults:
        g = f["replica_group"]
        if f["struck_at_s"] is not None:
            marks.append((max(train_start, f["struck_at_s"]), f"{fault_kind(f)} in {where(f)}"))
        if f["evicted_at_s"] is not None:
            marks.append((f["evicted_at_s"], f"group {g} evicted ({groups - 1} groups)"))
        if f["rejoined_at_s"] is not None:
            marks.append((f["rejoined_at_s"], f"healthy (group {g} rejoined)"))
    marks.sort()
    out = []
    for i, (start, name) in enumerate(marks):
        stop = marks[i + 1][0] if i + 1 < len(marks) else end
        if stop <= start:
            continue
        a, b = _job_step_at(ticks, start), _job_step_at(ticks, stop)
        out.append({"name": name, "start_s": round(start, 2), "end_s": round(stop, 2),
                    "steps": None if a is None or b is None else b - a,
                    "step_rate": _rate(ticks, start, stop)})
    healthy = out[0]["step_rate"] if out else None
    for p in out:
        p["vs_healthy"] = (round(p["step_rate"] / healthy, 2)
                           if healthy and p["step_rate"] is not None else None)
    return out


def fault_kind(f: dict) -> str:
    return (f["spec"] or "?").split(":", 1)[0]


def where(f: dict) -> str:
    return f"group {f['replica_group']}" + ("" if f.get("group_rank") is None
                                            else f" rank {f['group_rank']}")


def attributed_fault(d: dict, faults: list[dict], end: float) -> int | None:
    """The fault (1-based) that explains detection ``d``: same group, confirmed between its
    strike (arming, if no strike was seen; 1 s slack) and its group's rejoin (else the end)."""
    for i, f in enumerate(faults, 1):
        start = f["struck_at_s"] if f["struck_at_s"] is not None else (
            f["injected_at_s"] if f["detected_at_s"] is not None else None)
        if f["replica_group"] != d["replica_group"] or start is None:
            continue
        stop = f["rejoined_at_s"] if f["rejoined_at_s"] is not None else end
        if start - FINDING_SLACK_S <= d["at_s"] <= stop + FINDING_SLACK_S:
            return i
    return None


def detections(findings: list[dict], evictions: list[dict], t0_unix: float,
               faults: list[dict] | None = None, end: float = float("inf")) -> list[dict]:
    """Every finding the monitor confirmed, with the culprits it named and the fault it is
    attributed to (``fault``: 1-based index into ``faults``, null when no fault explains it)."""
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
             "bundle": next((e["bundle"] for e in ev if e.get("bundle")), None)}
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


def bundle_link(e: dict) -> str:
    """A markdown link to an eviction's bundle, or the reason there is none."""
    if e.get("bundle_file"):
        return f"[{e['bundle']}]({e['bundle_file']})"
    return f"`{e['bundle']}` (not in the report folder)" if e.get("bundle") else "none kept"


def final_steps(samples: list[dict]) -> dict[str, int]:
    """Each group's furthest rank at its last sample (a group that finished its --steps has no
    live rank to ask any more)."""
    last: dict[int, tuple[float, int]] = {}
    for s in samples:
        t, step = last.get(s["replica_group"], (-1.0, -1))
        if s["t"] > t:
            last[s["replica_group"]] = (s["t"], s["step"])
        elif s["t"] == t:
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
    healthy = ph[0]["step_rate"] if ph else None
    for f in faults:
        st = recovery.stages(f, samples, lighthouse, evictions, healthy, end)
        inc = recovery.ledger_incident(f, goodput, t0_unix)
        cost = recovery.measured_cost(inc, t0_unix, groups)
        st["back_at_pace_ledger"] = cost["back_to_pace_s"] if cost else None
        f["stages"] = st
        f["cost"] = cost
        onset = f.get("struck_at_s")
        f["recovery_s"] = cost["recovery_s"] if cost and cost.get("recovery_s") is not None \
            else None
        f["recovery_s_ranks"] = (round(st["back_at_pace"] - onset, 2)
                                 if st["back_at_pace"] is not None and onset is not None
                                 else None)
        slow = next((p["step_rate"] for p in ph if p["name"] == f"{fault_kind(f)} in {where(f)}"
                     and onset is not None and abs(p["start_s"] - onset) < 0.5), None)
        f["torchft_alone"] = recovery.torchft_alone(
            f, groups=groups, horizon_s=None if onset is None else round(end - onset, 2),
            healthy_rate=healthy, slow_rate=slow, settings=cfg)
        f["torchft_alone_at_defaults"] = recovery.torchft_alone(
            f, groups=groups, horizon_s=None if onset is None else round(end - onset, 2),
            healthy_rate=healthy, slow_rate=slow, settings=recovery.TORCHFT_DEFAULTS)


def build_report(demo) -> dict[str, Any]:
    now = demo.now()
    # what is measured ends with the last look at the ranks, not after stopping them
    end = demo.ticks[-1][0] if demo.ticks else now
    faults = [dict(f) for f in demo.faults]
    ph = phases(demo.train_start_s, end, faults, demo.args.groups, demo.ticks)
    healthy = ph[0]["step_rate"] if ph else None
    for f in faults:
        start = f["struck_at_s"]
        stop = f["rejoined_at_s"] or (end if start is not None else None)
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
        "detections": detections(demo.findings, demo.evictions, demo.t0_unix, faults, now),
        "evictions": evictions,
        "restarts": [{"replica_group": e["replica_group"], "at_s": e["t"]}
                     for e in demo.events if e["kind"] == "restarted"],
        "hosts": hosts_summary(demo),
        "placements": list(getattr(demo, "placements", [])),
        "phases": ph,
        "healthy_step_rate": healthy,
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


def story_lines(rep: dict) -> list[str]:
    """Each fault's story in one line, each step with its time: struck (rank, host) ->
    finding naming rank and host -> eviction -> host quarantined -> restarted on a host ->
    rejoined -> back at pace."""
    out = []
    for i, f in enumerate(rep["faults"], 1):
        steps = []
        if f["struck_at_s"] is not None:
            steps.append(f"struck group {f['replica_group']}"
                         + (f" rank {f['rank']}" if f.get("rank") is not None else "")
                         + (f" on {f['host']}" if f.get("host") else "")
                         + f" at {f['struck_at_s']:.1f}s")
        if f["detected_at_s"] is not None:
            steps.append(f"{f['detected_kind']} finding naming {_culprit(f)} at "
                         f"{f['detected_at_s']:.1f}s")
        if f["evicted_at_s"] is not None:
            steps.append(f"evicted at {f['evicted_at_s']:.1f}s")
        if f.get("host_quarantined_at_s") is not None:
            steps.append(f"{f['host']} quarantined at {f['host_quarantined_at_s']:.1f}s")
        elif f.get("host") and f.get("host_state") and f["detected_at_s"] is not None:
            steps.append(f"{f['host']} not quarantined: {f['host_state']}")
        if f["restarted_at_s"] is not None:
            on = f.get("restarted_on")
            moved = on and f.get("host") and on != f["host"]
            steps.append("restarted" + (f" on {on}" if on else "")
                         + (f" ({f['restarted_addr']})" if on and f.get("restarted_addr")
                            else "")
                         + (", a spare host" if moved else ", same host" if on else "")
                         + f" at {f['restarted_at_s']:.1f}s")
        if f["rejoined_at_s"] is not None:
            steps.append(f"rejoined at {f['rejoined_at_s']:.1f}s")
        back = _back_at(f)
        if back is not None:
            steps.append(f"back at pace at {back:.1f}s")
        out.append(f"fault {i} ({fault_kind(f)}): " + (" -> ".join(steps) or "no step seen")
                   + f"; {f['outcome']}")
    hs = rep.get("hosts") or {}
    for g, since in (hs.get("waiting") or {}).items():
        out.append(f"group {g} waits since {since:.1f}s: its host is quarantined and no other "
                   "host is free (--spare-hosts)")
    return out


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


def _fmt(v, unit: str = "s") -> str:
    if v is None:
        return "—"
    return f"{v:.1f}{unit}" if isinstance(v, float) else f"{v}{unit}"


def _culprit(f: dict) -> str:
    """What the finding named: culprit ranks and hosts when the monitor served them, else the
    finding's ranks (in parentheses: the ranks it looked at, not a culprit)."""
    if f.get("culprit_ranks") is not None:
        out = "rank" + ("s " if len(f["culprit_ranks"]) != 1 else " ") + ", ".join(
            str(r) for r in f["culprit_ranks"])
    elif f.get("finding_ranks") or f.get("ranks"):
        out = "(ranks " + ", ".join(str(r) for r in f.get("finding_ranks") or f["ranks"]) + ")"
    else:
        return "—"
    hosts = list(dict.fromkeys(f.get("culprit_hosts") or []))  # each host once, in order
    return out + (f" on {', '.join(hosts)}" if hosts else "")


def summary_markdown(rep: dict) -> str:
    lines = ["| # | fault | where (global rank, host) | armed | struck | caught as | culprit "
             "| detected | evicted | survivors committing | back at pace | rejoined | steps lost "
             "| outcome |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, f in enumerate(rep["faults"], 1):
        place = where(f)
        if f.get("rank") is not None or f.get("host"):
            place += " (" + ", ".join(x for x in (
                None if f.get("rank") is None else f"rank {f['rank']}", f.get("host")) if x) + ")"
        armed = "at start" if f.get("given") == "start" else _fmt(f["injected_at_s"])
        caught = (f"{f['detected_kind']} in group {f['replica_group']}"
                  if f["detected_kind"] else "—")
        lines.append(f"| {i} | `{f['spec']}` | {place} | {armed} | {_fmt(f['struck_at_s'])} "
                     f"| {caught} | {_culprit(f) if f['detected_kind'] else '—'} "
                     f"| {_fmt(f['detected_at_s'])} | {_fmt(f['evicted_at_s'])} "
                     f"| {_fmt(f['survivors_committing_at_s'])} "
                     f"| {_fmt(_back_at(f))} | {_fmt(f['rejoined_at_s'])} "
                     f"| {_fmt(f['steps_lost'], '')} | {f['outcome']} |")
    if not rep["faults"]:
        lines.append("| – | (no faults) | | | | | | | | | | | | |")
    notes = [f"- fault {i}: {f['note']}" for i, f in enumerate(rep["faults"], 1) if f.get("note")]
    if notes:
        lines += [""] + notes
    story = story_lines(rep)
    if story:
        lines += ["", "The story, step by step (seconds since the demo started):", ""]
        lines += [f"- {line}" for line in story]
    if any(f.get("stages") for f in rep["faults"]):
        lines += ["", stages_markdown(rep), "", cost_markdown(rep)]
    lines += ["", "| phase | from | to | steps | steps/s | vs healthy |",
              "|---|---|---|---|---|---|"]
    for p in rep["phases"]:
        vs = f"{p['vs_healthy']:.2f}x" if p["vs_healthy"] is not None else "—"
        rate = f"{p['step_rate']:.2f}" if p["step_rate"] is not None else "—"
        lines.append(f"| {p['name']} | {p['start_s']:.1f}s | {p['end_s']:.1f}s "
                     f"| {_fmt(p['steps'], '')} | {rate} | {vs} |")
    return "\n".join(lines)


def _back_at(f: dict) -> float | None:
    """Back at >= 90% of healthy pace: the monitor's ledger, else the ranks' commits."""
    st = f.get("stages") or {}
    return st.get("back_at_pace_ledger") if st.get("back_at_pace_ledger") is not None \
        else st.get("back_at_pace")


def _plus(v, onset) -> str:
    return "—" if v is None or onset is None else f"+{v - onset:.1f}"


STAGE_COLUMNS = (("detected", "detected"), ("kill_sent", "kill sent"),
                 ("lighthouse_dropped", "Lighthouse dropped it"),
                 ("survivors_quorum", "survivors' quorum"),
                 ("survivors_committing", "survivors committing"),
                 ("back_at_pace", "back at pace (ranks)"),
                 ("back_at_pace_ledger", "back at pace (ledger)"), ("restarted", "restarted"),
                 ("joined", "joined"), ("healed", "healed"))


def stages_markdown(rep: dict) -> str:
    """Each recovery stage by stage, in seconds after the fault's onset (measured)."""
    head = "| # | onset | " + " | ".join(name for _, name in STAGE_COLUMNS) + " | join dip |"
    lines = ["Recovery, stage by stage (seconds after the onset; measured):", "", head,
             "|" + "---|" * (len(STAGE_COLUMNS) + 3)]
    for i, f in enumerate(rep["faults"], 1):
        st = f.get("stages") or {}
        onset = st.get("onset")
        dip = st.get("join_dip")
        dip_s = "—" if not dip else (
            f"{'stalled' if dip['stalled'] else 'no stall'}: longest gap {dip['stall_s']:.1f}s, "
            f"lowest {dip['min_vs_healthy'] if dip['min_vs_healthy'] is not None else '—'}x")
        lines.append(f"| {i} | {_fmt(onset)} | "
                     + " | ".join(_plus(st.get(k), onset) for k, _ in STAGE_COLUMNS)
                     + f" | {dip_s} |")
    return "\n".join(lines)


def cost_markdown(rep: dict) -> str:
    """What each fault cost (measured by the monitor's ledger) beside what torchft alone would
    have cost under the same settings, and at torchft's defaults (computed)."""
    lines = ["What each fault cost: with Lightkeeper (measured by the monitor's ledger) and "
             "with torchft alone (computed from the timeouts: the same settings, and torchft's "
             "defaults):", "",
             "| # | fault | recovery, onset -> back at pace (measured) | cost (measured) "
             "| torchft alone, same settings (computed) | torchft alone, defaults (computed) |",
             "|---|---|---|---|---|---|"]
    for i, f in enumerate(rep["faults"], 1):
        c = f.get("cost")
        rec = f.get("recovery_s")
        rec_s = (f"{rec:.1f}s (ledger)" if rec is not None else "—") + (
            f", {f['recovery_s_ranks']:.1f}s (ranks)" if f.get("recovery_s_ranks") is not None
            else "")
        if c:
            causes = ", ".join(f"{k} {v:.1f}" for k, v in (c.get("by_cause") or {}).items() if v)
            cost_s = (f"{c['replica_seconds']:.1f} replica-s, {c['job_steps']} job steps"
                      + (f" ({causes})" if causes else ""))
        else:
            cost_s = "— (no ledger incident)"

        def alone(a):
            if not a:
                return "—"
            return (f"{a['outcome']}; {a['replica_seconds']:.1f} replica-s, "
                    f"{a['job_steps']} job steps to the end of this run, then "
                    f"{a['per_hour_after_replica_s'] / 3600:.2f} replica-s per second")
        lines.append(f"| {i} | `{f['spec']}` | {rec_s} | {cost_s} | {alone(f.get('torchft_alone'))} "
                     f"| {alone(f.get('torchft_alone_at_defaults'))} |")
    return "\n".join(lines)


def _healthy_line(rate: float | None) -> str:
    if rate is None:  # e.g. a --steps run whose groups ended within 1 s of all stepping
        return "Healthy step rate: not measured (every group was seen stepping for under 1 s)."
    return f"Healthy step rate: {rate} committed steps/s."


def markdown(rep: dict) -> str:
    c = rep["config"]
    head = ["# Lightkeeper demo report", "",
            f"{c['groups']} replica groups x {c['ranks_per_group']} rank(s)"
            + (", dry run (no evictions)" if c["dry_run"] else "")
            + (", no faults" if c["no_faults"] else "")
            + f"; {rep['duration_s']:.0f} s; outcome: {rep['outcome']}"
            + (f" ({rep['error']})" if rep["error"] else "") + ".",
            _healthy_line(rep["healthy_step_rate"])
            + " Times are seconds since the demo started.", "",
            "## Faults and phases", "", summary_markdown(rep), "",
            "## Detections", "",
            "| at | kind | group | ranks | culprit | evicted | explained by |",
            "|---|---|---|---|---|---|---|"]
    for d in rep["detections"]:
        head.append(f"| {d['at_s']:.1f}s | {d['kind']} | {d['replica_group']} | {d['ranks']} "
                    f"| {_culprit(d) if d.get('culprit_ranks') is not None else '—'} "
                    f"| {'yes' if d['evicted'] else 'no'} "
                    f"| {'fault ' + str(d['fault']) if d.get('fault') else 'no fault'} |")
    kills = [e for e in rep["evictions"] if e["decision"] == "evict"]
    if kills:
        head += ["", "## Evictions and their evidence", "",
                 "Before each kill the monitor kept the group's and its peers' stacks and "
                 "Flight Recorder dumps in an incident bundle; `lightkeeper analyze "
                 "<bundle>` reads one (docs/monitor.md, Incident bundles).", "",
                 "| at | group | reason | status | incident bundle |", "|---|---|---|---|---|"]
        for e in kills:
            head.append(f"| {e['at_s']:.1f}s | {e['replica_group']} | {e['reason']} "
                        f"| {e.get('status') or ''} | {bundle_link(e)} |")
    hs = rep.get("hosts")
    if hs:
        head += ["", "## Hosts", "",
                 "Each group on a host of its own (node name as NODE_NAME, a loopback address "
                 "for its ranks' servers), plus spares; the monitor's quarantine list at the "
                 f"end: {', '.join(hs.get('quarantined') or []) or 'none'}.", "",
                 "| host | address | group at the end | monitor's state |", "|---|---|---|---|"]
        on = {node: g for g, node in (hs.get("groups") or {}).items()}
        for h in hs["hosts"]:
            head.append(f"| {h['node']} | {h['addr']} | {on.get(h['node'], 'none')} "
                        f"| {(hs.get('states') or {}).get(h['node'], 'ok')} |")
    head += ["", "![timeline](timeline.png)", "", "## Events", ""]
    for e in rep["events"]:
        g = f"group {e['replica_group']}: " if e["replica_group"] is not None else ""
        head.append(f"- `{e['t']:7.1f}s` **{e['kind']}** {g}{e['detail']}")
    return "\n".join(head) + "\n"


def plot(samples: list[dict], ranks_per_group: int, rep: dict, path: Path) -> None:
    """Step rate per group (one rank per group, 3 s window); a heal (a jump of the step) or a
    restart starts a new window so neither shows as a spike."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5), dpi=110)
    by_group: dict[int, list[tuple[float, int]]] = {}
    for s in samples:
        if s["rank"] % ranks_per_group == 0:  # one rank per group is enough
            by_group.setdefault(s["replica_group"], []).append((s["t"], s["step"]))
    for g, pts in sorted(by_group.items()):
        xs, ys = [], []
        j = 0
        for i, (t, step) in enumerate(pts):
            if i and step - pts[i - 1][1] > 10:  # healed from a peer: new window
                j = i
            while pts[j][0] < t - 3.0:
                j += 1
            t0, s0 = pts[j]
            if t - t0 >= 1.0 and step >= s0:
                xs.append(t)
                ys.append((step - s0) / (t - t0))
            # a gap (restart) breaks the line
            if i + 1 < len(pts) and pts[i + 1][0] - t > 2.0:
                xs.append(t + 0.01)
                ys.append(float("nan"))
                j = i + 1
        ax.plot(xs, ys, label=f"group {g}", lw=1.4)
    colors = {"struck": "tab:red", "detected": "tab:orange", "evicted": "tab:purple",
              "Lighthouse dropped it": "tab:brown", "host quarantined": "tab:pink",
              "restarted": "tab:cyan", "back at pace": "black", "rejoined": "tab:green"}
    seen = set()
    for f in rep["faults"]:
        st = f.get("stages") or {}
        marks = [(f["struck_at_s"], "struck"), (f["detected_at_s"], "detected"),
                 (f["evicted_at_s"], "evicted"),
                 (st.get("lighthouse_dropped"), "Lighthouse dropped it"),
                 (f.get("host_quarantined_at_s"), "host quarantined"),
                 (f["restarted_at_s"], "restarted"),
                 (_back_at(f), "back at pace"), (f["rejoined_at_s"], "rejoined")]
        for at, name in marks:
            if at is not None:
                ax.axvline(at, color=colors[name], ls=":" if name == "back at pace" else "--",
                           lw=1.2 if name == "back at pace" else 1,
                           label=name if name not in seen else None)
                seen.add(name)
        if f["struck_at_s"] is not None:
            label = f"g{f['replica_group']}" + ("" if f.get("group_rank") is None
                                                else f".{f['group_rank']}")
            if f.get("host"):
                label += f"@{f['host']}"
            if f.get("restarted_on") and f["restarted_on"] != f.get("host"):
                label += f" -> {f['restarted_on']}"
            ax.annotate(f"{label} {fault_kind(f)}",
                        (f["struck_at_s"], 1.0), xycoords=("data", "axes fraction"),
                        xytext=(3, -12), textcoords="offset points", fontsize=8,
                        color="tab:red")
    ax.set_xlabel("seconds since the demo started")
    ax.set_ylabel("committed steps/s (3 s window)")
    ax.set_title("lightkeeper demo: step rate per replica group")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # none when stopped before the first step
        ax.legend(loc="lower right", fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(demo, report_dir: Path, final: bool = True) -> str:
    """Write report.json, report.md, timeline.png and timeline.json; return the summary table."""
    report_dir = Path(report_dir)
    rep = build_report(demo)
    (report_dir / "report.json").write_text(json.dumps(rep, indent=1))
    (report_dir / "timeline.json").write_text(json.dumps(
        {"samples": demo.samples, "ticks": demo.ticks, "lighthouse": demo.lighthouse_log,
         "goodput": demo.goodput, "t0_unix": demo.t0_unix}))
    (report_dir / "report.md").write_text(markdown(rep))
    try:
        plot(demo.samples, demo.args.ranks_per_group, rep, report_dir / "timeline.png")
    except Exception as e:  # a report without its picture beats no report
        (report_dir / "timeline.error.txt").write_text(repr(e))
    return summary_markdown(rep)
