"""Who may register a target: a bearer token, else an address in ``--allow-targets``. A name is
resolved once and polled at that address: DNS rebinding cannot move the polls.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from http_serving import bearer_token_matches, redact_entry

from ..config import MonitorConfig
from .discovery import BadTarget, Discovery, OtherJob, Target, TooManyTargets

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

RESOLVE_TIMEOUT_S = 2.0
MAX_LOOKUPS = 4  # names resolved at once; one more is refused (ResolverBusy), never queued
FAILED_LOOKUP_CACHE_S = 5.0  # an allow-list name that did not resolve (a slow resolver, perhaps)
DEFAULT_NETWORKS = ("127.0.0.0/8", "::1/128")
_HOST_RE = re.compile(r"^[A-Za-z0-9*?\[\]_.-]+$")
_WILDCARDS = set("*?[")
REFUSAL_EVERY_S = 600.0  # a refused rank asks again every 5 s: said once a window this long
# refusals said a window: anyone reaching the API may send a new URL each time, and neither the
# set of those said nor the log may grow with them (then one line says the rest go unsaid)
REFUSALS_SAID = 1000


class NotAllowed(Exception):
    """A target the monitor may not poll on an unauthenticated registration (answered 403)."""


class ResolverBusy(Exception):
    """Every DNS worker is still on a lookup (answered 503 with Retry-After), never queued."""


class Unauthorized(Exception):
    """The registration carried neither the registration nor the admin token (answered 401)."""


def registration_authorized(authorization: str | None, register_token: str | None,
                            admin_token: str | None) -> bool:
    """The header carries the registration or the admin token (an unset one matches nothing).
    Both are compared, so the time taken does not say which one matched."""
    by_register = bearer_token_matches(authorization, register_token)
    by_admin = bearer_token_matches(authorization, admin_token)
    return by_register or by_admin


def token_warning(register_token: str | None, admin_token: str | None,
                  exit_token: str | None = None) -> str | None:
    """The one-line warning for a monitor whose ranks must hold its admin token, else None."""
    if admin_token and exit_token and exit_token.strip() == admin_token.strip():
        return ("--rank-exit-token equals --token: every rank holds it (LIGHTKEEPER_EXIT_TOKEN), "
                "so every pod can also evict and release hosts; give them different values")
    # compared as the routes compare them: a secret file's final newline makes no other token
    if admin_token and register_token and register_token.strip() == admin_token.strip():
        return ("--register-token equals --token: every pod holding it can also evict and "
                "release hosts; give them different values")
    if admin_token and not register_token:
        return ("--token without --register-token: Lightkeeper ranks register only with the "
                "admin token (one without it is refused, HTTP 401), so every pod holding it can "
                "also evict and release hosts; set --register-token (LIGHTKEEPER_REGISTER_TOKEN) "
                "and give the pods only that one (ranks on torch's debug server alone never "
                "register)")
    return None


def _plain(addr: IPAddress) -> IPAddress:
    """``::ffff:10.0.0.1`` -> ``10.0.0.1``."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def ordinary_unicast(addr: IPAddress) -> bool:
    """What a host pattern may admit: never link-local (cloud metadata), loopback, multicast."""
    addr = _plain(addr)
    return not (addr.is_unspecified or addr.is_multicast or addr.is_link_local
                or addr.is_loopback or addr.is_reserved)


_pool = ThreadPoolExecutor(max_workers=MAX_LOOKUPS, thread_name_prefix="lightkeeper-dns")
# getaddrinfo cannot be cancelled: a lookup is started only on a free worker
_free = threading.BoundedSemaphore(MAX_LOOKUPS)


def _lookup(host: str, started: threading.Event) -> list:
    started.set()
    try:
        return socket.getaddrinfo(host, None, 0, socket.SOCK_STREAM)
    finally:
        _free.release()


def resolve(host: str, timeout: float = RESOLVE_TIMEOUT_S) -> list[IPAddress]:
    """Every address ``host`` resolves to; raises NotAllowed when none within ``timeout`` (from
    when the lookup starts), ResolverBusy when ``MAX_LOOKUPS`` lookups are under way."""
    try:
        return [_plain(ipaddress.ip_address(host.strip("[]")))]
    except ValueError:
        pass
    if not _free.acquire(blocking=False):
        raise ResolverBusy(f"the monitor is resolving {MAX_LOOKUPS} names already (a slow DNS "
                           f"resolver?); {host} was not looked up: try again")
    started = threading.Event()
    try:
        fut = _pool.submit(_lookup, host, started)
    except BaseException:
        _free.release()
        raise
    try:
        started.wait(timeout)  # at once: a worker was free
        infos = fut.result(timeout=timeout)
    except FutureTimeout:
        raise NotAllowed(f"{host} did not resolve within {timeout:g}s") from None
    except (OSError, UnicodeError) as e:  # UnicodeError: a name IDNA refuses (a..b, a long label)
        raise NotAllowed(f"{host} does not resolve: {e}") from None
    out: list[IPAddress] = []
    for info in infos:
        try:
            a = _plain(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]))
        except ValueError:
            continue
        if a not in out:
            out.append(a)
    if not out:
        raise NotAllowed(f"{host} resolves to no IP address")
    return out


def resolvable(url: str) -> str:
    """``url`` once its host resolves here (a token admits any address, not a name this monitor
    could never poll); raises NotAllowed."""
    resolve(urlsplit(url).hostname or "")
    return url


@dataclass
class AllowList:
    """The parsed ``--allow-targets`` entries; :meth:`admit` checks one target URL."""

    networks: list[IPNetwork] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)  # exact names, lower case
    patterns: list[str] = field(default_factory=list)  # fnmatch patterns, lower case
    resolver: Callable[[str], list[IPAddress]] = resolve
    host_cache_s: float = 30.0
    # an exact name -> (until when, its addresses)
    _host_addrs: dict[str, tuple[float, list[IPAddress]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, entries: Iterable[str], **kw) -> AllowList:
        """Raises ValueError naming an entry that is neither a network nor a host."""
        out = cls(**kw)
        for raw in entries:
            entry = raw.strip().lower()
            if not entry:
                continue
            try:
                out.networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            # a last label of digits is no host name (RFC 3696): a mistyped address or range
            if not _HOST_RE.match(entry) or entry.strip("*?.") == "" \
                    or entry.rstrip(".").rsplit(".", 1)[-1].isdigit():
                raise ValueError(f"--allow-targets entry {raw!r} is neither a network "
                                 "(CIDR or IP) nor a host name or pattern")
            (out.patterns if _WILDCARDS & set(entry) else out.hosts).append(entry)
        return out

    @classmethod
    def default(cls, static_targets: Iterable[str], **kw) -> AllowList:
        """Loopback and the hosts of the static targets (``host:port`` or URLs)."""
        hosts = [urlsplit(t if "://" in t else "http://" + t).hostname for t in static_targets]
        return cls.parse([*DEFAULT_NETWORKS, *filter(None, hosts)], **kw)

    def _allowed_by_hosts(self) -> set[IPAddress]:
        now = time.monotonic()
        out: set[IPAddress] = set()
        for h in self.hosts:
            cached = self._host_addrs.get(h)
            if cached is None or now >= cached[0]:
                try:  # ResolverBusy is raised on: nothing learned, nothing cached
                    addrs, keep = self.resolver(h), self.host_cache_s
                except NotAllowed:
                    # an allowed name that does not resolve allows no address, for a few seconds
                    # only: the failure may be a timeout of a resolver slow for a while
                    addrs, keep = [], min(self.host_cache_s, FAILED_LOOKUP_CACHE_S)
                cached = self._host_addrs[h] = (now + keep, addrs)
            out.update(cached[1])
        return out

    def admit(self, url: str) -> str:
        """The URL to poll for a registered ``http://host:port[/prefix]``, at the checked address;
        raises NotAllowed saying why not."""
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        addrs = self.resolver(host)
        by_network = [a for a in addrs if any(a in n for n in self.networks)]
        if host in self.hosts:
            ok = addrs
        elif any(fnmatch.fnmatchcase(host, p) for p in self.patterns):
            ok = [a for a in addrs if a in by_network or ordinary_unicast(a)]
        else:
            by_host = self._allowed_by_hosts()
            ok = [a for a in addrs if a in by_network or a in by_host]
        refused = [a for a in addrs if a not in ok]
        if refused:
            shown = ", ".join(map(str, refused))
            allowed = ", ".join([*map(str, self.networks), *self.hosts, *self.patterns])
            raise NotAllowed(f"target {url} resolves to {shown}, outside --allow-targets "
                             f"({allowed or 'nothing'}); register with the monitor's token or "
                             "widen --allow-targets")
        # IPv4 first (a WorkerServer on 0.0.0.0 hears no IPv6), the lowest: round-robin DNS does
        # not move a rank between two URLs
        addr = min(addrs, key=lambda a: (a.version, a))
        netloc = f"[{addr}]" if addr.version == 6 else str(addr)
        return f"{parts.scheme}://{netloc}:{parts.port}{parts.path}"  # a proxy's prefix too


REFUSALS = {Unauthorized: "unauthorized", NotAllowed: "not_allowed", BadTarget: "bad_request",
            TooManyTargets: "too_many_targets", OtherJob: "other_job",
            ResolverBusy: "resolver_busy"}


class Registrations:
    """``POST /v1/targets``: with a token configured it must carry one, else the target must be
    in ``--allow-targets``. Each outcome is counted (``counter``: by job and outcome)."""

    def __init__(self, discovery: Discovery, allow_list: AllowList, cfg: MonitorConfig,
                 counter: Any, clock: Callable[[], float]) -> None:
        self.discovery, self.allow_list, self.cfg, self.counter, self.clock = \
            discovery, allow_list, cfg, counter, clock
        self._said: set[tuple] = set()  # refusals said in this REFUSAL_EVERY_S window
        self._window = 0

    def register(self, body: Any, authorization: str | None, client: str | None) -> Target:
        """Raises one of REFUSALS' exceptions (nothing added), logged with ``client``, the
        caller's address."""
        admit = self.allow_list.admit
        try:
            if self.cfg.token or self.cfg.register_token:
                if not registration_authorized(authorization, self.cfg.register_token,
                                               self.cfg.token):
                    raise Unauthorized("missing or wrong bearer token")
                admit = resolvable
            target = self.discovery.register(body, admit=admit, now=self.clock())
        except tuple(REFUSALS) as e:
            outcome = REFUSALS[type(e)]
            self.counter.labels(self.cfg.job, outcome).inc()
            url = redact_entry(str(body.get("url")))[:200] if isinstance(body, dict) else None
            # an unauthorized one's URL is only the caller's claim: said once a window for
            # each address it comes from (a rank with a stale token, a scanner)
            key = (outcome, client) if isinstance(e, Unauthorized) else (url, outcome, str(e))
            if not isinstance(e, OtherJob):  # (said by Discovery)
                self._say(key, "registration of %s%s refused (%s): %s", url,
                          f" from {client}" if client else "", outcome, e)
            raise
        self.counter.labels(self.cfg.job, "accepted").inc()
        return target

    def _say(self, key: tuple, *line: Any) -> None:
        """Says ``line`` once a REFUSAL_EVERY_S window per ``key``, REFUSALS_SAID keys at most."""
        window = int(self.clock() // REFUSAL_EVERY_S)
        if window != self._window:  # a new window: each refusal said again
            self._said, self._window = set(), window
        if key in self._said or len(self._said) > REFUSALS_SAID:
            return
        self._said.add(key)
        if len(self._said) <= REFUSALS_SAID:
            log.info(*line)
            return
        until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime((window + 1) * REFUSAL_EVERY_S))
        log.warning("%d refused registrations logged within %d minutes: further refusals not "
                    "logged until %s", REFUSALS_SAID, REFUSAL_EVERY_S // 60, until)
