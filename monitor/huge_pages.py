"""Huge pages under the monitor's Python heap, for a monitor of many ranks.

At 100,000 ranks the monitor keeps ~1.4 GiB of small Python objects (the ranks' answers, their
views, the detectors' and ledgers' memory) and every sweep reads some ~40,000 of them in no
particular order. pymalloc maps them in 1 MiB arenas of 4 KiB pages, and a read of an object
the TLB does not cover walks the page tables; in a virtual machine that is two walks. Measured
here, a random read of a Python object took ~1.5 us, and the monitor's own work a leader sweep
was memory-bound, not bytecode-bound (docs/scaling.md, round 18). With its arenas on transparent
huge pages (2 MiB: 512 times the TLB's reach) the same reads took ~0.9 us.

:func:`enable` installs ``monitor/_hugearenas.c`` (an optional C helper, built by setup.py)
as pymalloc's arena allocator, once per process: the arenas made from then on come from 32 MiB
chunks aligned to 2 MiB and advised ``MADV_HUGEPAGE``; the kernel backs them with huge pages where
it offers transparent huge pages (``/sys/kernel/mm/transparent_hugepage/enabled`` ``madvise`` or
``always``). CPython 3.15 does the same for its own arenas (gh-144319). The monitor enables it
with ``--huge-pages on`` from ``MIN_TARGETS`` targets, before the sweep that first polls them
(a small monitor's heap gains nothing from it). It is off by default: at 100,000 ranks the
random reads it speeds up are measured (~40 % faster), the whole sweep's gain is not yet: within
this box's drift in 3 + 5 pairs (docs/scaling.md, round 18).

Nothing here changes what the monitor computes, only where pymalloc's memory lies. Where the
helper is not built, the kernel offers no transparent huge pages, or the platform is not Linux,
:func:`enable` says why and changes nothing. The memory cost: a chunk is returned to the system
only when none of its arenas is in use (one empty chunk is kept), where pymalloc returns each
empty arena; the heap of a monitor that shrank can stay up to a chunk per size class larger.
"""

from __future__ import annotations

import sys

MODES = ("on", "off")
MIN_TARGETS = 20_000  # as the frozen GC (monitor/service.py GC_FREEZE_MIN_TARGETS)
THP_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"

try:
    from . import _hugearenas
except ImportError:  # not built here (no compiler at install time): pymalloc's own arenas
    _hugearenas = None


def thp_mode(path: str = THP_PATH) -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), None where
    it says none (not Linux, no THP)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def unavailable() -> str | None:
    """Why huge page arenas cannot be used in this process, None when they can."""
    if _hugearenas is None:
        return "the C helper monitor/_hugearenas.c is not built (no compiler at install time?)"
    if not sys.platform.startswith("linux"):
        return f"not on Linux ({sys.platform})"
    mode = thp_mode()
    if mode not in ("always", "madvise"):
        return f"the kernel offers no transparent huge pages ({THP_PATH}: {mode or 'absent'})"
    return None


def enable() -> str | None:
    """Serve pymalloc's arenas from huge-page-advised chunks from now on, in this process (once;
    a second call changes nothing). None when it is on, else why it is not (nothing changed)."""
    why = unavailable()
    if why is None:
        _hugearenas.install()
    return why


def stats() -> dict | None:
    """What the allocator holds (chunks and arenas in use, chunks mapped and unmapped, arenas it
    left to pymalloc's own allocator); None where the helper is not built."""
    return _hugearenas.stats() if _hugearenas is not None else None
