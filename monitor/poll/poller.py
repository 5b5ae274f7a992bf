"""Concurrent polling of every rank on an asyncio loop in a thread, connections pooled per address.
A rank that fails becomes a :class:`RankPoll` with a ``reason``; a sweep never raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import msgspec

from .fd_budget import budget, out_of_descriptors, raise_soft_limit
from .http11 import TARGETS, Conn, PollError, note_sweep, target
from .packed_state import STATE_DECODER, bounded_state, pack_state
from .torch_target import handler_path

log = logging.getLogger(__name__)

# "monitor": the monitor could not ask (no file descriptor, its poller process died); nothing is
# known of the rank
REASONS = ("timeout", "connection", "http_status", "bad_response", "monitor")
STATE_PATH = "/v1/state"  # its answers are kept packed (monitor/poll/packed_state.py)
MAX_BODY = 1 << 20  # default per answer; /v1/fr_trace gets its own (larger) bound
EVENT_LOOPS = ("asyncio", "auto")


@dataclass
class RankPoll:
    """One target's answer to one request."""

    url: str
    ok: bool
    data: dict[str, Any] | None = None
    reason: str | None = None  # one of REASONS when not ok
    error: str | None = None
    status: int | None = None  # the HTTP status of an answer that was not 200
    latency_s: float = 0.0
    at: float = field(default_factory=time.time)


@dataclass(slots=True, eq=False)
class _Request:
    """One request in flight (``i``: its place in the sweep's URLs)."""

    sweep: _Sweep
    i: int
    key: tuple[str, int]
    wire: bytes
    start: float
    deadline: float
    conn: Conn | None = None
    connecting: asyncio.Task | None = None
    reused: bool = False
    done: bool = False
    shed: bool = False  # idle connections were closed to make room for its connect


@dataclass(slots=True, eq=False)
class _Sweep:
    """One call of :meth:`Poller.sweep`: its URLs, rows done, and requests in deadline order."""

    urls: list[str]
    path: bytes
    handler_path: bytes  # ``path`` on torch's server (monitor/poll/torch_target.py)
    timeout: float
    limit: int
    waiter: asyncio.Future
    on_rows: Callable[[list[tuple]], None] | None
    per_batch: int
    queries: list[bytes] | None  # per URL, appended to ``path``
    next: int = 0
    active: int = 0
    rows: list[tuple] = field(default_factory=list)
    # one timeout for all, so start order is deadline order: one timer, not one per request
    inflight: deque[_Request] = field(default_factory=deque)
    timer: asyncio.TimerHandle | None = None
    launching: bool = False

    def row(self, row: tuple) -> None:
        """A request is done; full batches are handed on to ``on_rows`` at once."""
        rows = self.rows
        rows.append(row)
        self.active -= 1
        if len(rows) >= self.per_batch and self.on_rows is not None:
            self.rows = []
            self.on_rows(rows)


_DECODE = msgspec.json.Decoder().decode  # hot: every answer of every sweep


def _json(body: bytes) -> Any:
    """msgspec's strict JSON; what it refuses goes to ``json.loads``, NaN and infinities read
    as null (the API serves them on, where they would be no JSON)."""
    try:
        return _DECODE(body)
    except (msgspec.DecodeError, RecursionError):
        return json.loads(body, parse_constant=lambda _: None, parse_float=_finite)


def _finite(text: str) -> float | None:
    v = float(text)  # 1e400: inf
    return v if math.isfinite(v) else None


def _state(body: bytes) -> Any:
    """A :data:`STATE_PATH` answer: only the contract's fields, each bounded, however big or
    odd the rest (monitor/poll/packed_state.py)."""
    try:
        return STATE_DECODER.decode(body)  # the usual answer: one pass, nothing else built
    except (msgspec.DecodeError, RecursionError):  # odd types, NaN, too long, not JSON
        data = _json(body)
    return bounded_state(data) if type(data) is dict else data


def judge_body(url: str, body: bytes, latency_s: float, at: float | None = None,
               state: bool = False) -> RankPoll:
    """The poll of a ``200`` answer: its JSON object, or why it is not one (never raises).
    ``state``: a :data:`STATE_PATH` answer, bounded and kept packed."""
    at = time.time() if at is None else at
    try:
        data = _state(body) if state else _json(body)
        if not isinstance(data, dict):
            raise PollError("bad_response", f"expected a JSON object, got {type(data).__name__}")
        if state:
            pack_state(data)
        return RankPoll(url, True, data, None, None, None, latency_s, at)
    except PollError as e:
        reason, error = e.reason, str(e)
    except ValueError as e:
        reason, error = "bad_response", f"not JSON: {e}"
    except Exception as e:  # RecursionError on deep nesting
        reason, error = "bad_response", f"{type(e).__name__}: {e}"
    return RankPoll(url, False, reason=reason, error=error, latency_s=latency_s, at=at)


def _status_text(status: int) -> str:
    """``HTTP 404 Not Found``: the standard phrase, not the server's."""
    try:
        return f"HTTP {status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"HTTP {status}"


def rank_poll(url: str, row: tuple, state: bool) -> RankPoll:
    """The poll of a sweep's row ``(index, ok, body, reason, error, status, latency_s, at)``."""
    _, ok, body, reason, error, status, latency, at = row
    if ok:
        return judge_body(url, body, latency, at, state)
    return RankPoll(url, False, reason=reason, error=error, status=status, latency_s=latency,
                    at=at)


def dedup_queries(urls: Iterable[str], queries: Sequence[str] | None
                  ) -> tuple[list[str], list[str] | None]:
    """``urls`` without repeats and their ``queries`` (a repeated URL keeps its last query).
    Raises ValueError unless there is one ``''`` or ``?``-led printable ASCII query per URL."""
    if queries is None:
        return list(dict.fromkeys(urls)), None
    urls, queries = list(urls), list(queries)
    if len(queries) != len(urls):
        raise ValueError(f"{len(queries)} queries for {len(urls)} URLs")
    for q in set(queries):
        if type(q) is not str or (q and (q[0] != "?" or not q.isascii() or not q.isprintable()
                                        or " " in q)):
            raise ValueError(f"a query must be '' or '?...' (printable ASCII, no space): {q!r}")
    by_url = dict(zip(urls, queries, strict=True))
    if len(by_url) == len(urls):
        return urls, queries
    return list(by_url), list(by_url.values())


def new_event_loop(kind: str = "asyncio") -> asyncio.AbstractEventLoop:
    """The stdlib's loop, or ``auto``: uvloop's (less CPU a request) where importable."""
    if kind not in EVENT_LOOPS:
        raise ValueError(f"event loop {kind!r}: one of {', '.join(EVENT_LOOPS)}")
    if kind == "auto":
        with contextlib.suppress(ImportError):
            import uvloop

            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class Poller:
    """Fetch JSON documents from many WorkerServers concurrently; see the module docstring."""

    def __init__(self, timeout_s: float = 0.8, max_concurrency: int = 1024,
                 max_idle: int = 4096, max_bytes: int = MAX_BODY,
                 event_loop: str = "asyncio") -> None:
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        # requests in flight and idle connections kept under the (raised) descriptor limit
        self.fd_limit = raise_soft_limit()
        self.max_concurrency, self.idle_cap = budget(self.fd_limit, max_concurrency)
        self.max_idle = max_idle
        self._idle: OrderedDict[tuple[str, int], list[Conn]] = OrderedDict()
        self._n_idle = 0
        self._loop = new_event_loop(event_loop)
        self._thread = threading.Thread(target=self._loop.run_forever, name="lightkeeper-poller",
                                        daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def max_idle(self) -> int:
        """Idle connections kept at most: as many as asked, up to ``idle_cap``."""
        return self._max_idle

    @max_idle.setter
    def max_idle(self, n: int) -> None:
        self._max_idle = max(0, min(n, self.idle_cap))

    def sweep(self, urls: Iterable[str], path: str = STATE_PATH, timeout_s: float | None = None,
              max_bytes: int | None = None, on_rows: Callable[[list[tuple]], None] | None = None,
              per_batch: int = 256, queries: Sequence[str] | None = None
              ) -> dict[str, RankPoll]:
        """GET ``path`` from every URL at once; url -> RankPoll (never raises). With ``on_rows``
        raw rows are handed to it in batches, unparsed, and the dict is empty."""
        urls, queries = dedup_queries(urls, queries)
        if not urls:
            return {}
        note_sweep(len(urls))
        timeout = self.timeout_s if timeout_s is None else timeout_s
        limit = self.max_bytes if max_bytes is None else max_bytes
        fut = asyncio.run_coroutine_threadsafe(
            self._sweep(urls, path, timeout, limit, on_rows, per_batch, queries), self._loop)
        return fut.result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def shutdown():
            conns = [c for cs in self._idle.values() for c in cs]
            self._idle.clear()
            self._n_idle = 0
            for conn in conns:
                if not conn.lost:
                    conn.abort()  # idle: nothing to flush
            for _ in range(2):  # let the transports run their close callbacks
                await asyncio.sleep(0)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        except TimeoutError:  # a loaded machine: the sockets close with the loop below
            pass
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()

    # --- event loop side -------------------------------------------------------------
    async def _sweep(self, urls: list[str], path: str, timeout: float, limit: int,
                     on_rows: Callable[[list[tuple]], None] | None, per_batch: int,
                     queries: list[str] | None) -> dict[str, RankPoll]:
        wire = None
        if queries is not None:  # few distinct values: each encoded once
            encoded = {q: q.encode("latin-1") for q in set(queries)}
            wire = [encoded[q] for q in queries]
        sw = _Sweep(urls, path.encode("latin-1"), handler_path(path).encode("latin-1"), timeout,
                    limit, self._loop.create_future(), on_rows,
                    per_batch if on_rows else len(urls), wire)
        self._launch(sw)
        try:
            await sw.waiter
        finally:
            if sw.timer is not None:
                sw.timer.cancel()
            # requests point back at the sweep: a cycle the monitor's frozen GC would keep
            sw.inflight.clear()
            sw.on_rows = None
        if on_rows is not None:
            if sw.rows:
                on_rows(sw.rows)
            return {}
        state = path == STATE_PATH
        polls = {urls[row[0]]: rank_poll(urls[row[0]], row, state) for row in sw.rows}
        return {u: polls[u] for u in urls}

    def _request(self, sw: _Sweep, i: int, target: tuple[tuple[str, int], bytes, bytes, bool],
                 now: float) -> _Request:
        """A request for the sweep's ``i``-th URL, in its deadline queue."""
        key, get, tail, torch = target
        query = b"" if sw.queries is None else sw.queries[i]
        path = sw.handler_path if torch else sw.path
        req = _Request(sw, i, key, get + path + query + tail, now, now + sw.timeout)
        sw.inflight.append(req)
        if sw.timer is None:
            sw.timer = self._loop.call_at(req.deadline, self._expire, sw)
        return req

    def _launch(self, sw: _Sweep) -> None:
        """Start requests until ``max_concurrency`` are in flight or none are left."""
        if sw.launching:  # a request that failed at once, inside the loop below
            return
        sw.launching = True
        urls, n, most = sw.urls, len(sw.urls), self.max_concurrency
        now = time.monotonic()
        while sw.active < most and sw.next < n:
            i = sw.next
            sw.next += 1
            sw.active += 1
            try:
                got = target(urls[i])
            except PollError as e:
                self._done(sw, i, e.reason, str(e))
                continue
            except Exception as e:
                self._done(sw, i, "bad_response", f"{type(e).__name__}: {e}")
                continue
            self._send(self._request(sw, i, got, now))
        sw.launching = False
        if sw.active == 0 and sw.next >= n and not sw.waiter.done():
            sw.waiter.set_result(None)

    def _send(self, req: _Request) -> None:
        conn = self._take(req.key)
        if conn is not None:
            req.reused = True
            conn.begin(req)
        else:
            req.reused = False
            req.connecting = self._loop.create_task(self._connect(req))

    async def _connect(self, req: _Request) -> None:
        host, port = req.key
        try:
            _, conn = await self._loop.create_connection(lambda: Conn(self, req.key), host, port)
        except OSError as e:
            req.connecting = None
            if out_of_descriptors(e) and not req.done:
                # the monitor's own limit, not the rank: make room in the idle pool, once
                if not req.shed and self._shed_idle():
                    req.shed = True
                    req.connecting = self._loop.create_task(self._connect(req))
                    return
                self._fail(req, "monitor", f"{type(e).__name__}: {e} (the monitor's own "
                           f"file descriptors, limit {self.fd_limit}: raise it, LimitNOFILE= "
                           "in a systemd unit, ulimit -n in a shell)")
                return
            self._fail(req, "connection", f"{type(e).__name__}: {e}")
            return
        except Exception as e:  # e.g. a host name that does not encode
            req.connecting = None
            self._fail(req, "bad_response", f"{type(e).__name__}: {e}")
            return
        req.connecting = None
        if req.done:  # timed out meanwhile
            conn.abort()
        else:
            conn.begin(req)

    def _shed_idle(self) -> bool:
        """Out of descriptors: keep an eighth fewer idle connections (at least 16) from now
        on, closing the least recently used. False when none was idle."""
        if self._n_idle == 0:
            return False
        cap = max(0, self._n_idle - max(16, self._n_idle // 8))
        if cap < self.idle_cap:
            log.warning("out of file descriptors (limit %d) with %d idle connections: keeping at "
                        "most %d from now on", self.fd_limit, self._n_idle, cap)
            self.idle_cap = cap
        self.max_idle = self._max_idle  # clamped to the new cap
        self._trim_idle(self._max_idle)
        return True

    def _retry(self, req: _Request) -> None:
        req.conn = None
        req.reused = False  # once: the fresh connection's failure is the answer
        req.connecting = self._loop.create_task(self._connect(req))

    def _expire(self, sw: _Sweep) -> None:
        sw.timer = None
        now = time.monotonic() + 0.001  # call_at may run a little early
        q = sw.inflight
        while q and (q[0].done or q[0].deadline <= now):
            req = q.popleft()
            if not req.done:
                self._fail(req, "timeout", f"no answer within {sw.timeout:.2f}s")
        if q and sw.timer is None:
            sw.timer = self._loop.call_at(q[0].deadline, self._expire, sw)

    def _answer(self, req: _Request, status: int, body: bytes) -> None:
        """The whole answer is here: judge it; the connection goes on to the sweep's next
        target when that is behind the same address, else back to the pool."""
        conn = req.conn
        req.conn = None
        conn.req = None
        req.done = True
        sw = req.sweep
        now = time.monotonic()
        if status == 200:  # judged by the caller (rank_poll)
            sw.row((req.i, True, body, None, None, None, now - req.start, time.time()))
        else:
            # the status only: /v1/ranks shows this error to anyone, and the URL polled is
            # whatever a registrant named
            sw.row((req.i, False, None, "http_status", _status_text(status), status,
                    now - req.start, time.time()))
        if not conn.keep or conn.lost:
            conn.abort()
        else:
            i = sw.next
            got = TARGETS.get(sw.urls[i]) if i < len(sw.urls) and not sw.launching else None
            if got is not None and got[0] == conn.key:
                sw.next += 1
                sw.active += 1
                nreq = self._request(sw, i, got, now)
                nreq.reused = True
                conn.begin(nreq)
                return
            self._put(conn)
        self._launch(sw)

    def _fail(self, req: _Request, reason: str, error: str) -> None:
        if req.done:
            return
        req.done = True
        conn = req.conn
        if conn is not None:  # cut off or malformed: the stream state is unknown
            req.conn = None
            conn.abort()
        if req.connecting is not None:
            req.connecting.cancel()
            req.connecting = None
        self._done(req.sweep, req.i, reason, error, time.monotonic() - req.start)

    def _done(self, sw: _Sweep, i: int, reason: str, error: str, latency_s: float = 0.0) -> None:
        """The ``i``-th request failed (an HTTP status is an answer: :meth:`_answer`)."""
        sw.row((i, False, None, reason, error, None, latency_s, time.time()))
        self._launch(sw)

    def _take(self, key: tuple[str, int]) -> Conn | None:
        conns = self._idle.get(key)
        while conns:
            conn = conns.pop()
            self._n_idle -= 1
            if not conns:
                del self._idle[key]
            if not conn.lost and not conn.transport.is_closing():
                return conn  # else closed by the server while idle: skip it
        return None

    def _put(self, conn: Conn) -> None:
        key = conn.key
        conns = self._idle.get(key)
        if conns is None:
            self._idle[key] = [conn]
        else:
            conns.append(conn)
            self._idle.move_to_end(key)
        self._n_idle += 1
        if self._n_idle > self._max_idle:
            self._trim_idle(self._max_idle)

    def _trim_idle(self, keep: int) -> None:
        """Close the least recently used idle connections until ``keep`` are left."""
        while self._n_idle > keep:
            old_key, old = next(iter(self._idle.items()))
            old.pop(0).abort()
            self._n_idle -= 1
            if not old:
                del self._idle[old_key]
