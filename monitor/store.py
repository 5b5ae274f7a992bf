"""The monitor's durable audit log in one SQLite file (``--state``): a restarted monitor never
evicts a ``replica_id`` again and continues the cooldown. Every write is committed (WAL)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from .locks import LockHeld, file_id, pid_lock
from .store_goodput import GoodputTables, goodput_json_text  # noqa: F401 (imported from here)
from .store_hosts import HostTables

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS findings (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL, replica_group INTEGER NOT NULL, replica_id TEXT,
    ranks TEXT NOT NULL, evidence TEXT NOT NULL,
    first_seen REAL NOT NULL, confirmed_at REAL, resolved_at REAL, resolution TEXT
);
CREATE TABLE IF NOT EXISTS decisions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL, replica_group INTEGER, replica_id TEXT,
    decision TEXT NOT NULL, reason TEXT NOT NULL, detail TEXT,
    finding_id INTEGER, finding TEXT,
    status TEXT, http_status INTEGER, confirmed_at REAL,
    source TEXT NOT NULL DEFAULT 'auto'
);
CREATE INDEX IF NOT EXISTS decisions_replica ON decisions (replica_id, decision);
CREATE TABLE IF NOT EXISTS goodput_state (
    id INTEGER PRIMARY KEY CHECK (id = 1), at REAL NOT NULL, data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS goodput_incidents (
    id INTEGER PRIMARY KEY, updated_at REAL NOT NULL, closed INTEGER NOT NULL, data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS goodput_intervals (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    start REAL NOT NULL, end REAL NOT NULL, replica_group INTEGER, cause TEXT NOT NULL,
    incident INTEGER, data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS hosts (
    host TEXT PRIMARY KEY, data TEXT NOT NULL, updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS host_offences (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    host TEXT NOT NULL, at REAL NOT NULL, kind TEXT NOT NULL, finding_id INTEGER,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS host_offences_host ON host_offences (host, at);
CREATE TABLE IF NOT EXISTS host_decisions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL, host TEXT NOT NULL,
    decision TEXT NOT NULL, reason TEXT NOT NULL, detail TEXT, evidence TEXT,
    source TEXT NOT NULL DEFAULT 'auto'
);
CREATE TABLE IF NOT EXISTS host_actions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    host TEXT NOT NULL, sink TEXT NOT NULL, op TEXT NOT NULL,
    status TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, next_at REAL,
    created_at REAL NOT NULL, updated_at REAL NOT NULL,
    detail TEXT, event TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS host_actions_due ON host_actions (status, next_at);
CREATE TABLE IF NOT EXISTS bundles (
    id TEXT PRIMARY KEY, at REAL NOT NULL, trigger TEXT NOT NULL, kind TEXT,
    replica_group INTEGER, replica_id TEXT, finding_id INTEGER, decision_id INTEGER,
    path TEXT NOT NULL, bytes INTEGER NOT NULL, summary TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS bundles_at ON bundles (at);
CREATE TABLE IF NOT EXISTS unreachable_ranks (
    url TEXT PRIMARY KEY, since REAL, state TEXT NOT NULL, trust TEXT
);
CREATE TABLE IF NOT EXISTS restart_marks (
    id INTEGER PRIMARY KEY CHECK (id = 1), data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS torch_paces (
    job TEXT PRIMARY KEY, data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS monitor_identity (
    id INTEGER PRIMARY KEY CHECK (id = 1), value TEXT NOT NULL
);
"""
# the file's format (SQLite's user_version; 0: from before it was kept): raised only by a change
# an older monitor would misread, which then refuses the file instead
FORMAT = 1
# columns added after a release: (table, column, declaration), added to an older file at start
ADDED_COLUMNS = (("decisions", "bundle", "TEXT"), ("decisions", "job", "TEXT"),
                 ("findings", "reconfirms", "INTEGER"), ("findings", "job", "TEXT"))
# kinds whose episode commits no step (a hang, a job-wide stall): a step past their finding's
# ends it; another kind's restart mark (a straggler steps on) starts at the next run's first look
STALLS = ("hang", "job_stall")

# a job-wide finding's replica_group (None) in the findings table, whose column is NOT NULL
JOB_GROUP = -1
# rows kept of each audit table (the oldest dropped, never one still needed): a file that grows
# for good fills its volume, and a kill that cannot be recorded is not sent
AUDIT_KEPT = 20_000
# a kill not judged yet: sent or maybe sent, no answer yet whether the replica left
UNJUDGED = "decision='evict' AND status IN ('sending', 'sent', 'interrupted')"
STILL_NEEDED = {"findings": "resolved_at IS NULL", "host_offences": "0", "host_decisions": "0",
                "decisions": UNJUDGED, "host_actions": "status IN ('pending', 'retrying')",
                "goodput_incidents": "NOT closed"}


def _group(stored: int | None) -> int | None:
    """A findings row's replica_group as a finding has it (JOB_GROUP: None, the whole job)."""
    return None if stored == JOB_GROUP else stored


def _setting(decision_id: int, fields: dict[str, Any]) -> tuple[str, tuple]:
    """The UPDATE of a decision's ``fields`` (column names Store.update_decision checked)."""
    return (f"UPDATE decisions SET {', '.join(f'{k}=?' for k in fields)} WHERE id=?",
            (*fields.values(), decision_id))


class StateTooNew(RuntimeError):
    """The state file is of a newer format than this monitor reads."""


class Store(GoodputTables, HostTables):
    """Thread-safe access to the audit log."""

    def __init__(self, path: str) -> None:
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._lock = threading.RLock()
        self.job: str | None = None  # the --job its decisions are written for (Enforcer)
        self._atomic = 0  # depth of atomic() blocks: their writes commit at the end
        self._relock: int | None = None  # the state's lock, taken again by _kept()
        # decision id -> fields a failed write left unwritten (a kill's outcome): read as if
        # written, and written first by the next write
        self._owed: dict[int, dict[str, Any]] = {}
        self._lock_file = f"{os.path.realpath(path)}.lock"
        self._lock_id = file_id(self._lock_file)  # held by the monitor (hold_state)
        try:
            self._open()
        except sqlite3.OperationalError as e:  # SQLite says "disk I/O error" for a full disk
            folder = os.path.dirname(os.path.abspath(path))
            if path != ":memory:" and not os.statvfs(folder).f_bavail:
                raise sqlite3.OperationalError(f"{e}: its filesystem is full") from None
            raise
        found = self._db.execute("PRAGMA user_version").fetchone()[0]
        if found > FORMAT:
            self._db.close()
            raise StateTooNew(f"written by a newer Lightkeeper (state format {found}; this one "
                              f"reads up to {FORMAT}): run that version, or give another --state")
        for table, column, decl in ADDED_COLUMNS:
            have = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
        if found < FORMAT:
            self._db.execute(f"PRAGMA user_version = {FORMAT}")
        self._db.commit()

    def _open(self) -> None:
        self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=10)
        self._db.row_factory = sqlite3.Row
        if self.path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
        self._file = file_id(self.path) if self.path != ":memory:" else None
        self._db.executescript(SCHEMA)

    def _kept(self) -> None:
        """Before a write: the file deleted under the running monitor (its folder cleaned up)
        is written back from the open database, with its lock, so a restart still knows every
        kill; another file in its place is not written over (raises sqlite3.Error)."""
        if self._file is None or self._db.in_transaction:
            return
        now = file_id(self.path)
        if now is not None:
            if now != self._file:
                raise sqlite3.OperationalError(f"{self.path} was replaced by another file: "
                                               "not written (restart the monitor)")
            return
        try:
            os.makedirs(os.path.dirname(self._lock_file), exist_ok=True)
            if self._lock_id is not None and file_id(self._lock_file) != self._lock_id:
                fd = pid_lock(self._lock_file)  # deleted with the folder: held again
                if self._relock is not None:
                    os.close(self._relock)
                self._relock, self._lock_id = fd, file_id(self._lock_file)
        except (OSError, LockHeld) as e:
            why = f"in use by another monitor (PID {e.holder})" if isinstance(e, LockHeld) else e
            raise sqlite3.OperationalError(f"{self.path} was deleted and cannot be written "
                                           f"again: {self._lock_file}: {why}") from None
        tmp = f"{self.path}.restoring"
        try:
            with contextlib.closing(sqlite3.connect(tmp)) as copy:
                self._db.backup(copy)
        except sqlite3.Error as e:  # a full disk: the open database stays, tried again
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise sqlite3.OperationalError(f"{self.path} was deleted and cannot be written "
                                           f"again: {e}") from None
        self._db.close()  # before the new file: its WAL is deleted by name on close
        for leftover in (f"{self.path}-wal", f"{self.path}-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)
        os.replace(tmp, self.path)
        self._open()
        log.warning("%s was deleted while the monitor ran: written again from the open "
                    "database", self.path)

    def close(self) -> None:
        with self._lock:
            self._db.close()
            if self._relock is not None:
                os.close(self._relock)

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """The writes inside commit together or not at all: a monitor killed between them
        leaves neither (a host quarantined without its sinks' actions, say)."""
        with self._lock:
            self._atomic += 1
            try:
                yield
                if self._atomic == 1:
                    self._pay()  # a block without a write of its own commits them too
                    self._db.commit()
                    self._owed = {}
            except BaseException:
                if self._atomic == 1:
                    self._db.rollback()
                raise
            finally:
                self._atomic -= 1

    def _write(self, sql: str, args: tuple | list = (), many: bool = False) -> int:
        """Run one statement (``many``: over the rows ``args``, in one transaction: a commit is
        a disk flush) and commit it (at the end of an atomic() block); the new row's id."""
        with self._lock:
            self._kept()  # may open the file again: self._db only after it
            try:
                self._pay()
                cur = (self._db.executemany if many else self._db.execute)(sql, args)
                if not self._atomic:
                    self._db.commit()
                    self._owed = {}
            except sqlite3.Error:  # no transaction left open to hold the file's locks
                self._db.rollback()
                raise
            return int(cur.lastrowid or 0)

    def _pay(self) -> None:
        """Write the fields owed (update_decision) into the transaction going on."""
        for did, fields in self._owed.items():
            self._db.execute(*_setting(did, fields))

    def _add(self, table: str, sql: str, args: tuple) -> int:
        """Insert one audit row, then drop the table's rows _pruning names."""
        with self.atomic():
            rid = self._write(sql, args)
            self._write(*self._pruning(table, rid))
        return rid

    def _pruning(self, table: str, newest: int) -> tuple[str, tuple]:
        """The DELETE of ``table``'s rows AUDIT_KEPT older than ``newest`` that nothing needs."""
        return (f"DELETE FROM {table} WHERE id <= ? AND NOT ({STILL_NEEDED[table]})",
                (newest - AUDIT_KEPT,))

    def _rows(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _dicts(self, sql: str, args: tuple = (), json_cols: tuple[str, ...] = ()
               ) -> list[dict[str, Any]]:
        """Rows as dicts, ``json_cols`` decoded (an empty one: None)."""
        return [{**dict(r), **{c: json.loads(r[c]) if r[c] else None for c in json_cols}}
                for r in self._rows(sql, args)]

    def add_finding(self, f: dict[str, Any]) -> int:
        return self._add("findings",
            "INSERT INTO findings (kind, replica_group, replica_id, ranks, evidence, "
            "first_seen, confirmed_at, resolved_at, resolution, reconfirms, job) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (f["kind"], JOB_GROUP if f["replica_group"] is None else f["replica_group"],
             f.get("replica_id"), json.dumps(f["ranks"]),
             json.dumps(f.get("evidence") or {}, default=str), f["first_seen"],
             f.get("confirmed_at"), f.get("resolved_at"), f.get("resolution"),
             f.get("reconfirms"), self.job))

    def resolve_finding(self, finding_id: int, at: float, resolution: str,
                        evidence: dict[str, Any] | None = None) -> None:
        """``evidence``: replaces the confirmation's (a job-wide finding's later probe rounds)."""
        self._write("UPDATE findings SET resolved_at=?, resolution=?, evidence=COALESCE(?, evidence) "
                    "WHERE id=?", (at, resolution, None if evidence is None
                                   else json.dumps(evidence, default=str), finding_id))

    def update_finding_evidence(self, finding_id: int, evidence: dict[str, Any]) -> None:
        """An open finding's evidence replaced (a job-wide finding's new probe verdict)."""
        self._write("UPDATE findings SET evidence=? WHERE id=?",
                    (json.dumps(evidence, default=str), finding_id))

    def restart_marks(self, at: float) -> dict[tuple, tuple[int, int | None]]:
        """A starting monitor's: the findings a previous run left open, closed as
        ``monitor_restarted``, and the marks a run before left: key -> (its episode: the id of
        its first finding, the lowest step seen since; a stall's: its finding's). This --job's
        only: another job's are kept for its monitor; those of a file from before findings named
        their job are no one's (found again, counted again, not taken for another job's).
        Saved at once: a run that stops before it confirms them again hands them on."""
        with self.atomic():
            saved = self._saved_marks()
            for r in self._rows("SELECT id, kind, replica_group, replica_id, reconfirms, job, "
                                "evidence FROM findings WHERE resolved_at IS NULL"):
                self.resolve_finding(r["id"], at, "monitor_restarted")
                step = json.loads(r["evidence"]).get("step") if r["kind"] in STALLS else None
                saved.append([r["kind"], _group(r["replica_group"]), r["replica_id"],
                              r["reconfirms"] or r["id"], step if type(step) is int else None,
                              r["job"]])
            marks = {tuple(m[:3]): (m[3], m[4]) for m in saved if m[5:] == [self.job]}
            self.save_restart_marks(marks, saved)
        return marks

    def _saved_marks(self) -> list[list]:
        rows = self._rows("SELECT data FROM restart_marks")
        return json.loads(rows[0][0]) if rows else []

    def save_restart_marks(self, marks: dict[tuple, tuple[int, int | None]],
                           saved: list[list] | None = None) -> None:
        """This job's ``marks`` in place of its saved ones, other jobs' kept. The newest 1000
        kept: a mark whose group never comes back is never forgotten."""
        others = [m for m in (self._saved_marks() if saved is None else saved)
                  if len(m) == 6 and m[5] != self.job]
        self._write("INSERT OR REPLACE INTO restart_marks (id, data) VALUES (1, ?)", (json.dumps(
            [*others, *([*k, *v, self.job] for k, v in marks.items())][-1000:]),))

    def torch_paces(self, job: str) -> dict[str, list[float]]:
        """``job``'s torch-only groups a run before timed: replica id -> their step times. A
        row that is not such a mapping is said once and read as none (each held again)."""
        rows = self._rows("SELECT data FROM torch_paces WHERE job=?", (job,))
        try:
            data = json.loads(rows[0][0]) if rows else {}
            if not isinstance(data, dict) or not all(
                    isinstance(t, list) and all(type(x) is float and 0 < x < math.inf for x in t)
                    for t in data.values()):
                raise ValueError("not replica id -> step times")
        except (ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep
            log.warning("%s: the torch-only groups' step times kept for job %s are unreadable "
                        "(%s): each group is held again until it steps twice", self.path, job, e)
            return {}
        return data

    def save_torch_paces(self, job: str, paces: dict[str, list[float]]) -> None:
        self._write("INSERT OR REPLACE INTO torch_paces (job, data) VALUES (?, ?)",
                    (job, json.dumps(paces)))

    def findings(self, limit: int = 500, open_only: bool = False) -> list[dict[str, Any]]:
        where = " WHERE resolved_at IS NULL" if open_only else ""
        rows = self._dicts(f"SELECT * FROM findings{where} ORDER BY id DESC LIMIT ?", (limit,),
                           ("ranks", "evidence"))
        return [{**r, "replica_group": _group(r["replica_group"])} for r in rows]

    def add_decision(self, *, replica_group: int | None, replica_id: str | None, decision: str,
                     reason: str, detail: str = "", finding_id: int | None = None,
                     finding: dict[str, Any] | None = None, status: str | None = None,
                     source: str = "auto", at: float | None = None) -> int:
        return self._add("decisions",
            "INSERT INTO decisions (at, replica_group, replica_id, decision, reason, detail, "
            "finding_id, finding, status, source, job) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (time.time() if at is None else at, replica_group, replica_id, decision, reason,
             detail, finding_id, json.dumps(finding, default=str) if finding else None,
             status, source, self.job))

    def update_decision(self, decision_id: int, **fields: Any) -> None:
        bad = set(fields) - {"status", "http_status", "confirmed_at", "detail", "bundle"}
        if bad:  # column names go into the SQL text: only these
            raise ValueError(f"cannot update {', '.join(sorted(bad))}")
        with self._lock:
            try:
                self._write(*_setting(decision_id, fields))
            except sqlite3.Error:  # a kill's outcome is not lost (a bundle's link may be)
                if "bundle" not in fields:
                    self._owed[decision_id] = {**self._owed.get(decision_id, {}), **fields}
                raise

    def decisions(self, limit: int = 500, decision: str | None = None) -> list[dict[str, Any]]:
        """The newest first; ``decision``: of that decision only (``evict``, ``hold``, ...)."""
        where, args = (" WHERE decision=?", (decision,)) if decision else ("", ())
        return self._decisions(f"SELECT * FROM decisions{where} ORDER BY id DESC LIMIT ?",
                               (*args, limit), ("finding",))

    def _decisions(self, sql: str, args: tuple = (), json_cols: tuple[str, ...] = ()
                   ) -> list[dict[str, Any]]:
        """Rows of decisions with the fields owed them."""
        with self._lock:
            return [{**r, **self._owed.get(r["id"], {})} for r in self._dicts(sql, args, json_cols)]

    def evicted_replica_ids(self) -> set[str]:
        """replica_ids a kill was sent for (whatever its confirmation): never evicted again."""
        return {r["replica_id"] for r in self._decisions(
            "SELECT id, replica_id, status FROM decisions WHERE decision='evict' AND "
            "status NOT IN ('failed', 'leader_failed') AND replica_id IS NOT NULL")
            if r["status"] not in ("failed", "leader_failed")}

    def mirrored_replica_ids(self) -> set[str]:
        """replica_ids of a leader's kills a shard copied into its log (``source: leader``),
        not the leader's own rows (``leader_sent`` ...) of a shard that also leads."""
        return {r["replica_id"] for r in self._decisions(
            "SELECT id, replica_id, status FROM decisions WHERE decision='evict' AND "
            "source='leader' AND status IN ('sent', 'confirmed', 'unconfirmed') AND "
            "replica_id IS NOT NULL")}

    def proposal_of(self, replica_id: str) -> dict[str, Any] | None:
        """The newest ``proposed`` row of ``replica_id`` (a shard's), with its finding."""
        rows = self._decisions("SELECT * FROM decisions WHERE decision='proposed' AND "
                               "replica_id=? ORDER BY id DESC LIMIT 1", (replica_id,),
                               ("finding",))
        return rows[0] if rows else None

    def told_to_go_replica_ids(self) -> set[str]:
        """The evicted set less the kills that turned ``unconfirmed`` (the replica still answered
        after the confirmation window: alive, not told to go): what the detectors leave alone."""
        rows = self._decisions("SELECT id, replica_id, status FROM decisions WHERE "
                               "decision='evict' AND replica_id IS NOT NULL")
        return {r["replica_id"] for r in rows if r["status"] not in ("failed", "leader_failed")} \
            - {r["replica_id"] for r in rows if r["status"] == "unconfirmed"}

    def last_eviction_at(self) -> float | None:
        """When this job's last kill request was attempted (sent or failed): the cooldown's
        start. A row from before decisions named their job counts for every job."""
        return self._rows("SELECT MAX(at) FROM decisions WHERE decision='evict' AND "
                          "(job=? OR job IS NULL)", (self.job,))[0][0]

    def interrupt_sending(self) -> None:
        """Decisions a stopped monitor left ``sending``, maybe never sent: ``interrupted``; a
        kill until a sweep sees whether the replica is gone (Enforcer.confirm_evictions)."""
        self._write("UPDATE decisions SET status='interrupted' WHERE status='sending'")

    def pending_confirmations(self) -> list[dict[str, Any]]:
        # a row still sending in the file may have been sent (its outcome unwritten)
        return [r for r in self._decisions(f"SELECT * FROM decisions WHERE {UNJUDGED}")
                if r["status"] in ("sent", "interrupted")]

    # --- unreachable ranks (monitor.service) and incident bundles (monitor.act.bundles) -------
    def keep_unreachable(self, rows: list[tuple[str, float | None, dict[str, Any],
                                                dict[str, Any] | None]]) -> None:
        """Ranks that stopped answering, each ``(url, since, last state, verdict)``, for a
        restarted monitor: all or none (raises sqlite3.Error)."""
        self._write("INSERT OR REPLACE INTO unreachable_ranks (url, since, state, trust) "
                    "VALUES (?,?,?,?)", [(url, since, json.dumps(state), json.dumps(trust))
                                         for url, since, state, trust in rows], many=True)

    def drop_unreachable(self, urls: list[str]) -> None:
        self._write("DELETE FROM unreachable_ranks WHERE url=?", [(u,) for u in urls], many=True)

    def unreachable(self) -> dict[str, tuple[float | None, dict[str, Any], dict | None]]:
        """url -> (unreachable since, last state, verdict) of the ranks keep_unreachable kept."""
        return {r["url"]: (r["since"], json.loads(r["state"]), json.loads(r["trust"] or "null"))
                for r in self._rows("SELECT url, since, state, trust FROM unreachable_ranks")}

    def add_bundle(self, row: dict[str, Any]) -> None:
        self._write("INSERT INTO bundles (id, at, trigger, kind, replica_group, replica_id, "
                    "finding_id, decision_id, path, bytes, summary) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    (row["id"], row["at"], row["trigger"], row.get("kind"),
                     row.get("replica_group"), row.get("replica_id"), row.get("finding_id"),
                     row.get("decision_id"), row["path"], row["bytes"],
                     json.dumps(row.get("summary") or {}, default=str)))

    def bundles(self, limit: int = 500, bundle_id: str | None = None) -> list[dict[str, Any]]:
        """Newest written first (not by ``at``: a restart's clock may lag), or ``bundle_id``'s."""
        if bundle_id is not None:
            return self._dicts("SELECT * FROM bundles WHERE id=?", (bundle_id,), ("summary",))
        return self._dicts("SELECT * FROM bundles ORDER BY rowid DESC LIMIT ?",
                           (limit,), ("summary",))

    def delete_bundle(self, bundle_id: str) -> None:
        self._write("DELETE FROM bundles WHERE id=?", (bundle_id,))

    def identity(self) -> str:
        """This file's monitor id: made once, kept across restarts wherever the file goes (a
        pod's new host name, a moved volume); a fresh one for an in-memory store."""
        with self._lock:
            row = self._db.execute("SELECT value FROM monitor_identity WHERE id=1").fetchone()
            if row:
                return row[0]
            new = uuid.uuid4().hex[:16]
            try:
                self._write("INSERT INTO monitor_identity (id, value) VALUES (1, ?)", (new,))
            except sqlite3.Error as e:  # a full disk, a replaced file: this run's id
                log.warning("cannot keep the monitor's id in %s: %s", self.path, e)
        return new

