"""The JSON the API serves about the cluster, from what the last sweep published: ``view`` is
every rank as seen, ``evidence`` the verified ones (the quorum, membership and replica ids)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any

from http_serving import redact_url
from monitor.detect import Detectors
from monitor.evidence.lighthouse_status import LighthouseStatus
from monitor.evidence.torch_rank import CANNOT_SHOW
from monitor.evidence.view import ClusterView

UNGROUPED = ("url", "reachable", "reason", "error", "unreachable_sweeps", "verification")


def verification_json(view: ClusterView | None, st: LighthouseStatus | None,
                      error: str | None, blind: str | None) -> dict[str, Any]:
    """What the Lighthouse said at the last sweep, and how many ranks are verified."""
    counts = Counter(r.trust.state if r.trust is not None else "unchecked"
                     for r in (view.ranks.values() if view else ()) if not r.superseded)
    return {"lighthouse_ok": st is not None and not error, "lighthouse_error": error,
            "lighthouse_quorum_id": st.quorum_id if st else None,
            "lighthouse_participants": sorted(st.members) if st else [],
            "lighthouse_heartbeating": sorted(r for r in st.heartbeats
                                              if st.heartbeating(r)) if st else [],
            "read_at": st.at if st else None, "ranks": dict(counts), "blind": blind}


def rank_json(r, now: float) -> dict[str, Any]:
    s = r.state or {}
    return {
        "url": r.url, "rank": r.rank, "replica_group": r.replica_group,
        "group_rank": s.get("group_rank"), "group_world_size": s.get("group_world_size"),
        "reachable": r.reachable, "reason": r.reason, "error": r.error,
        "step": s.get("step"), "phase": s.get("phase"),
        "phase_for_s": (now - s["phase_since"]) if s.get("phase_since") else None,
        "quorum_id": s.get("quorum_id"), "participating": s.get("participating"),
        "last_step_seconds": s.get("last_step_seconds"), "host": s.get("host"),
        "pid": s.get("pid"), "replica_id": s.get("replica_id"),
        "faults": s.get("faults"), "unreachable_sweeps": r.failures,
        "verification": r.trust.to_dict() if r.trust is not None else None,
        # on torch's debug server only: what it serves, what it cannot show
        "torch_only": s.get("torch_only"), "stacks_url": s.get("stacks_url")}


def ranks_json(view: ClusterView | None, now: float) -> list[dict[str, Any]]:
    """``GET /v1/ranks``: every target polled, with the verdict on its claims."""
    if view is None:
        return []
    out = [{**rank_json(r, now), "source": r.target.source if r.target else None,
            "registered_as": r.target.registered_as if r.target else None,
            "superseded": r.superseded} for r in view.ranks.values()]
    return sorted(out, key=lambda x: (x["rank"] is None, x["rank"] or 0, x["url"]))


def torchft_versions(view: ClusterView) -> dict[str, list[int]]:
    """torchft version -> the replica groups whose first reachable rank says it runs it (every
    group of a job must run the same: docs/install.md)."""
    out: dict[str, list[int]] = {}
    for g, gv in view.groups.items():
        v = next((r.state.get("torchft_version") for r in gv.reachable if r.state), None)
        if isinstance(v, str) and v != "unknown":
            out.setdefault(v, []).append(g)
    return {v: sorted(gs) for v, gs in sorted(out.items())}


def cluster_json(head: dict[str, Any], view: ClusterView | None, evidence: ClusterView | None,
                 detectors: Detectors, now: float, ranks: bool = True) -> dict[str, Any]:
    """``GET /v1/cluster``: ``head`` (the monitor's own fields) and every group as seen (without
    ``ranks``: no rank's row, in groups or ungrouped)."""
    out: dict[str, Any] = {**head, "groups": [], "job_findings": [], "ungrouped": [],
                           "quorum_id": None,
                           "quorum_participants": None, "reachable_fraction": None,
                           "sweep_seconds": None, "at": None, "torchft_versions": {}}
    if view is None or evidence is None:
        return out
    open_by_group: dict[int | None, list[str]] = {}
    for f in detectors.open_findings():
        open_by_group.setdefault(f.replica_group, []).append(f.kind)
    in_quorum = {g.replica_group for g in evidence.in_quorum()}
    out.update(quorum_id=evidence.quorum_id, quorum_participants=evidence.quorum_participants(),
               reachable_fraction=view.reachable_fraction, sweep_seconds=view.sweep_seconds,
               at=view.at, torchft_versions=torchft_versions(view))
    for g, gv in view.groups.items():
        verified = evidence.groups.get(g)
        out["groups"].append({
            "replica_group": g, "replica_id": verified.replica_id if verified else None,
            "status": gv.status, "step": gv.step, "in_quorum": g in in_quorum,
            "median_step_seconds": gv.median_step_seconds(),
            "arrival_lag_seconds": detectors.last_lags.get(g),
            "open_findings": sorted(open_by_group.get(g, [])),
            "evidence_ranks": len(verified.ranks) if verified else 0,
            "ranks": [rank_json(r, now) for r in gv.ranks] if ranks else []})
    out["job_findings"] = sorted(open_by_group.get(None, []))  # job-wide: no group named
    out["ungrouped"] = [{k: row[k] for k in UNGROUPED} for row in (
        rank_json(r, now) for r in view.ranks.values()
        if ranks and r.replica_group is None and not r.superseded)]
    return out


def cluster_head(monitor: Any, view: ClusterView | None) -> dict[str, Any]:
    """``/v1/cluster``'s own fields (``monitor``: a monitor.service.Monitor): what may change
    between sweeps."""
    cfg, stores = monitor.cfg, monitor.torch_ranks.stores
    unwatched = sorted(stores.unwatched.items()) if stores is not None else []
    return {"job": cfg.job, "lighthouse": redact_url(cfg.lighthouse),
            "dry_run": cfg.rails.dry_run, "sweeps": monitor.sweeps,
            "monitor_started_at": monitor.started_at,
            "last_error": monitor.last_sweep_error or monitor.detectors.last_error,
            "targets_file_error": monitor.discovery.file_error,
            "verification": verification_json(view, monitor.lighthouse_status,
                                              monitor.lighthouse_error, monitor.blind_reason()),
            "lighthouse_settings": monitor.lh_settings.to_dict(),
            "network_probes": monitor.probes.to_json(),
            "torch_only": {"store_discovery": cfg.torch_stores,
                           "store_error": stores.error if stores is not None else None,
                           "unwatched": [{"replica_id": r, "store": s, "group_ranks": list(g),
                                          "why": why} for (r, s), (g, why) in unwatched],
                           "cannot_show": list(CANNOT_SHOW)},
            "shard": monitor.shard.to_json() if monitor.shard else None}


def goodput_json(monitor: Any, incidents: int = 50, intervals: int = 200) -> dict[str, Any]:
    """``GET /v1/goodput``: the ledger; each incident with ``bundles``: the incident bundles of
    its findings and eviction (docs/monitor.md, Incident bundles)."""
    store = monitor.bundles.store
    ledger = monitor.goodput.to_json(incidents, intervals)
    links = store.by_link() if store is not None else {}  # (finding/decision, id) -> bundles
    for inc in ledger.get("incidents") or []:
        ids = [b for fid in inc.get("finding_ids") or [] for b in links.get(("finding", fid), [])]
        if inc.get("eviction_id") is not None:
            ids += links.get(("decision", inc["eviction_id"]), [])
        inc["bundles"] = sorted(set(ids))
    return ledger


def decisions_json(monitor: Any, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``GET /v1/evictions``' rows (and the overview's): each with ``bundle_pruned``, true when
    the bundle it names is no longer served (deleted by the bundles' size or age cap, or a
    monitor without bundles): the id stays, as the audit log kept it, but nothing links it."""
    store = monitor.bundles.store
    served: dict[str, bool] = {}
    for r in rows:
        b = r.get("bundle")
        if b is not None and b not in served:
            served[b] = store is not None and store.path(b) is not None
        r["bundle_pruned"] = b is not None and not served[b]
    return rows


def incidents_json(monitor: Any, limit: int = 100, goodput: bool = True) -> dict[str, Any]:
    """``GET /v1/incidents``: the incident bundles kept, newest first, each with its download
    path and (``goodput``) the goodput incident whose eviction or finding it kept."""
    store = monitor.bundles.store
    rows = store.list(limit) if store is not None else []
    ledger = monitor.goodput.to_json(incidents=10_000, intervals=0) if goodput and rows else {}
    owner: dict[tuple[str, int], int] = {}
    for inc in ledger.get("incidents") or []:
        for fid in inc.get("finding_ids") or []:
            owner[("finding", fid)] = inc["id"]
        if inc.get("eviction_id") is not None:
            owner[("decision", inc["eviction_id"])] = inc["id"]
    for r in rows:
        r["download"] = f"/v1/incidents/{r['id']}/bundle"
        r["goodput_incident"] = owner.get(("decision", r["decision_id"])) \
            or owner.get(("finding", r["finding_id"]))
    return {"enabled": store is not None, "dir": store.dir if store is not None else None,
            "error": store.error if store is not None else None,
            "policy": {k: v for k, v in asdict(monitor.cfg.bundles).items()
                       if k not in ("enabled", "dir")},
            "bundles": rows}
