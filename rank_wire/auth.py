"""How the monitor signs a state-changing call to one rank (``POST /v1/exit``, ``/v1/abort``,
``/v1/probe``), one spec for the monitor that signs (monitor/act/actions.py,
monitor/evidence/probes.py) and the WorkerServer that checks (worker_server/app.py).

The ranks' shared secret (``LIGHTKEEPER_EXIT_TOKEN``) is never sent: a call carries
``Authorization: Lightkeeper-HMAC-SHA256 <hex>``, HMAC-SHA256 keyed by the token over
:func:`canonical`: the method, the route's path with its query (as the rank serves it, without
any prefix of the target's URL), the identity of the one rank the call is for
(:func:`identity`) and the SHA-256 of the body. The identity is not sent: the rank computes its
own, so a signature the monitor gave a process claiming some rank's place is refused by every
other rank, and the monitor signs for no identity two of its targets claim
(``Claims`` in monitor/evidence/probes.py). The identity binds the rank's slot and its group's
incarnation, not the process (a non-zero rank restarted alone keeps its group's replica id).
There is no timestamp (ranks' clocks may be hours apart): whoever reads the traffic can replay a
call to the same rank slot and group incarnation, as the bearer token could be replayed before;
TLS or a private network is the answer to that (docs/CONTRACTS.md).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

SCHEME = "Lightkeeper-HMAC-SHA256"  # the Authorization header's scheme
VERSION = "lightkeeper-rank-call-v1"  # the canonical string's first line


def identity(replica_group: int | None, group_rank: int | None, replica_id: str | None) -> str:
    """The rank a call is for, as it serves itself in ``/v1/state``:
    ``<replica_group>/<group_rank>/<replica_id>``, the id empty before the rank has one (the
    first two are integers, so an id holding a ``/`` is still unambiguous)."""
    g = "" if replica_group is None else replica_group
    r = "" if group_rank is None else group_rank
    return f"{g}/{r}/{replica_id or ''}"


def identity_of(state: Mapping[str, Any] | None) -> str:
    """:func:`identity` from a rank's ``/v1/state`` document (what the monitor last read)."""
    s = state or {}
    return identity(s.get("replica_group"), s.get("group_rank"), s.get("replica_id"))


def canonical(method: str, path: str, ident: str, body: bytes) -> bytes:
    """What is signed: one line each for the version, the method (upper case), the path with
    its query (``/v1/exit``, ``/v1/x?a=1``), the identity and the body's SHA-256 (hex)."""
    return "\n".join((VERSION, method.upper(), path, ident,
                      hashlib.sha256(body).hexdigest())).encode("utf-8", "surrogatepass")


def _key(token: str) -> bytes:
    # a token read from a secret file often ends in a newline: neither side's spaces count
    return token.strip().encode("utf-8", "surrogatepass")


def sign(token: str, method: str, path: str, ident: str, body: bytes) -> str:
    """The signature (lower-case hex) of a call to the rank ``ident``."""
    if not token.strip():
        raise ValueError("no token to sign with")
    return hmac.new(_key(token), canonical(method, path, ident, body), hashlib.sha256).hexdigest()


def header(token: str, method: str, path: str, ident: str, body: bytes) -> str:
    """The ``Authorization`` value of a signed call."""
    return f"{SCHEME} {sign(token, method, path, ident, body)}"


def signature_of(authorization: str | None) -> str | None:
    """The signature of an ``Authorization`` value in :data:`SCHEME` (its name in any case),
    else None (a bearer token, nothing)."""
    scheme, _, given = (authorization or "").strip().partition(" ")
    return given.strip() if scheme.lower() == SCHEME.lower() else None


def verify(token: str | None, method: str, path: str, ident: str, body: bytes,
           signature: str | None) -> bool:
    """``signature`` is :func:`sign`'s for this call (compared in constant time); False
    without a token or a signature."""
    if not token or not token.strip() or not signature:
        return False
    want = sign(token, method, path, ident, body)
    return hmac.compare_digest(signature.strip().lower().encode("ascii", "replace"),
                               want.encode("ascii"))


def peer_identity(url: str) -> str:
    """The identity a rank's call to a peer at ``url`` (``http://host:port``, as the peer
    advertises its ``worker_url``) is signed for: replayed, it reaches that peer only."""
    return f"peer {url.rstrip('/')}"


def peer_authorization(token: str, path: str, url: str) -> str:
    """The ``Authorization`` of a rank's ``GET`` of the probe payload ``path`` (with its query)
    of the peer at ``url``: it proves the caller holds the ranks' token, so a reader without it
    cannot make a rank spend its threads serving bytes (worker_server/probe.py)."""
    return header(token, "GET", path, peer_identity(url), b"")


def authorization(token: str, mode: str, route: str, body: bytes, ident: str) -> str:
    """The ``Authorization`` value of a POST of ``body`` to the rank's ``route`` (the path it
    serves, with its query: ``/v1/exit``; never a prefix of the target's URL, which a proxy in
    front of the rank strips), signed for the rank ``ident``; ``mode`` ``bearer``: the token
    itself, the deprecated form a rank older than signatures takes."""
    if mode == "bearer":
        return f"Bearer {token.strip()}"
    return header(token, "POST", route, ident, body)
