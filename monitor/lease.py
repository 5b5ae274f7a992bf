"""etcd v3 through its JSON gateway, and one leader per key through an etcd lease.
:class:`EtcdError` means "do not know": act on nothing (docs/scaling.md, "The etcd protocol").
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

from http_serving import redact_url

log = logging.getLogger(__name__)


class EtcdError(RuntimeError):
    """etcd could not be asked or gave no usable answer; ``timed_out``: it did not answer in
    time (a hung etcd: asking again at once costs the timeout again)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


@dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int  # 0: none

    def json(self) -> Any:
        """The value as JSON, None when it is not (never acted on)."""
        try:
            return json.loads(self.value)
        except ValueError:
            return None

    @classmethod
    def from_wire(cls, kv: dict) -> KV:
        return cls(base64.b64decode(kv.get("key") or "").decode("utf-8", "replace"),
                   base64.b64decode(kv.get("value") or ""),
                   int(kv.get("create_revision", 0)), int(kv.get("mod_revision", 0)),
                   int(kv.get("lease", 0)))


def created_never(key: str) -> dict:
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def leased_by(key: str, lease: int) -> dict:
    """Compare: the key is held under ``lease`` (an absent key holds none)."""
    return {"key": _b64(key), "target": "LEASE", "result": "EQUAL", "lease": str(lease)}


def modified_at(key: str, mod_revision: int) -> dict:
    """Compare: nobody wrote the key since it was read at mod_revision."""
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL",
            "mod_revision": str(mod_revision)}


def _put(key: str, value: Any, lease: int = 0) -> dict:
    op = {"key": _b64(key), "value": _b64(json.dumps(value, sort_keys=True))}
    if lease:
        op["lease"] = str(lease)
    return op


class Etcd:
    """An etcd v3 client, one per thread; every call raises EtcdError without a usable answer."""

    def __init__(self, endpoint: str, timeout_s: float = 2.0) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        self._session = requests.Session()

    def call(self, path: str, body: dict) -> dict:
        try:
            r = self._session.post(self.endpoint + path, json=body, timeout=self.timeout_s)
        except requests.RequestException as e:
            # the type only: a repr names objects by address, and each new text is logged again
            # requests says ConnectionError for a read timeout while the body comes
            raise EtcdError(f"etcd at {redact_url(self.endpoint)} unreachable: "
                            f"{type(e).__name__}", isinstance(e, requests.Timeout)
                            or "timed out" in str(e).lower()) from None
        try:
            out = r.json()
        except ValueError:
            out = None
        if r.status_code != 200 or not isinstance(out, dict) or "error" in out:
            raise EtcdError(f"etcd {path}: HTTP {r.status_code}: {r.text[:200]!r}")
        return out

    def get(self, key: str) -> KV | None:
        kvs = self.call("/v3/kv/range", {"key": _b64(key)}).get("kvs") or []
        return KV.from_wire(kvs[0]) if kvs else None

    def range_prefix(self, prefix: str) -> list[KV]:
        """Every key starting with ``prefix`` (which ends in ``/``)."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        out = self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(end)})
        return [KV.from_wire(kv) for kv in out.get("kvs") or []]

    def put(self, key: str, value: Any, lease: int = 0) -> None:
        self.call("/v3/kv/put", _put(key, value, lease))

    def put_if(self, compare: list[dict], key: str, value: Any,
               lease: int = 0) -> tuple[bool, dict]:
        """Put only if every compare holds, atomically: (whether it did, the raw answer)."""
        return self._txn(compare, {"request_put": _put(key, value, lease)})

    def delete_if(self, compare: list[dict], key: str) -> bool:
        return self._txn(compare, {"request_delete_range": {"key": _b64(key)}})[0]

    def _txn(self, compare: list[dict], op: dict) -> tuple[bool, dict]:
        out = self.call("/v3/kv/txn", {"compare": compare, "success": [op]})
        return bool(out.get("succeeded", False)), out  # proto3 JSON leaves out a false

    def close(self) -> None:
        self._session.close()


class SessionLease:
    """A lease kept alive by whoever calls :meth:`refresh` (the sweep loop): keys written under
    it vanish when that caller stops, so "the key exists" means "the caller is alive"."""

    def __init__(self, etcd: Etcd, ttl_s: int) -> None:
        self.etcd = etcd
        self.ttl_s = ttl_s
        self.lease = 0
        self.granted_ttl = ttl_s

    def refresh(self) -> int:
        """The live lease id, renewed or granted anew; raises EtcdError."""
        if self.lease:
            out = self.etcd.call("/v3/lease/keepalive", {"ID": str(self.lease)}).get("result")
            if not isinstance(out, dict):
                raise EtcdError(f"lease keepalive: unexpected answer {out!r}")
            if int(out.get("TTL", 0)) > 0:  # else expired: etcd deleted its keys
                return self.lease
        out = self.etcd.call("/v3/lease/grant", {"TTL": str(int(self.ttl_s))})
        if "ID" not in out:
            raise EtcdError(f"lease not granted: {out}")
        # etcd may grant more than asked: its minimum TTL
        self.lease, self.granted_ttl = int(out["ID"]), int(out.get("TTL", self.ttl_s))
        return self.lease

    def revoke(self) -> None:
        """Drop the lease and its keys now; an unreachable etcd lets it expire by itself."""
        if self.lease:
            try:
                self.etcd.call("/v3/lease/revoke", {"ID": str(self.lease)})
            except EtcdError as e:
                log.info("could not revoke lease %x (it expires by itself): %s", self.lease, e)
        self.lease = 0


class LeaderLease(SessionLease):
    """One leader per ``key``: :meth:`campaign` says whether this candidate holds it; a leader puts
    :meth:`guard` into its txn, so one paused past its TTL fails in etcd. Never raises."""

    def __init__(self, etcd: Etcd, key: str, identity: dict[str, Any], ttl_s: int) -> None:
        super().__init__(etcd, ttl_s)
        self.key = key
        self.id = f"{identity.get('name', 'candidate')}-{uuid.uuid4().hex[:12]}"
        self.identity = {**identity, "id": self.id}
        self._renewed_at = float("-inf")
        self.leading = False
        self.leader: dict[str, Any] | None = None  # who leads, as the key says
        self.leader_revision = 0  # the key's create_revision: one per term
        self.error: str | None = None

    def refresh(self) -> int:
        sent, old = time.monotonic(), self.lease
        lease = super().refresh()
        if old and lease != old:
            log.warning("lease %x expired: leadership (if any) is lost", old)
        self._renewed_at = sent
        return lease

    def campaign(self) -> bool:
        was = self.leading
        try:
            self.refresh()
            self.etcd.put_if([created_never(self.key)], self.key,
                             {**self.identity, "since": time.time()}, self.lease)
            kv = self.etcd.get(self.key)
            self.leader = kv.json() if kv is not None else None
            self.leader_revision = kv.create_revision if kv is not None else 0
            self.leading = kv is not None and kv.lease == self.lease and self.valid() \
                and isinstance(self.leader, dict) and self.leader.get("id") == self.id
            self.error = None
        except (EtcdError, ValueError, TypeError) as e:
            self.leading, self.error = False, f"{type(e).__name__}: {e}"
        if was != self.leading:
            log.warning("%s leadership of %s (%s)", "took" if self.leading else "lost",
                        self.key, self.id if self.leading else self.error or self.leader)
        return self.leading

    def keep(self) -> bool:
        """Between a leader's kills (each may take the kill's timeout): renewed once a third of
        the TTL passed; False when the lease lapsed meanwhile (leadership lost: stop acting).
        Raises EtcdError."""
        if time.monotonic() - self._renewed_at < self.granted_ttl / 3:
            return True
        old = self.lease
        return self.refresh() == old and self.valid()

    def valid(self) -> bool:
        """Renewed less than the TTL ago (local monotonic clock): a late renewal does not count."""
        return time.monotonic() - self._renewed_at < self.granted_ttl

    def guard(self) -> dict:
        """The compare that makes a txn succeed only while this candidate holds the key."""
        return leased_by(self.key, self.lease)

    def resign(self) -> None:
        """Give the key up at once (a clean stop): revoking the lease deletes it."""
        self.revoke()
        self.leading = False
