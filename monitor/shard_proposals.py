"""A shard's eviction proposals in etcd (made, made manual, withdrawn; the leader's kills of them
copied into its audit log), apart from owning and holding its slice: a mixin of Shards, on its
cfg, mon, root, etcd, run, _proposed and _renewed."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from .act.enforcer import out_of_sight
from .lease import KV, created_never, modified_at
from .shard_leader import _audit, _by_rid, _is_proposal

log = logging.getLogger("monitor.shard")  # the shard's log lines, whichever half writes them


def _acted_on(record: KV | None) -> bool:
    """Whether a leader sent, or is sending, a kill on it (a failed one: retried while proposed)."""
    if record is None:
        return False
    rec = record.json()
    return not isinstance(rec, dict) or rec.get("state") != "failed"


def _summary(f: Any) -> dict[str, Any]:
    ev = f.evidence or {}
    return {"kind": f.kind, "first_seen": f.first_seen, "confirmed_at": f.confirmed_at,
            "culprit_ranks": ev.get("culprit_ranks", f.ranks),
            "culprit_hosts": ev.get("culprit_hosts", []),
            "detail": str(ev.get("detail") or ev.get("reason") or "")[:500]}


class Proposals:
    def _propose_findings(self, view: Any, evidence: Any, now: float,
                          records: dict[str, KV], blind: str | None) -> set[str]:
        """The enforcer's decisions under the shard's own rails, ``blind`` its report's, a
        proposal for each eviction (min replicas and cooldown are the leader's); then the
        withdrawals. The replica ids of the proposals kept out of sight (all, if none withdrawn)."""
        mon = self.mon
        wanted: set[str] = set()

        def propose(f: Any) -> bool:
            wanted.add(f.replica_id)
            if f.replica_id in self._proposed:
                return True
            fid = mon.enforcer.finding_id(f.key)
            # kept before the proposal, so before any kill the leader sends on it
            bundle = mon.enforcer.keep_bundle(view, evidence, f.to_dict(), fid, {
                "decision": "proposed", "reason": f.kind, "source": "auto",
                "status": "proposing", "replica_group": f.replica_group,
                "replica_id": f.replica_id, "at": mon.clock()})
            if not self._renewed():
                return False
            did = self._propose(f.replica_group, f.replica_id, _summary(f), fid, f.to_dict(),
                                "auto")
            if did is not None and bundle is not None:
                mon.store.update_decision(did, bundle=bundle["id"])
            return True

        local = dataclasses.replace(mon.cfg.rails, min_replicas=0, cooldown_s=0.0)
        decided = mon.enforcer.decide(view, evidence, now, local, propose, lambda _: blind)
        # its group out of sight, a proposal stays while its finding is open (left_job after
        # --dead-sweeps), blind or not: a flapping group is not proposed, bundled and withdrawn
        # every other sweep; the leader holds it meanwhile
        kept = {f.replica_id for f in mon.detectors.open_findings()
                if f.replica_id in self._proposed and f.kind in local.evict_kinds
                and out_of_sight(evidence, f)}
        if not decided:  # its lease lapsed while proposing: nothing withdrawn, all held
            return set(self._proposed)
        self._withdraw(wanted | kept, records)
        return kept & self._proposed

    def _withdraw(self, wanted: set[str], records: dict[str, KV]) -> None:
        """Delete this shard's automatic proposals that no open finding of this run stands behind
        (or it is blind, but for one whose group is out of sight) and no leader acted on: a
        leader never evicts on evidence the shard no longer holds (one of an earlier run goes
        too: the next sweep proposes anew). So does one of this shard's groups made by a shard
        whose run does not report (an earlier --shards): the leader would hold it for ever."""
        proposals = _by_rid(self.etcd, self.root + "proposals/")
        # one gone (withdrawn by another run that held the slice meanwhile): proposed anew
        self._proposed &= proposals.keys()
        runs: dict[Any, Any] | None = None  # the reporting shards' runs, read when needed
        for rid, kv in proposals.items():
            p = kv.json()
            rec = records.get(rid)
            if not _is_proposal(p) or p.get("manual") or _acted_on(rec):
                continue  # (a leader acted on it: it stays, and costs no txn every sweep)
            if p.get("shard") == self.cfg.index:
                if rid in wanted and p.get("run") == self.run:
                    continue
            elif not self.owns(p["replica_group"]):
                continue
            else:
                if runs is None:
                    runs = {str(r.get("shard")): r.get("run") for x in
                            self.etcd.range_prefix(self.root + "shards/")
                            if isinstance(r := x.json(), dict)}
                if p.get("run") is not None and runs.get(str(p.get("shard"))) == p["run"]:
                    continue  # its shard still runs (another --shards: the leader is blind)
            # the record as read: a leader retrying the failed kill meanwhile changed it
            record = f"{self.root}evictions/{rid}"
            if self.etcd.delete_if([created_never(record) if rec is None
                                    else modified_at(record, rec.mod_revision),
                                    modified_at(kv.key, kv.mod_revision)], kv.key):
                self._proposed.discard(rid)
                detail = ("no open finding stands behind the proposal, or this shard is blind"
                          if p.get("run") == self.run else "made by an earlier run of this shard:"
                          " proposed anew while a finding stands behind it" if p.get("shard") ==
                          self.cfg.index else f"made by shard {p.get('shard')} in a run that does"
                          " not report (an earlier --shards?): this shard owns the group and "
                          "proposes anew while a finding stands behind it")
                log.warning("withdrew the proposal to evict %s: %s", rid, detail)
                _audit(self.mon, p, rid, "withdrawn", p["kind"], detail, source="auto")

    def _mirror_evictions(self, records: dict[str, KV]) -> None:
        """The leader's sent kills of this shard's groups copied into its audit log (``sent``,
        ``source: leader``, with their finding): confirmed and charged as a single monitor's."""
        mirrored: set[str] | None = None
        for rid, kv in records.items():
            rec = kv.json()
            if rid in self._mirrored or not isinstance(rec, dict) \
                    or rec.get("shard") != self.cfg.index or rec.get("state") != "sent":
                continue
            self._mirrored.add(rid)
            if mirrored is None:  # this shard's copies, not the rows of its own --lead thread
                mirrored = self.mon.store.mirrored_replica_ids()
            if rid in mirrored:  # by an earlier run
                continue
            fid, finding = self._finding_of(rid)
            _audit(self.mon, rec, rid, "evict", str(rec.get("kind")),
                   f"sent by the leader {rec.get('leader')} (attempt {rec.get('attempt')}): "
                   f"{rec.get('detail', '')}", "sent", finding_id=fid, finding=finding)

    def _finding_of(self, replica_id: str) -> tuple[int | None, dict | None]:
        """The finding this shard proposed ``replica_id``'s eviction on (its ``proposed`` row),
        else its open finding of that replica id; (None, None): neither is known."""
        row = self.mon.store.proposal_of(replica_id)
        if row is not None and isinstance(row.get("finding"), dict):
            return row.get("finding_id"), row["finding"]
        for f in self.mon.detectors.open_findings():
            if f.replica_id == replica_id:
                return self.mon.enforcer.finding_id(f.key), f.to_dict()
        return None, None

    def _propose(self, replica_group: int, replica_id: str, summary: dict[str, Any],
                 finding_id: int | None, finding: dict[str, Any], source: str) -> int | None:
        """Write the proposal unless one exists for this replica id: its audit row's id, None
        when one existed; raises EtcdError."""
        key = f"{self.root}proposals/{replica_id}"
        value = {"replica_group": replica_group, "replica_id": replica_id, "shard": self.cfg.index,
                 "monitor": self.mon.url, "at": self.mon.clock(), "source": source,
                 "manual": source == "manual", "run": self.run, **summary}
        created, _ = self.etcd.put_if([created_never(key)], key, value)
        self._proposed.add(replica_id)
        if not created:
            return None
        self.proposals_made += 1
        log.warning("proposed evicting replica group %s (%s): %s", replica_group, replica_id,
                    summary["kind"])
        return self.mon.store.add_decision(
            replica_group=replica_group, replica_id=replica_id, decision="proposed",
            reason=summary["kind"], detail=f"proposed to the leader as {key}",
            finding_id=finding_id, finding=finding, source=source, at=self.mon.clock())

    def _make_manual(self, replica_group: int, replica_id: str, reason: str) -> dict | None:
        """The proposal standing for ``replica_id`` made manual (judged with the manual rails,
        never withdrawn) unless a kill on it is in flight or was sent; audited either way. None:
        the keys changed since read or the proposal is gone; raises EtcdError."""
        key, record = f"{self.root}proposals/{replica_id}", f"{self.root}evictions/{replica_id}"
        kv, rec = self.etcd.get(key), self.etcd.get(record)
        if kv is None:
            return None
        p = kv.json()
        p = p if isinstance(p, dict) else {}
        row = {"replica_group": replica_group}
        finding = {"kind": "manual", "reason": reason}
        if _acted_on(rec):  # (a failed kill is retried, as manual, by the proposal made so)
            sent = isinstance(r := rec.json(), dict) and r.get("state") == "sent"
            why, detail = ("already_evicted", f"the leader already sent the kill of {replica_id}") \
                if sent else ("kill_in_flight", f"a leader's kill of {replica_id} is in flight: "
                              "ask again if the group stays")
            did = _audit(self.mon, row, replica_id, "hold", why, f"{detail} (given: {reason})",
                         source="manual", finding=finding)
            return {"id": did, "decision": "hold", "reason": why, "detail": detail}
        if p.get("manual") is True:
            did = _audit(self.mon, row, replica_id, "proposed", "manual",
                         f"already proposed by hand as {key} (given: {reason})",
                         source="manual", finding=finding)
            return {"id": did, "decision": "proposed", "created": False, "proposal": key,
                    "reason": "already_proposed"}
        value = {**p, "replica_group": replica_group, "replica_id": replica_id,
                 "shard": self.cfg.index, "monitor": self.mon.url, "at": self.mon.clock(),
                 "source": "manual", "manual": True, "run": self.run, "kind": "manual",
                 "detail": reason, "auto_kind": p.get("kind")}
        if not self.etcd.put_if([modified_at(key, kv.mod_revision),
                                 created_never(record) if rec is None
                                 else modified_at(record, rec.mod_revision)], key, value)[0]:
            return None
        log.warning("made the proposal to evict replica group %s (%s) manual: %s",
                    replica_group, replica_id, reason)
        did = _audit(self.mon, row, replica_id, "proposed", "manual", f"the automatic proposal "
                     f"{key} ({p.get('kind')}) made manual: the leader judges it with the manual "
                     f"rails (given: {reason})", source="manual", finding=finding)
        return {"id": did, "decision": "proposed", "created": False, "proposal": key,
                "reason": "made_manual"}
