"""Prometheus metrics of one rank (``lightkeeper_`` prefix), in their own registry.

Gauges and counters are read from :class:`~worker_server.state.RankState` at scrape time by a
custom collector, so the training thread pays nothing per scrape; only the histograms (step time,
and per step the compute time and the waits inside collectives, from
:mod:`worker_server.timing`) are updated by step listeners, once per step.

Every series carries ``job``, ``replica_group`` and ``rank`` (global rank) labels, plus
``group_rank``. See the README's metrics table for each metric.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from http_serving.wsgi import HOLD_RESPONSE
from rank_wire import MONITOR_AGENT

from .probe import PAYLOAD_PATH
from .state import PHASES, RankState, library_versions
from .timing import StepTiming

# `_created` series double every counter's cardinality and no dashboard reads them.
disable_created_metrics()

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Waits of a healthy step are milliseconds; a straggler's peers wait about its extra time.
WAIT_BUCKETS = (0.001, 0.0025, 0.005, *STEP_BUCKETS)
LABELS = ("job", "replica_group", "rank", "group_rank")
# Readers take at most about this share of the training process: after a read, the next one
# waits (sleeping, without the GIL) until its CPU time / READ_SHARE has passed...
READ_SHARE = 0.02
# ...and never longer than this: the monitor's poll times out at 0.8 s (its --poll-timeout)
MAX_PACE_S = 0.25
# Paced reads that may wait at once: a waiting read sleeps on one of the server's 4 threads, and
# the monitor's polls queue behind those in waitress' FIFO; two stay free for them, one while a
# Flight Recorder dump runs (one at a time; another request waits for it only in its first
# endpoints.FR_WAIT_S, then is answered 503 at once). Another read that would wait is answered
# 429, made at once and sent HOLD_S later (holding no thread), so a client looping on refusals
# costs one answer per HOLD_S.
PACED_SLOTS = 2
# never paced nor refused when the server's ``trusted`` says its request is signed: a peer's
# probe payload (its time is the network's measure; only a peer holding the ranks' token gets it)
UNPACED = (PAYLOAD_PATH,)
# (User-Agent prefix, path) not paced within ALLOWANCE: the monitor's polls, and Prometheus'
# scrapes (it ignores Retry-After: a refused scrape reads as up=0, a rank down). Any client may
# send these headers, and four looping on them took a Python-bound loop to 0.4x: past the
# allowance such a client is paced.
UNPACED_AGENTS = ((MONITOR_AGENT, "/v1/state"), ("Prometheus/", "/metrics"))
# not paced within ALLOWANCE, whoever asks: a readiness probe refused would hold a rolling update
HEALTHZ = "/healthz"
# those reads per second per address and route (also the burst): a monitor polls once a sweep
# (1 s; 0.2-0.5 s in tests and the demo), a scrape interval is seconds
ALLOWANCE = 5.0
# Every read let through unpaced (those, a named agent's first on another route, a one-off
# curl) together take at most this share of a core, this much CPU at once: a client may ask
# from any address of 127/8 (or an IPv6 /64), so no per-address rule bounds their cost alone.
UNPACED_SHARE, UNPACED_BURST_S = 0.03, 0.05
# the routes a monitor's look reads of a rank at once (a bundle: its stacks and its dump): a
# named agent's unpaced read is allowed per address and per one of these (others share one)
LOOK_ROUTES = ("/v1/stacks", "/v1/fr_trace")
RETRY_AFTER_S = 1
HOLD_S = 1.0
# a POST answered so waits its pace on its thread (not a 429: a probe busy answers the monitor)
REFUSED = ("400", "401", "403", "404", "405", "413")


def _label_values(state: RankState) -> list[str]:
    i = state.identity
    return [i.job, str(i.replica_group), str(i.rank), str(i.group_rank)]


class _StateCollector(Collector):
    def __init__(self, state: RankState) -> None:
        self.state = state

    def collect(self):
        snap = self.state.snapshot()
        lv = _label_values(self.state)

        def gauge(name: str, doc: str, value: float | None, unit: str = ""):
            g = GaugeMetricFamily(name, doc, labels=LABELS, unit=unit)
            if value is not None:
                g.add_metric(lv, float(value))
            return g

        yield gauge("lightkeeper_step", "torchft committed step of this rank", snap["step"])
        yield gauge("lightkeeper_quorum_id", "current torchft quorum id", snap["quorum_id"])
        yield gauge("lightkeeper_quorum_participants",
                    "replica groups participating in the current quorum", snap["num_participants"])
        yield gauge("lightkeeper_participating",
                    "1 when this replica group takes part in the current step",
                    1 if snap["participating"] else 0)
        yield gauge("lightkeeper_last_step_duration_seconds", "wall time of the last finished step",
                    snap["last_step_seconds"])
        yield gauge("lightkeeper_last_step_timestamp_seconds",
                    "unix time the last step finished", snap["last_step_at"])
        yield gauge("lightkeeper_phase_duration_seconds", "seconds spent so far in the current phase",
                    self.state.phase_seconds())
        yield gauge("lightkeeper_loss", "training loss of the last step", snap["loss"])
        yield gauge("lightkeeper_faults_injected", "number of faults injected into this rank",
                    len(snap["faults"]))
        # The counters below count from 0 at this time: a rank that heals before its first
        # scrape shows its heals series first at 1, and the rules count that 1 by this start.
        yield gauge("lightkeeper_worker_start_time_seconds",
                    "unix time this rank started (its counters count from then)",
                    snap["started_at"])
        for name, doc, value in (
            ("lightkeeper_commits", "steps whose should_commit returned True", snap["commits"]),
            ("lightkeeper_commit_failures", "steps whose should_commit returned False",
             snap["commit_failures"]),
            ("lightkeeper_heals", "times this rank healed (recovered state) from a peer",
             snap["heals"]),
            ("lightkeeper_quorum_changes", "times the quorum (and process group) was rebuilt",
             snap["quorum_changes"]),
        ):
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(lv, float(value))
            yield c
        phase = GaugeMetricFamily("lightkeeper_phase", "1 for the phase this rank is in, else 0",
                                  labels=(*LABELS, "phase"))
        for p in PHASES:
            phase.add_metric([*lv, p], 1.0 if p == snap["phase"] else 0.0)
        yield phase
        torch_v, torchft_v = library_versions()
        info = InfoMetricFamily("lightkeeper_worker", "static facts about this rank",
                                labels=LABELS)
        info.add_metric(lv, {
            "replica_id": snap["replica_id"] or "",
            "host": snap["host"],
            "local_rank": str(snap["local_rank"]),
            "pid": str(snap["pid"]),
            "worker_url": snap["worker_url"] or "",
            "torch_version": torch_v,
            "torchft_version": torchft_v,
        })
        yield info


class WorkerMetrics:
    """The registry served at ``/metrics``; attach once per RankState."""

    def __init__(self, state: RankState) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        lv = _label_values(state)
        self.step_seconds = Histogram(
            "lightkeeper_step_duration_seconds", "wall time of each training step",
            LABELS, buckets=STEP_BUCKETS, registry=self.registry,
        ).labels(*lv)
        # What the WorkerServer itself costs the training process: CPU seconds its HTTP threads
        # spent answering (measured per request with thread_time), and the requests.
        self.server_cpu_seconds = Counter(
            "lightkeeper_worker_server_cpu_seconds", "CPU seconds the WorkerServer spent serving",
            LABELS, registry=self.registry,
        ).labels(*lv)
        self.server_requests = Counter(
            "lightkeeper_worker_server_requests", "HTTP requests the WorkerServer answered",
            LABELS, registry=self.registry,
        ).labels(*lv)
        # Per step, on this rank's own clock: what it computed and how long it waited inside
        # collectives, across replica groups (torchft) and inside its group (FSDP, commit vote).
        self.compute_seconds = Histogram(
            "lightkeeper_step_compute_seconds",
            "per step, seconds this rank spent outside collective waits (forward, backward, "
            "optimizer, data)", LABELS, buckets=WAIT_BUCKETS, registry=self.registry,
        ).labels(*lv)
        wait = Histogram(
            "lightkeeper_collective_wait_seconds",
            "per step, seconds this rank's training thread waited inside collectives; "
            "scope=cross: torchft quorum and all_reduce across replica groups, scope=group: "
            "FSDP all-gather/reduce-scatter and the commit vote inside the replica group",
            (*LABELS, "scope"), buckets=WAIT_BUCKETS, registry=self.registry,
        )
        self.wait_seconds = {scope: wait.labels(*lv, scope) for scope in ("cross", "group")}
        self.registry.register(_StateCollector(state))
        self._pace_lock = threading.Lock()
        self._free_at = 0.0  # monotonic time the reads answered so far are paid for
        state.add_step_listener(self._on_step)
        state.timing.add_listener(self._on_timing)

    def pace_s(self) -> float:
        """How long a read now waits until the reads answered before it are paid for."""
        with self._pace_lock:
            return self._free_at - time.monotonic()

    def pace(self) -> None:
        """Before a read: wait until the reads answered before it are paid for (at most
        MAX_PACE_S), so that a client reading back to back costs training ~READ_SHARE at most."""
        wait = self.pace_s()
        if wait > 0:
            time.sleep(wait)

    def served(self, cpu_s: float) -> None:
        """A request was answered with ``cpu_s`` of its thread's CPU: counted, and charged to
        the pace."""
        self.server_cpu_seconds.inc(cpu_s)
        self.server_requests.inc()
        with self._pace_lock:
            now = time.monotonic()
            self._free_at = min(max(self._free_at, now) + cpu_s / READ_SHARE, now + MAX_PACE_S)

    def count_cpu(self, app, paced_slots: int = PACED_SLOTS,
                  trusted: Callable[[dict], bool] | None = None):
        """Wrap a WSGI app so each request's CPU time (its thread's) is counted and reads (GET)
        are paced (:meth:`pace`), ``paced_slots`` of them waiting at once. Another that would
        wait is answered at once, unpaced, when its client (address) had no read answered
        within HOLD_S, else 429 with ``Retry-After`` (sent HOLD_S later, its thread freed at
        once). :data:`UNPACED` paths never wait when ``trusted`` says the request is signed, nor
        :data:`UNPACED_AGENTS` on their route within :data:`ALLOWANCE` and the unpaced budget
        (past them, as on any other route). On
        another route one of those agents has its own allowance per address and
        :data:`LOOK_ROUTES` route: its first read within HOLD_S is answered unpaced, its next
        one paced even with no slot free (at most MAX_PACE_S, one such read at a time), and
        further ones as anyone's:
        a monitor's look (stacks and a dump of a rank at once) is neither slowed nor refused."""
        slots = threading.BoundedSemaphore(paced_slots)
        extra = threading.BoundedSemaphore(1)
        readers, allowance, budget = _Readers(), _Allowance(), _Budget()

        def wsgi(environ, start_response):
            read = environ.get("REQUEST_METHOD") in ("GET", "HEAD", "OPTIONS")
            path, agent = environ.get("PATH_INFO"), environ.get("HTTP_USER_AGENT", "")
            named = [route for prefix, route in UNPACED_AGENTS if agent.startswith(prefix)]
            keys: tuple = ()  # marked again once answered: a slow answer's next ask loops
            client, now = environ.get("REMOTE_ADDR", ""), time.monotonic()
            pacing = read and self.pace_s() > 0 \
                and not (path in UNPACED and trusted is not None and trusted(environ))
            # an exemption below lets it through unpaced only while the budget lasts
            unpaced = pacing and budget.left(now)
            if pacing and not (unpaced and (path in named or path == HEALTHZ)
                              and allowance.take((client, path), now)):
                key = (client, path if path in LOOK_ROUTES else "") if named else client
                keys = (key,)
                if named and readers.first(key, now) and unpaced:
                    pass  # its one read of this route within HOLD_S: answered unpaced
                elif slots.acquire(blocking=False):
                    unpaced = False
                    readers.mark(key, now + max(0.0, self.pace_s()))
                    try:
                        self.pace()
                    finally:
                        slots.release()
                elif named and readers.first((*key, "paced"), now) \
                        and extra.acquire(blocking=False):
                    # its second (a bundle just after a sweep's dump): paced on the one thread
                    # beyond the slots, so spoofed agents never hold the monitor's polls' threads
                    unpaced = False
                    keys = (key, (*key, "paced"))
                    try:
                        self.pace()
                    finally:
                        extra.release()
                elif readers.looping(key, now) or not unpaced:
                    readers.mark(key, now + HOLD_S)
                    started = time.thread_time()
                    body = _busy(environ, start_response)
                    # charged as a read: a client looping on refusals slows the paced readers
                    self.served(time.thread_time() - started)
                    return body
                else:
                    # a one-off read (an operator's curl) is not refused behind looping readers:
                    # answered now, it sleeps on no thread; asked again at once, it is refused
                    readers.mark(key, now)
            started = time.thread_time()

            def done() -> None:
                cpu_s = time.thread_time() - started
                self.served(cpu_s)
                if unpaced:
                    budget.spend(cpu_s, time.monotonic())
                for key in keys:  # and once sent (a body made as it is sent)
                    readers.mark(key, time.monotonic())

            status: list[str] = []

            def answer(code, headers, exc_info=None):
                status.append(code)
                return start_response(code, headers, exc_info)

            try:
                body = app(environ, answer)
            except BaseException:
                done()
                raise
            if not read and status and status[-1][:3] in REFUSED:
                # a refused POST (a bad signature's 401, a 405) costs the rank its routing, its
                # error and any signature checked: looped on, it slowed a loop 2x. It waits its
                # pace on this thread (a monitor's own calls are answered at once)
                self.served(time.thread_time() - started)
                started = time.thread_time()
                self.pace()
            for key in keys:  # made: marked before a byte is sent, so before the next ask
                readers.mark(key, time.monotonic())
            # counted once the body was sent: a streamed one (a probe payload) is made as
            # waitress iterates it, on this thread, after the app returned
            return _Counted(body, done)

        return wsgi

    def _on_step(self, duration: float | None, committed: bool) -> None:
        if duration is not None:
            self.step_seconds.observe(duration)

    def _on_timing(self, timing: StepTiming) -> None:
        self.compute_seconds.observe(timing.compute_s)
        self.wait_seconds["cross"].observe(timing.wait_cross_s)
        self.wait_seconds["group"].observe(timing.wait_group_s)


class _Allowance:
    """Token buckets by key: :data:`ALLOWANCE` reads a second, as many at once. Keys whose
    bucket refilled are forgotten past KEEP."""

    KEEP = 256

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._left: dict[Any, tuple[float, float]] = {}  # key -> (reads left, at)

    def take(self, key: Any, now: float) -> bool:
        with self._lock:
            left, at = self._left.get(key, (ALLOWANCE, now))
            left = min(ALLOWANCE, left + (now - at) * ALLOWANCE)
            taken = left >= 1.0
            self._left[key] = (left - 1.0 if taken else left, now)
            if len(self._left) > self.KEEP:
                self._left = {k: (n, t) for k, (n, t) in self._left.items()
                              if n + (now - t) * ALLOWANCE < ALLOWANCE}
            return taken


class _Budget:
    """The CPU the unpaced reads may still spend: :data:`UNPACED_SHARE` a second, at most
    :data:`UNPACED_BURST_S` at once; a read is charged once served (the credit may go below
    zero: none is let through until it is back above)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._credit, self._at = UNPACED_BURST_S, time.monotonic()

    def _refill(self, now: float) -> None:
        self._credit = min(UNPACED_BURST_S,
                           self._credit + max(0.0, now - self._at) * UNPACED_SHARE)
        self._at = max(self._at, now)

    def left(self, now: float) -> bool:
        with self._lock:
            self._refill(now)
            return self._credit > 0

    def spend(self, cpu_s: float, now: float) -> None:
        with self._lock:
            self._refill(now)
            self._credit -= cpu_s


class _Readers:
    """When each client (by address, or a named agent's address and route) last asked or had a
    read answered while reads were paced (paced, refused or let through unpaced): one asking
    again within HOLD_S of that reads in a loop, and is refused when no slot is free."""

    KEEP = 256  # clients remembered before those no longer looping are forgotten

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until: dict[Any, float] = {}

    def mark(self, client: Any, answered_at: float) -> None:
        with self._lock:
            self._mark(client, answered_at)

    def _mark(self, client: Any, answered_at: float) -> None:
        self._until[client] = max(self._until.get(client, 0.0), answered_at + HOLD_S)
        if len(self._until) > self.KEEP:
            now = time.monotonic()
            self._until = {c: t for c, t in self._until.items() if t > now}

    def looping(self, client: Any, now: float) -> bool:
        with self._lock:
            return self._until.get(client, 0.0) > now

    def first(self, client: Any, now: float) -> bool:
        """Whether ``client`` is not looping; marked as asking now either way (at once: two
        asks at the same time are not both first)."""
        with self._lock:
            was = self._until.get(client, 0.0) <= now
            self._mark(client, now)
            return was


def _busy(environ, start_response) -> list[bytes]:
    """429 for a paced read beyond the slots, in the shape of every other error."""
    path = environ.get("PATH_INFO", "")
    doc = {"error": "too many reads at once on this rank: ask again after Retry-After",
           "status": 429, "path": path}
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    start_response("429 Too Many Requests", [("Content-Type", "application/json"),
                                             ("Content-Length", str(len(body))),
                                             ("Retry-After", str(RETRY_AFTER_S))])
    hold = environ.get(HOLD_RESPONSE)
    if hold is not None:
        hold(HOLD_S)
    return [body]


class _Counted:
    """A WSGI body that calls ``done`` when the server closes it (after the last byte)."""

    def __init__(self, body, done) -> None:
        self.body, self.done = body, done

    def __iter__(self):
        return iter(self.body)

    def close(self) -> None:
        try:
            close = getattr(self.body, "close", None)
            if close is not None:
                close()
        finally:
            self.done()
