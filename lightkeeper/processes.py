"""Processes this project starts, stopped by PID: waits with a deadline, a process tree's
stop (SIGTERM, then SIGKILL), ports chosen up front, and a monitor started as a child.

Used by :mod:`lightkeeper.cluster`, the demo, the soak and the tests. A PID is signalled only
while it is still the process it was (its start time from /proc): a PID freed since may be
another process's.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path


class ClusterError(RuntimeError):
    """A process of the local job failed to start or to report in time."""


def get_json(http, url: str, timeout: float):
    """``GET url`` with the ``requests`` session ``http``: the JSON answer, or None for an
    error status, no answer or a body that is not JSON (a rank or monitor that is starting,
    exiting or gone is sampled again next tick)."""
    import requests  # the trainer's ranks import this module and never make requests

    try:
        r = http.get(url, timeout=timeout)
        return r.json() if r.ok else None
    except (requests.RequestException, ValueError):
        return None


def wait_until(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


def descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of ``pid`` (from /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc/<pid>/stat), or None: no such
    process. A PID with the start time recorded earlier is still that process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def stamped(pids: list[int]) -> list[tuple[int, int]]:
    """``(pid, start time)`` of each of ``pids`` that runs now, for :func:`signal_same`."""
    return [(pid, t) for pid in pids if (t := start_time(pid)) is not None]


def signal_same(procs: list[tuple[int, int]], sig: int) -> None:
    """Send ``sig`` to each ``(pid, start time)`` still running as that same process: a PID
    freed since (its process exited and was reaped) may be another process's by now."""
    for pid, started in procs:
        if start_time(pid) != started:
            continue
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


# Set by the demo in its environment for every process it starts: "<its pid>:<its start
# time>:<its PID namespace>" (a pid means something only in its namespace)
OWNER_ENV = "LIGHTKEEPER_DEMO_OWNER"


def pid_namespace(pid: int | str = "self") -> int | None:
    """``pid``'s PID namespace (its inode), or None: gone, or not ours to read."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def owner_mark(pid: int) -> str:
    """The :data:`OWNER_ENV` value of a demo running as ``pid`` in this PID namespace."""
    return f"{pid}:{start_time(pid)}:{pid_namespace()}"


def kill_orphans() -> list[int]:
    """SIGKILL every process (that this user may read) whose environment names a demo
    (:data:`OWNER_ENV`) that no longer runs: what a killed demo left, in sessions of their own,
    training on unseen. Returns their PIDs. One in another PID namespace (a demo in a
    container), or marked in one, is not judged: its owner's pid is not this namespace's."""
    key, ns = OWNER_ENV.encode() + b"=", pid_namespace()
    left: list[tuple[int, int]] = []
    for entry in os.listdir("/proc"):
        # its start time read first: a PID reused meanwhile is not signalled (signal_same)
        started = start_time(int(entry)) if entry.isdigit() else None
        if started is None or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:  # gone, or another user's
            continue
        mark = next((v[len(key):].decode(errors="replace") for v in env.split(b"\0")
                     if v.startswith(key)), None)
        if mark is None or pid_namespace(entry) != ns:
            continue
        owner, _, rest = mark.partition(":")
        at, _, marked_ns = rest.partition(":")
        if marked_ns not in ("", str(ns)):
            continue
        if not owner.isdigit() or str(start_time(int(owner))) != at:
            left.append((int(entry), started))
    signal_same(left, signal.SIGKILL)
    return [pid for pid, _ in left]


def stop_process(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Stop a process we started and all its descendants, by PID: SIGTERM, then SIGKILL after
    ``grace`` seconds (at once when ``grace`` is 0).

    Descendants are found through /proc rather than the process group: torchrun puts its
    workers in sessions of their own, so a group signal would leave them running. A process
    that already exited is signalled nothing: once reaped its PID is free for another process,
    and its children, reparented when it exited, are no longer found through it.
    """
    if proc.poll() is not None:
        return
    # not reaped yet, so proc.pid is still ours (a zombie at worst) until proc.wait()
    tree = stamped([proc.pid, *descendants(proc.pid)])
    if grace > 0:
        signal_same(tree, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is None:  # still running: its tree as it is now, too
            tree += stamped([proc.pid, *descendants(proc.pid)])
    signal_same(tree, signal.SIGKILL)
    proc.wait(timeout=30)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (for MASTER_PORT, which must be known up front).

    Chosen below the kernel's ephemeral range: a port the kernel handed out with ``bind(0)`` and
    we released can be taken by any outgoing connection before rank 0 listens on it (seen with
    ~18,000 sockets open: rank 0 failed with EADDRINUSE). Falls back to ``bind(0)`` when no port
    below the range is free.
    """
    import random

    low = _ephemeral_low()
    rng = random.Random()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # ::1 and other IPv6 literals
    host = host.strip("[]")
    for _ in range(50):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# `python -m`/`-c` children put the working directory first on sys.path: a user's own trainer/
# or monitor/ package there would be imported instead of Lightkeeper's
SAFE_PATH = {"PYTHONSAFEPATH": "1"}


def start_monitor_process(cmd: list[str], out_path: Path, log_path: Path,
                          env: dict[str, str] | None = None,
                          timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """Start ``lightkeeper monitor --port 0 ...`` (``cmd``) in its own session, its stdout to
    ``out_path`` and stderr to ``log_path``; return the process and the URL it printed
    (``monitor=URL``). Raises :class:`ClusterError` with the log's tail if it exits first, and
    ``TimeoutError`` if it prints no URL within ``timeout`` (the process is the caller's to stop).
    The log is appended to: a restarted monitor keeps its earlier life's lines."""
    env = {**(os.environ if env is None else env), **SAFE_PATH}
    with open(out_path, "wb") as out, open(log_path, "ab") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True, env=env)

    def url():
        if proc.poll() is not None:
            raise ClusterError(f"monitor exited with {proc.returncode}: "
                               f"{log_path.read_text(errors='replace')[-2000:]}")
        for word in out_path.read_text(errors="replace").split():
            if word.startswith("monitor="):
                return word.split("=", 1)[1]
        return None

    try:
        return proc, wait_until(url, timeout, what="the monitor to serve")
    except BaseException:
        stop_process(proc, grace=1.0)
        raise
