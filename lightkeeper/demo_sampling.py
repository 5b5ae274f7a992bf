"""What the demo reads, every tick: each rank's ``/v1/state`` (its step, quorum, faults
struck), the Lighthouse's ``/status``, and the monitor's findings, evictions, goodput ledger and
host ledger; and the :class:`~lightkeeper.faulttrack.Observation` the fault stories are judged
from."""

from __future__ import annotations

import os

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


class TreeCpu:
    """The machine's busy CPU seconds (``/proc/stat``) and those of one process tree, ``root``
    and its descendants (utime + stime), so that over any window the CPU the machine's other
    processes took is the difference of their deltas. A process is placed in or out of the tree
    when first seen (its parent's place), and one gone keeps its last figure: the tree's sum
    never falls (a child's reaped time in its parent's cutime would count it twice; one that
    starts and ends between two samples is missed). A sample reads ``/proc/stat``, the list of
    ``/proc`` and the stat of each tree process and each new one. Linux only: elsewhere
    :meth:`sample` is None."""

    def __init__(self, root: int) -> None:
        self.root = root
        self._in: dict[int, bool] = {}                  # pid -> in the tree
        self._cpu: dict[int, tuple[int, float]] = {}    # tree pid -> (start time, CPU s)
        self._gone = 0.0                                # the last figures of those gone
        self._hz = os.sysconf("SC_CLK_TCK") if "SC_CLK_TCK" in getattr(
            os, "sysconf_names", {}) else 100

    def _stat(self, pid: int) -> tuple[int, int, float] | None:
        """(parent pid, start time, CPU seconds) of ``pid``; None: gone."""
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            return None
        v = raw[raw.rfind(b")") + 2:].split()  # the name may hold spaces and parentheses
        return int(v[1]), int(v[19]), (int(v[11]) + int(v[12])) / self._hz

    def sample(self) -> tuple[float, float] | None:
        """(the machine's busy CPU seconds, the tree's) now; None where not measured."""
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
            listed = {int(d) for d in os.listdir("/proc") if d.isdigit()}
        except (OSError, ValueError):
            return None
        # user nice system irq softirq steal (guest time is in user already)
        busy = (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / self._hz
        for pid in [p for p in self._in if p not in listed]:
            del self._in[pid]
            if pid in self._cpu:
                self._gone += self._cpu.pop(pid)[1]
        new = {}
        for pid in listed:
            got = None if self._in.get(pid) is False else self._stat(pid)
            if got is None:
                continue
            ppid, start, cpu = got
            old = self._cpu.get(pid)
            if old is not None and old[0] != start:  # the pid taken again since the last look
                self._gone += self._cpu.pop(pid)[1]
                del self._in[pid]
                old = None
            if pid in self._in:
                self._cpu[pid] = (start, max(cpu, old[1] if old else 0.0))
            else:
                new[pid] = got

        def place(pid: int) -> bool:  # a new process: in the tree if its parent is
            if pid not in self._in:
                ppid = new[pid][0] if pid in new else None
                self._in[pid] = pid == self.root or (ppid in new or ppid in self._in) \
                    and place(ppid)
            return self._in[pid]

        for pid, (_, start, cpu) in new.items():
            if place(pid):
                self._cpu[pid] = (start, cpu)
        return busy, self._gone + sum(c for _, c in self._cpu.values())


class Sampling:
    """Part of :class:`~lightkeeper.demo_loop.Demo` (its state is set up there)."""

    def sample_cpu(self, t: float) -> None:
        """The machine's busy CPU seconds and the demo's own processes' at the tick ``t`` in
        ``cpu_ticks`` (nothing where not measured): the report's ``others_cores``."""
        got = self.cpu.sample()
        if got is not None:
            self.cpu_ticks.append((t, *got))

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
