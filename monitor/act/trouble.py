"""A condition lasting across sweeps: said when it starts, again every ``WARN_EVERY_S`` while it
lasts, once when it ends. ``update`` it each sweep (None: none now; ``exc``: its traceback; a
new ``kind`` while it lasts is said at once)."""

from __future__ import annotations

import logging

WARN_EVERY_S = 60.0  # while a trouble lasts, said again this often
_log = logging.getLogger(__name__)


class Trouble:
    def __init__(self, what: str, ended: str, level: int = logging.WARNING,
                 log: logging.Logger = _log) -> None:
        self.what, self.ended, self.level, self.log = what, ended, level, log
        self.error: str | None = None
        self.kind: str | None = None
        self._said_at = float("-inf")

    def update(self, error: str | None, now: float, exc: BaseException | None = None,
               kind: str | None = None) -> None:
        if error and (not self.error or kind != self.kind or now - self._said_at >= WARN_EVERY_S):
            self.log.log(self.level, "%s: %s", self.what, error, exc_info=exc)
            self._said_at = now
        elif not error and self.error:
            self.log.warning("%s", self.ended)
        self.error, self.kind = error, kind
