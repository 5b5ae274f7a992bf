"""etcd v3 through its JSON gateway, and one leader per key through an etcd lease.

The sharded monitor (:mod:`monitor.shard`, docs/scaling.md "Beyond one machine") keeps its
shared state in an existing etcd and elects its leader there; nothing here invents a consensus
protocol. etcd serves its v3 API as JSON over HTTP at the client URL (grpc-gateway: ``POST
/v3/kv/range``, ``/v3/kv/put``, ``/v3/kv/txn``, ``/v3/lease/grant``, ``/v3/lease/keepalive``,
``/v3/lease/revoke``; keys and values base64, 64-bit integers as strings), so ``requests`` is
the whole client: no new dependency. Tested against Debian's etcd-server 3.4.

:class:`Etcd` raises :class:`EtcdError` for anything that is not an answer (refused, timeout,
an HTTP or gRPC error, a body that is not the expected JSON); callers treat that as "do not
know" and act on nothing. :class:`LeaderLease` holds one key while its lease lives: a leader
that cannot renew its lease stops calling itself leader after the TTL at the latest, by its own
monotonic clock, which is when etcd deletes the key and another candidate may take it.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import requests

log = logging.getLogger(__name__)


class EtcdError(RuntimeError):
    """etcd could not be asked or gave no usable answer."""


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _unb64(s: str | None) -> bytes:
    return base64.b64decode(s) if s else b""


def prefix_end(prefix: str) -> bytes:
    """etcd's range_end for "every key starting with prefix" (its last byte + 1)."""
    b = bytearray(prefix.encode())
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b"\0"  # every key
    b[-1] += 1
    return bytes(b)


@dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int  # 0: none

    def json(self) -> Any:
        """The value as JSON; ValueError when it is not."""
        return json.loads(self.value)

    @classmethod
    def from_wire(cls, kv: dict) -> KV:
        return cls(_unb64(kv.get("key")).decode("utf-8", "replace"), _unb64(kv.get("value")),
                   int(kv.get("create_revision", 0)), int(kv.get("mod_revision", 0)),
                   int(kv.get("lease", 0)))


# --- compares and operations of a txn (the gateway's JSON shapes) -------------------------------
def created_never(key: str) -> dict:
    """Compare: the key does not exist (its create_revision is 0)."""
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def held_by_lease(key: str, lease: int) -> dict:
    """Compare: the key exists under this lease (an expired lease has deleted it)."""
    return {"key": _b64(key), "target": "LEASE", "result": "EQUAL", "lease": str(lease)}


def modified_at(key: str, mod_revision: int) -> dict:
    """Compare: nobody wrote the key since it was read at mod_revision."""
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL",
            "mod_revision": str(mod_revision)}


def put_op(key: str, value: Any, lease: int = 0) -> dict:
    body = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode()
    op = {"key": _b64(key), "value": _b64(body)}
    if lease:
        op["lease"] = str(lease)
    return {"request_put": op}


def delete_op(key: str) -> dict:
    return {"request_delete_range": {"key": _b64(key)}}


class Etcd:
    """A small etcd v3 client over the JSON gateway; one per thread (one requests.Session)."""

    def __init__(self, endpoint: str, timeout_s: float = 2.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        self._session = requests.Session()

    def _call(self, path: str, body: dict) -> dict:
        try:
            r = self._session.post(self.endpoint + path, json=body, timeout=self.timeout_s)
        except requests.RequestException as e:
            raise EtcdError(f"etcd at {self.endpoint} unreachable: {type(e).__name__}: {e}") \
                from None
        try:
            out = r.json()
        except ValueError:
            raise EtcdError(f"etcd {path}: HTTP {r.status_code}, not JSON: "
                            f"{r.text[:200]!r}") from None
        if not isinstance(out, dict):
            raise EtcdError(f"etcd {path}: expected a JSON object, got {type(out).__name__}")
        if r.status_code != 200 or "error" in out:
            raise EtcdError(f"etcd {path}: HTTP {r.status_code}: "
                            f"{out.get('message') or out.get('error')}")
        return out

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (lease id, the TTL etcd granted, which may be above the one asked)."""
        out = self._call("/v3/lease/grant", {"TTL": str(int(ttl_s))})
        if out.get("error") or "ID" not in out:
            raise EtcdError(f"lease not granted: {out}")
        return int(out["ID"]), int(out.get("TTL", ttl_s))

    def keepalive(self, lease: int) -> int:
        """Renew the lease; its TTL now, 0 when it has expired (etcd deleted its keys)."""
        out = self._call("/v3/lease/keepalive", {"ID": str(lease)})
        result = out.get("result")
        if not isinstance(result, dict):
            raise EtcdError(f"lease keepalive: unexpected answer {out}")
        return int(result.get("TTL", 0))

    def revoke(self, lease: int) -> None:
        self._call("/v3/lease/revoke", {"ID": str(lease)})

    def get(self, key: str) -> KV | None:
        kvs = self._call("/v3/kv/range", {"key": _b64(key)}).get("kvs") or []
        return KV.from_wire(kvs[0]) if kvs else None

    def range_prefix(self, prefix: str) -> list[KV]:
        out = self._call("/v3/kv/range", {"key": _b64(prefix),
                                          "range_end": _b64(prefix_end(prefix))})
        return [KV.from_wire(kv) for kv in out.get("kvs") or []]

    def put(self, key: str, value: Any, lease: int = 0) -> None:
        self._call("/v3/kv/put", put_op(key, value, lease)["request_put"])

    def txn(self, compare: list[dict], success: list[dict],
            failure: list[dict] | None = None) -> tuple[bool, dict]:
        """One atomic transaction: (whether every compare held, the raw answer)."""
        out = self._call("/v3/kv/txn", {"compare": compare, "success": success,
                                        "failure": failure or []})
        return bool(out.get("succeeded", False)), out  # proto3 JSON leaves out a false

    def close(self) -> None:
        self._session.close()


class LeaderLease:
    """Campaign for ``key`` under a lease of ``ttl_s`` seconds; :meth:`campaign` is called
    periodically (every third of the TTL or more often) and says whether this candidate leads.

    Being leader means: the key exists, holding this candidate's value, under its lease, and the
    lease was renewed less than its TTL ago by the local monotonic clock. Anything that acts as
    leader also puts :meth:`guard` into its etcd transaction, so that a write from a leader that
    lost its lease (a pause longer than the TTL) fails in etcd rather than trusting the local
    clock. Errors talking to etcd never raise out of :meth:`campaign`: they end leadership.
    """

    def __init__(self, etcd: Etcd, key: str, identity: dict[str, Any], ttl_s: int) -> None:
        self.etcd = etcd
        self.key = key
        self.id = f"{identity.get('name', 'candidate')}-{uuid.uuid4().hex[:12]}"
        self.identity = {**identity, "id": self.id}
        self.ttl_s = ttl_s
        self.lease = 0
        self.granted_ttl = ttl_s
        self._renewed_at = float("-inf")
        self.leading = False
        self.leader: dict[str, Any] | None = None  # who leads, as the key says
        self.leader_revision = 0  # the key's create_revision: one per term
        self.error: str | None = None

    def _renew(self) -> None:
        if self.lease:
            sent = time.monotonic()
            if self.etcd.keepalive(self.lease) > 0:
                self._renewed_at = sent
                return
            log.warning("lease %x expired: leadership (if any) is lost", self.lease)
            self.lease = 0
        sent = time.monotonic()
        self.lease, self.granted_ttl = self.etcd.grant(self.ttl_s)
        self._renewed_at = sent

    def campaign(self) -> bool:
        was = self.leading
        try:
            self._renew()
            ok, out = self.etcd.txn(
                [created_never(self.key)],
                [put_op(self.key, {**self.identity, "since": time.time()}, self.lease)],
                [{"request_range": {"key": _b64(self.key)}}])
            if ok:
                kv = self.etcd.get(self.key)
            else:
                kvs = out["responses"][0]["response_range"].get("kvs") or []
                kv = KV.from_wire(kvs[0]) if kvs else None
            self.leader = kv.json() if kv is not None else None
            self.leader_revision = kv.create_revision if kv is not None else 0
            self.leading = kv is not None and kv.lease == self.lease \
                and isinstance(self.leader, dict) and self.leader.get("id") == self.id
            self.error = None
        except (EtcdError, KeyError, IndexError, ValueError, TypeError) as e:
            self.leading, self.error = False, f"{type(e).__name__}: {e}"
        if self.leading and not self.valid():  # renewed too late to still count
            self.leading = False
        if was != self.leading:
            log.warning("%s leadership of %s (%s)", "took" if self.leading else "lost",
                        self.key, self.id if self.leading else self.error or self.leader)
        return self.leading

    def valid(self) -> bool:
        """Still within the TTL of the last renewal (local monotonic clock)."""
        return time.monotonic() - self._renewed_at < self.granted_ttl

    def guard(self) -> dict:
        """The compare that makes a txn succeed only while this candidate holds the key."""
        return held_by_lease(self.key, self.lease)

    def resign(self) -> None:
        """Give the key up at once (a clean stop): revoking the lease deletes it."""
        if self.lease:
            try:
                self.etcd.revoke(self.lease)
            except EtcdError as e:
                log.info("could not revoke lease %x (it expires by itself): %s", self.lease, e)
        self.lease, self.leading = 0, False


class SessionLease:
    """A lease kept alive by whoever calls :meth:`refresh` (the sweep loop): keys written under
    it vanish when that caller stops, so "the key exists" means "the caller is alive"."""

    def __init__(self, etcd: Etcd, ttl_s: int) -> None:
        self.etcd = etcd
        self.ttl_s = ttl_s
        self.lease = 0

    def refresh(self) -> int:
        """The live lease id, renewed or granted anew; raises EtcdError."""
        if self.lease and self.etcd.keepalive(self.lease) > 0:
            return self.lease
        self.lease = self.etcd.grant(self.ttl_s)[0]
        return self.lease

    def revoke(self) -> None:
        if self.lease:
            try:
                self.etcd.revoke(self.lease)
            except EtcdError:
                pass
            self.lease = 0
