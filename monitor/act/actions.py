"""Actions on a replica group: the Lighthouse's kill (:class:`Lighthouse`), and telling the
group's other ranks, which that kill does not reach, to exit (:class:`Orphans`).

torchft 0.2.0 answers the kill with 500 (the Manager exits before replying), so any HTTP
answer counts as *sent*; the group leaving the quorum says it worked. A replica out of its last
quorum is answered 500 "failed to find replica" and nothing is killed (:data:`NOT_IN_QUORUM`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import requests

from http_serving import redact_url
from monitor.config import REFUSED_SIGNATURE
from monitor.evidence.claims import Claims
from monitor.poll.torch_target import is_torch
from rank_wire import auth

log = logging.getLogger(__name__)

# the kill's outcome for a replica out of the Lighthouse's last quorum: no process was asked to
# exit, so only the ranks' own /v1/exit (or its operator) can end the group
NOT_IN_QUORUM = "not in the Lighthouse's quorum: its kill cannot reach it"
# torch's own debug server serves nothing that changes a rank: never called, not a failure
TORCH_ONLY = ("a rank on torch's debug server: no /v1/exit or /v1/abort there (nothing that "
              "changes state is served)")


@dataclass
class Outcome:
    """How a kill or exit request went; ``sent``: the target was asked; ``skipped``: not
    asked on purpose (no failed try: :meth:`monitor.evidence.claims.Claims.why_not`)."""

    sent: bool
    http_status: int | None
    detail: str
    skipped: bool = False
    unreached: bool = False  # a kill the Lighthouse took but could not deliver (NOT_IN_QUORUM)


class Lighthouse:
    def __init__(self, url: str | None, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/") if url else None
        self.timeout_s = timeout_s
        self._session = requests.Session()

    def kill(self, replica_id: str) -> Outcome:
        """Send the kill request; never raises (the outcome is in the result)."""
        if not self.url:
            return Outcome(False, None, "no --lighthouse configured")
        url = f"{self.url}/replica/{quote(replica_id, safe=':')}/kill"
        try:
            r = self._session.post(url, timeout=self.timeout_s)
        except requests.ConnectionError as e:  # ConnectTimeout included: nothing was asked
            return Outcome(False, None, f"Lighthouse unreachable: {e}")
        except requests.Timeout:
            # connected and asked; the answer did not come: the Manager may be gone already
            return Outcome(True, None, f"no answer within {self.timeout_s:g}s (request sent)")
        # InvalidURL's text is the URL, password and all; urllib3 refuses some hosts with a
        # ValueError of its own (a label over 63 characters)
        except (requests.RequestException, ValueError) as e:
            return Outcome(False, None, f"{type(e).__name__}: {redact_url(str(e))}")
        if r.status_code == 200:
            return Outcome(True, 200, "killed")
        body = r.text[:300].replace("\n", " ")
        if r.status_code == 500 and "failed to find replica" in body:
            return Outcome(True, 500, f"{NOT_IN_QUORUM} (HTTP 500: {body})", unreached=True)
        return Outcome(True, r.status_code, f"HTTP {r.status_code} (expected: torchft's Manager "
                                               f"exits before replying): {body}")

    def close(self) -> None:
        self._session.close()


class RankCalls:
    """The ranks' token-guarded ``POST /v1/exit`` and ``/v1/abort``, each signed for the one
    rank it is for (rank_wire.auth), and skipped for an identity another known target claims
    (:class:`Claims`). Never raises."""

    def __init__(self, token: str | None, timeout_s: float = 2.0, auth: str = "hmac",
                 claims: Claims | None = None) -> None:
        self.token = (token or "").strip() or None  # a final newline: no header value
        self.timeout_s = timeout_s
        self.auth = auth
        self._session = requests.Session()
        self.claims = claims or Claims()
        # (rank URL, identity signed for) that refused a signature, said once: a later refusal
        # at that URL for another identity (a restarted rank) is news
        self._said_refused: set[tuple[str, str]] = set()

    def _post(self, rank: Any, path: str, body: dict, ok: tuple[int, ...],
              said: Callable[[requests.Response], str], known: Any = None) -> Outcome:
        url = rank.url
        if not self.token:
            return Outcome(False, None, "no --rank-exit-token")
        ident = auth.identity_of(getattr(rank, "state", None))
        why = self.why_not(known, rank)
        if why is not None:
            return Outcome(False, None, f"not sent: {why}", skipped=True)
        full = f"{url.rstrip('/')}{path}"
        data = json.dumps(body).encode()
        try:
            # signed for the route the rank serves, not the target URL's prefix
            authorization = auth.authorization(self.token, self.auth, path, data, ident)
            r = self._session.post(full, data=data, timeout=self.timeout_s,
                                   headers={"Authorization": authorization,
                                            "Content-Type": "application/json"})
        except (requests.RequestException, ValueError) as e:  # ValueError: as in kill()
            return Outcome(False, None, f"unreachable: {type(e).__name__}")
        if r.status_code not in ok:
            detail = f"HTTP {r.status_code}: {r.text[:120]}"
            if r.status_code == 401 and self.auth == "hmac":
                detail += f" ({REFUSED_SIGNATURE})"
                if (url, ident) not in self._said_refused:
                    self._said_refused.add((url, ident))
                    log.warning("%s refused a signed %s (HTTP 401): %s", redact_url(url), path,
                                REFUSED_SIGNATURE)
            return Outcome(False, r.status_code, detail)
        return Outcome(True, r.status_code, said(r))

    def why_not(self, known: Any, rank: Any) -> str | None:
        """Why no call is made to ``rank`` (not a failed try: its outcome is skipped); None: one
        may be. ``known``: the sweep's whole view, for :class:`Claims`."""
        if is_torch(rank.url):
            return TORCH_ONLY
        return self.claims.why_not(known, rank)

    def keep(self, known: Any) -> None:
        """Forget the refusals said of URLs ``known`` (the sweep's whole view) no longer has."""
        self._said_refused = {k for k in self._said_refused if k[0] in known.ranks}

    def exit(self, rank: Any, reason: str, known: Any = None) -> Outcome:
        """``known``: the sweep's whole view, for :class:`Claims`."""
        return self._post(rank, "/v1/exit", {"reason": reason}, (200, 202), lambda r: "exiting",
                          known)

    def abort(self, rank: Any, reason: str, decision: int | None,
              quorum_id: int | None = None, known: Any = None) -> Outcome:
        """Sent: the rank's 202 names how it aborts (its ``mechanism``); ``quorum_id``: the
        quorum whose collective is to fail (a rank that moved on answers 409)."""
        def mechanism(r: requests.Response) -> str:
            if not r.headers.get("content-type", "").startswith("application/json"):
                return "aborted"
            return r.json().get("mechanism", "aborted")

        return self._post(rank, "/v1/abort", {"reason": reason, "decision": decision,
                                              "quorum_id": quorum_id}, (202,), mechanism, known)

    def close(self) -> None:
        self._session.close()


class Orphans:
    """Finish an eviction: torchft 0.2.0's kill reaches only group rank 0, and without a local
    agent the group's other ranks live on; a group out of the Lighthouse's quorum it reaches not
    at all (docs/monitor.md, Eviction and safety rails)."""

    RETELL_S = 5.0

    def __init__(self, exits: RankCalls, grace_s: float) -> None:
        self.exits = exits
        self.grace_s = grace_s
        # (decision id, rank URL) -> seconds after the kill it was told: a restarted group's
        # rank may be back at an earlier orphan's URL
        self._told: dict[tuple[int, str], float] = {}
        self._said: dict[int, str] = {}  # decision id -> the last sentence returned
        self._skipped: set[tuple[int, str]] = set()  # (decision id, rank URL) not told, said
        self._outcome: dict[tuple[int, str], str] = {}  # (decision id, rank URL) -> last answer

    def keep(self, decision_ids: set[int]) -> None:
        """Forget the evictions no longer followed."""
        self._told = {k: t for k, t in self._told.items() if k[0] in decision_ids}
        self._said = {d: n for d, n in self._said.items() if d in decision_ids}
        self._skipped = {k for k in self._skipped if k[0] in decision_ids}
        self._outcome = {k: o for k, o in self._outcome.items() if k[0] in decision_ids}

    def follow(self, decision_id: int, replica_id: str, ranks: list[Any],
               since_kill_s: float, known: Any = None, unreached: bool = False) -> str | None:
        """``grace_s`` after the kill (at once when ``unreached``), tell each of ``ranks`` to
        exit (again every RETELL_S) or, without the token, name them; returns the eviction's
        new detail note, if it changed."""
        if not ranks or since_kill_s < (0.0 if unreached else self.grace_s):
            return None
        names = ", ".join(rank_name(r) for r in ranks)
        never: list[str] = []  # ranks no call reaches (torch's debug server)
        if not self.exits.token and unreached:
            note = (f"the Lighthouse's kill cannot reach a group out of its quorum and no "
                    f"--rank-exit-token is set: nothing but its operator can end it; stop "
                    f"rank(s) {names}")
        elif not self.exits.token:
            note = (f"rank(s) still running {self.grace_s:g}s after the kill: {names}; the "
                    "Lighthouse's kill reaches only group rank 0: stop them before restarting the "
                    "group (or run ranks with LIGHTKEEPER_EXIT_TOKEN and the monitor with "
                    "--rank-exit-token)")
        else:
            skipped, never = [], [rank_name(r) for r in ranks if is_torch(r.url)]
            for r in ranks:
                if is_torch(r.url):  # no call can ever reach it: its operator's to stop
                    continue
                key = (decision_id, r.url)
                told_at = self._told.get(key)
                if told_at is not None and since_kill_s - told_at < self.RETELL_S:
                    continue
                res = self.exits.exit(r, f"replica {replica_id} was evicted by the monitor",
                                      known)
                if res.skipped:  # no call made: checked again next sweep, said once
                    skipped.append(f"{rank_name(r)}: {res.detail}")
                    if key not in self._skipped:
                        self._skipped.add(key)
                        log.warning("did not tell %s of evicted %s to exit yet (checked again "
                                    "each sweep): %s", rank_name(r), replica_id, res.detail)
                    continue
                self._skipped.discard(key)
                self._told[key] = since_kill_s
                self._outcome[key] = f"{rank_name(r)}: {res.detail}"
                log.warning("told %s of evicted %s to exit: %s", rank_name(r), replica_id,
                            res.detail)
            # every rank told so far, not only this sweep's: the note changes only when an
            # outcome or the ranks left out do (a retell every 5 s appends nothing)
            told = [o for k, o in self._outcome.items() if k[0] == decision_id]
            if not told and not skipped and not never:
                return None
            whom = ("every rank of the group, which the Lighthouse's kill cannot reach out of its "
                    "quorum," if unreached else "rank(s) the Lighthouse's kill does not reach")
            note = "; ".join(
                ([f"told {whom} to exit (POST /v1/exit): {'; '.join(told)}"] if told else [])
                + ([f"not told to exit yet (checked again each sweep): {'; '.join(skipped)}"]
                   if skipped else [])
                + ([f"stop rank(s) {', '.join(never)}: {TORCH_ONLY}"] if never else []))
        if self._said.get(decision_id) == note:
            return None
        self._said[decision_id] = note
        if not self.exits.token or never:  # else only the audit row would say ranks live on
            log.warning("eviction of %s: %s", replica_id, note)
        return note


def rank_name(r: Any) -> str:
    s = getattr(r, "state", None) or {}
    return (f"rank {getattr(r, 'rank', '?')} (group rank {s.get('group_rank')}, host "
            f"{s.get('host')}, pid {s.get('pid')}, {getattr(r, 'url', '?')})")
