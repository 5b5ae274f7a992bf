"""What the demo reads, every tick: each rank's ``/v1/state`` (its step, quorum, faults
struck), the Lighthouse's ``/status``, and the monitor's findings, evictions, goodput ledger and
host ledger; and the :class:`~lightkeeper.faulttrack.Observation` the fault stories are judged
from."""

from __future__ import annotations

from http_serving import printable

from .faulttrack import Observation, Strike, finding_culprits
from .recovery import GOODPUT_INCIDENTS, merge_goodput


def merge_rows(old: list[dict], new: list) -> list[dict]:
    """The monitor's newest rows (``/v1/findings``, ``/v1/evictions``: the newest 500 by
    default) with those an earlier read saw that this one no longer lists: a long run (a soak)
    pushes its early ones out, and the report and the soak's false evictions need every one.
    Each row in its newest version seen, newest (highest id) first."""
    listed = [r for r in new if isinstance(r, dict)]
    ids = {r.get("id") for r in listed}
    kept = [r for r in old if r.get("id") is not None and r.get("id") not in ids]
    if not kept:
        return listed
    return sorted(listed + kept, key=lambda r: r["id"] if isinstance(r.get("id"), int) else -1,
                  reverse=True)


class Sampling:
    """Part of :class:`~lightkeeper.demo_loop.Demo` (its state is set up there)."""

    def state(self, url: str) -> dict | None:
        from .processes import get_json

        return get_json(self.http, url + "/v1/state", 1.0)

    def states(self, urls: list[str]) -> dict[str, tuple[float, dict | None]]:
        """Each rank's state and when it came (seconds since the start): each look dated by
        its answer, not by the tick (a rank that does not answer, its host offline, takes its
        timeout and the looks after it come that much later). Asked one after another: the
        loop's HTTP session is not shared across threads."""
        out = {}
        for url in urls:
            got = self.state(url)
            out[url] = (self.now(), got)
        return out

    def monitor_get(self, path: str) -> list | None:
        from .processes import get_json

        return None if self.monitor_url is None else get_json(self.http, self.monitor_url + path,
                                                              2.0)

    def sample_ranks(self, t: float) -> None:
        """Every rank's state (:meth:`states`): the latest per group, a sample each (dated by
        its answer), the faults they say struck (with the group's incarnation), and the job's
        step at the tick ``t`` in ``ticks``."""
        from .cluster import WORKER_URL_RE

        job_step = -1
        asked: dict[int, list[str]] = {}
        for g, grp in sorted(self.cluster.groups.items()):
            if grp.alive() and len(grp.worker_urls) < self.args.ranks_per_group:
                grp.worker_urls = {int(r): u for r, u in WORKER_URL_RE.findall(grp.log())}
            asked[g] = list(grp.worker_urls.values()) if grp.alive() else []
        answers = self.states([u for urls in asked.values() for u in urls])
        for g, urls in asked.items():
            states = [(at, s) for at, s in (answers[u] for u in urls) if s]
            self.latest[g] = [s for _, s in states]
            incarnation = self.restarts.get(g, 0)
            for at, s in states:
                for spec, struck in (s.get("faults_struck_at") or {}).items():
                    key = (g, incarnation, s["group_rank"], spec)
                    if key not in self.strikes:
                        self.strikes[key] = Strike(g, incarnation, s["group_rank"], s["rank"],
                                                   printable(str(s.get("host") or "?")), spec,
                                                   float(struck))
                self.rank_pids.add(int(s["pid"]))
                job_step = max(job_step, s["step"])
                self.samples.append({
                    "t": at, "tick": t, "replica_group": g, "rank": s["rank"], "step": s["step"],
                    "participating": s["participating"],
                    "num_participants": s["num_participants"], "phase": s["phase"],
                    "last_step_seconds": s["last_step_seconds"],
                    "last_step_at_s": self.rel(s["last_step_at"]),
                    "quorum_id": s.get("quorum_id"),
                    "replica_id": s["replica_id"], "faults": list(s.get("faults") or []),
                    "host": s.get("host"), "worker_url": s.get("worker_url")})
        self.ticks.append((t, job_step))

    def poll_lighthouse(self, t: float) -> None:
        """The Lighthouse's own view (``/status``): its newest quorum and which heartbeats it
        counts as stale; one entry in ``lighthouse_log`` per change."""
        from monitor.evidence.lighthouse_status import LighthouseReader

        if self.cluster.lighthouse_url is None:
            return
        if self._lh_reader is None:
            self._lh_reader = LighthouseReader(self.cluster.lighthouse_url, timeout_s=1.0)
        st, _err = self._lh_reader.read()
        if st is None:
            return
        entry = {"quorum_id": st.quorum_id, "members": sorted(st.members),
                 "heartbeating": sorted(r for r in st.heartbeats if r not in st.stale),
                 "stale": sorted(st.stale)}
        if not self.lighthouse_log or any(self.lighthouse_log[-1][k] != v
                                          for k, v in entry.items()):
            self.lighthouse_log.append({"t": t, **entry})

    def poll_goodput(self) -> None:
        g = self.monitor_get(f"/v1/goodput?incidents={GOODPUT_INCIDENTS}&intervals=0")
        if isinstance(g, dict):
            self.goodput = merge_goodput(self.goodput, g)

    def poll_hosts(self) -> None:
        """The monitor's host ledger (``GET /v1/hosts``): one event per host quarantined,
        with the time the monitor quarantined it."""
        body = self.monitor_get("/v1/hosts")
        if not isinstance(body, dict) or not isinstance(body.get("hosts"), list):
            return
        self.hosts_view = body
        for h in body["hosts"]:
            name = h.get("host")
            if h.get("state") != "quarantined" or (name, h.get("quarantined_at")) in self._q_seen:
                continue
            self._q_seen.add((name, h.get("quarantined_at")))  # again after a release: told
            at = self.rel(h.get("quarantined_at")) if h.get("quarantined_at") else self.now()
            self.quarantines[name] = at
            self.event("quarantined", None, f"host {name} quarantined at {at:.1f}s "
                                            f"({h.get('reason') or h.get('kind')})")

    def poll_monitor(self) -> None:
        self.poll_goodput()
        self.poll_hosts()
        findings = self.monitor_get("/v1/findings")
        if isinstance(findings, list):
            self.findings = merge_rows(self.findings, findings)
            for f in findings:
                key = (f["kind"], f["replica_group"], f.get("replica_id"), f.get("first_seen"))
                if key not in self._seen_findings and f.get("confirmed_at"):
                    self._seen_findings.add(key)
                    culprits, hosts = finding_culprits(f)
                    named = [f"ranks {f['ranks']}" if f.get("ranks") else None,
                             f"culprit ranks {culprits}" if culprits else None]
                    named = ", ".join(n for n in named if n) or "job-wide"  # job_stall names none
                    self.event("detected", f["replica_group"],
                               f"{f['kind']} ({named}"
                               + (f" on {', '.join(dict.fromkeys(hosts))}" if hosts else "")
                               + f") at {self.rel(f['confirmed_at']):.1f}s")
        evictions = self.monitor_get("/v1/evictions")
        if isinstance(evictions, list):
            self.evictions = merge_rows(self.evictions, evictions)
            for d in evictions:
                key = (d.get("id"), d["replica_group"], d.get("at"), d["decision"])
                # a hold because the kill was already sent repeats the "evicted" line before it
                if key not in self._seen_evictions and d["reason"] != "already_evicted":
                    self._seen_evictions.add(key)
                    kind = {"evict": "evicted", "abort": "survivors_released"}.get(
                        d["decision"], "held")
                    dry = " (dry run)" if d.get("status") == "dry_run" else ""  # not sent
                    self.event(kind, d["replica_group"], f"{d['decision']} ({d['reason']}){dry}")

    # --- what was sampled ---------------------------------------------------------------------
    def all_stepping(self) -> bool:
        return len(self.cluster.groups) == self.args.groups and all(
            len(self.latest.get(g) or []) == self.args.ranks_per_group
            and all(s["step"] >= 1 for s in self.latest[g]) for g in self.cluster.groups)

    def group_step(self, g: int) -> int:
        return max((s["step"] for s in self.latest.get(g) or []), default=-1)

    def job_step(self) -> int:
        return max((self.group_step(g) for g in self.cluster.groups), default=-1)

    def fresh_step(self, g: int) -> int:
        """Group ``g``'s step read now from its ranks, not from the last tick."""
        steps = [s["step"] for s in (self.state(u) for u in
                                     self.cluster.groups[g].worker_urls.values()) if s]
        return max(steps, default=self.group_step(g))

    def observation(self) -> Observation:
        groups = self.cluster.groups
        return Observation(
            t=self.now(), t0_unix=self.t0_unix, groups=self.args.groups,
            ranks_per_group=self.args.ranks_per_group, states=self.latest,
            incarnation={g: self.restarts.get(g, 0) for g in groups},
            alive={g: grp.alive() for g, grp in groups.items()},
            finished={g: not grp.alive() and grp.proc.returncode == 0
                      for g, grp in groups.items()},
            strikes=list(self.strikes.values()), findings=self.findings,
            evictions=self.evictions,
            restarts=[(e["replica_group"], e["t"]) for e in self.events
                      if e["kind"] == "restarted"],
            samples=self.samples, quarantines=dict(self.quarantines),
            placements=list(self.placements),
            drains=[(e["replica_group"], e["t"]) for e in self.events if e["kind"] == "drained"],
            quarantine_findings={h.get("host"): h.get("finding_id") for h in
                                 (self.hosts_view or {}).get("hosts") or [] if isinstance(h, dict)})
