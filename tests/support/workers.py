"""Small HTTP helpers for tests that read WorkerServers."""

from __future__ import annotations

import subprocess

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


def struck_state(base_url: str, spec: str, timeout: float = 60.0) -> dict:
    """The rank's /v1/state once fault ``spec`` has struck there. A one-off posted live strikes
    at its step, or at the first step past it when the post came late (a loaded machine), so a
    test reads the step it struck at here rather than assuming the one it asked for."""
    from lightkeeper.processes import wait_until

    return wait_until(lambda: (s := try_state(base_url)) and spec in s["faults_struck_at"] and s,
                      timeout, interval=0.2, what=f"{spec!r} to strike at {base_url}")


def torchft_entries(dump: dict, incarnation: dict) -> list[dict]:
    """Entries of ``dump`` that belong to one torchft process-group incarnation."""
    return [e for e in dump["entries"] if e["pg_id"] == incarnation["pg_id"]]


def save_dumps(urls: list[str], directory) -> list:
    """Fetch every rank's /v1/fr_trace into ``directory/rank<N>.json``; returns the paths."""
    import json
    from pathlib import Path

    paths = []
    for url in urls:
        dump = get_json(url + "/v1/fr_trace", timeout=10)
        path = Path(directory) / f"rank{dump['rank']}.json"
        path.write_text(json.dumps(dump))
        paths.append(path)
    return paths


def analyze_cli(*paths) -> tuple[int, dict]:
    """Run ``lightkeeper analyze --format json`` as a user would; (exit status, parsed output)."""
    import json
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "lightkeeper.cli", "analyze", "--format", "json",
                          *map(str, paths)], capture_output=True, text=True, timeout=120)
    return res.returncode, json.loads(res.stdout)


def finish_all(procs: list, label: str, timeout: float = 120.0) -> None:
    """Wait for every process; kill what is left (also on failure); fail the test naming each
    ``label N`` that did not exit 0, with the tail of its stderr."""
    import pytest

    failures = []
    try:
        for i, proc in enumerate(procs):
            try:
                _, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if proc.returncode != 0:
                failures.append(f"{label} {i} exited {proc.returncode}: {err.decode()[-2000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if failures:
        pytest.fail("\n".join(failures))
