"""Whether the monitor may sign a call for a rank (rank_wire.auth): not while another known
target claims the same identity, unless both URLs reach one listener; host names are looked up
off the sweep (:class:`Resolver`). Used by the probes, the exits and the aborts.
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from http_serving import redact_url
from rank_wire import auth

from .view import ClusterView

log = logging.getLogger(__name__)

RESOLVED_S, UNRESOLVED_S, MAX_NAMES = 60.0, 5.0, 4096  # a name's answer kept; a failure; names


class Resolver:
    """Host names -> addresses, looked up on a small pool of its own, never on the caller's
    thread (a hanging resolver, likeliest when the network is in trouble, must not stall a
    sweep): :meth:`addresses` answers what is known and asks in the background."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, workers: int = 2) -> None:
        self.clock, self.workers = clock, workers
        self._lock = threading.Condition()
        # name -> (until, monotonic; its addresses, None: the last lookup failed), oldest first
        self._known: OrderedDict[str, tuple[float, frozenset[str] | None]] = OrderedDict()
        self._asking: set[str] = set()  # names queued or being looked up
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []  # daemons: a hanging lookup holds no exit
        self._closed = False

    def __len__(self) -> int:
        return len(self._known)

    def addresses(self, host: str) -> frozenset[str] | None:
        """``host``'s addresses (an IP literal's own); None while unknown: being looked up, or
        the last lookup failed (asked again after :data:`UNRESOLVED_S`). An answer past its
        time is still given while it is looked up again."""
        try:
            return frozenset({str(ipaddress.ip_address(host))})
        except ValueError:
            pass
        host = host.lower()
        with self._lock:
            hit = self._known.get(host)
            if hit is not None:
                self._known.move_to_end(host)
            if (hit is None or hit[0] <= self.clock()) and host not in self._asking \
                    and not self._closed:
                self._asking.add(host)
                self._queue.put(host)
                if len(self._threads) < min(self.workers, len(self._asking)):
                    t = threading.Thread(target=self._work, daemon=True,
                                         name="lightkeeper-resolve")
                    self._threads.append(t)
                    t.start()
            return None if hit is None else hit[1]

    def _work(self) -> None:
        while (host := self._queue.get()) is not None:
            self._lookup(host)

    def _lookup(self, host: str) -> None:
        try:
            addrs: frozenset[str] | None = frozenset(
                str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError, ValueError):
            addrs = None
        except Exception:  # a bug must not leave the name asked forever
            addrs = None
            log.exception("looking up %s failed", host)
        with self._lock:
            self._asking.discard(host)
            self._lock.notify_all()
            self._known[host] = (self.clock() + (RESOLVED_S if addrs else UNRESOLVED_S),
                                 addrs or None)
            self._known.move_to_end(host)
            while len(self._known) > MAX_NAMES:
                self._known.popitem(last=False)

    def settle(self, timeout: float) -> bool:
        """Wait for the lookups under way (tests, shutdown); True when none is left."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._asking, timeout)

    def close(self) -> None:
        """No new lookup; one under way is left to its daemon thread (it may hang)."""
        with self._lock:
            self._closed = True
            for _ in self._threads:
                self._queue.put(None)


@dataclass(frozen=True)
class _Url:
    host: str
    port: int
    path: str

    @staticmethod
    def of(url: str) -> _Url | None:
        try:
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:  # a port out of range
            return None
        return _Url(parts.hostname, port, parts.path.rstrip("/")) if parts.hostname else None


class Claims:
    """Whether the monitor may sign a call for a rank: not when another known target (any
    polled URL, reachable or not, superseded included) claims the same identity
    (rank_wire.auth) in its last state, unless that URL names the same listener (the same port
    and path, and host names whose addresses intersect: a listed ``http://node7:9400`` and the
    rank's registered ``http://10.0.0.7:9400``). Verification may take a stranger copying an
    unreachable rank's public /v1/state in that rank's place; a call signed for it would be
    valid at the real rank too. One object for every caller (the probes, the exits, the
    aborts): one cache of names, looked up off the sweep (:class:`Resolver`); while a name is
    not known the call waits for a later sweep. Each claim and each name is said once while it
    lasts (:meth:`keep`), on ``logger``."""

    def __init__(self, logger: logging.Logger | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = logger or log
        self.resolver = Resolver(clock)
        self._said: set[tuple[str, frozenset[str]]] = set()  # (identity, the two URLs)
        self._said_unresolved: set[str] = set()  # host names

    def _same_listener(self, a: str, b: str) -> bool | str:
        """``a`` and ``b`` reach one listener (a call signed for one can reach no other
        process: one process listens on one address and port; a path behind one port may be
        another rank behind a proxy); a str: the host name whose addresses are not known yet."""
        ua, ub = _Url.of(a), _Url.of(b)
        if ua is None or ub is None or (ua.port, ua.path) != (ub.port, ub.path):
            return False
        if ua.host == ub.host:
            return True
        # both asked at once: each name is looked up while the other is
        known = {u.host: self.resolver.addresses(u.host) for u in (ua, ub)}
        missing = sorted(h for h, addrs in known.items() if addrs is None)
        for h in missing:
            if h not in self._said_unresolved:
                self._said_unresolved.add(h)
                self.log.warning("could not resolve %s yet: not signed", h)
        self._said_unresolved.difference_update(known.keys() - set(missing))
        return missing[0] if missing else bool(known[ua.host] & known[ub.host])

    @staticmethod
    def of(known: ClusterView) -> dict[str, list[str]]:
        """identity -> the URLs of ``known``'s targets whose last state claims it (computed
        once per view: a view never changes once built)."""
        cached = known.__dict__.get("_claims")
        if cached is None:
            cached = {}
            for url, r in known.ranks.items():
                if r.state is not None:
                    cached.setdefault(auth.identity_of(r.state), []).append(url)
            known.__dict__["_claims"] = cached
        return cached

    def why_not(self, known: ClusterView | None, rank: Any) -> str | None:
        """Why no call is signed for ``rank`` this sweep (another URL of ``known`` claims its
        identity, or a name is not resolved yet), or None: it may be; ``known``: the sweep's
        whole view (None: no target known)."""
        if known is None:
            return None
        ident = auth.identity_of(getattr(rank, "state", None))
        unresolved = None
        for other in self.of(known).get(ident, ()):
            same = True if other == rank.url else self._same_listener(other, rank.url)
            if isinstance(same, str):  # asked again next sweep, once looked up
                unresolved = unresolved or same
            if same is not False:
                continue
            key = (ident, frozenset((rank.url, other)))
            if key not in self._said:
                self._said.add(key)
                self.log.warning("no call signed for %s (replica group/group rank/replica id "
                                 "%s): %s claims the same rank in its last state, and a "
                                 "signature for one would be valid at the other; skipped while "
                                 "both are known", redact_url(rank.url), ident, redact_url(other))
            return f"{redact_url(other)} claims the same rank ({ident}), a call signed for it " \
                   "would be valid there too"
        return None if unresolved is None else f"could not resolve {unresolved} yet"

    def keep(self, known: ClusterView) -> None:
        """Forget what was said of claims ``known`` (the sweep's whole view) no longer holds and
        of names none of its URLs has: said again when they come back."""
        claims = self.of(known)
        self._said = {k for k in self._said if k[1] <= set(claims.get(k[0], ()))}
        hosts = {u.host for u in map(_Url.of, known.ranks) if u is not None}
        self._said_unresolved &= hosts

    def close(self) -> None:
        self.resolver.close()
