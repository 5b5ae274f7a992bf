"""The processes the demo starts and stops: the Lighthouse, the monitor (with its quarantine
flags), every group and its warm spare, Prometheus; each group's placement on a host; the URLs a
user on this machine reaches them at; and the stop of all of them, by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SOAK_QUARANTINE_TTL_S = 45.0  # --soak: a quarantined host, repaired, comes back after this


class Processes:
    """Part of :class:`~lightkeeper.demo_loop.Demo` (its state is set up there)."""

    def start(self) -> None:
        from trainer.faults import NETWORK_KINDS

        from .processes import ClusterError, wait_until

        self.logs.mkdir(parents=True, exist_ok=True)
        self._log = open(self.dir / "demo.log", "a")
        self.sweep_left_behind()
        try:
            self.cluster.start_lighthouse()  # stops its process itself if it fails to start
        finally:  # a Ctrl-C as it returns: the Lighthouse is stopped with the rest
            if self.cluster.lighthouse is not None:
                self.procs.append(self.cluster.lighthouse.proc)
        self.event("lighthouse", None, self.user_url(self.cluster.lighthouse_url))
        self.start_monitor()
        self.cluster.extra_env["LIGHTKEEPER_MONITOR"] = self.monitor_url
        specs: dict[int, list[str]] = {}
        for plan in self.sc.faults:  # a network fault is the host's: strike_hosts applies it
            if plan.at_start and plan.kind not in NETWORK_KINDS:
                specs.setdefault(plan.replica_group, []).append(plan.spec)
        for g in range(self.args.groups):
            self.launched_at[g] = self.now()
            host = self.pool.place(g) if self.pool else None
            self.placements.append(self._placement(g, host, "first start"))
            self.procs.extend(self.cluster.start_group(g, specs.get(g), host=host).processes())
        self.refill_spares(wait=False)
        for g in range(self.args.groups):
            try:
                self.cluster.wait_for_workers(g, timeout=120)
            except TimeoutError as e:
                raise ClusterError(str(e)) from None
        for g, grp in sorted(self.cluster.groups.items()):
            urls = map(self.both_urls, grp.worker_urls.values())
            self.event("started", g, "WorkerServers " + ", ".join(urls))
        self.start_prometheus()
        self.status = "waiting for the first quorum"
        wait_until(lambda: self.tick() or self.all_stepping(), 180, interval=0.0,
                   what="every group to commit a step")
        self.refill_spares(wait=True)  # a spare importing torch would slow the healthy baseline
        self.train_start_s = self.now()
        self.event("training", None, f"all {self.args.groups} groups committing steps")

    def sweep_left_behind(self) -> None:
        """Kill what a killed earlier demo left running, whatever its hosts (one demo runs at a
        time: the lock), and as root remove its namespaces (a namespaced demo's fabric did
        already); then mark every process this one starts as its own (``OWNER_ENV``)."""
        from .processes import OWNER_ENV, kill_orphans, owner_mark

        if self.fabric is None and os.geteuid() == 0:
            from .fabric import Fabric

            stale = Fabric.sweep_stale()
            if stale:
                self.say(f"lightkeeper demo: removed what a killed earlier demo left: "
                         f"{', '.join(stale)}")
        pids = kill_orphans()
        if pids:
            self.say(f"lightkeeper demo: killed {len(pids)} process(es) a killed earlier demo "
                     f"left running: PIDs {', '.join(map(str, sorted(pids)))}")
        os.environ[OWNER_ENV] = owner_mark(os.getpid())

    def start_monitor(self, port: int = 0) -> None:
        from .processes import start_monitor_process

        log_path = self.logs / "monitor.log"
        out_path = self.logs / "monitor.out"
        cmd = [sys.executable, "-u", "-m", "lightkeeper.cli", "monitor", "--port", str(port),
               "--lighthouse", self.cluster.lighthouse_url,
               "--state", str(self.dir / "monitor.sqlite"), "--job", self.cluster.job,
               "--sd-out", str(self.dir / "prometheus" / "file_sd" / "lightkeeper.json"),
               "--interval", "0.5", "--cooldown", "5", "--hang-floor", f"{self.sc.hang_floor_s:g}",
               "--expected-groups", str(self.args.groups),
               "--lighthouse-heartbeat-timeout-ms", str(self.sc.heartbeat_timeout_ms),
               "--lighthouse-join-timeout-ms", str(self.sc.join_timeout_ms),
               "--orphan-grace", "1",  # the exit token: in its environment, not argv
               "--min-replicas", str(max(1, self.args.groups - 1))]
        if self.fabric:  # on the bridge: the ranks register from their hosts
            from .fabric import CIDR

            cmd += ["--bind", self.fabric.ctl_addr, "--allow-targets", CIDR]
        cmd += self.quarantine_args()
        if self.args.dry_run:
            cmd.append("--dry-run")
        (self.dir / "prometheus" / "file_sd").mkdir(parents=True, exist_ok=True)
        # the admin token's header line for the user's curl (-H @file), readable by them alone;
        # removed at the stop. Made anew: one a killed run left keeps its mode, and a link put
        # there would be followed
        self.admin_token_path.unlink(missing_ok=True)
        fd = os.open(self.admin_token_path,
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"Authorization: Bearer {self.admin_token}\n")
        self.monitor_proc, self.monitor_url = start_monitor_process(
            cmd, out_path, log_path, env={**os.environ, "LIGHTKEEPER_EXIT_TOKEN": self.exit_token,
                                          "LIGHTKEEPER_TOKEN": self.admin_token,
                                          "LIGHTKEEPER_REGISTER_TOKEN": self.register_token})
        self.procs.append(self.monitor_proc)
        self.event("monitor", None, self.user_url(self.monitor_url)
                   + (" (dry run)" if self.args.dry_run else ""))

    @property
    def admin_token_path(self) -> Path:
        return self.dir / "monitor-admin-token"

    def quarantine_args(self) -> list[str]:
        """The monitor's host-quarantine flags (docs/demo.md, "Hosts"). Off with --one-host
        (every rank on one machine: quarantining it would end the demo) or --no-quarantine.
        The cap is the number of spare hosts: each quarantine moves a group to a spare, and
        one more would leave a group waiting; the default 10% of 3-5 hosts is 1, which would
        hold the second of two faulty hosts."""
        from monitor.config import QUARANTINE_AFTER

        a = self.args
        if a.one_host or a.no_quarantine:  # every kind that counts by default, off
            return ["--quarantine-after", ",".join(f"{k}=0" for k in QUARANTINE_AFTER)]
        out = ["--max-quarantined", str(max(1, a.spare_hosts))]
        if self.soaking:  # a repaired host returns once its quarantine expires
            out += ["--quarantine-ttl", f"{SOAK_QUARANTINE_TTL_S:g}"]
        if a.quarantine_dry_run or a.dry_run:  # --dry-run acts on nothing, hosts included
            out.append("--quarantine-dry-run")
        return out

    def _placement(self, g: int, host, why: str) -> dict:
        return {"replica_group": g, "at_s": self.now(), "node": host.node if host else None,
                "addr": host.addr if host else None, "why": why}

    def start_prometheus(self) -> None:
        from dashboards.promconfig import prometheus_config

        from . import prometheus

        if self.args.no_prometheus:
            self.prom_note = "not started (--no-prometheus)"
            return
        if prometheus.binary() is None:
            self.prom_note = f"not started: {prometheus.INSTALL_HINT}"
            self.event("prometheus", None, self.prom_note)
            return
        rules = Path(__file__).resolve().parent.parent / "dashboards" / "prometheus" / "rules.yml"
        cfg = prometheus_config(
            file_sd_files=[str(self.dir / "prometheus" / "file_sd" / "*.json")],
            monitor_targets=[self.monitor_url.split("://", 1)[1]], monitor_job=self.cluster.job,
            rule_files=[str(rules)] if rules.exists() else [], scrape_interval="2s")
        try:
            self.prom = prometheus.start(cfg, self.dir / "prometheus")
        except prometheus.PrometheusError as e:
            self.prom_note = f"failed to start: {str(e).splitlines()[0]}"
            self.event("prometheus", None, self.prom_note)
            return
        self.procs.append(self.prom.proc)
        self.prom_note = f"{self.user_url(self.prom.url)} (config {self.prom.config_path})"
        self.event("prometheus", None, self.prom_note)

    def user_url(self, url: str | None) -> str | None:
        """``url`` as a user on this machine reaches it: on a fabric, through a forward from
        127.0.0.1 into the job's network (its addresses exist only in its namespaces)."""
        if not url or self.fabric is None:
            return url
        import urllib.parse

        from .fabric import FabricError

        u = urllib.parse.urlsplit(url)
        if (u.hostname, u.port) not in self._forwards:
            try:
                self._forwards[(u.hostname, u.port)] = self.fabric.forward(u.port,
                                                                           addr=u.hostname)
            except FabricError:  # the final report, once the fabric is gone
                return url
        return u._replace(netloc=f"127.0.0.1:{self._forwards[(u.hostname, u.port)]}").geturl()

    def both_urls(self, url: str) -> str:
        """A rank's URL as a user here reaches it and, on a fabric, the address the monitor,
        its audit log and bundles name it by (its host's, in the job's network)."""
        here = self.user_url(url)
        if here == url:
            return url
        import urllib.parse

        return f"{here} ({urllib.parse.urlsplit(url).netloc} in the job's network)"

    # --- stop ---------------------------------------------------------------------------------
    def stop(self, grace: float = 3.0) -> None:
        """Stop every process the demo started and their descendants, by PID: SIGTERM to all but
        the monitor at once, then to the monitor (a stopped rank waits for its read: a planned
        stop), ``grace`` seconds for each of the two, then SIGKILL whatever is left."""
        from .processes import OWNER_ENV, descendants, signal_same, stamped, stop_process

        self.stopping = True
        self.status = "stopping"
        running = [p for p in reversed(self.procs) if p.poll() is None]
        # the trees as they are now: a child whose parent exits is no longer its descendant.
        # With start times: a PID that exits during the grace may be another process's after
        trees = {p: stamped([p.pid, *descendants(p.pid)]) for p in running}
        monitor = getattr(self, "monitor_proc", None)
        for last in (False, True):
            now = [p for p in running if (p is monitor) == last]
            signal_same([pp for p in now for pp in trees[p]], signal.SIGTERM)
            end = time.monotonic() + grace
            for p in now:
                try:
                    p.wait(timeout=max(0.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for p in reversed(self.procs):
            try:
                stop_process(p, grace=0.0)  # SIGKILL the rest of its tree and reap it
                signal_same(trees.get(p, [])[1:], signal.SIGKILL)
            except Exception as e:  # keep stopping the others
                self.say(f"lightkeeper demo: could not stop PID {p.pid}: {e}")
        if self._log:
            self._log.close()
            self._log = None
        self.admin_token_path.unlink(missing_ok=True)  # its monitor is gone: no secret left
        os.environ.pop(OWNER_ENV, None)  # nothing is started from here on

    def pids(self) -> list[int]:
        return sorted({p.pid for p in self.procs} | self.rank_pids)
