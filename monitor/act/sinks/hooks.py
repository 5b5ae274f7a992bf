"""Two generic sinks: an exec hook (``exec:CMD``, the event's JSON on stdin) and a signed
webhook (``webhook:URL``, HMAC-SHA256 of the body). Contract and retries: docs/quarantine.md.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shlex
import subprocess
from typing import Any

import requests

from .base import ActionResult, SinkConfigError

SIGNATURE_HEADER = "X-Lightkeeper-Signature"
EVENT_HEADER = "X-Lightkeeper-Event"


def event_bytes(event: dict[str, Any]) -> bytes:
    return json.dumps(event, sort_keys=True, default=str).encode()


def sign(secret: str, body: bytes) -> str:
    """The signature header's value for ``body``: ``sha256=<hex>``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def signature_matches(secret: str, body: bytes, header: str | None) -> bool:
    """For receivers: constant-time check of a signature header."""
    return bool(header) and hmac.compare_digest(sign(secret, body), header)


class ExecSink:
    def __init__(self, command: str, timeout_s: float = 10.0) -> None:
        self.argv = shlex.split(command)
        if not self.argv:
            raise SinkConfigError("exec hook: empty command")
        self.name = f"exec:{self.argv[0]}"
        self.timeout_s = timeout_s

    def run(self, event: dict[str, Any]) -> ActionResult:
        env = {**os.environ, "LIGHTKEEPER_EVENT": str(event.get("event")),
               "LIGHTKEEPER_HOST": str(event.get("host")),
               "LIGHTKEEPER_NODE": str(event.get("node") or event.get("host"))}
        try:
            p = subprocess.run(self.argv, input=event_bytes(event), capture_output=True,
                               timeout=self.timeout_s, env=env, check=False)
        except (FileNotFoundError, PermissionError) as e:
            return ActionResult(False, f"cannot run {self.argv[0]!r}: {e}", retry=False)
        except subprocess.TimeoutExpired:
            return ActionResult(False, f"{self.argv[0]} did not finish within "
                                       f"{self.timeout_s:g}s (killed)")
        except OSError as e:
            return ActionResult(False, f"cannot run {self.argv[0]!r}: {e}")
        if p.returncode == 0:
            return ActionResult(True, f"{self.argv[0]} exited 0")
        err = p.stderr.decode(errors="replace").strip()[-300:]
        return ActionResult(False, f"{self.argv[0]} exited {p.returncode}: {err}")

    quarantine = release = run


class WebhookSink:
    def __init__(self, url: str, secret: str | None, timeout_s: float = 10.0) -> None:
        if not secret:
            raise SinkConfigError("webhook: a signing secret is required (--webhook-secret or "
                                  "LIGHTKEEPER_WEBHOOK_SECRET)")
        self.url = url
        self.name = f"webhook:{url}"
        self._secret = secret
        self.timeout_s = timeout_s
        self._session = requests.Session()

    def post(self, event: dict[str, Any]) -> ActionResult:
        body = event_bytes(event)
        headers = {"Content-Type": "application/json", EVENT_HEADER: str(event.get("event")),
                   SIGNATURE_HEADER: sign(self._secret, body)}
        try:
            r = self._session.post(self.url, data=body, headers=headers, timeout=self.timeout_s)
        except requests.Timeout:
            return ActionResult(False, f"no answer within {self.timeout_s:g}s")
        except requests.RequestException as e:
            return ActionResult(False, f"unreachable: {type(e).__name__}")
        if 200 <= r.status_code < 300:
            return ActionResult(True, f"HTTP {r.status_code}")
        retry = r.status_code >= 500 or r.status_code in (408, 429)
        return ActionResult(False, f"HTTP {r.status_code}: {r.text[:200]}", retry=retry)

    quarantine = release = post
