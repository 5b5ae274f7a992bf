"""Text from elsewhere (a rank's answer, a host name, an error) made safe to print or log."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["on_command_line", "printable"]


def printable(line: str) -> str:
    """``line`` with each character a terminal acts on (escapes, newlines, bidi) shown escaped:
    such text may hold a terminal escape, or a newline that forges a line."""
    return line if line.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1]
                                                   for c in line)


def on_command_line(value: str | None, argv: Sequence[str] | None = None) -> bool:
    """The secret ``value`` is an argument (``--flag value`` or ``--flag=value``, any spelling
    argparse takes) of this process, where every user of the host reads it (``ps``); one from an
    @FILE or an environment variable is not."""
    args = sys.argv[1:] if argv is None else argv
    return bool(value) and any(a == value or a.endswith("=" + value) for a in args)
