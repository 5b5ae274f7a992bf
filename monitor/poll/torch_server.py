"""Ranks that run only torch's own debug server (``torch.distributed.debug``): ``GET /handler/``
lists a rank's handlers, ``POST /handler/<name>`` calls one. :class:`StoreReader` finds them in
the TCPStores the Lighthouse names (``debug_server/rank<RANK>``); :class:`TorchPoller` reads
each ``torch+http://`` target: Lightkeeper's state where it has those handlers, else torch's raw
Flight Recorder dumps under :data:`RAW_KEY`. Nothing here raises because of a rank or a store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .fr_bound import FrBound
from .poller import STATE_PATH, Poller, RankPoll
from .torch_target import HANDLERS, base_url, torch_url

log = logging.getLogger(__name__)

RAW_KEY = "torch_server"  # a torch-only answer (TorchAnswer), before evidence adapts it
# Lightkeeper's /v1/state and /v1/stacks as handlers on torch's server (same bytes)
STATE_HANDLER, LK_STACKS_HANDLER = HANDLERS[STATE_PATH], HANDLERS["/v1/stacks"]
FR_HANDLER, STACKS_HANDLER = "fr_trace_json", "dump_traceback"  # torch's own
# ProcessGroupNCCL's own recorder, on CUDA builds only: fr_trace_json serves the generic one
# (gloo, ...), so without this a GPU job's collectives would not be seen at all
NCCL_FR_HANDLER = "dump_nccl_trace_json"
STORE_PREFIX = "debug_server/rank"  # torch.distributed.debug._store: one key per RANK
HANDLERS_TTL_S = 30.0  # a rank's handler list is asked again this often (or after a 404)
STORE_RETRY_S = 5.0  # a store that could not be read (or lacked ranks) is asked again after
STORE_RETRY_MAX_S = 80.0  # ... doubled after each further failure to read it, up to this
# a store holding every rank is read again this often: torchrun restarting a group on its
# agent's store keeps the old ranks' keys until each new rank rewrites its own
STORE_REFRESH_S = 30.0
MAX_STORE_READS = 64  # store reads under way (torch's client can wait without end) at most
# a group's ranks lacking their key this long are said unwatched: a starting group writes its
# replica id (torchft's Manager) before its ranks call start_debug_server()
UNWATCHED_AFTER_S = 30.0
_GROUP_NUMBER = re.compile(r"(\d+)$")


def replica_group_of(replica_id: str) -> int | None:
    """The replica group number a torchft replica id names (``<prefix>:<uuid>``, the prefix
    ending in digits: ``replica_group_3``, ``ft_3``); None when it names none."""
    m = _GROUP_NUMBER.search(replica_id.rsplit(":", 1)[0])
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class TorchIdentity:
    """Who a torch-only rank is, from its group's TCPStore: the rank itself claims nothing."""

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
    """A torch-only rank's handlers and Flight Recorder dumps (or why none). Not a JSON type: no
    rank's JSON can pass for one."""

    handlers: tuple[str, ...]
    dump: dict[str, Any] | None = None
    error: str | None = None
    nccl: dict[str, Any] | None = None


class TorchPoller:
    """Reads torch-server targets through a :class:`Poller` of its own, one request per rank at
    each step (handler lists, states, dumps); :meth:`sweep` never raises."""

    def __init__(self, timeout_s: float = 0.8, fr_timeout_s: float = 5.0,
                 max_state_bytes: int = 1 << 20, max_fr_bytes: int = 64 << 20) -> None:
        self.fr_timeout_s, self.max_fr_bytes = fr_timeout_s, max_fr_bytes
        self.fr_bound = FrBound(fr_timeout_s)  # by handler URL: a dark rank holds ~1 s
        self.timeout_s, self.max_state_bytes = timeout_s, max_state_bytes
        self._own: Poller | None = None
        self._handlers: dict[str, tuple[tuple[str, ...], float]] = {}

    @property
    def _poller(self) -> Poller:
        """Started on first use: a monitor with no torch target runs no second event loop."""
        if self._own is None:
            self._own = Poller(self.timeout_s, max_bytes=self.max_state_bytes)
        return self._own

    def sweep(self, urls: Iterable[str], queries: Iterable[str] | None = None
              ) -> dict[str, RankPoll]:
        """Each target's answer: ``lightkeeper_state``'s document where the rank serves it
        (``queries``: per URL, as ``/v1/state`` takes them), else torch's raw dump."""
        urls = list(urls)
        if not urls:
            return {}
        query = dict(zip(urls, queries, strict=True)) if queries is not None else {}
        t0, at = time.monotonic(), time.time()
        out: dict[str, RankPoll] = {}
        handlers = self._list(urls, out)
        lk = [u for u, names in handlers.items() if STATE_HANDLER in names]
        if lk:
            polls = self._poller.sweep(lk, STATE_PATH, queries=[query.get(u, "") for u in lk])
            for u, p in polls.items():
                if p.status == 503:
                    continue  # registered, but its WorkerServer stopped: torch's answers
                self._forget_on_404(u, p)
                if p.ok and LK_STACKS_HANDLER in handlers[u]:
                    p.data["stacks_url"] = f"{base_url(u)}/handler/{LK_STACKS_HANDLER}"
                out[u] = p
        raw = [u for u in handlers if u not in out]
        dumps = self._dumps(raw, handlers)
        # a dump unanswered on a list from an earlier sweep: a crashed rank's port can still
        # take connections (torch's rank-0 frontend, forked from it, holds it), so the list is
        # asked again now; silent, the rank is unreachable, not merely its dump unread
        again = [u for u, d in dumps[FR_HANDLER].items()
                 if d.reason == "timeout" and self._handlers.get(u, ((), t0))[1] < t0]
        if again:
            for u in again:
                del self._handlers[u]
            self._list(again, out)
        latency = time.monotonic() - t0
        for u in raw:
            if u in out:
                continue
            d, dump = dumps[FR_HANDLER].get(u), None
            if d is None:
                error = f"no {FR_HANDLER} handler (torch < 2.8, or not registered)"
            elif d.ok:  # the rank answers: its state is made without waits otherwise
                dump, error = d.data, None
            else:
                error = d.error
                self._forget_on_404(u, d)
                if d.reason in ("connection", "timeout"):  # perhaps gone: listed afresh
                    self._handlers.pop(u, None)
                if d.reason == "connection":  # nothing listens (the handler list was cached)
                    out[u] = RankPoll(u, False, reason=d.reason, status=d.status,
                                      error=f"{FR_HANDLER}: {d.error}", latency_s=latency, at=at)
                    continue
            n, nccl = dumps[NCCL_FR_HANDLER].get(u), None
            if n is not None and n.ok:
                nccl = n.data
            elif n is not None:  # the generic recorder's answer still counts
                error = f"{error}; " if error else ""
                error += f"{NCCL_FR_HANDLER}: {n.error}"
                self._forget_on_404(u, n)
            out[u] = RankPoll(u, True, {RAW_KEY: TorchAnswer(handlers[u], dump, error, nccl)},
                              latency_s=latency, at=at)
        return {u: out[u] for u in urls}

    def _dumps(self, urls: list[str], handlers: dict[str, tuple[str, ...]]
               ) -> dict[str, dict[str, RankPoll]]:
        """handler -> url -> its dump, both recorders' asked at once (a CUDA rank serves two)."""
        asks = {f"{u}/handler/{h}": (u, h) for h in (FR_HANDLER, NCCL_FR_HANDLER)
                for u in urls if h in handlers[u]}
        out: dict[str, dict[str, RankPoll]] = {FR_HANDLER: {}, NCCL_FR_HANDLER: {}}
        if asks:
            self.fr_bound.keep(asks)
            got = self.fr_bound.fetch(
                list(asks), lambda live, w: self._poller.sweep(live, "", w, self.max_fr_bytes))
            for key, (u, h) in asks.items():
                out[h][u] = got[key]
        return out

    def stacks(self, stacks_urls: Iterable[str], limit: int = 256 << 10) -> dict[str, str]:
        """Stacks text by ``stacks_url`` (a handler, POSTed); one line saying why where none."""
        urls = list(dict.fromkeys(stacks_urls))
        rows = self._rows([torch_url(u) for u in urls], "", max(1.0, self.timeout_s),
                          limit)
        return {u: body.decode("utf-8", "replace") if ok else f"(no stacks: {error})"
                for u, (_, ok, body, _, error, *_) in zip(urls, rows, strict=True)}

    def close(self) -> None:
        if self._own is not None:
            self._own.close()

    def _list(self, urls: list[str], failed: dict[str, RankPoll]) -> dict[str, tuple[str, ...]]:
        """Each rank's handler names (``GET /handler/``, kept HANDLERS_TTL_S or until a 404);
        a rank whose list cannot be read gets its failed poll in ``failed`` instead."""
        now = time.monotonic()
        if len(self._handlers) > 2 * len(urls) + 1024:  # restarted ranks' old addresses
            # by age, not by ``urls``: a sweep may ask a few ranks only (a drill, a re-ask)
            self._handlers = {u: h for u, h in self._handlers.items() if now - h[1] < HANDLERS_TTL_S}
        out: dict[str, tuple[str, ...]] = {}
        ask = []
        for u in dict.fromkeys(urls):
            got = self._handlers.get(u)
            if got is not None and now - got[1] < HANDLERS_TTL_S:
                out[u] = got[0]
            else:
                ask.append(u)
        rows = self._rows([base_url(u) for u in ask], "/handler/", self.timeout_s,
                          64 << 10)
        for u, (_, ok, body, reason, error, status, latency, at) in zip(ask, rows, strict=True):
            if ok:
                try:
                    names = json.loads(body)
                    if not isinstance(names, list) or not all(type(n) is str for n in names):
                        raise ValueError(f"expected a list of handler names, got "
                                         f"{str(names)[:80]!r}")
                except (ValueError, RecursionError) as e:  # not JSON, or nested too deep
                    reason, error = "bad_response", f"GET /handler/: {e}"
                else:
                    out[u] = tuple(names)
                    self._handlers[u] = (out[u], now)
                    continue
            elif status == 404:  # torch's server always lists its handlers there
                error = ("GET /handler/ answered 404: no torch debug handlers at this address "
                         "(torch older than 2.10, or not torch's debug server)")
            failed[u] = RankPoll(u, False, reason=reason, error=error, status=status,
                                 latency_s=latency, at=at)
        return out

    def _rows(self, urls: list[str], path: str, timeout_s: float, limit: int) -> list[tuple]:
        """The poller's rows (unparsed bodies) of ``urls``, which are distinct, in their order."""
        if not urls:
            return []
        rows: list[tuple] = []
        self._poller.sweep(urls, path, timeout_s, limit, on_rows=rows.extend)
        by_index = {row[0]: row for row in rows}
        return [by_index[i] for i in range(len(urls))]

    def _forget_on_404(self, url: str, p: RankPoll) -> None:
        if p.status == 404:
            self._handlers.pop(url, None)  # its handlers changed: listed again next time


@dataclass
class _StoreRead:
    found: dict[str, TorchIdentity]
    at: float
    wait: float = STORE_RETRY_S  # read again this long after ``at`` (doubled by each failure)


@dataclass(frozen=True)
class _Got:
    """One store read: the ranks found, whether all were, whether it failed, and what to say
    about it (once per ``key``)."""

    found: dict[str, TorchIdentity]
    complete: bool
    failed: bool = False
    key: str = ""
    message: str | None = None
    client: Any = None  # torch's client of the store, kept for its next read
    missing: tuple[int, ...] = ()  # group ranks whose key the store (the group's) lacks


class _Reading:
    """One store read on a thread of its own: on a port that takes connections but never
    answers, torch's ``TCPStore()`` waits without end whatever its ``timeout``."""

    def __init__(self, fetch: Callable[[], _Got]) -> None:
        self.got: _Got | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(fetch,), name="lightkeeper-store-read",
                         daemon=True).start()

    def _run(self, fetch: Callable[[], _Got]) -> None:
        try:
            self.got = fetch()
        finally:
            self.done.set()


class StoreReader:
    """torch-only ranks from the TCPStores of the groups the Lighthouse lists: a store whose
    ``replica_id`` is the group's holds a ``debug_server/rank<i>`` address per rank. Needs torch
    (said once). Never raises. Stores due are read at once, each on a thread, waited for
    ``timeout_s`` at most; a late read is taken at a later call. A store that cannot be read is
    said once and read again STORE_RETRY_S later, doubling up to STORE_RETRY_MAX_S. A store
    lacking ranks is read again STORE_RETRY_S later, one holding them all STORE_REFRESH_S later.

    A store read again is read on the connection its last read made: torch's store server
    resolves every new client's address to a name (reverse DNS) on the thread that serves the
    whole store, so a connection per read would hold the job's own store calls for as long as
    that lookup takes. The connection is closed once the store cannot be read, or its group is
    forgotten."""

    def __init__(self, timeout_s: float = 1.0, forget_after_s: float = 30.0) -> None:
        self.timeout_s, self.forget_after_s = timeout_s, forget_after_s
        self._reads: dict[tuple[str, str], _StoreRead] = {}
        self._reading: dict[tuple[str, str], _Reading] = {}  # reads not taken yet
        self._clients: dict[tuple[str, str], Any] = {}  # idle clients; a read holds its own
        self._last_listed: dict[str, float] = {}  # replica id -> when the Lighthouse listed it
        self._said: set[str] = set()
        self.error: str | None = None  # the last store that could not be read, and why
        self._missing: dict[tuple[str, str], tuple[float, tuple[int, ...]]] = {}  # since, ranks
        # group ranks lacking their key UNWATCHED_AFTER_S: (replica id, store) -> (ranks, why)
        self.unwatched: dict[tuple[str, str], tuple[tuple[int, ...], str]] = {}

    def identities(self) -> dict[str, TorchIdentity]:
        """URL -> identity of every rank found and not forgotten."""
        return {u: i for r in self._reads.values() for u, i in r.found.items()}

    def read(self, groups: Iterable[tuple[str, str, int]], now: float,
             failed: Iterable[str] = ()) -> dict[str, TorchIdentity]:
        """Read the due stores of ``groups`` (replica id, ``host:port``, world size); forget
        groups unlisted for ``forget_after_s``. A store whose rank URL is in ``failed`` (its poll
        failed) is due again STORE_RETRY_S after its last read: a restarted rank re-registers
        under a new address. Blocks ``timeout_s`` at most; :meth:`identities`."""
        failed = set(failed)
        for r in self._reads.values():  # a refresh brought forward; a failing store backs off
            if r.wait == STORE_REFRESH_S and not failed.isdisjoint(r.found):
                r.wait = STORE_RETRY_S
        started: list[tuple[str, str]] = []
        groups = list(groups)
        listed = {(rid, store) for rid, store, _ in groups}
        moved = {rid for rid, _, _ in groups}  # a group's store it no longer names: its old ranks
        for table in (self._reads, self._clients, self._missing):
            for key in [k for k in table if k[0] in moved and k not in listed]:
                del table[key]  # a client's connection closes with it
        for rid, store, ws in groups:
            self._last_listed[rid] = now
            key = (rid, store)
            got = self._reads.get(key)
            if key in self._reading or got is not None and now - got.at < got.wait:
                continue
            if len(self._reading) >= MAX_STORE_READS:
                self._say("reads", f"torch's debug server: {len(self._reading)} store reads "
                          "have not answered; no other store is read until one does")
                continue
            reading = self._start(rid, store, ws)
            if isinstance(reading, _Got):
                self._settle(key, reading, now)
            else:
                self._reading[key] = reading
                started.append(key)
        deadline = time.monotonic() + self.timeout_s
        for key in started:
            self._reading[key].done.wait(max(0.0, deadline - time.monotonic()))
        for key, reading in list(self._reading.items()):
            if reading.done.is_set():
                del self._reading[key]
                # else forgotten meanwhile, or its group moved to another store: old ranks
                if key[0] in self._last_listed and (key in listed or key[0] not in moved):
                    self._settle(key, reading.got or _Got({}, False, True), now)
            elif key in started:
                self._say(f"store:{key[1]}", f"torch's debug server: cannot read store "
                          f"{key[1]} of {key[0]!r}: no answer in {self.timeout_s:g} s (its port "
                          "takes connections); not read again until that read ends")
        for rid in [r for r, t in self._last_listed.items() if now - t >= self.forget_after_s]:
            del self._last_listed[rid]
            for key in [k for k in self._reads if k[0] == rid]:
                del self._reads[key]
            for key in [k for k in self._clients if k[0] == rid]:
                del self._clients[key]  # its connection closes with it
            self._missing = {k: v for k, v in self._missing.items() if k[0] != rid}
        self._say_unwatched(now)
        return self.identities()

    def _say_unwatched(self, now: float) -> None:
        """Say (once) the groups whose ranks wrote no address for UNWATCHED_AFTER_S, and when
        that ends: no rank of theirs is polled, so nothing else would."""
        was, self.unwatched = self.unwatched, {
            (rid, store): (ranks, f"torch's debug server: store {store} of {rid!r} holds no "
                           f"{STORE_PREFIX}<N> for group rank(s) {list(ranks)}: not watched "
                           "(start_debug_server() not called there, or torch older than 2.10)")
            for (rid, store), (since, ranks) in self._missing.items()
            if now - since >= UNWATCHED_AFTER_S}
        for key in self.unwatched.keys() - was.keys():
            log.warning("%s", self.unwatched[key][1])
        for rid, store in was.keys() - self.unwatched.keys():
            log.warning("torch's debug server: store %s of %r: %s", store, rid,
                        "every rank's address found, watched now" if (rid, store) in self._reads
                        else "the Lighthouse no longer lists its group there")

    def _say(self, key: str, message: str) -> None:
        self.error = message
        if key not in self._said:
            self._said.add(key)
            log.warning("%s", message)

    def _settle(self, key: tuple[str, str], got: _Got, now: float) -> None:
        if got.message is not None:
            self._say(got.key, got.message)
        if not got.failed:
            self._said.discard(f"store:{key[1]}")  # read: a later failure is said again
            if got.missing:
                self._missing[key] = (self._missing.get(key, (now,))[0], got.missing)
            else:
                self._missing.pop(key, None)
        old = self._reads.get(key)
        if got.failed and old is not None:
            wait = min(2 * old.wait, STORE_RETRY_MAX_S)
        elif not got.complete:
            wait = STORE_RETRY_S
        else:  # no client: nothing was read (no torch, no group number), nothing will change
            wait = STORE_REFRESH_S if got.client is not None else float("inf")
        if got.found or old is None:
            self._reads[key] = _StoreRead(got.found, now, wait)
        else:
            old.at, old.wait = now, wait
        if got.client is not None:
            self._clients[key] = got.client  # read again later: on this connection

    def _start(self, rid: str, store: str, ws: int) -> _Reading | _Got:
        """The read of ``store`` under way, or what it came to where no read is needed."""
        group = replica_group_of(rid)
        if group is None:
            return _Got({}, True, key=f"group:{rid}", message=(
                f"torch's debug server: replica id {rid!r} names no replica group number (its "
                "prefix should end in digits); its ranks are not read"))
        try:
            from torch.distributed import TCPStore
        except ImportError as e:
            return _Got({}, True, key="torch", message=(
                f"--torch-stores needs torch in the monitor's Python to read the groups' "
                f"TCPStores ({e}); torch-only ranks are not found"))
        client = self._clients.pop((rid, store), None)  # held by this read until it ends
        return _Reading(lambda: self._fetch(TCPStore, rid, store, ws, group, client))

    def _fetch(self, tcp_store: Any, rid: str, store: str, ws: int, group: int,
               client: Any) -> _Got:
        """The read itself, on its own thread, on ``client`` where the last read left one;
        never raises."""
        host, _, port = store.rpartition(":")
        host = host.strip("[]")
        try:
            if client is not None:
                with contextlib.suppress(Exception):  # its store restarted or went away
                    return self._ask(client, rid, store, ws, group)
            # a plain connect first: torch's client retries a dead port for its whole timeout,
            # writing some 30 lines of C++ errors a try
            socket.create_connection((host, int(port)), timeout=self.timeout_s).close()
            client = tcp_store(host, int(port), is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=self.timeout_s))
            return self._ask(client, rid, store, ws, group)
        except Exception as e:  # refused, unreachable, timed out, a bad port: read again later
            return _Got({}, False, True, f"store:{store}", f"torch's debug server: cannot read "
                        f"store {store} of {rid!r}: {type(e).__name__}: {e}")

    @staticmethod
    def _ask(client: Any, rid: str, store: str, ws: int, group: int) -> _Got:
        """The ranks ``client``'s store holds for ``rid``; raises where the store cannot say."""
        listed = client.get("replica_id").decode("utf-8", "replace") \
            if client.check(["replica_id"]) else None
        if listed != rid:
            return _Got({}, False, key=f"rid:{rid}:{store}", message=(
                f"torch's debug server: store {store} holds replica_id {listed!r}, not "
                f"{rid!r}: its ranks are not read"), client=client)
        found: dict[str, TorchIdentity] = {}
        missing = []
        for i in range(ws):
            key = f"{STORE_PREFIX}{i}"
            if client.check([key]):
                addr = client.get(key).decode("utf-8", "replace")
                found[torch_url(addr)] = TorchIdentity(rid, group, i, ws, store)
            else:
                missing.append(i)
        return _Got(found, len(found) == ws, client=client, missing=tuple(missing))
