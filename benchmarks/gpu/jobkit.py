"""What the GPU job scripts share (torch_only_e2e.py, trainer_cuda.py, straggler_cuda.py): ports,
polling with a deadline, starting processes and a Lighthouse, and ending every process they
started whatever happened. Standard library only: the
scripts run with the GPU machine's own Python and a ``--deps`` folder."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, post: bool = False, body: dict | None = None, token: str | None = None):
    """The answer's JSON (its text when it is not JSON); ``post``: torch's handlers; ``body``:
    POST it as JSON, with ``token`` as the bearer token."""
    data = json.dumps(body).encode() if body is not None else b"" if post else None
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, headers=headers,
                                 method="GET" if data is None else "POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read()
    try:
        return json.loads(body)
    except ValueError:
        return body.decode(errors="replace")


def until(fn, timeout: float, what: str):
    """``fn()``'s first truthy value, asked every 0.5 s; an answer not there yet (a server not
    serving, half a document) is asked again; ``TimeoutError(what)`` at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = fn()
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
            got = None
        if got:
            return got
        time.sleep(0.5)
    raise TimeoutError(what)


@contextlib.contextmanager
def recorded(procs: list[subprocess.Popen], path: Path, record: dict):
    """The script's body: an exception becomes ``record["error"]`` (``ok`` false); then every
    started process's session is killed and ``record`` written to ``path`` and printed."""
    try:
        yield
    except Exception as e:
        record["error"] = f"{type(e).__name__}: {e}"
        record["ok"] = False
    finally:
        for p in reversed(procs):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
        path.write_text(json.dumps(record, indent=1, default=str))
        print(json.dumps(record, indent=1, default=str)[:6000])


def starter(procs: list[subprocess.Popen], out: Path, env: dict):
    """``start(cmd, name, extra=None)``: ``cmd`` in a session of its own with ``env`` (and
    ``extra``), its output in ``out/<name>.log``, added to ``procs`` for recorded() to end."""
    def start(cmd: list[str], name: str, extra: dict | None = None) -> subprocess.Popen:
        with open(out / f"{name}.log", "wb") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                 env={**env, **(extra or {})}, start_new_session=True)
        procs.append(p)
        return p
    return start


def lighthouse(start, out: Path, script: str, min_replicas: int = 1,
               heartbeat_ms: int = 1000) -> str:
    """A real torchft Lighthouse (``script``: lightkeeper.cluster.LIGHTHOUSE_SCRIPT, join
    timeout 1 s) started with ``start``; its URL once it serves."""
    url_file = out / "lighthouse.url"
    url_file.unlink(missing_ok=True)  # a run before in the same folder
    start([sys.executable, "-u", "-c", script, str(min_replicas), "1000", str(heartbeat_ms),
           str(url_file), "127.0.0.1"], "lighthouse")
    return until(lambda: url_file.exists() and url_file.read_text().strip(), 30,
                 "the Lighthouse")


def worker_url(log: Path, timeout: float = 120) -> str:
    """The WorkerServer URL ``lightkeeper train`` printed to ``log`` (``worker_server=URL``)."""
    line = re.compile(r"worker_server=(\S+)")
    return until(lambda: (m := line.search(log.read_text())) and m.group(1), timeout,
                 f"the WorkerServer in {log.name}")
