"""The host ledger's tables (monitor.act.hosts): hosts, offences, host decisions, sinks' actions;
apart from the replicas' audit, a mixin of Store on its _write, _add, _rows and _dicts."""

from __future__ import annotations

import json
from typing import Any


class HostTables:
    def save_host(self, host: str, data: dict[str, Any], at: float) -> None:
        self._write("INSERT OR REPLACE INTO hosts (host, data, updated_at) VALUES (?,?,?)",
                    (host, json.dumps(data, default=str), at))

    def delete_host(self, host: str) -> None:
        self._write("DELETE FROM hosts WHERE host=?", (host,))

    def load_hosts(self) -> dict[str, dict[str, Any]]:
        return {r[0]: json.loads(r[1]) for r in self._rows("SELECT host, data FROM hosts")}

    def add_host_offence(self, host: str, at: float, kind: str, finding_id: int | None,
                         data: dict[str, Any]) -> int:
        return self._add("host_offences",
            "INSERT INTO host_offences (host, at, kind, finding_id, data) VALUES (?,?,?,?,?)",
            (host, at, kind, finding_id, json.dumps(data, default=str)))

    def host_offences(self, host: str, since: float = float("-inf"),
                      limit: int = 1000) -> list[dict[str, Any]]:
        """A host's offences since a time, newest first."""
        return self._dicts("SELECT * FROM host_offences WHERE host=? AND at>=? "
                           "ORDER BY id DESC LIMIT ?", (host, since, limit), ("data",))

    def offended_in(self, host: str, episode: int) -> bool:
        """``host`` has an offence of a finding of ``episode`` (its first finding's id, or one
        confirming it again after a monitor restart)."""
        return bool(self._rows("SELECT 1 FROM host_offences o JOIN findings f ON "
                               "f.id=o.finding_id WHERE o.host=? AND ? IN (f.id, f.reconfirms) "
                               "LIMIT 1", (host, episode)))

    def add_host_decision(self, *, host: str, decision: str, reason: str, detail: str,
                          evidence: Any, at: float, source: str = "auto") -> int:
        return self._add("host_decisions",
            "INSERT INTO host_decisions (at, host, decision, reason, detail, evidence, "
            "source) VALUES (?,?,?,?,?,?,?)",
            (at, host, decision, reason, detail, json.dumps(evidence, default=str), source))

    def host_decisions(self, limit: int = 500) -> list[dict[str, Any]]:
        return self._dicts("SELECT * FROM host_decisions ORDER BY id DESC LIMIT ?", (limit,),
                           ("evidence",))

    def add_host_action(self, *, host: str, sink: str, op: str, status: str, event: dict,
                        at: float, next_at: float | None, detail: str = "") -> int:
        return self._add("host_actions",
            "INSERT INTO host_actions (host, sink, op, status, attempts, next_at, "
            "created_at, updated_at, detail, event) VALUES (?,?,?,?,0,?,?,?,?,?)",
            (host, sink, op, status, next_at, at, at, detail, json.dumps(event, default=str)))

    def update_host_action(self, action_id: int, *, status: str, attempts: int,
                           next_at: float | None, detail: str, at: float) -> None:
        self._write("UPDATE host_actions SET status=?, attempts=?, next_at=?, detail=?, "
                    "updated_at=? WHERE id=?", (status, attempts, next_at, detail, at, action_id))

    def rename_sink(self, old: str, new: str) -> None:
        self._write("UPDATE host_actions SET sink=? WHERE sink=?", (new, old))

    def newest_host_actions(self) -> list[dict[str, Any]]:
        """Each host and sink's newest action: where that sink stands."""
        return self._dicts("SELECT * FROM host_actions WHERE id IN (SELECT MAX(id) FROM "
                           "host_actions GROUP BY host, sink)", (), ("event",))

    def host_action_before(self, host: str, sink: str, before: int) -> dict[str, Any] | None:
        """The host and sink's newest action older than id ``before`` that was carried out or
        tried: not superseded, or superseded after an attempt (the sink may hold what it did)."""
        rows = self._dicts("SELECT * FROM host_actions WHERE host=? AND sink=? AND id<? AND "
                           "(status!='superseded' OR attempts>0) ORDER BY id DESC LIMIT 1",
                           (host, sink, before), ("event",))
        return rows[0] if rows else None

    def host_actions(self, due_at: float | None = None, limit: int = 500
                     ) -> list[dict[str, Any]]:
        """Actions newest first; with ``due_at``, only pending ones due by then, oldest first."""
        if due_at is None:
            return self._dicts("SELECT * FROM host_actions ORDER BY id DESC LIMIT ?", (limit,),
                               ("event",))
        return self._dicts("SELECT * FROM host_actions WHERE status IN ('pending', 'retrying') "
                           "AND next_at<=? ORDER BY id ASC LIMIT ?", (due_at, limit), ("event",))
