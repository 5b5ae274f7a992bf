"""The second shape of ``stuck_starting``: a verified, answering group the job's quorums go on
without. A group whose step hangs past the others' process-group timeout (its first: the hang
detector holds an untimed group to --starting-timeout, torchft drops it sooner; a later one the
hang detector did not name: a monitor started since, or the others' timeout cut their wait
under the hang threshold; or one it named, whose hang stays open: monitor.detect.hang) answers
and heartbeats at its old quorum id but never trains again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from monitor.config import DetectorConfig
from monitor.evidence.lighthouse_status import LighthouseStatus, QuorumMember
from monitor.evidence.view import ClusterView, GroupView

from .hang import untimed
from .rank_state import SaveClock

MIN_JOB_STEPS = 2  # the others' progress over the span: a whole job stalled is job_stall's


@dataclass
class LeftOutGroup:
    gv: GroupView
    evidence: dict[str, Any]
    first_seen: float


class LeftOut:
    def __init__(self, cfg: DetectorConfig) -> None:
        self.cfg = cfg
        # group -> (replica id, step, when first seen there by the monitor's clock, not a rank's)
        self._at: dict[int, tuple[str | None, int, float]] = {}
        # (when, the newest quorum's step) each time that step changed, back to the last one
        # at or before now - --starting-timeout
        self._job: deque[tuple[float, int]] = deque()
        self._saves = SaveClock(cfg.checkpoint_timeout_s)  # by url, noted each sweep it is judged
        # group -> the last sweep it was held (saving or busy): its clock starts again there
        self._held_at: dict[int, float] = {}
        # group -> the last sweep it took part in the newest quorum or had no quorum yet: time
        # in the quorum (the others waiting for it) is no time left out
        self._part_at: dict[int, float] = {}
        # group -> the quorum id its reachable ranks last reported: torchft's ids only grow
        # while the Lighthouse lives, so a sweep the others' ranks miss lowers nothing
        self._reported: dict[int, int] = {}
        self._newest_q: int | None = None

    def judge(self, view: ClusterView, now: float, skip: set[int],
              lighthouse: LighthouseStatus | None = None
              ) -> tuple[dict[int, LeftOutGroup], set[int]]:
        """(group -> what names it, the groups still out: step unmoved and no part in the newest
        quorum, or no rank answering) of ``view``'s verified groups; ``skip``: groups the
        no-first-quorum shape names; ``lighthouse``: None: the newest quorum the ranks told."""
        timeout = self.cfg.starting_timeout_s
        q, members, fell = self._newest(view, lighthouse)
        part = {g for g, gv in view.groups.items() if _takes_part(gv, q, members)}
        steps = [view.groups[g].step for g in part if view.groups[g].step is not None]
        # a shard may hold no group of the newest quorum: its members' steps tell the others'
        # progress (each as of its last quorum request: a step behind at most)
        steps += [m.step for m in (members or {}).values()]
        top = max(steps, default=None)
        job = self._job
        if top is not None and not fell and (not job or job[-1][1] != top):
            job.append((now, top))
        while len(job) > 1 and job[1][0] <= now - timeout:
            job.popleft()
        done = top - job[0][1] if top is not None and job else 0
        at = self._at
        # kept while a group is away from the view or none of its ranks answers (a blip, the
        # monitor's own network): only a new step or replica id restarts its clock
        named, still = {}, {g for g in at if g not in view.groups}
        for g, gv in view.groups.items():
            was = at.get(g)
            step, rid = gv.step, gv.replica_id or (was[0] if was else None)
            if step is None or q is None:
                if was is not None:
                    still.add(g)
                continue
            if was is None or was[:2] != (rid, step):  # it committed, or a new incarnation
                at[g] = was = (rid, step, now)
            since = was[2]
            held = self._held(gv, now)
            if held:
                self._held_at[g] = now
            elif held is not None:  # a save past --checkpoint-timeout excuses nothing
                self._held_at.pop(g, None)
            if g in part or any(r.state and r.state["quorum_id"] < 0 for r in gv.reachable):
                self._part_at[g] = now
            if g in part:
                continue
            if since < now:
                still.add(g)
            start = max(since, self._held_at.get(g, since), self._part_at.get(g, since))
            if now - start < timeout or g in skip or done < MIN_JOB_STEPS \
                    or not self._answering(gv) or held:
                continue
            named[g] = LeftOutGroup(gv, self._evidence(gv, q, step, now - start, done), start)
        return named, still

    def _newest(self, view: ClusterView, lighthouse: LighthouseStatus | None
                ) -> tuple[int | None, dict[str, QuorumMember] | None, bool]:
        """(the newest quorum id, its members by replica id from the Lighthouse's status (else
        None), whether that id went down since the last sweep). Without the status: the highest
        id the verified groups last reported, lower only once those that carried it are gone
        or report lower (a Lighthouse restart), never because their ranks missed a sweep."""
        reported = self._reported
        for g in [g for g in reported if g not in view.groups]:
            del reported[g]
        for g, gv in view.groups.items():
            if gv.quorum_id is not None:
                reported[g] = gv.quorum_id
        if lighthouse is not None and lighthouse.quorum_id is not None:
            q, members = lighthouse.quorum_id, lighthouse.members
        else:
            q, members = max(reported.values(), default=None), None
        fell = q is not None and self._newest_q is not None and q < self._newest_q
        if q is not None:
            self._newest_q = q
        return q, members, fell

    def _held(self, gv: GroupView, now: float) -> bool | None:
        """Every reachable rank in a held phase (``checkpoint``, ``busy``: on purpose outside the
        collectives): True while seen so under --checkpoint-timeout ago, False past; else None."""
        held = self._saves.note(gv, now)
        return None if held is None or not gv.reachable else held[1]

    @staticmethod
    def _answering(gv: GroupView) -> bool:
        """Every rank answers with a quorum, none said it stopped or ended (a planned stop); a
        rank without a first quorum is the other shape's, one down the dead detectors'."""
        return len(gv.reachable) == len(gv.ranks) and all(
            r.state and r.state["quorum_id"] >= 0 and r.state.get("finished") is not True
            and r.state.get("phase") != "stopped" for r in gv.ranks)

    def _evidence(self, gv: GroupView, newest: int, step: int, for_s: float,
                  done: int) -> dict[str, Any]:
        timeout = self.cfg.starting_timeout_s
        ranks = sorted(r.rank for r in gv.ranks if r.rank is not None)
        joined = newest in gv.quorums
        return {
            "summary": f"rank(s) {ranks} out of the job's quorums since step {step}: the others "
                       f"committed {done} steps in the last {timeout:g}s (its quorum "
                       f"{gv.quorum_id}, the newest {newest})",
            "shape": "left_out", "step": step, "job_steps": done, "window_s": timeout,
            "starting_timeout_s": timeout, "for_s": round(for_s, 1),
            "quorum_id": gv.quorum_id, "newest_quorum_id": newest,
            "why": "in the newest quorum but not taking part in it (participating false) "
                   "while the others commit" if joined else
                   # a timed group hung mid-run
                   "the others' quorums go on without it: a step that hung past their process-"
                   "group timeout (its first step, held as compiling?)" if untimed(gv) else
                   "a step that hung past the others' process-group timeout: the job went on "
                   "without it",
            "ranks": {str(r.rank): {
                "phase": r.state.get("phase"), "replica_id": r.replica_id, "step": r.state["step"],
                "quorum_id": r.state["quorum_id"],
                "participating": r.state.get("participating", True)}
                for r in gv.ranks if r.rank is not None}}


def _takes_part(gv: GroupView, q: int | None, members: dict[str, QuorumMember] | None) -> bool:
    """``gv`` takes part in quorum ``q``: with the Lighthouse's ``members``, one it let in
    (unless its ranks say they do not take part in it); without, one whose reachable ranks
    take part in ``q``. (A rank claiming a quorum past the Lighthouse's is not verified, so
    never here.)"""
    if members is None:
        return q in gv.taking_part
    if q in gv.quorums and q not in gv.taking_part:
        return False
    return gv.replica_id in members
