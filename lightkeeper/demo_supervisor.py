"""The demo's supervisor: what Kubernetes (or a job scheduler) does for a real job. It restarts
a group whose process exited, off a host the monitor quarantined (the monitor's ``GET /v1/hosts``
read as a node's taint), or lets it wait when no host is free; it drains a quarantined host's
group (a NoExecute taint); and it keeps a warm spare per group started ahead."""

from __future__ import annotations

DRAIN_GRACE_S = 5.0  # a group on a quarantined host still running this long after: drained
MAX_RESTARTS, MAX_RESTARTS_SOAK = 5, 1000  # per group: a crash loop ends; a soak's do not


class Supervisor:
    """Part of :class:`~lightkeeper.demo_loop.Demo` (its state is set up there)."""

    def supervise(self) -> None:
        """Restart any group whose process exited (evicted, crashed), as a scheduler would."""
        if self.stopping:
            return
        self.drain_quarantined()
        refreshed = False
        for g, grp in sorted(self.cluster.groups.items()):
            if grp.alive() or (self.args.steps and grp.proc.returncode == 0):
                continue
            if not refreshed:  # the monitor may have quarantined the host this very sweep
                self.poll_hosts()
                refreshed = True
            n = self.restarts.get(g, 0)
            if n >= (MAX_RESTARTS_SOAK if self.soaking else MAX_RESTARTS):
                continue
            old = self.pool.host_of(g) if self.pool else None
            # the monitor's quarantine list, as a scheduler reads a node's taint; before the
            # monitor ever answered, nothing is known to be quarantined
            bad = set((self.hosts_view or {}).get("quarantined") or [])
            host = self.pool.place(g, bad) if self.pool else None
            if self.pool and host is None:
                if g not in self.waiting:
                    self.waiting[g] = self.now()
                    self.event("waiting", g, f"host {old.node if old else '?'} is quarantined "
                                             "and no other host is free: the group waits")
                continue
            waited = self.waiting.pop(g, None)
            self.restarts[g] = n + 1
            code = grp.proc.returncode
            moved = host is not None and old is not None and host.node != old.node
            why = (f"{old.node} quarantined" if moved else "same host") if host else "restart"
            self.placements.append(self._placement(g, host, why))
            new = self.cluster.start_group(g, host=host)
            self.procs.extend(p for p in new.processes() if p not in self.procs)
            where = "" if host is None else (
                f" on {host}" + (f", spare host ({old.node} quarantined)" if moved else ""))
            self.event("restarted", g, f"process exited ({code}); supervisor restarted it"
                                       f"{where} (restart {n + 1}, "
                                       + ("warm spare" if new.warm else "cold start")
                                       + (f", after waiting {self.now() - waited:.1f}s for a "
                                          "free host" if waited is not None else "") + ")")

    def drain_quarantined(self) -> None:
        """Stop the processes of a group whose host the monitor quarantined, as a scheduler
        evicts the pods of a tainted node (NoExecute): a host off the network never hears
        the Lighthouse's kill, and its group must still move. The supervisor restarts it."""
        from .processes import stop_process

        bad = set((self.hosts_view or {}).get("quarantined") or [])
        for g, grp in sorted(self.cluster.groups.items()):
            host = self.pool.host_of(g) if self.pool else None
            if host is None or host.node not in bad or not grp.alive():
                continue
            # as a NoExecute taint's toleration: an evicted group exits by itself first
            if self.now() - self.quarantines.get(host.node, self.now()) < DRAIN_GRACE_S:
                continue
            for proc in grp.processes():
                stop_process(proc, grace=0.0)
            self.event("drained", g, f"host {host.node} quarantined: its processes stopped, "
                                     "as a scheduler evicts a tainted node's pods")

    def refill_spares(self, wait: bool, timeout: float = 90.0) -> None:
        """Give every group a warm spare (unless --cold-restarts): with the job at its start
        and once the scenario is over (--keep-running), never while it is measured: a group
        restarted twice in one scenario starts cold the second time. With ``wait``, tick until
        they have all imported (at most ``timeout`` s: a spare not ready then is not used)."""
        if not self.sc.warm_spares or self.stopping:
            return
        for g in range(self.args.groups):
            had = g in self.cluster.spares and self.cluster.spares[g].group.alive()
            spare = self.cluster.start_spare(g)
            if not had:
                self.procs.extend(spare.group.processes())
                self.event("spare", g, "warm spare started (imports, then waits)")
        if wait:
            self.wait(lambda: all(sp.ready() for sp in self.cluster.spares.values()), timeout)
