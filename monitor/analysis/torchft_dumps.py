"""torchft's own Flight Recorder dumps: one folder per quorum.

torchft 0.2.0's Manager, when ``TORCH_FR_DUMP_TEMP_FILE`` is set, points it at
``<TORCH_FR_DUMP_TEMP_FILE>_quorum_<quorum_id>/<global_rank>`` at every new quorum
(``Manager._update_fr_path``), so torch's dump on a timeout, or on an abort with
``TORCHFT_TRIGGER_FR_ON_ABORT=true`` (``ProcessGroupNCCL.abort``), lands in the folder of the
quorum it happened in. Dumps of different quorums are different incarnations of torchft's group:
``lightkeeper analyze`` reads one quorum's folder at a time (the newest unless told).
"""

from __future__ import annotations

import re
from pathlib import Path

_QUORUM = re.compile(r"^(?P<prefix>.*)_quorum_(?P<quorum>-?\d+)$")


def quorum_folders(path: str | Path) -> dict[int, Path]:
    """quorum id -> folder, for ``path`` a folder holding ``*_quorum_<id>`` folders, or the
    prefix itself (the value of ``TORCH_FR_DUMP_TEMP_FILE``) beside which they lie; {} else.
    ``OSError`` when the folder to look in cannot be listed."""
    p = Path(path)
    if not p.is_dir():
        return _folders(p.parent, p.name) if p.name and p.parent.is_dir() else {}
    inside = _folders(p, None)
    try:
        return inside or (_folders(p.parent, p.name) if p.name else {})
    except OSError:  # a folder of dumps inside one this user may not list: read as given
        return {}


def _folders(parent: Path, prefix: str | None) -> dict[int, Path]:
    """quorum id -> folder, of ``parent``'s ``<prefix>_quorum_<id>`` folders (any prefix: None)."""
    out = {}
    for c in parent.iterdir():
        m = _QUORUM.match(c.name)
        if c.is_dir() and m and prefix in (None, m.group("prefix")):
            out[int(m.group("quorum"))] = c
    return out


def pick(folders: dict[int, Path], quorum: int | None) -> tuple[int, Path] | None:
    """The folder of ``quorum``, else the newest quorum's; None when ``quorum`` is not there."""
    if quorum is None:
        q = max(folders)
        return q, folders[q]
    return (quorum, folders[quorum]) if quorum in folders else None
