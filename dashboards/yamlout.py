"""A tiny YAML writer for the generated Prometheus files (no PyYAML dependency).

Handles what those files contain: dicts, lists, str, int, float, bool and None. Strings are
written plain when that is unambiguous, single-quoted otherwise, and as ``|-`` blocks when they
span lines (PromQL expressions and descriptions read best that way).
"""

from __future__ import annotations

import math
import re
from typing import Any

_PLAIN = re.compile(r"^(?:[A-Za-z_/][A-Za-z0-9_./-]*|[0-9]+(?:ms|[smhdwy]))$")
_RESERVED = {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"}


def _scalar(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isinf(v):
            return ".inf" if v > 0 else "-.inf"
        if math.isnan(v):
            return ".nan"
        return repr(v)
    s = str(v)
    if _PLAIN.match(s) and s.lower() not in _RESERVED:
        return s
    return "'" + s.replace("'", "''") + "'"


def _is_block(v: Any) -> bool:
    return isinstance(v, str) and "\n" in v


def _block(s: str, indent: int) -> list[str]:
    pad = " " * indent
    return [pad + line if line else "" for line in s.rstrip("\n").split("\n")]


def _emit(obj: Any, indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = _scalar(str(k))
            if isinstance(v, dict) and v:
                lines.append(f"{pad}{key}:")
                lines += _emit(v, indent + 2)
            elif isinstance(v, list) and v:
                lines.append(f"{pad}{key}:")
                lines += _emit(v, indent + 2)
            elif _is_block(v):
                lines.append(f"{pad}{key}: |-")
                lines += _block(v, indent + 2)
            else:
                lines.append(f"{pad}{key}: {_inline_empty(v)}")
        return lines
    if isinstance(obj, list):
        for item in obj:
            if isinstance(item, (dict, list)) and item:
                sub = _emit(item, indent + 2)
                # put the first line after the dash
                lines.append(f"{pad}- {sub[0].lstrip()}")
                lines += sub[1:]
            elif _is_block(item):
                lines.append(f"{pad}- |-")
                lines += _block(item, indent + 2)
            else:
                lines.append(f"{pad}- {_inline_empty(item)}")
        return lines
    return [pad + _scalar(obj)]


def _inline_empty(v: Any) -> str:
    if isinstance(v, dict):
        return "{}"
    if isinstance(v, list):
        return "[]"
    return _scalar(v)


def dump(obj: Any, header: str = "") -> str:
    """YAML text for ``obj``, optionally preceded by a ``#`` comment ``header``."""
    out = [f"# {line}".rstrip() for line in header.strip("\n").split("\n")] if header else []
    out += _emit(obj, 0)
    return "\n".join(out) + "\n"
