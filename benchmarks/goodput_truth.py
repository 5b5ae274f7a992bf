"""The ground truth of benchmarks/bench_goodput.py, from the ranks alone, and the goodput
ledger reconciled with it. Pure functions (unit-tested in tests/test_bench_goodput.py).

The truth takes nothing from the ledger: committed steps from every rank's own
``step=N ... committed=True`` log line, each fault's onset from the rank's own record of its
strike, the healthy baseline from the commits before the first injection, the eviction times
from the monitor's decisions (what it did, not what its ledger made of it). It applies the
ledger's definitions (docs/goodput.md) to them: pace is the job's commits over a trailing
window ``W`` against the healthy baseline, >= 0.9 is at pace.
"""

from __future__ import annotations

import bisect
import math
import re
import time

PACE_THRESHOLD = 0.9  # "at healthy pace", as the ledger (monitor/goodput/)
PACE_WINDOW_S, PACE_WINDOW_STEPS = 3.0, 20  # the ledger's pace window W = max(3 s, 20 x b)
BIN_S = 0.5  # ground-truth accounting resolution (the monitor's sweep interval here)
# The ledger's names for an injected fault: its incident's kind, and its own badput cause
# until it is acted on (docs/goodput.md)
INCIDENT_KINDS = {"slow_compute": ("straggler",), "hang": ("hang",)}
FAULT_CAUSE = {"slow_compute": "straggler_drag", "hang": "stall"}
ACTED_CAUSES = ("recovery", "capacity_lost")  # after an eviction (or the group's exit)
# Reconciliation tolerances, the ledger against the ranks' own record: against one fault's
# cost here (a hang ~10 replica-s and ~3 s onset -> back at pace, a straggler ~15 and ~7 s)
TOL_GOODPUT_RS = 3.0  # goodput over the ledger's window, replica-seconds
TOL_ONSET_S = 0.5  # an incident's onset vs the rank's strike (one sweep)
TOL_RECOVERY_S = 1.0  # onset -> back at pace (two sweeps)
TOL_COST_RS = 2.0  # an incident's cost, replica-seconds
TOL_CAUSE_RS = 2.0  # its part before the fault was acted on, and after (a sweep, 0.5-0.7 s
# with the kill's bundle, on 3 groups: the ledger books a sweep whole by its end)

# The trainer logs one line per finished step (trainer/loop.py, asctime on the local clock).
COMMIT_RE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \S+ INFO step=(\d+) .*committed=True", re.M)


def parse_commit_log(text: str) -> list[tuple[float, int]]:
    """``(unix time, step)`` of every committed step in one incarnation's log, sorted by time.

    Several ranks of a group write the same log and each logs every step: a step counts once, at
    the first rank's time. Lines another process's output ran into are skipped (no match)."""
    first: dict[int, float] = {}
    for m in COMMIT_RE.finditer(text):
        t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3
        step = int(m.group(3))
        if step not in first or t < first[step]:
            first[step] = t
    return sorted((t, s) for s, t in first.items())


def healthy_step_s(commits: dict[int, list[float]], t0: float, t1: float) -> float | None:
    """The healthy baseline by the ledger's definition (docs/goodput.md, healthy baseline): a
    window's mean step, the time elapsed over the steps committed, each group's first to last
    commit in ``[t0, t1]``, summed over the groups (None with fewer than 5 steps). Not the
    median gap between commits: steps are uneven (one waits on a peer, the next is short), so
    the median differs from the mean the ledger samples by that skew alone."""
    elapsed, steps = 0.0, 0
    for times in commits.values():
        inside = sorted(t for t in times if t0 <= t <= t1)
        if len(inside) >= 2:
            elapsed, steps = elapsed + inside[-1] - inside[0], steps + len(inside) - 1
    return elapsed / steps if steps >= 5 else None


def pace_window(b: float) -> float:
    return max(PACE_WINDOW_S, PACE_WINDOW_STEPS * b)


def commits_in(times: list[float], a: float, c: float) -> int:
    """Commits in ``(a, c]``."""
    return bisect.bisect_right(times, c) - bisect.bisect_right(times, a)


def goodput_from_commits(commits: dict[int, list[float]], t0: float, t1: float, b: float,
                         expected_groups: int, bin_s: float = BIN_S,
                         threshold: float = PACE_THRESHOLD,
                         cuts: list[tuple[float, float]] = ()) -> dict:
    """Goodput of ``expected_groups`` slots over ``[t0, t1]`` from the groups' commit times, by
    the ledger's definitions (monitor/goodput/) with the healthy baseline ``b`` throughout: per
    slot and bin, a group whose commits in the trailing window ``W`` (not before ``t0``) x
    ``b`` / its length reach ``threshold`` counts the whole bin, else its commits in the bin x
    ``b``, at most the bin, what they hold beyond it carried to the next bin (at most ``b``;
    reset at pace). A group without commits is all badput; a slot of a group never seen too.

    ``cuts``: ``(onset, until)`` of each fault: for a bin ending in ``(onset, until]`` the
    trailing window starts at the onset at the earliest (commits before a fault say nothing
    about the pace after it; ``until``: the job back at pace, :func:`fault_truth`).

    Returns ``goodput_s``, ``expected_s``, ``ratio`` and ``bins``: ``[start, end, goodput]``
    summed over the slots. ValueError on an empty window or a baseline that is not > 0."""
    if not t1 > t0:
        raise ValueError(f"empty window: {t0} .. {t1}")
    if not b or b <= 0 or expected_groups < 1:
        raise ValueError(f"need a baseline > 0 and >= 1 group, got b={b!r}, "
                         f"groups={expected_groups}")
    series = [sorted(commits.get(g, [])) for g in sorted(commits)][:expected_groups]
    # the trailing window starts at t0 at the earliest (what came before is not accounted); a
    # window shorter than 2 steps says nothing about pace yet: the bin's own commits count
    edges = [t0 + i * bin_s for i in range(int(math.ceil((t1 - t0) / bin_s - 1e-9)))] + [t1]
    w = pace_window(b)
    bins, total = [], 0.0
    carry = [0.0] * len(series)
    for a, c in zip(edges, edges[1:], strict=False):
        dt, good = c - a, 0.0
        start = max([c - w, t0] + [on for on, until in cuts if on < c <= until])
        span = c - start
        for k, times in enumerate(series):
            if span >= 2 * b and commits_in(times, start, c) * b / span >= threshold:
                good, carry[k] = good + dt, 0.0
            else:
                held = commits_in(times, a, c) * b + carry[k]
                good, carry[k] = good + min(dt, held), min(b, held - min(dt, held))
        bins.append([round(a, 3), round(c, 3), round(good, 4)])
        total += good
    expected = expected_groups * (t1 - t0)
    return {"goodput_s": round(total, 3), "expected_s": round(expected, 3),
            "ratio": round(total / expected, 4), "bins": bins, "baseline_s": round(b, 4),
            "window_s": round(w, 3)}


def lost_seconds(times: list[float], a: float, z: float, b: float) -> float:
    """Seconds of one group's slot lost over ``[a, z]``: the time its commits (sorted) do not
    cover at healthy pace, each commit covering the ``b`` seconds before it. Expected commits
    at healthy pace minus actual, in seconds; overlaps count once, so a group faster than
    ``b`` loses nothing, and a commit's step is not lost to where ``a`` and ``z`` fall."""
    covered, reach = 0.0, a
    for c in times[bisect.bisect_right(times, a):]:
        if c - b >= z:
            break
        lo, hi = max(c - b, reach), min(c, z)
        if hi > lo:
            covered, reach = covered + hi - lo, hi
    return max(0.0, (z - a) - covered)


def badput_in_window(intervals: list[dict], t0: float, t1: float) -> dict[str, float]:
    """The ledger's badput by cause (pending included) within ``[t0, t1]``: each interval's
    replica-seconds pro rata of its overlap with the window (a diff of the ledger's totals
    would also count time from before ``t0`` that settled within the window)."""
    out: dict[str, float] = {}
    for iv in intervals:
        a, c, rs = iv.get("start"), iv.get("end"), iv.get("replica_seconds")
        if a is None or c is None or not rs or c <= t0 or a >= t1:
            continue
        frac = 1.0 if c <= a else (min(c, t1) - max(a, t0)) / (c - a)
        out[iv["cause"]] = out.get(iv["cause"], 0.0) + rs * frac
    return {k: round(v, 3) for k, v in sorted(out.items())}


def badput_by_window(bins: list[list[float]], expected_groups: int,
                     marks: list[tuple[float, str]]) -> dict[str, float]:
    """Each bin's badput (slots x bin - goodput) under the label of the latest mark at or before
    the bin's start (``before faults`` before the first). Marks: ``(time, label)``."""
    marks = sorted(marks)
    out: dict[str, float] = {}
    for a, c, good in bins:
        label = "before faults"
        for t, name in marks:
            if t <= a + 1e-9:
                label = name
        out[label] = out.get(label, 0.0) + max(0.0, expected_groups * (c - a) - good)
    return {k: round(v, 3) for k, v in out.items()}


def job_commit_times(steps: dict[int, list[tuple[float, int]]]) -> list[float]:
    """Times at which the job's newest committed step (the max over groups) moved on."""
    events = sorted((t, s) for series in steps.values() for t, s in series)
    out, top = [], None
    for t, s in events:
        if top is None or s > top:
            if top is not None:
                out.append(t)
            top = s
    return out


def back_at_pace(job_times: list[float], after: float, horizon: float, b: float,
                 threshold: float = PACE_THRESHOLD) -> float | None:
    """The job back at healthy pace after ``after`` (a fault's onset): the first ``t``
    (``after``, or a job commit after it) from which the job's commits over every trailing
    window ``W`` that starts at or after ``t`` and ends by ``t + 2W`` (and by ``horizon``: the
    next fault's onset, or the end) stay >= ``threshold`` of one step per ``b``: at pace for a
    window, and held for another. Never before the job's first commit after ``after``; None
    when no such ``t`` has ``t + W <= horizon``."""
    w = pace_window(b)
    first = next((t for t in job_times if t > after), None)
    if first is None:
        return None
    for t in [after] + [c for c in job_times if c > after]:
        if t + w > horizon:
            return None
        # a window's count only drops when a commit leaves it: the lowest are at t + W and at
        # each commit's c + W
        ends = [t + w] + [c + w for c in job_times if t < c and c + w <= min(t + 2 * w, horizon)]
        if all(commits_in(job_times, e - w, e) * b / w >= threshold for e in ends):
            return max(t, first)
    return None


def fault_truth(strikes: list[dict], commits: dict[int, list[float]], job_times: list[float],
                b: float, t_end: float, expected_groups: int, evicted: dict[int, list[float]],
                exits: dict[int, list[float]]) -> list[dict]:
    """Each fault's ground truth, in strike order, from the ranks' commits and the strike
    (``at``, the rank's own record), none of it from the ledger: ``back`` (:func:`back_at_pace`
    from the onset until the next fault's onset, else ``t_end``) and the replica-seconds lost
    (:func:`lost_seconds` with the healthy ``b``) by cause.

    A fault's window: from its onset, for every group until the job is back at pace (else the
    next fault's onset, else ``t_end``); for its own group, once it is out of the job (evicted,
    else its processes exited: ``evicted`` and ``exits``, per group, the monitor's eviction
    decisions and the supervisor's restarts), until it commits again (else ``t_end``). Where
    windows overlap, a group's time is its own fault's while it is out, else the newest
    fault's. Causes, by the ledger's names: the fault's own (``FAULT_CAUSE``) until it is acted
    on; then ``capacity_lost`` for its group while out, ``recovery`` for the others after the
    eviction."""
    faults = []
    order = sorted(strikes, key=lambda s: s["at"])
    for i, st in enumerate(order):
        g, on = st["replica_group"], st["at"]
        horizon = min([t_end] + [s["at"] for s in order[i + 1:]])
        # an eviction or exit of this group before its next fault is this fault's
        mine = min([t_end] + [s["at"] for s in order[i + 1:] if s["replica_group"] == g])
        ev = next((t for t in evicted.get(g, []) if on <= t < mine), None)
        ex = next((t for t in exits.get(g, []) if on <= t < mine), None)
        out = ev if ev is not None else ex
        back = back_at_pace(job_times, on, horizon, b)
        end = back if back is not None else horizon
        rejoin = None if ex is None else next((t for t in commits.get(g, []) if t > ex), None)
        own_end = end if out is None else max(end, t_end if rejoin is None else rejoin)
        faults.append({"kind": st["kind"], "replica_group": g, "onset": on, "horizon": horizon,
                       "baseline_s": round(b, 4),
                       "back": back, "evicted": ev, "exited": ex, "out": out,
                       "rejoined": rejoin, "end": {k: own_end if k == g else end
                                                   for k in range(expected_groups)},
                       "by_cause": {}})
    for g in range(expected_groups):
        times = sorted(commits.get(g, []))
        marks = sorted({x for f in faults for x in (f["onset"], f["end"][g], f["evicted"],
                                                    f["out"]) if x is not None and x <= t_end})
        for a, z in zip(marks, marks[1:], strict=False):
            mid = (a + z) / 2
            live = [f for f in faults if f["onset"] <= mid < f["end"][g]]
            if not live:
                continue
            out = [f for f in live if f["replica_group"] == g and f["out"] is not None
                   and mid >= f["out"]]
            f = (out or live)[-1]
            cause = ("capacity_lost" if out else "recovery"
                     if f["evicted"] is not None and mid >= f["evicted"]
                     else FAULT_CAUSE.get(f["kind"], "stall"))
            f["by_cause"][cause] = f["by_cause"].get(cause, 0.0) + lost_seconds(times, a, z, b)
    for f in faults:
        f["by_cause"] = {k: round(v, 3) for k, v in sorted(f["by_cause"].items())}
        f["cost_replica_s"] = round(sum(f["by_cause"].values()), 3)
        f["recovery_s"] = None if f["back"] is None else round(f["back"] - f["onset"], 3)
        del f["end"]
    return faults


def ledger_window(before: dict | None, after: dict | None) -> dict | None:
    """The ledger's job totals between two ``GET /v1/goodput`` answers (a window of the run)."""
    if not before or not after or not after.get("job"):
        return None
    j0, j1 = before.get("job") or {}, after["job"]
    good = j1["goodput_seconds"] - j0.get("goodput_seconds", 0.0)
    exp = j1["expected_seconds"] - j0.get("expected_seconds", 0.0)
    bad0 = j0.get("badput_seconds") or {}
    bad = {k: round(v - bad0.get(k, 0.0), 3) for k, v in j1["badput_seconds"].items()}
    return {"from": before.get("at"), "to": after.get("at"),
            "goodput_s": round(good, 3), "expected_s": round(exp, 3),
            "ratio": round(good / exp, 4) if exp > 0 else None, "badput_s": bad,
            "pending_s": j1.get("pending_seconds"),
            "baseline_s": (after.get("baseline") or {}).get("step_seconds")}


def _check(name: str, truth: float, ledger: float, tol: float, **extra) -> dict:
    d = ledger - truth
    return {"check": name, "ground_truth": round(truth, 3), "ledger": round(ledger, 3),
            "diff": round(d, 3), "tolerance": tol, "ok": abs(d) <= tol, **extra}


def _baselines(truth_b: float, ledger_b: float | None, where: str) -> str:
    return f"healthy step: {truth_b:.3f} s before the first fault" + (
        f", the ledger's {ledger_b:.3f} s {where}" if ledger_b else "")


def _acted_split(by_cause: dict[str, float]) -> tuple[float, float]:
    """A cost before its fault was acted on (its own cause; any but ``ACTED_CAUSES``) and
    after: the survivors' recovery and the evicted group's lost capacity, together (where
    the two meet, the group still in the quorum or not, is the Lighthouse's to say)."""
    after = sum(v for k, v in by_cause.items() if k in ACTED_CAUSES)
    return sum(by_cause.values()) - after, after


def reconcile(ledger: dict | None, truth_goodput: dict | None, faults: list[dict],
              incidents: list[dict], t0: float = 0.0) -> list[dict]:
    """The ledger against the ground truth, each check with its tolerance and verdict; none
    takes a figure from the ledger into the truth.

    - goodput (replica-s) over the ledger's window (its first answer with a baseline to its
      last): ``truth_goodput``, :func:`goodput_from_commits` over it with the pre-fault
      baseline and each fault's window cut from its onset until the job is back at pace;
    - per fault (:func:`fault_truth`): its incident, of its group and kind
      (``INCIDENT_KINDS``), the nearest onset: none is a failed check naming what the ledger
      has instead; its ``onset_at`` vs the rank's strike; ``back_to_pace_at`` vs the ranks'
      back at pace, both or neither (``superseded``, or none yet: the ranks not back before the
      next fault's onset or the end), else failed; its cost, and that cost before the fault
      was acted on (its own cause) and after (``ACTED_CAUSES``);
    - incidents no fault explains: an incident of no fault whose onset is in no fault's
      window (a healthy stretch charged) fails.

    Onsets are shown in seconds after ``t0``."""
    checks = []
    if ledger and truth_goodput:
        checks.append(_check("goodput over the ledger's window (replica-s)",
                             truth_goodput["goodput_s"], ledger["goodput_s"], TOL_GOODPUT_RS,
                             expected_s=ledger["expected_s"], note=_baselines(
                                 truth_goodput["baseline_s"], ledger.get("baseline_s"),
                                 "at its end")))
    else:
        checks.append({"check": "goodput over the ledger's window (replica-s)", "ok": False,
                       "note": "the ledger has no baseline or no window"})
    matched = set()
    for f in faults:
        name = f"{f['kind']} in group {f['replica_group']}"
        kinds = INCIDENT_KINDS.get(f["kind"], (f["kind"],))
        mine = [i for i in incidents if i.get("replica_group") == f["replica_group"]
                and i.get("kind") in kinds and i.get("onset_at") is not None]
        if not mine:
            near = [i for i in incidents if i.get("onset_at") is not None
                    and f["onset"] - 5 <= i["onset_at"] <= f["horizon"]]
            has = ", ".join(f"{i.get('kind')} in group {i.get('replica_group')} at "
                            f"{i['onset_at'] - f['onset']:+.1f} s" for i in near) or "none"
            checks.append({"check": f"{name}: its incident", "ok": False,
                           "note": f"no {'/'.join(kinds)} incident of group "
                                   f"{f['replica_group']}; the ledger has: {has}"})
            continue
        inc = min(mine, key=lambda i: abs(i["onset_at"] - f["onset"]))
        matched.add(inc.get("id"))
        checks.append(_check(f"{name}: onset vs the rank's strike (s)", f["onset"] - t0,
                             inc["onset_at"] - t0, TOL_ONSET_S))
        status = inc.get("back_to_pace")
        led_back = inc.get("back_to_pace_at") if status in ("reached", "settled") else None
        check = f"{name}: onset -> back at pace (s)"
        if f["back"] is not None and led_back is not None:
            checks.append(_check(check, f["back"] - f["onset"], led_back - inc["onset_at"],
                                 TOL_RECOVERY_S, note=f"the ledger: {status}"))
        elif f["back"] is None and led_back is None:
            until = "the end" if f is faults[-1] else "the next fault's onset"
            led = (f"superseded by incident {inc.get('superseded_by')}"
                   if status == "superseded" else "none yet")
            checks.append({"check": check, "ok": True,
                           "note": f"neither: the ranks not back at pace before {until}; "
                                   f"the ledger {led}"})
        elif f["back"] is not None:
            checks.append({"check": check, "ok": False, "ground_truth": round(
                f["back"] - f["onset"], 3), "note": "the ranks were back at pace, the ledger "
                f"has no back at pace ({status or 'none'})"})
        else:
            checks.append({"check": check, "ok": False, "ledger": round(
                led_back - inc["onset_at"], 3), "note": f"the ledger has it back ({status}); "
                "the ranks were not back at pace before the next fault or the end"})
        cost = inc.get("cost") or {}
        rs, steps = cost.get("replica_seconds") or 0.0, cost.get("group_steps")
        checks.append(_check(f"{name}: cost (replica-s)", f["cost_replica_s"], rs, TOL_COST_RS,
                             note=_baselines(f["baseline_s"], rs / steps if steps else None,
                                             "in its cost")))
        (truth_before, truth_after), (led_before, led_after) = (
            _acted_split(f["by_cause"]), _acted_split(cost.get("by_cause") or {}))
        checks.append(_check(f"{name}: cost before it was acted on (replica-s)", truth_before,
                             led_before, TOL_CAUSE_RS))
        checks.append(_check(f"{name}: cost after (recovery + capacity_lost) (replica-s)",
                             truth_after, led_after, TOL_CAUSE_RS))
    spans = [(f["onset"], max(f["horizon"] if f["back"] is None else f["back"],
                              f["rejoined"] or 0.0)) for f in faults]
    stray = [i for i in incidents if i.get("id") not in matched
             and i.get("onset_at") is not None
             and (not ledger or ledger["from"] <= i["onset_at"] <= ledger["to"])
             and not any(a - TOL_ONSET_S <= i["onset_at"] <= z for a, z in spans)]
    checks.append({"check": "incidents no fault explains", "ok": not stray,
                   "note": ", ".join(f"{i.get('kind')} in group {i.get('replica_group')}, "
                                     f"{(i.get('cost') or {}).get('replica_seconds')} replica-s"
                                     for i in stray) or "none"})
    return checks
