"""What every sink shares: the result of one attempt, the sink protocol, the config error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class ActionResult:
    ok: bool
    detail: str
    retry: bool = True  # False: retrying cannot help (forbidden, not found, bad command)


class Sink(Protocol):
    name: str

    def quarantine(self, event: dict[str, Any]) -> ActionResult: ...

    def release(self, event: dict[str, Any]) -> ActionResult: ...


class SinkConfigError(ValueError):
    """An ``--action`` the monitor cannot build a sink from."""
