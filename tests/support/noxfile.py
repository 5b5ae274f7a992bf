"""The project's noxfile.py as a module, loaded once a process: nox registers each session in a
registry of its own at import, and a second load registers them again (a FutureWarning now, an
error in a later nox)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def load_noxfile() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lk_noxfile", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
