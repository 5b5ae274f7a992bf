"""Python stacks of every thread in this process.

Read from ``sys._current_frames()``, which needs only the GIL: the training thread releases it
while blocked in a collective (gloo/NCCL waits, ``Event.wait``), so this answers during a hang.
"""

from __future__ import annotations

import gc
import sys
import threading
import traceback
from typing import Any


def current_frames() -> dict[int, Any]:
    """``sys._current_frames()`` with the collector off: CPython 3.11 builds the frames' objects
    holding the interpreter's thread-list lock, and a collection they set off that frees a
    ``threading.local`` takes that lock again: the process deadlocked, the rank's training
    with it (as later CPythons do, no collection runs during it)."""
    was = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if was:
            gc.enable()


def thread_stacks() -> list[dict[str, Any]]:
    """One record per live thread: name, ident, daemon flag and frames (outermost first)."""
    threads = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, frame in current_frames().items():
        t = threads.get(ident)
        frames = [
            {"file": fs.filename, "line": fs.lineno, "function": fs.name, "code": fs.line or ""}
            for fs in traceback.extract_stack(frame)
        ]
        out.append({
            "thread_id": ident,
            "name": t.name if t else f"<unknown {ident}>",
            "daemon": bool(t.daemon) if t else None,
            "is_main": t is threading.main_thread() if t else False,
            "frames": frames,
        })
    # Main thread first: that is where training usually is.
    out.sort(key=lambda r: (not r["is_main"], r["name"]))
    return out


def format_stacks(stacks: list[dict[str, Any]]) -> str:
    """The same stacks as text, like faulthandler/py-spy dump output (innermost call last)."""
    lines = []
    for s in stacks:
        daemon = " daemon" if s["daemon"] else ""
        lines.append(f'Thread {s["thread_id"]} "{s["name"]}"{daemon}' + (" (main)" if s["is_main"] else ""))
        for f in s["frames"]:
            lines.append(f'  File "{f["file"]}", line {f["line"]}, in {f["function"]}')
            if f["code"]:
                lines.append(f"    {f['code']}")
        lines.append("")
    return "\n".join(lines)
