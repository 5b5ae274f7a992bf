"""Flask app factory for the WorkerServer: thin, read-only routes over plain functions.

Every debug route is GET-only; the routes that act, fault injection, exit (a monitor ending a
rank of an evicted group), abort (failing a collective blocked on a dead peer) and probe (the rank
opening connections to its peers), are off unless the process opts in with a token (and, for
the first three, a handler). An unknown path or a bad parameter answers 4xx with a JSON error;
an endpoint that fails inside answers 500 with the reason, and the server keeps serving.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flask import Flask, Response, jsonify, request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from werkzeug.exceptions import HTTPException, ServiceUnavailable

from http_serving import bearer_token_matches
from rank_wire import MONITOR_AGENT

from .abort import MAX_REASON, NothingToAbort, abort_request
from .endpoints import (  # noqa: F401 (filter_fr_dump, state_since, state_recent: re-exported)
    BadParameter,
    filter_fr_dump,
    fr_trace_body,
    int_param,
    stacks_body,
    state_body,
    state_recent,
    state_since,
)
from .flight_recorder import (
    FlightRecorderBusy,
    FlightRecorderNotAvailable,
    IncarnationTracker,
    fr_dump,
)
from .metrics import WorkerMetrics
from .probe import DEFAULT_BYTES, MAX_BYTES, payload, probe_peers, probe_request
from .state import RankState

MAX_BODY = 16 * 1024
def bearer_matches(token: str) -> bool:
    """The request carries ``Authorization: Bearer <token>`` (compared in constant time)."""
    return bearer_token_matches(request.headers.get("Authorization"), token)


def create_app(
    state: RankState,
    tracker: IncarnationTracker | None = None,
    metrics: WorkerMetrics | None = None,
    fr_dumper: Callable[..., bytes] = fr_dump,
    fault_handler: Callable[[str], Any] | None = None,
    fault_token: str | None = None,
    exit_handler: Callable[[str], Any] | None = None,
    exit_token: str | None = None,
    abort_handler: Callable[[str, int | None, int | None], dict] | None = None,
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
        finished = state.finished  # before the snapshot: the answer says at least this
        response = Response(state_body(state, request.args), mimetype="application/json")
        if request.headers.get("User-Agent", "").startswith(MONITOR_AGENT):  # finish() waits
            response.call_on_close(lambda: state.state_read(finished))  # once it was written
        return response

    @app.get("/v1/fr_trace")
    def v1_fr_trace():
        return Response(fr_trace_body(state, tracker, request.args, fr_dumper),
                        mimetype="application/json")

    @app.get("/v1/stacks")
    def v1_stacks():
        body, content_type = stacks_body(state, request.args)
        return Response(body, content_type=content_type)

    @app.get("/metrics")
    def prometheus_metrics():
        return Response(generate_latest(metrics.registry), content_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/faults")
    def v1_faults():
        if fault_handler is None:  # `lightkeeper run` and plain scripts: nothing to inject
            return jsonify(error="this rank serves no fault injection: its program has no fault "
                                 "handler (`lightkeeper train` has one)", status=403), 403
        if not fault_token:
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
        # the reason goes to the job's log: one line, as long as an abort's at most
        reason = " ".join(reason.split())[:MAX_REASON] if isinstance(reason, str) else ""
        exit_handler(reason or "POST /v1/exit")
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
            reason, decision, quorum_id = abort_request(request.get_json(silent=True))
        except ValueError as e:
            raise BadParameter(str(e)) from None
        try:
            return jsonify(abort_handler(reason, decision, quorum_id)), 202
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
        results, control = probe_peers(req, state.control_url or state.worker_url)
        return jsonify({"from": {"worker_url": state.worker_url, "host": ident.host,
                                 "node": ident.host, "hostname": state.hostname,
                                 "rank": ident.rank, "replica_group": ident.replica_group},
                        "bytes": req.nbytes, "timeout_s": req.timeout_s,
                        "results": results, "control": control})

    @app.get("/v1/probe/payload")
    def v1_probe_payload():
        n = int_param(request.args, "bytes", 0, MAX_BYTES)
        n = DEFAULT_BYTES if n is None else n
        return Response(payload(n), mimetype="application/octet-stream",
                        headers={"Content-Length": str(n), "Cache-Control": "no-store"})

    @app.errorhandler(BadParameter)
    def bad_parameter(e: BadParameter):
        return jsonify(error=str(e), status=400, path=request.path), 400  # as every error

    @app.errorhandler(FlightRecorderNotAvailable)
    def fr_not_available(e: FlightRecorderNotAvailable):
        # this torch has no such call (worker_server/flight_recorder.py): not a failure
        return jsonify(error=str(e), status=501, path=request.path, torch=e.torch_version,
                       missing=e.missing), 501

    @app.errorhandler(FlightRecorderBusy)
    def fr_busy(e: FlightRecorderBusy):
        return http_error(ServiceUnavailable(str(e), retry_after=1))

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        resp = jsonify(error=e.description, status=e.code, path=request.path)
        resp.status_code = e.code
        # werkzeug's own headers (a 405's Allow) without its text/html Content-Type
        resp.headers.extend((k, v) for k, v in e.get_headers() if k.lower() != "content-type")
        return resp

    @app.errorhandler(Exception)
    def internal_error(e: Exception):
        # one line: a monitor polling a failing endpoint must not fill the job's log
        app.logger.error("endpoint %s failed: %s: %s", request.path, type(e).__name__, e)
        return jsonify(error=f"{type(e).__name__}: {e}", status=500, path=request.path), 500

    return app
