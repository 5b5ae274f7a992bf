"""One injected fault's story, told from what the demo observes: struck -> caught -> evicted -> back.

A :class:`FaultTrack` is created when the demo arms a fault (given to a group at start, or
injected into a running rank). Every tick the demo hands it an :class:`Observation` (the ranks'
own ``/v1/state``, the monitor's ``/v1/findings`` and ``/v1/evictions``, the supervisor's
restarts) and the track moves through its stages, each with a deadline:

1. **strike**: the target rank reports the fault in ``/v1/state`` ``faults_struck_at`` (its own
   clock, the moment the fault first acted). Deadline: ``strike_s`` plus ``s_per_step`` for every
   step the group still had to go to the fault's step when it was armed. A group restarted (or
   finished) before the fault struck takes the fault with it: "never struck".
2. **detection**: a confirmed finding for the fault's replica group, confirmed no earlier than
   1 s before the strike (``dead`` counts only once the group's process is gone, as for a crash,
   except for ``host_offline``, whose processes live on). A finding of another fault's making is
   not this one's: ``quarantined_host``, and any confirmed after the supervisor drained the group
   (its host quarantined for an earlier fault); such a drain ends the story (``not measured``).
   Deadline: ``detect_s`` after the strike.
3. **eviction**: the monitor's ``evict`` decision for that finding (or group). A ``dry_run``
   hold ends the story there; other holds (cooldown, min_replicas) are waited out until
   ``evict_s``. A group whose process died and was restarted without an eviction skips it.
4. **rejoin**: every rank of a restarted incarnation takes part in a quorum of all groups, or in
   the newest quorum with every group in it (another group out, hung or evicted, does not
   hold it back), close to the job's step. Deadline: ``rejoin_s`` after the eviction. A
   network fault's group restarted on its own host (the fault still there) does not end
   ``recovered``.

A stage whose deadline passes ends the story of that fault with an ``outcome`` and a ``note``
that names the deadline; the track never waits forever, so the demo always ends. ``record`` is
the fault's entry in ``report.json`` (docs/demo.md, `report.json`). Times are demo seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from http_serving import printable

STAGES = ("strike", "detection", "eviction", "rejoin", "done")
FINDING_SLACK_S = 1.0  # a finding confirmed this long before the strike still counts (clocks)
DRAIN_GRACE_S = 2.0  # a finding the monitor confirmed just before a drain may be read this late
NETWORK_KINDS = ("slow_link", "partition", "host_offline")  # the host's: a restart there keeps it


@dataclass(frozen=True)
class Deadlines:
    strike_s: float = 30.0     # armed -> struck (plus s_per_step per step still to go)
    s_per_step: float = 2.0
    detect_s: float = 60.0     # struck -> detected
    evict_s: float = 30.0      # detected -> evicted
    rejoin_s: float = 120.0    # evicted -> rejoined


@dataclass(frozen=True)
class Strike:
    """A strike one rank reported: its group, the group's incarnation (0 = first start), the
    rank's group rank, global rank, host, the spec and the unix time it struck."""

    replica_group: int
    incarnation: int
    group_rank: int
    rank: int
    host: str
    spec: str
    at_unix: float


@dataclass
class Observation:
    """What the demo knows at one tick."""

    t: float                                    # demo seconds now
    t0_unix: float                              # unix time of demo second 0
    groups: int
    ranks_per_group: int
    states: dict[int, list[dict]]               # group -> latest /v1/state of its live ranks
    incarnation: dict[int, int]                 # group -> starts so far - 1
    alive: dict[int, bool]                      # group -> any of its processes runs
    finished: dict[int, bool]                   # group -> exited 0 (trained its --steps)
    strikes: list[Strike]
    findings: list[dict]                        # monitor /v1/findings
    evictions: list[dict]                       # monitor /v1/evictions (decisions)
    restarts: list[tuple[int, float]]           # (group, demo seconds) per supervisor restart
    samples: list[dict] = field(default_factory=list)  # every rank sample so far
    quarantines: dict[str, float] = field(default_factory=dict)  # host -> demo s quarantined
    placements: list[dict] = field(default_factory=list)  # group starts: replica_group, at_s,
    #                                                      node, addr, why (the supervisor's)
    drains: list[tuple[int, float]] = field(default_factory=list)  # (group, demo s) drained
    quarantine_findings: dict[str, Any] = field(default_factory=dict)  # host -> the finding id
    #                                                    its newest quarantine names (GET /v1/hosts)

    def unix(self, t: float) -> float:
        return self.t0_unix + t

    def rel(self, unix: float | None) -> float | None:
        return None if unix is None else round(unix - self.t0_unix, 2)

    def group_step(self, g: int) -> int:
        return max((s["step"] for s in self.states.get(g) or []), default=-1)

    def job_step(self) -> int:
        return max((self.group_step(g) for g in self.states), default=-1)


def finding_culprits(f: dict) -> tuple[list[int] | None, list[str] | None]:
    """(culprit ranks, their hosts) as the monitor serves them on a finding (its
    ``evidence.culprit_ranks`` and ``evidence.culprit_hosts``, which ranks named: printed
    escaped); None where it names none."""
    ev = f.get("evidence") if isinstance(f.get("evidence"), dict) else {}
    ranks, hosts = ev.get("culprit_ranks"), ev.get("culprit_hosts")
    return (None if ranks is None else [int(r) for r in ranks],
            None if hosts is None else list(dict.fromkeys(printable(str(h)) for h in hosts)))


class FaultTrack:
    """The story of one fault; see the module docstring."""

    def __init__(self, index: int, *, replica_group: int, group_rank: int | None, spec: str,
                 kind: str, trigger_step: int, given: str, armed_at_s: float,
                 counting_from_s: float, incarnation: int, step_at_arming: int,
                 ranks_per_group: int, deadlines: Deadlines = Deadlines()) -> None:
        """``armed_at_s``: when the fault was given (the group's start, or the injection);
        ``counting_from_s``: when the strike deadline starts counting (for a fault given at
        start, once training runs); ``incarnation``: the group's starts so far - 1."""
        self.index = index
        self.kind = kind
        self.trigger_step = trigger_step
        self.incarnation = incarnation
        self.dl = deadlines
        self.stage = "strike"
        steps_to_go = max(0, trigger_step - max(0, step_at_arming))
        self.deadline_s = round(counting_from_s + deadlines.strike_s
                                + steps_to_go * deadlines.s_per_step, 2)
        self.finding_id: Any = None
        self.held: str | None = None
        self.ended_s: float | None = None        # demo seconds the story ended
        self._t = armed_at_s                       # demo seconds of the newest observation
        self._since_unix: float | None = None    # detection window start (strike, else arming)
        self.record: dict[str, Any] = {
            "replica_group": replica_group, "group_rank": group_rank,
            "rank": None if group_rank is None else replica_group * ranks_per_group + group_rank,
            "host": None, "spec": spec, "given": given, "injected_at_s": armed_at_s,
            "struck_at_s": None, "detected_at_s": None, "detected_kind": None,
            "finding_ranks": None, "culprit_ranks": None, "culprit_hosts": None,
            "evicted_at_s": None, "restarted_at_s": None, "survivors_committing_at_s": None,
            "rejoined_at_s": None, "steps_lost": None, "outcome": "pending", "note": None,
            "host_quarantined_at_s": None, "restarted_on": None, "restarted_addr": None}

    # --- public ----------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.stage == "done"

    @property
    def group(self) -> int:
        return self.record["replica_group"]

    def describe(self) -> str:
        """A few words on where the story stands (live view)."""
        r = self.record
        where = f"group {self.group}" + ("" if r["group_rank"] is None
                                         else f" rank {r['group_rank']}")
        if self.done:
            return f"{r['spec']} in {where}: {r['outcome']}"
        return f"{r['spec']} in {where}: waiting for {self.stage} (until {self.deadline_s:.0f}s)"

    def update(self, obs: Observation) -> list[tuple[str, str]]:
        """Advance as far as ``obs`` allows; returns events (kind, detail) for the demo's log."""
        events: list[tuple[str, str]] = []
        self._t = obs.t
        before = None
        while not self.done and self.stage != before:
            before = self.stage
            getattr(self, f"_{self.stage}")(obs, events)
        return events

    def note_hosts(self, obs: Observation) -> None:
        """Where the story met the hosts: the struck host's quarantine (if the monitor
        quarantined it after the strike) and the host the group was restarted on. Called on
        every tick, also once the story is over (the monitor's ledger may answer a tick late)."""
        r = self.record
        if r["struck_at_s"] is None and r["detected_at_s"] is None:
            return
        since = (r["struck_at_s"] if r["struck_at_s"] is not None else r["injected_at_s"]) \
            - FINDING_SLACK_S
        until = float("inf") if self.ended_s is None else self.ended_s + FINDING_SLACK_S
        for host in [r["host"], *(r["culprit_hosts"] or [])]:
            at = obs.quarantines.get(host) if host else None
            if r["host_quarantined_at_s"] is not None or at is None or at < since:
                continue
            # the host's quarantine for a finding of this story (a rail may have held it past
            # the story's end); one the ledger names no finding for, made while the story ran
            fid = obs.quarantine_findings.get(host)
            if fid in self._finding_ids(obs, since, until) if fid is not None else at <= until:
                r["host_quarantined_at_s"] = at
        gone = r["evicted_at_s"] if r["evicted_at_s"] is not None else r["detected_at_s"]
        if r["restarted_on"] is None and gone is not None:
            p = next((p for p in obs.placements if p["replica_group"] == self.group
                      and p["at_s"] >= gone - FINDING_SLACK_S and p.get("node")), None)
            if p is not None:
                r["restarted_on"], r["restarted_addr"] = p["node"], p.get("addr")

    def _finding_ids(self, obs: Observation, since_s: float, until_s: float) -> set:
        """Ids of the findings of this fault's group confirmed while its story ran, not of
        another fault's making."""
        return {self.finding_id} | {
            f.get("id") for f in obs.findings if f.get("replica_group") == self.group
            and f.get("confirmed_at") and since_s <= obs.rel(f["confirmed_at"]) <= until_s
            and not self._theirs(f, obs)}

    def fail(self, outcome: str, note: str) -> None:
        """End the story before it began (the fault could not be armed)."""
        self._end(outcome, note, [])

    def stop(self, t: float) -> None:
        """The demo ends before this story did: say where it stood."""
        if not self.done:
            self.record["note"] = f"the demo stopped at {t:.1f}s while waiting for {self.stage}"
            self.stage, self.ended_s = "done", t

    # --- stages ----------------------------------------------------------------------
    def _end(self, outcome: str, note: str | None, events: list) -> None:
        self.record["outcome"] = outcome
        self.record["note"] = note
        self.stage, self.ended_s = "done", self._t
        events.append(("outcome", f"fault {self.index}: {outcome}" + (f" ({note})" if note
                                                                      else "")))

    def _strike(self, obs: Observation, events: list) -> None:
        r = self.record
        mine = [s for s in obs.strikes if s.replica_group == self.group
                and s.incarnation == self.incarnation and s.spec == r["spec"]
                and (r["group_rank"] is None or s.group_rank == r["group_rank"])]
        if mine:
            first = min(mine, key=lambda s: s.at_unix)
            r["struck_at_s"] = obs.rel(first.at_unix)
            r["host"] = first.host
            if r["group_rank"] is not None:
                r["rank"] = first.rank
            self._since_unix = first.at_unix
            self._next("detection", max(obs.t, r["struck_at_s"]), self.dl.detect_s)
            events.append(("struck", f"{r['spec']} struck group {self.group} "
                                     f"rank {first.rank} ({first.host}) at "
                                     f"{r['struck_at_s']:.1f}s"))
            return
        gone = (not obs.alive.get(self.group, False)
                or obs.incarnation.get(self.group, 0) != self.incarnation)
        since = obs.unix(r["injected_at_s"])
        if gone and self._finding(obs, since) is not None:
            # The process is gone without a strike seen (a crash exits before the next poll)
            # and the monitor caught something: told as such, counted from arming.
            self._since_unix = since
            r["note"] = "the rank never reported the strike; detection counted from arming"
            self._next("detection", obs.t, self.dl.detect_s)
            return
        if self._crash_restarted(obs, r["injected_at_s"], strike=True):
            return
        if obs.incarnation.get(self.group, 0) != self.incarnation:
            self._end("never struck", f"group {self.group} was restarted before the fault "
                                      "struck; faults given at start are not given again", events)
        elif obs.finished.get(self.group):
            self._end("never struck", f"group {self.group} finished its steps first", events)
        elif obs.t >= self.deadline_s:
            self._end("never struck", f"no strike reported by {self.deadline_s:.1f}s "
                                      f"(step {self.trigger_step} not reached, or skipped by a "
                                      "heal)", events)

    def _finding(self, obs: Observation, since_unix: float) -> dict | None:
        found = [f for f in obs.findings if f.get("replica_group") == self.group
                 and f.get("confirmed_at") and f["confirmed_at"] >= since_unix - FINDING_SLACK_S]
        gone = (not obs.alive.get(self.group, False)
                or obs.incarnation.get(self.group, 0) != self.incarnation)
        # a host gone off the network is caught as dead while its processes live on (under
        # --dry-run nothing kills them)
        found = [f for f in found if (f["kind"] != "dead" or gone or self.kind == "host_offline")
                 and not self._theirs(f, obs)]
        found.sort(key=lambda f: (f["kind"] == "dead", f["confirmed_at"]))
        return found[0] if found else None

    def _drained(self, obs: Observation) -> float | None:
        """When the supervisor first drained the group since the fault was armed (its host
        quarantined), or None."""
        return next((t for g, t in obs.drains if g == self.group
                     and t >= self.record["injected_at_s"]), None)

    def _theirs(self, f: dict, obs: Observation) -> bool:
        """``f`` is of another fault's making: a group on a host quarantined already, or what
        a drain left (a drain follows a quarantine: one of this fault's own follows its finding,
        which is then told already)."""
        drained = self._drained(obs)
        return f["kind"] == "quarantined_host" or (
            drained is not None and f["confirmed_at"] >= obs.unix(drained))

    def _crash_restarted(self, obs: Observation, since_s: float, strike: bool = False) -> bool:
        """A crash exits before the next poll and the supervisor restarts the group at once:
        torchft's own recovery, with nothing for the monitor to act on. On the group's first
        restart since ``since_s`` the story goes to its rejoin (``strike``: the rank never
        reported its strike, so struck at the exit as the supervisor saw it, and said so)."""
        if self.kind != "crash":
            return False
        exit_at = next((t for g, t in obs.restarts if g == self.group and t >= since_s), None)
        if exit_at is None:
            return False
        r = self.record
        if strike:
            r["struck_at_s"] = exit_at
        r["restarted_at_s"] = exit_at
        r["note"] = "the rank exited (a crash): torchft's own recovery, group restarted" + (
            "; it never reported the strike: struck_at_s is its exit as the supervisor saw "
            "it (up to a tick late)" if strike else "")
        self._next("rejoin", obs.t, self.dl.rejoin_s)
        return True

    def _detection(self, obs: Observation, events: list) -> None:
        r = self.record
        f = self._finding(obs, self._since_unix)
        if f is None:
            if self._crash_restarted(obs, r["struck_at_s"]):
                return
            drained = self._drained(obs)
            if drained is not None and obs.t >= drained + DRAIN_GRACE_S:
                self._end("not measured", f"group {self.group} was drained at {drained:.1f}s, "
                                          "its host quarantined before the monitor found this "
                                          "fault (for an earlier one)", events)
            elif obs.t >= self.deadline_s:
                self._end("not detected", f"no confirmed finding for group {self.group} within "
                                          f"{self.dl.detect_s:g}s of the strike "
                                          f"(deadline {self.deadline_s:.1f}s)", events)
            return
        self.finding_id = f.get("id")
        r["detected_at_s"], r["detected_kind"] = obs.rel(f["confirmed_at"]), f["kind"]
        r["finding_ranks"] = list(f.get("ranks") or [])
        r["culprit_ranks"], r["culprit_hosts"] = finding_culprits(f)
        self._next("eviction", max(obs.t, r["detected_at_s"]), self.dl.evict_s)

    def _decisions(self, obs: Observation, decision: str) -> list[dict]:
        since = obs.unix(self.record["detected_at_s"]) - FINDING_SLACK_S
        out = [d for d in obs.evictions if d.get("decision") == decision
               and d.get("replica_group") == self.group and d.get("at", 0) >= since]
        if self.finding_id is not None:
            own = [d for d in out if d.get("finding_id") == self.finding_id]
            out = own or [d for d in out if d.get("finding_id") is None]
        return sorted(out, key=lambda d: d["at"])

    def _eviction(self, obs: Observation, events: list) -> None:
        r = self.record
        evicts = self._decisions(obs, "evict")
        if evicts:
            r["evicted_at_s"] = obs.rel(evicts[0]["at"])
            self._next("rejoin", max(obs.t, r["evicted_at_s"]), self.dl.rejoin_s)
            return
        holds = self._decisions(obs, "hold")
        if holds:
            self.held = holds[-1].get("reason")
        elif r["detected_kind"] == "dead" and self.kind == "host_offline" and any(
                d.get("status") == "dry_run" and d.get("replica_group") == self.group
                and d.get("at", 0) >= self._since_unix - FINDING_SLACK_S for d in obs.evictions):
            # dead is reported, never decided: the dry run shows in the monitor's other
            # decisions on the group (the survivors' abort it did not send); a crash's group
            # is restarted by its supervisor, dry run or not
            self.held = "dry_run"
        if self.held == "dry_run":
            self._end("detected, not evicted (dry run)", "the monitor held the eviction: "
                                                          "--dry-run", events)
            return
        if obs.incarnation.get(self.group, 0) != self.incarnation:
            # the process died (a crash, or a dead rank) and the supervisor restarted it
            self._next("rejoin", obs.t, self.dl.rejoin_s)
            return
        if obs.t >= self.deadline_s:
            self._end("detected, not evicted" + (f" (held: {self.held})" if self.held else ""),
                      f"no eviction of group {self.group} within {self.dl.evict_s:g}s of the "
                      f"detection (deadline {self.deadline_s:.1f}s)", events)

    def _rejoin(self, obs: Observation, events: list) -> None:
        r = self.record
        if r["restarted_at_s"] is None and obs.incarnation.get(self.group, 0) != self.incarnation:
            # its first restart since the strike, also one before the finding (a drain's)
            since = r["struck_at_s"] if r["struck_at_s"] is not None else r["injected_at_s"]
            r["restarted_at_s"] = next((t for g, t in obs.restarts if g == self.group
                                        and t >= since), None)
        gone_at = r["evicted_at_s"] if r["evicted_at_s"] is not None else r["restarted_at_s"]
        if r["survivors_committing_at_s"] is None and r["evicted_at_s"] is None \
                and r["struck_at_s"] is not None:
            # no kill (a host gone, a crash): the survivors go on once a quorum leaves it out,
            # which may be long before its restart
            r["survivors_committing_at_s"] = self._survivors_commit(obs, r["struck_at_s"],
                                                                    without=True)
        if r["survivors_committing_at_s"] is None and gone_at is not None:
            r["survivors_committing_at_s"] = self._survivors_commit(obs, gone_at)
        if gone_at is not None and r["survivors_committing_at_s"] is not None \
                and self._rejoined(obs, obs.unix(gone_at)):
            r["rejoined_at_s"] = obs.t
            r["outcome"] = "recovered"
            self.stage, self.ended_s = "done", obs.t
            events.append(("rejoined", f"group {self.group} back in the quorum "
                                       f"({obs.states[self.group][0]['num_participants']} "
                                       f"participants) at step "
                                       f"{obs.group_step(self.group)}"))
            self._on_its_host(obs, gone_at, events)
        elif obs.t >= self.deadline_s:
            self._end("evicted, did not rejoin in time" if r["evicted_at_s"] is not None
                      else "did not rejoin in time",
                      f"group {self.group} not back in the job's quorum within "
                      f"{self.dl.rejoin_s:g}s (deadline {self.deadline_s:.1f}s)", events)

    def _on_its_host(self, obs: Observation, gone_at: float, events: list) -> None:
        """A network fault stays on its host: a restart there (its quarantine held, or not
        made) is no recovery, said in the outcome."""
        r = self.record
        back = [p for p in obs.placements if p["replica_group"] == self.group
                and p["at_s"] >= gone_at - FINDING_SLACK_S]
        there = [p for p in back if r["host"] is not None and p.get("node") == r["host"]]
        if self.kind not in NETWORK_KINDS or not there:
            return
        still = back[-1].get("node") == r["host"]
        self._end("rejoined on its faulty host" if still
                  else "recovered after a restart on its faulty host",
                  f"restarted at {there[0]['at_s']:.1f}s on {r['host']}, where the {self.kind} "
                  "still was" + ("" if still else f"; on {back[-1].get('node')} since "
                                                  f"{back[-1]['at_s']:.1f}s"), events)

    def _survivors_commit(self, obs: Observation, gone_at: float,
                          without: bool = False) -> float | None:
        """First step the other groups committed after ``gone_at``: a committed step moves
        torchft's step; a failed one (the survivors' collective breaking) only moves
        last_step_at. ``without``: only in a quorum without this group (fewer participants)."""
        survivors = {g for g in obs.states if g != self.group}
        step_then: dict[int, int] = {}
        for s in obs.samples:
            if s["replica_group"] in survivors and s["t"] <= gone_at:
                step_then[s["rank"]] = max(step_then.get(s["rank"], 0), s["step"])
        late = [s["last_step_at_s"] for s in obs.samples if s["replica_group"] in survivors
                and s["last_step_at_s"] is not None and s["step"] > step_then.get(s["rank"], 0)
                and s["last_step_at_s"] > gone_at
                and (not without or s.get("num_participants", obs.groups) < obs.groups)]
        return min(late) if late else None

    def _rejoined(self, obs: Observation, since_unix: float) -> bool:
        """Stage 4's test; "every group in it": the groups whose ranks report the newest
        quorum are as many as its participants (a hung group's ranks report an older one)."""
        st = obs.states.get(self.group) or []
        q = {s.get("quorum_id") for s in st}
        newest = max((s.get("quorum_id") or -1 for ss in obs.states.values() for s in ss),
                     default=-1)
        members = len([g for g, ss in obs.states.items()
                       if any(s.get("quorum_id") == newest for s in ss)])
        return (len(st) == obs.ranks_per_group
                and all(s["participating"] and s["started_at"] > since_unix
                        and s["step"] >= obs.job_step() - 3
                        and (s["num_participants"] == obs.groups
                             or q == {newest} and 1 < s["num_participants"] == members)
                        for s in st))

    def _next(self, stage: str, start_s: float, allowed_s: float) -> None:
        self.stage = stage
        self.deadline_s = round(start_s + allowed_s, 2)
