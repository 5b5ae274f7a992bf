"""The probe mesh: one verified rank per host asked (``POST <rank>/v1/probe``, signed with the
ranks' token for that rank: rank_wire.auth) to time a transfer from its peers (docs/monitor.md, The
probe mesh). A round runs on its own thread, one at a time; a rank that gives no results is named
in one warning, nothing raises into the sweep.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import requests

from monitor.config import REFUSED_SIGNATURE, ProbeConfig
from monitor.poll.torch_target import is_torch
from rank_wire import auth

from .claims import Claims
from .view import ClusterView, RankView

log = logging.getLogger(__name__)

MAX_ANSWER_BYTES = 1 << 20  # a probe answer: a few hundred bytes per peer
_REFUSED = {404: "no /v1/probe route (an older WorkerServer)",
            401: "refused the token (HTTP 401: LIGHTKEEPER_EXIT_TOKEN differs, or the rank "
                 "takes only signed calls: LIGHTKEEPER_EXIT_AUTH=hmac)",
            403: "probes off on the rank (HTTP 403: no LIGHTKEEPER_EXIT_TOKEN)",
            429: "busy: another probe was running on the rank (HTTP 429)"}
_REFUSED_SIGNED = f"refused the signature (HTTP 401: {REFUSED_SIGNATURE})"  # --rank-auth hmac
BUSY_RETRIES = 2  # a 429 (another monitor probing the rank) is asked again this often at most


@dataclass
class HostProbe:
    """One host's row of the mesh: the rank asked and what it measured, by peer host."""

    host: str
    url: str
    rank: int | None
    peers: dict[str, str]  # peer host -> the URL it was asked to reach
    # the rank's last /v1/state: the identity a call to it is signed for
    state: dict[str, Any] | None = field(default=None, repr=False)
    status: int | None = None  # the HTTP answer; None: none came
    error: str | None = None  # why there are no results
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # peer host -> its link
    control: dict[str, Any] | None = None  # the rank's transfer from itself; None: not sent


@dataclass
class ProbeRound:
    started_at: float  # the monitor's clock
    finished_at: float
    probes: dict[str, HostProbe]  # by host

    def missing(self) -> dict[str, str]:
        """Hosts whose rank gave no results, and why."""
        return {h: p.error or f"HTTP {p.status}" for h, p in sorted(self.probes.items())
                if p.status != 200}

    def controls(self) -> dict[str, dict[str, Any]]:
        """host -> its rank's transfer from itself (no network in it), where it sent one."""
        return {h: p.control for h, p in sorted(self.probes.items())
                if p.status == 200 and p.control is not None}

    def matrix(self) -> dict[str, dict[str, dict[str, Any]]]:
        """from host -> to host -> the link as measured from the first."""
        return {h: dict(sorted(p.results.items())) for h, p in sorted(self.probes.items())}

    def to_json(self) -> dict[str, Any]:
        return {"started_at": self.started_at, "finished_at": self.finished_at,
                "asked": {h: {"rank": p.rank, "url": p.url, "status": p.status,
                              "error": p.error, "peers": sorted(p.peers),
                              "control": p.control}
                          for h, p in sorted(self.probes.items())},
                "matrix": self.matrix()}


def _number(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
        return float(v)
    return None


def _answer_text(raw: bytes) -> str:
    """A refusal's words as the rank gave them (its JSON ``error``, else the body): one line,
    at most 120 characters."""
    text = raw[:4096].decode("utf-8", "replace")
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        text = doc["error"]
    return " ".join(text.split())[:120] or "(no text)"


def link_row(row: dict[str, Any]) -> dict[str, Any]:
    """One result as the monitor keeps it: typed, the rest dropped."""
    err = row.get("error")
    return {"ok": row.get("ok") is True, "connect_s": _number(row.get("connect_s")),
            "transfer_s": _number(row.get("transfer_s")), "mbit_s": _number(row.get("mbit_s")),
            "error": str(err)[:200] if err is not None else None}


def control_row(raw: Any) -> dict[str, Any] | None:
    """A rank's transfer from itself as the monitor keeps it, when it says one thing: worked
    (with a rate) or failed (with why); None otherwise (an older WorkerServer sends none, and
    a shape this monitor does not know must not spare a host)."""
    if not isinstance(raw, dict):
        return None
    row = link_row(raw)
    worked = raw.get("ok") is True and row["mbit_s"] is not None
    failed = raw.get("ok") is False and isinstance(raw.get("error"), str)
    return row if worked or failed else None


def plan(ranks: dict[str, RankView], peers: int) -> dict[str, list[str]]:
    """host -> the hosts its rank probes: every other one up to ``peers + 1`` hosts, else the
    next ``peers`` in a ring of the sorted hosts."""
    hosts = sorted(ranks)
    n = len(hosts)
    k = min(peers, n - 1)
    return {h: [hosts[(i + j) % n] for j in range(1, k + 1)] for i, h in enumerate(hosts)}


def pick(view: ClusterView, evicted: Collection[str] = (),
         skip: Callable[[RankView], bool] | None = None) -> dict[str, RankView]:
    """One rank per host: the lowest verified rank of the newest quorum that answered this
    sweep, none of a replica id in ``evicted`` (its kill was sent) nor one ``skip`` names (asked
    only of the rank about to be picked)."""
    by_host: dict[str, list[RankView]] = {}
    for gv in view.in_quorum():
        for r in gv.reachable:
            host = (r.state or {}).get("host")
            if r.replica_id in evicted or not r.fresh or not host or r.rank is None \
                    or is_torch(r.url):  # torch's debug server serves no /v1/probe
                continue
            by_host.setdefault(host, []).append(r)
    out: dict[str, RankView] = {}
    for host, ranks in by_host.items():
        for r in sorted(ranks, key=lambda r: (r.rank, r.url)):
            if skip is None or not skip(r):
                out[host] = r
                break
    return out


def peer_url(r: RankView) -> str:
    """The address a peer reaches the rank at: what it advertises, else what the monitor polls."""
    adv = (r.state or {}).get("worker_url")
    return adv.rstrip("/") if isinstance(adv, str) and adv.startswith("http") else r.url


class ProbeMesh:
    """Rounds of probes. ``clock``: the monitor's (the rate limit's); ``token``: the ranks';
    ``auth``: how a call carries it (``hmac``: signed for the rank asked; ``bearer``: the token
    itself, for ranks older than signatures)."""

    def __init__(self, cfg: ProbeConfig, token: str | None,
                 clock: Callable[[], float] = time.time, auth: str = "hmac",
                 claims: Claims | None = None) -> None:
        # a secret file's final newline is no header value (requests refuses it)
        self.cfg, self.token, self.clock = cfg, (token or "").strip() or None, clock
        self.auth = auth
        self.claims = claims or Claims()  # the monitor's, shared with its calls to ranks
        self._thread: threading.Thread | None = None
        self._finished: ProbeRound | None = None
        self._lock = threading.Lock()
        self._started_at = float("-inf")
        self._said: dict[str, str] = {}  # topic -> the line last logged
        self.last: ProbeRound | None = None  # the last round finished (for the API)
        self.rounds = 0
        self.note: str | None = None  # why the last wanted round was not asked

    def take(self) -> ProbeRound | None:
        """The round finished since the last call, once."""
        with self._lock:
            done, self._finished = self._finished, None
        return done

    def ask(self, view: ClusterView, wanted: bool, blind: str | None, now: float,
            evicted: Collection[str] = (), known: ClusterView | None = None,
            standby: bool = False) -> None:
        """Start a round of one rank per host (:func:`pick`) if ``wanted`` and due; none while
        ``blind`` nor on a ``standby`` shard (its active monitor probes: both would find ranks
        busy, 429). ``known``: the sweep's whole view, for :class:`Claims`."""
        if not wanted:
            self.note = None
            return
        if not self.cfg.enabled:
            return self._hold("off", "network probes are off (--no-probes): a network fault's "
                                     "host is not looked for")
        urls = (known or view).ranks
        if urls and all(map(is_torch, urls)):  # nothing to ask, whatever the token
            return self._hold("torch", "network probes need ranks running Lightkeeper's "
                                       "WorkerServer (torch's debug server serves no /v1/probe): "
                                       "a network fault's host is not looked for")
        if not self.token:
            return self._hold("token", "network probes need the Lightkeeper ranks' token "
                                       "(--rank-exit-token / LIGHTKEEPER_EXIT_TOKEN): a network "
                                       "fault's host is not looked for")
        if blind:
            return self._hold("blind", f"network probes held: {blind}")
        if standby:
            return self._hold("standby", "network probes held: this monitor stands by for its "
                                         "shard (another monitor started with the same --shard "
                                         "runs it and probes its ranks)")
        self._said.pop("standby", None)
        if self.running() or now - self._started_at < self.cfg.interval_s:
            return
        ranks = pick(view, evicted, lambda r: self.claims.why_not(known, r) is not None)
        if len(ranks) < 2:
            return self._hold("hosts", f"network probes need two hosts or more, the job runs "
                                       f"on {len(ranks)}")
        self.note = None
        self._said.pop("blind", None)
        self._started_at = now
        self._thread = threading.Thread(target=self._round, args=(ranks, now), daemon=True,
                                        name="lightkeeper-probes")
        self._thread.start()

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float) -> bool:
        """Wait for the round under way (tests, shutdown); True when none runs."""
        t = self._thread
        if t is not None:
            t.join(timeout)
        return not self.running()

    def close(self) -> None:
        """Give a round under way a moment (its thread is a daemon: nothing waits on it)."""
        self.wait(self.cfg.timeout_s + 1)

    def _hold(self, topic: str, line: str) -> None:
        self.note = line
        self._say(topic, line)

    def _say(self, topic: str, line: str) -> None:
        """Log ``line`` once while it stays the same."""
        if self._said.get(topic) != line:
            self._said[topic] = line
            log.warning("%s", line)

    def _round(self, ranks: dict[str, RankView], started: float) -> None:
        try:
            mesh = plan(ranks, self.cfg.peers)
            probes = {h: HostProbe(h, ranks[h].url, ranks[h].rank,
                                   {p: peer_url(ranks[p]) for p in mesh[h]}, ranks[h].state)
                      for h in mesh}
            # the longest one ask takes (connect, then its most peers one after another): a
            # rank busy with another monitor's probe is asked again within it
            deadline = time.monotonic() + self.cfg.timeout_s * (self.cfg.peers + 2) + 1.0
            with ThreadPoolExecutor(max_workers=min(self.cfg.workers, len(probes)),
                                    thread_name_prefix="lightkeeper-probe") as ex:
                list(ex.map(lambda p: self._ask(p, deadline), probes.values()))
            rnd = ProbeRound(started, self.clock(), probes)
            self._warn_missing(rnd)
        except Exception:  # a bug here must not end monitoring: no round
            log.exception("probe round failed")
            return
        with self._lock:
            self._finished = self.last = rnd
            self.rounds += 1

    def _ask(self, p: HostProbe, deadline: float = math.inf) -> None:
        """Fill ``p`` from its rank's answer; a busy rank (429: another monitor probing it) is
        asked again, :data:`BUSY_RETRIES` times at most, within ``deadline`` (monotonic). Never
        raises."""
        body = {"peers": list(p.peers.values()), "bytes": self.cfg.size_bytes,
                "timeout_s": self.cfg.timeout_s}
        # the rank may probe its peers one after another, each up to timeout_s
        read_s = self.cfg.timeout_s * (len(p.peers) + 1) + 1.0
        url, data = f"{p.url.rstrip('/')}/v1/probe", json.dumps(body).encode()
        for retry in range(BUSY_RETRIES + 1):
            if retry:
                # another probe takes about timeout_s (a rank probes 16 peers at once)
                left = deadline - time.monotonic() - self.cfg.timeout_s
                if left < self.cfg.timeout_s:
                    break  # no time left for an answer
                time.sleep(self.cfg.timeout_s)
                read_s = min(read_s, left)
            try:
                authorization = auth.authorization(self.token or "", self.auth, "/v1/probe",
                                                   data, auth.identity_of(p.state))
                with requests.post(url, data=data, stream=True,
                                   headers={"Authorization": authorization,
                                            "Content-Type": "application/json"},
                                   timeout=(self.cfg.timeout_s, read_s)) as r:
                    p.status = r.status_code
                    raw = r.raw.read(MAX_ANSWER_BYTES + 1, decode_content=True)
            except (requests.RequestException, ValueError) as e:  # ValueError: a bad URL
                p.status, p.error = None, f"no answer: {type(e).__name__}"
                return
            if p.status != 429:
                break
        if p.status != 200:
            p.error = _REFUSED_SIGNED if p.status == 401 and self.auth == "hmac" \
                else _REFUSED.get(p.status, f"HTTP {p.status}")
            if p.status == 401 and self.auth == "bearer":  # the rank's why (it holds no secret)
                p.error += f": {_answer_text(raw)}"
            return
        try:
            if len(raw) > MAX_ANSWER_BYTES:
                raise ValueError(f"larger than {MAX_ANSWER_BYTES} bytes")
            doc = json.loads(raw)
            rows = doc.get("results") if isinstance(doc, dict) else None
            if not isinstance(rows, list):
                raise ValueError("no results list")
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
            p.status, p.error = None, f"bad answer: {e}"
            return
        host_of = {url: h for h, url in p.peers.items()}
        for row in rows:
            if isinstance(row, dict) and isinstance(row.get("peer"), str) \
                    and row["peer"] in host_of:
                p.results[host_of[row["peer"]]] = link_row(row)
        for h in p.peers:  # a peer the rank left out: not measured, so not good
            p.results.setdefault(h, link_row({"error": "not in the rank's answer"}))
        p.control = control_row(doc.get("control"))

    def _warn_missing(self, rnd: ProbeRound) -> None:
        missing = rnd.missing()
        if not missing:
            self._said.pop("missing", None)
            return
        kinds = sorted(set(missing.values()))
        self._say("missing", f"network probes: {len(missing)} of {len(rnd.probes)} host(s) gave "
                             f"no results ({'; '.join(kinds)}: "
                             f"{', '.join(sorted(missing))}): no network culprit can be named "
                             "while a host's row is missing")

    def to_json(self) -> dict[str, Any]:
        last = self.last
        return {"enabled": self.cfg.enabled and bool(self.token), "rounds": self.rounds,
                "running": self.running(), "note": self.note,
                "last": last.to_json() if last is not None else None}
