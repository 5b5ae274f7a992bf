"""Concurrent polling of every rank: one sweep = one ``GET /v1/state`` per target, all at once.

The poller runs its own asyncio event loop in a background thread and speaks just enough
HTTP/1.1 (keep-alive, ``Content-Length`` or chunked bodies) to fetch JSON from WorkerServers.
That keeps a sweep over 1,000 ranks well under a second on two cores (benchmarks/
bench_monitor_sweep.py), where a thread per request or ``requests`` would spend the budget on
overhead. Every request has its own timeout; a rank that is slow, refuses connections, answers
garbage or an HTTP error becomes a :class:`RankPoll` with ``ok=False`` and a ``reason``
(``timeout``, ``connection``, ``http_status``, ``bad_response``) and never delays the others
beyond its timeout or raises out of :meth:`Poller.sweep`.

Everything a rank sends is bounded: the whole request by its timeout (a rank that dribbles bytes
is cut off like a silent one), the body by ``max_bytes`` (declared or counted, chunked or not),
header lines by the stream's 64 KiB line limit and their number by :data:`MAX_HEADERS`.

Keep-alive connections are pooled per ``host:port`` (several per address when several targets
share one, e.g. ranks behind one proxy, addressed as ``http://host:port/<prefix>``: the request
goes to ``/<prefix>/v1/state``), at most ``max_idle`` idle ones overall, least recently used
closed first; a reused connection the server closed in the meantime is retried once on a fresh
one. The monitor sizes ``max_idle`` to the targets it polls: a pool smaller than one sweep made
every sweep past it reconnect (at 10,000 ranks ~6,000 connects per sweep, most of its cost;
docs/scaling.md).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from http_serving import host_for_url

REASONS = ("timeout", "connection", "http_status", "bad_response")
MAX_BODY = 1 << 20  # default per answer; /v1/fr_trace gets its own (larger) bound
MAX_HEADERS = 100


class PollError(Exception):
    def __init__(self, reason: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


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


class _Conn:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:
            pass


_SPLIT_CACHE: dict[str, tuple[str, int, str]] = {}


def _split(url: str) -> tuple[str, int, str]:
    """(host, port, path prefix without a trailing slash) of a target URL (cached)."""
    got = _SPLIT_CACHE.get(url)
    if got is not None:
        return got
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None or parts.query \
            or parts.fragment:
        raise PollError("connection", f"unsupported target URL {url!r} "
                                      "(http://host:port[/prefix] only)")
    # an IPv6 literal comes unbracketed (as asyncio takes it), a zone as %eth0, not %25eth0
    got = (unquote(parts.hostname), parts.port, parts.path.rstrip("/"))
    if len(_SPLIT_CACHE) > 1_000_000:
        _SPLIT_CACHE.clear()
    _SPLIT_CACHE[url] = got
    return got


class Poller:
    """Fetch JSON documents from many WorkerServers concurrently; see the module docstring."""

    def __init__(self, timeout_s: float = 0.8, max_concurrency: int = 1024,
                 max_idle: int = 4096, max_bytes: int = MAX_BODY) -> None:
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.max_concurrency = max_concurrency
        self.max_idle = max_idle
        self._idle: OrderedDict[tuple[str, int], list[_Conn]] = OrderedDict()
        self._n_idle = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lightkeeper-poller",
                                        daemon=True)
        self._thread.start()
        self._closed = False

    # --- public, thread-safe ---------------------------------------------------------
    def sweep(self, urls: Iterable[str], path: str = "/v1/state",
              timeout_s: float | None = None,
              max_bytes: int | None = None) -> dict[str, RankPoll]:
        """GET ``path`` from every URL concurrently; returns url -> RankPoll (never raises).

        A body over ``max_bytes`` (default: the poller's) is a ``bad_response``."""
        urls = list(dict.fromkeys(urls))
        if not urls:
            return {}
        timeout = self.timeout_s if timeout_s is None else timeout_s
        limit = self.max_bytes if max_bytes is None else max_bytes
        fut = asyncio.run_coroutine_threadsafe(self._sweep(urls, path, timeout, limit),
                                               self._loop)
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
                conn.close()

            async def closed(conn: _Conn) -> None:
                try:
                    await conn.writer.wait_closed()
                except Exception:
                    pass

            if conns:  # all at once: one by one, 10,000 pooled connections outlast any timeout
                await asyncio.wait([asyncio.ensure_future(closed(c)) for c in conns], timeout=2.0)
            await asyncio.sleep(0)  # let transports run their close callbacks

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        except TimeoutError:  # a loaded machine: the sockets close with the loop below
            pass
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()

    # --- event loop side -------------------------------------------------------------
    async def _sweep(self, urls: list[str], path: str, timeout: float,
                     limit: int) -> dict[str, RankPoll]:
        # max_concurrency workers share one iterator: no semaphore, whose release scans its
        # waiters (with 10,000 queued requests that scan was a quarter of the sweep)
        results: dict[str, RankPoll] = {}
        todo = iter(urls)

        async def worker() -> None:
            for url in todo:
                results[url] = await self._one(url, path, timeout, limit)

        await asyncio.gather(*(worker() for _ in range(min(self.max_concurrency, len(urls)))))
        return {u: results[u] for u in urls}

    async def _one(self, url: str, path: str, timeout: float, limit: int) -> RankPoll:
        start = time.perf_counter()
        status = None
        try:
            async with asyncio.timeout(timeout):  # no extra task per request
                data = await self._get_json(url, path, limit)
            return RankPoll(url, True, data=data, latency_s=time.perf_counter() - start)
        except PollError as e:
            reason, msg, status = e.reason, str(e), e.status
        except TimeoutError:
            reason, msg = "timeout", f"no answer within {timeout:.2f}s"
        except (OSError, asyncio.IncompleteReadError, ConnectionError) as e:
            reason, msg = "connection", f"{type(e).__name__}: {e}"
        except Exception as e:  # anything else a broken rank can provoke
            reason, msg = "bad_response", f"{type(e).__name__}: {e}"
        return RankPoll(url, False, reason=reason, error=msg, status=status,
                        latency_s=time.perf_counter() - start)

    def _take(self, key: tuple[str, int]) -> _Conn | None:
        conns = self._idle.get(key)
        if not conns:
            return None
        conn = conns.pop()
        if not conns:
            del self._idle[key]
        self._n_idle -= 1
        return conn

    def _put(self, key: tuple[str, int], conn: _Conn) -> None:
        conns = self._idle.get(key)
        if conns is None:
            self._idle[key] = [conn]
        else:
            conns.append(conn)
            self._idle.move_to_end(key)
        self._n_idle += 1
        while self._n_idle > self.max_idle:
            old_key, old = next(iter(self._idle.items()))
            old.pop(0).close()
            self._n_idle -= 1
            if not old:
                del self._idle[old_key]

    async def _get_json(self, url: str, path: str, limit: int) -> dict[str, Any]:
        host, port, prefix = _split(url)
        key = (host, port)
        path = prefix + path
        conn = self._take(key)
        reused = conn is not None
        for attempt in (0, 1):
            if conn is None:
                reader, writer = await asyncio.open_connection(host, port)
                conn = _Conn(reader, writer)
            try:
                status, body, keep = await self._request(conn, host, port, path, limit)
                break
            except (ConnectionError, asyncio.IncompleteReadError, _StaleConnection):
                conn.close()
                conn = None
                if attempt == 0 and reused:
                    continue  # the server closed an idle keep-alive connection: retry fresh
                raise
            except BaseException:
                conn.close()  # cancelled (timeout) or malformed: the stream state is unknown
                raise
        if keep:
            self._put(key, conn)
        else:
            conn.close()
        if status != 200:
            raise PollError("http_status", f"HTTP {status}: {body[:200]!r}", status)
        try:
            data = json.loads(body)
        except ValueError as e:
            raise PollError("bad_response", f"not JSON: {e}") from None
        if not isinstance(data, dict):
            raise PollError("bad_response", f"expected a JSON object, got {type(data).__name__}")
        return data

    @staticmethod
    async def _request(conn: _Conn, host: str, port: int, path: str,
                       limit: int) -> tuple[int, bytes, bool]:
        conn.writer.write(f"GET {path} HTTP/1.1\r\nHost: {host_for_url(host)}:{port}\r\n"
                          "Accept: application/json\r\nUser-Agent: lightkeeper-monitor\r\n\r\n"
                          .encode("latin-1"))
        await conn.writer.drain()
        line = await conn.reader.readline()
        if not line:
            raise _StaleConnection("connection closed before the status line")
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise PollError("bad_response", f"bad status line {line[:100]!r}")
        status = int(parts[1])
        headers: dict[bytes, bytes] = {}
        for lines in range(MAX_HEADERS + 1):
            h = await conn.reader.readline()
            if h in (b"\r\n", b"\n"):
                break
            if not h:
                raise PollError("bad_response", "connection closed inside the headers")
            if lines == MAX_HEADERS:
                raise PollError("bad_response", f"more than {MAX_HEADERS} header lines")
            name, _, value = h.partition(b":")
            headers[name.strip().lower()] = value.strip()
        keep = parts[0] == b"HTTP/1.1" and headers.get(b"connection", b"").lower() != b"close"
        if b"content-length" in headers:
            try:
                n = int(headers[b"content-length"])
            except ValueError:
                raise PollError("bad_response", "bad Content-Length") from None
            if n < 0 or n > limit:
                raise PollError("bad_response", f"Content-Length {n} out of range "
                                                f"(at most {limit} bytes)")
            body = await conn.reader.readexactly(n)
        elif headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            chunks = []
            total = 0
            while True:
                size_line = await conn.reader.readline()
                try:
                    size = int(size_line.split(b";")[0].strip(), 16)
                except ValueError:
                    raise PollError("bad_response", "bad chunk size") from None
                if size == 0:
                    while (await conn.reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                total += size
                if total > limit:
                    raise PollError("bad_response", f"body larger than {limit} bytes")
                chunks.append(await conn.reader.readexactly(size))
                await conn.reader.readexactly(2)
            body = b"".join(chunks)
        else:  # the body ends when the connection does
            chunks, total = [], 0
            while chunk := await conn.reader.read(65536):
                total += len(chunk)
                if total > limit:
                    raise PollError("bad_response", f"body larger than {limit} bytes")
                chunks.append(chunk)
            body = b"".join(chunks)
            keep = False
        return status, body, keep


class _StaleConnection(ConnectionError):
    pass
