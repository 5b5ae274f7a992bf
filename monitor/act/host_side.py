"""The Enforcer's host side: findings charged to hosts, the quarantine policy, its API; apart
from evictions, as a host ledger failure is logged and shown (``hosts_trouble``), never raised."""

from __future__ import annotations

import sqlite3
import threading
from typing import Any

from ..detect import Finding
from ..evidence.lighthouse_status import LighthouseStatus
from ..evidence.view import ClusterView
from .hosts import HOST_KINDS, protected_hosts


def _aftermath(f: Finding, killed: set[str], gone: set[str]) -> bool:
    """A finding on a group the monitor had killed: its processes' end, not its host's fault
    (of the host kinds, ``dead`` only: the probes measure a host's links, not the processes)."""
    if f.kind in ("dead", "dead_rank"):
        return f.replica_id in killed
    return f.kind not in HOST_KINDS and f.replica_id in gone


class HostSide:
    """The Enforcer's host ledger duties (a mixin: its hosts, store, detectors and metrics)."""

    def host_findings(self, view: ClusterView, evidence: ClusterView, now: float,
                      reshaped: Any) -> list[Finding]:
        """New quarantined_host findings; those of released hosts are resolved. Never raises."""
        self._hosts_failed = False
        try:
            self.hosts.observe(view, now, reshaped)
            bad = set(self.hosts.quarantined())
            for f in self.detectors.open_findings():
                if f.kind == "quarantined_host" and not bad & set(f.evidence.get("hosts", {})):
                    self.detectors.resolve(f.key, "host_released", now)
            return [f for f in self.hosts.group_findings(evidence, now) if self.detectors.report(f)]
        except Exception as e:
            self._hosts_failed = True
            self._host_ledger_failed(e, now)
            return []

    def judge_hosts(self, view: ClusterView, new: list[Finding], now: float,
                    lighthouse: LighthouseStatus | None = None,
                    before: tuple[set[str], set[str]] | None = None) -> None:
        """Offences (a ``dead`` one once ``lighthouse``, just read, agrees: DeadGroups), the
        quarantine policy, due sink actions on a thread (a slow sink delays no sweep); no raise.
        ``before``: the replica ids told to go, and those a kill was sent for, before ``new``
        was confirmed (default: as the audit log has them now)."""
        try:
            # a group the monitor sent a kill for ends by that kill (even one left unconfirmed,
            # its Manager gone and a bare rank still up): no host's fault; nor is what its
            # processes show while it dies (the survivors' wait read as a hang): the offence
            # that got it killed counted. Kills sent before this sweep's findings, or a shard's
            # leader's in a copy its shard made of records read before it proposed
            if before is None:
                gone, killed = self.store.told_to_go_replica_ids(), self.store.evicted_replica_ids()
            else:
                gone, killed = before
                if mirrored := self.store.mirrored_replica_ids():  # read again only for those
                    gone = gone | self.store.told_to_go_replica_ids() & mirrored
                    killed = killed | self.store.evicted_replica_ids() & mirrored
            new = [f for f in new if not _aftermath(f, killed, gone)]
            counted = [f for f in new if f.kind != "dead"] + self.dead.agreed(
                new, {f.key for f in self.detectors.open_findings()}, view, lighthouse, killed)
            group_hosts = {f.replica_group: view.groups[f.replica_group].hosts for f in counted
                           if f.replica_group in view.groups}
            charged = [{**f.to_dict(), "id": self._finding_ids.get(f.key)} for f in counted]
            # a network finding a later round widened to another host: that host charged now, by
            # its own culprits only (those named before were at its opening; one opened now, whole)
            opened = {f.key for f in counted}
            for f, added in self.detectors.network_hosts_added():
                if f.key in opened:
                    continue
                d = f.to_dict()
                culprits = [c for c in d["evidence"].get("culprits") or ()
                            if c.get("host") in added]
                charged.append({**d, "id": self._finding_ids.get(f.key),
                                "evidence": {**d["evidence"], "culprits": culprits}})
            self.hosts.record(charged, now, group_hosts)
            # as the eviction rail: a group the Lighthouse stopped hearing is gone, not unseen
            self.hosts.decide(now, self.blind_to_kills(view, lighthouse, unheard=True),
                              len(self.hosts.known_hosts()),
                              lambda: protected_hosts(view, self.cfg.rails.min_replicas))
            if self.hosts.sinks and self.store.host_actions(due_at=now, limit=1):
                self._start_host_actions()
            self.metrics.set_hosts(self.hosts.counts(), self.hosts.to_json(now))
            if not self._hosts_failed:
                self.hosts_trouble.update(None, now)
        except Exception as e:
            self._host_ledger_failed(e, now)

    def _host_ledger_failed(self, e: Exception, now: float) -> None:
        self.hosts_trouble.update(f"{type(e).__name__}: {e}", now,  # a full disk: no traceback
                                  None if isinstance(e, sqlite3.OperationalError) else e,
                                  type(e).__name__)

    def hosts_json(self) -> dict[str, Any]:
        """``GET /v1/hosts``."""
        q = self.cfg.quarantine
        return {"hosts": self.hosts.to_json(self.clock()), "counts": self.hosts.counts(),
                "quarantined": self.hosts.quarantined(), "dry_run": q.dry_run,
                "actions": [s.name for s in self.hosts.sinks],
                "policy": {"after": q.after, "window_s": q.window_s, "ttl_s": q.ttl_s,
                           "max_quarantined": q.max_quarantined,
                           "cap": q.cap(len(self.hosts.known_hosts()))},
                "decisions": self.store.host_decisions(limit=50), "error": self.hosts_trouble.error}

    def release_host(self, host: str, reason: str) -> dict[str, Any]:
        """``POST /v1/hosts/{host}/release``; KeyError / ValueError as HostLedger.release."""
        out = self.hosts.release(host, reason)
        if self.hosts.sinks:
            self._start_host_actions()
        return out

    def _start_host_actions(self) -> None:
        if self._host_actions is None or not self._host_actions.is_alive():  # one at a time
            self._host_actions = threading.Thread(target=self.hosts.run_actions,
                                                  name="lightkeeper-host-actions", daemon=True)
            self._host_actions.start()

