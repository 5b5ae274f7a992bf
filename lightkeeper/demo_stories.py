"""The scenario the demo plays (:mod:`lightkeeper.scenario`) and each fault's story: the faults
armed (given at start) or injected live into a running rank, a network fault applied to its
group's host once the group reaches its step, and every story followed
(:class:`~lightkeeper.faulttrack.FaultTrack`) until it ends, one fault at a time."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain

import requests

from .demo_options import baseline_steps
from .faulttrack import Deadlines, FaultTrack, Strike
from .scenario import FaultPlan

SLOW_LINK_MBIT = 20.0  # a live slow_link's rate: the degraded link
# the most a soak's fault waits for the last one's drains, restarts and quarantines to be over:
# a quarantine frees its host after the soak's 45 s TTL, a drained group is back in seconds
SETTLE_S = 90.0


class Stories:
    """Part of :class:`~lightkeeper.demo_loop.Demo` (its state is set up there)."""

    def run_scenario(self) -> None:
        try:
            self._run_scenario()
        finally:  # ended or stopped (--duration): --keep-running ticks on with this line
            self.status = "scenario over" + (", kept running (Ctrl-C stops it)"
                                             if getattr(self.args, "keep_running", False) else "")

    def _run_scenario(self) -> None:
        plans = self.sc.faults
        if not plans:
            self.status = "healthy"
            while True:
                self.tick()
        for plan in plans:
            if plan.at_start:
                tr = self.arm(plan.spec, plan.replica_group, "start",
                              self.launched_at[plan.replica_group])
                self.event("armed", plan.replica_group,
                           f"{plan.spec} (given at start; strikes from step {tr.trigger_step})")
        listed = [plan for plan in plans if not plan.at_start]
        if listed:
            self.status = f"healthy ({self.sc.healthy_s:g}s)"
            self.wait(lambda: False, self.sc.healthy_s)
        live: Iterable[FaultPlan] = listed
        if self.soaking:  # its time is its only stop: past the list, its schedule goes on
            live = chain(listed, getattr(plans, "rest", ()))
        for plan in live:  # one at a time: the next once the last one's story is over
            self.status = "following the faults"
            self.wait(self.story_over, float("inf"))
            # and the monitor's ledger saw the job back at pace: each fault measured alone
            self.wait(self.ledger_settled, self.sc.ledger_wait_s)
            if self.soaking and not self.soak_turn():
                break
            # No refill of a used spare here: its import would slow the job that is being
            # measured (on this machine a spare shares the cores; a real one waits elsewhere).
            self.inject_live(plan)
        else:
            if self.soaking:  # a finite schedule ran out before the soak's time: said
                self.soak["schedule_exhausted"] = True
                self.event("soak", None, "the fault schedule ran out before the soak's time")
        self.status = "following the faults"
        self.wait(self.story_over, float("inf"))  # every stage of every story has a deadline
        self.event("story", None, "every fault's story is over: " + "; ".join(
            f"{tr.index}: {tr.record['outcome']}" for tr in self.tracks))
        self.status = f"healthy end ({self.sc.end_s:g}s)"
        self.wait(lambda: False, self.sc.end_s)
        # The ledger says a job is back at pace once a whole pace window (20 steps, 3 s at
        # least) after the eviction was at pace: give it that long to say so (at most
        # --ledger-wait, 30 s).
        self.status = "waiting for the monitor's ledger to see the job back at pace"
        self.wait(self.ledger_settled, self.sc.ledger_wait_s)

    def soak_turn(self) -> bool:
        """Between two of a soak's faults: False once its time is up; the monitor restarted
        once, half-way; the spares refilled (a soak restarts groups many times); then the wait
        until nothing of the last fault goes on (:meth:`settle`)."""
        from .soak import restart_monitor, rss_kb

        trained = self.now() - (self.train_start_s or 0.0)
        if trained >= self.args.soak:
            return False
        if "restart" not in self.soak and trained >= self.args.soak / 2:
            self.soak["rss"].append({"life": 1, "end_kb": rss_kb(self.monitor_proc.pid)})
            self.soak["restart"] = restart_monitor(self)
            self.soak["restart"]["job_step"] = self.job_step()
            self.soak["rss"].append({"life": 2, "start_kb": rss_kb(self.monitor_proc.pid)})
        self.refill_spares(wait=True)
        self.settle()
        return True

    def settle(self) -> None:
        """Wait (at most SETTLE_S) until nothing of an earlier fault goes on (:meth:`unsettled`),
        so the next one is measured alone; past that it is injected all the same, and said."""
        self.status = "waiting for the last fault's drains, restarts and quarantines"
        if not self.wait(lambda: self.unsettled() is None, SETTLE_S):
            self.event("soak", None, f"not settled after {SETTLE_S:g}s, the next fault "
                                     f"injected all the same: {self.unsettled()}")

    def unsettled(self) -> str | None:
        """What of an earlier fault still goes on, or None: a group not running, waiting for a
        host, on a quarantined host (its drain due) or not back in a quorum of every group; a
        host's quarantine held by a rail; no spare host free for the next fault's quarantine.
        With one spare free and none held, the cap (the spares) holds no single quarantine. And
        a monitor restarted has taken its job-wide baseline anew (a slow link is judged
        against it), twice over."""
        view = self.hosts_view or {}
        bad = set(view.get("quarantined") or [])
        for g, grp in sorted(self.cluster.groups.items()):
            host = self.pool.host_of(g) if self.pool else None
            st = self.latest.get(g) or []
            if not grp.alive() or g in self.waiting:
                return f"group {g} is not running"
            if host is not None and host.node in bad:
                return f"group {g} still runs on quarantined host {host.node}"
            if len(st) < self.args.ranks_per_group or not all(
                    s["participating"] and s["num_participants"] == self.args.groups for s in st):
                return f"group {g} is not in a quorum of all {self.args.groups} groups"
        restart = self.soak.get("restart") or {}
        if "job_step" in restart and self.job_step() < restart["job_step"] + 2 * baseline_steps():
            return "the restarted monitor is taking its job-wide baseline"
        for h in view.get("hosts") or []:
            hold = h.get("hold") or {}
            if h.get("state") == "suspect" and hold.get("reason") not in (None, "dry_run"):
                return f"host {h.get('host')}'s quarantine is held ({hold.get('reason')})"
        if self.pool and self.args.spare_hosts and not self.pool.spares(bad):
            return "no spare host is free"
        return None

    # --- the stories --------------------------------------------------------------------------
    def follow_stories(self) -> None:
        if not self.tracks:
            return
        obs = self.observation()
        for tr in self.tracks:
            tr.note_hosts(obs)
        open_tracks = [tr for tr in self.tracks if not tr.done]
        for tr in open_tracks:
            for kind, detail in tr.update(obs):
                self.event(kind, tr.group, detail)
            tr.note_hosts(obs)
        still = [f"fault {tr.index}: {tr.describe()}" for tr in open_tracks if not tr.done]
        if still:
            self.status = "; ".join(still)

    def deadlines(self) -> Deadlines:
        sc = self.sc
        return Deadlines(strike_s=sc.strike_timeout_s, detect_s=sc.detect_timeout_s,
                         evict_s=sc.evict_timeout_s, rejoin_s=sc.rejoin_timeout_s)

    def arm(self, spec: str, g: int, given: str, armed_at_s: float) -> FaultTrack:
        """Start following ``spec`` in group ``g`` (already given to it, or just injected)."""
        from trainer.faults import parse_fault

        f = parse_fault(spec)
        tr = FaultTrack(
            len(self.tracks) + 1, replica_group=g, group_rank=f.rank, spec=f.spec, kind=f.kind,
            trigger_step=f.from_step if f.kind in ("slow", "slow_compute", "slow_link")
            else f.at_step,
            given=given, armed_at_s=armed_at_s, counting_from_s=self.now(),
            incarnation=self.restarts.get(g, 0), step_at_arming=self.group_step(g),
            ranks_per_group=self.args.ranks_per_group, deadlines=self.deadlines())
        self.tracks.append(tr)
        return tr

    def story_over(self) -> bool:
        return all(tr.done for tr in self.tracks)

    def ledger_settled(self) -> bool:
        """Every evicted fault's incident in the monitor's ledger has its back-at-pace time."""
        from .recovery import ledger_incident

        for f in self.faults:
            if f["evicted_at_s"] is None:
                continue
            inc = ledger_incident(f, self.goodput, self.t0_unix)
            if inc is None or inc.get("back_to_pace_at") is None:
                return False
        return True

    # --- the faults injected ------------------------------------------------------------------
    def post_fault(self, urls: list[str], spec: str) -> bool:
        ok = bool(urls)
        for url in urls:
            try:
                r = self.http.post(url + "/v1/faults", json={"spec": spec}, timeout=5,
                                   headers={"Authorization": f"Bearer {self.token}"})
                # a try whose answer was lost may have been taken: the rank then refuses the
                # same spec again, and it is injected all the same
                ok = ok and (r.ok or (r.status_code == 400 and "already injected" in r.text))
            except requests.RequestException:
                ok = False
        return ok

    def live_spec(self, plan: FaultPlan, step: int) -> str:
        """The spec of a default fault, from the group's current ``step``."""
        rank = "" if plan.group_rank is None else f",rank={plan.group_rank}"
        at = step + self.sc.hang_in_steps
        if plan.kind in ("slow", "slow_compute"):
            return f"{plan.kind}:delay={self.sc.slow_delay_s:g},from_step={step}{rank}"
        if plan.kind == "slow_link":
            return f"slow_link:mbit={SLOW_LINK_MBIT:g},from_step={at}"
        if plan.kind in ("partition", "host_offline", "crash"):  # no where= in their grammar
            return f"{plan.kind}:at_step={at}{rank}"
        # in the group only on one rank of it: struck on every rank it would do nothing
        where = ",where=group" if self.args.ranks_per_group > 1 and rank else ""
        return f"{plan.kind}:at_step={at}{where}{rank}"

    def inject_live(self, plan: FaultPlan) -> None:
        """Inject a default fault into the running target rank (every rank: group-wide); a
        network fault is armed for a step ahead and applied to the group's host then."""
        from trainer.faults import NETWORK_KINDS

        g = plan.replica_group
        self.wait(lambda: self.group_step(g) >= 1 and len(self.latest.get(g) or [])
                  == self.args.ranks_per_group, self.sc.rejoin_timeout_s)
        if plan.kind in NETWORK_KINDS:
            spec = self.live_spec(plan, self.fresh_step(g))
            self.arm(spec, g, "live", self.now())
            self.event("injected", g, f"{spec} (on host {self.pool.host_of(g).node})")
            return
        urls = self.cluster.groups[g].worker_urls
        targets = [urls[plan.group_rank]] if plan.group_rank in urls else list(urls.values())
        spec = self.live_spec(plan, self.fresh_step(g))
        # injected when the POST goes out: a fault from the current step strikes while the
        # answer is on its way on a busy box
        given_at = self.now()
        # A posted one-off strikes at the first step at or past its own, even one the group
        # passed during the POST: once a rank may have taken this spec, another would strike
        # too (or never, its rank crashed by this one). A retry posts the same spec again; a
        # rank that took it answers "already injected".
        ok = any(self.post_fault(targets, spec) for _attempt in range(3))
        tr = self.arm(spec, g, "live", given_at)
        if not ok:
            tr.fail("injection failed", f"POST /v1/faults {spec} to {', '.join(targets)} failed "
                                        "(3 tries)")
            self.event("error", g, f"could not inject {spec}")
            return
        self.event("injected", g, spec + ("" if plan.group_rank is None
                                          else f" (rank {plan.group_rank} only)"))

    def strike_hosts(self) -> None:
        """Apply each armed network fault to its group's host once the group reaches the
        fault's step (the fault models the host, so it strikes every rank on it, then)."""
        from trainer.faults import parse_fault

        for tr in self.tracks:
            f = parse_fault(tr.record["spec"])
            g = tr.group
            if not f.network or tr.index in self.net_applied or tr.done \
                    or self.restarts.get(g, 0) != tr.incarnation \
                    or self.group_step(g) < tr.trigger_step or not self.pool:
                continue
            self.net_applied.add(tr.index)
            host = self.pool.host_of(g)
            if f.kind == "slow_link":
                act = self.fabric.rate_limit(host.node, f.mbit)
            elif f.kind == "partition":
                act = self.fabric.partition(host.node)
            else:
                act = self.fabric.disconnect(host.node)
            if not act.ok:
                tr.fail("injection failed", f"{f.spec} on {host.node}: {act.error}")
                self.event("error", g, f"could not apply {f.spec} to {host.node}: {act.error}")
                continue
            ranks = {s["group_rank"]: s["rank"] for s in self.latest.get(g) or []}
            for r in range(self.args.ranks_per_group):
                self.strikes[(g, tr.incarnation, r, f.spec)] = Strike(
                    g, tr.incarnation, r, ranks.get(r, g * self.args.ranks_per_group + r),
                    host.node, f.spec, act.at)
            self.event("network", g, f"{host.node}: {act.detail}")
