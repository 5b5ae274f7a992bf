"""The WorkerServer's read-only endpoints as plain functions: the document or bytes each one
answers, given the request's query arguments. Flask's routes (:mod:`worker_server.app`) and
torch's ``_WorkerServer`` handlers (:mod:`worker_server.torch_server`) both answer through them,
so a rank serves the same bytes on either server.

A bad argument raises :class:`BadParameter` (answered 400 by either server); a Flight Recorder
this torch cannot dump raises :class:`~worker_server.flight_recorder.FlightRecorderNotAvailable`
(501); anything else raised is answered 500 and the server keeps serving.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from http_serving import decimal_int
from rank_wire import QUORUM_KEY
from rank_wire.recorders import is_torchft_pg_name

from .flight_recorder import FlightRecorderBusy, IncarnationTracker, fr_dump
from .packed import state_packed
from .stacks import format_stacks, thread_stacks
from .state import RankState

# the words a boolean query parameter may be (any case)
BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


class Params(Protocol):
    """A request's query arguments: the value of ``name``, or None when it was not given."""

    def get(self, name: str) -> str | None: ...


class BadParameter(ValueError):
    """A query parameter with a value the endpoint does not accept (answered 400)."""


def bool_param(args: Params, name: str, default: bool = False) -> bool:
    raw = args.get(name)
    if raw is None:
        return default
    try:
        return BOOL_WORDS[raw.strip().lower()]
    except KeyError:
        raise BadParameter(f"{name} must be true or false (1/0, yes/no), got {raw!r}") from None


def choice_param(args: Params, name: str, choices: tuple[str, ...], default: str) -> str:
    raw = args.get(name)
    raw = default if raw is None else raw
    if raw not in choices:
        raise BadParameter(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
    return raw


def int_param(args: Params, name: str, lo: int, hi: int) -> int | None:
    raw = args.get(name)
    if raw is None:
        return None
    try:
        value = decimal_int(raw)
    except ValueError:
        raise BadParameter(f"{name} must be an integer in [{lo}, {hi}], got {raw!r}") from None
    if not lo <= value <= hi:
        raise BadParameter(f"{name} must be an integer in [{lo}, {hi}], got {raw!r}")
    return value


MAX_LAST = 1_000_000
# A request waits for another's dump only while that dump is this young (a normal one takes
# ~30-100 ms); older, it is taken as wedged and the request is answered 503 at once: a thread
# waiting on it, beside the paced reads' two, would leave the monitor's polls none (metrics.py)
FR_WAIT_S = 0.25


class _DumpTurn:
    """One Flight Recorder dump at a time (torch's dump is the whole process's)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._since: float | None = None  # when the running dump started; None: none runs

    def take(self) -> bool:
        """Start a dump now, or after the running one if it ends within FR_WAIT_S of its
        start; False when it does not."""
        with self._cond:
            if self._since is not None:
                wait = self._since + FR_WAIT_S - time.monotonic()
                self._cond.wait_for(lambda: self._since is None, timeout=max(0.0, wait))
                if self._since is not None:
                    return False
            self._since = time.monotonic()
            return True

    def give(self) -> None:
        with self._cond:
            self._since = None
            self._cond.notify()


_FR_DUMPING = _DumpTurn()
# one dump and one waiting for it: a queue of dumps would hold every server thread, and a
# monitor's /v1/state behind them past its poll timeout (the rank found dead)
_FR_CALLERS = threading.BoundedSemaphore(2)
MAX_STEP = 1 << 62  # ``since`` bound: any torchft step fits, a huge value is a bad parameter
MAX_RECENT = 1 << 20  # ``recent`` bound: more than any rank keeps


def state_since(doc: dict[str, Any], since: int) -> dict[str, Any]:
    """``/v1/state?since=N``: ``timing.recent`` (and ``recent_quorum``) holds only the rows of
    steps after N, and
    ``timing.since`` says it was cut (N). A monitor that folded this rank's rows up to step N
    asks for the rest only: at 100,000 ranks a leader's answer is then one or two rows, not 32,
    and the rows are most of what the monitor parses (docs/scaling.md). Everything else in the
    document is as ``/v1/state`` serves it (``last_step`` and ``window`` too)."""
    timing = doc.get("timing")
    if isinstance(timing, dict) and isinstance(timing.get("recent"), list):
        for key in ("recent", QUORUM_KEY):
            if isinstance(timing.get(key), list):
                timing[key] = [r for r in timing[key]
                               if not isinstance(r, dict) or not isinstance(r.get("step"), int)
                               or r["step"] > since]
        timing["since"] = since
    return doc


def state_recent(doc: dict[str, Any], recent: int) -> dict[str, Any]:
    """``/v1/state?recent=N``: ``recent_step_seconds`` holds only the newest N step times. A
    rank keeps 64 (worker_server/state.py) and the monitor reads the newest 16: at 100,000
    ranks the other 48 were ~1.1 KB of every leader's ~2.3 KB answer, parsed and freed ~15,000
    times a sweep (docs/scaling.md). Everything else is as ``/v1/state`` serves it."""
    vals = doc.get("recent_step_seconds")
    if isinstance(vals, list) and len(vals) > recent:
        doc["recent_step_seconds"] = vals[len(vals) - recent:]
    return doc


def filter_fr_dump(body: bytes, pg: str | None, last: int | None, only_active: bool = False) -> bytes:
    """``/v1/fr_trace?pg=<name>&last=N``: only the entries of one process group, the newest N.

    ``pg=torchft`` is torchft's cross-replica-group group, every incarnation of it (entries whose
    ``pg_id`` an incarnation names, or whose name is torchft's: ``''`` or
    ``torchft_quorum_*``); any other value matches a process group's name or description exactly.
    ``last`` keeps the newest N entries (of that group, when both are given). Every other key is
    kept as it is, and ``filter`` says what was left out (``entries_total`` in the full dump) and,
    with ``only_active: true``, that torch was asked for onlyActive (a cut or filtered dump does
    not show it). A dump that is not a JSON object with an ``entries`` list is returned unchanged."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body
    entries = doc.get("entries") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        return body
    kept = entries
    if pg is not None:
        if pg == "torchft":
            ids = {i.get("pg_id") for i in doc.get("incarnations") or []
                   if isinstance(i, dict) and i.get("pg_id") is not None}

            def match(e: Any) -> bool:
                names = e.get("process_group") or [None]
                return e.get("pg_id") in ids or (isinstance(names[0], str)
                                                 and is_torchft_pg_name(names[0]))
        else:
            def match(e: Any) -> bool:
                names = e.get("process_group") or []
                return pg in names[:2] if isinstance(names, list) else False
        kept = [e for e in kept if isinstance(e, dict) and match(e)]
    if last is not None:
        kept = kept[-last:]
    doc["entries"] = kept
    doc["filter"] = {"pg": pg, "last": last, "entries_total": len(entries)}
    if only_active:
        doc["filter"]["only_active"] = True
    return json.dumps(doc, separators=(",", ":")).encode()


def identity_keys(state: RankState) -> dict[str, Any]:
    i = state.identity
    return {
        "rank": i.rank,
        "replica_group": i.replica_group,
        "replica_id": state.replica_id,
        "group_rank": i.group_rank,
        "group_world_size": i.group_world_size,
        "host": i.host,
        "job": i.job,
    }


def json_body(doc: Any) -> bytes:
    """``doc`` as Flask's ``jsonify`` writes it (sorted keys, compact, a final newline), so the
    two servers answer the same bytes."""
    return json.dumps(doc, ensure_ascii=True, sort_keys=True, separators=(",", ":")).encode() \
        + b"\n"


def state_body(state: RankState, args: Params) -> bytes:
    """``/v1/state[?since=N][&recent=N][&packed=true]``: the rank's state document."""
    since = int_param(args, "since", -MAX_STEP, MAX_STEP)
    recent = int_param(args, "recent", 0, MAX_RECENT)
    packed = bool_param(args, "packed")
    doc = state.snapshot()
    if since is not None:
        doc = state_since(doc, since)
    if recent is not None:
        doc = state_recent(doc, recent)
    if packed:
        doc = state_packed(doc)
    return json_body(doc)


def fr_trace_body(state: RankState, tracker: IncarnationTracker | None, args: Params,
                  fr_dumper: Callable[..., bytes] = fr_dump) -> bytes:
    """``/v1/fr_trace[?onlyactive=true][&pg=NAME][&last=N]``: the Flight Recorder dump (JSON)."""
    only_active = bool_param(args, "onlyactive")
    pg = args.get("pg")
    last = int_param(args, "last", 1, MAX_LAST)
    if pg is not None and not pg.strip():
        raise BadParameter("pg must name a process group (or 'torchft'), got ''")
    # Bytes straight through: a full dump is ~1 MB of JSON, and parsing and re-serializing it
    # here would hold the GIL the training thread needs. Only a filtered request (a monitor's
    # drill-down) pays one parse, to answer kilobytes instead of that megabyte.
    if not _FR_CALLERS.acquire(blocking=False):
        raise FlightRecorderBusy("another Flight Recorder dump is running and one waits for "
                                 "it; retry later")
    try:
        if not _FR_DUMPING.take():
            raise FlightRecorderBusy("another Flight Recorder dump is still running; retry later")
        try:
            body = fr_dumper(tracker, identity_keys(state), only_active=only_active)
        finally:
            _FR_DUMPING.give()
    finally:
        _FR_CALLERS.release()
    if pg is not None or last is not None:
        body = filter_fr_dump(body, pg, last, only_active)
    return body


def stacks_body(state: RankState, args: Params) -> tuple[bytes, str]:
    """``/v1/stacks[?format=text|json]``: (body, content type)."""
    fmt = choice_param(args, "format", ("text", "json"), "text")
    stacks = thread_stacks()
    if fmt == "json":
        return json_body({"pid": state.identity.pid, "rank": state.identity.rank,
                          "threads": stacks}), "application/json"
    return format_stacks(stacks).encode(), "text/plain; charset=utf-8"
