"""Each fault's recovery, stage by stage, its cost, and what torchft alone would have cost.

Plain functions over what the demo recorded (its rank samples, the Lighthouse's ``/status`` as
it changed, the monitor's ``/v1/goodput``), used by :mod:`lightkeeper.report` and re-runnable on
a saved run (``report.json`` + ``timeline.json``). Times are demo seconds (0 = the demo's start).

**Recovery** is fault onset -> the job back at >= 90% of its healthy pace (committed job steps
per second over a trailing window), never the first commit after an eviction. A job on fewer
replica groups can be back at pace: its pace is in job steps per second.

Stages (``stages`` of a fault in ``report.json``; null when it did not happen or could not be
seen):

| stage | evidence |
| --- | --- |
| ``onset`` | the rank's own ``faults_struck_at`` (``steps_to_detect``: the faulty group's own commits from the onset to the detection) |
| ``detected`` | the monitor's finding, ``confirmed_at`` |
| ``kill_sent`` | the monitor's ``evict`` decision (it sends the Lighthouse kill in the same sweep) |
| ``lighthouse_dropped`` | the first Lighthouse ``/status`` read after the kill in which the killed replica no longer heartbeats (stale or gone), or the Lighthouse issued a quorum without it |
| ``survivors_quorum`` | the first quorum the Lighthouse issued without the killed replica (its ``/status``; else a survivor rank's ``quorum_id`` moved) |
| ``survivors_committing`` | the survivors' first commit after the kill (their ``last_step_at``) |
| ``back_at_pace`` | the first commit after the kill from which the job commits at >= 90% of its healthy rate up to its first commit ``PACE_WINDOW_S`` or more later (the ranks' commit times), that later commit by the next fault's onset (:func:`next_fault`; else the end): the job's pace past it may be that fault's; ``back_at_pace_ledger`` is the monitor's ledger's ``back_to_pace_at`` for the same incident |
| ``restarted`` | the supervisor started the group again (warm spare or cold) |
| ``joined`` | a rank of the new incarnation first takes part in a quorum |
| ``healed`` | every rank of it back in the job's quorum, within 3 steps of the job (``rejoined_at_s``) |

``join_dip`` says whether the restarted group's arrival stalled the others again: the job's
longest time without a commit from 1 s before the join to 5 s after it (``stall_s``) and its
lowest pace over ``DIP_WINDOW_S`` windows there (``min_vs_healthy``).
"""

from __future__ import annotations

import bisect
from collections.abc import Collection
from typing import Any

PACE_WINDOW_S = 3.0   # the ledger's W floor; W = max(3 s, 20 steps) is longer past 0.15 s steps
PACE_RATIO = 0.9
DIP_WINDOW_S = 2.0
DIP_AFTER_S = 5.0


# --- the job's commits ------------------------------------------------------------------------
def commit_series(samples: list[dict]) -> list[tuple[float, int]]:
    """(time, job step) at every commit the samples saw: each rank sample gives the time its
    newest step committed (``last_step_at_s``); the job's step is the furthest group's."""
    pts = sorted((s["last_step_at_s"], s["step"]) for s in samples
                 if s.get("last_step_at_s") is not None and s.get("step") is not None)
    out: list[tuple[float, int]] = []
    best = -1
    for t, step in pts:
        if step > best:
            best = step
            out.append((t, step))
    return out


def step_at(series: list[tuple[float, int]], t: float) -> int | None:
    """The job's committed step at time ``t`` (None before the first commit)."""
    i = bisect.bisect_right(series, (t, float("inf"))) - 1
    return series[i][1] if i >= 0 else None


def back_at_pace(series: list[tuple[float, int]], after: float, rate: float | None,
                 last_t: float, window: float = PACE_WINDOW_S,
                 ratio: float = PACE_RATIO) -> float | None:
    """The first commit time ``T >= after`` from which the job commits at least ``ratio`` x
    ``rate`` steps a second up to its first commit seen ``window`` or more later (at most
    ``last_t``, the last time observed); None when it never does (or there is no healthy rate).
    The pace is taken between two commits seen, not over a fixed window: the ranks are looked
    at every 0.5 s, a step or two at a time, and a window's count would follow where those
    looks fall."""
    if not rate:
        return None
    times = [t for t, _ in series]
    for i, (t, step) in enumerate(series):
        if t < after:
            continue
        j = bisect.bisect_left(times, t + window, i + 1)
        if j == len(series) or series[j][0] > last_t:
            return None
        t2, step2 = series[j]
        if step2 - step >= ratio * rate * (t2 - t) - 1e-9:
            return round(t, 2)
    return None


def job_stall(series: list[tuple[float, int]], start: float, end: float) -> float:
    """The longest time in ``[start, end]`` without a job commit."""
    times = [start] + [t for t, _ in series if start < t < end] + [end]
    return round(max(b - a for a, b in zip(times, times[1:], strict=False)), 2) \
        if end > start else 0.0


def min_pace(series: list[tuple[float, int]], start: float, end: float, rate: float | None,
             window: float = DIP_WINDOW_S, step: float = 0.25) -> float | None:
    """The job's lowest pace (vs ``rate``) over trailing ``window`` s windows ending in
    ``[start + window, end]`` (None without a rate or a whole window)."""
    if not rate or end - start < window:
        return None
    low = None
    t = start + window
    while t <= end + 1e-9:
        a, b = step_at(series, t - window), step_at(series, t)
        if a is not None and b is not None:
            v = (b - a) / window / rate
            low = v if low is None else min(low, v)
        t += step
    return None if low is None else round(low, 2)


# --- stages -----------------------------------------------------------------------------------
def evicted_replica(fault: dict, evictions: list[dict]) -> str | None:
    """The replica id the monitor evicted for ``fault`` (its first evict decision for the
    group at or after the detection)."""
    if fault.get("evicted_at_s") is None:
        return None
    evs = sorted((e for e in evictions if e.get("decision") == "evict"
                  and e.get("replica_group") == fault["replica_group"]
                  and e.get("at_s") is not None and e["at_s"] >= fault["evicted_at_s"] - 0.5),
                 key=lambda e: e["at_s"])
    return evs[0].get("replica_id") if evs else None


def stages(fault: dict, samples: list[dict], lighthouse: list[dict], evictions: list[dict],
           rate: float | None, end: float, until: float | None = None) -> dict[str, Any]:
    """The recovery of one fault, stage by stage (module docstring); times in demo seconds.
    ``until``: where the search for back at pace stops (:func:`pace_until`)."""
    g = fault["replica_group"]
    kill = fault.get("evicted_at_s")
    rid = evicted_replica(fault, evictions)
    series = commit_series(samples)
    out: dict[str, Any] = {
        "onset": fault.get("struck_at_s"), "detected": fault.get("detected_at_s"),
        "kill_sent": kill, "lighthouse_dropped": None, "survivors_quorum": None,
        "survivors_committing": fault.get("survivors_committing_at_s"), "back_at_pace": None,
        "back_at_pace_ledger": None, "restarted": fault.get("restarted_at_s"), "joined": None,
        "healed": fault.get("rejoined_at_s"), "evicted_replica_id": rid, "join_dip": None,
        "steps_to_detect": None}
    onset, det = fault.get("struck_at_s"), fault.get("detected_at_s")
    if onset is not None and det is not None:  # its own group's steps from onset to detection
        own = commit_series([s for s in samples if s["replica_group"] == g and s["t"] <= det + 1
                             and (rid is None or s.get("replica_id") == rid)])
        a, b = step_at(own, onset), step_at(own, det)
        out["steps_to_detect"] = None if a is None or b is None else b - a
    if kill is None:
        return out
    # the Lighthouse's own view
    before = [e for e in lighthouse if e["t"] <= kill]
    q0 = before[-1]["quorum_id"] if before else None
    for e in lighthouse:
        if e["t"] < kill:
            continue
        if rid is not None and out["lighthouse_dropped"] is None and (
                rid not in e["heartbeating"]
                or (e["quorum_id"] != q0 and rid not in e["members"])):
            out["lighthouse_dropped"] = e["t"]
        if out["survivors_quorum"] is None and e["quorum_id"] is not None and q0 is not None \
                and e["quorum_id"] > q0 and (rid is None or rid not in e["members"]):
            out["survivors_quorum"] = e["t"]
    if out["survivors_quorum"] is None:  # the ranks' view
        qs = [s["quorum_id"] for s in samples if s["replica_group"] != g and s["t"] <= kill
              and s.get("quorum_id") is not None]
        if qs:
            q = max(qs)
            later = [s["t"] for s in samples if s["replica_group"] != g and s["t"] > kill
                     and (s.get("quorum_id") or -1) > q]
            out["survivors_quorum"] = min(later) if later else None
    not_before = out["survivors_committing"] if out["survivors_committing"] is not None else kill
    out["back_at_pace"] = back_at_pace(series, not_before, rate,
                                       end if until is None else min(end, until))
    # the restarted group
    joined = [s["t"] for s in samples if s["replica_group"] == g and s["t"] > kill
              and s.get("participating") and s.get("replica_id") not in (None, rid)]
    out["joined"] = min(joined) if joined else None
    if out["joined"] is not None:
        a, b = out["joined"] - 1.0, min(end, out["joined"] + DIP_AFTER_S)
        low = min_pace(series, a, b, rate)
        out["join_dip"] = {"from": round(a, 2), "to": round(b, 2),
                           "stall_s": job_stall(series, a, b), "min_vs_healthy": low,
                           "stalled": low is not None and low < PACE_RATIO}
    return out


# --- the monitor's ledger ---------------------------------------------------------------------
# incidents asked of GET /v1/goodput each poll (its default): far more than one poll ever opens
GOODPUT_INCIDENTS = 50


def merge_goodput(old: dict | None, new: dict | None) -> dict | None:
    """The newest ``/v1/goodput`` document (``old`` when the poll got none), its ``incidents``
    completed with those an earlier poll saw that it no longer lists: the API lists the newest
    ``GOODPUT_INCIDENTS`` only, and a long run's (a soak's) later incidents push an early fault's
    out, its cost and recovery then lost to the report and its wait for the ledger never over.
    Each incident in its newest version seen, newest first."""
    if not isinstance(new, dict):
        return old
    if not isinstance(old, dict):
        return new
    listed = [i for i in new.get("incidents") or [] if isinstance(i, dict)]
    ids = {i.get("id") for i in listed}
    kept = [i for i in old.get("incidents") or [] if isinstance(i, dict)
            and i.get("id") not in ids]
    if not kept:
        return new
    merged = sorted(listed + kept, key=lambda i: i["id"] if isinstance(i.get("id"), int)
                    else -1, reverse=True)
    return {**new, "incidents": merged}


def fault_start(f: dict) -> float | None:
    """When fault ``f`` began to act: its strike, else its arming if the monitor caught it all
    the same (a crash gone before a look at it); None: it never acted."""
    if f.get("struck_at_s") is not None:
        return f["struck_at_s"]
    return f.get("injected_at_s") if f.get("detected_at_s") is not None else None


def acted_at(f: dict) -> float | None:
    """When fault ``f`` acted on the job: its strike; else (its rank never reported it, a crash
    gone first) for a fault injected live its injection (the POST is within a step of the
    strike), for one given at start its detection (armed at its group's launch, long before it
    acted); None: it never acted (nor was caught)."""
    if f.get("struck_at_s") is not None:
        return f["struck_at_s"]
    if f.get("detected_at_s") is None:
        return None
    live = f.get("given") != "start" and f.get("injected_at_s") is not None
    return f["injected_at_s"] if live else f["detected_at_s"]


def last_acted(faults: list[dict], held: list[int]) -> int | None:
    """Of the faults whose windows (:func:`fault_windows`) hold a job-wide incident or finding
    (indices ``held``), the one that acted last (:func:`acted_at`): the wide window (from the
    arming) says which may own it, the onset which did."""
    return max(held, key=lambda k: (acted_at(faults[k]), k)) if held else None


def next_fault(faults: list[dict], k: int) -> int | None:
    """The index of the fault that acted next after fault ``k`` (:func:`acted_at`; of any
    group: the job's pace is the whole job's), None: none did (or ``k`` never acted)."""
    starts = [acted_at(f) for f in faults]
    later = [(s, j) for j, s in enumerate(starts)
             if starts[k] is not None and s is not None and s > starts[k]]
    return min(later)[1] if later else None


def pace_until(faults: list[dict], k: int, end: float) -> float:
    """Where the search for fault ``k``'s back at pace stops: the next fault's onset
    (:func:`next_fault`), else ``end``: the job's pace past it may be that fault's."""
    nxt = next_fault(faults, k)
    return end if nxt is None else min(end, acted_at(faults[nxt]))


def fault_windows(faults: list[dict], end: float) -> list[tuple[float, float] | None]:
    """Each fault's time in the job (demo seconds; None: it never acted): from its start to its
    group's rejoin, or without one the run's end (a restart that never trained is still the
    fault's: a crash's dead finding, the survivors' stall); cut where the next fault of its
    group starts."""
    starts = [fault_start(f) for f in faults]
    out: list[tuple[float, float] | None] = []
    for f, start in zip(faults, starts, strict=True):
        if start is None:
            out.append(None)
            continue
        g = f["replica_group"]
        stop = f.get("rejoined_at_s")
        nxt = [s for o, s in zip(faults, starts, strict=True)
               if o["replica_group"] == g and s is not None and s > start]
        out.append((start, min([end if stop is None else stop, *nxt])))
    return out


def detected_incident(fault: dict, goodput: dict | None, t0_unix: float) -> dict | None:
    """The fault's group's incident the monitor detected within 1.5 s of the fault's
    detection."""
    if not goodput or fault.get("detected_at_s") is None:
        return None
    det = t0_unix + fault["detected_at_s"]
    close = [i for i in goodput.get("incidents") or [] if i.get("replica_group")
             == fault["replica_group"] and i.get("kind") != "manual"
             and i.get("detected_at") is not None and abs(i["detected_at"] - det) <= 1.5]
    return min(close, key=lambda i: abs(i["detected_at"] - det)) if close else None


def ledger_incident(fault: dict, goodput: dict | None, t0_unix: float,
                    until: float | None = None, taken: Collection = ()) -> dict | None:
    """The monitor's incident for ``fault``: :func:`detected_incident`, else the first of its
    group whose onset lies between the strike and ``until`` (the end of the fault's window,
    :func:`fault_windows`; not given: its rejoin) and that is not in ``taken`` (the ids other
    faults' detections matched): a crash the story saw no detection of still has its ``dead``
    incident."""
    start = fault.get("struck_at_s")
    if start is None:
        start = fault.get("detected_at_s")
    if not goodput or start is None:
        return None
    close = detected_incident(fault, goodput, t0_unix)
    if close is not None:
        return close
    lo = t0_unix + start - 2.0
    hi = t0_unix + (until if until is not None else fault.get("rejoined_at_s") or 1e18)
    inside = [i for i in goodput.get("incidents") or [] if i.get("replica_group")
              == fault["replica_group"] and i.get("kind") != "manual"
              and i.get("onset_at") is not None and lo <= i["onset_at"] <= hi
              and i.get("id") not in taken]
    return min(inside, key=lambda i: i["onset_at"]) if inside else None


def job_wide_owners(faults: list[dict], goodput: dict | None, t0_unix: float,
                    end: float) -> dict[int, list[dict]]:
    """Fault index -> the job-wide incidents (no replica group: the survivors' stall while the
    fault's group goes) whose onset lies in its window (:func:`fault_windows`); one that two
    faults' windows hold is the fault's that acted last (:func:`last_acted`)."""
    out: dict[int, list[dict]] = {}
    windows = fault_windows(faults, end)
    for inc in (goodput or {}).get("incidents") or []:
        onset = inc.get("onset_at")
        if inc.get("replica_group") is not None or inc.get("kind") == "manual" or onset is None:
            continue
        held = [k for k, w in enumerate(windows)
                if w is not None and t0_unix + w[0] - 2.0 <= onset <= t0_unix + w[1]]
        if held:
            out.setdefault(last_acted(faults, held), []).append(inc)
    return out


def measured_cost(inc: dict | None, t0_unix: float, groups: int,
                  job_wide: list[dict] = (), ledger_at: float | None = None) -> dict | None:
    """A fault's cost as the monitor's ledger measured it: its incident's, and the job-wide
    incidents it caused (:func:`job_wide_owners`). ``not_back_by_s``: where the ledger never
    saw the job back at pace (nor settled) for it, the time its cost runs to, every slow second
    until then in it whatever slowed the job: a ``superseded`` one's end, else ``ledger_at``
    (the ledger's last read)."""
    if inc is None:
        return None
    cost = dict(inc.get("cost") or {})
    for extra in job_wide:
        more = extra.get("cost") or {}
        for key in ("replica_seconds", "group_steps"):
            if more.get(key) is not None:
                cost[key] = round((cost.get(key) or 0.0) + more[key], 3)
        by = dict(cost.get("by_cause") or {})
        for cause, v in (more.get("by_cause") or {}).items():
            by[cause] = round(by.get(cause, 0.0) + v, 3)
        cost["by_cause"] = by

    def rel(v):
        return None if v is None else round(v - t0_unix, 2)

    rs = cost.get("replica_seconds")
    gs = cost.get("group_steps")
    return {"source": "measured: the monitor's ledger (GET /v1/goodput)",
            "incident": inc.get("id"), "open": inc.get("open"),
            "job_wide_incidents": [i.get("id") for i in job_wide],
            "replica_seconds": rs, "group_steps": gs,
            "job_steps": None if gs is None else round(gs / groups, 1),
            "by_cause": cost.get("by_cause"),
            "onset_s": rel(inc.get("onset_at")), "detected_s": rel(inc.get("detected_at")),
            "evicted_s": rel(inc.get("evicted_at")),
            "back_to_pace_s": rel(inc.get("back_to_pace_at")),
            # "superseded": another fault was confirmed first, back_to_pace_s is its detection,
            # so recovery_s is no onset -> back at pace
            "back_to_pace": inc.get("back_to_pace"), "superseded_by": inc.get("superseded_by"),
            "recovery_s": inc.get("recovery_s"), "detect_s": inc.get("detect_s"),
            "not_back_by_s": None if inc.get("back_to_pace") in ("reached", "settled")
            else rel(inc.get("back_to_pace_at")) if inc.get("back_to_pace") == "superseded"
            else rel(ledger_at)}


# --- torchft alone ----------------------------------------------------------------------------
TORCHFT_DEFAULTS = {"pg_timeout_s": 60.0, "quorum_timeout_s": 60.0, "join_timeout_ms": 60000,
                    "heartbeat_timeout_ms": 5000}


def torchft_alone(fault: dict, *, groups: int, horizon_s: float | None,
                  healthy_rate: float | None, slow_rate: float | None,
                  settings: dict[str, float], blocked: bool = True) -> dict | None:
    """What the same fault would have cost with torchft alone (nobody evicts), COMPUTED from
    the job's timeouts (``settings``: ``pg_timeout_s``, ``quorum_timeout_s``,
    ``join_timeout_ms``) over ``horizon_s`` (the fault's onset to the end of the run).

    - hang: every group waits for the process-group timeout; then the survivors' next quorum
      waits for the hung group, which still heartbeats but never asks to join, until the
      Lighthouse's join timeout, and if that is not shorter than the Manager's quorum timeout,
      the quorum times out and the job dies (torchft's defaults: +120 s). Otherwise the job goes
      on at full pace on the other groups and the hung group's capacity is lost to the end.
    - straggler (``slow``, ``slow_compute``) and slow link (``slow_link``): never removed: the
      job keeps the pace it had with it (``slow_rate``, measured in the fault's phase) to the
      end of the run.
    - partition (the host reaches the Lighthouse, not its peers): its group still heartbeats, so
      every quorum has it again; every group blocks in the same all_reduce until the
      process-group timeout, and again: the job never commits another step.
    - host_offline: the survivors block until the process-group timeout (the group's heartbeat
      stops, so their next quorum goes on without it), then train on the other groups; a host
      gone between two collectives (``blocked`` false: no survivor was seen held, so none was
      told to abort) leaves them waiting only for the Lighthouse to stop hearing it.

    ``job_steps`` is the measured cost's quantity (:func:`measured_cost`): replica-seconds lost
    x ``healthy_rate`` / ``groups``, so a group's capacity lost after a stall counts, as the
    ledger's ``capacity_lost`` does.

    Returns None for other kinds (torchft handles a crash itself), without a horizon, or for a
    straggler whose phase was not slower than the healthy one (the machine's pace changed)."""
    kind = (fault.get("spec") or "").split(":", 1)[0]
    if horizon_s is None or horizon_s <= 0:
        return None
    e = groups
    pg = float(settings["pg_timeout_s"])
    qt = float(settings["quorum_timeout_s"])
    join = float(settings["join_timeout_ms"]) / 1000.0
    basis = (f"process-group timeout {pg:g} s, quorum timeout {qt:g} s, Lighthouse join "
             f"timeout {join:g} s")

    def steps(lost: float) -> int | None:
        return None if not healthy_rate else round(lost / e * healthy_rate)

    if kind == "hang":
        if join >= qt:
            dies = pg + qt
            lost = e * horizon_s
            return {"source": "computed from the job's timeouts", "basis": basis,
                    "outcome": f"the job dies at +{dies:g} s (the survivors' quorum times out "
                               "waiting for the hung group)",
                    "stall_s": round(min(dies, horizon_s), 1), "recovery_s": None,
                    "replica_seconds": round(lost, 1),
                    "job_steps": steps(lost), "per_hour_after_replica_s": e * 3600.0}
        stall = pg + join
        cut = min(stall, horizon_s)
        lost = e * cut + max(0.0, horizon_s - stall)
        return {"source": "computed from the job's timeouts", "basis": basis,
                "outcome": f"the job stalls {stall:g} s, then trains on {e - 1} of {e} groups "
                           "to the end (the hung group never returns)",
                "stall_s": round(stall, 1), "recovery_s": round(stall, 1),
                "replica_seconds": round(lost, 1),
                "job_steps": steps(lost), "per_hour_after_replica_s": 3600.0}
    if kind == "partition":
        return {"source": "computed from the job's timeouts", "basis": basis,
                "outcome": f"the job stops for good: every {pg:g} s the process group times "
                           "out and the quorum re-forms with the same groups",
                "stall_s": round(horizon_s, 1), "recovery_s": None,
                "replica_seconds": round(e * horizon_s, 1), "job_steps": steps(e * horizon_s),
                "per_hour_after_replica_s": e * 3600.0}
    if kind == "host_offline":
        hb = float(settings.get("heartbeat_timeout_ms", 5000)) / 1000.0
        wait = pg if blocked else hb
        lost = e * min(wait, horizon_s) + max(0.0, horizon_s - wait)
        why = "the process-group timeout" if blocked else \
            "the Lighthouse's heartbeat timeout: it went between two collectives"
        return {"source": "computed from the job's timeouts", "basis": basis,
                "outcome": f"the job stalls {wait:g} s ({why}), then trains on {e - 1} of {e} "
                           "groups",
                "stall_s": round(wait, 1), "recovery_s": round(wait, 1),
                "replica_seconds": round(lost, 1), "job_steps": steps(lost),
                "per_hour_after_replica_s": 3600.0}
    if kind in ("slow", "slow_compute", "slow_link"):
        if not healthy_rate or slow_rate is None or slow_rate >= 0.95 * healthy_rate:
            return None  # no slower than the healthy phase: the box's own pace changed
        frac = 1.0 - slow_rate / healthy_rate
        lost = e * horizon_s * frac
        what = "slow link" if kind == "slow_link" else "straggler"
        return {"source": f"computed from the {what}'s measured pace", "basis":
                f"the job at {slow_rate:.2f} steps/s with the {what} vs {healthy_rate:.2f} "
                "healthy; torchft never removes a slow group",
                "outcome": "drags the job to the end of the run", "stall_s": 0.0,
                "recovery_s": None, "replica_seconds": round(lost, 1), "job_steps": steps(lost),
                "per_hour_after_replica_s": round(e * 3600.0 * frac, 1)}
    return None
