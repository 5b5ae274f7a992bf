"""Ranks that run only torch's own debug server (``torch.distributed.debug``), read as they are.

torch serves, per rank, a C++ ``_WorkerServer``: ``GET /handler/`` lists its handlers and
``POST /handler/<name>`` calls one (``fr_trace_json``, ``dump_traceback``, ``ping``, ...).
``start_debug_server()`` publishes every rank's address in its replica group's TCPStore as
``debug_server/rank<RANK>``; the torchft Lighthouse names each group's TCPStore (``TCPStore:`` of
every quorum member), so the monitor finds these ranks from the Lighthouse alone.

Such a target is spelled ``torch+http://host:port`` (:func:`torch_url`). :class:`TorchPoller`
reads it each sweep: through Lightkeeper's handlers when the rank has them (its WorkerServer
registered on torch's server: ``lightkeeper_state``, ``lightkeeper_fr_trace``,
``lightkeeper_stacks`` answer as ``GET /v1/state``, ``/v1/fr_trace``, ``/v1/stacks`` do), the
full rank state; else torch's whole Flight Recorder dump, raw, under :data:`RAW_KEY`
(monitor.evidence.torch_rank makes that a rank state). :class:`StoreReader` finds the ranks and
who they are. Nothing here raises because of a rank or a store: what cannot be read becomes a
failed :class:`RankPoll` or one logged line.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import requests

from .poller import RankPoll, judge_body
from .torch_target import base_url, torch_url

log = logging.getLogger(__name__)

RAW_KEY = "torch_server"  # a torch-only answer (TorchAnswer), before evidence adapts it
# Lightkeeper's /v1/state, /v1/fr_trace, /v1/stacks as handlers on torch's server (same bytes)
STATE_HANDLER, LK_FR_HANDLER, LK_STACKS_HANDLER = \
    "lightkeeper_state", "lightkeeper_fr_trace", "lightkeeper_stacks"
FR_HANDLER, STACKS_HANDLER = "fr_trace_json", "dump_traceback"  # torch's own
STORE_PREFIX = "debug_server/rank"  # torch.distributed.debug._store: one key per RANK
HANDLERS_TTL_S = 30.0  # a rank's handler list is asked again this often (or after a 404)
STORE_RETRY_S = 5.0  # a store that could not be read (or lacked ranks) is asked again after
_GROUP_NUMBER = re.compile(r"(\d+)$")


def replica_group_of(replica_id: str) -> int | None:
    """The replica group number a torchft replica id names (``<prefix>:<uuid>``, the prefix
    ending in digits: ``replica_group_3``, ``ft_3``); None when it names none."""
    m = _GROUP_NUMBER.search(replica_id.rsplit(":", 1)[0])
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class TorchIdentity:
    """Who a torch-only rank is, from its group's TCPStore (whose ``replica_id`` the Lighthouse
    lists): the rank itself claims nothing."""

    replica_id: str
    replica_group: int
    group_rank: int
    group_world_size: int
    store: str

    @property
    def rank(self) -> int:
        return self.replica_group * self.group_world_size + self.group_rank


@dataclass(frozen=True)
class TorchAnswer:
    """What a torch-only rank answered: its handlers and torch's Flight Recorder dump (or why
    none). Not a JSON type: no rank's JSON can pass for one."""

    handlers: tuple[str, ...]
    dump: dict[str, Any] | None = None
    error: str | None = None


def _read_limited(r: requests.Response, limit: int) -> bytes:
    body = bytearray()
    for chunk in r.iter_content(65536):
        body += chunk
        if len(body) > limit:
            raise ValueError(f"answer larger than {limit} bytes")
    return bytes(body)


class TorchPoller:
    """Reads torch-server targets, a few at a time on threads (they are few: an adapter, not
    the poller's hot path); :meth:`sweep` never raises."""

    def __init__(self, timeout_s: float = 0.8, fr_timeout_s: float = 5.0,
                 max_state_bytes: int = 1 << 20, max_fr_bytes: int = 64 << 20,
                 workers: int = 8) -> None:
        self.timeout_s, self.fr_timeout_s = timeout_s, fr_timeout_s
        self.max_state_bytes, self.max_fr_bytes = max_state_bytes, max_fr_bytes
        self._session = requests.Session()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="lightkeeper-torch-poll")
        self._handlers: dict[str, tuple[tuple[str, ...], float]] = {}

    def sweep(self, urls: Iterable[str], queries: Iterable[str] | None = None
              ) -> dict[str, RankPoll]:
        """Each target's state answer (:meth:`poll`); ``queries``: per URL, for
        ``lightkeeper_state`` (as ``/v1/state`` takes them)."""
        urls = list(urls)
        qs = list(queries) if queries is not None else [""] * len(urls)
        if not urls:
            return {}
        if len(self._handlers) > 2 * len(urls) + 1024:  # restarted ranks' old addresses
            self._handlers = {u: h for u, h in self._handlers.items() if u in set(urls)}
        return dict(zip(urls, self._pool.map(self.poll, urls, qs), strict=True))

    def fr_sweep(self, urls: Iterable[str], query: str = "") -> dict[str, RankPoll]:
        """``lightkeeper_fr_trace`` + ``query`` of ranks that serve it (a rank without it: a
        failed poll, reason ``http_status``, status 404)."""
        urls = list(urls)
        return dict(zip(urls, self._pool.map(lambda u: self._fr(u, query), urls), strict=True))

    def _fr(self, url: str, query: str) -> RankPoll:
        t0, at = time.monotonic(), time.time()
        try:
            if LK_FR_HANDLER not in self.handlers(url):
                raise _CallError("http_status", f"{url}: no {LK_FR_HANDLER} handler", 404)
            body = self.call(url, LK_FR_HANDLER + query, self.fr_timeout_s, self.max_fr_bytes)
            return judge_body(url, body, time.monotonic() - t0, at)
        except _CallError as e:
            return RankPoll(url, False, reason=e.reason, error=str(e), status=e.status,
                            latency_s=time.monotonic() - t0, at=at)

    def poll(self, url: str, query: str = "") -> RankPoll:
        """One target's answer: ``lightkeeper_state``'s document, else the raw dump."""
        t0, at = time.monotonic(), time.time()
        try:
            handlers = self.handlers(url)
            if STATE_HANDLER in handlers:
                try:
                    body = self.call(url, STATE_HANDLER + query, self.timeout_s,
                                     self.max_state_bytes)
                except _CallError as e:
                    if e.status != 503:
                        raise
                    body = None  # registered, but its WorkerServer stopped: torch's answers
                if body is not None:
                    p = judge_body(url, body, time.monotonic() - t0, at, state=True)
                    if p.ok and LK_STACKS_HANDLER in handlers:
                        p.data["stacks_url"] = f"{base_url(url)}/handler/{LK_STACKS_HANDLER}"
                    return p
            dump, error = None, None
            if FR_HANDLER in handlers:
                try:
                    dump = self.call_json(url, FR_HANDLER, self.fr_timeout_s, self.max_fr_bytes)
                except _CallError as e:  # the rank answers: its state is made without waits
                    error = str(e)
            else:
                error = f"no {FR_HANDLER} handler (torch < 2.8, or not registered)"
            return RankPoll(url, True, {RAW_KEY: TorchAnswer(handlers, dump, error)},
                            latency_s=time.monotonic() - t0, at=at)
        except _CallError as e:
            return RankPoll(url, False, reason=e.reason, error=str(e), status=e.status,
                            latency_s=time.monotonic() - t0, at=at)

    def stacks(self, stacks_urls: Iterable[str], limit: int = 256 << 10) -> dict[str, str]:
        """Stacks text by ``stacks_url`` (a handler, POSTed); one line saying why where none."""
        urls = list(dict.fromkeys(stacks_urls))

        def one(u: str) -> str:
            try:
                body = self._request("POST", u, max(1.0, self.timeout_s), limit)
                return body.decode("utf-8", "replace")
            except _CallError as e:
                return f"(no stacks: {e})"
        return dict(zip(urls, self._pool.map(one, urls), strict=True)) if urls else {}

    def handlers(self, url: str) -> tuple[str, ...]:
        """The handler names its ``GET /handler/`` lists (cached HANDLERS_TTL_S)."""
        got = self._handlers.get(url)
        if got is not None and time.monotonic() - got[1] < HANDLERS_TTL_S:
            return got[0]
        body = self._request("GET", base_url(url) + "/handler/", self.timeout_s, 64 << 10)
        try:
            names = _json(body)
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"expected a list of handler names, got {str(names)[:80]!r}")
        except ValueError as e:
            raise _CallError("bad_response", f"GET /handler/: {e}") from None
        out = tuple(names)
        self._handlers[url] = (out, time.monotonic())
        return out

    def call(self, url: str, name: str, timeout_s: float, limit: int) -> bytes:
        """``POST /handler/<name>``'s body (``name`` may end in a ``?query``); raises
        :class:`_CallError`."""
        try:
            return self._request("POST", f"{base_url(url)}/handler/{name}", timeout_s, limit)
        except _CallError as e:
            if e.status == 404:
                self._handlers.pop(url, None)  # its handlers changed: listed again next time
            raise

    def call_json(self, url: str, name: str, timeout_s: float, limit: int) -> dict[str, Any]:
        body = self.call(url, name, timeout_s, limit)
        try:
            data = _json(body)
        except ValueError as e:
            raise _CallError("bad_response", f"{name}: not JSON: {e}") from None
        if not isinstance(data, dict):
            raise _CallError("bad_response", f"{name}: expected a JSON object")
        return data

    def _request(self, method: str, url: str, timeout_s: float, limit: int) -> bytes:
        try:
            with self._session.request(method, url, timeout=timeout_s, stream=True) as r:
                if r.status_code != 200:
                    raise _CallError("http_status", f"{method} {url}: HTTP {r.status_code}: "
                                     f"{r.raw.read(200, decode_content=True)!r}", r.status_code)
                return _read_limited(r, limit)
        except requests.Timeout as e:
            raise _CallError("timeout", f"{method} {url}: {e}") from None
        except requests.RequestException as e:
            raise _CallError("connection", f"{method} {url}: {type(e).__name__}: {e}") from None
        except ValueError as e:  # larger than the limit
            raise _CallError("bad_response", f"{method} {url}: {e}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._session.close()


class _CallError(Exception):
    def __init__(self, reason: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.reason, self.status = reason, status


def _json(body: bytes) -> Any:
    return json.loads(body)


@dataclass
class _StoreRead:
    found: dict[str, TorchIdentity]
    complete: bool
    at: float


class StoreReader:
    """torch-only ranks from their groups' TCPStores: for each group the Lighthouse lists
    (replica id, store, world size), the store's ``replica_id`` must be that id, then each
    ``debug_server/rank<i>`` key is a rank's address. Needs torch in the monitor's Python
    (said once, then nothing is found). Never raises."""

    def __init__(self, timeout_s: float = 1.0, forget_after_s: float = 30.0) -> None:
        self.timeout_s, self.forget_after_s = timeout_s, forget_after_s
        self._reads: dict[tuple[str, str], _StoreRead] = {}
        self._last_listed: dict[str, float] = {}  # replica id -> when the Lighthouse listed it
        self._said: set[str] = set()
        self.error: str | None = None  # the last store that could not be read, and why

    def identities(self) -> dict[str, TorchIdentity]:
        """URL -> identity of every rank found and not forgotten."""
        return {u: i for r in self._reads.values() for u, i in r.found.items()}

    def read(self, groups: Iterable[tuple[str, str, int]], now: float) -> dict[str, TorchIdentity]:
        """Read the stores of ``groups`` (replica id, ``host:port``, world size) not read yet
        (or incomplete, after STORE_RETRY_S); forget groups the Lighthouse stopped listing
        ``forget_after_s`` ago. Returns :meth:`identities`."""
        for rid, store, ws in groups:
            self._last_listed[rid] = now
            got = self._reads.get((rid, store))
            if got is not None and (got.complete or now - got.at < STORE_RETRY_S):
                continue
            found, complete = self._read_one(rid, store, ws)
            if found or got is None:
                self._reads[(rid, store)] = _StoreRead(found, complete, now)
            else:
                got.at = now
        for key in [k for k in self._reads if now - self._last_listed.get(k[0], now)
                    >= self.forget_after_s]:
            del self._reads[key]
            self._last_listed.pop(key[0], None)
        return self.identities()

    def _say(self, key: str, message: str) -> None:
        self.error = message
        if key not in self._said:
            self._said.add(key)
            log.warning("%s", message)

    def _read_one(self, rid: str, store: str, ws: int) -> tuple[dict[str, TorchIdentity], bool]:
        group = replica_group_of(rid)
        if group is None:
            self._say(f"group:{rid}", f"torch's debug server: replica id {rid!r} names no "
                      "replica group number (its prefix should end in digits); its ranks "
                      "are not read")
            return {}, True
        try:
            from torch.distributed import TCPStore
        except ImportError as e:
            self._say("torch", f"--torch-stores needs torch in the monitor's Python to read "
                      f"the groups' TCPStores ({e}); torch-only ranks are not found")
            return {}, True
        host, _, port = store.rpartition(":")
        try:
            s = TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=self.timeout_s))
            listed = s.get("replica_id").decode("utf-8", "replace") \
                if s.check(["replica_id"]) else None
            if listed != rid:
                self._say(f"rid:{rid}:{store}", f"torch's debug server: store {store} holds "
                          f"replica_id {listed!r}, not {rid!r}: its ranks are not read")
                return {}, False
            found: dict[str, TorchIdentity] = {}
            for i in range(ws):
                key = f"{STORE_PREFIX}{i}"
                if s.check([key]):
                    addr = s.get(key).decode("utf-8", "replace")
                    found[torch_url(addr)] = TorchIdentity(rid, group, i, ws, store)
            return found, len(found) == ws
        except Exception as e:  # unreachable, timed out, a bad port: asked again later
            self._say(f"store:{store}", f"torch's debug server: cannot read store {store} of "
                      f"{rid!r}: {type(e).__name__}: {e}")
            return {}, False
