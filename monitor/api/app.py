"""The monitor's HTTP API: thin routes over what the loop last published (tokens, limits and
status codes: docs/monitor.md)."""

from __future__ import annotations

import threading
import time
import zlib
from functools import partial
from typing import Any

from flask import Flask, Response, abort, jsonify, render_template, request, send_file
from flask.json.provider import DefaultJSONProvider
from markupsafe import Markup
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from werkzeug.exceptions import HTTPException

from http_serving import bearer_token_matches, decimal_int, printable
from monitor.api import views
from monitor.config import MonitorConfig
from monitor.poll.admission import NotAllowed, ResolverBusy, Unauthorized
from monitor.poll.discovery import BadTarget, OtherJob, TooManyTargets

MAX_BODY = 64 * 1024  # a request is a few hundred bytes
REASON_MAX = 500  # an operator's reason, as the audit log keeps it
# a shard's holds of POST /v1/evict that are no rail's (monitor/shard.py): 503, not 409
RETRY_HOLDS = ("etcd_unreachable", "busy")
OVERVIEW_RANKS = 1000  # the overview's rank rows: more are unreadable and cost the sweeps' GIL
OVERVIEW_UNGROUPED = 50  # its targets in no replica group (every one: /v1/cluster's ungrouped)


class _JSONProvider(DefaultJSONProvider):
    """Flask's JSON, with a body nested too deeply for the parser a ValueError like any bad
    JSON: werkzeug's silent get_json then gives None (400), not a 500 and a logged traceback."""

    def loads(self, s: str | bytes, **kwargs: Any) -> Any:
        try:
            return super().loads(s, **kwargs)
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None


def _json_body():
    """The request's JSON body (None: none); a body sent without ``Content-Type:
    application/json`` is refused saying so (a browser's cross-site form cannot send that
    type: it is kept required), not read as no body."""
    body = request.get_json(silent=True)
    raw = request.get_data(cache=True)
    if body is None and raw and raw.strip() != b"null":  # a request that says why, not none
        raise BadTarget("the body is not valid JSON" if request.is_json else
                        "the body must be sent with the header Content-Type: application/json "
                        "(required: a browser cannot send it cross-site without a preflight)")
    return body


def _check_admin(cfg: MonitorConfig) -> None:
    """Aborts the request (403, or 401 for a missing or wrong token) unless the caller shows
    the admin token."""
    if not cfg.token:
        abort(403, "state changes are disabled: start the monitor with --token or "
                   "LIGHTKEEPER_TOKEN (the admin token)")
    authorization = request.headers.get("Authorization")
    if bearer_token_matches(authorization, cfg.token):
        return
    if bearer_token_matches(authorization, cfg.register_token):
        abort(403, "the registration token admits POST /v1/targets only; this route needs the "
                   "admin token (--token)")
    abort(401, "missing or wrong bearer token")


DECISIONS = ("evict", "hold", "abort", "proposed")  # the decisions table's kinds


def _asked(*names: str) -> None:
    """Refuses a query parameter the route does not know: a misspelt filter would otherwise
    answer everything, read as what was asked."""
    unknown = sorted(set(request.args) - set(names))
    if unknown:
        raise BadTarget(f"unknown query parameter(s) {', '.join(repr(u[:40]) for u in unknown[:5])}"
                        f"; this route takes {', '.join(names) or 'none'}")


def _choice(name: str, choices: tuple[str, ...]) -> str | None:
    raw = request.args.get(name) or None
    if raw is not None and raw not in choices:
        raise BadTarget(f"{name} must be one of {', '.join(choices)}, got {raw[:40]!r}")
    return raw


def _limit(name: str = "limit", default: int = 500, least: int = 1) -> int:
    raw = request.args.get(name, str(default))
    try:
        n = decimal_int(raw)
    except ValueError:
        n = least - 1
    if n < least:  # a -1 read as the least would answer what was not asked
        raise BadTarget(f"{name} must be a decimal integer ({least} to 10000; more reads as "
                        f"10000), got {raw[:40]!r}")
    return min(n, 10_000)


def overview_groups(monitor: Any, view: Any) -> dict[str, Any]:
    """The overview's groups with their ranks' rows, at most OVERVIEW_RANKS of them: past that,
    the groups not all up or with an open finding first; the rest counted."""
    if view is None:  # before the first sweep (cluster_json would take a view published since)
        return {"groups": [], "hidden_ranks": 0, "total_ranks": 0, "limit": OVERVIEW_RANKS,
                "hidden_groups": 0}
    groups = monitor.cluster_json(ranks=False, view=view)["groups"]
    total = sum(len(gv.ranks) for gv in view.groups.values())
    if total > OVERVIEW_RANKS:
        groups.sort(key=lambda g: g["status"] == "up" and not g["open_findings"])
    left, now = OVERVIEW_RANKS, monitor.clock()
    for i, g in enumerate(groups):
        if left <= 0:
            del groups[i:]
            break
        ranks = view.groups[g["replica_group"]].ranks
        g["ranks"] = [views.rank_json(r, now) for r in ranks[:left]]
        g["more_ranks"], left = len(ranks) - len(g["ranks"]), left - len(g["ranks"])
    return {"groups": groups, "hidden_ranks": total - (OVERVIEW_RANKS - left),
            "total_ranks": total, "limit": OVERVIEW_RANKS,
            "hidden_groups": len(view.groups) - len(groups)}


def overview_ungrouped(monitor: Any, view: Any) -> dict[str, Any]:
    """The overview's targets in no replica group (one that never answered: a mistyped address
    shows with why), the first OVERVIEW_UNGROUPED as /v1/cluster's ``ungrouped`` rows, the rest
    counted; how many targets are known, polled or not; and ``shard``, the monitor's ``--shard``
    index and count (index None: a --lead candidate only), whose view holds its slice only."""
    ranks = [r for r in view.ranks.values() if r.replica_group is None
             and not r.superseded] if view is not None else []
    now = monitor.clock()
    rows = [{k: row[k] for k in views.UNGROUPED}
            for row in (views.rank_json(r, now) for r in ranks[:OVERVIEW_UNGROUPED])]
    shard = monitor.shard.cfg if monitor.shard is not None else None
    return {"rows": rows, "more": len(ranks) - len(rows),
            "targets": len(monitor.discovery.targets()),
            "shard": {"index": shard.index, "shards": shard.shards} if shard else None}


def create_app(monitor: Any) -> Flask:
    """The routes over ``monitor`` (a :class:`monitor.service.Monitor`)."""
    app = Flask(__name__)
    app.json = _JSONProvider(app)
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY  # 413 beyond it

    @app.get("/healthz")
    def healthz():
        stalled = monitor.stalled_for()
        if stalled is not None:  # a liveness probe restarts a monitor whose loop is stuck
            return jsonify(status="stalled", sweeps=monitor.sweeps, since_s=round(stalled, 1)), 503
        if monitor.last_sweep_error:  # still 200: a restart mends no full disk (docs/monitor.md)
            return jsonify(status="failing", sweeps=monitor.sweeps,
                           last_error=monitor.last_sweep_error,
                           since_s=round(monitor.clock() - monitor.swept_at, 1))
        return jsonify(status="ok", sweeps=monitor.sweeps)

    @app.get("/metrics")
    def metrics():
        return Response(generate_latest(monitor.metrics.registry), content_type=CONTENT_TYPE_LATEST)

    render_lock = threading.Lock()

    def per_sweep(view: Any, name: str, build: Any) -> Any:
        """``build()`` made once per published view (what grows with the job: not once per
        request or open tab), kept on it as ``name``."""
        with render_lock:
            value = getattr(view, name, None)
            if value is None:
                value = build()
                if view is not None:
                    setattr(view, name, value)
        return value

    def encoded(doc: Any) -> tuple[bytes, int]:
        body = app.json.dumps(doc, separators=(",", ":")).encode()
        return body, zlib.crc32(body)

    def answer(body: bytes, etag: str) -> Response:
        resp = Response(body, mimetype="application/json")
        resp.set_etag(etag)
        return resp.make_conditional(request)  # 304 to an If-None-Match of the same answer

    @app.get("/v1/cluster")
    def cluster():
        """The groups' rows encoded once per sweep, as the overview's table; the monitor's own
        fields as of the request."""
        view = monitor.view
        head = app.json.dumps(views.cluster_head(monitor, view), separators=(",", ":")).encode()
        body, crc = per_sweep(view, "cluster_body", lambda: encoded(views.cluster_json(
            {}, view, view.evidence() if view else None, monitor.detectors, monitor.clock())))
        return answer(head[:-1] + b"," + body[1:], f"{zlib.crc32(head):08x}{crc:08x}")

    @app.get("/v1/ranks")
    def ranks():
        view = monitor.view
        body, crc = per_sweep(view, "ranks_body",
                              lambda: encoded(views.ranks_json(view, monitor.clock())))
        return answer(body, f"{crc:08x}")

    @app.get("/v1/findings")
    def findings():
        _asked("open", "limit")
        raw = request.args.get("open", "").lower()
        if raw not in ("", "1", "0", "true", "false", "yes", "no"):
            raise BadTarget(f"open must be 1, true, yes, 0, false or no, got {raw[:40]!r}")
        open_only = raw in ("1", "true", "yes")
        rows = monitor.store.findings(limit=_limit(), open_only=open_only)
        for r in rows:
            r["open"] = r["resolved_at"] is None
        return jsonify(rows)

    @app.get("/v1/evictions")
    def evictions():
        _asked("decision", "limit")
        return jsonify(views.decisions_json(monitor, monitor.store.decisions(
            limit=_limit(), decision=_choice("decision", DECISIONS))))

    @app.get("/v1/goodput")
    def goodput():
        _asked("incidents", "intervals")
        return jsonify(views.goodput_json(monitor, incidents=_limit("incidents", 50, 0),
                                          intervals=_limit("intervals", 200, 0)))

    @app.get("/v1/incidents")
    def incidents():
        _asked("limit")
        return jsonify(views.incidents_json(monitor, limit=_limit("limit", 100)))

    @app.get("/v1/incidents/<bundle_id>/bundle")
    def incident_bundle(bundle_id: str):
        """The bundle's ``.tar.gz``; 404 for an id the audit log does not list (the id is
        looked up, never joined to a path)."""
        store = monitor.bundles.store
        path = store.path(bundle_id) if store is not None else None
        try:  # opened here: a bundle pruned from now on is still read whole
            f = open(path, "rb") if path is not None else None
        except FileNotFoundError:  # pruned since it was looked up
            f = None
        if f is None:
            return jsonify(error=f"no incident bundle {bundle_id!r}", status=404), 404
        return send_file(f, mimetype="application/gzip", as_attachment=True,
                         download_name=f"{bundle_id}.tar.gz", max_age=0)

    @app.get("/v1/targets")
    def targets():
        return jsonify([{"url": t.url, "source": t.source, "job": t.job,
                         "replica_group": t.replica_group, "rank": t.rank}
                        for t in monitor.discovery.targets()])

    @app.post("/v1/targets")
    def register():
        t = monitor.register_target(request.get_json(silent=True),  # refusals counted there
                                    request.headers.get("Authorization"), request.remote_addr)
        return jsonify(url=t.url, registered=True, registered_as=t.registered_as or t.url)

    @app.post("/v1/evict")
    def evict():
        _check_admin(monitor.cfg)
        body = _json_body()
        g = body.get("replica_group") if isinstance(body, dict) else None
        if type(g) is not int or not 0 <= g < 1 << 63:  # not a bool; fits SQLite's INTEGER
            raise BadTarget('body must be {"replica_group": <int >= 0>, "reason": "..."}')
        # one printable line, bounded: it goes into the log and the audit row's detail
        reason = printable(str(body.get("reason") or "manual"))[:REASON_MAX]
        result = monitor.evict_manual(g, reason)
        if result["decision"] == "evict" and result.get("sent") is False:
            # decided and logged, but no kill went out: a status a script checks must say so
            return jsonify(result), (502 if monitor.cfg.lighthouse else 503)
        if result["decision"] == "hold" and result["reason"] in RETRY_HOLDS:
            # no rail held it: the shard could not write its proposal (etcd unreachable, or
            # the key kept changing); asking again may pass
            resp = jsonify(result)
            resp.headers["Retry-After"] = "1"
            return resp, 503
        # 202: a shard's proposal, which the leader carries out (docs/scaling.md)
        return jsonify(result), (200 if result["decision"] == "evict"
                                 else 202 if result["decision"] == "proposed" else 409)

    @app.get("/v1/hosts")
    def hosts():
        return jsonify(monitor.enforcer.hosts_json())

    @app.post("/v1/hosts/<host>/release")
    def release_host(host: str):
        """404 for a host the ledger does not know, 409 for one that is not quarantined."""
        _check_admin(monitor.cfg)
        body = _json_body()
        if body is not None and not isinstance(body, dict):
            raise BadTarget('body must be {"reason": "..."} or empty')
        reason = printable(str((body or {}).get("reason") or "released by hand"))[:REASON_MAX]
        try:
            return jsonify(monitor.enforcer.release_host(host, reason))
        except KeyError:
            return jsonify(error=f"no host {host!r} in the ledger", status=404), 404
        except ValueError as e:
            return jsonify(error=str(e), status=409), 409

    @app.get("/")
    def overview():
        view = monitor.view
        groups_table, goodput = per_sweep(view, "overview", lambda: (
            Markup(render_template("groups.html", c=overview_groups(monitor, view),
                                   u=overview_ungrouped(monitor, view))),
            # the last incident's figures, not its bundles (listed below)
            monitor.goodput.to_json(incidents=1, intervals=0)))
        return render_template("overview.html", c=monitor.cluster_json(ranks=False),
                               groups_table=groups_table, goodput=goodput,
                               findings=monitor.store.findings(limit=20),
                               decisions=views.decisions_json(
                                   monitor, monitor.store.decisions(limit=20)),
                               hosts=monitor.enforcer.hosts_json(),
                               bundles=views.incidents_json(monitor, 10, False)["bundles"],
                               interval=monitor.cfg.interval_s,
                               fmt_time=lambda t: time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                time.gmtime(t)) if t else "")

    def error_json(e: Exception, status: int):
        return jsonify(error=str(e), status=status), status

    for error, status in ((BadTarget, 400), (Unauthorized, 401), (NotAllowed, 403),
                          (OtherJob, 409), (TooManyTargets, 429)):
        app.register_error_handler(error, partial(error_json, status=status))

    @app.errorhandler(ResolverBusy)
    def resolver_busy(e: ResolverBusy):
        resp, status = error_json(e, 503)
        resp.headers["Retry-After"] = "1"  # a lookup is free again within RESOLVE_TIMEOUT_S
        return resp, status

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        resp = jsonify(error=e.description, status=e.code, path=request.path)
        resp.status_code = e.code
        # werkzeug's own headers (a 405's Allow) without its text/html Content-Type
        resp.headers.extend((k, v) for k, v in e.get_headers() if k.lower() != "content-type")
        return resp

    @app.errorhandler(Exception)
    def internal_error(e):
        app.logger.exception("endpoint %s failed", request.path)
        return jsonify(error=f"{type(e).__name__}: {e}", status=500, path=request.path), 500

    return app
