"""What holds a host's offence or quarantine back, on the job's own evidence: the Lighthouse's
word before a ``dead`` finding counts (:class:`DeadGroups`; none where the host refused the
connections: :func:`refused_on`), the rails before a quarantine (:func:`holding_rail`) and
``--min-replicas`` among them (:func:`protected_hosts`; :func:`drained_groups` for the eviction
rail). See docs/quarantine.md.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

from monitor.config import QuarantineConfig
from monitor.detect import Finding
from monitor.evidence.lighthouse_status import LighthouseStatus
from monitor.evidence.view import ClusterView


def protected_hosts(view: ClusterView, min_replicas: int) -> Protection:
    """host -> why its quarantine (which drains it) would leave fewer than ``min_replicas``
    groups of the newest quorum; :meth:`Protection.why` also counts groups already down."""
    return Protection({gv.replica_group: (gv.replica_id, set(gv.hosts))
                       for gv in view.in_quorum()}, min_replicas)


def drained_groups(view: ClusterView, hosts_down: Collection[str]) -> set[int]:
    """The groups of ``view``'s newest quorum with a rank on a quarantined host: the eviction
    rail counts them as gone, since the drain takes them down."""
    down = set(hosts_down)
    return {gv.replica_group for gv in view.in_quorum()
            if not down.isdisjoint(gv.hosts)} if down else set()


class Protection(dict):
    """host -> why its quarantine alone leaves fewer than ``min_replicas`` groups; ``why()``
    also counts the groups down already, so several quarantines never go below it together."""

    def __init__(self, groups: dict[int, tuple[str | None, set[str]]], min_replicas: int):
        self.groups, self.min_replicas = groups, min_replicas  # group -> (replica id, hosts)
        self.on: dict[str, set[int]] = {}  # host -> its groups
        for g, (_, hosts) in groups.items():
            for h in hosts:
                self.on.setdefault(h, set()).add(g)
        super().__init__({h: self.why(h) for h, gs in self.on.items()
                          if len(groups) - len(gs) < min_replicas})

    def why(self, host: str, hosts_down: Collection[str] = (),
            evicted: Collection[str] = ()) -> str | None:
        """Why quarantining ``host`` would break the rail with the groups on ``hosts_down``
        (quarantined) and those sent a kill (``evicted`` replica ids) gone; None: it would not."""
        down = {g for g, (rid, on) in self.groups.items()
                if rid in evicted or not on.isdisjoint(hosts_down)}
        mine = self.on.get(host, set())
        left = len(self.groups) - len(down | mine)
        if not mine - down or left >= self.min_replicas:
            return None  # it takes down no group still up, or enough remain
        return (f"quarantining {host} would take down group(s) {sorted(mine)} of the quorum, "
                f"leaving {left}, fewer than --min-replicas {self.min_replicas}"
                + (f" (group(s) {sorted(down)} down already: quarantined or evicted)"
                   if down else ""))


def holding_rail(cfg: QuarantineConfig, host: str, down: set[str], blind: str | None,
                 known: int, protected: Callable[[], dict[str, str]],
                 evicted: Callable[[], set[str]]) -> tuple[str, str] | None:
    """The first rail (name, detail) holding ``host``'s quarantine, ``down`` out; or None."""
    n, cap = len(down), cfg.cap(known)
    if blind:
        return "monitor_blind", blind
    p = protected()
    why = p.why(host, down, evicted()) if isinstance(p, Protection) else p.get(host)
    if why is not None:
        return "min_replicas", why
    if n + 1 >= known:
        return "no_other_host", (f"quarantining {host} would leave none of the {known} "
                                 f"host(s) the monitor knows to run on ({n} quarantined "
                                 "already): the restarted group would come back on it")
    if n >= cap:
        return "cap", (f"{n} host(s) quarantined already, the cap (--max-quarantined "
                       f"{cfg.max_quarantined:g} of {known} known host(s)) is {cap}")
    if cfg.dry_run:
        return "dry_run", "--quarantine-dry-run or --dry-run: decided, nothing done"
    return None


def refused_on(f: dict[str, Any], ranks: Iterable[int]) -> bool:
    """A ``dead`` finding whose ``ranks`` (one host's) each had its last connection refused: the
    host's kernel answered, so its processes ended (a crash), the host did not drop off. One that
    does not answer (timed out, no route: a host gone, a deleted pod's address) counts."""
    polls, ranks = (f.get("evidence") or {}).get("unreachable") or {}, list(ranks)
    return f.get("kind") == "dead" and bool(ranks) and all(
        (polls.get(str(r)) or {}).get("refused") for r in ranks)


class DeadGroups:
    """Dead findings waiting for the Lighthouse to agree: one counts once the Lighthouse no
    longer hears the group and at least as many groups live on as are dead; one resolved first
    (its group evicted: monitor.detect.liveness) never counts."""

    def __init__(self) -> None:
        self.pending: dict[tuple, Finding] = {}  # confirmed, not yet agreed

    def agreed(self, new: Iterable[Finding], open_keys: Collection[tuple], view: ClusterView,
               lighthouse: LighthouseStatus | None,
               killed: Collection[str] = ()) -> list[Finding]:
        """The dead findings (of ``new`` and those waiting) that now count, each with the
        Lighthouse's word added to its evidence (``lighthouse``); none of a replica the monitor
        sent a kill for (``killed``)."""
        for f in new:
            if f.kind == "dead":
                self.pending[f.key] = f
        if not self.pending:
            return []
        for key in [k for k, f in self.pending.items()
                    if k not in open_keys or not f.replica_id or f.replica_id in killed]:
            del self.pending[key]
        if not self.pending or lighthouse is None:
            return []
        live = sorted(g for g, gv in view.groups.items() if gv.reachable and gv.replica_id
                      and lighthouse.heartbeating(gv.replica_id))
        dead = {k[1] for k in open_keys if k[0] == "dead"} - set(live)
        out = []
        for key, f in list(self.pending.items()):
            rid: Any = f.replica_id
            # heard, then stopped: a restarted Lighthouse lists none it has not heard yet, and
            # a group merely cut off from the monitor is no host's offence
            if rid not in lighthouse.stale or len(live) < max(1, len(dead)):
                continue
            seen = lighthouse.heartbeats.get(rid)
            f.evidence["lighthouse"] = (
                f"the Lighthouse no longer hears {rid}"
                + (f" (last heartbeat {seen:.1f}s ago)" if seen is not None else "")
                + f"; {len(live)} group(s) live on, {len(dead)} dead")
            out.append(f)
            del self.pending[key]
        return out
