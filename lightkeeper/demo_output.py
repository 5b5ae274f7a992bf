"""The demo's terminal output when its reader goes away: a closed pipe (``| head``, a ``tee``
that died with Ctrl-C) or a hung-up terminal must not cost the stop and the report."""

from __future__ import annotations

import contextlib
import os


def reader_gone() -> bool:
    """Whether fd 1 is a pipe whose reader closed (EPIPE came from the output, not a socket)."""
    import select

    p = select.poll()
    p.register(1, 0)
    return any(ev & select.POLLERR for _, ev in p.poll(0))


def say(text: str) -> None:
    """Print ``text``; where fd 1's reader is gone, mute the output instead of failing: what
    follows (the stop, the report) goes on."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        if not reader_gone():
            raise
        mute()


def mute(*_):
    """Point fds 1 and 2 at /dev/null: after a SIGHUP each write to the hung-up terminal fails
    (EIO), or to a pipe whose reader died with it (``| tee``: EPIPE), and would cost the cleanup
    and the report. A file is muted too: demo.log keeps the lines."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            with contextlib.suppress(OSError):
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)
