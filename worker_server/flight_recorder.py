"""This rank's Flight Recorder dump, made interpretable across torchft quorums.

torchft rebuilds its cross-replica-group process group at every quorum change: sequence ids
restart at 1, ``pg_id`` grows per process and, on gloo, the group has an empty name. A raw dump
therefore cannot tell which entries belong to which quorum. :class:`IncarnationTracker` hooks the
call that rebuilds the group (torchft 0.2's ``configure(...)``, nightly's ``reconfigure(opts)``)
and records, per incarnation, the quorum id, this rank's position and the group's members next to
the record id where it began; :func:`fr_dump` adds that list to the dump as ``incarnations`` (see
docs/CONTRACTS.md).

Which torch has which dump (``torch._C._distributed_c10d``), as read in torch's sources:

============================  ===============  =============================================
call                          torch            what it dumps
============================  ===============  =============================================
``_dump_nccl_trace``          2.3+, NCCL       ProcessGroupNCCL's recorder, pickle
``_dump_nccl_trace_json``     2.5+, NCCL       ProcessGroupNCCL's recorder, JSON (used here)
``_dump_fr_trace``            2.8+             the generic recorder (gloo, ...), pickle
``_dump_fr_trace_json``       2.8+             the generic recorder, JSON (used here)
============================  ===============  =============================================

The two JSON calls dump two different recorders: NCCL's entries are only in
``_dump_nccl_trace_json`` (CUDA builds), gloo's only in ``_dump_fr_trace_json``. Where a GPU is
in use and torch has both, both are served as one dump (rank_wire.recorders: the generic
recorder's ids moved past NCCL's, NCCL's record ids up by one), parsed and written again: a
TorchTitan job on GPUs runs torchft's cross-group all-reduce on gloo by default, while FSDP's
collectives go to NCCL. Elsewhere the first of them that holds entries is served. So a gloo job
on torch 2.7 (torchft 0.2's floor) has no dump to serve: :func:`raw_dump_json` raises
:class:`FlightRecorderNotAvailable`, which the WorkerServer answers ``501`` with a JSON reason
naming the torch version; the rank's state, stacks and metrics are served as usual. A dump that
this torch could produce but did not (Flight Recorder disabled, the call failed) raises
:class:`FlightRecorderUnavailable`, answered 500 with the reason.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from rank_wire import recorders

from .autostart import say


class FlightRecorderUnavailable(RuntimeError):
    """torch cannot dump its Flight Recorder here."""


class FlightRecorderNotAvailable(FlightRecorderUnavailable):
    """This torch has no Flight Recorder call that could dump this rank (HTTP 501)."""

    def __init__(self, reason: str, torch_version: str | None, missing: list[str]) -> None:
        super().__init__(reason)
        self.torch_version = torch_version
        self.missing = missing


class FlightRecorderBusy(FlightRecorderUnavailable):
    """Another request's dump is still running (HTTP 503): one dump at a time, so a wedged
    one holds one of the server's threads, not all of them."""


NCCL_JSON, GENERIC_JSON = "_dump_nccl_trace_json", "_dump_fr_trace_json"
SINCE = {NCCL_JSON: "torch 2.5, CUDA builds", GENERIC_JSON: "torch 2.8"}


def _call(dump: Callable[..., bytes], only_active: bool) -> bytes:
    try:
        return dump(includeCollectives=True, onlyActive=only_active)
    except TypeError:  # a torch whose binding takes other keywords: its defaults
        return dump()


def _merging(torch: Any, c10d: Any) -> bool:
    """Whether this process serves both recorders as one dump (a GPU in use, both calls)."""
    return torch.cuda.is_available() and hasattr(c10d, NCCL_JSON) and hasattr(c10d, GENERIC_JSON)


def _merged(c10d: Any, only_active: bool) -> bytes:
    """Both recorders' dumps as one (rank_wire.recorders), either alone if the other's call
    fails; raises :class:`FlightRecorderUnavailable` when both fail."""
    docs, errors = {}, []
    for name in (GENERIC_JSON, NCCL_JSON):
        try:
            raw = bytes(_call(getattr(c10d, name), only_active)).strip()
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError(f"not a JSON object: {raw[:80]!r}")
            docs[name] = doc
        except Exception as e:  # the other recorder's dump still counts
            errors.append(f"{name}: {type(e).__name__}: {e}")
    if not docs:
        raise FlightRecorderUnavailable("; ".join(errors))
    merged = recorders.merge(docs.get(GENERIC_JSON), docs.get(NCCL_JSON, {}))
    return json.dumps(merged, separators=(",", ":")).encode()


def raw_dump_json(only_active: bool = False) -> bytes:
    """torch's Flight Recorder dump as JSON bytes: both recorders as one where a GPU is in use
    and torch has both calls (:func:`_merged`); else NCCL's recorder on a CUDA build unless it
    is empty and the generic one (gloo's) is not, else the generic one.

    Raises :class:`FlightRecorderNotAvailable` when this torch has no call to make (see the
    module doc), :class:`FlightRecorderUnavailable` when every call failed."""
    try:
        import torch
        import torch._C._distributed_c10d as c10d
    except ImportError as e:
        raise FlightRecorderNotAvailable(f"no Flight Recorder: torch.distributed cannot be "
                                         f"imported ({e})", None, [NCCL_JSON, GENERIC_JSON]
                                         ) from None
    version = str(getattr(torch, "__version__", "?"))
    if _merging(torch, c10d):
        return _merged(c10d, only_active)
    dumpers: list[Callable[..., bytes]] = []
    cuda = torch.cuda.is_available()
    if cuda and hasattr(c10d, NCCL_JSON):
        dumpers.append(getattr(c10d, NCCL_JSON))
    if hasattr(c10d, GENERIC_JSON):
        dumpers.append(getattr(c10d, GENERIC_JSON))
    if not dumpers:
        wanted = [NCCL_JSON, GENERIC_JSON] if cuda else [GENERIC_JSON]
        raise FlightRecorderNotAvailable(
            f"Flight Recorder JSON dump not available in torch {version}: "
            + "; ".join(f"torch._C._distributed_c10d.{n} is missing (since {SINCE[n]})"
                        for n in wanted), version, wanted)
    errors = []
    empty: bytes | None = None  # the first valid dump without entries, served if none has any
    for dump in dumpers:
        try:
            raw = bytes(_call(dump, only_active)).strip()
        except Exception as e:  # try the next flavour, report all if none works
            errors.append(f"{type(e).__name__}: {e}")
            continue
        if not (raw.startswith(b"{") and raw.endswith(b"}")):
            errors.append(f"not a JSON object: {raw[:80]!r}")
        elif b'"record_id"' in raw:
            return raw
        elif empty is None:
            empty = raw
    if empty is not None:
        return empty
    raise FlightRecorderUnavailable("; ".join(errors))


# One entry's (pg_id, group name, record_id), read straight from the dump's bytes: torch writes
# entry keys in sorted order (nlohmann::json), so pg_id, process_group and record_id come in
# that order inside each entry object. Entries hold no nested objects, so [^{}] stays inside one.
_ENTRY_RE = re.compile(
    rb'"pg_id":\s*(\d+),\s*"process_group":\s*\["((?:[^"\\]|\\.)*)"[^{}]*?"record_id":\s*(\d+)'
)


def entry_index(raw: bytes) -> list[tuple[int, int, str]]:
    """(record_id, pg_id, process-group name) of every entry in a JSON dump.

    Reads the bytes with a regular expression instead of parsing ~1 MB of JSON under the GIL
    (the training thread's time); falls back to a full parse when the dump is laid out
    differently (the count of entries found must match the count of ``record_id`` keys).
    """
    found = [(int(r), int(p), json.loads(b'"' + n + b'"') if b"\\" in n else n.decode())
             for p, n, r in _ENTRY_RE.findall(raw)]
    if len(found) == raw.count(b'"record_id"'):
        return found
    entries = json.loads(raw).get("entries") or []
    return [(int(e.get("record_id", -1)), int(e.get("pg_id", -1)),
             str((e.get("process_group") or [""])[0])) for e in entries]


def _next_record_id(raw: bytes) -> int:
    return max((rid for rid, _, _ in entry_index(raw)), default=-1) + 1


class IncarnationTracker:
    """Remembers every torchft process-group incarnation this rank has been part of."""

    def __init__(self, group_rank: int, max_incarnations: int = 256) -> None:
        self.group_rank = group_rank
        self._lock = threading.Lock()
        self._incarnations: list[dict[str, Any]] = []
        self._max = max_incarnations
        self._said = False
        self._said_handles = False  # an empty reconfigure handle explained (once)

    def hook(self, manager: Any) -> str:
        """Record every rebuild of ``manager``'s process group; returns the call it wraps.

        torchft 0.2's group has ``configure(...)``; nightly's has ``reconfigure(opts)`` (a plain
        torch group made with ``enable_reconfigure=True`` takes no Python attributes, so then the
        Manager's ``_reconfigure_pg`` is wrapped). Raises ``AttributeError`` when there is none of
        them (the caller says so and serves the rest). A failure to record is said once on stderr
        and never reaches the training loop."""
        pg = manager._pg
        if callable(getattr(pg, "configure", None)):
            self._wrap(pg, "configure", pg, _configure_fields)
            return "configure"
        if callable(getattr(pg, "reconfigure", None)):
            try:
                self._wrap(pg, "reconfigure", pg, _reconfigure_fields)
                return "reconfigure"
            except (AttributeError, TypeError):
                pass
            if callable(getattr(manager, "_reconfigure_pg", None)):
                self._wrap(manager, "_reconfigure_pg", pg, _reconfigure_pg_fields)
                return "Manager._reconfigure_pg"
        raise AttributeError(f"no configure(...) (torchft 0.2) or reconfigure(opts) (nightly) "
                             f"to wrap on {type(pg).__name__}")

    def _wrap(self, owner: Any, name: str, pg: Any, fields: Callable[..., dict]) -> None:
        """Replace ``owner.<name>`` by a wrapper that calls it, then records the incarnation that
        ``fields`` reads from the call (idempotent); raises when ``owner`` takes no attribute."""
        original = getattr(owner, name)
        if getattr(original, "_lightkeeper_hooked", False):
            return

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            first = _first_record_id(pg)
            try:
                result = original(*args, **kwargs)
            except Exception:
                if not self._said_handles and "" in _handles(args, kwargs):
                    self._said_handles = True  # else only torchft's JSONDecodeError, each step
                    say("the Lighthouse gave this group an empty reconfigure handle: a torchft "
                        "0.2.x Lighthouse (or group) with torchft-nightly ranks; run nightly's "
                        "torchft_lighthouse, nightly on its path too, and one torchft in every "
                        "group (docs/install.md)")
                raise
            try:
                self.record(**fields(pg, original, args, kwargs), first_record_id=first)
            except Exception as e:  # a shape this code does not know: say so once, train on
                if not self._said:
                    self._said = True
                    say(f"Flight Recorder incarnation not recorded ({type(e).__name__}: {e}); "
                         "training goes on")
            return result

        wrapper._lightkeeper_hooked = True  # type: ignore[attr-defined]
        setattr(owner, name, wrapper)

    def record(self, *, quorum_id, replica_rank, replica_world_size, global_ranks,
               first_record_id) -> None:
        with self._lock:
            self._incarnations.append({
                "pg_id": None,
                "pg_name": None,
                "quorum_id": None if quorum_id is None else int(quorum_id),
                "group_rank": self.group_rank,
                "replica_rank": int(replica_rank),
                "replica_world_size": int(replica_world_size),
                "global_ranks": global_ranks,
                "first_record_id": int(first_record_id),
                "started_ns": time.time_ns(),
            })
            del self._incarnations[: -self._max]

    def annotate(self, raw: bytes) -> list[dict[str, Any]]:
        """The incarnation list for a JSON dump, with ``pg_id``/``pg_name`` resolved from it.

        The first torchft-group entry at or after an incarnation's first record id carries the
        incarnation's ``pg_id``; once seen it is remembered, so later dumps whose ring buffer has
        wrapped past that entry still know it (and need not be read for it again).
        """
        with self._lock:
            incs = self._incarnations
            unresolved = [i for i, inc in enumerate(incs) if inc["pg_id"] is None]
            index = entry_index(raw) if unresolved else []
            for i in unresolved:
                inc = incs[i]
                end = incs[i + 1]["first_record_id"] if i + 1 < len(incs) else None
                for rid, pg_id, name in index:
                    if rid < inc["first_record_id"] or (end is not None and rid >= end):
                        continue
                    if recorders.is_torchft_pg_name(name):
                        inc["pg_id"], inc["pg_name"] = pg_id, name
                        break
            return [dict(inc) for inc in incs]

    def unresolved(self) -> bool:
        with self._lock:
            return any(inc["pg_id"] is None for inc in self._incarnations)

    def current(self) -> dict[str, Any] | None:
        with self._lock:
            return dict(self._incarnations[-1]) if self._incarnations else None


def _first_record_id(pg: Any = None) -> int:
    """The record id, as ``/v1/fr_trace`` serves it, that the next entry of torchft's group
    ``pg`` will get in its recorder (0 without a dump). Read with a regular expression, not
    parsed: this runs on the training thread, at every quorum change."""
    try:
        import torch
        import torch._C._distributed_c10d as c10d

        if _merging(torch, c10d):
            nccl = _records_in_nccl(pg)
            raw = bytes(_call(getattr(c10d, NCCL_JSON if nccl else GENERIC_JSON), False))
            return recorders.moved_record_id(_next_record_id(raw), nccl)
        return _next_record_id(raw_dump_json())
    except Exception:
        return 0


def _records_in_nccl(pg: Any) -> bool:
    """Whether torchft's group ``pg`` records in NCCL's recorder: its class (through torchft's
    wrappers, ``_pg``) is a ProcessGroupNCCL, or a torch group's backend is ``nccl``. A Baby
    group records in its child process, neither here."""
    for _ in range(4):
        if pg is None:
            return False
        name = type(pg).__name__
        if "NCCL" in name:
            return "Baby" not in name
        backend = getattr(pg, "_get_backend_name", None)
        if callable(backend):
            try:
                return "nccl" in str(backend()).lower()
            except Exception:
                return False
        pg = getattr(pg, "_pg", None)
    return False


def _configure_fields(pg, original, args, kwargs) -> dict[str, Any]:
    """torchft 0.2: ``configure(store_addr, replica_id, rank, world_size, quorum_id,
    group_rank, group_world_size, global_ranks)``."""
    a = inspect.signature(original).bind(*args, **kwargs).arguments
    ranks = a.get("global_ranks")
    return {"quorum_id": a.get("quorum_id"), "replica_rank": a["rank"],
            "replica_world_size": a["world_size"],
            "global_ranks": list(ranks) if ranks is not None else None}


def _handles(args: tuple, kwargs: dict) -> list:
    """The handles of a nightly ``reconfigure(opts)`` or ``_reconfigure_pg(id, handles)`` call."""
    opts = args[0] if args else kwargs.get("opts")
    found = getattr(opts, "handles", None)
    if found is None:
        found = kwargs.get("handles", args[1] if len(args) > 1 else None)
    return list(found) if isinstance(found, (list, tuple)) else []


def _reconfigure_fields(pg, original, args, kwargs) -> dict[str, Any]:
    """nightly: ``reconfigure(opts)``, ``opts.uuid`` the quorum id (the Manager's communicator
    id), ``opts.handles`` the members in rank order; torchft's handles are JSON with ``id`` and
    ``global_rank``, a plain torch group's are its own (then its ``rank()`` after the call)."""
    opts = args[0] if args else kwargs["opts"]
    return _from_handles(pg, opts.uuid, list(opts.handles))


def _reconfigure_pg_fields(pg, original, args, kwargs) -> dict[str, Any]:
    """nightly's ``Manager._reconfigure_pg(communicator_id, handles)``."""
    a = inspect.signature(original).bind(*args, **kwargs).arguments
    return _from_handles(pg, a["communicator_id"], list(a["handles"]))


def _from_handles(pg, quorum_id, handles: list[str]) -> dict[str, Any]:
    try:
        peers = [json.loads(h) for h in handles]
        ids = [p["id"] for p in peers]
        ranks = [p.get("global_rank") for p in peers]
    except (ValueError, TypeError, KeyError):
        ids, ranks = [], [None]
    handle_id = getattr(pg, "_handle_id", None)
    own = handle_id() if callable(handle_id) else None
    return {"quorum_id": quorum_id,
            "replica_rank": ids.index(own) if own in ids else pg.rank(),
            "replica_world_size": len(handles),
            "global_ranks": None if None in ranks else ranks}


def fr_dump(tracker: IncarnationTracker | None, identity: dict[str, Any],
            only_active: bool = False) -> bytes:
    """The ``/v1/fr_trace`` document as JSON bytes: torch's dump plus who-am-I keys and
    ``incarnations``, spliced in without parsing and re-serializing the dump."""
    raw = raw_dump_json(only_active=only_active)
    # Resolve pg ids against the full buffer even when only active entries are served.
    full = raw_dump_json() if (only_active and tracker is not None and tracker.unresolved()) \
        else raw
    extra = dict(identity)
    extra["dump_time_ns"] = time.time_ns()
    extra["incarnations"] = tracker.annotate(full) if tracker is not None else []
    if only_active:  # said, as an unfiltered dump has no ``filter`` to say it in
        extra["only_active"] = True
    keys = json.dumps(extra, separators=(",", ":"))[1:-1].encode()
    body = raw[:-1].rstrip()
    return body + (b"," if not body.endswith(b"{") else b"") + keys + b"}"
