"""Just enough HTTP/1.1 to read a rank's answer: a callback-driven keep-alive :class:`Conn`
(no coroutine per request: docs/scaling.md). Everything a rank sends is bounded.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import unquote, urlsplit

from http_serving import host_for_url
from rank_wire import MONITOR_AGENT

from .torch_target import SCHEME, handler_path, is_torch

MAX_HEADERS = 100
MAX_HEAD = 64 * 1024  # status line + headers, bytes
MAX_CHUNK_LINE = 1024  # a chunk-size line (hex size and extensions)


class PollError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _split(url: str) -> tuple[str, int, str]:
    """(host, port, path prefix without a trailing slash) of a target URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", SCHEME) or not parts.hostname or parts.port is None \
            or parts.query or parts.fragment:
        raise PollError("connection", f"unsupported target URL {url!r} "
                                      f"(http://host:port[/prefix] or {SCHEME}://host:port only)")
    # an IPv6 literal comes unbracketed (as asyncio takes it), a zone as %eth0, not %25eth0
    return unquote(parts.hostname), parts.port, parts.path.rstrip("/")


# url -> ((host, port), b"GET <prefix>", b" HTTP/1.1\r\nHost: ...\r\n\r\n", on torch's server):
# around the path; a rank on torch's server is asked POST /handler/<name> (torch_target.py)
TARGETS: dict[str, tuple[tuple[str, int], bytes, bytes, bool]] = {}
_TAILS: dict[tuple[str, int, bool], bytes] = {}  # one header block per address and method
# URLs kept at most: twice the largest sweep (ranks that come and go with new addresses leave
# theirs behind; ~0.5 KB each), and no fewer than this
MIN_KEPT = 50_000
_kept = [MIN_KEPT]


def note_sweep(n: int) -> None:
    """A sweep of ``n`` targets is under way: the cache keeps up to twice the largest."""
    if 2 * n > _kept[0]:
        _kept[0] = 2 * n


def target(url: str) -> tuple[tuple[str, int], bytes, bytes, bool]:
    got = TARGETS.get(url)
    if got is not None:
        return got
    host, port, prefix = _split(url)
    key = (host, port)
    torch = is_torch(url)
    if torch:  # a WorkerServer path in the URL itself is asked of its handler too
        prefix = handler_path(prefix)
    tail = _TAILS.get((host, port, torch))
    if tail is None:
        tail = _TAILS[host, port, torch] = (
            f" HTTP/1.1\r\nHost: {host_for_url(host)}:{port}\r\n"
            f"Accept: application/json\r\nUser-Agent: {MONITOR_AGENT}\r\n"
            + ("Content-Length: 0\r\n\r\n" if torch else "\r\n")).encode("latin-1")
    got = (key, (b"POST " if torch else b"GET ") + prefix.encode("latin-1"), tail, torch)
    if len(TARGETS) > _kept[0]:
        TARGETS.clear()
        _TAILS.clear()
    TARGETS[url] = got
    return got


_HEAD, _LENGTH, _CHUNKED, _TO_EOF = range(4)  # what a connection is reading


def _header(low: bytes, name: bytes) -> bytes | None:
    """The stripped value of header ``name`` (b"\\n<name>:", lower case) in a lower-cased head."""
    at = low.find(name)
    if at < 0:
        return None
    at += len(name)
    end = low.find(b"\n", at)
    return low[at:end if end >= 0 else len(low)].strip()


class Conn(asyncio.Protocol):
    """One keep-alive connection: sends its request's bytes, parses the answer as it comes."""

    def __init__(self, poller: Any, key: tuple[str, int]) -> None:
        self.poller = poller
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.req: Any | None = None
        self.lost = False
        self.buf = bytearray()  # what of the current answer is not consumed yet
        self.state = _HEAD
        self.status = 0
        self.keep = True
        self.need = 0  # _LENGTH: body bytes; _CHUNKED: bytes counted so far
        self.chunks: list[bytes] = []
        self.got_any = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        req = self.req
        if req is None:  # nothing was asked: the stream is out of step, never reuse it
            self.abort()
            return
        self.got_any = True
        try:
            if self.buf or self.state != _HEAD or not self._whole(data, req):
                self.buf += data
                self._advance(self.buf)
        except PollError as e:
            self.poller._fail(req, e.reason, str(e))
        except Exception as e:  # anything else a broken rank can provoke
            self.poller._fail(req, "bad_response", f"{type(e).__name__}: {e}")

    def _whole(self, data: bytes, req: Any) -> bool:
        """Fast path (hot at scale): finish a plain ``200`` with ``Content-Length`` whole in one
        read; False for anything else, which :meth:`_advance` reads step by step."""
        end = data.find(b"\r\n\r\n")
        if end < 0 or end > MAX_HEAD or not data.startswith(b"HTTP/1.1 200 "):
            return False
        low = data[:end].lower()
        at = low.find(b"\ncontent-length:")
        if at < 0 or b"\ntransfer-encoding:" in low or b"\nconnection:" in low \
                or low.count(b"\n") > MAX_HEADERS:
            return False
        eol = low.find(b"\n", at + 16)
        try:
            n = int(low[at + 16:eol if eol >= 0 else end])
        except ValueError:
            return False
        end += 4
        if n < 0 or n > req.sweep.limit or len(data) - end < n:
            return False
        self.status = 200
        if len(data) - end > n:  # bytes past the answer: the stream is out of step
            self.keep = False
        self.poller._answer(req, 200, data[end:end + n])
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        req = self.req
        if req is None or req.done:
            return
        if self.state == _TO_EOF:  # the body ends when the connection does
            body = b"".join(self.chunks)
            self.keep = False
            self.poller._answer(req, self.status, body)
        elif not self.got_any and req.reused:
            self.req = None  # the server closed an idle keep-alive connection: retry fresh
            self.poller._retry(req)
        else:
            what = f"{type(exc).__name__}: {exc}" if exc is not None else \
                "connection closed before the status line" if not self.got_any else \
                "connection closed inside the answer"
            self.poller._fail(req, "connection", what)

    def begin(self, req: Any) -> None:
        self.req = req
        req.conn = self
        self.state, self.keep, self.got_any = _HEAD, True, False
        self.transport.write(req.wire)

    def abort(self) -> None:
        self.req = None
        self.lost = True
        if self.transport is not None:
            self.transport.abort()

    def _advance(self, buf: bytearray) -> None:
        """Consume what ``buf`` (``self.buf``) can; finish the request when the answer is
        whole."""
        if self.state == _HEAD:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                body_at = end + 4
            else:  # a bare-LF server (or the head not whole yet)
                end = buf.find(b"\n\n")
                body_at = end + 2
            if end < 0 or end > MAX_HEAD:
                lines = buf.count(b"\n", 0, MAX_HEAD + 2)
                if lines > MAX_HEADERS + 1:
                    raise PollError("bad_response", f"more than {MAX_HEADERS} header lines")
                if len(buf) > MAX_HEAD or end > MAX_HEAD:
                    raise PollError("bad_response", f"status line and headers over the "
                                                    f"{MAX_HEAD}-byte limit")
                return
            self._head(bytes(buf[:end]))
            del buf[:body_at]
        if self.state == _LENGTH:
            if len(buf) >= self.need:
                self._body(bytes(buf[:self.need]), len(buf) > self.need)
        elif self.state == _CHUNKED:
            self._chunks(buf)
        else:  # _TO_EOF
            self.need += len(buf)
            if self.need > self.req.sweep.limit:
                raise PollError("bad_response", f"body larger than {self.req.sweep.limit} bytes")
            if buf:
                self.chunks.append(bytes(buf))
                buf.clear()

    def _head(self, head: bytes) -> None:
        if head.count(b"\n") > MAX_HEADERS:
            raise PollError("bad_response", f"more than {MAX_HEADERS} header lines")
        eol = head.find(b"\n")
        first = head[:eol] if eol >= 0 else head
        parts = first.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            # not its text: it may be another service's greeting, shown on /v1/ranks to anyone
            raise PollError("bad_response", "bad status line: not an HTTP/1.x answer")
        self.status = int(parts[1])
        low = head.lower()
        length = _header(low, b"\ncontent-length:")
        chunked = _header(low, b"\ntransfer-encoding:") == b"chunked"
        self.keep = parts[0] == b"HTTP/1.1" and _header(low, b"\nconnection:") != b"close"
        limit = self.req.sweep.limit
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                raise PollError("bad_response", "bad Content-Length") from None
            if n < 0 or n > limit:
                raise PollError("bad_response", f"Content-Length {n} out of range "
                                                f"(at most {limit} bytes)")
            self.state, self.need = _LENGTH, n
        elif chunked:
            self.state, self.need, self.chunks = _CHUNKED, 0, []
        else:
            self.state, self.need, self.chunks, self.keep = _TO_EOF, 0, [], False

    def _chunks(self, buf: bytearray) -> None:
        limit = self.req.sweep.limit
        while True:
            eol = buf.find(b"\n")
            if eol < 0:
                if len(buf) > MAX_CHUNK_LINE:
                    raise PollError("bad_response", "bad chunk size")
                break
            try:
                size = int(bytes(buf[:eol]).split(b";")[0].strip(), 16)
            except ValueError:
                raise PollError("bad_response", "bad chunk size") from None
            if size < 0:
                raise PollError("bad_response", "bad chunk size")
            if size == 0:  # then optional trailers, up to an empty line
                if buf.startswith(b"\r\n", eol + 1) or buf.startswith(b"\n", eol + 1):
                    body = b"".join(self.chunks)
                    self._body(body, len(buf) > eol + 1 + (1 if buf[eol + 1] == 10 else 2))
                    return
                if buf.find(b"\n\r\n", eol) < 0 and buf.find(b"\n\n", eol) < 0:
                    if len(buf) > MAX_HEAD:
                        raise PollError("bad_response", "trailers over the limit")
                    break
                self._body(b"".join(self.chunks), True)  # trailers: never reuse after them
                return
            if self.need + size > limit:
                raise PollError("bad_response", f"body larger than {limit} bytes")
            if len(buf) < eol + 1 + size + 2:  # the chunk and its CRLF are not all here yet
                break
            self.need += size
            self.chunks.append(bytes(buf[eol + 1:eol + 1 + size]))
            del buf[:eol + 1 + size + 2]

    def _body(self, body: bytes, extra: bool) -> None:
        if extra:  # bytes past the answer: the stream is out of step
            self.keep = False
        self.buf = bytearray()
        self.poller._answer(self.req, self.status, body)

