"""Whether a rank's claims hold against the Lighthouse and its peers: anyone allowed to register
can claim any identity, so only verified answers are evidence (docs/monitor.md, Verification).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..poll.torch_target import is_torch
from .lighthouse_status import LighthouseStatus
from .rank import RankView

VERIFIED, UNVERIFIED, UNVERIFIABLE = "verified", "unverified", "unverifiable"
REASONS = ("ok", "no_replica_id", "unknown_replica_id", "quorum_ahead", "not_in_quorum",
           "world_size_mismatch", "group_rank_out_of_range", "replica_id_conflict",
           "group_disagrees", "group_rank_taken", "rank_taken", "never_answered",
           "lighthouse_unreadable", "no_lighthouse")


@dataclass(frozen=True)
class Trust:
    """The verdict on one rank; ``evidence``: whether its answers reach the detectors."""

    state: str  # VERIFIED, UNVERIFIED or UNVERIFIABLE
    reason: str  # "ok" or one of REASONS: why not
    detail: str
    evidence: bool
    claims: tuple | None = None  # (replica_id, replica_group, group_rank, world size, rank,
    # pid, started_at): who the rank said it was, the process included
    checked_at: float | None = None
    stale: bool = False  # the rank did not answer this sweep: the verdict of its last answer

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "claims"}


def restored(kept: dict[str, Any] | None, state: dict[str, Any]) -> Trust | None:
    """The verdict an earlier run gave a rank's last answer (Trust.to_dict), as stale."""
    try:
        return Trust(**{**kept, "stale": True}, claims=claims(state)) if kept else None
    except (TypeError, KeyError):  # a file of another version: judged afresh
        return None


def claims(state: dict[str, Any]) -> tuple:
    return (state.get("replica_id"), state["replica_group"], state["group_rank"],
            state.get("group_world_size"), state["rank"], state.get("pid"),
            state.get("started_at"))


def _vouched(rv: RankView, c: tuple) -> bool:
    """Whether the same process, with the same claims, was evidence at its last verdict."""
    prev = rv.trust
    return prev is not None and prev.evidence and prev.claims == c


def as_int(v: Any) -> int | None:
    """``v`` if it is an int (not a bool), else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _check_against_lighthouse(s: dict[str, Any], lh: LighthouseStatus) -> tuple[str, str]:
    """("ok", detail) or (reason, detail) for one rank's claims against the Lighthouse."""
    rid = s.get("replica_id")
    if not isinstance(rid, str) or not rid:
        return "no_replica_id", "reports no replica_id (its torchft Manager may not exist yet)"
    member = lh.members.get(rid)
    if member is None and not lh.heartbeating(rid):
        return "unknown_replica_id", (f"the Lighthouse has no participant or live heartbeat "
                                      f"{rid!r}")
    q, lq = s["quorum_id"], lh.quorum_id
    if q > (lq if lq is not None else 0) or (lq is None and q > 0):
        return "quorum_ahead", f"claims quorum {q}; the Lighthouse's newest is {lq}"
    if lq is not None and q == lq:
        if member is None:
            return "not_in_quorum", f"claims quorum {q}, which does not list {rid!r}"
        n = as_int(s.get("num_participants"))
        if n is not None and n > len(lh.members):
            return "not_in_quorum", (f"claims {n} participants in quorum {q}, which has "
                                     f"{len(lh.members)}")
    ws = as_int(s.get("group_world_size"))
    if ws is None or ws < 1:
        return "world_size_mismatch", f"group_world_size is {s.get('group_world_size')!r}"
    if member is not None and member.world_size != ws:
        return "world_size_mismatch", (f"claims group_world_size {ws}; the Lighthouse lists "
                                       f"{member.world_size} for {rid!r}")
    if not 0 <= s["group_rank"] < ws:
        return "group_rank_out_of_range", f"group_rank {s['group_rank']} of {ws}"
    how = f"participant of quorum {lq}" if member is not None else "heartbeating"
    return "ok", f"{rid} is known to the Lighthouse ({how})"


def verify_ranks(ranks: Mapping[str, RankView], lighthouse: LighthouseStatus | None,
                 error: str | None, configured: bool, now: float) -> dict[str, Trust]:
    """The verdict on each of ``ranks`` by URL (``rv.trust``: the previous one); every rank a
    check involves must be among them."""
    out: dict[str, Trust] = {}
    live: list[RankView] = []
    for url, rv in ranks.items():
        if rv.reachable and rv.state is not None:
            live.append(rv)
        elif rv.trust is not None:
            out[url] = replace(rv.trust, stale=True)
        else:
            out[url] = Trust(UNVERIFIED, "never_answered", (
                "has not answered as a rank (torch's debug server: GET /handler/, and whose "
                "rank it is from its group's TCPStore)" if is_torch(url)
                else "has not answered a valid /v1/state"), False, None, None, True)
    if not configured:
        for rv in live:
            out[rv.url] = Trust(UNVERIFIABLE, "no_lighthouse", "no --lighthouse to verify "
                                "against: findings are reported, never acted on", True,
                                claims(rv.state), now)
        return out
    if lighthouse is None:
        for rv in live:
            c = claims(rv.state)
            vouched = _vouched(rv, c)
            out[rv.url] = Trust(UNVERIFIABLE, "lighthouse_unreadable",
                                f"{error}; " + ("verified before with the same identity"
                                                if vouched else "not verified before"),
                                vouched, c, now)
        return out

    verdict = {rv.url: _check_against_lighthouse(rv.state, lighthouse) for rv in live}
    passing = [rv for rv in live if verdict[rv.url][0] == "ok"]

    groups_of_rid: dict[str, set[int]] = defaultdict(set)
    for rv in passing:
        groups_of_rid[rv.state["replica_id"]].add(rv.state["replica_group"])
    by_group: dict[int, list[RankView]] = defaultdict(list)
    for rv in passing:
        rid = rv.state["replica_id"]
        if len(groups_of_rid[rid]) > 1:
            others = sorted(groups_of_rid[rid] - {rv.state["replica_group"]})
            verdict[rv.url] = ("replica_id_conflict",
                               f"replica group(s) {others} claim {rid!r} too")
        else:
            by_group[rv.state["replica_group"]].append(rv)
    for g, ranks in by_group.items():
        for key, name in ((lambda s: s["replica_id"], "replica_id"),
                          (lambda s: s["group_world_size"], "group_world_size")):
            counts = Counter(key(rv.state) for rv in ranks if verdict[rv.url][0] == "ok")
            if len(counts) < 2:
                continue
            top, n = counts.most_common(1)[0]
            majority = top if n * 2 > sum(counts.values()) else None
            for rv in ranks:
                if verdict[rv.url][0] == "ok" and key(rv.state) != majority:
                    verdict[rv.url] = ("group_disagrees",
                                       f"replica group {g}'s ranks disagree on {name}: "
                                       f"{dict(counts)}")
    for key, reason in ((lambda s: (s["replica_group"], s["group_rank"]), "group_rank_taken"),
                        (lambda s: s["rank"], "rank_taken")):
        holders: dict[Any, list[RankView]] = defaultdict(list)
        for rv in live:
            if verdict[rv.url][0] == "ok":  # a claimant already caught lying is no rival
                holders[key(rv.state)].append(rv)
        for k, rvs in holders.items():
            if len(rvs) > 1:
                for rv in rvs:
                    verdict[rv.url] = (reason, f"{len(rvs)} ranks that pass every other check "
                                               f"claim {k}: {sorted(r.url for r in rvs)}")
    for rv in live:
        reason, detail = verdict[rv.url]
        ok, c = reason == "ok", claims(rv.state)
        # a stop said by a process verified before stays evidence when the Lighthouse lists
        # it no more (its Manager gone) and no successor is in its group: unheard, it would
        # read as a crash
        stop = reason in ("unknown_replica_id", "not_in_quorum") \
            and rv.state.get("finished") is True and _vouched(rv, c) and not by_group.get(c[1])
        out[rv.url] = Trust(VERIFIED if ok else UNVERIFIED, reason,
                            detail + "; it said it stopped, verified before" if stop else detail,
                            ok or stop, c, now)
    return out


def _key(rv: RankView) -> tuple | None:
    """What a rank's verdict rests on, besides the Lighthouse and its peers."""
    s = rv.state
    if s is None:
        return None
    return (rv.reachable, claims(s), s["quorum_id"], s.get("num_participants"))


class Verifier:
    """:func:`verify_ranks` sweep after sweep, with the same verdicts; while the Lighthouse says the
    same, only changed claims are judged again, with every rank their checks involve."""

    def __init__(self) -> None:
        self._sig: Any = _NOT_YET
        self._keys: dict[str, tuple | None] = {}
        self._by: dict[tuple, set[str]] = defaultdict(set)  # ("g"|"rid"|"rank", v) -> URLs

    @staticmethod
    def _signature(lighthouse: LighthouseStatus | None, error: str | None,
                   configured: bool) -> Any:
        if not configured:
            return ("none",)
        if lighthouse is None:
            return ("unreadable", error)
        return (lighthouse.quorum_id,
                tuple(sorted((rid, m.world_size) for rid, m in lighthouse.members.items())),
                frozenset(r for r in lighthouse.heartbeats if lighthouse.heartbeating(r)))

    def _index(self, url: str, key: tuple | None, add: bool) -> None:
        for k in _scopes(key):
            if add:
                self._by[k].add(url)
            else:
                urls = self._by.get(k)
                if urls is not None:
                    urls.discard(url)
                    if not urls:
                        del self._by[k]

    def judge(self, ranks: Mapping[str, RankView], changed: set[str],
              lighthouse: LighthouseStatus | None, error: str | None, configured: bool,
              now: float) -> dict[str, Trust]:
        """The verdicts that change this sweep, by URL (ViewBuilder.update's ``judge``);
        ``changed`` holds at least every URL whose reachability or claims may have changed."""
        sig = self._signature(lighthouse, error, configured)
        keys = self._keys
        touched = []
        added = 0  # changed URLs never judged
        if sig == self._sig:
            for url in changed:
                k = _key(ranks[url])
                old = keys.get(url, _NOT_YET)
                if k != old:
                    touched.append((url, old, k))
                    if old is _NOT_YET:
                        added += 1
        # a URL new to ``ranks`` is in ``changed``: equal counts mean the same ranks
        if sig != self._sig or len(ranks) - added != len(keys):
            self._sig = sig
            self._keys, self._by = {}, defaultdict(set)
            for url, rv in ranks.items():
                k = self._keys[url] = _key(rv)
                self._index(url, k, True)
            return verify_ranks(ranks, lighthouse, error, configured, now)
        if not touched:
            return {}
        todo: list[tuple] = []
        for url, old, k in touched:
            if old is not _NOT_YET:
                self._index(url, old, False)
                todo += _scopes(old)
            self._keys[url] = k
            self._index(url, k, True)
            todo += _scopes(k)
        subset: dict[str, RankView] = {url: ranks[url] for url, _, _ in touched}
        seen: set[tuple] = set()
        while todo:  # every rank a changed rank's checks involve, to closure
            k = todo.pop()
            if k in seen:
                continue
            seen.add(k)
            for url in self._by.get(k, ()):
                if url not in subset:
                    subset[url] = ranks[url]
                    todo += _scopes(self._keys.get(url))
        return verify_ranks(subset, lighthouse, error, configured, now)


_NOT_YET = object()


def _scopes(key: tuple | None) -> list[tuple]:
    """The checks beyond its own a rank takes part in: its group, replica id and rank."""
    if key is None:
        return []
    rid, g, _gr, _ws, rank, *_ = key[1]
    out = [("g", g), ("rank", rank)]
    if rid is not None:
        out.append(("rid", rid))
    return out
