"""Flask app factory for the WorkerServer: thin, read-only routes over plain functions.

Every debug route is GET-only; the routes that act, fault injection, exit (a monitor ending a
rank of an evicted group), abort (failing a collective blocked on a dead peer) and probe (the rank
opening connections to its peers), are off unless the process opts in with a token (and, for
the first three, a handler). An unknown path or a bad parameter answers 4xx with a JSON error;
an endpoint that fails inside answers 500 with the reason, and the server keeps serving.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from flask import Flask, Response, jsonify, request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from werkzeug.exceptions import HTTPException

from http_serving import bearer_token_matches

from .abort import NothingToAbort, abort_request
from .flight_recorder import (
    FlightRecorderNotAvailable,
    IncarnationTracker,
    fr_dump,
    is_torchft_pg_name,
)
from .metrics import WorkerMetrics
from .packed import state_packed
from .probe import DEFAULT_BYTES, MAX_BYTES, payload, probe_peers, probe_request
from .stacks import format_stacks, thread_stacks
from .state import RankState

MAX_BODY = 16 * 1024
# the words a boolean query parameter may be (any case)
BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


class BadParameter(ValueError):
    """A query parameter with a value the endpoint does not accept (answered 400)."""


def bool_param(name: str, default: bool = False) -> bool:
    raw = request.args.get(name)
    if raw is None:
        return default
    try:
        return BOOL_WORDS[raw.strip().lower()]
    except KeyError:
        raise BadParameter(f"{name} must be true or false, got {raw!r}") from None


def choice_param(name: str, choices: tuple[str, ...], default: str) -> str:
    raw = request.args.get(name, default)
    if raw not in choices:
        raise BadParameter(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
    return raw


def int_param(name: str, lo: int, hi: int) -> int | None:
    raw = request.args.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise BadParameter(f"{name} must be an integer in [{lo}, {hi}], got {raw!r}") from None
    if not lo <= value <= hi:
        raise BadParameter(f"{name} must be an integer in [{lo}, {hi}], got {raw!r}")
    return value


MAX_LAST = 1_000_000
MAX_STEP = 1 << 62  # ``since`` bound: any torchft step fits, a huge value is a bad parameter
MAX_RECENT = 1 << 20  # ``recent`` bound: more than any rank keeps


def state_since(doc: dict[str, Any], since: int) -> dict[str, Any]:
    """``/v1/state?since=N``: ``timing.recent`` holds only the rows of steps after N, and
    ``timing.since`` says it was cut (N). A monitor that folded this rank's rows up to step N
    asks for the rest only: at 100,000 ranks a leader's answer is then one or two rows, not 16,
    and the rows are most of what the monitor parses (docs/scaling.md). Everything else in the
    document is as ``/v1/state`` serves it (``last_step`` and ``window`` too)."""
    timing = doc.get("timing")
    if isinstance(timing, dict) and isinstance(timing.get("recent"), list):
        timing["recent"] = [r for r in timing["recent"]
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


def filter_fr_dump(body: bytes, pg: str | None, last: int | None) -> bytes:
    """``/v1/fr_trace?pg=<name>&last=N``: only the entries of one process group, the newest N.

    ``pg=torchft`` is torchft's cross-replica-group group, every incarnation of it (entries whose
    ``pg_id`` an incarnation names, or whose name is torchft's: ``''`` or
    ``torchft_quorum_*``); any other value matches a process group's name or description exactly.
    ``last`` keeps the newest N entries (of that group, when both are given). Every other key is
    kept as it is, and ``filter`` says what was left out (``entries_total`` in the full dump).
    A dump that is not a JSON object with an ``entries`` list is returned unchanged."""
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
    return json.dumps(doc, separators=(",", ":")).encode()


def bearer_matches(token: str) -> bool:
    """The request carries ``Authorization: Bearer <token>`` (compared in constant time)."""
    return bearer_token_matches(request.headers.get("Authorization"), token)


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


def create_app(
    state: RankState,
    tracker: IncarnationTracker | None = None,
    metrics: WorkerMetrics | None = None,
    fr_dumper: Callable[..., bytes] = fr_dump,
    fault_handler: Callable[[str], Any] | None = None,
    fault_token: str | None = None,
    exit_handler: Callable[[str], Any] | None = None,
    exit_token: str | None = None,
    abort_handler: Callable[[str, int | None], dict] | None = None,
) -> Flask:
    """The WorkerServer's routes. ``fault_handler`` + ``fault_token`` opt in to ``POST
    /v1/faults`` (fault injection for tests and the demo), ``exit_handler`` + ``exit_token`` to
    ``POST /v1/exit`` (the process ends: a monitor finishing an eviction), ``abort_handler`` +
    ``exit_token`` to ``POST /v1/abort`` (the cross-group process group is aborted, the process
    goes on) and ``exit_token`` alone to ``POST /v1/probe``; without them a route answers 403.
    ``GET /v1/probe/payload`` is read-only and always served."""
    app = Flask("lightkeeper.worker_server")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY  # 413 beyond it (a fault spec is a short line)
    metrics = metrics or WorkerMetrics(state)

    @app.get("/healthz")
    def healthz():
        return jsonify(status="ok")

    @app.get("/v1/state")
    def v1_state():
        since = int_param("since", -MAX_STEP, MAX_STEP)
        recent = int_param("recent", 0, MAX_RECENT)
        packed = bool_param("packed")
        doc = state.snapshot()
        if since is not None:
            doc = state_since(doc, since)
        if recent is not None:
            doc = state_recent(doc, recent)
        if packed:
            doc = state_packed(doc)
        return jsonify(doc)

    @app.get("/v1/fr_trace")
    def v1_fr_trace():
        only_active = bool_param("onlyactive")
        pg = request.args.get("pg")
        last = int_param("last", 1, MAX_LAST)
        if pg is not None and not pg.strip():
            raise BadParameter("pg must name a process group (or 'torchft'), got ''")
        # Bytes straight through: a full dump is ~1 MB of JSON, and parsing and re-serializing it
        # here would hold the GIL the training thread needs. Only a filtered request (a
        # monitor's drill-down) pays one parse, to answer kilobytes instead of that megabyte.
        body = fr_dumper(tracker, identity_keys(state), only_active=only_active)
        if pg is not None or last is not None:
            body = filter_fr_dump(body, pg, last)
        return Response(body, mimetype="application/json")

    @app.get("/v1/stacks")
    def v1_stacks():
        fmt = choice_param("format", ("text", "json"), "text")
        stacks = thread_stacks()
        if fmt == "json":
            return jsonify(pid=state.identity.pid, rank=state.identity.rank, threads=stacks)
        return Response(format_stacks(stacks), mimetype="text/plain")

    @app.get("/metrics")
    def prometheus_metrics():
        return Response(generate_latest(metrics.registry), mimetype=CONTENT_TYPE_LATEST)

    @app.post("/v1/faults")
    def v1_faults():
        if fault_handler is None or not fault_token:
            return jsonify(error="fault injection is disabled on this rank (start the trainer "
                                 "with LIGHTKEEPER_FAULT_TOKEN set to enable it)", status=403), 403
        if not bearer_matches(fault_token):
            return jsonify(error="missing or wrong bearer token", status=401), 401
        body = request.get_json(silent=True)
        spec = body.get("spec") if isinstance(body, dict) else None
        if not isinstance(spec, str):
            raise BadParameter('body must be JSON {"spec": "KIND:KEY=VALUE,..."}')
        try:
            fault_handler(spec)
        except ValueError as e:
            raise BadParameter(str(e)) from None
        return jsonify(injected=spec, faults=state.faults)

    @app.post("/v1/exit")
    def v1_exit():
        if exit_handler is None or not exit_token:
            return jsonify(error="exit is disabled on this rank (start it with "
                                 "LIGHTKEEPER_EXIT_TOKEN set to let a monitor end it)",
                           status=403), 403
        if not bearer_matches(exit_token):
            return jsonify(error="missing or wrong bearer token", status=401), 401
        body = request.get_json(silent=True)
        reason = body.get("reason") if isinstance(body, dict) else None
        exit_handler(reason if isinstance(reason, str) else "POST /v1/exit")
        return jsonify(exiting=True, pid=state.identity.pid, rank=state.identity.rank), 202

    def token_refusal(what: str, handler_ok: bool = True):
        """403 while the route is off, 401 without the exit token; None when allowed."""
        if not handler_ok or not exit_token:
            return jsonify(error=f"{what} is disabled on this rank (start it with "
                                 "LIGHTKEEPER_EXIT_TOKEN set to let a monitor use it)",
                           status=403), 403
        if not bearer_matches(exit_token):
            return jsonify(error="missing or wrong bearer token", status=401), 401
        return None

    @app.post("/v1/abort")
    def v1_abort():
        refused = token_refusal("abort", abort_handler is not None)
        if refused:
            return refused
        try:
            reason, decision = abort_request(request.get_json(silent=True))
        except ValueError as e:
            raise BadParameter(str(e)) from None
        try:
            return jsonify(abort_handler(reason, decision)), 202
        except NothingToAbort as e:
            return jsonify(error=f"nothing to abort: {e}", status=409), 409

    @app.post("/v1/probe")
    def v1_probe():
        refused = token_refusal("probing peers")
        if refused:
            return refused
        try:
            req = probe_request(request.get_json(silent=True))
        except ValueError as e:
            raise BadParameter(str(e)) from None
        ident = state.identity
        return jsonify({"from": {"worker_url": state.worker_url, "host": ident.host,
                                 "node": ident.host, "hostname": state.hostname,
                                 "rank": ident.rank, "replica_group": ident.replica_group},
                        "bytes": req.nbytes, "timeout_s": req.timeout_s,
                        "results": probe_peers(req)})

    @app.get("/v1/probe/payload")
    def v1_probe_payload():
        n = int_param("bytes", 0, MAX_BYTES)
        n = DEFAULT_BYTES if n is None else n
        return Response(payload(n), mimetype="application/octet-stream",
                        headers={"Content-Length": str(n), "Cache-Control": "no-store"})

    @app.errorhandler(BadParameter)
    def bad_parameter(e: BadParameter):
        return jsonify(error=str(e), status=400), 400

    @app.errorhandler(FlightRecorderNotAvailable)
    def fr_not_available(e: FlightRecorderNotAvailable):
        # this torch has no such call (worker_server/flight_recorder.py): not a failure
        return jsonify(error=str(e), status=501, path=request.path, torch=e.torch_version,
                       missing=e.missing), 501

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        return jsonify(error=e.description, status=e.code, path=request.path), e.code

    @app.errorhandler(Exception)
    def internal_error(e: Exception):
        app.logger.exception("endpoint %s failed", request.path)
        return jsonify(error=f"{type(e).__name__}: {e}", status=500, path=request.path), 500

    return app
