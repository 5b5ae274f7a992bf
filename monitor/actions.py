"""Actions: ask the torchft Lighthouse to kill a replica group, the way its Kill button does.

``POST {lighthouse}/replica/{replica_id}/kill`` makes the Lighthouse tell that group's Manager to
exit. torchft 0.2.0 answers 500 ("transport error") because the Manager exits before it replies,
so any HTTP answer counts as *sent*; only when the Lighthouse cannot be reached at all (refused,
DNS, timeout before connecting) is the kill *failed*. Whether it worked is judged afterwards by
the group leaving the quorum (see :mod:`monitor.service`), never by this answer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import quote

import requests

log = logging.getLogger(__name__)


@dataclass
class KillResult:
    sent: bool
    http_status: int | None
    detail: str


class Lighthouse:
    def __init__(self, url: str | None, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/") if url else None
        self.timeout_s = timeout_s
        self._session = requests.Session()

    def kill(self, replica_id: str) -> KillResult:
        """Send the kill request; never raises (the outcome is in the result)."""
        if not self.url:
            return KillResult(False, None, "no --lighthouse configured")
        url = f"{self.url}/replica/{quote(replica_id, safe=':')}/kill"
        try:
            r = self._session.post(url, timeout=self.timeout_s)
        except requests.ConnectTimeout as e:
            return KillResult(False, None, f"Lighthouse unreachable: {e}")
        except requests.ConnectionError as e:
            return KillResult(False, None, f"Lighthouse unreachable: {e}")
        except requests.Timeout:
            # connected and asked; the answer did not come: the Manager may be gone already
            return KillResult(True, None, f"no answer within {self.timeout_s:g}s (request sent)")
        except requests.RequestException as e:
            return KillResult(False, None, f"{type(e).__name__}: {e}")
        if r.status_code == 200:
            return KillResult(True, 200, "killed")
        body = r.text[:300].replace("\n", " ")
        # 0.2.0: the Manager exits before answering the Lighthouse, which reports 500.
        return KillResult(True, r.status_code, f"HTTP {r.status_code} (expected with torchft "
                                               f"0.2.0: Manager exits before replying): {body}")

    def status_html(self) -> str | None:
        """The Lighthouse's ``/status`` page, or None when unreachable (for the overview link)."""
        if not self.url:
            return None
        try:
            r = self._session.get(f"{self.url}/status", timeout=self.timeout_s)
            return r.text if r.ok else None
        except requests.RequestException:
            return None

    def close(self) -> None:
        self._session.close()
