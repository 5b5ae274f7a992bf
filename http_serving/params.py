"""Query parameters read strictly: what a client writes, not everything Python accepts."""

from __future__ import annotations

import re

__all__ = ["decimal_int"]

# int() also takes "1_0", " 7 ", "+7" and non-ASCII digits: none is a number a client means
_DECIMAL = re.compile(r"-?[0-9]{1,19}")


def decimal_int(raw: str) -> int:
    """``raw`` as a plain decimal integer; ``ValueError`` for any other spelling."""
    if not _DECIMAL.fullmatch(raw):
        raise ValueError(f"not a decimal integer: {raw!r}")
    return int(raw)
