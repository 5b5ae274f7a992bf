"""The torchft Lighthouse's newest quorum and heartbeats, parsed from its ``/status`` HTML.
A page of another shape is a :class:`StatusFormatError`, never an empty quorum: fail closed.
"""

from __future__ import annotations

import html
import re
import time
from dataclasses import dataclass, field

import requests

from http_serving import failure_reason, redact_url

MAX_STATUS_BYTES = 16 << 20  # ~600 bytes per replica group: room for ~25,000 of them

_CURRENT = re.compile(r"Current quorum_id:\s*(-?\d+)\s*<br>")
_NEXT = re.compile(r"Next quorum status:([^<]*)")  # quorum_compute's reason, e.g. a join wait
_PREVIOUS = re.compile(r"Previous quorum id:\s*(\d+)\s*<br>\s*Num participants:\s*(\d+)\s*<br>")
# a field is [^<]* up to its tag, stripped after: ".*?" and "\s*" around it backtracked
# (a 5 KB page took a minute)
_MEMBER = re.compile(
    r'<div class="member\s*(?:(recovering)\s*)?">\s*<b>([^<]*)</b>\s*<br/>\s*'
    r"Step:\s*(-?\d+)\s*<br/>\s*Manager:([^<]*)<br/>\s*TCPStore:([^<]*)<br/>\s*"
    r"World size:\s*(\d+)\s*<br/>")
_MEMBER_START = re.compile(r'<div class="member\b')
_HEARTBEAT = re.compile(r'<li class="heartbeat\s*(?:(old)\s*)?">\s*(.+):\s+seen\s+([0-9.]+)'
                        r"\s*(ns|µs|us|ms|s)\s+ago\s*</li>")
_HEARTBEAT_START = re.compile(r'<li class="heartbeat\b')
_UNITS = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


class StatusFormatError(ValueError):
    """The page is not a torchft 0.2.0 Lighthouse ``/status`` fragment."""


@dataclass(frozen=True)
class QuorumMember:
    replica_id: str
    step: int
    store: str
    world_size: int  # ranks in the replica group


@dataclass(frozen=True)
class LighthouseStatus:
    quorum_id: int | None  # the newest quorum the Lighthouse issued; None before the first
    members: dict[str, QuorumMember]  # its participants, by replica_id
    heartbeats: dict[str, float]  # replica_id -> seconds since its last heartbeat
    stale: frozenset[str] = field(default_factory=frozenset)  # heartbeats past the timeout
    at: float = 0.0
    next_status: str = ""  # why the next quorum is not issued yet ("" when not shown)

    def heartbeating(self, replica_id: str) -> bool:
        return replica_id in self.heartbeats and replica_id not in self.stale

    def to_dict(self) -> dict:
        """As read (an incident bundle's): each heartbeat's age is seconds before ``at``."""
        return {"read_at": self.at, "quorum_id": self.quorum_id,
                "members": {rid: {"step": m.step, "world_size": m.world_size}
                            for rid, m in self.members.items()},
                "heartbeat_age_s": dict(self.heartbeats), "stale": sorted(self.stale),
                "next_status": self.next_status}


def parse_status(page: str, at: float = 0.0) -> LighthouseStatus:
    """Parse the ``/status`` fragment; raises StatusFormatError when it has another shape."""
    current = _CURRENT.search(page)
    if current is None or "<h3>Previous Quorum</h3>" not in page or "<h2>Heartbeats</h2>" \
            not in page:
        raise StatusFormatError("not a torchft Lighthouse /status page (no quorum_id, quorum "
                                "or heartbeat section)")
    quorum_part, _, heartbeat_part = page.partition("<h2>Heartbeats</h2>")
    nxt = _NEXT.search(quorum_part.partition("<h3>Previous Quorum</h3>")[0])
    members: dict[str, QuorumMember] = {}
    previous = _PREVIOUS.search(quorum_part)
    if previous is None:
        if _MEMBER_START.search(quorum_part):
            raise StatusFormatError("quorum members without a quorum id")
        quorum_id = None if int(current.group(1)) <= 0 else int(current.group(1))
    else:
        quorum_id = int(previous.group(1))
        for m in _MEMBER.finditer(quorum_part):
            rid = html.unescape(m.group(2))
            members[rid] = QuorumMember(rid, int(m.group(3)), html.unescape(m.group(5).strip()),
                                        int(m.group(6)))
        declared = int(previous.group(2))
        found = len(_MEMBER_START.findall(quorum_part))
        if not declared == found == len(members):
            raise StatusFormatError(f"quorum {quorum_id} declares {declared} participants; "
                                    f"{found} member blocks, {len(members)} understood")
    heartbeats: dict[str, float] = {}
    stale = set()
    for h in _HEARTBEAT.finditer(heartbeat_part):
        rid = html.unescape(h.group(2).strip())
        heartbeats[rid] = float(h.group(3)) * _UNITS[h.group(4)]
        if h.group(1):
            stale.add(rid)
    if len(_HEARTBEAT_START.findall(heartbeat_part)) != len(heartbeats):
        raise StatusFormatError("heartbeat entries that could not be read")
    return LighthouseStatus(quorum_id, members, heartbeats, frozenset(stale), at,
                            html.unescape(nxt.group(1).strip()) if nxt else "")


class LighthouseReader:
    """Reads ``{lighthouse}/status``: ``timeout_s`` per socket operation, the body given up
    past twice that overall. A host name's lookup is not covered: the system resolver's own
    timeouts bound it (an IP address in ``--lighthouse`` needs none)."""

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        self.url = url.rstrip("/")
        self.shown = redact_url(self.url)  # in the messages, which are shown and logged
        self.timeout_s = timeout_s
        self._session = requests.Session()

    def read(self) -> tuple[LighthouseStatus | None, str | None]:
        """(status, None), or (None, why it could not be read or understood); never raises."""
        deadline = time.monotonic() + 2 * self.timeout_s
        try:
            with self._session.get(self.url + "/status", timeout=self.timeout_s,
                                   stream=True) as r:
                if r.status_code != 200:
                    return None, f"{self.shown}/status answered HTTP {r.status_code}"
                body = bytearray()
                for chunk in r.iter_content(65536):
                    body += chunk
                    if len(body) > MAX_STATUS_BYTES:
                        return None, f"{self.shown}/status is larger than {MAX_STATUS_BYTES} bytes"
                    if time.monotonic() > deadline:
                        return None, f"{self.shown}/status took longer than " \
                                     f"{2 * self.timeout_s:g}s"
            return parse_status(body.decode("utf-8", "replace"), time.time()), None
        except StatusFormatError as e:
            return None, f"{self.shown}/status: {e}"
        except (requests.RequestException, ValueError) as e:  # urllib3: a host it cannot parse
            # an invalid URL's text holds it whole
            why = failure_reason(e) or f"{type(e).__name__}: {redact_url(str(e))}"
            return None, f"{self.shown}/status unreachable: {why}"

    def close(self) -> None:
        self._session.close()
