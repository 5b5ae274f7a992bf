"""What the analyzer concludes: findings and the result that carries them. ``to_dict()`` is
the JSON interface of docs/analyze.md: add fields, never rename or remove them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .model import GroupKey

KIND_ORDER = {"hang": 0, "mismatch": 1, "straggler": 2, "lag": 3}
_DIGITS = {"score": 4, "expected": 4, "late_fraction": 4, "z": 2, "median_wait_ms": 3}


def _json(name: str, value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): v for k, v in sorted(value.items())}
    if isinstance(value, list):
        return list(value)
    return round(value, _DIGITS[name]) if name in _DIGITS else value


@dataclass
class Finding:
    """Something wrong with one collective (``seq``; None for stragglers); ``detail``: one line."""

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
            **{f.name: _json(f.name, getattr(self, f.name)) for f in fields(self)[len(_BASE):]},
        }

    def sort_key(self) -> tuple:
        where = ("", -1, -1, -1) if self.group is None else self.group.order()
        return (KIND_ORDER.get(self.kind, 9), *where, -1 if self.seq is None else self.seq, self.culprit_ranks)


_BASE = fields(Finding)


@dataclass
class MismatchFinding(Finding):
    """Ranks of a group enqueued different collectives at one sequence id (``variants``: most
    common first); without a majority every participant is a culprit."""

    mismatch: str = "op"
    has_majority: bool = True
    variants: list[dict[str, Any]] = field(default_factory=list)
    later_mismatches: int = 0
    departs_from_history: list[int] = field(default_factory=list)
    departs_from_step_pattern: list[int] = field(default_factory=list)


@dataclass
class HangFinding(Finding):
    """Some members enqueued collective ``seq`` while others (``culprit_ranks``) never did;
    ``last_activity``: each known member's newest entry; ``blocked_by``: members that never did
    because they wait in another hang (its group and seq), not culprits."""

    waiting_ranks: list[int] = field(default_factory=list)
    unknown_ranks: list[int] = field(default_factory=list)
    last_seq_by_rank: dict[int, int] = field(default_factory=dict)
    last_activity: dict[int, dict[str, Any] | None] = field(default_factory=dict)
    blocked_by: dict[int, dict[str, Any]] = field(default_factory=dict)


@dataclass
class StragglerFinding(Finding):
    """A rank that arrives last (or late) far more often than chance; of two ranks (``peers``) a
    ``lag`` when nothing else agrees. The fields: docs/analyze.md."""

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


@dataclass
class AnalysisResult:
    """What :func:`monitor.analysis.analyze` returns; ``last_seq``: per current group, each
    member's last enqueued sequence id where its dump can tell; ``lags``: not findings."""

    ranks: list[int]
    unknown_ranks: list[int]
    findings: list[Finding]
    errors: list[dict[str, Any]] = field(default_factory=list)
    last_seq: dict[GroupKey, dict[int, int]] = field(default_factory=dict)
    lags: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what could not be checked, and why
    compared: set[int] = field(default_factory=set)  # ranks the straggler check could time
    compared_across: set[int] | None = None  # ... in a torchft cross-group group (None: none)

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": list(self.ranks), "unknown_ranks": list(self.unknown_ranks), "errors": list(self.errors),
                "findings": [f.to_dict() for f in self.findings], "lags": [f.to_dict() for f in self.lags],
                "notes": list(self.notes)}
