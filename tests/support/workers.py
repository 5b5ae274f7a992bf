"""Small HTTP helpers for tests that read WorkerServers."""

from __future__ import annotations

import requests


def get_json(url: str, timeout: float = 2.0):
    r = requests.get(url, timeout=timeout)
    r.raise_for_status()
    return r.json()


def try_state(base_url: str) -> dict | None:
    """A rank's /v1/state, or None while it is unreachable."""
    try:
        return get_json(base_url + "/v1/state")
    except (requests.RequestException, ValueError):
        return None


def torchft_entries(dump: dict, incarnation: dict) -> list[dict]:
    """Entries of ``dump`` that belong to one torchft process-group incarnation."""
    return [e for e in dump["entries"] if e["pg_id"] == incarnation["pg_id"]]
