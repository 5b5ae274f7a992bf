"""Incident bundles: the evidence an eviction destroys, kept before the kill.

Before a kill (and, on a helper thread, when a hang, mismatch or network fault is confirmed)
:class:`Bundles` fetches the stacks and Flight Recorder dumps of the culprit's group and its
collective peers, each bounded by ``--bundle-timeout``, and writes them with the finding, view and
decision as one ``<id>.tar.gz`` indexed in the audit log. A rank that does not answer, answers
garbage or is over ``--bundle-ranks`` is named in the manifest; a failed write is logged. Nothing
here raises into the enforcer.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sqlite3
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from ..analysis import bundle as layout  # the bundle format lightkeeper analyze reads
from ..config import BundleConfig, ConfigError, MonitorConfig
from ..evidence.view import ClusterView
from ..poll.poller import Poller, judge_body
from ..poll.torch_target import base_url, torch_url
from ..store import Store

log = logging.getLogger(__name__)

MAX_STACKS_BYTES = 4 << 20  # a rank's stacks are KB; past this, not parsed before the kill
BUSY_RETRY_S = 0.3  # a rank dumping for someone else (503) is asked again this often
# a rank refusing reads beyond its paced ones (429) says Retry-After: 1 (docs/worker_server.md)
REFUSED_RETRY_S = 1.0
AGAIN = {503: BUSY_RETRY_S, 429: REFUSED_RETRY_S}  # status -> asked again after

CONFIRM_KINDS = ("hang", "mismatch", "network")  # bundled when confirmed, evicted or not
_ENCODE = msgspec.json.Encoder()


def _encode(doc: Any) -> bytes:
    try:
        return _ENCODE.encode(doc)
    except (TypeError, msgspec.EncodeError):  # a value msgspec does not know: as a string
        return json.dumps(doc, default=str).encode()


def _named_ranks(ev: dict[str, Any]) -> list[int]:
    """The ranks a finding's evidence names beside its culprits (waiters, a mismatch's other
    variants)."""
    found = list(ev.get("waiting_ranks") or [])
    analysis = ev.get("analysis")
    for a in analysis if isinstance(analysis, list) else [analysis]:
        if isinstance(a, dict):
            found += list(a.get("waiting_ranks") or [])
            found += [x for v in a.get("variants") or [] for x in v.get("ranks") or []]
    return [r for r in found if isinstance(r, int)]


def _rank_row(r: Any, role: str) -> dict[str, Any]:
    s = r.state or {}
    return {"rank": r.rank, "url": r.url, "replica_group": r.replica_group,
            "group_rank": s.get("group_rank"), "host": s.get("host"), "pid": s.get("pid"),
            "replica_id": s.get("replica_id"), "role": role}


def _torch_only(r: Any) -> bool:
    """A rank read through torch's own debug server alone (no Lightkeeper endpoint)."""
    return isinstance(r.state, dict) and "torch_only" in r.state


def view_json(view: ClusterView, evidence: ClusterView | None,
              lighthouse: tuple[Any, str | None] = (None, "not read")) -> dict[str, Any]:
    """The verified view as the monitor acted on it: every group and rank, each rank's
    verdict against the Lighthouse, the quorum the verified ranks report; and the Lighthouse's
    own status as last read (``lighthouse``: the status and why it was not read), each group
    with its heartbeat's age then: whether torchft still heard a group the ranks did not."""
    status, error = lighthouse
    beats = status.heartbeats if status is not None else {}
    ev = evidence or view
    in_quorum = {g.replica_group for g in ev.in_quorum()}
    groups = []
    for g, gv in sorted(view.groups.items()):
        verified = ev.groups.get(g)
        ranks = []
        for r in gv.ranks:
            s = r.state or {}
            ranks.append({**_rank_row(r, "member"), "reachable": r.reachable,
                          "reason": r.reason, "error": r.error, "step": s.get("step"),
                          "phase": s.get("phase"), "phase_since": s.get("phase_since"),
                          "quorum_id": s.get("quorum_id"),
                          "verification": r.trust.to_dict() if r.trust is not None else None})
        rid = verified.replica_id if verified else None
        groups.append({"replica_group": g, "replica_id": rid,
                       "status": gv.status, "step": gv.step, "in_quorum": g in in_quorum,
                       "heartbeat_age_s": beats.get(rid),
                       "evidence_ranks": len(verified.ranks) if verified else 0, "ranks": ranks})
    return {"at": view.at, "quorum_id": ev.quorum_id,
            "quorum_participants": ev.quorum_participants(),
            "reachable_fraction": view.reachable_fraction, "groups": groups,
            "lighthouse": {"error": error, **(status.to_dict() if status is not None else {})}}


def choose_ranks(view: ClusterView, evidence: ClusterView | None, replica_group: int | None,
                 culprits: list[int], finding_evidence: dict[str, Any] | None,
                 most: int, replica_id: str | None = None
                 ) -> tuple[list[tuple[Any, str]], list[dict[str, Any]]]:
    """(ranks to ask with their role, ranks left out over ``most``): the culprit's group, the
    ranks the finding names, then the other quorum groups' ranks at the culprits' group rank
    (the other side of torchft's cross-group collective). Never a rank of the group that an
    incarnation other than ``replica_id`` holds now."""
    by_rank = {r.rank: r for r in view.ranks.values() if r.rank is not None and not r.superseded}
    chosen: dict[str, tuple[Any, str]] = {}

    def add(r: Any, role: str) -> None:
        if r is not None and r.url not in chosen and not (
                replica_id and r.replica_group == replica_group
                and r.replica_id not in (None, replica_id)):
            chosen[r.url] = (r, role)

    gv = view.groups.get(replica_group) if replica_group is not None else None
    for r in gv.ranks if gv is not None else ():
        add(r, "culprit" if r.rank in culprits else "culprit_group")
    for r in culprits:
        add(by_rank.get(r), "culprit")
    for r in _named_ranks(finding_evidence or {}):
        add(by_rank.get(r), "peer")
    # no culprit named (a manual eviction): the whole group's group ranks
    group_ranks = {(by_rank[r].state or {}).get("group_rank") for r in culprits if r in by_rank} \
        or {(r.state or {}).get("group_rank") for r in (gv.ranks if gv is not None else ())}
    for g in sorted(x.replica_group for x in (evidence or view).in_quorum()):
        if g == replica_group or g not in view.groups:
            continue
        for r in view.groups[g].ranks:
            if (r.state or {}).get("group_rank") in group_ranks:
                add(r, "peer")
    rows = list(chosen.values())
    over = [{**_rank_row(r, role), "why": f"over --bundle-ranks {most}"}
            for r, role in rows[most:]]
    return rows[:most], over


def _asks(ranks: list[tuple[Any, str]]) -> list[tuple[str, str, str, str, str]]:
    """(rank URL, ``stacks``/``fr``, URL asked, query, form: ``json``/``dump``/``text``) per
    ask. A torch-only rank is asked only its ``dump_traceback`` handler (:func:`_torch_dump`)."""
    asks = []
    for r, _ in ranks:
        if not r.reachable and r.reason == "bad_response":
            continue  # what answers at its address is not this rank (a port bound again)
        if _torch_only(r):
            url = r.state.get("stacks_url")
            # a handler of this target's own server, as the poller names it: never an address
            # the rank's answer chose (fetched into a bundle anyone may download)
            if isinstance(url, str) and url.startswith(base_url(r.url) + "/handler/"):
                asks.append((r.url, "stacks", torch_url(url), "", "text"))
            continue
        base = r.url.rstrip("/")
        asks += [(r.url, "stacks", base + "/v1/stacks", "?format=json", "json"),
                 (r.url, "fr", base + "/v1/fr_trace", "", "dump")]
    return asks


def _torch_dump(r: Any, dump: Mapping[str, Any] | None, row: dict[str, Any]
                ) -> tuple[bytes | None, str]:
    """A torch-only rank's dump as the monitor last read it (its ``dump_time_ns`` in ``row``
    as ``fr_trace_at``), or why there is none."""
    row["torch_only"] = True
    if dump is None or dump.get("rank") != r.rank:
        said = (r.state.get("torch_only") or {}).get("flight_recorder")
        return None, f"none read from its torch server in the monitor's last sweep ({said})"
    at = dump.get("dump_time_ns")
    row["fr_trace_at"] = at / 1e9 if isinstance(at, int) else None
    return _encode(dump), "ok"


class _Recorder(msgspec.Struct):
    """What every Flight Recorder dump holds, entries or not (analyze needs it)."""

    version: str


_RECORDER = msgspec.json.Decoder(_Recorder)


def looks_like_dump(body: bytes) -> bool:
    """A JSON object naming ``entries``: kept as the rank sent it (``lightkeeper analyze``
    judges it whole, and says so in its ``errors`` when it is broken after all); without
    them, one with a ``version`` string: torch leaves ``entries`` out of an empty recorder's
    dump (a rank that has run no collective yet), so this is read whole (no dump is large
    without them)."""
    if bytes(body[:64]).lstrip()[:1] != b"{":
        return False
    if b'"entries"' in body:
        return True
    try:
        _RECORDER.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return False
    return True


class BundleStore:
    """Where bundles are written, listed and read back from. Compressed at zlib's fastest
    level: the kill waits for the write, and Flight Recorder JSON shrinks ~8x even so."""

    def __init__(self, cfg: BundleConfig, directory: str, store: Store,
                 clock=time.time) -> None:
        # absolute: the index keeps each file's path, read again after a restart from elsewhere
        directory = os.path.abspath(directory)
        self.cfg, self.dir, self.store, self.clock = cfg, directory, store, clock
        try:  # at start-up, not at the first kill
            os.makedirs(directory, exist_ok=True)
            if not os.access(directory, os.W_OK | os.X_OK):
                raise PermissionError("not writable")
        except OSError as e:
            raise ConfigError(f"--bundle-dir {directory}: {e}") from None
        self.error: str | None = None
        self._lock = threading.Lock()  # one write and prune at a time (the loop, its helper)

    def new_id(self, trigger: str, kind: str | None, replica_group: int | None) -> str:
        """A fresh, file-safe id (``20261125T150102Z-evict-hang-g2``), suffixed when taken
        (also by another monitor sharing the folder)."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.clock()))
        base = f"{stamp}-{trigger}-{kind or 'none'}-g{'job' if replica_group is None else replica_group}"
        base = "".join(c if c.isalnum() or c in "_.-" else "_" for c in base)[:120]
        out, n = base, 1
        while self.store.bundles(bundle_id=out) or \
                os.path.exists(os.path.join(self.dir, out + layout.SUFFIX)):
            n += 1
            out = f"{base}-{n}"
        return out

    def write(self, bundle_id: str, manifest: dict[str, Any], files: list[tuple[str, bytes]],
              row: dict[str, Any]) -> str | None:
        """Write ``<id>.tar.gz`` (``manifest.json`` first, then ``files``: (name inside the top
        folder, bytes)), index it, prune; the path, or None when it could not be written."""
        if not layout.ID_RE.match(bundle_id):
            raise ValueError(f"bad bundle id {bundle_id!r}")
        path = os.path.join(self.dir, bundle_id + layout.SUFFIX)
        with self._lock:
            try:
                os.makedirs(self.dir, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=f".{bundle_id}.", dir=self.dir)
                try:
                    with os.fdopen(fd, "wb") as raw, \
                            tarfile.open(fileobj=raw, mode="w:gz", compresslevel=1) as tar:
                        mtime = self.clock()
                        members = [(layout.MANIFEST, json.dumps(manifest, indent=1,
                                                         default=str).encode())] + files
                        for name, data in members:
                            info = tarfile.TarInfo(f"{bundle_id}/{name}")
                            info.size, info.mtime, info.mode = len(data), int(mtime), 0o644
                            tar.addfile(info, io.BytesIO(data))
                    os.replace(tmp, path)  # whole or not at all
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
                try:
                    self.store.add_bundle({**row, "id": bundle_id, "path": path,
                                           "bytes": os.path.getsize(path)})
                except sqlite3.Error:  # unindexed it would never be listed nor pruned
                    os.unlink(path)
                    raise
                self.error = None
            except (OSError, tarfile.TarError, sqlite3.Error) as e:
                self.error = f"cannot write bundle {bundle_id}: {e}"
                log.warning("%s", self.error)
                return None
            self._prune()
        return path

    def prune(self) -> list[str]:
        """At start-up: also delete the partial files a killed monitor's writes left (one
        touched in the last 10 minutes may be another monitor's)."""
        with self._lock:
            for e in os.scandir(self.dir):
                with contextlib.suppress(OSError):
                    if e.name.startswith(".") and layout.ID_RE.match(e.name[1:]) and \
                            e.stat().st_mtime < self.clock() - 600:
                        os.unlink(e.path)
            return self._prune()

    def _prune(self) -> list[str]:
        """Delete bundles older than ``keep_s``, then the oldest while all weigh more than
        ``total_bytes`` (the newest stays: its decision names it); the ids deleted."""
        rows = self.store.bundles(limit=1_000_000)[::-1]  # oldest written first
        cutoff = self.clock() - self.cfg.keep_s
        total = sum(r["bytes"] for r in rows)
        gone = []
        for i, r in enumerate(rows):
            if r["at"] >= cutoff and (total <= self.cfg.total_bytes or i == len(rows) - 1):
                continue
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
        if not isinstance(bundle_id, str) or not layout.ID_RE.match(bundle_id):
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


class Bundles:
    """Fetch, assemble and keep incident bundles; ``store`` lists and serves them."""

    def __init__(self, cfg: MonitorConfig, store: Store,
                 clock: Callable[[], float] = time.time,
                 torch_dumps: Callable[[], Mapping[str, Mapping[str, Any]]] = dict,
                 lighthouse: Callable[[], tuple[Any, str | None]] = lambda: (None, "not read")
                 ) -> None:
        """``torch_dumps``: URL -> the dump the monitor last read from each torch-only rank;
        ``lighthouse``: the Lighthouse's status as last read, and why it was not read."""
        self.cfg, self.bc, self.clock, self.torch_dumps = cfg, cfg.bundles, clock, torch_dumps
        self.lighthouse = lighthouse
        directory = self.bc.directory(cfg.state_path) if self.bc.enabled else None
        self.store = BundleStore(self.bc, directory, store, clock) if directory else None
        self._poller: Poller | None = None
        self._lock = threading.Lock()
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="lightkeeper-bundles")
        if self.store is not None:
            try:
                self.store.prune()  # retention holds across restarts too
            except Exception:
                log.exception("cannot prune incident bundles")

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def _get_poller(self) -> Poller:
        with self._lock:
            if self._poller is None:
                # every rank's two asks at once: queued ones would wait past --bundle-timeout
                self._poller = Poller(self.bc.timeout_s, 2 * self.bc.max_ranks,
                                      max_bytes=self.cfg.max_fr_bytes)
            return self._poller

    def capture(self, trigger: str, view: ClusterView, evidence: ClusterView | None,
                finding: dict[str, Any] | None, finding_id: int | None,
                decision: dict[str, Any] | None, related: list[dict[str, Any]]) -> dict | None:
        """Fetch and write one bundle now (at most ``--bundle-timeout`` waiting for ranks);
        ``{"id", "seconds", ...}`` or None when disabled or it could not be written. Never
        raises."""
        if self.store is None:
            return None
        t0 = time.perf_counter()
        try:
            return self._capture(trigger, view, evidence, finding or {}, finding_id, decision,
                                 related, t0)
        except Exception:
            log.exception("incident bundle failed (the action goes on)")
            return None

    def capture_later(self, trigger: str, view: ClusterView, evidence: ClusterView | None,
                      finding: dict[str, Any], finding_id: int | None,
                      related: list[dict[str, Any]]) -> None:
        """The same on the helper thread: a confirmation never delays the sweep."""
        if self.store is None:
            return
        try:
            self._helper.submit(self.capture, trigger, view, evidence, finding, finding_id,
                                None, related)
        except RuntimeError:  # closed: the monitor is stopping
            log.info("monitor stopping: no bundle for finding %s", finding_id)

    def _capture(self, trigger: str, view: ClusterView, evidence: ClusterView | None,
                 finding: dict[str, Any], finding_id: int | None,
                 decision: dict[str, Any] | None, related: list[dict[str, Any]],
                 t0: float) -> dict | None:
        assert self.store is not None
        d = decision or {}
        kind = finding.get("kind") or d.get("reason")
        group = finding.get("replica_group")
        if group is None:
            group = d.get("replica_group")
        culprits = [int(r) for r in finding.get("ranks") or [] if isinstance(r, int)]
        rid = finding.get("replica_id") or d.get("replica_id")
        ranks, over = choose_ranks(view, evidence, group, culprits, finding.get("evidence"),
                                   self.bc.max_ranks, rid)
        started = self.clock()
        polls = self._fetch(_asks(ranks))
        fetched_s = time.perf_counter() - t0
        torch_dumps = self.torch_dumps() if any(_torch_only(r) for r, _ in ranks) else {}
        rows, candidates = [], []
        for r, role in ranks:
            row, torch_only = _rank_row(r, role), _torch_only(r)
            # what a rank was not asked for (a reachable one is asked all it serves)
            why = "no dump_traceback handler" if r.reachable \
                else f"not asked: {r.reason}: {r.error}"
            st, st_why = polls.get((r.url, "stacks"), (None, why))
            if torch_only:
                fr, fr_why = _torch_dump(r, torch_dumps.get(r.url), row)
            else:
                fr, fr_why = polls.get((r.url, "fr"), (None, why))
            rows.append({**row, "stacks": st_why, "fr_trace": fr_why})
            if r.rank is None:
                continue
            if st is not None:  # torch's traceback is text
                ext = "txt" if torch_only else "json"
                candidates.append((layout.rank_file(layout.STACKS_DIR, r.rank, ext), bytes(st),
                                   role))
            if fr is not None:
                candidates.append((layout.rank_file(layout.FR_DIR, r.rank), bytes(fr), role))
        # a culprit no process of its incarnation holds now (replaced, its target gone): as the
        # finding last saw it
        held = {x["rank"] for x in (*rows, *over)}
        for c in (finding.get("evidence") or {}).get("culprits") or ():
            if isinstance(c, dict) and c.get("rank") in culprits and c.get("rank") not in held:
                gone = f"gone: no process of {rid} holds rank {c.get('rank')} now (last seen on " \
                       f"{c.get('host')}, pid {c.get('pid')})"
                rows.append({**{k: c.get(k) for k in ("rank", "url", "group_rank", "host", "pid")},
                             "replica_group": group, "replica_id": rid, "role": "culprit",
                             "gone": True, "stacks": gone, "fr_trace": gone})
        bundle_id = self.store.new_id(trigger, kind, group)
        candidates += [(layout.FINDINGS, _encode({"finding": {**finding, "id": finding_id},
                                                  "related": related}), "head"),
                       ("view.json", _encode(view_json(view, evidence, self.lighthouse())),
                        "head")]
        # under the size cap the culprit's group comes first, stacks before dumps
        order = {"head": 0, "culprit": 1, "culprit_group": 1, "peer": 2}
        candidates.sort(key=lambda x: (order[x[2]], x[0].startswith(layout.FR_DIR + "/")))
        files, left_out, size = [], [], 0
        for name, data, _ in candidates:
            if size + len(data) > self.bc.max_bytes:
                left_out.append({"what": name, "bytes": len(data),
                                 "why": f"over --bundle-max-bytes {self.bc.max_bytes}"})
                continue
            files.append((name, data))
            size += len(data)
        manifest = {
            "format": layout.FORMAT, "version": layout.VERSION, "id": bundle_id,
            "job": self.cfg.job,
            "trigger": trigger, "written_before_kill": trigger == "evict",
            "created_at": started, "kind": kind, "replica_group": group,
            "replica_id": rid, "culprit_ranks": sorted(culprits),
            "culprit_hosts": (finding.get("evidence") or {}).get("culprit_hosts") or [],
            "finding_id": finding_id, "decision": decision,
            "fetch": {"timeout_s": self.bc.timeout_s, "seconds": round(fetched_s, 4),
                      "ranks_asked": len(ranks)},
            "ranks": rows, "not_asked": over, "left_out": left_out,
            "files": [name for name, _ in files]}
        summary = {"culprit_ranks": manifest["culprit_ranks"],
                   "ranks_asked": len(ranks),
                   "ranks_complete": sum(1 for x in rows if x["stacks"] == x["fr_trace"] == "ok"),
                   "not_fetched": [{"rank": x["rank"], "stacks": x["stacks"],
                                    "fr_trace": x["fr_trace"]} for x in rows
                                   if x["stacks"] != "ok" or x["fr_trace"] != "ok"],
                   "not_asked": len(over), "left_out": len(left_out),
                   "fetch_seconds": manifest["fetch"]["seconds"]}
        path = self.store.write(bundle_id, manifest, files, {
            "at": started, "trigger": trigger, "kind": kind, "replica_group": group,
            "replica_id": rid, "finding_id": finding_id,
            "decision_id": d.get("id"), "summary": summary})
        if path is None:
            return None
        took = time.perf_counter() - t0
        log.info("incident bundle %s: %d rank(s) asked, %d complete, fetched in %.2fs, written "
                 "in %.2fs", bundle_id, len(ranks), summary["ranks_complete"], fetched_s, took)
        return {"id": bundle_id, "seconds": round(took, 4), **summary}

    def _fetch(self, asks: list[tuple[str, str, str, str, str]]
               ) -> dict[tuple[str, str], tuple[bytes | None, str]]:
        """Every ask at once, each ended at ``--bundle-timeout``: (rank URL, ``stacks``/``fr``)
        -> (the bytes as sent or None, ``ok`` or why not). Dumps are only sniffed, not parsed:
        the kill waits for this."""
        if not asks:
            return {}
        # each (URL, query) asked once: two ranks can name one address
        index = {k: i for i, k in enumerate(dict.fromkeys((a[2], a[3]) for a in asks))}
        urls = [u for u, _ in index]
        form = {index[(a[2], a[3])]: a[4] for a in asks}
        queries = [q for _, q in index]
        rows: list[tuple] = []
        again: dict[int, tuple] = {}
        busy: list[threading.Thread] = []
        deadline = time.monotonic() + self.bc.timeout_s

        def on_rows(batch: list[tuple]) -> None:
            rows.extend(batch)
            for r in batch:  # a 503 or 429 is asked again, not after the slowest rank
                if r[5] in AGAIN:
                    t = threading.Thread(target=self._ask_busy, daemon=True,
                                         args=(r[0], urls[r[0]], queries[r[0]], deadline, again,
                                               r[5], r[6] or 0.0),
                                         name="lightkeeper-bundles-busy")
                    try:  # raised on the poller's loop, it would never end the sweep
                        t.start()
                    except RuntimeError as e:  # no thread to spare (pids limit): answer kept
                        log.warning("incident bundle: %s not asked again: %s", urls[r[0]], e)
                        continue
                    busy.append(t)

        self._get_poller().sweep(urls, "", self.bc.timeout_s, self.cfg.max_fr_bytes,
                                 on_rows=on_rows, per_batch=1, queries=queries)
        for t in busy:  # each bounded by the deadline
            t.join()
        rows = [again.get(r[0], r) for r in rows]
        got: dict[int, tuple[bytes | None, str]] = {}
        for i, ok, body, reason, error, _status, latency, _at in rows:
            if not ok:
                got[i] = (None, f"{reason}: {error}" if error else str(reason))
            elif form[i] == "json" and len(body) > MAX_STACKS_BYTES:
                # parsed on the kill's path: a rank's few KB, never a garbage body's seconds
                got[i] = (None, f"bad_response: {len(body)} bytes of stacks, over "
                                f"{MAX_STACKS_BYTES >> 20} MiB: not read")
            elif form[i] == "json":
                p = judge_body(urls[i], body, latency)
                got[i] = (body, "ok") if p.ok else (None, f"{p.reason}: {p.error}")
            elif form[i] == "text" or looks_like_dump(body):
                got[i] = (body, "ok")
            else:
                got[i] = (None, "bad_response: not a Flight Recorder dump (a JSON object with "
                          "entries or a version)")
        return {(a[0], a[1]): got.get(index[(a[2], a[3])], (None, "not answered"))
                for a in asks}

    def _ask_busy(self, i: int, url: str, query: str, deadline: float,
                  out: dict[int, tuple], status: int, latency: float) -> None:
        """Ask a rank that was dumping for someone else (503) again every ``BUSY_RETRY_S``, or
        that refused the read (429) after its ``Retry-After``, until it answers or
        ``deadline``; its last answer goes in ``out[i]``. A retry cut short by the time left
        says nothing truer than "busy": not kept."""
        # Retry-After counts from the answer's making: a 429 held HOLD_S before it is sent has
        # waited its second already
        while deadline - time.monotonic() > (wait := max(0.0, AGAIN[status] - latency)):
            time.sleep(wait)
            rows: list[tuple] = []
            self._get_poller().sweep([url], "", deadline - time.monotonic(),
                                     self.cfg.max_fr_bytes, on_rows=rows.extend,
                                     queries=[query])
            if not rows or rows[0][3] == "timeout":
                return
            out[i] = (i, *rows[0][1:])
            status, latency = rows[0][5], rows[0][6] or 0.0
            if status not in AGAIN:
                return

    def close(self) -> None:
        """Let a bundle under way finish (bounded by the fetch timeout and a write)."""
        self._helper.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            if self._poller is not None:
                self._poller.close()
                self._poller = None
