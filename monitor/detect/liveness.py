"""Ranks gone after they started (``dead_rank``: its Manager still answers and its group is seen
waiting for it; ``dead``: the Manager too); only a verified group's replica id can be evicted.
One that said it finished, or whose incarnation was evicted, ended when it went silent."""

from __future__ import annotations

import errno
import logging
import re
from collections.abc import Container, Mapping
from types import SimpleNamespace
from typing import Any

from monitor.config import DetectorConfig
from monitor.evidence.lighthouse_status import LighthouseStatus
from monitor.evidence.rank import DOWN_AT
from monitor.evidence.view import ClusterView, GroupView, RankView

from .findings import Finding, Findings
from .rank_state import SaveClock, collective_wait
from .starting import StuckStarting

log = logging.getLogger(__name__)
DEAD_KINDS = ("dead", "dead_rank")
HOLD = float("-inf")  # the mark of a rank whose group's commits when it went down are unknown
# asyncio's error when every address of a host name (IPv6 and IPv4) failed: each part refused
_ONE = rf"\[Errno {errno.ECONNREFUSED}\] Connect call failed \([^()]*\)"
_ALL_REFUSED = re.compile(rf"OSError: Multiple exceptions: {_ONE}(, {_ONE})*")


def _unreachable(ranks: list[RankView]) -> dict[str, Any]:
    return {str(r.rank): {"url": r.url, "reason": r.reason, "error": r.error,
                          "refused": _refused(r), "sweeps": r.failures,
                          "since": r.unreachable_since} for r in ranks}


def _commits(st: Mapping[str, Any]) -> int:
    """The rank's ``commits`` (its ``step`` where it counts none: torch's debug server): a heal
    moves the step with no commit."""
    c = st.get("commits")
    return c if type(c) is int else st.get("step") or 0


def _kept_mark(st: Mapping[str, Any], done: int) -> float:
    """The mark of a rank down since before this monitor started: the last run's, else its own
    last commits (maybe older than its death: a late finding, never a false one), else HOLD."""
    m = st.get(DOWN_AT)
    m = m if type(m) is int else st.get("commits")
    return min(done, m) if type(m) is int else HOLD


def _refused(r: RankView) -> bool:
    """Its last poll's connection was refused: its host is up, nothing listens on the port."""
    e = r.error or ""
    return r.reason == "connection" and (e.startswith("ConnectionRefusedError")
                                         or _ALL_REFUSED.fullmatch(e) is not None)


def _heard_since(lh: LighthouseStatus | None, rid: str | None, ranks: list[RankView],
                 now: float) -> bool:
    """The Lighthouse still hears ``rid`` and heard it after the monitor lost ``ranks``: its
    Manager lives and only the monitor misses them (a crash's last heartbeat comes before)."""
    return lh is not None and bool(rid) and bool(ranks) and lh.heartbeating(rid) \
        and lh.heartbeats[rid] < now - max(r.unreachable_since or now for r in ranks)


def _process(r: RankView) -> tuple:
    return r.state.get("pid"), r.state.get("started_at")


class Liveness(StuckStarting):
    def __init__(self, cfg: DetectorConfig, findings: Findings) -> None:
        super().__init__(cfg, findings)
        self._last: dict[int, GroupView] = {}  # group -> its last view, kept while it is away
        self._down: set[int] = set()  # groups last seen with a rank down
        # url of a rank down -> its Manager's commits then (HOLD: unknown); kept in --state
        self.down_at: dict[str, float] = {}
        self._saves = SaveClock(cfg.checkpoint_timeout_s)  # by url, noted as _held judges
        self._ended: dict[int, dict[str, set[str]]] = {}  # group -> ended replica id -> peers down
        self._replaced: dict[int, set[str]] = {}  # group -> earlier incarnations judged
        self._left: dict[int, dict[str, RankView]] = {}  # group -> url -> an earlier one's view
        self._stepped: dict[int, tuple[int, float]] = {}  # group -> its Manager's step, since
        self._unheard: dict[tuple[int, str], tuple[set[str], bool]] = {}  # (group, replica id)
        # -> never verified ranks down when its stop was read (crashed), and whether found
        self._unsure: set[Any] = set()  # why a dead was held last sweep: said once while it lasts

    def _mark(self, r: RankView, done: int) -> float:
        """The commits ``r`` went down at: this run's mark, else, never heard by this run (its
        state from --state), the kept one, else ``done``."""
        if r.url in self.down_at:
            return self.down_at[r.url]
        return _kept_mark(r.state, done) if r.answered_at is None and r.state else done

    def dead(self, view: ClusterView, now: float, evicted: Container[str] = (),
             full: ClusterView | None = None, cut_off: bool = False,
             lighthouse: LighthouseStatus | None = None) -> list[Finding]:
        """``view``: the evidence; ``full``: every rank polled (its never verified ones judged on a
        verified peer's stop notice only). A group out of reach is not ``dead`` while ``cut_off``
        unless its hosts refused, nor while ``lighthouse`` hears its replica id since."""
        findings, new = self.findings, []
        unsure, self._unsure = self._unsure, set()
        open_dead = findings.groups(*DEAD_KINDS)
        last = self._last
        changed = [g for g, gv in view.groups.items() if last.get(g) is not gv]
        # a rank answering again lived: a later crash is measured from then
        for url in [u for u in self.down_at if u not in view.ranks or view.ranks[u].reachable]:
            del self.down_at[url]
        # an unchanged group with no rank down and nothing open has nothing new
        for g in sorted(self._down.union(changed, open_dead, self._left)):
            gv = view.groups.get(g)
            if g in open_dead and full is not None:
                self._lived(full.groups.get(g), now, lighthouse)
            if gv is None:  # away (its newcomers not verified yet): what was found stays found
                self._replaced.setdefault(g, set()).update(
                    k[2] for k in findings.open if k[0] in DEAD_KINDS and k[1] == g)
                continue
            left = self._left_behind(gv, last.get(g))
            last[g] = gv
            if len(gv.reachable) == len(gv.ranks):
                self._down.discard(g)
                self._stepped.pop(g, None)
                if g not in open_dead and not gv.superseded and not left:
                    continue
            else:
                self._down.add(g)
            rid = gv.replica_id
            if rid in evicted:  # its ranks go because the monitor killed them
                for kind in DEAD_KINDS:
                    findings.resolve((kind, g, rid), "evicted", now)
                continue
            # a rank that ended fails its peers' collectives: those of its incarnation down after
            # its stop was read end with it; one down before (a crash torchrun then stopped) is
            # dead, unless the stopping peer's commits grew by more than one since (it lived)
            ended = self._ended.setdefault(g, {})
            ids = {r.replica_id for r in (*gv.ranks, *gv.superseded, *left)}
            for k in [k for k in ended if k not in ids]:
                del ended[k]
            for e in gv.ranks:
                if e.state and e.state.get("finished") is True and e.replica_id is not None \
                        and e.replica_id not in ended:
                    at = _commits(e.state)
                    ended[e.replica_id] = {r.url for r in gv.ranks if r.failures > e.failures
                                           and at <= self._mark(r, at) + 1}
                    self._note_unheard(gv, e, full)
            if rid is not None:
                # what was dead of an earlier incarnation is over (one found now, next sweep:
                # open for one sweep, the goodput ledger counts its cost)
                found = self._replaced_early(gv, rid, ended, ids, evicted, now, left)
                if found:  # the new incarnation is judged from the next sweep on
                    new += found
                    continue
                for key in [k for k in findings.open if k[0] in DEAD_KINDS and k[1] == g
                            and k[2] not in (None, rid)]:
                    findings.resolve(key, "replaced", now)
            # a rank of an earlier incarnation is not this incarnation's loss
            down = [r for r in gv.ranks if not r.reachable and not r.superseded
                    and not r.ended and r.failures >= self.cfg.dead_sweeps
                    and (rid is None or r.replica_id in (None, rid))
                    and r.url in ended.get(r.replica_id, (r.url,))]
            manager_up = [r for r in gv.reachable if r.state.get("group_rank") == 0
                          and r.replica_id == rid and rid is not None]
            # torchft commits a step only with every rank of the group: one the group committed
            # past since it stopped answering lives (a later death is missed, never a false kill)
            top = max((m.state.get("step") or 0 for m in manager_up), default=None)
            if top is None:
                self._stepped.pop(g, None)
            else:
                if self._stepped.get(g, (None,))[0] != top:
                    self._stepped[g] = (top, now)
                done = max(_commits(m.state) for m in manager_up)
                for r in gv.ranks:
                    if not r.reachable and r.url not in self.down_at:
                        self.down_at[r.url] = self._mark(r, done)
                down = [r for r in down if done <= self.down_at.get(r.url, done) + 1]
            lost = [r for r in down if r.replica_id == rid and r.state
                    and r.state.get("group_rank") != 0]
            if manager_up and lost:
                held = self._held(gv, view, lost, now)
                if held is None:
                    f = findings.open.get(("dead_rank", g, rid))
                    if f is None:  # pending: nothing shows the group waits for them yet
                        continue
                    held = f.evidence.get("held")
                findings.resolve(("dead", g, rid), "rank_dead_in_live_group", now)
                ranks = sorted(r.rank for r in lost if r.rank is not None)
                ev = {"summary": f"rank(s) {ranks} unreachable for {self.cfg.dead_sweeps}+ sweeps "
                                 f"while the group's Manager (rank {manager_up[0].rank}) still "
                                 "heartbeats",
                      "unreachable": _unreachable(lost),
                      "alive": sorted(r.rank for r in gv.reachable if r.rank is not None),
                      "manager_rank": manager_up[0].rank, "held": held,
                      "why": "the group's Manager (group rank 0) still heartbeats, so torchft "
                             "keeps the group in the quorum and every group waits for these "
                             "ranks until its timeouts"}
                new.append(findings.confirm("dead_rank", gv, ranks, ev,
                                            min(r.unreachable_since or now for r in lost), now,
                                            view))
                continue
            # a host that refused the connection was reached: its ranks' processes are gone;
            # while cut off, a Lighthouse hearing one missed group may be on the monitor's side
            pending = "cut_off" if cut_off and not all(map(_refused, down)) \
                else rid if _heard_since(lighthouse, rid, down, now) else None
            if down and pending:  # said once while it lasts
                if pending not in unsure | self._unsure:
                    log.info("not confirming dead: %s", "the monitor may be the one cut off "
                             "(it reaches no group, or is blind)" if pending == "cut_off" else
                             f"replica group {g} is out of reach, but the Lighthouse hears {rid}")
                self._unsure.add(pending)
                continue
            findings.resolve_where("group_dead" if down else "reachable", now, ("dead_rank",), g)
            if not down:
                if any(k[0] == g for k in self._unheard):  # found below, from the full view
                    continue
                findings.resolve_where(
                    "finished" if any(r.ended for r in gv.ranks) else "reachable", now, ("dead",), g)
                continue
            # a peer that said it stopped (torchrun SIGTERMs them) is forgotten: the size it said
            size = max([len(gv.ranks)] + [ws for r in gv.ranks if isinstance(
                ws := (r.state or {}).get("group_world_size"), int)])
            ev = {"summary": f"{len(down)} of the group's {size} rank(s) unreachable "
                             f"for {self.cfg.dead_sweeps}+ sweeps",
                  "unreachable": _unreachable(down), "group_ranks_unreachable": len(down),
                  "group_ranks": size}
            new.append(findings.confirm(
                "dead", gv, sorted({r.rank for r in down if r.rank is not None}), ev,
                min(r.unreachable_since or now for r in down), now, view))
        new += self._judge_unheard(full, now, evicted)
        return [f for f in new if f]

    def _lived(self, gv: GroupView | None, now: float,
               lighthouse: LighthouseStatus | None) -> None:
        """A ``dead`` is over once its ranks in ``gv`` (every rank polled, verified or not) answer
        with its replica id, all or group rank 0, unless the Lighthouse lists that id stopped."""
        if gv is None or not gv.ranks:
            return
        for key in [k for k in self.findings.open if k[0] == "dead" and k[1] == gv.replica_group]:
            rid = key[2]
            answering = [r for r in gv.reachable if r.replica_id == rid]
            if not answering or (lighthouse is not None and rid in lighthouse.stale):
                continue
            if len(answering) == len(gv.ranks) or any(
                    (r.state or {}).get("group_rank") == 0 for r in answering):
                self.findings.resolve(key, "reachable", now)

    def _note_unheard(self, gv: GroupView, e: RankView, full: ClusterView | None) -> None:
        """A never verified rank in a group rank no verified rank of ``e``'s incarnation holds,
        down at most ``--dead-sweeps`` sweeps when ``e``'s stop was read, crashed: the launcher
        stopped ``e`` (torchrun stops a crashed worker's peers within seconds)."""
        fg = full.groups.get(gv.replica_group) if full is not None else None
        rid, ws = e.replica_id, e.state.get("group_world_size")
        mine = [r for r in gv.ranks if r.replica_id == rid]
        held = {r.state.get("group_rank") for r in mine}
        # its claims are unverified: a slot of the group, on a host of the incarnation (the
        # launcher that stopped the peer runs there), one claimant a slot
        hosts = {r.state.get("host") for r in mine} - {None}
        slots: dict[int, list[str]] = {}
        for r in fg.ranks if fg is not None and isinstance(ws, int) else ():
            gr = r.state.get("group_rank") if r.state else None
            if r.state and not r.reachable and not r.ended \
                    and 0 < r.failures - e.failures <= self.cfg.dead_sweeps \
                    and not (r.trust is not None and r.trust.evidence) \
                    and r.replica_id in (None, rid) and r.state.get("group_world_size") == ws \
                    and isinstance(gr, int) and 0 <= gr < ws and gr not in held \
                    and r.state.get("host") in hosts:
                slots.setdefault(gr, []).append(r.url)
        urls = {u[0] for u in slots.values() if len(u) == 1}
        if urls:
            self._unheard[(gv.replica_group, rid)] = (urls, False)

    def _judge_unheard(self, full: ClusterView | None, now: float,
                       evicted: Container[str]) -> list[Finding]:
        """``dead`` for the ranks :meth:`_note_unheard` kept, once down ``--dead-sweeps`` sweeps;
        none once one answers again or another is open (kept while the one found is open)."""
        out = []
        for key, (urls, found) in list(self._unheard.items()) if full is not None else ():
            g, rid = key
            ranks = [full.ranks.get(u) for u in urls]
            gv, is_open = full.groups.get(g), ("dead", g, rid) in self.findings.open
            if found or is_open or rid in evicted or gv is None \
                    or any(r is None or r.reachable for r in ranks):
                if not (found and is_open):
                    del self._unheard[key]
                continue
            if min(r.failures for r in ranks) < self.cfg.dead_sweeps:
                continue
            self._unheard[key] = (urls, True)
            numbers = sorted(r.rank for r in ranks if r.rank is not None)
            ev = {"summary": f"rank(s) {numbers}, never verified, went down unsaid before a "
                             f"peer of {rid} said it was stopped",
                  "unreachable": _unreachable(ranks)}
            out.append(self.findings.confirm(
                "dead", gv, numbers, ev, min(r.unreachable_since or now for r in ranks), now,
                SimpleNamespace(rank_view={r.rank: r for r in ranks}.get), replica_id=rid))
        return out

    def _held(self, gv: GroupView, view: ClusterView, lost: list[RankView],
              now: float) -> dict[str, Any] | None:
        """What shows the group waits for its ``lost`` ranks, or None: a live rank blocked in a
        collective for a median step, or its Manager's step unchanged for ``--hang-factor`` median
        steps since they went down (a save under --checkpoint-timeout restarts that clock)."""
        med = gv.median_step_seconds() or view.median_step_seconds()
        rid = gv.replica_id
        blocked = {}
        for r in gv.reachable:  # a wait carried from an older poll is not a wait now
            if r.fresh and r.replica_id == rid and r.rank is not None:
                scope, secs = collective_wait(r.state)
                if scope is not None and secs >= (med or self.cfg.hang_floor_s):
                    blocked[str(r.rank)] = {"scope": scope, "seconds": round(secs, 3),
                                            "phase": r.state.get("phase")}
        if blocked:
            return {"blocked": blocked, "median_step_s": med}
        g = gv.replica_group
        step, at = self._stepped[g]
        if (held := self._saves.note(gv, now)) and held[1]:
            self._stepped[g] = (step, now)  # a save commits nothing on purpose
            return None
        since = max(at, min(r.unreachable_since or now for r in lost))
        threshold = self.cfg.hang_factor * med if med else self.cfg.hang_floor_s
        if now - since >= threshold:
            return {"step": step, "stalled_s": round(now - since, 3),
                    "threshold_s": round(threshold, 3), "median_step_s": med}
        return None

    def _left_behind(self, gv: GroupView, last: GroupView | None) -> list[RankView]:
        """The earlier incarnations' last views at addresses another process answers at now (a
        fixed worker port), kept from the last sweep that showed them until judged."""
        g = gv.replica_group
        left = self._left.pop(g, {})
        scan = last is not None and last is not gv and (
            last.replica_id != gv.replica_id or len(last.reachable) < len(last.ranks)
            or len(gv.ranks) < len(last.ranks))
        if not scan and not left:
            return []
        at = {r.url: r for r in (*gv.ranks, *gv.superseded)}
        for p in last.ranks if scan else ():  # not in this view: its newcomer is not verified yet
            r = at.get(p.url)
            if p.replica_id and (r is None or r.reachable and r.replica_id != p.replica_id):
                left.setdefault(p.url, p)
        out = []
        for url, p in list(left.items()):
            r = at.get(url)
            if r is not None and (r.superseded or r.reachable and _process(r) == _process(p)):
                del left[url]  # judged where its rank runs now, or answering again
            elif r is not None and r.reachable:
                out.append(p)
        if left:
            self._left[g] = left
        return out

    def _replaced_early(self, gv: GroupView, rid: str, ended: Mapping[str, set[str]],
                        ids: set[Any], evicted: Container[str], now: float,
                        left: list[RankView]) -> list[Finding]:
        """An earlier incarnation replaced before its lost ranks were down ``--dead-sweeps``
        sweeps (restarted at once): a rank of it that went down unsaid is dead."""
        g = gv.replica_group
        judged = self._replaced.setdefault(g, set())
        judged.intersection_update(ids)
        lost: dict[str, list[RankView]] = {}
        # a process restarted at its address waits until its incarnation answers nowhere
        live = {rid, *gv.reported_replica_ids}
        kept = self._left.get(g, {})
        behind = [kept.pop(p.url) for p in left if p.replica_id not in live]
        gone = [r for r in (*gv.ranks, *gv.superseded) if not r.reachable and r.failures >= 1]
        for r in (*gone, *behind):
            old = r.replica_id
            if old not in (None, rid) and old not in judged and old not in evicted \
                    and r.state.get("finished") is not True \
                    and r.url in ended.get(old, (r.url,)):
                lost.setdefault(old, []).append(r)
        out = []
        for old, ranks in lost.items():
            judged.add(old)
            if any(k[0] in DEAD_KINDS and k[1] == gv.replica_group and k[2] == old
                   for k in self.findings.open):
                continue
            ev = {"summary": f"{len(ranks)} rank(s) of the earlier incarnation {old} went down "
                             f"unsaid before {rid} replaced it",
                  "unreachable": _unreachable(ranks), "replaced_by": rid}
            out.append(self.findings.confirm(
                "dead", gv, sorted({r.rank for r in ranks if r.rank is not None}), ev,
                min(r.unreachable_since or now for r in ranks), now,
                # the culprits as last seen: the view's ranks of their numbers replaced them
                SimpleNamespace(rank_view={r.rank: r for r in ranks}.get), replica_id=old))
        return out
