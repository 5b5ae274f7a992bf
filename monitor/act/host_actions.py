"""The host ledger's actions: one queued per sink for each quarantine or release, carried out
by a background thread with backoff. A sink that raises is a failed attempt. See
docs/quarantine.md.
"""

from __future__ import annotations

import logging
import re
import shlex
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from monitor.config import QuarantineConfig, url_host_port
from monitor.store import Store

from .sinks import ActionResult, Sink
from .sinks.base import event_shard, sink_name

log = logging.getLogger(__name__)

# retried 2 s, 4 s, ... then every 5 min until done: an outage must not lose a cordon or drain
BACKOFF_S, BACKOFF_MAX_S = 2.0, 300.0
FAILING = ("failed", "retrying")  # a last action not carried out (alerted, kept in the ledger)
UNDONE = ("pending", *FAILING)
HASHED = re.compile(r"(.*)\.\.\.#[0-9a-f]{8}", re.S)  # sink_name's ``public...#digest``


def failing_actions(h: dict[str, Any]) -> list[dict[str, Any]]:
    """The newest action of each configured sink that failed or is retried (for a host saved
    by an older version: its ``last_action``)."""
    acts = h.get("actions")
    if acts is None:
        acts = {"": h["last_action"]} if h.get("last_action") else {}
    return [a for a in acts.values()
            if a.get("status") in FAILING and a.get("configured", True)]


def public_sink_name(name: str) -> str:
    """A stored sink name as this version shows it: an older version stored the whole
    ``--action`` (a webhook URL's secret path, a hook's arguments)."""
    kind, _, arg = name.partition(":")
    if name == "kubernetes":
        return "k8s"
    if kind not in ("webhook", "exec") or not arg:
        return name

    def public(given: str) -> str:
        if kind == "webhook":
            return f"{urlsplit(given).scheme}://{url_host_port(given)}"
        try:
            argv = shlex.split(given)
        except ValueError:  # unbalanced quotes: no argument can be told from the program
            return ""
        return argv[0] if len(argv) > 1 else given

    hashed = HASHED.fullmatch(arg)
    if hashed and (kind == "exec" or "/" not in hashed.group(1).partition("://")[2]):
        return name  # already ``kind:public...#digest`` (a program, a URL without a path)
    return sink_name(kind, arg, public(arg))


def rename_old_sinks(store: Store, keep: Iterable[str], hosts: dict[str, dict[str, Any]]
                     ) -> None:
    """Rename older versions' sink names to their public form, in the audit log and the saved
    hosts (``keep``: the configured sinks' names, never renamed)."""
    keep = set(keep)

    def new(name: str) -> str:
        return name if name in keep else public_sink_name(name)

    for old in {a["sink"] for a in store.newest_host_actions()}:
        if new(old) != old:
            store.rename_sink(old, new(old))
    for h in hosts.values():
        acts = h.get("actions")
        if acts is None and h.get("last_action"):  # saved before ``actions``: its newest
            acts = h["actions"] = {h["last_action"].get("sink") or "": h["last_action"]}
        h["actions"] = {new(s): {**a, "sink": new(a.get("sink") or s)}
                        for s, a in (acts or {}).items()}
        if h.get("last_action"):
            h["last_action"]["sink"] = new(h["last_action"].get("sink") or "")


def monitor_identity(monitor_id: str, shard: str | None) -> dict[str, Any]:
    """Who sends a sink's events: action ids are numbered per state file, and a slice's holder
    and its standby both send theirs, so a receiver tells them apart by ``id`` (the state file's,
    ``Store.identity``: the same after a restart); ``host`` is for people."""
    return {"id": monitor_id, "host": socket.gethostname(), "shard": shard}


class HostActions:
    """The action queue of :class:`~monitor.act.hosts.HostLedger` (which provides the fields
    below). A sink no longer configured keeps its actions on the host, ``configured: false``:
    never retried nor alerted, and they keep no host in the ledger nor make it releasable."""

    store: Store
    cfg: QuarantineConfig
    sinks: list[Sink]
    job: str
    sender: dict[str, Any] | None
    clock: Callable[[], float]
    hosts: dict[str, dict[str, Any]]
    _lock: Any
    _save: Callable[[dict[str, Any], float], None]

    def _load_actions(self) -> None:
        """Where each sink stands for each host, as the audit log says (start-up)."""
        self._actions_running = threading.Lock()
        self._sink_names = {s.name for s in self.sinks}
        rename_old_sinks(self.store, self._sink_names, self.hosts)
        for a in sorted(self.store.newest_host_actions(), key=lambda a: a["id"]):
            if a["status"] in ("pending", "retrying") and a["sink"] not in self._sink_names:
                a = self._unconfigured(a)
            if a["host"] in self.hosts:
                self._note(self.hosts[a["host"]], {**a, "at": a["updated_at"]})
        for h in self.hosts.values():  # and the entries only a saved host holds (rows dropped)
            self._settle(h)

    def _unconfigured(self, a: dict[str, Any]) -> dict[str, Any]:
        """Fail ``a``, whose sink is not configured now: a later run that configures it again
        must not carry out what no ledger tracked since."""
        at = self.clock()
        detail = f"sink {a['sink']} is no longer configured" + (
            f"; not carried out after {a['attempts']} attempt(s), the last: {a['detail']}"
            if a["attempts"] else "")
        self.store.update_host_action(a["id"], status="failed", attempts=a["attempts"],
                                      next_at=None, detail=detail, at=at)
        log.info("host %s: %s via %s failed: %s", a["host"], a["op"], a["sink"], detail)
        return {**a, "status": "failed", "detail": detail, "updated_at": at, "next_at": None}

    def _unsettled(self, h: dict[str, Any]) -> bool:
        """A configured sink's newest action for ``h`` not carried out (pending, retried or
        failed): the host stays in the ledger."""
        return any(a.get("status") in UNDONE and a.get("configured", True)
                   for a in (h.get("actions") or {}).values())

    def _queue(self, h: dict[str, Any], op: str, kind: str, reason: str,
               finding: dict | None, now: float) -> None:
        # a release names the job and shard that quarantined the host (its drain, its taint),
        # not this run's --job and --shard; a host saved before they were kept: this run's
        shard = h["shard"] if "shard" in h else (self.sender or {}).get("shard")
        for sink in self.sinks:
            event = {"event": op, "host": h["host"], "node": h.get("node") or h["host"],
                     "devices": list(h.get("devices", [])), "kind": kind, "reason": reason,
                     "slurm_jobs": list(h.get("slurm_jobs", [])),
                     "finding": finding, "job": h.get("job") or self.job, "shard": shard,
                     "at": now,
                     "expires_at": h.get("expires_at") if op == "quarantine" else None}
            aid = self.store.add_host_action(host=h["host"], sink=sink.name, op=op,
                                             status="pending", event=event, at=now, next_at=now)
            self._note(h, {"id": aid, "sink": sink.name, "op": op, "status": "pending",
                           "attempts": 0, "detail": "", "at": now, "next_at": now})
        self._save(h, now)

    def _note(self, h: dict[str, Any], a: dict[str, Any]) -> None:
        """``a``: its sink's newest action on ``h``."""
        h.setdefault("actions", {})[a["sink"]] = {k: a.get(k) for k in (
            "id", "sink", "op", "status", "attempts", "detail", "at", "next_at")}
        self._settle(h)

    def _settle(self, h: dict[str, Any]) -> None:
        """``last_action``: a configured sink's failing one (never hidden by another sink's
        success), else the newest (a configured sink's where there is one)."""
        acts = h.get("actions") or {}
        for x in acts.values():
            x["configured"] = x.get("sink") in self._sink_names
        mine = [x for x in acts.values() if x["configured"]]
        failing = [x for x in mine if x.get("status") in FAILING]
        if acts:
            h["last_action"] = dict(max(failing or mine or acts.values(),
                                        key=lambda x: x.get("id") or 0))

    def run_actions(self, now: float | None = None) -> int:
        """Carry out every due action once; returns the attempts made (0 while another runs,
        or in a dry run: a previous run's pending ones wait for a run that acts)."""
        if self.cfg.dry_run or not self._actions_running.acquire(blocking=False):
            return 0
        try:
            due = self.store.host_actions(due_at=self.clock() if now is None else now)
            rows = self.store.host_actions() if due else []
            settled: set[int] = set()  # releases found to have nothing to undo
            # first attempts before retries: a sink timing out on every retry must not hold
            # a new quarantine back for a whole round of them
            due.sort(key=lambda a: a["attempts"] > 0)
            for n, a in enumerate(due):
                if a["id"] in settled:
                    continue
                if a["attempts"] and self._new_action_waits():
                    return n  # the next run takes it first; these retries stay due
                with self._lock:  # one queued since ``rows`` was read (a POST /release)
                    known = ((self.hosts.get(a["host"]) or {}).get("actions") or {}).get(
                        a["sink"]) or {}
                if (known.get("id") or 0) > max((r["id"] for r in rows), default=0):
                    rows = self.store.host_actions()
                # a per-job sink: only the same job's (and shard's) next action overtakes it,
                # as another's quarantine holds its own drain or taint; a hook holds one per host
                per_job = getattr(self._sink(a["sink"]), "per_job", False)
                holder = (a["event"].get("job"), event_shard(a["event"]))
                later = sorted((r for r in rows if r["host"] == a["host"]
                                and r["sink"] == a["sink"] and r["id"] > a["id"]
                                and (not per_job or (r["event"].get("job"),
                                                     event_shard(r["event"])) == holder)),
                               key=lambda r: r["id"])
                if later:  # attempted or not, never carried out after the host's next action
                    self._supersede(a, later[0], settled)
                    continue
                attempts = a["attempts"] + 1
                # written before the sink is called: an attempt the monitor's death cut short
                # still counts, so a release queued after it is never taken as nothing to undo
                self.store.update_host_action(
                    a["id"], status=a["status"], attempts=attempts, next_at=a["next_at"],
                    detail=f"attempt {attempts} under way: no answer recorded", at=self.clock())
                res = self._attempt(a, attempts)
                done = self.clock()
                if res.ok:
                    status, next_at = "done", None
                elif res.retry:
                    status = "retrying"
                    # the exponent capped: 2.0 * 2**1024 overflows (3.5 days of retries)
                    next_at = done + min(BACKOFF_MAX_S, BACKOFF_S * 2 ** min(attempts - 1, 16))
                else:
                    status, next_at = "failed", None
                (log.info if res.ok else log.warning)(
                    "host %s: %s via %s, attempt %d: %s (%s)", a["host"], a["op"], a["sink"],
                    attempts, status, res.detail)
                self.store.update_host_action(a["id"], status=status, attempts=attempts,
                                              next_at=next_at, detail=res.detail, at=done)
                self._noted({**a, "status": status, "attempts": attempts,
                             "detail": res.detail, "at": done, "next_at": next_at})
            return len(due)
        finally:
            self._actions_running.release()

    def _supersede(self, a: dict[str, Any], nxt: dict[str, Any], settled: set[int]) -> None:
        """Drop ``a`` for ``nxt``, the host and sink's next action. A release right after a
        never-attempted quarantine is marked done unrun when the sink holds nothing to undo
        (no earlier action tried, or the last one a release done)."""
        at = self.clock()
        void = not a["attempts"] and a["op"] == "quarantine" and nxt["op"] == "release" \
            and not nxt["attempts"] and nxt["status"] in ("pending", "retrying")
        if void:
            before = self.store.host_action_before(a["host"], a["sink"], a["id"])
            void = before is None or (before["op"], before["status"]) == ("release", "done")
        with self.store.atomic():
            self.store.update_host_action(a["id"], status="superseded", attempts=a["attempts"],
                                          next_at=None, at=at, detail="a later action for this "
                                          "host overtook it before it was carried out")
            if void:
                detail = "nothing carried out: the quarantine it undoes was never attempted"
                self.store.update_host_action(nxt["id"], status="done", attempts=0,
                                              next_at=None, detail=detail, at=at)
        log.info("host %s: %s via %s superseded by a later %s", a["host"], a["op"], a["sink"],
                 nxt["op"])
        if void:
            settled.add(nxt["id"])
            self._noted({**nxt, "status": "done", "detail": detail, "at": at, "next_at": None})

    def _noted(self, a: dict[str, Any]) -> None:
        """``a``'s new status on its host, if it is still its sink's newest action there."""
        with self._lock:
            h = self.hosts.get(a["host"])
            if h is None or (((h.get("actions") or {}).get(a["sink"]) or {}).get("id")
                             or 0) > a["id"]:
                return
            self._note(h, a)
            self._save(h, a["at"])

    def _new_action_waits(self) -> bool:
        return any(not a["attempts"] for a in self.store.host_actions(due_at=self.clock()))

    def _sink(self, name: str) -> Sink | None:
        return next((s for s in self.sinks if s.name == name), None)

    def _attempt(self, a: dict[str, Any], attempts: int) -> ActionResult:
        sink = self._sink(a["sink"])
        if sink is None:
            return ActionResult(False, f"sink {a['sink']} is no longer configured", retry=False)
        event = {**a["event"], "action_id": a["id"], "attempt": attempts, "monitor": self.sender}
        try:
            if a["op"] == "release":  # a sink holds only what that quarantine carried out
                event["undoes"] = self._undoes(a)
            return getattr(sink, a["op"])(event)
        except Exception as e:  # a sink bug is a failed attempt, never a crash
            log.exception("sink %s failed", a["sink"])
            return ActionResult(False, f"{type(e).__name__}: {e}")

    def _undoes(self, a: dict[str, Any]) -> dict[str, Any] | None:
        """For release ``a``: its sink's newest quarantine of the host tried before it, past
        releases not done (they undid nothing), as ``{"action_id", "status"}``; None when
        there is none, or a release done came after it."""
        b = self.store.host_action_before(a["host"], a["sink"], a["id"])
        while b and b["op"] == "release" and b["status"] != "done":
            b = self.store.host_action_before(a["host"], a["sink"], b["id"])
        return {"action_id": b["id"], "status": b["status"]} \
            if b and b["op"] == "quarantine" else None
