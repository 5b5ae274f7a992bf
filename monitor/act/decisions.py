"""Safety rails: whether a confirmed finding may evict its replica group, and why (not).

:func:`decide` is a pure function of the finding, a summary of what the monitor currently sees
(:class:`Situation`) and the audit history (already-evicted replica ids, the last eviction); it
returns ``evict`` or ``hold`` with the first rail that stops it, checked in this order:

1. ``kind_not_evicted``: the finding's kind is not in ``--evict-on`` (``dead`` by default: torchft
   already drops a dead group, and a kill request cannot reach it); the loop does not even ask
   for such findings, so they appear as findings only, not in the decision log;
2. ``no_replica_id``: the group's torchft replica id is unknown, so there is nothing to kill;
3. ``already_evicted``: a kill for this replica id was already sent (also before a restart of the
   monitor); a restarted group has a new replica id and is judged on its own evidence;
4. ``dry_run``: ``--dry-run`` detects and reports, never evicts;
5. ``monitor_blind``: the monitor reaches no more than ``min_reachable_fraction`` of the ranks it
   knows; then the monitor (or its network) is the likely problem, not the groups; or it cannot
   verify what ranks claim (``Situation.blind_reason``: the Lighthouse is unreadable);
6. ``min_replicas``: evicting would leave fewer than ``--min-replicas`` groups in the quorum;
7. ``cooldown``: another eviction happened less than ``--cooldown`` seconds ago.

Manual evictions (``POST /v1/evict``) pass through rails 2, 3, 4 and 6: the person asking is the
evidence, and may act within a cooldown or while the monitor is partly blind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from monitor.config import RailsConfig

EVICT, HOLD = "evict", "hold"


@dataclass
class Situation:
    """What the monitor sees right now, as far as the rails care."""

    now: float
    reachable_fraction: float
    groups_in_quorum: set[int]  # replica groups taking part in the newest quorum
    evicted_replica_ids: set[str] = field(default_factory=set)
    last_eviction_at: float | None = None
    blind_reason: str | None = None  # set when the monitor cannot verify what it sees


@dataclass
class Decision:
    decision: str  # "evict" or "hold"
    reason: str  # "evict" / the rail that held it back
    detail: str

    @property
    def evict(self) -> bool:
        return self.decision == EVICT


def decide(kind: str, replica_group: int, replica_id: str | None, s: Situation,
           rails: RailsConfig, manual: bool = False) -> Decision:
    def hold(reason: str, detail: str) -> Decision:
        return Decision(HOLD, reason, detail)

    if not manual and kind not in rails.evict_kinds:
        return hold("kind_not_evicted", f"{kind} findings are reported, not evicted "
                                        f"(--evict-on {','.join(rails.evict_kinds)})")
    if not replica_id:
        return hold("no_replica_id", f"replica group {replica_group} has no known torchft "
                                     "replica_id (no /v1/state with one)")
    if replica_id in s.evicted_replica_ids:
        return hold("already_evicted", f"a kill for {replica_id} was already sent")
    if rails.dry_run:
        return hold("dry_run", "--dry-run: detect and report only")
    if not manual and s.blind_reason:
        return hold("monitor_blind", s.blind_reason)
    if not manual and s.reachable_fraction <= rails.min_reachable_fraction:
        return hold("monitor_blind", f"the monitor reaches only {s.reachable_fraction:.0%} of "
                                     "the ranks it knows; it may be the problem")
    remaining = len(s.groups_in_quorum - {replica_group})
    if remaining < rails.min_replicas:
        return hold("min_replicas", f"evicting would leave {remaining} replica group(s) in the "
                                    f"quorum, fewer than --min-replicas {rails.min_replicas}")
    if not manual and s.last_eviction_at is not None \
            and s.now - s.last_eviction_at < rails.cooldown_s:
        wait = rails.cooldown_s - (s.now - s.last_eviction_at)
        return hold("cooldown", f"last eviction {s.now - s.last_eviction_at:.1f}s ago; next "
                                f"possible in {wait:.1f}s (--cooldown {rails.cooldown_s:g})")
    return Decision(EVICT, "evict", f"{kind} in replica group {replica_group}; "
                                    f"{remaining} group(s) remain")
