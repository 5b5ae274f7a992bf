"""Flask app factory for the WorkerServer: thin, read-only routes over plain functions.

Every debug route is GET-only; the routes that act, fault injection, exit (a monitor ending a
rank of an evicted group), abort (failing a collective blocked on a dead peer) and probe (the rank
opening connections to its peers), are off unless the process opts in with a token (and, for
the first three, a handler). An unknown path or a bad parameter answers 4xx with a JSON error;
an endpoint that fails inside answers 500 with the reason, and the server keeps serving.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from flask import Flask, Response, jsonify, request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from werkzeug.exceptions import HTTPException, ServiceUnavailable

from http_serving import bearer_token_matches
from rank_wire import MONITOR_AGENT
from rank_wire import auth as rank_auth

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
UNAUTHORIZED = ("missing or wrong signature or bearer token (a signature is for one rank: its "
                "replica group, group rank and replica id)")
EXIT_AUTH = ("any", "hmac")  # LIGHTKEEPER_EXIT_AUTH: what a monitor's call may carry
BEARER_OFF = ("the bearer token is not taken on this rank (LIGHTKEEPER_EXIT_AUTH=hmac): the "
              "monitor must sign its calls (an older monitor, or one run with --rank-auth "
              "bearer, is refused)")
BEARER_TAKEN = ("a monitor called with the bearer token (deprecated: it sends the token to every "
                "rank it calls): set LIGHTKEEPER_EXIT_AUTH=hmac once the monitor signs its "
                "calls, and rotate LIGHTKEEPER_EXIT_TOKEN if an older monitor ever ran")
PROBE_BUSY = "another probe is running on this rank: one at a time"
# required on purpose: a browser cannot send this type to another site without a preflight
NOT_JSON_TYPED = ("the body must be sent with the header Content-Type: application/json "
                  "(required: a browser cannot send it cross-site without a preflight)")


def bearer_matches(token: str) -> bool:
    """The request carries ``Authorization: Bearer <token>`` (compared in constant time)."""
    return bearer_token_matches(request.headers.get("Authorization"), token)


def json_body() -> Any:
    """The request's JSON body (None: none, or not JSON); a body sent without ``Content-Type:
    application/json`` is a 400 naming that header, not "not JSON" (a plain ``curl -d``)."""
    if not request.is_json and request.get_data(cache=True).strip():
        raise BadParameter(NOT_JSON_TYPED)
    return _get_json()


def _get_json() -> Any:
    """werkzeug's silent ``get_json``, which lets a RecursionError (``[[[...`` nested too
    deeply for the parser) through as a 500 and an ERROR line in the job's log: a 400 here."""
    try:
        return request.get_json(silent=True)
    except RecursionError:
        raise BadParameter("the body's JSON is nested too deeply") from None


def monitor_call_refusal(state: RankState, token: str, exit_auth: str = "any") -> str | None:
    """Why the request may not act on this rank (401), or None: it is signed with ``token``
    for this very rank (rank_wire.auth) or, from a monitor older than signatures (deprecated),
    carries the token as a bearer, unless ``exit_auth`` is ``hmac``."""
    authorization = request.headers.get("Authorization")
    signature = rank_auth.signature_of(authorization)
    if signature is None:
        if exit_auth == "hmac":
            return BEARER_OFF
        return None if bearer_token_matches(authorization, token) else UNAUTHORIZED
    ident = state.identity
    signed = rank_auth.verify(token, request.method, signed_path(request.environ),
                              rank_auth.identity(ident.replica_group, ident.group_rank,
                                                 state.replica_id),
                              request.get_data(cache=True), signature)
    return None if signed else UNAUTHORIZED


def payload_signed(environ: Mapping[str, Any], state: RankState, token: str | None) -> bool:
    """Whether the request (a WSGI environ) is a peer's ``GET`` of the probe payload signed with
    the ranks' ``token`` for this rank's address (a peer dials the worker_url it advertises; its
    own control probe, its control_url): a fetch seen on the wire reaches no other rank."""
    signature = rank_auth.signature_of(environ.get("HTTP_AUTHORIZATION"))
    return bool(token) and signature is not None and any(
        rank_auth.verify(token, "GET", signed_path(environ), rank_auth.peer_identity(url), b"",
                         signature)
        for url in {state.worker_url, state.control_url} if url)


def signed_path(environ: Mapping[str, Any]) -> str:
    """The request's route with its query as the caller signed it: PATH_INFO leaves out
    SCRIPT_NAME, the prefix a proxy in front of the rank strips (docs/CONTRACTS.md, Signed
    calls)."""
    query = environ.get("QUERY_STRING", "")
    return environ.get("PATH_INFO", "") + (f"?{query}" if query else "")


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
    exit_auth: str = "any",
) -> Flask:
    """The WorkerServer's routes. ``fault_handler`` + ``fault_token`` opt in to ``POST
    /v1/faults`` (fault injection for tests and the demo), ``exit_handler`` + ``exit_token`` to
    ``POST /v1/exit`` (the process ends: a monitor finishing an eviction), ``abort_handler`` +
    ``exit_token`` to ``POST /v1/abort`` (the cross-group process group is aborted, the process
    goes on) and ``exit_token`` alone to ``POST /v1/probe``; without them a route answers 403.
    ``exit_auth`` (``LIGHTKEEPER_EXIT_AUTH``, :data:`EXIT_AUTH`): ``hmac`` refuses the
    deprecated bearer token. ``GET /v1/probe/payload`` is served to a peer's fetch signed
    with ``exit_token`` for this rank's address (rank_wire.auth.peer_identity)."""
    if exit_auth not in EXIT_AUTH:
        raise ValueError(f"exit_auth {exit_auth!r}: one of {', '.join(EXIT_AUTH)}")
    app = Flask("lightkeeper.worker_server")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY  # 413 beyond it (a fault spec is a short line)
    metrics = metrics or WorkerMetrics(state)
    bearer_said = threading.Event()  # the deprecated bearer's line: once per process
    probing = threading.Lock()  # one probe at a time: a replayed call cannot pile them up

    def call_refusal():
        """401 unless the monitor's call is allowed (:func:`monitor_call_refusal`); None."""
        why = monitor_call_refusal(state, exit_token, exit_auth)
        if why:
            return jsonify(error=why, status=401), 401
        if rank_auth.signature_of(request.headers.get("Authorization")) is None \
                and not bearer_said.is_set():
            bearer_said.set()
            app.logger.warning("%s", BEARER_TAKEN)
        return None

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
        body = json_body()
        spec = body.get("spec") if isinstance(body, dict) else None
        if not isinstance(spec, str):
            raise BadParameter('body must be JSON {"spec": "KIND:KEY=VALUE,..."}')
        try:
            taken = fault_handler(spec)
        except ValueError as e:
            raise BadParameter(str(e)) from None
        # the spec as the handler listed it (the trainer's: stripped), as /v1/state shows it
        return jsonify(injected=taken if isinstance(taken, str) else spec, faults=state.faults)

    @app.post("/v1/exit")
    def v1_exit():
        if exit_handler is None or not exit_token:
            return jsonify(error="exit is disabled on this rank (start it with "
                                 "LIGHTKEEPER_EXIT_TOKEN set to let a monitor end it)",
                           status=403), 403
        refused = call_refusal()
        if refused:
            return refused
        body = _get_json()
        reason = body.get("reason") if isinstance(body, dict) else None
        # the reason goes to the job's log: one line, as long as an abort's at most
        reason = " ".join(reason.split())[:MAX_REASON] if isinstance(reason, str) else ""
        exit_handler(reason or "POST /v1/exit")
        return jsonify(exiting=True, pid=state.identity.pid, rank=state.identity.rank), 202

    def token_refusal(what: str, handler_ok: bool = True):
        """403 while the route is off, 401 without a call signed with the exit token for this
        rank (or the token as a bearer); None when allowed."""
        if not handler_ok or not exit_token:
            return jsonify(error=f"{what} is disabled on this rank (start it with "
                                 "LIGHTKEEPER_EXIT_TOKEN set to let a monitor use it)",
                           status=403), 403
        return call_refusal()

    @app.post("/v1/abort")
    def v1_abort():
        refused = token_refusal("abort", abort_handler is not None)
        if refused:
            return refused
        try:
            reason, decision, quorum_id = abort_request(json_body())
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
            req = probe_request(json_body())
        except ValueError as e:
            raise BadParameter(str(e)) from None
        ident = state.identity
        # a signed probe replayed without limit must not tie up the rank's few threads
        if not probing.acquire(blocking=False):
            return jsonify(error=PROBE_BUSY, status=429), 429
        try:
            results, control = probe_peers(req, exit_token, state.control_url or state.worker_url)
        finally:
            probing.release()
        return jsonify({"from": {"worker_url": state.worker_url, "host": ident.host,
                                 "node": ident.host, "hostname": state.hostname,
                                 "rank": ident.rank, "replica_group": ident.replica_group},
                        "bytes": req.nbytes, "timeout_s": req.timeout_s,
                        "results": results, "control": control})

    @app.get("/v1/probe/payload")
    def v1_probe_payload():
        # its bytes cost this rank's threads: open, a reader in a loop slowed the rank into a
        # straggler, evicted; only a peer asked to probe holds the ranks' token
        if not exit_token:
            return jsonify(error="probing is disabled on this rank (start it with "
                                 "LIGHTKEEPER_EXIT_TOKEN set)", status=403), 403
        if not payload_signed(request.environ, state, exit_token):
            return jsonify(error="the payload is served only to a peer's fetch signed with the "
                                 "ranks' token (POST /v1/probe asks for it)", status=401), 401
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
