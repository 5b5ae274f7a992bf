"""What the analyzer concludes: findings and the result that carries them.

Every finding has ``kind``, ``pg`` (process-group name as entries carry it), ``seq`` (collective
sequence id, ``None`` for stragglers), ``op``, ``culprit_ranks`` and a one-line ``detail``; torchft
groups add ``quorum_id`` / ``group_rank``, replica-group-local groups ``replica_group``. The
kind-specific fields are those of the subclasses. ``to_dict()`` gives the JSON form documented in
docs/analyze.md (JSON interface), which other tools rely on: add fields, never rename or remove them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .model import GroupKey

__all__ = [
    "AnalysisResult",
    "Finding",
    "HangFinding",
    "MismatchFinding",
    "StragglerFinding",
    "KIND_ORDER",
]

KIND_ORDER = {"hang": 0, "mismatch": 1, "straggler": 2, "lag": 3}


def _str_keys(mapping: dict[int, Any]) -> dict[str, Any]:
    return {str(k): v for k, v in sorted(mapping.items())}


@dataclass
class Finding:
    """Something wrong with one collective (or one rank, for stragglers)."""

    kind: str
    group: GroupKey | None
    seq: int | None
    op: str | None
    culprit_ranks: list[int]
    detail: str

    @property
    def pg(self) -> str | None:
        return None if self.group is None else self.group.pg

    def to_dict(self) -> dict[str, Any]:
        g = self.group
        return {
            "kind": self.kind,
            "pg": self.pg,
            "replica_group": None if g is None else g.replica_group,
            "quorum_id": None if g is None else g.quorum_id,
            "group_rank": None if g is None else g.group_rank,
            "seq": self.seq,
            "op": self.op,
            "culprit_ranks": list(self.culprit_ranks),
            "detail": self.detail,
            **self._extra(),
        }

    def _extra(self) -> dict[str, Any]:
        return {}

    def sort_key(self) -> tuple:
        g = self.group
        return (
            KIND_ORDER.get(self.kind, 9),
            "" if g is None else g.pg,
            -1 if g is None or g.replica_group is None else g.replica_group,
            -1 if g is None or g.quorum_id is None else g.quorum_id,
            -1 if g is None or g.group_rank is None else g.group_rank,
            -1 if self.seq is None else self.seq,
            self.culprit_ranks,
        )


@dataclass
class MismatchFinding(Finding):
    """Ranks of a group enqueued different collectives at one sequence id.

    ``mismatch`` is ``"op"``, ``"size"`` or ``"dtype"``; ``has_majority`` is False when no single
    variant was enqueued by more ranks than every other (then every participant is a culprit);
    ``variants`` lists what was enqueued, most common first; ``later_mismatches`` counts further
    sequence ids of the group that disagree too (usually consequences of the first);
    ``departs_from_history`` (only without a majority) names the participants whose collective
    differs from the variant of that op they themselves enqueued most often in the group's other
    collectives: the likely culprit when two ranks disagree.
    """

    mismatch: str = "op"
    has_majority: bool = True
    variants: list[dict[str, Any]] = field(default_factory=list)
    later_mismatches: int = 0
    departs_from_history: list[int] = field(default_factory=list)

    def _extra(self) -> dict[str, Any]:
        return {
            "mismatch": self.mismatch,
            "has_majority": self.has_majority,
            "variants": self.variants,
            "later_mismatches": self.later_mismatches,
            "departs_from_history": list(self.departs_from_history),
        }


@dataclass
class HangFinding(Finding):
    """Some members enqueued collective ``seq`` while others never did.

    ``culprit_ranks`` never enqueued it; ``waiting_ranks`` did and (on NCCL) it has not completed;
    ``unknown_ranks`` are members whose dump is missing or whose ring buffer cannot tell;
    ``last_seq_by_rank`` is each known member's last sequence id in the group; ``last_activity``
    is each known member's newest Flight Recorder entry (pg, seq, op, state).
    """

    waiting_ranks: list[int] = field(default_factory=list)
    unknown_ranks: list[int] = field(default_factory=list)
    last_seq_by_rank: dict[int, int] = field(default_factory=dict)
    last_activity: dict[int, dict[str, Any] | None] = field(default_factory=dict)

    def _extra(self) -> dict[str, Any]:
        return {
            "waiting_ranks": list(self.waiting_ranks),
            "unknown_ranks": list(self.unknown_ranks),
            "last_seq_by_rank": _str_keys(self.last_seq_by_rank),
            "last_activity": _str_keys(self.last_activity),
        }


@dataclass
class StragglerFinding(Finding):
    """A rank that arrives last (or late) at collectives far more often than chance.

    ``score`` is the fraction of observed collectives at which it arrived last; ``expected`` what
    that fraction would be by chance; ``late_fraction`` the fraction at which it arrived at least
    ``min_wait_ms`` after the median rank; ``z`` how many standard deviations above chance the
    count that flagged it is; ``median_wait_ms`` how long its peers typically waited for it when it was last;
    ``evidence`` is ``"duration_ms"`` (NCCL: the last to arrive has the shortest kernel) or
    ``"host_clock"`` (enqueue order among ranks sharing a host's clock).

    Found where only two ranks are compared (``peers`` names the other one), ``score`` is the
    fraction of collectives at which it was the later of the two and ``median_wait_ms`` its
    median lag behind the peer; alone, such a finding has kind ``lag`` and sits in
    ``AnalysisResult.lags``, not in the findings (docs/analyze.md, Stragglers).
    """

    rank: int = -1
    score: float = 0.0
    expected: float = 0.0
    z: float = 0.0
    collectives: int = 0
    median_wait_ms: float = 0.0
    evidence: str = "duration_ms"
    groups: list[str] = field(default_factory=list)
    late_fraction: float = 0.0
    peers: list[int] = field(default_factory=list)

    def _extra(self) -> dict[str, Any]:
        return {
            "peers": list(self.peers),
            "rank": self.rank,
            "score": round(self.score, 4),
            "expected": round(self.expected, 4),
            "z": round(self.z, 2),
            "collectives": self.collectives,
            "median_wait_ms": round(self.median_wait_ms, 3),
            "evidence": self.evidence,
            "groups": list(self.groups),
            "late_fraction": round(self.late_fraction, 4),
        }


@dataclass
class AnalysisResult:
    """The outcome of :func:`monitor.analysis.analyze`.

    ``ranks``: ranks whose dumps were analyzed; ``unknown_ranks``: members of some group with no
    usable dump (never culprits unless ``blame_missing``); ``errors``: dumps that could not be
    used (``{"rank": .., "error": ..}``, or ``"path"`` from the loader); ``last_seq``: for every
    current group (the latest torchft incarnation, every other group), each member's last
    enqueued sequence id where its dump can tell (0 = enqueued nothing); ``lags``: ranks that
    lag persistently behind the one peer they were compared with, where nothing else agrees
    that they are stragglers (kind ``lag``; not findings: no majority says who is off pace).
    """

    ranks: list[int]
    unknown_ranks: list[int]
    findings: list[Finding]
    errors: list[dict[str, Any]] = field(default_factory=list)
    last_seq: dict[GroupKey, dict[int, int]] = field(default_factory=dict)
    lags: list[Finding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranks": list(self.ranks),
            "unknown_ranks": list(self.unknown_ranks),
            "errors": list(self.errors),
            "findings": [f.to_dict() for f in self.findings],
            "lags": [f.to_dict() for f in self.lags],
        }
