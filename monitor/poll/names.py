"""The addresses of host names the registrations are matched against (monitor/poll/discovery.py),
looked up off the registration path: a daemon thread asks every name again every NAME_CACHE_S
(a name with no addresses yet every RETRY_S) on a few workers of its own, so a slow resolver
delays no registration and takes none of the admission's lookups (monitor/poll/admission.py).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from .admission import IPAddress, NotAllowed

log = logging.getLogger(__name__)

NAME_CACHE_S = 30.0  # a name's addresses are asked again this often, as --allow-targets' are
RETRY_S = 5.0  # a name not resolved yet (new, or its lookups failed) is asked again this soon
WORKERS = 4  # lookups at a time; a resolver that hangs holds these, never a registration
MAX_WANTED = 10_000  # registered names asked for (beyond: matched as spelled only)

Addresses = frozenset[IPAddress]


def ip_of(host: str) -> IPAddress | None:
    """``host`` (unbracketed) as an address, ``::ffff:10.0.0.1`` as ``10.0.0.1``; None for a name."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def lookup(host: str) -> list[IPAddress]:
    """Every address ``host`` resolves to, as long as the resolver takes; raises NotAllowed."""
    addr = ip_of(host)
    if addr is not None:
        return [addr]
    try:
        infos = socket.getaddrinfo(host, None, 0, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:  # UnicodeError: a name IDNA refuses
        raise NotAllowed(f"{host} does not resolve: {e}") from None
    out: list[IPAddress] = []
    for info in infos:
        a = ip_of(str(info[4][0]).split("%", 1)[0])
        if a is not None and a not in out:
            out.append(a)
    if not out:
        raise NotAllowed(f"{host} resolves to no IP address")
    return out


class NameRefresher:
    """Keeps the names it is given resolved. A failed or empty lookup keeps a name's previous
    addresses (a resolver's blip moves nothing); a lookup giving other addresses calls
    ``on_change(name, old, new)`` (``old`` None the first time) on a worker, outside any lock
    of its own."""

    def __init__(self, resolver: Callable[[str], Iterable[IPAddress]],
                 on_change: Callable[[str, Addresses | None, Addresses], None],
                 every_s: float = NAME_CACHE_S) -> None:
        self._resolver, self._on_change, self.every_s = resolver, on_change, every_s
        self._lock = threading.Lock()
        self._listed: set[str] = set()
        self._wanted: dict[str, float] = {}  # a registration's name -> when last asked for
        self._addrs: dict[str, Addresses] = {}  # a name's last good answer
        self._asked: dict[str, float] = {}  # when a name's last lookup ended
        self._in_flight: dict[str, Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def set_listed(self, names: Iterable[str]) -> None:
        """The listed names (a new listing): new ones are looked up at once."""
        with self._lock:
            self._listed = set(names)
            self._forget()
        self._wake.set()

    def want(self, name: str) -> Addresses | None:
        """A registration's host name: its addresses as last resolved, None when it never was;
        looked up soon, and again while registrations ask for it."""
        with self._lock:
            new = name not in self._wanted
            if not new or len(self._wanted) < MAX_WANTED:
                self._wanted[name] = time.monotonic()
            addrs = self._addrs.get(name)
        if new:
            self._wake.set()
        return addrs

    def addresses(self, name: str) -> Addresses | None:
        """``name``'s addresses as last resolved; None when it never was."""
        with self._lock:
            return self._addrs.get(name)

    def _forget(self) -> None:  # under self._lock
        for name in [n for n in self._addrs if n not in self._listed and n not in self._wanted]:
            del self._addrs[name]
            self._asked.pop(name, None)

    def refresh(self, names: Iterable[str] | None = None) -> None:
        """Look every name (or those given) up now and wait for the answers."""
        with self._lock:
            names = list(self._listed | self._wanted.keys() if names is None else names)
        wait_futures([f for f in self._submit(names) if f is not None])

    def _submit(self, names: Iterable[str]) -> list[Future | None]:
        out = []
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=WORKERS,
                                                thread_name_prefix="lightkeeper-names")
            for name in names:
                fut = self._in_flight.get(name)
                if fut is None and not self._stop.is_set():
                    fut = self._in_flight[name] = self._pool.submit(self._lookup, name)
                out.append(fut)
        return out

    def _lookup(self, name: str) -> None:
        try:
            try:
                got = frozenset(self._resolver(name))
            except Exception as e:  # NotAllowed, a timeout: the previous addresses stay
                log.debug("listed name %s: %s", name, e)
                got = frozenset()
            with self._lock:
                self._asked[name] = time.monotonic()
                old = self._addrs.get(name)
                gone = name not in self._listed and name not in self._wanted
                if not got or got == old or gone:
                    return
                self._addrs[name] = got
            # before the next lookup of this name starts (it is still in flight): in order
            self._on_change(name, old, got)
        finally:
            with self._lock:
                self._in_flight.pop(name, None)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lightkeeper-names",
                                            daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            pool = self._pool
        if pool is not None:  # a lookup under way ends when the resolver answers
            pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        full_at = 0.0
        while not self._stop.is_set():
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                if now >= full_at:  # every name again; a registration's while it is asked for
                    self._wanted = {n: t for n, t in self._wanted.items()
                                    if now - t < 2 * self.every_s}
                    self._forget()
                    due = list(self._listed | self._wanted.keys())
                    full_at = now + self.every_s
                else:  # new names, and those whose lookups failed so far
                    due = [n for n in self._listed | self._wanted.keys() if n not in self._addrs
                           and now - self._asked.get(n, -RETRY_S) >= RETRY_S]
            self._submit(due)
            self._wake.wait(min(RETRY_S, max(0.0, full_at - now)))
