"""A fresh interpreter with ``lightkeeper run``'s hook and a stand-in torchft: the hook's own
code paths (a Manager built, its server started, what it patches) without a Lighthouse, which a
real torchft Manager needs."""

from __future__ import annotations

import os
from pathlib import Path

from worker_server import autostart

STAND_IN_MANAGER = ("class Manager:\n    def __init__(self, *, replica_id=None):\n"
                    "        self._replica_id = replica_id\n")


def hooked_env(tmp_path: Path) -> dict[str, str]:
    """This environment with the hook on and a stand-in ``torchft.manager.Manager`` first on
    ``PYTHONPATH`` (no monitor, no replica group given)."""
    fakes = tmp_path / "fakes" / "torchft"
    fakes.mkdir(parents=True)
    (fakes / "__init__.py").write_text("")
    (fakes / "manager.py").write_text(STAND_IN_MANAGER)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "LIGHTKEEPER_MONITOR", "REPLICA_GROUP_ID")}
    env.update({autostart.ENV_AUTOSTART: "1", "PYTHONPATH": os.pathsep.join(
        [str(autostart.SITE_DIR), str(fakes.parent)])})
    return env
