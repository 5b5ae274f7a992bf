"""The demo's report as text and picture: each fault's story, ``report.md``'s tables and
``timeline.png`` (step rate per group over time, events marked), from the report
:mod:`lightkeeper.report` builds.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from .recovery import acted_at, next_fault, pace_until

# a ledger incident begun this much after its fault's strike leaves the time between out of its cost
LATE_ONSET_S = 2.0
OTHERS_MORE = 0.25  # cores the machine's other processes took more than in the healthy phase


def fault_kind(f: dict) -> str:
    return (f["spec"] or "?").split(":", 1)[0]


def where(f: dict) -> str:
    return f"group {f['replica_group']}" + ("" if f.get("group_rank") is None
                                            else f" rank {f['group_rank']}")


def bundle_link(e: dict) -> str:
    """A markdown link to an eviction's (a detection's) bundle, or the reason there is none."""
    if e.get("bundle_file"):
        return f"[{e['bundle']}]({e['bundle_file']})"
    return f"`{e['bundle']}` (not in the report folder)" if e.get("bundle") else "none kept"


STAGE_COLUMNS = (("detected", "detected"), ("kill_sent", "kill sent"),
                 ("lighthouse_dropped", "Lighthouse dropped it"),
                 ("survivors_quorum", "survivors' quorum"),
                 ("survivors_committing", "survivors committing"),
                 ("back_at_pace", "back at pace (ranks)"),
                 ("back_at_pace_ledger", "back at pace (ledger)"), ("restarted", "restarted"),
                 ("joined", "joined"), ("healed", "healed"))


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
        elif not_back := _not_back(rep["faults"], i - 1):
            steps.append(not_back + _others_then(rep, i - 1))
        out.append(f"fault {i} ({fault_kind(f)}): " + (" -> ".join(steps) or "no step seen")
                   + f"; {f['outcome']}")
    hs = rep.get("hosts") or {}
    for g, since in (hs.get("waiting") or {}).items():
        out.append(f"group {g} waits since {since:.1f}s: its host is quarantined and no other "
                   "host is free (--spare-hosts)")
    return out


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
    none = "no healthy baseline" if rep.get("no_baseline") else "—"

    def lost(f: dict) -> str:
        return none if f["steps_lost"] is None and f["struck_at_s"] is not None \
            else _fmt(f["steps_lost"], "")

    lines = ["| # | fault | where (global rank, host) | armed | struck | caught as | culprit "
             "| detected | evicted | survivors committing | back at pace | rejoined | steps behind pace "
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
                     f"| {_back_cell(rep['faults'], i - 1)} | {_fmt(f['rejoined_at_s'])} "
                     f"| {lost(f)} | {f['outcome']} |")
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
    # the machine's other processes: where not measured (not Linux) no column
    others = any(p.get("others_cores") is not None for p in rep["phases"])
    lines += ["", "| phase | from | to | steps | steps/s | vs healthy |"
              + (" others' CPU (cores) |" if others else ""),
              "|---|---|---|---|---|---|" + ("---|" if others else "")]
    for p in rep["phases"]:
        vs = f"{p['vs_healthy']:.2f}x" if p["vs_healthy"] is not None else none
        rate = f"{p['step_rate']:.2f}" if p["step_rate"] is not None else "—"
        lines.append(f"| {p['name']} | {p['start_s']:.1f}s | {p['end_s']:.1f}s "
                     f"| {_fmt(p['steps'], '')} | {rate} | {vs} |"
                     + (f" {p['others_cores']:.2f} |" if p.get("others_cores") is not None
                        else " — |" if others else ""))
    return "\n".join(lines)


def _back_at(f: dict) -> float | None:
    """Back at >= 90% of healthy pace: the monitor's ledger, else the ranks' commits."""
    st = f.get("stages") or {}
    return st.get("back_at_pace_ledger") if st.get("back_at_pace_ledger") is not None \
        else st.get("back_at_pace")


def _started(rep: dict) -> str:
    """When, in UTC: bundles, the audit log and the API date everything so."""
    t = rep.get("started_at_unix")
    if not isinstance(t, int | float):
        return ""
    return f" ({datetime.fromtimestamp(t, UTC):%Y-%m-%dT%H:%M:%SZ})"


def _not_back(faults: list[dict], k: int) -> str | None:
    """Fault ``k`` evicted and neither measure saw the job back at pace (nor settled) before the
    next fault's onset or the end; None otherwise."""
    f = faults[k]
    if _back_at(f) is not None or (f.get("stages") or {}).get("kill_sent") is None \
            or f.get("settled_pace") is not None:
        return None
    nxt = next_fault(faults, k)
    return "not back at pace by the end" if nxt is None else \
        f"not back at pace before fault {nxt + 1} ({acted_at(faults[nxt]):.1f}s)"


def _others_then(rep: dict, k: int) -> str:
    """Fault ``k`` not back at pace: where the machine's other processes took ``OTHERS_MORE``
    cores more in the phase that judged it (the last before the next fault's onset or the end)
    than in the healthy phase, a clause that says so: the job's pace is theirs to share."""
    ph, f = rep.get("phases") or [], rep["faults"][k]
    onset, end = acted_at(f), (ph[-1]["end_s"] if ph else None)
    if onset is None or end is None or not ph or ph[0]["name"] != "healthy":
        return ""
    until = pace_until(rep["faults"], k, end)
    last = next((p for p in reversed(ph) if onset <= p["start_s"] < until), None)
    healthy, then = ph[0].get("others_cores"), last and last.get("others_cores")
    if healthy is None or then is None or round(then - healthy, 2) < OTHERS_MORE:
        return ""
    return (f"; the machine's other processes took {then:.2f} cores then "
            f"({last['start_s']:.1f}s-{last['end_s']:.1f}s), {healthy:.2f} in the healthy phase: "
            "the slowdown may be theirs")


def _back_cell(faults: list[dict], k: int) -> str:
    if not _not_back(faults, k):
        return _fmt(_back_at(faults[k]))
    nxt = next_fault(faults, k)
    return "not by the end" if nxt is None else f"not before #{nxt + 1}"


def _plus(v, onset) -> str:
    return "—" if v is None or onset is None else f"+{v - onset:.1f}"


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
    # the ledger names the incident that superseded one; the table numbers faults
    fault_of = {(f.get("cost") or {}).get("incident"): i for i, f in enumerate(rep["faults"], 1)}
    for i, f in enumerate(rep["faults"], 1):
        c = f.get("cost")
        rec = f.get("recovery_s")
        sup, level = f.get("superseded_by"), f.get("settled_pace")
        by = f"#{fault_of[sup]}" if sup in fault_of else f"incident {sup}"
        rec_s = (f"superseded by {by} at {_fmt((c or {}).get('back_to_pace_s'))} (ledger)"
                 if sup is not None
                 else f"settled at {level:.2g}x after {rec:.1f}s (ledger)"
                 if level is not None and rec is not None
                 else f"{rec:.1f}s (ledger)" if rec is not None else "—") + (
            f", {f['recovery_s_ranks']:.1f}s (ranks)" if f.get("recovery_s_ranks") is not None
            else "")
        if c:
            causes = ", ".join(f"{k} {v:.1f}" for k, v in (c.get("by_cause") or {}).items() if v)
            cost_s = (f"{c['replica_seconds']:.1f} replica-s, {c['job_steps']} job steps of capacity"
                      + (f" ({causes})" if causes else ""))
            began, onset = c.get("onset_s"), f.get("struck_at_s")
            if began is not None and onset is not None and began - onset > LATE_ONSET_S:
                cost_s += (f"; from +{began - onset:.1f}s, when the ledger's incident began "
                           "(the job first judged slow): the time before is not in it")
            if c.get("not_back_by_s") is not None:  # the ledger cannot tell whose slowness
                cost_s += (f"; not back at pace by {c['not_back_by_s']:.1f}s: includes every "
                           "slow second until then")
        else:
            cost_s = "— (no ledger incident)"

        def alone(a):
            if not a:
                return "—"
            steps = ("job steps: no healthy baseline" if a["job_steps"] is None
                     else f"{a['job_steps']} job steps of capacity")
            return (f"{a['outcome']}; {a['replica_seconds']:.1f} replica-s, "
                    f"{steps} to the end of this run, then "
                    f"{a['per_hour_after_replica_s'] / 3600:.2f} replica-s per second")
        lines.append(f"| {i} | `{f['spec']}` | {rec_s} | {cost_s} | {alone(f.get('torchft_alone'))} "
                     f"| {alone(f.get('torchft_alone_at_defaults'))} |")
    return "\n".join(lines)


def _healthy_line(rate: float | None, no_baseline: str | None = None) -> str:
    if no_baseline:  # nothing measured against it: vs healthy, steps behind pace, back at pace
        return f"Healthy step rate: none, {no_baseline}."
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
            _healthy_line(rep["healthy_step_rate"], rep.get("no_baseline"))
            + " Times are seconds since the demo started" + _started(rep) + ".", "",
            "## Faults and phases", "", summary_markdown(rep), "",
            "## Detections", "",
            "| at | kind | group | ranks | culprit | evicted | explained by | incident bundle |",
            "|---|---|---|---|---|---|---|---|"]
    for d in rep["detections"]:
        group = "job-wide" if d["replica_group"] is None else d["replica_group"]
        head.append(f"| {d['at_s']:.1f}s | {d['kind']} | {group} | {d['ranks'] or '—'} "
                    f"| {_culprit(d) if d.get('culprit_ranks') else '—'} "
                    f"| {'yes' if d['evicted'] else 'no'} "
                    f"| {'fault ' + str(d['fault']) if d.get('fault') else 'no fault'} "
                    f"| {bundle_link(d)} |")
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
                 "Each group on a host of its own (node name as NODE_NAME, "
                 + ("a network namespace of its own, its address below"
                    if any(not str(h["addr"]).startswith("127.") for h in hs["hosts"])
                    else "a loopback address for its ranks' servers")
                 + "), plus spares; the monitor's quarantine list at the "
                 f"end: {', '.join(hs.get('quarantined') or []) or 'none'}.", "",
                 "| host | address | group at the end | monitor's state |", "|---|---|---|---|"]
        on = {node: g for g, node in (hs.get("groups") or {}).items()}
        for h in hs["hosts"]:
            head.append(f"| {h['node']} | {h['addr']} | {on.get(h['node'], 'none')} "
                        f"| {(hs.get('states') or {}).get(h['node'], 'ok')} |")
    picture = "![timeline](timeline.png)" if not rep.get("timeline_error") else \
        f"No timeline picture: {rep['timeline_error']}"
    head += ["", picture, "", "## Events", ""]
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
