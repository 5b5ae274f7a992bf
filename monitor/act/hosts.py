"""The host ledger and the quarantine policy: confirmed findings in, host decisions out.

A confirmed finding of a ``--quarantine-after`` kind is an offence against its culprits' hosts.
Enough offences of one kind within the window quarantine a host unless a rail holds it; each
quarantine or release queues one action per sink (:mod:`monitor.act.host_actions`). See
docs/quarantine.md.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from functools import cache
from typing import Any

from monitor.config import QuarantineConfig
from monitor.detect import Finding
from monitor.store import Store

from .host_actions import HostActions, failing_actions
from .host_rails import DeadGroups, Protection, holding_rail, protected_hosts, refused_on
from .sinks import Sink

__all__ = ["DeadGroups", "HostLedger", "Protection", "culprit_hosts", "failing_actions",
           "protected_hosts"]

log = logging.getLogger(__name__)

OK, SUSPECT, QUARANTINED, RELEASED = "ok", "suspect", "quarantined", "released"
STATES = (OK, SUSPECT, QUARANTINED, RELEASED)
# findings about the host itself, not its processes: a restart on the same host cannot help
HOST_KINDS = ("network", "dead")


def culprit_hosts(finding: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """host -> {node, devices, ranks, slurm_jobs} of a finding's culprits (hostless skipped)."""
    out: dict[str, dict[str, Any]] = {}
    for c in (finding.get("evidence") or {}).get("culprits") or ():
        host = c.get("host")
        if not host:
            continue
        row = out.setdefault(str(host), {"node": c.get("node") or host, "devices": [],
                                         "ranks": [], "slurm_jobs": []})
        if c.get("slurm_job_id") and c["slurm_job_id"] not in row["slurm_jobs"]:
            row["slurm_jobs"].append(str(c["slurm_job_id"]))
        label = device_label(c["device"]) if c.get("device") else None
        if label and label not in row["devices"]:
            row["devices"].append(label)
        if c.get("rank") is not None:
            row["ranks"].append(c["rank"])
    return out


def device_label(d: Any) -> str:
    if not isinstance(d, dict):
        return str(d)
    if d.get("type") == "cuda":
        return f"cuda:{d.get('index')}" + (f" {d['uuid']}" if d.get("uuid") else "")
    return str(d.get("type", "?"))


def set_state(h: dict[str, Any], state: str, now: float) -> None:
    if h.get("state") != state:
        h["state"], h["state_since"] = state, now


@contextlib.contextmanager
def kept_unless_written(h: dict[str, Any]) -> Iterator[None]:
    """``h`` as it was if the block raises: a decision the audit log refused (a full disk)
    changes nothing, so the next sweep or POST makes it again."""
    before = copy.deepcopy(h)
    try:
        yield
    except BaseException:
        h.clear()
        h.update(before)
        raise


class HostLedger(HostActions):
    def __init__(self, store: Store, cfg: QuarantineConfig, sinks: list[Sink], job: str,
                 clock) -> None:
        self.store = store
        self.cfg = cfg
        self.sinks = list(sinks)
        self.job = job
        self.clock = clock
        self.sender: dict[str, Any] | None = None  # monitor_identity(): in every sink event
        self._lock = threading.RLock()
        self.hosts: dict[str, dict[str, Any]] = store.load_hosts()
        self._load_actions()
        self._held: dict[str, str] = {}  # host -> the rail that held it last (logged once)
        self._unwritten: list[tuple] = []  # offences a failed write left, tried again first
        # the observed view's claims about hosts, per rank: a sweep reads only the changed ones
        self._claims: dict[str, tuple] = {}  # url -> (host, replica id, node, device, superseded)
        self._claimed_from: dict[str, tuple] = {}  # url -> the state fields of its claim
        self._rids: dict[str, dict[str, int]] = {}  # host -> replica id -> live ranks
        self._urls: dict[str, set[str]] = {}  # host -> its live ranks' URLs
        self._named: dict[str, int] = {}  # host -> ranks naming it (superseded ones too)
        self._observed: Any = None  # the view the index is of

    def _host(self, host: str, now: float) -> dict[str, Any]:
        h = self.hosts.get(host)
        if h is None:
            h = self.hosts[host] = {"host": host, "node": host, "devices": [], "state": OK,
                                    "state_since": now, "first_seen": now, "last_seen": None}
        return h

    def observe(self, view: Any, now: float, changed: Any = None) -> None:
        """Node, devices and last-seen time of the ledger's hosts from the ranks' claims.
        ``changed``: the URLs whose claims may differ (ViewBuilder.reshaped); None: every rank."""
        with self._lock:
            ranks = view.ranks
            if changed is None or len(changed) >= len(ranks) or self._observed is None:
                self._claims, self._rids, self._urls, self._named = {}, {}, {}, {}
                self._claimed_from = {}
                changed = ranks.keys()
            claimed_from, claims = self._claimed_from, self._claims
            for url in changed:
                r = ranks.get(url)
                s = r.state if r is not None else None
                fields = None if not s else (s.get("host"), s.get("replica_id"), s.get("node"),
                                             s.get("device"), r.superseded)
                if fields == claimed_from.get(url):
                    continue  # the same fields, the same claim: most ranks, most sweeps
                old = claims.pop(url, None)
                if old is not None:
                    self._index(url, old, -1)
                if fields is None:
                    claimed_from.pop(url, None)
                    continue
                claimed_from[url] = fields
                host, rid, node, device, superseded = fields
                if host:
                    claims[url] = new = (host, str(rid) if rid else None, node,
                                         device_label(device) if device else None,
                                         bool(superseded))
                    self._index(url, new, 1)
            self._observed = view
            for host, h in list(self.hosts.items()):  # the ledger's hosts: the few that offended
                urls = self._urls.get(host)
                if not urls:  # nothing counts, no rank runs there, every action done: forgotten
                    if h["state"] == OK and not self._unsettled(h):
                        del self.hosts[host]
                        self.store.delete_host(host)
                    continue
                h["last_seen"] = now
                for u in sorted(urls, key=lambda u: (ranks[u].rank, u)):
                    _, _, node, d, _ = self._claims[u]
                    if node:
                        h["node"] = node
                    # not "cpu": a GPU host's rank reports it until it initializes CUDA
                    if d and d != "cpu" and d not in h["devices"]:
                        h["devices"].append(d)

    def _index(self, url: str, claim: tuple, sign: int) -> None:
        host, rid, _, _, superseded = claim
        n = self._named[host] = self._named.get(host, 0) + sign
        if not n:
            del self._named[host]
        if superseded:
            return
        if sign > 0:
            self._urls.setdefault(host, set()).add(url)
        else:
            self._urls[host].discard(url)
            if not self._urls[host]:
                del self._urls[host]
        if rid is not None:
            by = self._rids.setdefault(host, {})
            k = by[rid] = by.get(rid, 0) + sign
            if not k:
                del by[rid]
                if not by:
                    del self._rids[host]

    def _on_host(self, host: str) -> set[str]:
        """Replica ids of the observed view's live ranks on ``host``."""
        return set(self._rids.get(host, ()))

    def known_hosts(self) -> set[str]:
        """The hosts the observed view's ranks name, and the ledger's."""
        with self._lock:
            return set(self._named) | set(self.hosts)

    def record(self, findings: list[dict[str, Any]], now: float,
               group_hosts: dict[int, set[str]] | None = None) -> None:
        """Record new confirmed findings (dicts with ``id``) against their culprits' hosts; one
        naming every host of a multi-host group (``group_hosts``) is recorded, never counted.
        Offences the audit log refused (a full disk) are kept, written first at the next call."""
        with self._lock:
            todo = list(self._unwritten)
            for f in findings:
                if self.cfg.after.get(f.get("kind"), 0) < 1:
                    continue  # not a kind that counts against a host
                named = culprit_hosts(f)
                spans = (group_hosts or {}).get(f.get("replica_group")) or set()
                # the probe mesh singles out each host a network finding names, all of a group's
                counts = f.get("kind") == "network" or not (len(spans) > 1 and set(named) >= spans)
                todo += [(host, c, f, spans, counts, now, self._seen_before_restart(host, f))
                         for host, c in named.items()]
            for i, (host, c, f, spans, counts, at, again) in enumerate(todo):
                h = self._host(host, at)
                h["node"] = c["node"]
                h["devices"] += [d for d in c["devices"] if d not in h["devices"] + ["cpu"]]
                # the Slurm jobs its ranks ran in: the slurm sink drains only a node running one
                jobs = [j for j in h.get("slurm_jobs", []) if j not in c["slurm_jobs"]]
                h["slurm_jobs"] = (jobs + c["slurm_jobs"])[-8:]
                up = refused_on(f, c["ranks"])
                counts = counts and not again and not up
                data = {"kind": f["kind"], "finding_id": f.get("id"),
                        "replica_group": f.get("replica_group"),
                        "replica_id": f.get("replica_id"), "ranks": c["ranks"],
                        "devices": c["devices"], "counts": counts}
                if again:  # recorded, as each confirmation is: counted by the run before
                    data["note"] = "re-confirmed after a monitor restart"
                elif up:
                    data["note"] = "the host refused the connections: up, its processes ended"
                self._unwritten = todo[i:]
                # one transaction: an offence whose host row a kill lost would be read after a
                # restart as seen before it, and the host, with no row, never judged
                with kept_unless_written(h), self.store.atomic():
                    self.store.add_host_offence(host, at, f["kind"], f.get("id"), data)
                    if counts and h["state"] in (OK, RELEASED):
                        set_state(h, SUSPECT, now)
                    self._save(h, now)
                self._unwritten = todo[i + 1:]
                if again:
                    log.info("%s of %s re-confirmed after a monitor restart: recorded, not "
                             "counted against %s again", f["kind"], f.get("replica_id"), host)
                elif up:
                    log.info("dead of %s: %s refused the connections (up, the processes "
                             "ended): recorded, not counted", f.get("replica_id"), host)
                elif not counts:
                    log.info("%s in replica group %s names all its hosts (%s): recorded, not "
                             "counted against %s", f["kind"], f.get("replica_group"),
                             ", ".join(sorted(spans)), host)

    def _seen_before_restart(self, host: str, f: dict[str, Any]) -> bool:
        """``f`` confirms again an episode a previous run left open (``reconfirms``: once its
        group stepped on healthy, a fault back is a new episode) that was an offence of
        ``host`` then. None there (a dead one the Lighthouse had not agreed to yet): it counts."""
        return f.get("reconfirms") is not None and self.store.offended_in(host, f["reconfirms"])

    def _counting_offences(self, h: dict[str, Any], now: float) -> list[dict[str, Any]]:
        since = max(now - self.cfg.window_s, h.get("released_at") or float("-inf"))
        return [o for o in self.store.host_offences(h["host"], since=since)
                if o["at"] > (h.get("released_at") or float("-inf"))
                and o["data"].get("counts", True)]

    def decide(self, now: float, blind: str | None, known: int,
               protected: Callable[[], dict[str, str]] | None = None) -> list[dict[str, Any]]:
        """Expire quarantines past their TTL, then judge every suspect host; returns the
        decisions made (holds only when their rail changed). ``protected()``: host -> why its
        quarantine would break --min-replicas (called lazily, at most once)."""
        protected = cache(protected or dict)
        evicted = cache(self.store.evicted_replica_ids)
        out = []
        with self._lock:
            for h in list(self.hosts.values()):
                if h["state"] == QUARANTINED and h.get("expires_at") is not None \
                        and now >= h["expires_at"]:
                    out.append(self._release(h, now, "ttl", f"quarantine TTL "
                                             f"({self.cfg.ttl_s:g}s) expired"))
                elif h["state"] == RELEASED and now - h["state_since"] >= self.cfg.window_s:
                    set_state(h, OK, now)  # offences before a release no longer count
                    self._save(h, now)
            for h in list(self.hosts.values()):
                if h["state"] != SUSPECT:
                    continue
                offences = self._counting_offences(h, now)
                counts = dict(Counter(o["kind"] for o in offences))
                due = sorted(k for k, n in counts.items()
                             if self.cfg.after.get(k, 0) >= 1 and n >= self.cfg.after[k])
                if not due:
                    if not offences:
                        set_state(h, OK, now)
                        self._save(h, now)
                    self._held.pop(h["host"], None)
                    continue
                kind = due[0]
                evidence = {"counts": counts, "after": {k: self.cfg.after[k] for k in counts
                                                        if k in self.cfg.after},
                            "window_s": self.cfg.window_s,
                            "offences": [{"at": o["at"], **o["data"]} for o in offences[:20]]}
                rail = holding_rail(self.cfg, h["host"], self._down(h["host"], now), blind,
                                    known, protected, evicted)
                summary = f"{counts[kind]} {kind} finding(s) within {self.cfg.window_s:g}s " \
                          f"(--quarantine-after {kind}={self.cfg.after[kind]})"
                if rail is not None:
                    if self._held.get(h["host"]) == rail[0]:
                        continue
                    self._held[h["host"]] = rail[0]
                    decision = "quarantine" if rail[0] == "dry_run" else "hold"
                    log.warning("host %s: %s (%s): %s; %s", h["host"], decision, rail[0],
                                summary, rail[1])
                    h["hold"] = {"reason": rail[0], "detail": rail[1], "at": now}
                    if rail[0] == "dry_run":
                        h["would_quarantine"] = {"at": now, "kind": kind, "reason": summary}
                    self._save(h, now)
                    self.store.add_host_decision(host=h["host"], decision=decision,
                                                 reason=rail[0], detail=f"{summary}; {rail[1]}",
                                                 evidence=evidence, at=now)
                    out.append({"host": h["host"], "decision": decision, "reason": rail[0],
                                "detail": rail[1]})
                    continue
                out.append(self._quarantine(h, kind, summary, evidence, offences, now))
        return out

    def _down(self, host: str, now: float) -> set[str]:
        """Hosts quarantined, and a dry run's would-be ones but ``host`` while a real one lasts."""
        return {x["host"] for x in self.hosts.values() if x["state"] == QUARANTINED or (
            self.cfg.dry_run and x["host"] != host and x.get("would_quarantine") is not None
            and now - x["would_quarantine"]["at"] < self.cfg.ttl_s)}

    def held_back_on(self, f: dict[str, Any], evicted: Collection[str], now: float
                     ) -> str | None:
        """Why evicting ``f``'s group (a HOST_KINDS finding) only restarts it on a host it names:
        an earlier incarnation was evicted after such an offence there (one that still counts),
        and a rail (not a dry run) holds the host's quarantine; None: nothing holds it."""
        if f.get("kind") not in HOST_KINDS:
            return None
        with self._lock:
            for host in culprit_hosts(f):
                h, rail = self.hosts.get(host), self._held.get(host)
                if h is None or h["state"] != SUSPECT or rail in (None, "dry_run"):
                    continue
                before = sorted({o["data"].get("replica_id") for o in
                                 self._counting_offences(h, now) if o["kind"] in HOST_KINDS
                                 and o["data"].get("replica_group") == f.get("replica_group")
                                 and o["data"].get("replica_id") != f.get("replica_id")
                                 and o["data"].get("replica_id") in evicted})
                if before:
                    return (f"replica group {f.get('replica_group')} was evicted off {host} "
                            f"already ({', '.join(before)}) and is back on it; its quarantine "
                            f"is held ({rail}: {h['hold']['detail']}), so another eviction "
                            f"only restarts it there: evicted once {host} is quarantined or "
                            "the group runs elsewhere")
        return None

    def _quarantine(self, h: dict[str, Any], kind: str, summary: str, evidence: dict,
                    offences: list[dict[str, Any]], now: float) -> dict[str, Any]:
        # the newest offence of the kind that quarantines: a newer one of another kind (not
        # due) would send the admin to the wrong finding and group
        last = next(o["data"] for o in offences if o["kind"] == kind)
        finding = {"id": last.get("finding_id"), "kind": kind,
                   "replica_group": last.get("replica_group"),
                   "replica_id": last.get("replica_id"), "ranks": last.get("ranks")}
        with kept_unless_written(h), self.store.atomic():  # never without its actions
            h.pop("hold", None)
            # the job and shard its drain entry and taint are keyed on: a later run on this
            # --state under another --job or --shard still releases them
            h.update(kind=kind, reason=summary, quarantined_at=now, job=self.job,
                     shard=(self.sender or {}).get("shard"),
                     expires_at=now + self.cfg.ttl_s, finding_id=last.get("finding_id"),
                     present_replica_ids=sorted({str(o["data"].get("replica_id"))
                                                 for o in offences
                                                 if o["data"].get("replica_id")}
                                                | self._on_host(h["host"])),
                     released_at=None, release_reason=None)
            set_state(h, QUARANTINED, now)
            self.store.add_host_decision(host=h["host"], decision="quarantine", reason=kind,
                                         detail=summary, evidence=evidence, at=now)
            self._queue(h, "quarantine", kind, summary, finding, now)
        self._held.pop(h["host"], None)
        log.warning("host %s (node %s) quarantined: %s", h["host"], h["node"], summary)
        return {"host": h["host"], "decision": "quarantine", "reason": kind, "detail": summary}

    def release(self, host: str, reason: str) -> dict[str, Any]:
        """``POST /v1/hosts/{host}/release`` (also of a host with a failed action, once its
        sink is fixed); KeyError: unknown host, ValueError: nothing to release."""
        now = self.clock()
        with self._lock:
            h = self.hosts.get(host)
            if h is None:
                raise KeyError(host)
            if h["state"] != QUARANTINED and not any(
                    a["status"] == "failed" for a in failing_actions(h)):
                raise ValueError(f"host {host} is {h['state']}, not quarantined")
            return self._release(h, now, "manual", reason)

    def _release(self, h: dict[str, Any], now: float, why: str, detail: str
                 ) -> dict[str, Any]:
        with kept_unless_written(h), self.store.atomic():  # never without its actions
            # a host not quarantined (a failed release cleared) only has its release sent
            # again: one suspect again keeps its new offences counting
            if h["state"] == QUARANTINED:
                h.update(released_at=now, release_reason=f"{why}: {detail}")
                set_state(h, RELEASED, now)
            self.store.add_host_decision(
                host=h["host"], decision="release", reason=why, detail=detail,
                evidence={"quarantined_at": h.get("quarantined_at"), "kind": h.get("kind")},
                at=now, source="manual" if why == "manual" else "auto")
            self._queue(h, "release", h.get("kind") or "", f"{why}: {detail}", None, now)
        log.warning("host %s released (%s): %s", h["host"], why, detail)
        return {"host": h["host"], "decision": "release", "reason": why, "detail": detail}

    def group_findings(self, evidence: Any, now: float) -> list[Finding]:
        """A ``quarantined_host`` finding for each group with a rank on a quarantined host that
        came there after the quarantine."""
        out = []
        with self._lock:
            bad = {h["host"]: h for h in self.hosts.values() if h["state"] == QUARANTINED}
            if not bad:
                return out
            for g, gv in evidence.groups.items():
                rid = gv.replica_id
                ranks = [r for r in gv.ranks
                         if (r.state or {}).get("host") in bad and r.reachable]
                if not ranks or rid is None:
                    continue
                hosts = sorted({r.state["host"] for r in ranks})
                if all(str(rid) in bad[x].get("present_replica_ids", []) for x in hosts):
                    continue
                culprits = [{"rank": r.rank, "group_rank": r.state.get("group_rank"),
                             "host": r.state.get("host"), "node": r.state.get("node"),
                             "device": r.state.get("device"), "pid": r.state.get("pid"),
                             "url": r.url} for r in ranks]
                ev = {"summary": f"replica group {g} ({rid}) runs on quarantined host(s) "
                                 f"{', '.join(hosts)}",
                      "hosts": {x: {"quarantined_at": bad[x].get("quarantined_at"),
                                    "kind": bad[x].get("kind"), "reason": bad[x].get("reason")}
                                for x in hosts},
                      "culprit_ranks": [r.rank for r in ranks],
                      "culprit_hosts": [c["host"] for c in culprits], "culprits": culprits}
                out.append(Finding("quarantined_host", g, rid, [r.rank for r in ranks], ev,
                                   now, now))
        return out

    def _save(self, h: dict[str, Any], now: float) -> None:
        self.store.save_host(h["host"], h, now)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {**dict.fromkeys(STATES, 0), **Counter(h["state"] for h in self.hosts.values())}

    def quarantined(self) -> list[str]:
        with self._lock:
            return sorted(h["host"] for h in self.hosts.values() if h["state"] == QUARANTINED)

    def to_json(self, now: float) -> list[dict[str, Any]]:
        """``GET /v1/hosts``: every host with an offence, a quarantine or a release."""
        with self._lock:
            hosts = [dict(h) for h in self.hosts.values()]
        out = []
        order = {QUARANTINED: 0, SUSPECT: 1, RELEASED: 2, OK: 3}
        since = now - self.cfg.window_s
        for h in sorted(hosts, key=lambda x: (order.get(x["state"], 4), x["host"])):
            rows = self.store.host_offences(h["host"], limit=20)
            h["offences"] = [{"at": o["at"], "kind": o["kind"], "finding_id": o["finding_id"],
                              "replica_group": o["data"].get("replica_group"),
                              "ranks": o["data"].get("ranks"),
                              "counts": o["data"].get("counts", True),
                              "note": o["data"].get("note"),
                              "in_window": o["data"].get("counts", True) and o["at"] >= since
                              and o["at"] > (h.get("released_at") or float("-inf"))}
                             for o in rows]
            h.pop("present_replica_ids", None)
            h["expires_in_s"] = (h["expires_at"] - now) if h["state"] == QUARANTINED \
                and h.get("expires_at") else None
            out.append(h)
        return out
