"""Incident bundles on disk: written whole or not at all, indexed in the audit log, capped and
aged out (``--bundle-*`` flags, monitor.config.BundleConfig).

Each bundle is one ``<id>.tar.gz`` in the bundle folder (by default ``incidents/`` beside
``--state``); the audit log's ``bundles`` table lists them. A write that fails (disk full, no
permission) is logged and returns None: keeping evidence never stops an eviction.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
import tempfile
import threading
import time
from typing import Any

from ..analysis.bundle import ID_RE, MANIFEST, SUFFIX
from ..config import BundleConfig
from ..store import Store

log = logging.getLogger(__name__)


class BundleStore:
    """Where bundles are written, listed and read back from. Compressed at zlib's fastest
    level: the kill waits for the write, and Flight Recorder JSON shrinks ~8x even so."""

    def __init__(self, cfg: BundleConfig, directory: str, store: Store,
                 clock=time.time) -> None:
        self.cfg, self.dir, self.store, self.clock = cfg, directory, store, clock
        self.error: str | None = None
        self._lock = threading.Lock()  # one write and prune at a time (the loop, its helper)

    def new_id(self, trigger: str, kind: str | None, replica_group: int | None) -> str:
        """A fresh id: UTC time, trigger, kind and group (``20261125T150102Z-evict-hang-g2``),
        suffixed when taken; a safe file name by construction (ID_RE)."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.clock()))
        base = f"{stamp}-{trigger}-{kind or 'none'}-g{'job' if replica_group is None else replica_group}"
        base = "".join(c if c.isalnum() or c in "_.-" else "_" for c in base)[:120]
        out, n = base, 1
        while self.store.bundles(bundle_id=out):
            n += 1
            out = f"{base}-{n}"
        return out

    def write(self, bundle_id: str, manifest: dict[str, Any], files: list[tuple[str, bytes]],
              row: dict[str, Any]) -> str | None:
        """Write ``<id>.tar.gz`` (``manifest.json`` first, then ``files``: (name inside the top
        folder, bytes)), index it, prune; the path, or None when it could not be written."""
        if not ID_RE.match(bundle_id):
            raise ValueError(f"bad bundle id {bundle_id!r}")
        path = os.path.join(self.dir, bundle_id + SUFFIX)
        with self._lock:
            try:
                os.makedirs(self.dir, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=f".{bundle_id}.", dir=self.dir)
                try:
                    with os.fdopen(fd, "wb") as raw, \
                            tarfile.open(fileobj=raw, mode="w:gz", compresslevel=1) as tar:
                        mtime = self.clock()
                        members = [(MANIFEST, json.dumps(manifest, indent=1,
                                                         default=str).encode())] + files
                        for name, data in members:
                            info = tarfile.TarInfo(f"{bundle_id}/{name}")
                            info.size, info.mtime, info.mode = len(data), int(mtime), 0o644
                            tar.addfile(info, io.BytesIO(data))
                    os.replace(tmp, path)  # whole or not at all
                except BaseException:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
                    raise
                size = os.path.getsize(path)
                self.store.add_bundle({**row, "id": bundle_id, "path": path, "bytes": size})
                self.error = None
            except (OSError, tarfile.TarError) as e:
                self.error = f"cannot write bundle {bundle_id}: {e}"
                log.warning("%s", self.error)
                return None
            self._prune()
        return path

    def prune(self) -> list[str]:
        with self._lock:
            return self._prune()

    def _prune(self) -> list[str]:
        """Delete bundles older than ``keep_s``, then the oldest while all weigh more than
        ``total_bytes``; the ids deleted."""
        rows = sorted(self.store.bundles(limit=1_000_000), key=lambda r: r["at"])
        cutoff = self.clock() - self.cfg.keep_s
        total = sum(r["bytes"] for r in rows)
        gone = []
        for r in rows:
            if r["at"] >= cutoff and total <= self.cfg.total_bytes:
                break
            try:
                os.unlink(r["path"])
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("cannot delete bundle %s: %s", r["id"], e)
                continue
            self.store.delete_bundle(r["id"])
            total -= r["bytes"]
            gone.append(r["id"])
        if gone:
            log.info("deleted %d old incident bundle(s): %s", len(gone), ", ".join(gone))
        return gone

    def list(self, limit: int = 100) -> list[dict[str, Any]]:
        """``GET /v1/incidents``: newest first, without the file's path."""
        return [{k: v for k, v in r.items() if k != "path"} for r in self.store.bundles(limit)]

    def path(self, bundle_id: str) -> str | None:
        """The file of a listed bundle (None: unknown id, or its file is gone). The id is looked
        up in the index, never joined to a path."""
        if not isinstance(bundle_id, str) or not ID_RE.match(bundle_id):
            return None
        rows = self.store.bundles(bundle_id=bundle_id)
        if not rows or not os.path.isfile(rows[0]["path"]):
            return None
        return rows[0]["path"]

    def by_link(self) -> dict[tuple[str, int], list[str]]:
        """(``finding``/``decision``, id) -> bundle ids: what ties a goodput incident to its
        bundles."""
        out: dict[tuple[str, int], list[str]] = {}
        for r in self.store.bundles(limit=10_000):
            for key in ("finding", "decision"):
                if r.get(f"{key}_id") is not None:
                    out.setdefault((key, r[f"{key}_id"]), []).append(r["id"])
        return out
