"""Simulated WorkerServers for monitor tests and benchmarks: many ranks, one asyncio loop.

Each simulated rank listens on its own port and answers ``/v1/state`` (and ``/v1/fr_trace``,
``/v1/stacks``, ``/healthz``) from a document the test controls. A rank can misbehave on purpose:
``mode`` ``"slow"`` answers after ``delay`` seconds, ``"http500"`` answers 500, ``"garbage"``
answers a body that is not JSON, ``"badstate"`` a JSON object that is not a /v1/state,
``"wrongtypes"`` a /v1/state whose values have the wrong types, ``"close"`` closes the connection
without answering, ``"down"`` stops listening (connection refused), ``"silent"`` reads every
request and answers none (a host whose packets are dropped: no reset, no answer), ``"fr_silent"``
so for ``/v1/fr_trace`` alone (``fr_held`` counts those requests). Hostile ones, for the bounds:
``"huge"`` declares a 10 GiB body, ``"huge_chunked"`` and ``"huge_unframed"`` stream one without
end (chunked / until the connection closes), ``"dribble"`` sends one byte every 50 ms,
``"many_headers"`` 10,000 header lines, ``"long_header"`` a 1 MiB header line, ``"deep_json"``
an array nested 30,000 deep.

``POST /v1/probe`` is a fake of the rank's probe endpoint (the real one is the WorkerServer's):
it measures nothing and answers from the test's link matrix, ``SimRanks.links(from_url,
to_url) -> {"ok", "mbit_s", ...}`` (None: the route does not exist, 404, as on an older rank;
``SimRank.probe_route = False`` for one rank alone; ``SimRank.probe_status``: the status line
it answers instead, as something in front of the rank would), with ``SimRanks.probe_token`` required
(401 without it: a call signed with it for the rank, as a real rank checks, or it as a bearer),
and counts the requests in ``SimRank.probes``. Its ``control`` (the rank's
transfer from itself) is fast unless ``SimRanks.control(url) -> {...}`` says otherwise.

:class:`SimJob` puts simulated groups into a real torchft Lighthouse's quorum, so that the
monitor can verify them (and records kill requests). In-process: ``sim = SimRanks.start(n,
groups=3)`` ... ``sim.stop()``. As a process (benchmarks,
so the monitor and the simulated ranks do not share one GIL)::

    python -m tests.support.monitor_sim --ranks 1000 --groups 100
    # prints one line "SIM <url> <url> ..." then serves until stdin closes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rank_wire import auth


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def rank_state(rank: int, replica_group: int, *, step: int = 100, phase: str = "forward",
               step_seconds: float = 0.2, quorum_id: int = 1, participants: int = 1,
               now: float | None = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    return {
        "job": "sim", "replica_group": replica_group, "replica_id": f"replica_group_{replica_group}:sim",
        "group_rank": 0, "group_world_size": 1, "rank": rank, "host": "sim", "pid": 1000 + rank,
        "worker_url": None, "step": step, "quorum_id": quorum_id,
        "num_participants": participants, "participating": True, "phase": phase,
        "phase_since": now - 0.01, "finished": False, "stopped_by": None,
        "last_step_seconds": step_seconds, "last_step_at": now - 0.02,
        "recent_step_seconds": [step_seconds] * 16, "commits": step, "commit_failures": 0,
        "heals": 0, "quorum_changes": 0, "loss": 1.0, "lighthouse": None,
        "torch_version": "sim", "torchft_version": "sim", "started_at": now - 60, "faults": [],
    }


class SimRank:
    def __init__(self, sim: SimRanks, state: dict[str, Any]) -> None:
        self.sim = sim
        self.state = state
        self.fr: dict[str, Any] | bytes | None = None
        self.mode = "ok"
        self.delay = 0.0
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self.requests = 0
        self.fr_answered = 0  # /v1/fr_trace answers sent
        self.fr_held = 0  # /v1/fr_trace requests left unanswered ("silent", "fr_silent")
        self.probes = 0  # POST /v1/probe requests
        self.aborts: list[dict[str, Any]] = []  # POST /v1/abort bodies accepted
        self.abort_failures = 0  # the next POST /v1/abort answers 503 this many times
        self.exits: list[dict[str, Any]] | None = None  # a list: POST /v1/exit served (bodies)
        self.probe_route = True
        self.probe_status: str | None = None  # e.g. "503 Service Unavailable"
        self.writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def update(self, **fields: Any) -> None:
        self.state = {**self.state, **fields}

    def set_mode(self, mode: str, delay: float = 0.0) -> None:
        """Change behaviour (thread-safe); ``down``/``ok`` stop/start listening on the same port."""
        fut = asyncio.run_coroutine_threadsafe(self._set_mode(mode, delay), self.sim.loop)
        fut.result(timeout=10)

    async def _set_mode(self, mode: str, delay: float) -> None:
        self.mode, self.delay = mode, delay
        if mode == "down" and self.server is not None:
            self.server.close()
            self.server = None
            self.drop_connections()
        elif mode != "down" and self.server is None:
            await self.listen(self.port)

    def drop_connections(self) -> None:
        for w in list(self.writers):
            w.close()
        self.writers.clear()

    async def listen(self, port: int = 0) -> None:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", port, backlog=256)
        self.port = self.server.sockets[0].getsockname()[1]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                method = line.split()[0].decode() if line.split() else "GET"
                path = line.split()[1].decode() if len(line.split()) > 1 else "/"
                headers = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    k, _, v = h.decode("latin-1").partition(":")
                    headers[k.strip().lower()] = v.strip()
                length = int(headers.get("content-length") or 0)
                body = await reader.readexactly(length) if length else b""
                self.requests += 1
                self.last_path = path  # with its query: what the monitor asked
                mode = self.mode
                if mode == "close":
                    break
                if mode == "silent" or (mode == "fr_silent" and path.startswith("/v1/fr_trace")):
                    self.fr_held += path.startswith("/v1/fr_trace")
                    await reader.read()  # until the client gives up and closes
                    break
                if mode == "slow":
                    await asyncio.sleep(self.delay)
                if mode in HOSTILE:
                    await HOSTILE[mode](writer)
                    break
                if method == "POST" and path.split("?")[0] == "/v1/probe":
                    status, ctype, out = self.probe(path, headers, body)
                elif method == "POST" and path.split("?")[0] == "/v1/abort":
                    status, ctype, out = self.abort(path, headers, body)
                elif method == "POST" and path == "/v1/exit" and self.exits is not None:
                    status, ctype, out = self.exit(path, headers, body)
                else:
                    status, ctype, out = self.respond(path, mode)
                self.fr_answered += path.startswith("/v1/fr_trace") and status.startswith("200")
                writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                             f"Content-Length: {len(out)}\r\n\r\n".encode() + out)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()

    def authorized(self, path: str, headers: dict[str, str], body: bytes) -> bool:
        """As a real rank (worker_server/app.py): a POST signed with ``SimRanks.probe_token`` for
        the identity this rank serves, or that token as a bearer."""
        authorization = headers.get("authorization")
        signature = auth.signature_of(authorization)
        if signature is None:
            return authorization == f"Bearer {self.sim.probe_token}"
        return auth.verify(self.sim.probe_token, "POST", path, auth.identity_of(self.state),
                           body, signature)

    def probe(self, path: str, headers: dict[str, str], body: bytes) -> tuple[str, str, bytes]:
        """The fake ``POST /v1/probe`` (module docstring): the test's link matrix, no transfer."""
        self.probes += 1
        links = self.sim.links
        if links is None or not self.probe_route:
            return "404 Not Found", "application/json", b'{"error": "not found"}'
        if self.probe_status:
            return self.probe_status, "text/plain", b"unavailable"
        if not self.authorized(path, headers, body):
            return "401 Unauthorized", "application/json", b'{"error": "bad token"}'
        peers = json.loads(body)["peers"]
        fine = {"ok": True, "connect_s": 0.001, "transfer_s": 0.002, "mbit_s": 1000.0,
                "error": None}
        results = [{"peer": p, **fine, **links(self.url, p)} for p in peers]
        own = self.sim.control(self.url) if self.sim.control else {}
        control = {"peer": self.url, **fine, **own}
        return "200 OK", "application/json", json.dumps(
            {"from": self.url, "results": results, "control": control}).encode()

    def abort(self, path: str, headers: dict[str, str], body: bytes) -> tuple[str, str, bytes]:
        """The fake ``POST /v1/abort``: recorded, nothing to abort (the same token as probes)."""
        if not self.authorized(path, headers, body):
            return "401 Unauthorized", "application/json", b'{"error": "bad token"}'
        if self.abort_failures > 0:  # its server busy, say
            self.abort_failures -= 1
            return "503 Service Unavailable", "application/json", b'{"error": "busy"}'
        self.aborts.append(json.loads(body))
        return "202 Accepted", "application/json", json.dumps(
            {"aborted": True, "pg": "sim", "mechanism": "sim", "detail": "recorded",
             "quorum_id": self.state.get("quorum_id"), "step": self.state.get("step")}).encode()

    def exit(self, path: str, headers: dict[str, str], body: bytes) -> tuple[str, str, bytes]:
        """The fake ``POST /v1/exit`` (once ``exits`` is a list): recorded, the rank stays (the
        same token as probes)."""
        if not self.authorized(path, headers, body):
            return "401 Unauthorized", "application/json", b'{"error": "bad token"}'
        self.exits.append(json.loads(body))
        return "202 Accepted", "application/json", b'{"exiting": true}'

    def respond(self, path: str, mode: str) -> tuple[str, str, bytes]:
        path, _, query = path.partition("?")
        if mode == "http500":
            return "500 Internal Server Error", "application/json", b'{"error": "boom"}'
        if mode == "garbage":
            return "200 OK", "application/json", b"<html>not json"
        if mode == "deep_json":
            return "200 OK", "application/json", b"[" * 30_000 + b"]" * 30_000
        if path == "/v1/state":
            doc = {"oops": True} if mode == "badstate" else self.state
            if mode == "wrongtypes":
                doc = {**self.state, "step": "100", "quorum_id": None, "phase": 7,
                       "replica_group": [1]}
            return "200 OK", "application/json", json.dumps(doc).encode()
        if mode == "fr_busy_once" and path == "/v1/fr_trace":  # dumping for someone else
            self.mode = "ok"
            return "503 Service Unavailable", "application/json", b'{"error": "busy"}'
        if path == "/v1/fr_trace" and self.fr is not None:  # bytes: served as they are
            return "200 OK", "application/json", self.fr if isinstance(self.fr, bytes) \
                else json.dumps(self.fr).encode()
        if path == "/v1/stacks":
            if "format=json" in query:
                return "200 OK", "application/json", json.dumps(
                    {"pid": self.state.get("pid"), "rank": self.state.get("rank"),
                     "threads": [{"name": "MainThread", "is_main": True, "frames": [
                         {"file": "sim.py", "line": 1, "function": "sim", "code": ""}]}]}
                ).encode()
            return "200 OK", "text/plain", b"Thread MainThread\n  sim\n"
        if path == "/healthz":
            return "200 OK", "application/json", b'{"status": "ok"}'
        return "404 Not Found", "application/json", b'{"error": "not found"}'


async def _huge(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 10737418240\r\n\r\n")
    await _stream(writer, b"\x00" * 65536)


async def _huge_chunked(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    await _stream(writer, b"10000\r\n" + b"[" * 65536 + b"\r\n")


async def _huge_unframed(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
    await _stream(writer, b" " * 65536)


async def _stream(writer: asyncio.StreamWriter, piece: bytes) -> None:
    while True:  # until the reader hangs up (drain raises) or the test stops the sim
        writer.write(piece)
        await writer.drain()


async def _dribble(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
    while True:
        writer.write(b" ")
        await writer.drain()
        await asyncio.sleep(0.05)


async def _many_headers(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\n" + b"X-Pad: 1\r\n" * 10_000 + b"\r\n{}")
    await writer.drain()


async def _long_header(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * (1 << 20) + b"\r\n\r\n{}")
    await writer.drain()


HOSTILE = {"huge": _huge, "huge_chunked": _huge_chunked, "huge_unframed": _huge_unframed,
           "dribble": _dribble, "many_headers": _many_headers, "long_header": _long_header}


class SimRanks:
    """N simulated ranks in ``groups`` replica groups (rank r is in group r % groups)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="sim-ranks")
        self.ranks: list[SimRank] = []
        # the fake POST /v1/probe's link matrix and token (module docstring)
        self.links: Callable[[str, str], dict[str, Any]] | None = None
        self.probe_token: str | None = None
        self.control: Callable[[str], dict[str, Any]] | None = None

    @classmethod
    def start(cls, n: int, groups: int | None = None, **state_kw: Any) -> SimRanks:
        raise_fd_limit()
        sim = cls()
        sim.thread.start()
        groups = groups or n

        async def boot():
            for r in range(n):
                rank = SimRank(sim, rank_state(r, r % groups, participants=groups, **state_kw))
                rank.state["group_rank"] = r // groups
                rank.state["group_world_size"] = -(-n // groups)
                await rank.listen()
                sim.ranks.append(rank)

        asyncio.run_coroutine_threadsafe(boot(), sim.loop).result(timeout=120)
        return sim

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.ranks]

    def group(self, g: int) -> list[SimRank]:
        return [r for r in self.ranks if r.state["replica_group"] == g]

    def stop(self) -> None:
        async def shutdown():
            for r in self.ranks:
                if r.server is not None:
                    r.server.close()
                r.drop_connections()
            await asyncio.sleep(0.05)
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()
            await asyncio.sleep(0)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


class SimJob:
    """Simulated replica groups in a real torchft job: a real Lighthouse (in this process) that
    every group joins for real (``LighthouseClient.quorum``, then heartbeats every 0.2 s), with
    the groups' ranks served by :class:`SimRanks` and their states agreeing with the Lighthouse
    (replica id, quorum id, participants, group world size).

    A real kill makes the group's torchft Manager exit its process, and a simulated group has no
    Manager. So the monitor is pointed at :attr:`url`, a small front on 127.0.0.1 that forwards
    every request to the real Lighthouse except ``POST /replica/{id}/kill``: that one it records
    in :attr:`kills`, takes the group down the way its exiting Manager would (ranks stop
    answering, heartbeats stop) and answers 500 as torchft 0.2.0 does. :meth:`front_down` /
    :meth:`front_up` close and reopen the front's port (the Lighthouse unreachable, then back).
    """

    def __init__(self, groups: int, ranks_per_group: int = 1, heartbeat_timeout_ms: int = 2000,
                 join_timeout_ms: int = 3000) -> None:
        from datetime import timedelta

        from torchft.coordination import LighthouseClient, LighthouseServer

        self._client = lambda: LighthouseClient(addr=self.grpc_addr,
                                                connect_timeout=timedelta(seconds=5))
        self._timedelta = timedelta
        self.lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1,
                                           join_timeout_ms=join_timeout_ms,
                                           heartbeat_timeout_ms=heartbeat_timeout_ms)
        port = int(self.lighthouse.address().rsplit(":", 1)[1])
        self.grpc_addr = f"http://127.0.0.1:{port}"
        self.lighthouse_url = f"http://127.0.0.1:{port}"
        self.sim = SimRanks.start(groups * ranks_per_group, groups)
        self.groups = groups
        self.replica_ids = {g: f"replica_group_{g}:{uuid.uuid4()}" for g in range(groups)}
        self.alive = set(range(groups))
        for r in self.sim.ranks:
            r.update(replica_id=self.replica_ids[r.state["replica_group"]])
        self.kills: list[str] = []
        self.quorum_id: int | None = None
        self._stop = threading.Event()
        self._heartbeats = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                            name="sim-heartbeats")
        self._heartbeats.start()
        self.front_port = 0
        self._front: ThreadingHTTPServer | None = None
        self.front_up()
        self.requorum()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.front_port}"

    def train_and_sweep(self, mon, clock: list[float], seconds: int, steps: int = 5) -> None:
        """``seconds`` sweeps of ``mon`` one second apart on its injected ``clock``, each after
        every live group's ranks committed ``steps`` more steps."""
        for _ in range(seconds):
            clock[0] += 1.0
            for g in self.alive:
                for r in self.sim.group(g):
                    r.update(step=r.state["step"] + steps, commits=r.state["commits"] + steps,
                             last_step_at=clock[0])
            mon.sweep_once()

    def _heartbeat_loop(self) -> None:
        client = self._client()
        while not self._stop.is_set():
            for g in sorted(self.alive):
                try:
                    client.heartbeat(self.replica_ids[g],
                                     timeout=self._timedelta(seconds=1))
                except Exception:  # the Lighthouse shutting down at the end of a test
                    pass
            self._stop.wait(0.2)

    def requorum(self, attempts: int = 3) -> int:
        """Every live group asks for a quorum at once (as each step's Manager does); the ranks
        then report it. Returns the quorum id."""
        client = self._client()
        for g in sorted(self.alive):  # all heartbeating first: the Lighthouse waits for them
            client.heartbeat(self.replica_ids[g], timeout=self._timedelta(seconds=5))
        for _ in range(attempts):
            results: dict[int, Any] = {}

            def join(g: int, results: dict[int, Any] = results) -> None:
                try:
                    results[g] = self._client().quorum(
                        replica_id=self.replica_ids[g], timeout=self._timedelta(seconds=10),
                        address=f"http://127.0.0.1:1/sim-manager-{g}",
                        store_address="127.0.0.1:1", step=100,
                        world_size=len(self.sim.group(g)), shrink_only=False)
                except Exception as e:  # a round that split: asked again below
                    results[g] = e

            threads = [threading.Thread(target=join, args=(g,)) for g in sorted(self.alive)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            ids = {getattr(q, "quorum_id", None) for q in results.values()}
            if len(results) == len(self.alive) and len(ids) == 1 and None not in ids:
                break
        else:
            raise RuntimeError(f"simulated groups did not form one quorum: {results}")
        q = next(iter(results.values()))
        self.quorum_id = int(q.quorum_id)
        for g in self.alive:
            for r in self.sim.group(g):
                r.update(quorum_id=self.quorum_id, num_participants=len(q.participants),
                         participating=True, group_world_size=len(self.sim.group(g)))
        return self.quorum_id

    def kill(self, replica_id: str) -> bool:
        for g, rid in self.replica_ids.items():
            if rid == replica_id and g in self.alive:
                self.alive.discard(g)
                for r in self.sim.group(g):
                    r.set_mode("down")
                return True
        return False

    def serve_dumps(self) -> None:
        """Every rank serves an empty Flight Recorder dump of its own rank and group."""
        for r in self.sim.ranks:
            r.fr = {"version": "2.10", "pg_config": {}, "entries": [], "rank": r.state["rank"],
                    "replica_group": r.state["replica_group"]}

    def dark_mid_dump(self, g: int, timeout: float = 30.0) -> float:
        """Once a monitor has read every rank's dump (:meth:`serve_dumps`), leave the next dump
        of group ``g``'s first rank unanswered and, that fetch in flight, take ``g``'s host dark
        (:meth:`go_dark`); returns when, ``time.monotonic()``."""
        from lightkeeper.processes import wait_until

        wait_until(lambda: all(r.fr_answered for r in self.sim.ranks), timeout,
                   what="a Flight Recorder look at every rank")
        victim = self.sim.group(g)[0]
        victim.set_mode("fr_silent")
        wait_until(lambda: victim.fr_held, timeout, what="a dump fetch in flight")
        dark = time.monotonic()
        self.go_dark(g)
        return dark

    def go_dark(self, g: int) -> None:
        """Group ``g``'s host drops every packet: its ranks answer nothing (``"silent"``, no
        reset either) and its heartbeats stop; nothing is killed."""
        self.alive.discard(g)
        for r in self.sim.group(g):
            r.set_mode("silent")

    # --- the front -------------------------------------------------------------------
    def front_up(self) -> None:
        outer = self

        class Front(BaseHTTPRequestHandler):
            def _forward(self, method: str) -> None:
                import urllib.error
                import urllib.request

                req = urllib.request.Request(outer.lighthouse_url + self.path, method=method)
                try:
                    with urllib.request.urlopen(req, timeout=10) as resp:
                        status, body = resp.status, resp.read()
                except urllib.error.HTTPError as e:
                    status, body = e.code, e.read()
                self._answer(status, body)

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                self._forward("GET")

            def do_POST(self):  # noqa: N802
                parts = self.path.strip("/").split("/")
                if len(parts) == 3 and parts[0] == "replica" and parts[2] == "kill":
                    rid = urllib.parse.unquote(parts[1])
                    outer.kills.append(rid)
                    outer.kill(rid)
                    self._answer(500, b"Something went wrong: transport error")
                else:
                    self._forward("POST")

            def log_message(self, *args):
                pass

        self._front = ThreadingHTTPServer(("127.0.0.1", self.front_port), Front)
        self._front.daemon_threads = True
        self.front_port = self._front.server_address[1]
        # shutdown() (front_down, stop) waits for the loop's next poll: 0.05 s, not 0.5
        threading.Thread(target=self._front.serve_forever, args=(0.05,), daemon=True,
                         name="sim-lighthouse-front").start()

    def front_down(self) -> None:
        if self._front is not None:
            self._front.shutdown()
            self._front.server_close()
            self._front = None

    def stop(self) -> None:
        self._stop.set()
        self.front_down()
        self._heartbeats.join(timeout=5)
        self.lighthouse.shutdown()
        self.sim.stop()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--groups", type=int, default=None)
    p.add_argument("--rank-offset", type=int, default=0)
    args = p.parse_args()
    sim = SimRanks.start(args.ranks, args.groups)
    for i, r in enumerate(sim.ranks):
        r.update(rank=args.rank_offset + i)
    print("SIM " + " ".join(sim.urls), flush=True)
    sys.stdin.read()  # serve until the parent closes our stdin (or exits)
    sim.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
