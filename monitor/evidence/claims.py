"""Whether the monitor may sign a call for a rank (rank_wire.auth): not while another known
target claims the same identity, unless both URLs name one listener. Used by the probes, the
exits and the aborts.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from http_serving import redact_url
from rank_wire import auth

from .view import ClusterView

log = logging.getLogger(__name__)


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
        host = parts.hostname
        if not host:
            return None
        try:  # one spelling of an address (::1 and 0:0::1)
            host = str(ipaddress.ip_address(host))
        except ValueError:
            pass
        return _Url(host, port, parts.path.rstrip("/"))


class Claims:
    """The module's rule over every known target, superseded included; one listener: the same
    host, port and path as written (no lookup). A stranger copying an unreachable rank's
    /v1/state may pass verification, and a call signed for it would be valid at the real rank.
    Each claim is logged once while it lasts (:meth:`keep`)."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.log = logger or log
        self._said: set[tuple[str, frozenset[str]]] = set()  # (identity, the two URLs)

    @staticmethod
    def _same_listener(a: str, b: str) -> bool:
        ua, ub = _Url.of(a), _Url.of(b)
        return ua is not None and ua == ub

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
        """Why no call is signed for ``rank`` (another URL of ``known`` claims its identity),
        or None: it may be; ``known``: the sweep's whole view (None: no target known)."""
        if known is None:
            return None
        ident = auth.identity_of(getattr(rank, "state", None))
        for other in self.of(known).get(ident, ()):
            if other == rank.url or self._same_listener(other, rank.url):
                continue
            key = (ident, frozenset((rank.url, other)))
            if key not in self._said:
                self._said.add(key)
                self.log.warning("no call signed for %s (replica group/group rank/replica id "
                                 "%s): %s claims the same rank in its last state, and a "
                                 "signature for one would be valid at the other; skipped while "
                                 "both are known (a rank listed by a name and registered by its "
                                 "address: list it as it registers)", redact_url(rank.url),
                                 ident, redact_url(other))
            return f"{redact_url(other)} claims the same rank ({ident}), a call signed for it " \
                   "would be valid there too"
        return None

    def keep(self, known: ClusterView) -> None:
        """Forget what was said of claims ``known`` (the sweep's whole view) no longer holds:
        said again when they come back. Nothing to do, and nothing read, when none was said."""
        if self._said:
            claims = self.of(known)
            self._said = {k for k in self._said if k[1] <= set(claims.get(k[0], ()))}
