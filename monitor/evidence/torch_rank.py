"""A torch-only rank (torch's debug server, no Lightkeeper code) made a ``/v1/state`` document
at the poll boundary, so everything downstream reads it like any rank: who it is from its
group's TCPStore, step and quorum from the Lighthouse (its last read), the collective it is
blocked in from its Flight Recorder dump. What it cannot show is :data:`CANNOT_SHOW`. Nothing
here raises because of what a rank answered.
"""

from __future__ import annotations

import bisect
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from monitor.poll.poller import RankPoll
from monitor.poll.torch_server import (
    RAW_KEY,
    STACKS_HANDLER,
    StoreReader,
    TorchAnswer,
    TorchIdentity,
    replica_group_of,
)
from monitor.poll.torch_target import base_url, is_torch
from rank_wire import recorders
from rank_wire.recorders import is_torchft_pg_name

from .lighthouse_status import LighthouseStatus

log = logging.getLogger(__name__)

CANNOT_SHOW = ("step phase (forward, backward, commit: only whether it is blocked in a "
               "collective)", "compute/wait split of a step (stragglers from the Flight "
               "Recorder only)", "step times", "commit counts",
               "its own step (the Lighthouse's, per quorum request)")
# Flight Recorder entries a look reads of each rank: 4x the 64 that give the same verdicts as
# whole dumps (tests/test_monitor_fr_filter.py)
FR_LAST = 256
STEP_PACES = 16
# paces of incarnations absent from the Lighthouse's quorum kept beyond twice its members
PACES_KEPT = 1024
# the timed groups' step times saved (--state) at most this often, unless a group was timed
PACES_SAVED_EVERY_S = 60.0


def _int(v: Any) -> int | None:
    try:
        return int(v) if not isinstance(v, bool) else None
    except (TypeError, ValueError):
        return None


def combined(raw: TorchAnswer) -> Mapping[str, Any] | None:
    """One dump of a rank's two Flight Recorders, the generic one and NCCL's (CUDA builds), as
    rank_wire.recorders merges them; None when neither recorder answered a dict."""
    if isinstance(raw.nccl, Mapping) and isinstance(raw.nccl.get("entries"), list):
        return recorders.merge(raw.dump if isinstance(raw.dump, Mapping) else None, raw.nccl)
    return raw.dump if isinstance(raw.dump, Mapping) else None


class _Pg(NamedTuple):
    """A process group as one dump shows it: its name, last completed and enqueued sequence
    ids (pg_status), its entries and the span of their enqueue times (ns)."""
    name: str | None
    done: int
    enqueued: int
    entries: list[Mapping]
    first_ns: int
    last_ns: int


def _created(e: Mapping) -> int | None:
    t = e.get("time_created_ns")
    return t if isinstance(t, int) and not isinstance(t, bool) and t > 0 else None


def _groups(dump: Mapping[str, Any]) -> dict[int, _Pg]:
    """pg_id -> :class:`_Pg` of each group a wait is read in: every one but torchft's older
    incarnations, with a pg_status and an entry (or the dump says too little: empty)."""
    entries, status = dump.get("entries"), dump.get("pg_status")
    if not isinstance(entries, list) or not isinstance(status, Mapping):
        return {}
    newest_ft = max((p for e in entries if isinstance(e, Mapping)
                     and is_torchft_pg_name(recorders.pg_name(e))
                     and (p := _int(e.get("pg_id"))) is not None), default=None)
    by_pg: dict[int, list[Mapping]] = {}
    for e in entries:
        if isinstance(e, Mapping) and (pg_id := _int(e.get("pg_id"))) is not None and \
                (pg_id == newest_ft or not is_torchft_pg_name(recorders.pg_name(e))):
            by_pg.setdefault(pg_id, []).append(e)
    out = {}
    for key, st in status.items():
        pg_id, es = _int(key), by_pg.get(_int(key))  # type: ignore[arg-type]
        if not isinstance(st, Mapping) or pg_id is None or not es:
            continue
        done, enq = _int(st.get("last_completed_collective")), \
            _int(st.get("last_enqueued_collective"))
        times = [t for e in es if (t := _created(e)) is not None]
        if done is not None and enq is not None and times:
            done, enq = _gloo_counts(es, done, enq)
            out[pg_id] = _Pg(recorders.pg_name(es[0]), done, enq, es, min(times), max(times))
    return out


def _gloo_counts(entries: list[Mapping], done: int, enq: int) -> tuple[int, int]:
    """A gloo group's pg_status counts as its entries' sequence ids. gloo counts its send/recv
    there too (a PGTransport heal's, on torchft's group), and records no entry of them: past
    one, the counts ran ahead of every entry, and every rank read as blocked in nothing. The
    last entry is the last enqueued; a completed one before it the newest it can be (gloo
    marks one completed when it enqueues the next; the heal's send/recv wait complete)."""
    last = max((s for e in entries if not e.get("is_p2p")
                and str(e.get("profiling_name", "")).startswith("gloo:")
                and (s := _int(e.get("collective_seq_id"))) is not None), default=None)
    if last is None or enq <= last:
        return done, enq
    ahead = enq - last  # the send/recv counted before the last entry
    return (done - ahead if done >= enq else max(done - ahead, min(done, last - 1))), last


def blocked_in(dump: Mapping[str, Any], now: float,
               past: Mapping[int, tuple[int, int]] | None = None
               ) -> tuple[str, float, Mapping] | None:
    """(scope, seconds, entry) of the oldest collective enqueued and not completed, of every
    group but torchft's older incarnations; None when none (or the dump says too little).
    ``past``: pg_id -> (the furthest sequence id another member of that group completed, the
    furthest it enqueued). gloo's recorder marks a step's last collective completed only once
    the rank enqueues its next one, so the rank's own word is not enough: a collective
    completes for every member together, so one that another member completed, or enqueued a
    later one past, is not what the rank is blocked in."""
    oldest = None
    for pg_id, pg in _groups(dump).items():
        gone, ahead = (past or {}).get(pg_id, (-1, -1))
        first = max(pg.done, gone, ahead - 1) + 1  # the first it may still be blocked in
        # ...the lowest one recorded from there: a new group's sequence ids start at 1 where
        # its last completed reads -1
        seq = min((s for e in pg.entries if not e.get("is_p2p")
                   and (s := _int(e.get("collective_seq_id"))) is not None
                   and first <= s <= pg.enqueued), default=None)
        if seq is None:
            continue
        for e in pg.entries:
            if _int(e.get("collective_seq_id")) != seq or e.get("is_p2p"):
                continue
            created = _created(e)
            if created is not None and (oldest is None or created < oldest[0]):
                oldest = (created, "cross" if is_torchft_pg_name(pg.name) else "group", e)
    if oldest is None:
        return None
    secs = now - oldest[0] / 1e9
    return oldest[1], max(0.0, secs) if math.isfinite(secs) else 0.0, oldest[2]


def peers_past(groups: Mapping[str, tuple[TorchIdentity, int | None, Mapping[int, _Pg]]]
               ) -> dict[str, dict[int, tuple[int, int]]]:
    """URL -> :func:`blocked_in`'s ``past`` of each rank, from the others' dumps of a sweep
    (``groups``: URL -> (whose, the Lighthouse quorum it takes part in or None, :func:`_groups`
    of its dump)). Members of one group: torchft's newest incarnation of the same group rank
    and name, of ranks in the same quorum (gloo's are all named ''), or an in-group one of the
    same name in the same replica group. A rank is judged by the members with an entry since
    its own first: one whose entries all predate it is of an older incarnation (it has not
    enqueued in its new one yet), whose sequence ids say nothing of this one's. Hosts' clocks
    are taken to agree within the time since the rank's first entry: early in an incarnation,
    about a step (a rank hung there, on a host behind by more, reads blocked: a job_stall)."""
    members: dict[tuple, list[tuple[str, int, _Pg]]] = {}
    for url, (who, quorum, pgs) in groups.items():
        for pg_id, pg in pgs.items():
            if not is_torchft_pg_name(pg.name):
                members.setdefault(("group", who.replica_id, pg.name), []).append(
                    (url, pg_id, pg))
            elif quorum is not None:
                members.setdefault(("cross", quorum, who.group_rank, pg.name), []).append(
                    (url, pg_id, pg))
    out: dict[str, dict[int, tuple[int, int]]] = {}
    for group in members.values():
        group.sort(key=lambda m: m[2].last_ns)
        lasts = [pg.last_ns for _, _, pg in group]
        # the two highest (completed, enqueued) of each suffix of the members by newest entry
        tops: list[tuple[list, list]] = [([], [])] * (len(group) + 1)
        for i in range(len(group) - 1, -1, -1):
            url, _, pg = group[i]
            done, enq = tops[i + 1]
            tops[i] = (sorted([*done, (pg.done, url)], reverse=True)[:2],
                       sorted([*enq, (pg.enqueued, url)], reverse=True)[:2])
        for url, pg_id, pg in group:
            done, enq = tops[bisect.bisect_left(lasts, pg.first_ns)]
            others = (next((v for v, u in done if u != url), None),
                      next((v for v, u in enq if u != url), None))
            if None not in others:
                out.setdefault(url, {})[pg_id] = others  # type: ignore[assignment]
    return out


def torch_state(url: str, who: TorchIdentity, raw: TorchAnswer,
                lighthouse: LighthouseStatus | None, now: float, job: str,
                past: Mapping[int, tuple[int, int]] | None = None,
                step_s: float | None = None, timed: bool = True) -> dict[str, Any]:
    """The ``/v1/state`` document of a torch-only rank's answer (``past``: as
    :func:`blocked_in`'s; ``timed``: :meth:`StepPace.timed`)."""
    member = lighthouse.members.get(who.replica_id) if lighthouse is not None else None
    dump = combined(raw)
    blocked = blocked_in(dump, now, past) if dump is not None else None
    waiting = None
    phase, since = "unknown", now
    if blocked is not None:
        scope, secs, _ = blocked
        waiting = {"scope": scope, "seconds": round(secs, 3)}
        since = now - secs
        phase = "allreduce" if scope == "cross" else "collective"
    host = base_url(url).split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    handlers = raw.handlers
    return {
        "job": job, "replica_group": who.replica_group, "replica_id": who.replica_id,
        "group_rank": who.group_rank, "group_world_size": who.group_world_size,
        "rank": who.rank, "host": host, "node": host, "device": {"type": "unknown"},
        "step": member.step if member is not None else -1,
        "quorum_id": lighthouse.quorum_id if member is not None and
        lighthouse.quorum_id is not None else -1,
        "num_participants": len(lighthouse.members) if member is not None else 0,
        "participating": member is not None, "phase": phase, "phase_since": since,
        "last_step_seconds": None, "recent_step_seconds": b"",
        "timing": {"last_step": None, "window": None, "waiting": waiting, "recent": b""},
        "torch_only": {"store": who.store, "handlers": [h for h in handlers
                                                        if isinstance(h, str)][:64],
                       "flight_recorder": "; ".join(filter(None, (
                           f"{len(dump.get('entries') or [])} entries" if dump else None,
                           raw.error))) or "none",
                       "cannot_show": list(CANNOT_SHOW),
                       "step_s": None if step_s is None else round(step_s, 4),
                       "timed": timed},
        "stacks_url": f"{base_url(url)}/handler/{STACKS_HANDLER}"
        if STACKS_HANDLER in handlers else None,
    }


def adapted_dump(dump: Mapping[str, Any], state: Mapping[str, Any],
                 lighthouse: LighthouseStatus | None, at: float) -> dict[str, Any]:
    """torch's dump as the analysis reads a rank's ``/v1/fr_trace``: its identity added,
    torchft's older incarnations left out, the newest described when the Lighthouse lists the
    rank's group in its quorum."""
    entries = [e for e in dump.get("entries") or [] if isinstance(e, Mapping)]
    ft = [e for e in entries
          if is_torchft_pg_name(recorders.pg_name(e)) and _int(e.get("pg_id")) is not None]
    newest = max((_int(e["pg_id"]) for e in ft), default=None)
    out = {k: v for k, v in dump.items() if k not in ("entries", "pg_config")}
    kept = [e for e in entries if not is_torchft_pg_name(recorders.pg_name(e))
            or _int(e.get("pg_id")) == newest]
    out["entries"] = kept[-FR_LAST:]
    # said as the WorkerServer's ?last= says it: torch's handler gave a whole dump, not an
    # onlyActive one, which the analysis could not tell from one cut here to unfinished entries
    config = dump.get("pg_config")
    # that its recorder listed a group (was on), said before gloo's only one ('') is dropped below
    out["filter"] = {"pg": None, "last": FR_LAST, "entries_total": len(kept), "only_active": False,
                     "pg_listed": bool(config)}
    out["pg_config"] = {k: v for k, v in config.items() if not is_torchft_pg_name(str(k))} \
        if isinstance(config, Mapping) else {}
    g, gr, ws = state["replica_group"], state["group_rank"], state["group_world_size"]
    out.update(rank=state["rank"], replica_group=g, replica_id=state.get("replica_id"),
               group_rank=gr, group_world_size=ws, host=state.get("host"),
               dump_time_ns=int(at * 1e9), incarnations=[])
    q = state.get("quorum_id")
    if newest is None or lighthouse is None or not state.get("participating") \
            or q != lighthouse.quorum_id:
        return out
    order = sorted(lighthouse.members)
    groups = [replica_group_of(rid) for rid in order]
    if None in groups or state.get("replica_id") not in order:
        return out
    mine = [e for e in ft if _int(e["pg_id"]) == newest]
    out["incarnations"] = [{
        "pg_id": newest, "pg_name": recorders.pg_name(mine[0]) or "", "quorum_id": q,
        "group_rank": gr,
        "replica_rank": order.index(state["replica_id"]), "replica_world_size": len(order),
        "global_ranks": [m * lighthouse.members[rid].world_size + gr
                         for m, rid in zip(groups, order, strict=True)],
        "first_record_id": min(_int(e.get("record_id")) or 0 for e in mine)}]
    return out


class StepPace:
    """A group's step time where its ranks serve none: the Lighthouse's step counter of its
    Manager, over the sweeps that saw it move (the time between the first sweeps that saw two
    moves, over the steps between them; the median of the newest STEP_PACES). Without it a
    torch-only job's hang threshold was --hang-floor alone: a group 3 s late in a job of 10-s
    steps was evicted as hung."""

    def __init__(self, joined_at: int | None = None) -> None:
        self.step: int | None = None
        self.at: float | None = None  # when a sweep first saw the step move to self.step
        self.times: deque[float] = deque(maxlen=STEP_PACES)
        # the job's step when the monitor first saw the group (None: timed from the start)
        self.joined_at = joined_at

    def timed(self) -> bool:
        """It committed two steps past the job's step when the monitor first saw it (its heal's,
        then one): a new incarnation's first step compiles (held to --starting-timeout, as
        Lightkeeper's ranks are until they time a step past their heal's). Neither the
        Lighthouse's step nor a dump tells one that trained before the monitor looked from one
        resumed at its checkpoint's step, or mid-way through its first step's collectives."""
        return self.joined_at is None or (self.step or 0) >= self.joined_at + 2

    def see(self, step: int, now: float) -> None:
        if self.step is None or step == self.step:
            self.step = step  # first seen mid-step (a monitor started), or not moved
            return
        # a first move is no step: from a sweep mid-step, or a restarted group's heal (its
        # step jumps from 0 to the others')
        if self.at is not None and step > self.step and now > self.at:
            self.times.append((now - self.at) / (step - self.step))
        self.step, self.at = step, now  # moved, or its Manager went back (a heal)

    def seconds(self) -> float | None:
        return statistics.median(self.times) if self.times else None


class TorchRanks:
    """Each sweep's torch-only answers made rank states (:meth:`adapt`), and their dumps;
    ``stores`` (--torch-stores) finds them in their groups' TCPStores."""

    def __init__(self, job: str, stores: StoreReader | None = None,
                 timed: Mapping[str, Iterable[float]] | None = None) -> None:
        self.job, self.stores = job, stores
        self.dumps: dict[str, dict[str, Any]] = {}  # URL -> adapted dump of its last answer
        # the last status read: while the Lighthouse is unreadable, "no quorum" would make
        # stuck_starting find every group and the job-wide detectors lose them
        self._known: LighthouseStatus | None = None
        self._paces: dict[str, StepPace] = {}  # replica id -> its step time, as sweeps see it
        # groups a monitor run before timed (--state): a replica id is one incarnation (torchft
        # adds a uuid), so one seen again has trained and is not held as on its first step
        for rid, times in (timed or {}).items():
            self._paces[rid] = StepPace()
            self._paces[rid].times.extend(times)
        self._saved = {r: list(p.times) for r, p in self._paces.items()}
        self._saved_at, self._save_failed = -math.inf, False

    def save_paces(self, now: float, save: Callable[[dict[str, list[float]]], None]) -> None:
        """``save`` the timed groups' step times (replica id -> times) when a group was timed or
        left since the last save, or they changed and PACES_SAVED_EVERY_S passed. A save that
        raised is tried again PACES_SAVED_EVERY_S later (raising again)."""
        paces = {r: list(p.times) for r, p in self._paces.items() if p.timed()}
        soon = now - self._saved_at < PACES_SAVED_EVERY_S
        if paces == self._saved or soon and (self._save_failed or
                                              paces.keys() == self._saved.keys()):
            return
        self._saved_at, self._save_failed = now, True
        save(paces)
        self._saved, self._save_failed = paces, False

    def sweep(self, polls: dict[str, RankPoll], lighthouse: LighthouseStatus | None,
              now: float) -> dict[str, tuple[int, int]] | None:
        """The groups' stores read for new ranks (returned: next sweep's targets, URL ->
        (replica group, rank); None when not read), this sweep's answers made rank states."""
        found = None
        if self.stores is not None and lighthouse is not None:
            found = {u: (i.replica_group, i.rank) for u, i in self.stores.read(
                [(m.replica_id, m.store, m.world_size) for m in lighthouse.members.values()],
                now, failed=[u for u, p in polls.items() if not p.ok]).items()}
        # their enqueue times are on their wall clocks: judged by this host's, not the monitor's
        self.adapt(polls, self.stores.identities() if self.stores is not None else {},
                   lighthouse, time.time())
        return found

    def adapt(self, polls: dict[str, RankPoll], identities: Mapping[str, TorchIdentity],
              lighthouse: LighthouseStatus | None, now: float) -> None:
        """Replace, in ``polls``, each torch-only answer by its rank state (or a failed poll
        saying why it cannot be one). ``lighthouse`` None: unreadable this sweep."""
        dumps: dict[str, dict[str, Any]] = {}
        if lighthouse is not None:
            last, self._known = self._known, lighthouse  # the last status read
            # a group new to the monitor, also on its first read, joins at the job's step (a
            # replacement heals to it, a resumed job asks its first quorum at it)
            job_step = max((m.step for m in lighthouse.members.values()), default=0)
            for rid, m in lighthouse.members.items():
                pace = self._paces.pop(rid, None) or StepPace(job_step)
                self._paces[rid] = pace  # newest seen last
                if last is not None and rid not in last.members:
                    pace.at = None  # back in a quorum: its heal's jump is no step time
                pace.see(m.step, now)
            # a group left out of a quorum, or every group while a restarted Lighthouse has
            # none, comes back the same incarnation: its pace is kept a while (not new again)
            for rid in list(self._paces)[:max(0, len(self._paces) - 2 * len(lighthouse.members)
                                            - PACES_KEPT)]:
                del self._paces[rid]
        known, read = self._known, {}
        for url, p in list(polls.items()):
            raw = p.data.get(RAW_KEY) if p.ok and is_torch(url) else None
            if not isinstance(raw, TorchAnswer):  # a full state (lightkeeper_state), or none
                continue
            who = identities.get(url)
            if who is None:
                polls[url] = RankPoll(url, False, reason="bad_response", error=(
                    "torch's debug server answers, but whose rank it is is unknown: "
                    "--torch-stores reads it from its group's TCPStore"),
                    latency_s=p.latency_s, at=p.at)
                continue
            try:
                dump = combined(raw)
                quorum = known.quorum_id if known is not None and \
                    who.replica_id in known.members else None
                read[url] = (who, TorchAnswer(raw.handlers, dump, raw.error),  # combined once
                             quorum, _groups(dump) if dump is not None else {})
            except Exception as e:  # a dump of an unexpected shape: said, the rank kept
                self._unread(polls, url, e)
        # a rank's wait judged by its group's other members too: all their dumps are here
        past = peers_past({u: (who, q, pgs) for u, (who, _, q, pgs) in read.items()})
        for url, (who, raw, _, _) in read.items():
            p = polls[url]
            try:
                pace = self._paces.get(who.replica_id)
                state = torch_state(url, who, raw, known, now, self.job, past.get(url),
                                    pace.seconds() if pace is not None else None,
                                    pace is None or pace.timed())
                if raw.dump is not None:  # incarnations only of a quorum read now
                    dumps[url] = adapted_dump(raw.dump, state, lighthouse, p.at)
            except Exception as e:
                self._unread(polls, url, e)
                continue
            polls[url] = RankPoll(url, True, state, latency_s=p.latency_s, at=p.at)
        # answers carried from an earlier sweep (leader polling) keep their dump
        self.dumps = {**{u: d for u, d in self.dumps.items()
                         if u not in polls and u in identities}, **dumps}

    @staticmethod
    def _unread(polls: dict[str, RankPoll], url: str, e: Exception) -> None:
        """A dump of an unexpected shape: said, the rank kept (a failed poll saying why)."""
        p = polls[url]
        log.warning("torch-only rank %s: cannot read its answer: %s: %s", url,
                    type(e).__name__, e)
        polls[url] = RankPoll(url, False, reason="bad_response",
                              error=f"torch's answer: {type(e).__name__}: {e}",
                              latency_s=p.latency_s, at=p.at)


def add_stacks(new: list, stacks: Callable[[Iterable[str]], dict[str, str]]) -> None:
    """A new finding's culprits on torch's debug server: their stacks read now (``stacks``), into
    its evidence (an eviction ends the process, and its stacks with it)."""
    culprits = [c for f in new for c in f.evidence.get("culprits") or []
                if is_torch(c.get("url") or "") and (c.get("stacks") or "").startswith("http")]
    if culprits:
        got = stacks(c["stacks"] for c in culprits)
        for c in culprits:
            c["stacks_text"] = got[c["stacks"]]
