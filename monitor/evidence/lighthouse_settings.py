"""Is the Lighthouse set so that recovery is slow? (docs/lighthouse.md) It does not publish its
flags: judged from the declared ones, ``/status``, kills and the survivors' phases meanwhile;
reported, never acted on.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from .cluster import ClusterView
from .lighthouse_status import LighthouseStatus

log = logging.getLogger(__name__)

SLOW_S = 2.0  # a dead group's stall above this is slow (docs/lighthouse.md)
DROP_SLACK_S = 1.0  # a drop time also holds the process's exit
RELOG_S = 600.0  # a warning that still holds is logged again after this many seconds
PENDING_MAX_S = 300.0  # a kill whose replica never leaves the quorum is forgotten after this

SETTINGS = ("heartbeat_timeout", "eviction_drop", "heartbeat_timeout_declared")


@dataclass(frozen=True)
class SettingWarning:
    setting: str  # one of SETTINGS
    message: str


@dataclass
class Evidence:
    """What is known about the Lighthouse's settings; None: not known."""

    declared_heartbeat_s: float | None = None
    declared_join_s: float | None = None
    heartbeat_above_s: float | None = None  # the timeout is longer than this (observed)
    heartbeat_at_most_s: float | None = None  # ... and at most this (observed)
    last_drop_s: float | None = None  # the last kill -> out of the Lighthouse's quorum
    # the survivors' ranks waited in their quorum call (phase quorum) all through that slow drop
    last_drop_asked: bool = False
    # /status said, with the evicted group's heartbeat already old, that the next quorum waited
    # for healthy groups that had not asked, due to the join timeout
    last_drop_join_wait: bool = False
    interval_s: float = 1.0  # the sweep interval the observations were made at


def _fmt(s: float) -> str:
    return f"{s * 1000:.0f} ms"


def assess(ev: Evidence) -> list[SettingWarning]:
    """The warnings the evidence supports (docs/lighthouse.md, The monitor's warning); []
    when nothing is known to be slow."""
    out: list[SettingWarning] = []
    hb = ev.declared_heartbeat_s
    said = f"{_fmt(hb)} (declared, --lighthouse-heartbeat-timeout-ms)" if hb is not None else ""
    if hb is None and ev.heartbeat_above_s is not None and ev.heartbeat_above_s > SLOW_S:
        hb = ev.heartbeat_above_s
        said = (f"longer than {_fmt(hb)} (its /status showed a departed group's heartbeat that "
                f"old and not yet expired)")
    join_caps = ev.declared_join_s is not None and ev.declared_join_s <= SLOW_S
    if hb is not None and hb > SLOW_S and not join_caps:
        out.append(SettingWarning(
            "heartbeat_timeout",
            f"the Lighthouse's heartbeat timeout is {said}: after every eviction "
            f"or crash the surviving groups stall about that long before their next quorum "
            f"(above {_fmt(SLOW_S)}); start the Lighthouse with heartbeat_timeout_ms=1000 "
            f"(docs/lighthouse.md)"))
    limit = SLOW_S + ev.interval_s + DROP_SLACK_S
    if ev.last_drop_s is not None and ev.last_drop_s > limit:
        drop = (f"the last evicted group left the Lighthouse's quorum {ev.last_drop_s:.1f}s "
                f"after the kill (more than {limit:.1f}s: {_fmt(SLOW_S)} + one sweep + "
                f"{DROP_SLACK_S:g}s for the process to exit); the survivors stalled that long")
        short = _short_heartbeat(ev)
        join = ev.declared_join_s
        # from the survivors' first request to the next sweep: about the join timeout
        at_join = (short is not None and join is not None
                   and join <= ev.last_drop_s <= join + ev.interval_s + DROP_SLACK_S)
        if ev.last_drop_asked:
            # they asked at once, so the Lighthouse held the quorum: below min_replicas without
            # the evicted group, it waits for a replacement
            asked = "they asked for a new quorum at once (their ranks waited in phase quorum)"
            why = (f"{asked} and, its heartbeat timeout {short}, the Lighthouse held it back: "
                   f"its min_replicas is more than the groups left, so the quorum waited for a "
                   f"replacement group to join; start the Lighthouse with a --min_replicas the "
                   f"survivors meet, or keep a spare group ready (docs/lighthouse.md)" if short
                   else f"{asked} and the Lighthouse held it back: check its min_replicas (more "
                   f"than the groups left: the quorum waits for a replacement group to join), "
                   f"heartbeat_timeout_ms and join_timeout_ms (docs/lighthouse.md)")
        elif ev.last_drop_join_wait or at_join:
            seen = ("its /status said it waited for healthy groups that had not asked, due to "
                    "its join timeout" if ev.last_drop_join_wait
                    else f"about its join_timeout_ms, {_fmt(join)} (declared)")
            # gloo fails only the connections to the dead peer: a survivor's rank can wait on
            # another survivor's rank that gave the collective up, until the next quorum
            why = (f"not the evicted group's exit: the Lighthouse held the survivors' next quorum "
                   f"until its join timeout ({seen}): a surviving group was held out, one of "
                   f"its ranks still blocked in the old cross-group collective on a survivor's "
                   f"rank that had given it up, so the group could not ask; the monitor's abort "
                   f"of the survivors' collective (--rank-exit-token) ends that wait, a shorter "
                   f"join_timeout_ms where steps allow caps it (docs/lighthouse.md)")
        elif short is None:
            why = ("check the Lighthouse's heartbeat_timeout_ms and join_timeout_ms "
                   "(docs/lighthouse.md)")
        else:
            why = (f"not the Lighthouse's doing, its heartbeat timeout is {short}: the "
                   f"survivors asked for a new quorum late, blocked in a collective with the "
                   f"evicted group until it failed; check that every rank of an evicted group "
                   f"exits (the Lighthouse's kill reaches only group rank 0: "
                   f"--rank-exit-token) and the Manager's timeout (TORCHFT_TIMEOUT_SEC)")
        out.append(SettingWarning("eviction_drop", f"{drop}: {why}"))
    d, lo, hi = ev.declared_heartbeat_s, ev.heartbeat_above_s, ev.heartbeat_at_most_s
    seen = None
    if d is not None and lo is not None and d < lo - ev.interval_s:
        seen = f"longer than {lo:.1f}s"
    elif d is not None and hi is not None and d > hi + ev.interval_s:
        seen = f"at most {hi:.1f}s"
    if seen is not None:
        out.append(SettingWarning(
            "heartbeat_timeout_declared",
            f"--lighthouse-heartbeat-timeout-ms says {_fmt(d)} but the Lighthouse's /status "
            f"shows a heartbeat timeout {seen}: the declared value is not what it runs with"))
    return out


def _short_heartbeat(ev: Evidence) -> str | None:
    """How the heartbeat timeout is known to be at most SLOW_S; None when it is not."""
    d, hi = ev.declared_heartbeat_s, ev.heartbeat_at_most_s
    if d is not None:
        return f"{_fmt(d)} (declared)" if d <= SLOW_S else None
    if hi is not None and hi <= SLOW_S:
        return f"at most {_fmt(hi)} (observed)"
    return None


class LighthouseSettingsWatch:
    """Collects the evidence sweep by sweep; each warning is logged once, again every RELOG_S
    while it holds, and once when it clears. Never raises on what the Lighthouse serves."""

    def __init__(self, declared_heartbeat_ms: int | None = None,
                 declared_join_ms: int | None = None, interval_s: float = 1.0) -> None:
        self.ev = Evidence(
            declared_heartbeat_s=None if declared_heartbeat_ms is None
            else declared_heartbeat_ms / 1000,
            declared_join_s=None if declared_join_ms is None else declared_join_ms / 1000,
            interval_s=interval_s)
        self.pending: dict[str, float] = {}  # replica_id -> when the kill was sent
        self._asked: dict[str, bool] = {}  # pending replica_id -> survivors all in phase quorum
        self._join_wait: set[str] = set()  # pending replica_ids: see Evidence.last_drop_join_wait
        self.active: dict[str, SettingWarning] = {}
        self._logged_at: dict[str, float] = {}

    def kill_sent(self, replica_id: str | None, now: float) -> None:
        if replica_id:
            self.pending[replica_id] = now

    def observe(self, status: LighthouseStatus | None, now: float,
                view: ClusterView | None = None) -> list[SettingWarning]:
        """Learn from one sweep's status (None: unreadable) and the ranks' newest ``view``;
        returns the warnings that hold."""
        if view is not None and status is not None and status.quorum_id is not None:
            self._note_survivors(view, status.members)
        if status is not None:
            ev = self.ev
            if "due to join timeout" in status.next_status:
                self._join_wait |= {r for r in self.pending if not status.heartbeating(r)}
            for rid, age in status.heartbeats.items():
                if not math.isfinite(age) or age < 0:
                    continue
                if rid in status.stale:
                    if ev.heartbeat_at_most_s is None or age < ev.heartbeat_at_most_s:
                        ev.heartbeat_at_most_s = age
                elif ev.heartbeat_above_s is None or age > ev.heartbeat_above_s:
                    ev.heartbeat_above_s = age
            if status.quorum_id is not None:
                for rid, at in list(self.pending.items()):
                    if rid not in status.members:
                        del self.pending[rid]
                        ev.last_drop_s = max(0.0, now - at)
                        ev.last_drop_asked = self._asked.pop(rid, False)
                        ev.last_drop_join_wait = rid in self._join_wait
                        log.info("evicted replica %s left the Lighthouse's quorum %.1fs after "
                                 "the kill", rid, ev.last_drop_s)
        self.pending = {rid: at for rid, at in self.pending.items() if now - at <= PENDING_MAX_S}
        self._asked = {rid: a for rid, a in self._asked.items() if rid in self.pending}
        self._join_wait &= set(self.pending)
        warnings = assess(self.ev)
        current = {w.setting: w for w in warnings}
        for setting, w in current.items():
            last = self._logged_at.get(setting)
            if last is None or now - last >= RELOG_S:
                log.warning("slow Lighthouse settings (%s): %s", setting, w.message)
                self._logged_at[setting] = now
        for setting in set(self.active) - set(current):
            log.info("Lighthouse settings warning cleared (%s)", setting)
            self._logged_at.pop(setting, None)
        self.active = current
        return warnings

    def _note_survivors(self, view: ClusterView, members) -> None:
        """For each kill whose drop is already slow: were the survivors' ranks (of the
        Lighthouse's quorum ``members``, not the killed ones) all in their quorum call (asked at
        once), at every sweep since? A replacement or spare still starting is no survivor."""
        states = [r.state for gv in view.groups.values() for r in gv.reachable
                  if r.fresh and r.state and r.replica_id in members
                  and r.replica_id not in self.pending and r.state.get("phase") != "starting"]
        if not states:
            return
        asking = all(s.get("phase") == "quorum" for s in states)
        limit = SLOW_S + self.ev.interval_s + DROP_SLACK_S
        for rid, at in self.pending.items():
            if view.at >= at + limit:
                self._asked[rid] = asking and self._asked.get(rid, True)

    def publish(self, metrics, job: str) -> None:
        """Set the gauges of monitor.api.metrics.MonitorMetrics."""
        ev, nan = self.ev, float("nan")
        metrics.lighthouse_drop.labels(job).set(nan if ev.last_drop_s is None
                                                else ev.last_drop_s)
        for source, value in (("declared", ev.declared_heartbeat_s),
                              ("observed_above", ev.heartbeat_above_s),
                              ("observed_at_most", ev.heartbeat_at_most_s)):
            metrics.lighthouse_heartbeat_timeout.labels(job, source).set(
                nan if value is None else value)
        for setting in SETTINGS:
            metrics.config_warnings.labels(job, setting).set(1 if setting in self.active else 0)

    def to_dict(self) -> dict:
        ev = self.ev
        return {"declared_heartbeat_timeout_s": ev.declared_heartbeat_s,
                "declared_join_timeout_s": ev.declared_join_s,
                "observed_heartbeat_timeout_above_s": ev.heartbeat_above_s,
                "observed_heartbeat_timeout_at_most_s": ev.heartbeat_at_most_s,
                "last_drop_s": ev.last_drop_s, "slow_s": SLOW_S,
                "warnings": [{"setting": w.setting, "message": w.message}
                             for w in self.active.values()]}
