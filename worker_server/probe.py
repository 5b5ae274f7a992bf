"""Peer-to-peer network evidence: ``POST /v1/probe`` and ``GET /v1/probe/payload``.

When one host's network is degraded or cut off from its peers while it still reaches the
Lighthouse and the monitor, every replica group waits in the cross-group collective alike and
the ranks' own timings cannot say whose link is bad. The monitor then asks ranks to measure
their peers: each asked rank opens a TCP connection to every named peer's WorkerServer (the
connect time) and fetches ``N`` bytes of zeros from its ``/v1/probe/payload`` (the transfer
time, hence a throughput). A peer that cannot be reached, answers wrongly or is too slow is a
result with ``ok: false`` and the error in one line, never a failed request.

Bounds: at most :data:`MAX_PEERS` peers per request, probed :data:`PARALLEL` at a time; each
peer's connect and transfer together get ``timeout_s`` (at most :data:`MAX_TIMEOUT_S`), so an
answer comes within about ``ceil(peers / PARALLEL) * timeout_s``. The payload is at most
:data:`MAX_BYTES`. Only ``http://host:port`` peers; only the payload path is ever fetched.
"""

from __future__ import annotations

import http.client
import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from http_serving import split_host_port
from rank_wire import auth

MAX_PEERS = 64
MAX_BYTES = 4 * 1024 * 1024
DEFAULT_BYTES = 256 * 1024
DEFAULT_TIMEOUT_S = 2.0
MAX_TIMEOUT_S = 10.0
PARALLEL = 16
PAYLOAD_PATH = "/v1/probe/payload"
_CHUNK = bytes(64 * 1024)  # the payload is zeros, served from one shared buffer


@dataclass(frozen=True)
class ProbeRequest:
    peers: tuple[str, ...]
    nbytes: int
    timeout_s: float


def _peer_url(raw: Any) -> str:
    """``http://host:port`` (an optional trailing ``/``), normalized; ValueError otherwise."""
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(f"each peer must be a worker URL http://host:port, got {raw!r}")
    url = raw.strip()
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"only http:// peers can be probed, got {raw!r}")
    if parts.username or parts.password or parts.query or parts.fragment \
            or parts.path not in ("", "/"):
        raise ValueError(f"a peer is a worker URL http://host:port with nothing after it, "
                         f"got {raw!r}")
    try:
        split_host_port(url)
    except ValueError as e:
        raise ValueError(f"bad peer URL: {e}") from None
    return url.rstrip("/")


def probe_request(body: Any) -> ProbeRequest:
    """The request in a ``POST /v1/probe`` body ``{"peers": [url, ...], "bytes": int,
    "timeout_s": float}``; ValueError saying what is wrong (answered 400)."""
    if not isinstance(body, dict):
        raise ValueError('body must be JSON {"peers": ["http://host:port", ...], '
                         '"bytes": <int>, "timeout_s": <seconds>}')
    peers = body.get("peers")
    if not isinstance(peers, list) or not peers:
        raise ValueError("peers must be a non-empty list of worker URLs")
    if len(peers) > MAX_PEERS:
        raise ValueError(f"at most {MAX_PEERS} peers per request, got {len(peers)}")
    urls = tuple(_peer_url(p) for p in peers)
    if len(set(urls)) != len(urls):
        raise ValueError("peers must be distinct")
    nbytes = body.get("bytes", DEFAULT_BYTES)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= MAX_BYTES:
        raise ValueError(f"bytes must be an integer in [0, {MAX_BYTES}], got {nbytes!r}")
    timeout_s = body.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or not math.isfinite(timeout_s) or not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], "
                         f"got {timeout_s!r}")
    return ProbeRequest(urls, nbytes, float(timeout_s))


def payload(nbytes: int) -> Iterator[bytes]:
    """``nbytes`` zeros in chunks of 64 KiB (``GET /v1/probe/payload``)."""
    left = nbytes
    while left > 0:
        chunk = _CHUNK if left >= len(_CHUNK) else _CHUNK[:left]
        left -= len(chunk)
        yield chunk


def _error(e: BaseException, timeout_s: float) -> str:
    if isinstance(e, TimeoutError):
        return f"timed out ({timeout_s:g} s)"
    return f"{type(e).__name__}: {e}"


def probe_peer(url: str, nbytes: int, timeout_s: float, token: str) -> dict[str, Any]:
    """Connect to ``url`` (timed), then fetch ``nbytes`` from its payload route (timed, signed
    with the ranks' ``token``), all within ``timeout_s``. Never raises: a failure is
    ``ok: false`` with ``error``."""
    out: dict[str, Any] = {"peer": url, "ok": False, "connect_s": None, "transfer_s": None,
                           "mbit_s": None, "error": None}
    host, port = split_host_port(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    resp: http.client.HTTPResponse | None = None
    started = time.monotonic()
    deadline = started + timeout_s
    try:
        try:
            conn.connect()
        except OSError as e:
            out["error"] = f"connect: {_error(e, timeout_s)}"
            return out
        out["connect_s"] = round(time.monotonic() - started, 6)
        got = 0
        began = time.monotonic()
        try:
            sock = conn.sock  # the response reads through it after the connection lets go
            sock.settimeout(max(deadline - began, 0.001))
            path = f"{PAYLOAD_PATH}?bytes={nbytes}"
            conn.request("GET", path, headers={
                "Connection": "close", "Authorization": auth.peer_authorization(token, path, url)})
            resp = conn.getresponse()
            if resp.status != 200:
                out["error"] = f"transfer: HTTP {resp.status} from {PAYLOAD_PATH}"
                return out
            while got < nbytes:  # the response closes the socket once it has them all
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)  # the whole transfer, not each read, gets timeout_s
                chunk = resp.read(min(len(_CHUNK), nbytes - got))
                if not chunk:
                    break
                got += len(chunk)
        except (OSError, http.client.HTTPException) as e:
            out["error"] = f"transfer: {_error(e, timeout_s)} after {got} of {nbytes} bytes"
            return out
        elapsed = time.monotonic() - began
        if got != nbytes:
            out["error"] = f"transfer: got {got} of {nbytes} bytes"
            return out
        out.update(ok=True, transfer_s=round(elapsed, 6),
                   mbit_s=round(nbytes * 8 / elapsed / 1e6, 3) if nbytes and elapsed > 0
                   else None)
        return out
    finally:
        if resp is not None:
            resp.close()
        conn.close()


def probe_peers(req: ProbeRequest, token: str, control: str | None = None
                ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """:func:`probe_peer` for every peer, :data:`PARALLEL` at a time (results in the order the
    peers were given), and for ``control`` (this rank's own URL) alongside: a transfer with no
    network in it, so a process too busy to serve or read (its GIL held by training) shows
    there as on every link, where a bad network does not."""
    urls = [*req.peers, *([control] if control else [])]
    workers = min(PARALLEL, len(urls))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lightkeeper-probe") as pool:
        rows = list(pool.map(lambda url: probe_peer(url, req.nbytes, req.timeout_s, token),
                             urls))
    return rows[:len(req.peers)], (rows[-1] if control else None)
