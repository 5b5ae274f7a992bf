"""One task over many files on several cores, in fresh ``python -S`` workers (never torch).
A worker that dies costs only its file; with none left the rest runs here (docs/analyze.md).
"""

from __future__ import annotations

import fcntl
import gc
import importlib
import os
import pickle
import selectors
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

Outcome = tuple[Any, str | None]  # (value or None, error message or None) for one file

IN_FLIGHT = 2  # files handed to a worker ahead of its answers
# workers per available core at most: more only add start-up and memory (--jobs 100000 on 1024
# files would start 1024 interpreters)
JOBS_PER_CORE = 2
_HEADER = 8
_ROOT = str(Path(__file__).resolve().parents[2])  # holds the `monitor` package
_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from monitor.analysis.pool import _serve; _serve(sys.argv[2])"


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def max_workers() -> int:
    """The most worker processes a pool starts, whatever ``jobs`` it is asked for."""
    return JOBS_PER_CORE * available_cores()


def file_size(path: str | os.PathLike[str]) -> int:
    """Its size in bytes; 0 when it cannot be read (it will fail to load, and say why)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def run_pool(paths: Sequence[str | os.PathLike[str]], jobs: int, task: str) -> list[Outcome]:
    """One outcome per path, in order; ``ValueError`` when ``task`` names no importable function.
    ``jobs`` workers at most, and no more than :func:`max_workers`."""
    resolve(task)  # a bad name fails here, not as one error per file
    return _Pool([str(p) for p in paths], max(1, jobs), task).run()


def resolve(task: str) -> Callable[[str], Outcome]:
    module, _, name = task.partition(":")
    try:
        function = getattr(importlib.import_module(module), name) if module and name else None
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"unknown task {task!r}: {exc}") from exc
    if not callable(function):
        raise ValueError(f"unknown task {task!r}: want 'package.module:function'")
    return function


def _serve(task: str) -> None:
    """Answer ``(index, path)`` requests on stdin until it closes."""
    gc.disable()  # dumps are trees of fresh containers without cycles
    work = resolve(task)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must not land in the answers
    try:
        _send(out, ("ready", os.getpid()))
        while (request := _recv(inp)) is not None:
            index, path = request
            _send(out, (index, *work(path)))
    except (EOFError, BrokenPipeError):  # the parent is gone
        pass


def _send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(len(data).to_bytes(_HEADER, "little") + data)
    stream.flush()


def _recv(stream: BinaryIO) -> Any:
    head = stream.read(_HEADER)
    size = int.from_bytes(head, "little")
    data = stream.read(size) if len(head) == _HEADER else b""
    if len(data) != size or len(head) != _HEADER:
        raise EOFError("worker stream ended")
    return pickle.loads(data)


_PIPE_BYTES = 1 << 20  # a worker's answers queue up here instead of blocking it
_F_SETPIPE_SZ = 1031  # Linux fcntl


class _Worker:
    def __init__(self, task: str) -> None:
        # start_new_session: the terminal's Ctrl-C is the parent's to handle
        self.proc = subprocess.Popen([sys.executable, "-S", "-c", _BOOT, _ROOT, task], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, close_fds=True, start_new_session=True)
        self.fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        try:
            fcntl.fcntl(self.fd, _F_SETPIPE_SZ, _PIPE_BYTES)
        except OSError:  # not Linux, or over the system's limit: the default size works too
            pass
        self.ready = False
        self.in_flight: deque[int] = deque()
        self._pending = bytearray()

    def answers(self) -> list[Any] | None:
        """The answers that arrived complete; None at end of stream."""
        chunk = os.read(self.fd, _PIPE_BYTES)
        if not chunk:
            return None
        buf = self._pending
        buf += chunk
        out, at = [], 0
        while len(buf) - at >= _HEADER:
            size = int.from_bytes(buf[at : at + _HEADER], "little")
            if len(buf) - at - _HEADER < size:
                break
            out.append(pickle.loads(memoryview(buf)[at + _HEADER : at + _HEADER + size]))
            at += _HEADER + size
        del buf[:at]
        return out

    def send(self, message: Any) -> bool:
        try:
            _send(self.proc.stdin, message)  # type: ignore[arg-type]
            return True
        except OSError:  # its stdin is closed: it died, and its stdout's end will say so
            return False

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()  # type: ignore[union-attr]
            except OSError:
                pass

    def stop(self) -> None:
        # spares an idle worker's teardown; a busy one (the caller gave up) must not outlive us
        if self.proc.poll() is None:
            self.proc.kill()
        self.close()
        self.proc.wait()


class _Pool:
    def __init__(self, paths: list[str], jobs: int, task: str) -> None:
        self.paths = paths
        self.jobs = min(jobs, len(paths), max_workers())
        self.task = task
        self.outcomes: list[Outcome | None] = [None] * len(paths)
        self.left = len(paths)
        self.queue: deque[int] = deque(sorted(range(len(paths)), key=lambda i: file_size(paths[i]), reverse=True))
        self.selector = selectors.DefaultSelector()
        self.workers: list[_Worker] = []
        self.replacements = self.jobs

    def run(self) -> list[Outcome]:
        if not self.paths:
            return []
        try:
            for _ in range(self.jobs):
                self._start_worker()
            # a dead worker's stdout ends (EOF): its death is noticed without polling
            while self.left and self.workers:
                for key, _ in self.selector.select():
                    worker = key.data
                    answers = worker.answers()
                    if answers is None:
                        self._bury(worker)
                        continue
                    for answer in answers:
                        self._take(worker, answer)
            if self.left:  # every worker died: run what is left here
                work = resolve(self.task)
                while self.queue:
                    index = self.queue.popleft()
                    self._settle(index, work(self.paths[index]))
        finally:
            for worker in self.workers:
                worker.stop()
            self.selector.close()
        return self.outcomes  # type: ignore[return-value]

    def _take(self, worker: _Worker, answer: tuple) -> None:
        if answer[0] == "ready":
            worker.ready = True
            return
        index, trace, error = answer
        worker.in_flight.remove(index)
        self._settle(index, (trace, error))
        self._feed(worker)

    def _start_worker(self) -> None:
        try:
            worker = _Worker(self.task)
        except OSError:  # cannot start a process at all: the caller's loop loads in-process
            return
        self.workers.append(worker)
        self.selector.register(worker.fd, selectors.EVENT_READ, worker)
        for _ in range(IN_FLIGHT):
            self._feed(worker)

    def _feed(self, worker: _Worker) -> None:
        if self.queue and len(worker.in_flight) < IN_FLIGHT:
            index = self.queue.popleft()
            worker.in_flight.append(index)
            worker.send((index, self.paths[index]))
        elif not self.queue and not worker.in_flight:
            worker.send(None)  # nothing more: let it exit

    def _settle(self, index: int, outcome: Outcome) -> None:
        if self.outcomes[index] is None:
            self.outcomes[index] = outcome
            self.left -= 1

    def _bury(self, worker: _Worker) -> None:
        # its output ended: blame the file it was reading, requeue the rest
        self.selector.unregister(worker.fd)
        worker.close()
        code = worker.proc.wait()
        self.workers.remove(worker)
        lost = worker.in_flight
        if worker.ready and lost and code != 0:
            index = lost.popleft()
            self._settle(index, (None, f"the loader process died ({_describe_exit(code)}) while reading this file"))
        self.queue.extendleft(reversed(lost))
        if self.queue and worker.ready and self.replacements > 0:
            self.replacements -= 1
            self._start_worker()


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
