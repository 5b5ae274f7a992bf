"""``job_stall`` and ``job_slow``: the whole job stopped or slowed and no group to blame (one
host's bad network makes every group wait alike). Report-only: they name no group. The rules:
docs/monitor.md (Detectors).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Container
from typing import Any

from monitor.config import DetectorConfig
from monitor.evidence.lighthouse_status import LighthouseStatus
from monitor.evidence.view import ClusterView

from .findings import JOB_KINDS, Finding, Findings
from .hang import Hang
from .rank_state import collective_wait, current_wait
from .straggler import Straggler, Window, late_for, quorum_size

# findings that name a group: while one is open for a group of the quorum it explains the job
GROUP_KINDS = ("straggler", "hang", "mismatch", "dead_rank", "dead")
BASELINE_KEEP = 30  # healthy windows the baseline is the median of (the newest ones)
IN_COLLECTIVES = 0.5  # of the step's rise, at least this much is waiting in collectives
LATE_SHARE = 0.5  # of the step's rise, one group's arrival lag this much: it, not the network
QUORUM_BASE_WINDOWS = 2  # baseline windows with a group's quorum lag before it can be named
# the newest at-pace windows a group's quorum lag is held against: a group's pre-quorum work
# that changed (its data loading fixed) moves the others' lags within these
QUORUM_BASE_KEEP = 5
# of the hang threshold: a job stall this far on its way starts the probe mesh, so that its
# rounds are in when the stall confirms
STALL_SUSPECT = 0.5
# steps past the newest at the monitor's Lighthouse outage whose commits prove nothing: torchft
# has one step in flight, already past its quorum, and it commits whatever the step time
LH_STEPS_IN_FLIGHT = 1
_NO_WAIT = (None, 0.0)


def _hosts(groups: list) -> list[str]:
    return sorted({h for gv in groups for h in gv.hosts})


def _own_reports(groups: list) -> tuple[int, int] | None:
    """(newest step, newest quorum id) the reachable ranks report themselves; None when none
    does: a rank on torch's debug server alone shows the Lighthouse's, as of its last read, so
    frozen while the monitor cannot read it."""
    own = [r.state for gv in groups for r in gv.reachable
           if r.state and "torch_only" not in r.state]
    if not own:
        return None
    return max(int(s["step"]) for s in own), max(int(s["quorum_id"]) for s in own)


def _host_clock_gpus(groups: list) -> list[int]:
    """CUDA ranks that time their waits on the host clock, where a GPU slow on the GPU waits
    like its peers (docs/gpu.md, 7): a job_slow may then be one of them."""
    return sorted(r.rank for gv in groups for r in gv.ranks if isinstance(s := r.state, dict)
                  and isinstance(d := s.get("device"), dict) and d.get("type") == "cuda"
                  and isinstance(t := s.get("timing"), dict) and t.get("clock") == "host")


def _stall_shape(groups: list, waits: dict[int, tuple]) -> tuple[dict, set, list] | None:
    """Every group blocked in the cross-group collective (a rank of each in ``waits``) or
    behind it, at most one step apart, or through it and waiting for a quorum a step ahead:
    (per group, their steps, the groups through); None otherwise."""
    # first the cheap test that fails a hang: the full one reads every rank's state
    for gv in groups:
        if not any(waits.get(r.rank, _NO_WAIT)[0] == "cross" for r in gv.ranks) and not all(
                r.state.get("phase") == "quorum" for r in gv.ranks if r.fresh):
            return None
    per_group: dict[str, Any] = {}
    steps, through = set(), []
    for gv in groups:
        if len(gv.reachable) != len(gv.ranks):
            return None  # a rank absent: the per-group detectors' business
        fresh = [r for r in gv.ranks if r.fresh]
        if not fresh:
            return None
        if all(r.state.get("phase") == "quorum" for r in fresh):
            # through the collective before the fault cut the others' part of it: waiting
            # for a quorum the blocked groups never ask for (checked a step ahead below)
            through.append(gv)
            continue
        waited = []
        for r in fresh:
            scope, secs = collective_wait(r.state)
            # behind its own group: in an in-group collective, or in torchft's commit (waits
            # for every rank of the group; a healing step's commit says healing)
            if scope not in ("cross", "group") and r.state.get("phase") not in ("commit",
                                                                                "healing"):
                return None  # someone neither in the cross-group collective nor behind it
            if scope == "cross" and r.rank in waits and waits[r.rank][0] == "cross":
                waited.append(secs)
        if not waited:
            return None
        steps.add(gv.step)
        per_group[str(gv.replica_group)] = {
            "step": gv.step, "waiting_s": round(max(waited), 3),
            "ranks": sorted(r.rank for r in fresh if r.rank is not None),
            "hosts": sorted(gv.hosts)}
    if not steps or None in steps or max(steps) - min(steps) > 1 \
            or any(gv.step != max(steps) + 1 for gv in through):
        return None
    return per_group, steps, through


def _quorum_stall(groups: list, threshold: float) -> tuple[dict, set, float] | None:
    """Every rank of every group blocked across groups for ``threshold``, in any phase (a group
    waiting for its quorum shows phase ``quorum``), at most one step apart: (per group, their
    steps, the longest wait); None otherwise. Read only with the Lighthouse down: with it up, a
    group waiting for its quorum is torchft forming one, or another finding's."""
    per_group: dict[str, Any] = {}
    steps, longest = set(), 0.0
    for gv in groups:
        fresh = [r for r in gv.ranks if r.fresh]
        if not fresh or len(gv.reachable) != len(gv.ranks):
            return None
        waited = []
        for r in fresh:
            scope, secs = current_wait(r.state)
            if scope != "cross" or secs is None or secs < threshold:
                return None
            waited.append(secs)
        steps.add(gv.step)
        longest = max(longest, *waited)
        per_group[str(gv.replica_group)] = {
            "step": gv.step, "waiting_s": round(max(waited), 3),
            "ranks": sorted(r.rank for r in fresh if r.rank is not None),
            "hosts": sorted(gv.hosts)}
    if not steps or None in steps or max(steps) - min(steps) > 1:
        return None
    return per_group, steps, longest


JOIN_SLACK_S = 5.0  # a joiner's wait may have begun this much before the others' collective


def _cross_wait(state: Any) -> float:
    """A rank's cross-group wait in any phase (its quorum call too), else its collective wait."""
    scope, secs = current_wait(state)
    return secs if scope == "cross" and secs is not None else collective_wait(state)[1]


def _joining(view: ClusterView, groups: list, lighthouse: LighthouseStatus | None = None,
             any_phase: bool = False, outage_s: float | None = None,
             full: ClusterView | None = None) -> bool:
    """A group outside the newest quorum still in its own (joining, or healing) holds the others:
    recovery, no stall. Its raw wait in any phase (a synchronous quorum heals inside
    start_quorum), and only one that began with the others' (a group re-asking since long
    before holds nobody, as does one in its quorum call only since long after: a crash loop);
    with the Lighthouse's status of that quorum, only a member of it.
    ``any_phase``: the others' wait in their quorum call counts too (the quorum branch's);
    ``outage_s``: how long the Lighthouse has been gone: a group asking only since then needs
    it as much as the others do, so it holds nobody. Joiners are looked for in ``full`` (every
    rank polled): a group restarted while the monitor cannot read the Lighthouse is no evidence
    until it can, yet it holds the others all the same (it only holds back a report-only
    finding, so an unverified rank acts on nothing)."""
    in_q = {gv.replica_group for gv in groups}
    members = lighthouse.members if lighthouse is not None and lighthouse.quorum_id is not None \
        and lighthouse.quorum_id == view.quorum_id else None
    wait_of = _cross_wait if any_phase else (lambda st: collective_wait(st)[1])
    longest = max((wait_of(r.state) for gv in groups for r in gv.ranks if r.fresh),
                  default=0.0)
    slack = max(JOIN_SLACK_S, 3 * (view.median_step_seconds() or 0.0))
    for gv in (full or view).groups.values():
        if gv.replica_group in in_q or (members is not None and gv.replica_id not in members):
            continue
        for r in gv.ranks:
            # never answered (placed by its file_sd hint), or its last answer kept after a
            # failed poll: a dead process is no joiner
            if not r.fresh or not r.reachable or r.state is None:
                continue
            # a member of the quorum not taking part in it heals into it: the others wait for
            # its recovery, or its own hang (a replacement's first step), never the network;
            # one blocked in their collective (healed, or a spare) waits like them
            if members is not None and r.state.get("quorum_id") == view.quorum_id \
                    and not r.state.get("participating", True) \
                    and collective_wait(r.state)[0] != "cross":
                return True
            scope, waited = current_wait(r.state)
            # a process only now asking for its quorum (a crash loop) is not what the others
            # have waited for since long before; one in its collective, its quorum still
            # healing in the background (async quorum: after a cold first step), is
            asking_late = r.state.get("phase") == "quorum" and waited is not None \
                and waited < longest - slack
            if scope == "cross" and r.state.get("quorum_id") != view.quorum_id \
                    and waited is not None and waited <= longest + slack and not asking_late \
                    and (outage_s is None or waited >= outage_s - slack):
                return True
    return False


class JobWide:
    def __init__(self, cfg: DetectorConfig, findings: Findings) -> None:
        self.cfg, self.findings = cfg, findings
        # healthy windows: (step, compute, wait_cross, wait_group) medians
        self.baseline: deque[tuple[float, float, float, float]] = deque(maxlen=BASELINE_KEEP)
        # the newest at-pace windows with quorum waits: the quorum's replica ids then, and each
        # group's median lag (against those groups': held only against the same ones) and its
        # ranks' extra work (Straggler.quorum_lags)
        self.quorum_base: deque[tuple[frozenset, dict[int, tuple[float, dict]]]] = deque(
            maxlen=QUORUM_BASE_KEEP)
        self._rids: frozenset = frozenset()  # (group, replica id) of the newest quorum
        # the quorum's groups as a lag at pace is held against: incarnations of one group may
        # count as one (monitor.detect.pre_quorum)
        self.same: Callable[[frozenset], frozenset] = lambda members: members
        self._newest: int | None = None  # the newest step of the last window judged
        self._baseline_newest: int | None = None  # ... of the last window in the baseline
        # the consecutive slow windows: (ratio, the group late at torchft's quorum or None)
        self._slow: list[tuple[float, int | None]] = []
        self._slow_since: float | None = None
        self._members: frozenset = frozenset()  # (group, replica id) of the newest quorum
        self._stall_suspected = False  # this sweep: a job stall on its way (STALL_SUSPECT)
        self._held = False  # a job_stall explained by an eviction torchft has not acted on yet
        self._changed_at: int | None = None  # the newest step when they last changed
        self._unseen = 0  # sweeps in a row an open job_stall saw no group of the quorum
        self._shrunk = 0  # sweeps in a row the quorum had fewer than two groups
        self._absent: dict[str, int] = {}  # Lighthouse member of the quorum -> sweeps unseen
        # (quorum id, newest step, when, re-based) as every rank's verdict became
        # lighthouse_unreadable; the quorum id and step those ranks report themselves; when:
        # the last sweep that read it (a long sweep or --interval notices an outage late)
        self._lh_out: tuple[int | None, int | None, float, bool] | None = None
        self._lh_read_at: float | None = None  # the last sweep whose ranks read the Lighthouse

    def judge(self, view: ClusterView, now: float, hang: Hang, straggler: Straggler,
              evicted: Container[str] = (),
              lighthouse: LighthouseStatus | None = None, blind: bool = False,
              full: ClusterView | None = None) -> list[Finding]:
        """``blind``: the monitor may be the one cut off: the groups it misses have not left;
        ``full``: every rank polled (``view``: the evidence ranks)."""
        groups = view.in_quorum()
        in_q = {gv.replica_group for gv in groups}
        q = view.quorum_id

        def of_quorum(g: int) -> bool:
            # a group of the quorum out of sight (dead, evicted) still holds the others in its
            # collective: the stall is its finding's, not a job-wide one
            gv = view.groups.get(g)
            return g in in_q or (gv is not None and q is not None and any(
                r.state and r.state.get("quorum_id") == q for r in gv.ranks))

        blamed = sorted({k[1] for k in self.findings.open if k[0] in GROUP_KINDS
                         and of_quorum(k[1])})
        # a group evicted, still of the quorum, holds the others until torchft drops it: seen
        # so, or among the Lighthouse's members of it (its spare may be up under a new id)
        lh = lighthouse.members if lighthouse is not None and q is not None \
            and lighthouse.quorum_id == q else {}
        killed = [g for g, gv in view.groups.items() if gv.replica_id in evicted
                  and of_quorum(g)] + [rid for rid in lh if rid in evicted] \
            if evicted and not blamed else []
        seen = {gv.replica_id for gv in (full or view).groups.values() if gv.reachable}
        self._absent = {rid: self._absent.get(rid, 0) + 1 for rid in lh if rid not in seen}
        self._held = bool(killed) and (self._held or ("job_stall", None, None)
                                       in self.findings.open)
        self._note_lighthouse(groups, now)
        members = frozenset((gv.replica_group, gv.replica_id) for gv in groups)
        if members != self._members:  # a group left, joined or was restarted
            self._members = members
            self._changed_at = view.newest_step()
        self._rids = members
        if len(groups) < 2 and (size := quorum_size(view, self.cfg.dead_sweeps)) < 2:
            # one group left (or none): nothing job-wide, once it lasts --dead-sweeps (a heal's
            # sweep is no shrink); out-of-sight groups' own findings explain it even when blind
            if blamed:
                for kind in JOB_KINDS:
                    self._explained((kind, None, None), now)
            self._shrunk += not blind
            if self._shrunk >= self.cfg.dead_sweeps:
                self._slow, self._slow_since, self._stall_suspected = [], None, False
                self._unseen = 0
                self.findings.resolve_where("quorum_shrunk" if size else "no_quorum", now,
                                            JOB_KINDS)
            return []
        self._shrunk = 0
        out = [self.stall(view, groups, now, hang, blamed or killed, lighthouse, blind, full),
               self.slow(view, groups, now, straggler.last_window, blamed)]
        return [f for f in out if f]

    def _note_lighthouse(self, groups: list, now: float) -> None:
        """Track the monitor's Lighthouse outage: the quorum and newest step the ranks report
        themselves when it began. A sweep with no fresh rank neither starts nor ends it."""
        fresh = [r for gv in groups for r in gv.ranks if r.fresh]
        if not fresh:
            return
        if not all(r.verdict is not None and r.verdict[1] == "lighthouse_unreadable"
                   for r in fresh):
            self._lh_out, self._lh_read_at = None, now
            return
        top, q = _own_reports(groups) or (None, None)
        if self._lh_out is None:
            self._lh_out = (q, top, now if self._lh_read_at is None else self._lh_read_at, False)
            return
        q0, top0, since, rebased = self._lh_out
        # the step in flight got its quorum before the outage, and it may be reported only
        # after the monitor noticed it: one newer quorum id before a step past that one is it
        if not rebased and None not in (q, q0, top, top0) and q > q0 \
                and top <= top0 + LH_STEPS_IN_FLIGHT:
            self._lh_out = (q, top0, since, True)

    def _lighthouse_cause(self, groups: list) -> tuple[str, str | None]:
        """With the monitor unable to read the Lighthouse: ``("lighthouse", None)`` while
        nothing shows the ranks can (no quorum formed, no step committed since beyond the one in
        flight); ``("network", what shows it)`` once something does (a commit needs a quorum:
        the ranks reach it, the monitor's read is what fails); ``("unknown", None)`` when no
        rank reports a step of its own (torch's debug server only: the Lighthouse's, frozen)."""
        own = _own_reports(groups)
        q0, top0, _, _ = self._lh_out or (None, None, 0.0, False)
        if own is None or top0 is None or q0 is None:
            return "unknown", None
        newest, q = own
        since = [what for what, yes in (("a new quorum formed", q != q0),
                                        ("steps committed", newest > top0 + LH_STEPS_IN_FLIGHT))
                 if yes]
        return ("network", " and ".join(since) + " since") if since else ("lighthouse", None)

    def suspected(self) -> bool:
        """A slow window seen but ``job_slow`` not yet confirmed, a job stall past
        ``STALL_SUSPECT`` of the hang threshold (the probe mesh starts then), or one explained
        by an eviction whose group torchft still holds the others for."""
        return bool(self._slow) or self._stall_suspected or self._held

    def _quorum_late(self, w: Window, rise: float) -> dict[str, Any] | None:
        """The group the job waits for at torchft's quorum: late by LATE_SHARE of the step's rise
        (and the lag floor), and by as much more than in the newest at-pace windows of the same
        groups (replica ids), in 3/4 of the window's steps. A group always late there (rank 0
        logging) explains no slowdown; a lag is against the others', so it moves with them."""
        if w.quorum_lags is None or rise <= 0:
            return None
        best, groups = None, self.same(self._rids)
        exact = [b for rids, b in self.quorum_base if rids == self._rids]
        # a carried group's own lag only: the others' moved with its restart (rr5)
        carried = [b for rids, b in self.quorum_base if self.same(rids) == groups]
        for g, x in w.quorum_lags.items():
            at_pace = [b[g] for b in (carried if (g, None) in groups else exact) if g in b]
            seen = [lag for lag, _ in at_pace]
            if len(seen) < QUORUM_BASE_WINDOWS:
                continue  # no baseline of its own to hold it against
            base, lags = statistics.median(seen), x["step_lags_s"]
            least = max(LATE_SHARE * rise, x["floor_s"])
            # later than at pace by it, and late by it: a lag that only fell less is no arrival
            if sum(v >= least and v - base >= least for v in lags) >= 0.75 * len(lags):
                over = [v - base for v in lags]
                late = statistics.median(over)
                if best is None or late > best["lag_s"] - best["baseline_lag_s"]:
                    was = [e[x["rank"]] for _, e in at_pace if x["rank"] in e]  # at pace
                    best = {"group": g, "rank": x["rank"], "host": x["host"],
                            "lag_s": round(statistics.median(lags), 4),
                            "baseline_lag_s": round(base, 4), "steps": x["steps"],
                            "step_lags_s": lags, "extra_s": x["extra_s"],
                            "baseline_extra_s": round(statistics.median(was), 4)
                            if was else None}
        return best

    def baseline_medians(self) -> tuple[float, float, float, float] | None:
        if len(self.baseline) < self.cfg.job_baseline_windows:
            return None
        return tuple(statistics.median(w[i] for w in self.baseline)  # type: ignore[return-value]
                     for i in range(4))

    def _explained(self, key: tuple, now: float) -> None:
        """Resolve a job-wide finding ``explained``; the group findings confirmed now name it
        (``evidence.job_findings``) so the goodput ledger counts them from the job's onset."""
        if key in self.findings.open:
            for k, f in self.findings.open.items():
                if k[0] in GROUP_KINDS and f.confirmed_at == now:
                    f.evidence.setdefault("job_findings", []).append(key[0])
        self.findings.resolve(key, "explained", now)

    # --- job_stall --------------------------------------------------------------------------
    def stall(self, view: ClusterView, groups: list, now: float, hang: Hang,
              blamed: list[int], lighthouse: LighthouseStatus | None = None,
              blind: bool = False, full: ClusterView | None = None) -> Finding | None:
        self._stall_suspected = False
        key = ("job_stall", None, None)
        was = self.findings.open.get(key)
        top = view.newest_step()
        if was is None:
            self._unseen = 0
        elif (over := self._stall_over(was, top, view, blind)) is not None:
            self.findings.resolve(key, over, now)
            return None
        if blamed:
            self._explained(key, now)
            return None
        # torchft's allreduce waits for its quorum first: with the Lighthouse down (restarted)
        # every rank shows blocked in the collective, or in its quorum call, and the network is
        # not to blame; unless a step committed since the monitor lost it (its read fails, the
        # ranks' do not): then a long quorum wait is torchft's own (a heartbeat timeout)
        lh_down = self._lh_out is not None  # _note_lighthouse: every fresh rank says so
        cause, reached = self._lighthouse_cause(groups) if lh_down else ("network", None)
        lh_blamed = cause == "lighthouse"
        if hang.stalled_sweeps < 1 or len(groups) < 2 \
                or _joining(view, groups, lighthouse, any_phase=lh_blamed,
                            outage_s=now - self._lh_out[2] if lh_blamed else None, full=full):
            return None
        stalled, longest, threshold, waits = hang.stall(view, now)
        shape = _stall_shape(groups, waits) if stalled else None
        where = "blocked in the cross-group collective"
        if shape is None and lh_blamed and (waiting := _quorum_stall(groups, threshold)):
            shape, longest = (waiting[0], waiting[1], []), waiting[2]
            where = "blocked across groups (in the collective or its quorum call)"
        if shape is None:  # e.g. between quorums: an open one stays open until a step moves
            if was is None:
                early, _, _, waits = hang.stall(view, now, STALL_SUSPECT)
                self._stall_suspected = (early and _stall_shape(groups, waits) is not None) or (
                    lh_blamed and _quorum_stall(groups, STALL_SUSPECT * threshold) is not None)
            return None
        unseen = sorted(self._absent)
        if was is None and any(n < self.cfg.dead_sweeps for n in self._absent.values()):
            # a member of the Lighthouse's quorum out of sight, its dead finding on its way:
            # the groups seen wait for it, not for the network
            self._stall_suspected = True
            return None
        per_group, steps, through = shape
        for gv in through:
            per_group[str(gv.replica_group)] = {
                "step": gv.step, "waiting_s": None, "phase": "quorum",
                "ranks": sorted(r.rank for r in gv.ranks if r.rank is not None),
                "hosts": sorted(gv.hosts)}
        hosts = _hosts(groups)
        past = sorted(gv.replica_group for gv in through)
        kept = was.evidence.get("cause") if was is not None else None
        if kept in ("network", "unknown") or kept == "lighthouse" \
                and was.evidence.get("quorum_id") == view.quorum_id:
            # open, so no step passed the stalled one: the same stall keeps the cause it opened
            # with, whether the Lighthouse answers again or the monitor loses it meanwhile; but
            # a newer quorum formed needed the Lighthouse: judged again (then network, kept)
            cause = kept
        elif cause == "lighthouse" and now - longest < self._lh_out[2] - JOIN_SLACK_S:
            cause = "network"  # stalled before the monitor lost the Lighthouse: not its outage
        why = {"lighthouse": "the Lighthouse does not answer the monitor either: the ranks may "
                             "be waiting for their quorum" if lh_down else
                             "the Lighthouse did not answer the monitor when the stall began, "
                             "and no step has committed since: the ranks may be waiting for "
                             "their quorum",
               "unknown": ("the Lighthouse does not answer the monitor, and the ranks, on "
                           "torch's debug server only, show its last read as their step: a wait "
                           "for their quorum and a network fault cannot be told apart"
                           if lh_down else
                           "the Lighthouse did not answer the monitor when the stall began, and "
                           "the ranks, on torch's debug server only, showed its last read as "
                           "their step: a wait for their quorum and a network fault could not be "
                           "told apart"),
               "network": "a network fault makes every group wait alike"
                          + (f"; the Lighthouse does not answer the monitor, but {reached}: the "
                             "ranks reach it" if reached else "")}[cause]
        seen = f"{len(groups)}" + (f" seen; the Lighthouse's member(s) {unseen} unseen, not "
                                   f"found dead" if unseen else "")
        ev = {"summary": f"every replica group of quorum {view.quorum_id} ({seen}) is "
                         f"{where} at step {max(steps)}"
                         + (f" or, through it, waits for a quorum (group(s) {past})"
                            if past else "")
                         + f", the longest for {longest:.1f}s (threshold {threshold:.1f}s), "
                         + ("and no group seen is late" if unseen else
                            "and no group is late or absent")
                         + f": a job-wide stall ({why}); hosts {', '.join(hosts)}",
              "lighthouse_unreadable": lh_down or cause == "lighthouse", "cause": cause,
              "stalled_s": round(longest, 3), "threshold_s": round(threshold, 3),
              "quorum_id": view.quorum_id, "step": top, "groups": per_group,
              "hosts": hosts, "probe": None, "unseen_replica_ids": unseen,
              "replica_ids": {str(gv.replica_group): gv.replica_id for gv in groups}}
        return self.findings.confirm("job_stall", None, [], ev, now - longest, now, view)

    def _stall_over(self, was: Finding, top: int | None, view: ClusterView,
                    blind: bool = False) -> str | None:
        """Why an open job_stall is over at the quorum's newest step ``top``, if it is:
        ``progress`` (a step past it, but not just the others through the collective while a
        group stalled in it still waits there), ``restarted`` (below every stalled group's step,
        or none of their incarnations left), ``no_quorum`` (none seen for --dead-sweeps unblind
        sweeps)."""
        if top is None:
            self._unseen += not blind
            return "no_quorum" if self._unseen >= self.cfg.dead_sweeps else None
        self._unseen = 0
        ev = was.evidence
        # the others only through the collective, a step ahead of a group stalled in it that
        # still waits there at its step: the same stall, no step committed
        if top > ev["step"] and not any(
                g.get("waiting_s") is not None and g["step"] == top - 1
                and (gv := view.groups.get(int(k))) is not None and gv.step == g["step"]
                and any(collective_wait(r.state)[0] == "cross" for r in gv.ranks if r.fresh)
                for k, g in ev["groups"].items()):
            return "progress"  # a step committed, not a group gone
        steps = [g["step"] for g in ev["groups"].values() if g.get("step") is not None]
        stalled = {(int(g), rid) for g, rid in (ev.get("replica_ids") or {}).items()}
        if (steps and top < min(steps)) or (stalled and not stalled & self._members):
            return "restarted"
        return None

    # --- job_slow ---------------------------------------------------------------------------
    def slow(self, view: ClusterView, groups: list, now: float, w: Window | None,
             blamed: list[int]) -> Finding | None:
        key = ("job_slow", None, None)
        if blamed:  # a sweep with no newer window too: a group finding opened explains it
            self._slow, self._slow_since = [], None
            self._explained(key, now)
            if w is not None:
                self._newest = w.newest
            return None
        if w is None or w.newest == self._newest:
            return None  # no newer steps: nothing new to judge
        self._newest = w.newest
        if self._changed_at is not None \
                and w.first <= self._changed_at + self.cfg.straggler_steps:
            return None  # a quorum change (a group healing) is not a slowdown, nor a baseline
        base = self.baseline_medians()
        ratio = w.step_s / base[0] if base and base[0] > 0 else None
        max_lag = max(w.lags.values(), default=0.0)
        late = max_lag >= w.lag_threshold_s
        rise = w.step_s - base[0] if base else 0.0
        # a group late by most of the rise under the lag floor: the others' time went into the
        # collective waiting for it, though the median over ranks (two groups: half of them
        # waited) may not show it
        late_group = max(w.lags, key=w.lags.get) if w.lags and rise > 0 \
            and max_lag >= LATE_SHARE * rise else None
        waits_rose = base is not None and (late_group is not None or (
            w.wait_cross_s + w.wait_group_s - base[2] - base[3]) >= IN_COLLECTIVES * rise)
        factor = self.cfg.job_slow_factor
        if ratio is None or ratio <= factor or late or not waits_rose:
            self._slow, self._slow_since = [], None
            if key in self.findings.open:
                if ratio is not None and ratio <= (1 + factor) / 2:
                    self.findings.resolve(key, "back_at_pace", now)
            # learned only at pace (half way to the factor, as back_at_pace): a slowdown just
            # under the factor would else become the norm a later one is held against
            elif (ratio is None or ratio <= (1 + factor) / 2) and not late \
                    and ("job_stall", None, None) not in self.findings.open \
                    and (self._baseline_newest is None or w.first > self._baseline_newest):
                # disjoint windows only: each a sample of its own steps
                self.baseline.append((w.step_s, w.compute_s, w.wait_cross_s, w.wait_group_s))
                if w.quorum_lags is not None:
                    self.quorum_base.append((self._rids, {
                        g: (statistics.median(x["step_lags_s"]), x["extras_s"])
                        for g, x in w.quorum_lags.items()}))
                self._baseline_newest = w.newest
            return None
        q = self._quorum_late(w, rise)
        self._slow.append((round(ratio, 3), q["group"] if q else None))
        # named only when the same group in the last --job-slow-windows slow windows: chance
        # (every group's rank 0 working at random before its quorum) names one now and then
        n = self.cfg.job_slow_windows
        quorum_late = q if q and len(self._slow) >= n \
            and all(g == q["group"] for _, g in self._slow[-n:]) else None
        if self._slow_since is None:  # since its first slow step began
            self._slow_since = now - late_for(w.steps_s, factor * base[0], w.steps_s)
        if len(self._slow) < self.cfg.job_slow_windows and key not in self.findings.open:
            return None
        hosts, host_clock = _hosts(groups), _host_clock_gpus(groups)
        if quorum_late is not None:
            r = quorum_late
            last = f" (rank {r['rank']} on host {r['host']} its last arriver in " \
                f"{r['steps'][0]}/{r['steps'][1]} steps)" if r["rank"] is not None else ""
            why = (f"group {r['group']} arrives at torchft's quorum {r['lag_s']:.3f}s after the "
                   f"others ({r['baseline_lag_s']:.3f}s at pace){last}: a rank slow before its "
                   f"quorum call (data loading, logging) more likely than the network")
        elif late_group is None:
            why = (f"no group is late (largest arrival lag {max_lag:.3f}s, a straggler needs "
                   f"{w.lag_threshold_s:.3f}s): every group waits alike inside the collectives "
                   f"(a network fault slows them all, or a load every host shares: the probe "
                   f"round's verdict, in `probe`, says whether one host's links)")
        else:  # late by less than the median group's own work (or --straggler-min-lag)
            why = (f"group {late_group} arrives {max_lag:.3f}s late, {max_lag / rise:.0%} of the "
                   f"step's rise, under the straggler threshold of {w.lag_threshold_s:.3f}s "
                   f"(--straggler-min-lag {self.cfg.straggler_min_lag_s}s, or the median "
                   f"group's own work a step when shorter): it more likely than the network")
        if host_clock:
            why += (f"; CUDA rank(s) {host_clock} time their waits on the host clock "
                    f"(LIGHTKEEPER_CUDA_TIMING=off, or a CUDA error there), on which a GPU slow "
                    f"on the GPU waits like its peers: it may be one of them")
        ev = {"summary": f"the job's median step is {ratio:.2f}x its healthy baseline "
                         f"({w.step_s:.3f}s vs {base[0]:.3f}s) and {why}; hosts "
                         f"{', '.join(hosts)}",
              "host_clock_cuda_ranks": host_clock, "late_group": late_group,
              "median_step_s": round(w.step_s, 4), "baseline_step_s": round(base[0], 4),
              "ratio": round(ratio, 3), "factor": factor, "steps": [w.first, w.newest],
              "windows": len(self._slow), "window_ratios": [r for r, _ in self._slow[-10:]],
              "quorum_late": quorum_late,
              "now_s": {"compute_s": round(w.compute_s, 4),
                        "wait_cross_s": round(w.wait_cross_s, 4),
                        "wait_group_s": round(w.wait_group_s, 4)},
              "baseline_s": {"compute_s": round(base[1], 4), "wait_cross_s": round(base[2], 4),
                             "wait_group_s": round(base[3], 4)},
              "arrival_lags_s": {str(g): v for g, v in w.lags.items()},
              "lag_threshold_s": round(w.lag_threshold_s, 4), "quorum_id": view.quorum_id,
              "hosts": hosts, "probe": None}
        return self.findings.confirm("job_slow", None, [], ev, self._slow_since, now, view)
