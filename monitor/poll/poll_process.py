"""The poller in its own process, off the monitor's GIL (docs/scaling.md): the child sends raw
bodies back in batches; one that dies or hangs fails its sweep's missing polls as ``monitor``:
the monitor's fault, no evidence of the ranks: carried as not asked, as a poll without a
descriptor is.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import queue
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, BinaryIO

import msgspec

from .poller import MAX_BODY, STATE_PATH, Poller, RankPoll, dedup_queries, rank_poll

BATCH = 256  # polls per message back
GUARD_S = 30.0  # a child silent this long past its sweep's bound is stuck, and is killed
_LEN = struct.Struct("<I")
_ENCODE = msgspec.msgpack.Encoder().encode
_DECODE = msgspec.msgpack.Decoder().decode
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds monitor/

log = logging.getLogger(__name__)


def _frame(msg: Any) -> bytes:
    body = _ENCODE(msg)
    return _LEN.pack(len(body)) + body


def _read_frame(f: BinaryIO) -> Any | None:
    """The next message, or None at the end of the stream (or a cut one)."""
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    body = f.read(n)
    if len(body) < n:
        return None
    return _DECODE(body)


class PollHandle:
    """One sweep sent to the child: the reader thread queues its batches, :meth:`result` parses
    them in the thread that asks."""

    __slots__ = ("urls", "state", "results", "batches", "why", "bound_s", "child", "sent_at",
                 "finished_at")

    def __init__(self, urls: list[str], bound_s: float, child: _Child | None,
                 state: bool = False) -> None:
        self.urls = urls
        self.state = state  # polls of STATE_PATH: kept packed
        self.results: dict[str, RankPoll] = {}
        self.batches: queue.SimpleQueue[list | None] = queue.SimpleQueue()
        self.why: str | None = None  # the child died: the error of the polls that never came
        self.bound_s = bound_s
        self.child = child
        self.sent_at = time.monotonic()
        self.finished_at: float | None = None  # when the last poll came (or the child died)
        if not urls:
            self.finish(None)

    def finish(self, why: str | None) -> None:
        self.finished_at = time.monotonic()
        self.why = why
        self.batches.put(None)

    def result(self) -> dict[str, RankPoll]:
        """url -> RankPoll in the order sent (never raises because of a rank or the child)."""
        urls, results, state = self.urls, self.results, self.state
        deadline = self.sent_at + self.bound_s + GUARD_S
        killed = False
        while True:
            try:
                rows = self.batches.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                if killed:  # not even its reader answered: give up on it
                    self.why = self.why or "no answer: the monitor's poller process is stuck"
                    break
                log.warning("the monitor's poller process (pid %d) sent nothing for %.0fs past "
                            "its sweep's bound: killed", self.child.proc.pid, GUARD_S)
                self.child.kill()  # stuck: its reader then finishes this sweep
                killed, deadline = True, time.monotonic() + GUARD_S
                continue
            if rows is None:
                self.batches.put(None)  # a second call returns the same
                break
            for row in rows:
                results[urls[row[0]]] = rank_poll(urls[row[0]], row, state)
        if self.why is not None and len(results) < len(urls):
            now, latency = time.time(), time.monotonic() - self.sent_at
            for url in urls:
                if url not in results:
                    # the monitor's own failure: no evidence against the rank (ViewBuilder)
                    results[url] = RankPoll(url, False, reason="monitor", error=self.why,
                                            latency_s=latency, at=now)
        return {u: results[u] for u in urls}


class _Child:
    """One poller process, the sweeps sent to it and the thread reading its answers."""

    def __init__(self, lock: threading.Lock, settings: tuple) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        # from the package's own root: the monitor's working folder may hold another `monitor`
        self.proc = subprocess.Popen([sys.executable, "-m", "monitor.poll.poll_process"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     cwd=_ROOT)
        self.pending: dict[int, PollHandle] = {}
        self.dead = False
        self.lock = lock  # the ProcessPoller's
        self.write_lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, name="lightkeeper-poll-reader",
                                       daemon=True)
        self.reader.start()
        self.send(settings)

    def send(self, msg: Any) -> None:
        # gone: the reader fails its sweeps at the EOF
        with contextlib.suppress(OSError, ValueError), self.write_lock:
            self.proc.stdin.write(_frame(msg))
            self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def _read(self) -> None:
        out = self.proc.stdout
        try:
            while (msg := _read_frame(out)) is not None:
                rid, rows, last = msg
                handle = self.pending.get(rid)
                if handle is None:
                    continue
                handle.batches.put(rows)
                if last:
                    with self.lock:
                        self.pending.pop(rid, None)
                    handle.finish(None)
        except Exception:  # a garbled stream: the child is of no further use
            self.kill()
        with self.lock:
            self.dead = True
            left, self.pending = list(self.pending.values()), {}
        try:
            code = self.proc.wait(timeout=GUARD_S)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.wait()
        why = (f"no answer: the monitor's poller process (pid {self.proc.pid}) exited with code "
               f"{code} during this sweep (the monitor's fault, not the rank's); a new one "
               "polls the next sweep")
        if left:  # once a death: each of its polls is counted as reason "monitor"
            log.warning("%s; %d sweep(s) in flight, their missing polls carried as not asked",
                        why.removeprefix("no answer: "), len(left))
        for handle in left:
            handle.finish(why)


class ProcessPoller:
    """The :class:`~monitor.poll.poller.Poller`'s calls, polling in a child process."""

    def __init__(self, timeout_s: float = 0.8, max_concurrency: int = 1024,
                 max_idle: int = 4096, max_bytes: int = MAX_BODY,
                 event_loop: str = "auto") -> None:
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.max_idle = max_idle
        self.max_bytes = max_bytes
        self.event_loop = event_loop  # the child's (poller.new_event_loop)
        self._lock = threading.Lock()
        self._next = 0
        self._closed = False
        self._child = self._spawn()

    @property
    def pid(self) -> int:
        """The current child's process id."""
        return self._child.proc.pid

    def _spawn(self) -> _Child:
        return _Child(self._lock, (self.timeout_s, self.max_concurrency, self.max_bytes,
                                   self.event_loop))

    def start(self, urls: Iterable[str], path: str = STATE_PATH,
              timeout_s: float | None = None, max_bytes: int | None = None,
              queries: Sequence[str] | None = None) -> PollHandle:
        """Send a sweep to the child; :meth:`PollHandle.result` is what :meth:`Poller.sweep`
        would return."""
        urls, queries = dedup_queries(urls, queries)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        limit = self.max_bytes if max_bytes is None else max_bytes
        bound = timeout * (math.ceil(len(urls) / self.max_concurrency) + 1)
        if not urls:
            return PollHandle(urls, bound, None)
        with self._lock:
            if self._closed:
                raise RuntimeError("the poller is closed")
            if self._child.dead:
                self._child = self._spawn()
            child = self._child
            rid = self._next = self._next + 1
            handle = child.pending[rid] = PollHandle(urls, bound, child, path == STATE_PATH)
        child.send((rid, urls, path, timeout, limit, self.max_idle, queries))
        return handle

    def sweep(self, urls: Iterable[str], path: str = STATE_PATH, timeout_s: float | None = None,
              max_bytes: int | None = None, queries: Sequence[str] | None = None
              ) -> dict[str, RankPoll]:
        """As :meth:`Poller.sweep` (never raises because of a rank)."""
        return self.start(urls, path, timeout_s, max_bytes, queries).result()

    def close(self) -> None:
        """End the child (its current sweep first, up to 10 s) and wait for it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            child = self._child
        with contextlib.suppress(OSError):
            child.proc.stdin.close()
        try:
            child.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.proc.wait()
        child.reader.join(timeout=10)


# --- the child ------------------------------------------------------------------------------
def _serve() -> None:
    """The child: its settings, then one sweep a message, from stdin until it ends."""
    # the answers go over the original stdout; a stray print goes to stderr, never into them
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    settings = _read_frame(inp)
    if settings is None:  # the monitor went before it said anything
        return
    timeout, concurrency, max_bytes, event_loop = settings
    poller = Poller(timeout, concurrency, max_bytes=max_bytes, event_loop=event_loop)
    frames: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

    def write() -> None:  # off the event loop: a slow reader never stalls the requests
        try:
            while (data := frames.get()) is not None:
                out.write(data)
                out.flush()
        except OSError:  # the monitor is gone
            os._exit(0)

    writer = threading.Thread(target=write, name="lightkeeper-poll-writer", daemon=True)
    writer.start()
    try:
        while (msg := _read_frame(inp)) is not None:
            rid, urls, path, timeout, limit, max_idle, queries = msg
            poller.max_idle = max_idle

            def on_rows(rows: list[tuple], rid=rid) -> None:  # on the poller's thread
                frames.put(_frame((rid, rows, False)))

            # no GC pass during a sweep: its objects come and go, its cycles are cut at its end
            gc.disable()
            try:
                poller.sweep(urls, path, timeout, limit, on_rows=on_rows, per_batch=BATCH,
                             queries=queries)
            finally:
                gc.enable()
            frames.put(_frame((rid, [], True)))
    finally:
        frames.put(None)
        writer.join(timeout=30)
        poller.close()


if __name__ == "__main__":
    _serve()
