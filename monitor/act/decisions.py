"""Safety rails: whether a confirmed finding may evict its replica group, and why (not).

:func:`decide` is a pure function returning ``evict``, or ``hold`` with the first rail that
stops it, in the order of docs/monitor.md (Eviction and safety rails). A manual eviction skips
``kind_not_evicted``, ``monitor_blind`` and ``cooldown``: the person asking is the evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from monitor.config import RailsConfig

EVICT, HOLD = "evict", "hold"


@dataclass
class Situation:
    """What the monitor sees right now, as far as the rails care."""

    now: float
    groups_in_quorum: set[int]  # replica groups taking part in the newest quorum
    evicted_replica_ids: set[str] = field(default_factory=set)
    last_eviction_at: float | None = None
    blind_reason: str | None = None  # set when the monitor cannot verify what it sees
    # why evicting would only restart the group on a host whose quarantine a rail holds
    quarantine_held: str | None = None


@dataclass
class Decision:
    decision: str  # "evict" or "hold"
    reason: str  # "evict" / the rail that held it back
    detail: str

    @property
    def evict(self) -> bool:
        return self.decision == EVICT


def blind_reason(blind: str | None, reachable_fraction: float, rails: RailsConfig,
                 who: str = "the monitor") -> str | None:
    """Why nobody may be blamed now: ``blind`` (ranks cannot be verified), or ``who`` reaches no
    more than ``--min-reachable`` of its ranks (it may be the one cut off); None: neither."""
    if blind or reachable_fraction > rails.min_reachable_fraction:
        return blind
    return (f"{who} reaches only {reachable_fraction:.0%} of the ranks it knows; it may be the "
            "problem")


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
    remaining = len(s.groups_in_quorum - {replica_group})
    if remaining < rails.min_replicas:
        return hold("min_replicas", f"evicting would leave {remaining} replica group(s) in the "
                                    f"quorum, fewer than --min-replicas {rails.min_replicas}")
    if not manual and s.quarantine_held:
        return hold("quarantine_held", s.quarantine_held)
    if not manual and s.last_eviction_at is not None \
            and s.now - s.last_eviction_at < rails.cooldown_s:
        wait = rails.cooldown_s - (s.now - s.last_eviction_at)
        return hold("cooldown", f"last eviction {s.now - s.last_eviction_at:.1f}s ago; next "
                                f"possible in {wait:.1f}s (--cooldown {rails.cooldown_s:g})")
    return Decision(EVICT, "evict", f"{kind} in replica group {replica_group}; "
                                    f"{remaining} group(s) remain")
