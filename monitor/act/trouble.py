"""A condition lasting across sweeps: said when it starts, again every ``WARN_EVERY_S`` while it
lasts, once when it ends. ``update`` it each sweep (None: none now; ``exc``: its traceback; a
``kind`` not said in the last ``WARN_EVERY_S`` while it lasts is said at once)."""

from __future__ import annotations

import logging

WARN_EVERY_S = 60.0  # while a trouble lasts, said again this often
_log = logging.getLogger(__name__)


class Trouble:
    def __init__(self, what: str, ended: str, level: int = logging.WARNING,
                 log: logging.Logger = _log) -> None:
        self.what, self.ended, self.level, self.log = what, ended, level, log
        self.error: str | None = None
        self._said: dict[str | None, float] = {}  # kind -> when said, while it lasts

    def update(self, error: str | None, now: float, exc: BaseException | None = None,
               kind: str | None = None) -> None:
        # each kind once a minute: two taking turns (a full disk) must not say every sweep
        self._said = {k: t for k, t in self._said.items() if error and now - t < WARN_EVERY_S}
        if error and kind not in self._said:
            self.log.log(self.level, "%s: %s", self.what, error, exc_info=exc)
            self._said[kind] = now
        elif not error and self.error:
            self.log.warning("%s", self.ended)
        self.error = error
