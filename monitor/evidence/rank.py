"""One rank as the last sweeps saw it (:class:`RankView`), and what counts as a ``/v1/state``.

An answer that is not a ``/v1/state`` document counts as unreachable (``bad_response``).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any

from monitor.poll.discovery import Target
from rank_wire import INT64_MAX, INT64_MIN, unpack_seconds

_REQUIRED = {"replica_group": int, "rank": int, "group_rank": int, "step": int,
            "quorum_id": int, "phase": str, "phase_since": (int, float)}
# read when present: a wrong type makes no /v1/state either
_NULL = type(None)
_OPTIONAL = {"replica_id": (str, _NULL), "group_world_size": (int, _NULL), "num_participants": int,
             "commit_failures": (int, _NULL),
             "participating": bool, "host": (str, _NULL), "node": (str, _NULL),
             "slurm_job_id": (str, _NULL), "device": (dict, _NULL), "pid": (int, _NULL), "started_at": (int, float, _NULL)}
# numbers the monitor computes with: an int past int64 raised in the goodput ledger and the
# metrics, a time past a float's range in ``now - phase_since`` (the comparisons refuse NaN)
_I64, _FLOAT = (INT64_MIN, INT64_MAX), (-sys.float_info.max, sys.float_info.max)
_BOUNDS = tuple((key, *bounds) for key, bounds in {
    "replica_group": _I64, "rank": _I64, "group_rank": _I64, "step": _I64, "quorum_id": _I64,
    "phase_since": _FLOAT, "group_world_size": _I64, "num_participants": _I64,
    "commit_failures": _I64, "pid": _I64, "started_at": _FLOAT}.items())
STEP_TIMES_READ = 16  # step times asked of each rank (``/v1/state?recent=``)


def valid_state(data: Any) -> str | None:
    """None when ``data`` looks like a /v1/state document, else what is wrong with it."""
    if not isinstance(data, dict):
        return "not an object"
    for key, typ in _REQUIRED.items():
        v = data.get(key)
        if not isinstance(v, typ) or isinstance(v, bool):
            return f"{key} is {v!r}"[:200]
    return _bad_optional(data)


def _bad_optional(data: dict) -> str | None:
    for key, typ in _OPTIONAL.items():
        if key in data:
            v = data[key]
            if not isinstance(v, typ) or (isinstance(v, bool) and typ is not bool):
                return f"{key} is {v!r}"[:200]
    get = data.get
    for key, low, high in _BOUNDS:  # every one a number or None by now
        v = get(key)
        if v is not None and not low <= v <= high:
            what = "beyond int64" if high == INT64_MAX else "not a finite number"
            return f"{key} is {v!r}"[:180] + f": {what}"
    return None


def plain_shape(data: Any) -> tuple | None:
    """``data``'s :func:`state_shape` when it is a valid /v1/state with JSON's own types (the
    usual answer, checked in one pass); None: :func:`valid_state` decides."""
    if type(data) is not dict:
        return None
    try:
        if type(data["replica_group"]) is int and type(data["rank"]) is int \
                and type(data["group_rank"]) is int and type(data["step"]) is int \
                and type(data["quorum_id"]) is int and type(data["phase"]) is str \
                and type(data["phase_since"]) in (float, int) and _bad_optional(data) is None:
            return state_shape(data)
    except KeyError:
        pass
    return None


def state_shape(s: dict[str, Any]) -> tuple:
    """What a group and a verdict rest on besides progress: a rank answering again with the
    same shape is not judged again (ViewBuilder)."""
    g = s.get
    return (s["replica_group"], s["rank"], s["group_rank"], s["quorum_id"], g("replica_id"),
            g("group_world_size"), g("num_participants"), g("participating", True), g("host"),
            g("node"), g("device"), g("job"))


# in a kept state: its group's Manager's commits when the monitor first saw it down (dead_rank)
DOWN_AT = "down_at_commits"


def last_known(s: dict[str, Any], down_at: float | None = None) -> dict[str, Any]:
    """What of a rank's state is kept once it stops answering (JSON: what a restarted monitor
    groups and judges it by), with its ``down_at`` mark (monitor.detect.liveness) when known."""
    keep = (*_REQUIRED, "job", "replica_id", "group_world_size", "num_participants",
            "participating", "host", "node", "slurm_job_id", "device", "finished", "pid",
            "started_at", "commits")
    out = {k: s[k] for k in keep if k in s}
    if type(down_at) is int:
        out[DOWN_AT] = down_at
    return out


OTHER_JOB = "a rank of job "  # how not_state's reason for another job's rank begins
_OTHER_JOB = re.compile(re.escape(OTHER_JOB) + r"(.*?) \(group -?\d+ rank -?\d+\)", re.S)


def _monitor_job(target: Target | None) -> str | None:
    """The monitor's --job as the target carries it (``expect_job``, or a --targets or
    TCPStore target's job)."""
    if target is None:
        return None
    if target.expect_job is not None:
        return target.expect_job
    return target.job if target.source in ("static", "torch_store") else None


def not_state(data: Any, last: dict[str, Any] | None, target: Target | None) -> str | None:
    """Why ``data`` is no /v1/state of the rank that ``last`` was at its address (None: it is):
    not a /v1/state, not of the job ``target`` expects, or another process on the dead rank's
    port (another job's rank, or not the rank registered there). A restart, a rank now of the
    monitor's own --job, or a --targets rank with the same group and rank is the rank again."""
    bad = valid_state(data)
    if bad is not None:
        return bad
    job, who = data.get("job"), (data["replica_group"], data["rank"])
    want = target.expect_job if target is not None else None
    if want is not None and job is not None and job != want:
        return f"{OTHER_JOB}{job!r} (group {who[0]} rank {who[1]}), not this monitor's " \
               f"--job {want!r}"
    if last is None:
        return None
    # a changed job is a stranger, unless now the monitor's --job or a --targets rank with the
    # same group and rank (the operator listed it: polled whatever job it answers for)
    if job != last.get("job") and None not in (job, last.get("job")) \
            and job != _monitor_job(target) and not (
                target is not None and target.source == "static"
                and who == (last["replica_group"], last["rank"])):
        return f"{OTHER_JOB}{job!r} (group {who[0]} rank {who[1]}) answers at its address"
    if who != (last["replica_group"], last["rank"]) and target is not None \
            and target.source == "registered" and target.rank is not None \
            and (target.replica_group, target.rank) != who:
        return f"group {who[0]} rank {who[1]} answers at the address group " \
               f"{target.replica_group} rank {target.rank} registered"
    return None


def answers_other_job(rv: RankView | None) -> str | None:
    """The job of another job's rank that answered at ``rv``'s address (not_state's words);
    None when it is not that."""
    if rv is None or rv.reachable or rv.reason != "bad_response":
        return None
    # at the start: a bad document's own text ("rank is '...'") may quote the words
    found = _OTHER_JOB.match((rv.error or "").removeprefix("bad /v1/state: "))
    return found.group(1) if found else None


_new = object.__new__


@dataclass(slots=True)
class RankView:
    """One target as the last sweeps saw it; slotted, as many are made a sweep (docs/scaling.md)."""

    url: str
    reachable: bool
    state: dict[str, Any] | None  # last good /v1/state (possibly stale when unreachable)
    reason: str | None = None
    error: str | None = None
    failures: int = 0  # consecutive failed sweeps
    unreachable_since: float | None = None
    target: Target | None = None
    superseded: bool = False  # unreachable, and a live rank now holds its (group, rank)
    trust: Any = None  # monitor.evidence.verification.Trust (None: no verdict yet)
    fresh: bool = True  # polled this sweep; False: not due, carried from an earlier sweep
    answered_at: float | None = None  # when its last good answer came (RankPoll.at)
    _recent: list[float] | None = field(default=None, repr=False, compare=False)

    @property
    def replica_group(self) -> int | None:
        s = self.state
        if s is not None:
            g = s["replica_group"]
            return g if type(g) is int else int(g)
        return self.target.replica_group if self.target else None

    @property
    def rank(self) -> int | None:
        s = self.state
        if s is not None:
            r = s["rank"]
            return r if type(r) is int else int(r)
        return self.target.rank if self.target else None

    @property
    def replica_id(self) -> str | None:
        return self.state.get("replica_id") if self.state else None

    @property
    def ended(self) -> bool:
        """Unreachable after its last answer said training completed (``"finished": true``,
        WorkerServer.finish): the rank ended, it did not die."""
        return not self.reachable and self.state is not None and self.state.get("finished") is True

    @property
    def verdict(self) -> tuple[str, str, bool] | None:
        """(trust state, reason, stale: the verdict of an answer before this sweep's, the
        rank not answering now); None: no verdict yet."""
        t = self.trust
        return (t.state, t.reason, t.stale) if t is not None else None

    def copy(self) -> RankView:
        """A shallow copy whose ``superseded`` the view it goes into decides afresh."""
        c = self.clone()
        c.superseded = False
        return c

    def clone(self) -> RankView:
        """A shallow copy, ``superseded`` included; field by field, several times cheaper than
        dataclasses.replace in the view's hot loop."""
        c = _new(RankView)
        c.url, c.reachable, c.state, c.reason, c.error, c.failures = \
            self.url, self.reachable, self.state, self.reason, self.error, self.failures
        c.unreachable_since, c.target, c.superseded, c.trust = \
            self.unreachable_since, self.target, self.superseded, self.trust
        c.fresh, c._recent, c.answered_at = self.fresh, self._recent, self.answered_at
        return c

    def recent_steps(self) -> list[float]:
        """Its recent step times (computed once: a RankView's state never changes)."""
        cached = self._recent
        if cached is not None:
            return cached
        vals = self.state.get("recent_step_seconds") if self.state else None
        out = unpack_seconds(vals) if type(vals) is bytes else []  # as the poller keeps it
        self._recent = out
        return out


def answered(url: str, prev: RankView | None, state: dict[str, Any], target: Target | None,
             at: float) -> RankView:
    """The RankView of a valid answer that came at ``at`` (RankPoll.at)."""
    rv = _new(RankView)
    rv.url, rv.reachable, rv.state, rv.reason, rv.error, rv.failures = \
        url, True, state, None, None, 0
    rv.unreachable_since, rv.superseded, rv.fresh, rv.target = None, False, True, target
    rv.trust = prev.trust if prev is not None else None
    rv._recent, rv.answered_at = None, at
    return rv
