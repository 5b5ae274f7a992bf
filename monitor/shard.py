"""Several monitors, one job: each shard polls its replica groups and proposes evictions in etcd;
one :class:`Leader` applies the global rails and kills (docs/scaling.md, "The etcd protocol")."""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from functools import lru_cache
from typing import Any

from http_serving import redact_url

from .act.trouble import Trouble
from .config import ShardConfig
from .lease import Etcd, EtcdError, SessionLease, created_never, leased_by
from .shard_leader import Leader, _by_rid
from .shard_proposals import Proposals

log = logging.getLogger(__name__)

REPROBE_S = 60.0  # a target of another shard is asked its group again this often


@lru_cache(maxsize=1 << 16)  # an MD5 per group, not per target and sweep
def shard_of(replica_group: int, shards: int) -> int:
    """Prometheus' ``hashmod`` of the group's decimal id (the last 8 bytes of its MD5, big-endian,
    mod N): Prometheus shard I keeps the groups of monitor shard I."""
    digest = hashlib.md5(str(int(replica_group)).encode(), usedforsecurity=False).digest()
    return int.from_bytes(digest[8:], "big") % shards


def expected_in_slice(expected_groups: int | None, shard: Any) -> int | None:
    """Of ``--expected-groups`` (the job's), those a shard's ledger sees and expects."""
    if shard is None or expected_groups is None:
        return expected_groups
    return sum(shard_of(g, shard.shards) == shard.index for g in range(expected_groups))


class Shards(Proposals):
    """A monitor's shard: its slice, report, hold and proposals (on the sweep loop's thread), and
    its :class:`Leader` candidate with ``--lead``."""

    def __init__(self, cfg: ShardConfig, monitor: Any) -> None:
        self.cfg = cfg
        self.mon = monitor  # monitor.service.Monitor: its store, rails, metrics
        self.root = f"{cfg.etcd_prefix.rstrip('/')}/{monitor.cfg.job}/"
        self.etcd = Etcd(cfg.etcd)  # the sweep loop's connection
        self.session = SessionLease(self.etcd, cfg.lease_ttl_s)
        # url -> (replica group, learned at); a rank kept unreachable across a restart (--state)
        # stays in its group's slice, so its death is found again as a single monitor finds it
        self._groups: dict[str, tuple[int, float]] = {
            u: (g, monitor.clock()) for u, (_, s, _) in monitor.store.unreachable().items()
            if isinstance(g := s.get("replica_group"), int)}
        self._learned = 0  # counts the groups learned that differ from the last known
        self._slice: list = []  # the last own_targets, for its key until the next reprobe
        self._slice_key: tuple = (None, -1)
        self._reprobe_at = float("-inf")
        self._unplaced = True  # no target's group is known yet: any may be this slice's
        self._proposed: set[str] = set()
        self._mirrored: set[str] = set()  # leader kills copied into this shard's audit log
        self.run = uuid.uuid4().hex[:12]  # this run of the shard: its proposals name it
        # whether this run holds its index's report key (None: not known yet); another monitor
        # started with the same --shard holds it, this one stands by: no report, no proposals
        self.holds: bool | None = None
        self.held_by: dict[str, Any] | None = None
        # when this run's hold ends unless renewed (monotonic): the lease's TTL counted from
        # before the last renewal that answered, so etcd cannot have let it go sooner
        self._holds_until = float("-inf")
        self._lapse_said = False
        self.etcd_trouble = Trouble(f"shard {cfg.index} cannot report or propose", f"etcd answers "
                                    f"again: shard {cfg.index} reports and proposes", log=log)
        self._retry_at = float("-inf")  # etcd failed: asked again from then (monotonic)
        # set up so that nothing acts on it: its index held by a shard of another --shards, or
        # no leader under its prefix (a wrong --etcd-prefix or --job); its error, said
        self.misconfig = Trouble(f"shard {cfg.index}/{cfg.shards}: nothing acts on it",
                                 f"shard {cfg.index}/{cfg.shards}: set up right again",
                                 logging.ERROR, log)
        self._stray: str | None = None  # why its index is another --shards' (_report)
        self._leader_at = time.monotonic()  # when a leader key was last seen (or the start)
        self._leader_seen: Any = None  # its value then ({"name", "monitor", "id"})
        self.sent_kills: set[str] = set()  # the job's kills the leader sent, any slice's
        self.proposals_made = 0
        self.leader: Leader | None = None

    def owns(self, replica_group: int) -> bool:
        return self.cfg.index is not None and shard_of(replica_group, self.cfg.shards) \
            == self.cfg.index

    def start(self) -> None:
        if self.cfg.lead:  # once the API serves: the leader key names the monitor's url
            self.leader = Leader(self.cfg, self.mon, self.root)
            self.leader.start()

    def stop(self) -> None:
        if self.leader is not None:
            self.leader.stop()
        self.session.revoke()  # the report goes with it: the leader sees this shard gone at once
        self.etcd.close()

    def own_targets(self, targets: list, poller: Any, now: float, version: Any = None) -> list:
        """The targets of this shard's groups (by their last state, else their registration's
        hint); one with neither is asked here, another shard's one again every REPROBE_S. The
        last slice is reused while ``version`` (Discovery.version) and the groups learned stand."""
        if self.cfg.index is None:
            return []
        key = (version, self._learned)
        if version is not None and key == self._slice_key and now < self._reprobe_at:
            return list(self._slice)
        known = {t.url for t in targets}
        self._groups = {u: g for u, g in self._groups.items() if u in known}
        mine, probe, reprobe_at = [], [], float("inf")
        for t in targets:
            g, at = self._groups.get(t.url, (t.replica_group, now))
            if g is None or (not self.owns(g) and now - at >= REPROBE_S):
                probe.append(t)
            elif self.owns(g):
                mine.append(t)
            else:
                reprobe_at = min(reprobe_at, at + REPROBE_S)
        if probe:
            for url, p in poller.sweep([t.url for t in probe]).items():
                g = p.data.get("replica_group") if p.ok and isinstance(p.data, dict) else None
                if isinstance(g, int) and not isinstance(g, bool):
                    self._groups[url] = (g, now)
            mine += [t for t in probe if t.url in self._groups
                     and self.owns(self._groups[t.url][0])]
            for t in probe:  # one still without a group is asked again next sweep
                g, at = self._groups.get(t.url, (None, now))
                if g is None or not self.owns(g):
                    reprobe_at = min(reprobe_at, now if g is None else at + REPROBE_S)
        self._slice, self._slice_key, self._reprobe_at = mine, key, reprobe_at
        # one without a group while others have one never answered with one (dead, mistyped,
        # no torchft rank): no rank anyone knows, so it leaves an empty slice empty
        self._unplaced = bool(targets) and all(
            self._groups.get(t.url, (t.replica_group, 0))[0] is None for t in targets)
        return list(mine)

    def after_sweep(self, view: Any, evidence: Any, now: float) -> None:
        """Learn the groups of the ranks polled, report this shard, propose its evictions.
        Never raises: etcd unreachable is logged once and shown."""
        for url in self.mon.views.changed:
            r = view.ranks.get(url)
            if r is not None and r.replica_group is not None and r.fresh:
                old = self._groups.get(url)
                self._groups[url] = (r.replica_group, now)
                if old is None or old[0] != r.replica_group:
                    self._learned += 1  # the slice may differ
        if self.cfg.index is None or time.monotonic() < self._retry_at:
            return
        mon = self.mon
        try:
            before, asked_at = self.session.lease, time.monotonic()
            lease = self.session.refresh()
            if self.holds and before and lease == before:
                # kept alive, so the key under it is still this run's: proposals go out in the
                # sweep etcd answers again, not one later
                self._holds_until = asked_at + self.session.granted_ttl
            # before the report: a leader that sees this run's report sees its proposals
            records = _by_rid(self.etcd, self.root + "evictions/")
            # the read's revision as far as the leader needs it: a record written after the read
            # is newer than every one it holds, one written before it is among them
            records_rev = max((kv.mod_revision for kv in records.values()), default=0)
            self.sent_kills = {rid for rid, kv in records.items()
                               if isinstance(rec := kv.json(), dict) and rec.get("state") == "sent"}
            # the single monitor's rail: reach outside the groups gone (the job's kills, and
            # those the Lighthouse lists as stopped while no more than the groups reached and
            # no id heard is unknown here or to the other shards), so
            # a kill of its slice blinds it to no other. A slice with no rank while a target's
            # group is known (more shards than groups, or its groups left) has nothing to be cut
            # off from: blind, it would hold every kill
            blind = mon.enforcer.blind_to_kills(
                evidence, mon.lighthouse_status, unheard=True, also=self.sent_kills,
                who=f"shard {self.cfg.index}", heard=not (view.ranks or self._unplaced),
                elsewhere=self.reported_elsewhere)
            # the proposals it keeps while their group is out of sight: the leader holds them.
            # Not acting (its lease lapsed), it withdraws nothing, so vouches for none: all held
            kept = self._propose_findings(view, evidence, now, records, blind) \
                if self.acting() else set(self._proposed)
            self._mirror_evictions(records)
            self._report(self.session.lease, {  # granted anew if it lapsed while proposing
                "shard": self.cfg.index, "shards": self.cfg.shards, "at": now,
                "monitor": mon.url, "sweeps": mon.sweeps, "blind": blind,
                "ranks": len(view.ranks), "run": self.run, "records_rev": records_rev,
                "out_of_sight": sorted(kept),
                "groups": {str(g): gv.replica_id for g, gv in evidence.groups.items()},
                # what its ranks answer as: another shard tells a group gone by it
                "reporting": sorted({rid for gv in view.groups.values()
                                     for rid in gv.reported_replica_ids if rid})}, asked_at)
            self.etcd_trouble.update(None, now)
            self.misconfig.update("; ".join(filter(None, (self._stray, self._no_leader())))
                                  or None, now)
        except EtcdError as e:
            self.etcd_trouble.update(str(e), now)
            self._back_off(e)
        m = mon.metrics
        # 0: it proposes nothing anyone acts on, for either reason
        m.shard_etcd_up.labels(m.job, "shard").set(0 if self.error else 1)
        m.shard_standby.labels(m.job).set(1 if self.holds is False else 0)

    @property
    def error(self) -> str | None:
        return self.etcd_trouble.error or self.misconfig.error

    def _no_leader(self) -> str | None:
        """Why no leader acts on this shard: no ``leader`` key under its prefix for 3 lease
        TTLs (a leader's lapse is replaced within one); None once one is seen."""
        now = time.monotonic()
        kv = self.etcd.get(self.root + "leader")
        self._leader_seen = kv.json() if kv is not None else None  # shown: who leads
        if kv is not None:
            self._leader_at = now
        elif now - self._leader_at > 3 * self.cfg.lease_ttl_s:
            return (f"no leader under {self.root} for {now - self._leader_at:.0f} s: nothing acts "
                    "on its proposals (the leader's --etcd-prefix and --job must be its own)")
        return None

    def acting(self) -> bool:
        """Whether this run may act for its slice (abort, tell orphans to exit, fetch bundles,
        propose): it holds the slice's key and its lease cannot have lapsed (another monitor may
        hold the slice then). Not known yet or lapsed: it acts on nothing until etcd answers."""
        if not self.holds:
            return False
        if time.monotonic() < self._holds_until:
            self._lapse_said = False
            return True
        if not self._lapse_said:
            log.warning("shard %s/%s: its lease may have lapsed (etcd unreachable for %d s): "
                        "acting on nothing until etcd answers", self.cfg.index, self.cfg.shards,
                        self.session.granted_ttl)
            self._lapse_said = True
        return False

    def _back_off(self, e: EtcdError) -> None:
        """A hung etcd costs each call its timeout: asked again a third of the TTL later."""
        if e.timed_out:
            now, third = time.monotonic(), self.cfg.lease_ttl_s / 3.0
            retry = now + third
            if self.holds and self._holds_until > now:  # renewed before the hold can lapse
                retry = min(retry, max(now, self._holds_until - third))
            self._retry_at = retry

    def reported_elsewhere(self) -> tuple[set[str], bool]:
        """The replica ids the other shards' reachable ranks report (their leased reports), and
        whether every other shard of this --shards reported and could see its slice (a blind
        shard's report vouches for nothing); etcd unreachable: nothing, no."""
        if time.monotonic() < self._retry_at:  # a hung etcd: not asked again this sweep
            return set(), False
        try:
            kvs = self.etcd.range_prefix(self.root + "shards/")
        except EtcdError as e:
            self._back_off(e)
            return set(), False
        ids: set[str] = set()
        seen: set[int] = set()
        for kv in kvs:
            r = kv.json()
            if not isinstance(r, dict) or r.get("shards") != self.cfg.shards \
                    or not isinstance(r.get("reporting"), list) or r.get("shard") == self.cfg.index \
                    or r.get("blind") or not r.get("ranks"):
                continue
            seen.add(r["shard"])
            ids.update(x for x in r["reporting"] if isinstance(x, str))
        return ids, set(range(self.cfg.shards)) - {self.cfg.index} <= seen

    def _report(self, lease: int, report: dict[str, Any], asked_at: float) -> None:
        """Write this shard's report where the key is free or already this run's; held by another
        run (a second monitor with the same --shard, a SIGKILLed predecessor), stand by until
        that lease ends (said once). ``asked_at``: when the lease was last renewed (monotonic)."""
        key = f"{self.root}shards/{self.cfg.index}"
        did = self.etcd.put_if([leased_by(key, lease)], key, report, lease)[0] \
            or self.etcd.put_if([created_never(key)], key, report, lease)[0]
        where = f"shard {self.cfg.index}/{self.cfg.shards}"
        self._stray = None
        if did:
            if self.holds is False:
                log.warning("%s: the other monitor's lease ended: this one reports and "
                            "proposes", where)
            self.holds, self.held_by = True, None
            # renewed while proposing: held until later than the sweep's first renewal says
            self._holds_until = max(self._holds_until, asked_at + self.session.granted_ttl)
            return
        kv = self.etcd.get(key)
        other = kv.json() if kv is not None else None
        other = other if isinstance(other, dict) else {}
        n = other.get("shards")
        if n != self.cfg.shards:  # one of them was given the wrong --shards: never let go
            self._stray = (f"{where} is held by a monitor of --shards {n} ({other.get('monitor')}"
                           f", shard {other.get('shard')}/{n}): the job's slices are cut "
                           f"{self.cfg.shards} or {n} ways, not both; stop the wrong one")
        elif self.holds is not False:
            log.warning("%s is already run by another monitor (%s, run %s): this one stands by, "
                        "proposing nothing, until that one's lease ends", where,
                        other.get("monitor"), other.get("run"))
        self.holds = False
        self.held_by = {k: other.get(k) for k in ("monitor", "run", "at")}

    def _renewed(self) -> bool:
        """The lease renewed after a proposal's bundle (--bundle-timeout): many outlast no hold;
        False: it lapsed (another run may hold the slice), propose no more; raises EtcdError."""
        before, asked_at = self.session.lease, time.monotonic()
        if self.session.refresh() != before:
            return False
        self._holds_until = asked_at + self.session.granted_ttl
        return True

    def propose_manual(self, replica_group: int, replica_id: str | None,
                       reason: str) -> dict[str, Any]:
        """``POST /v1/evict`` on a shard: a proposal the leader judges with the manual rails.
        A group of another shard, or one without a verified replica id, is held here (409)."""
        def hold(why: str, detail: str) -> dict[str, Any]:
            return {"id": None, "decision": "hold", "reason": why, "detail": detail}

        if not self.owns(replica_group):
            me = "this leader candidate (it owns none)" if self.cfg.index is None \
                else self.cfg.index
            return hold("other_shard", f"replica group {replica_group} belongs to shard "
                        f"{shard_of(replica_group, self.cfg.shards)}, not {me}: ask that shard")
        if replica_id is None:
            return hold("no_replica_id", "no verified rank of the group reports a torchft "
                        "replica id")
        key = f"{self.root}proposals/{replica_id}"
        try:
            for _ in range(3):  # the proposal or its record changed meanwhile: read them again
                did = self._propose(replica_group, replica_id, {"kind": "manual",
                                                               "detail": reason},
                                    None, {"kind": "manual", "reason": reason}, "manual")
                if did is not None:
                    return {"id": did, "decision": "proposed", "created": True, "proposal": key,
                            "reason": "proposed"}
                out = self._make_manual(replica_group, replica_id, reason)
                if out is not None:
                    return out
        except EtcdError as e:
            return hold("etcd_unreachable", str(e))
        return hold("busy", f"{key} kept changing while this request was made: ask again")

    def to_json(self) -> dict[str, Any]:
        e = self.leader.election if self.leader else None
        return {"index": self.cfg.index, "shards": self.cfg.shards, "lead": self.cfg.lead,
                "etcd": redact_url(self.cfg.etcd), "prefix": self.root, "held_by": self.held_by,
                "error": self.error, "standby": self.holds is False,
                # read, not judged: only the sweep says a lapse (a status read changes no log)
                "acting": bool(self.holds) and time.monotonic() < self._holds_until,
                "proposals_made": self.proposals_made,
                "owned_groups": sorted({g for g, _ in self._groups.values() if self.owns(g)}),
                "leading": bool(e and e.leading),
                "leader": e.leader if e else self._leader_seen,
                "candidate_id": e.id if e else None,
                "leader_error": self.leader.error if self.leader else None,
                "leader_blind": self.leader.blind if self.leader else None}
