"""A fake of one rank's WorkerServer on 127.0.0.1, for tests of what the monitor sends a rank:
it serves ``state`` at ``GET /v1/state`` and records every POST (``/v1/exit``, ``/v1/abort``,
``/v1/probe``) with its Authorization header and body. Many ranks on one loop, and ranks that
misbehave, are tests/support/monitor_sim.py's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

from tests.support.http_stub import HttpStub, Request

Answer = tuple[int, Any]  # (status, body): bytes are sent as text, anything else as JSON


class Post(NamedTuple):
    path: str
    authorization: str | None
    body: bytes


class FakeRank:
    """``answers``: (status, body) for the next POSTs, in order; then ``bearer`` set: an older
    rank that takes nothing but that token as a bearer (401); else a rank that took the call.
    ``get(path)``: the answer to a GET, None for the default (``state`` at /v1/state, else 404).
    ``log``: a list shared by several ranks, their POSTs in the order they came."""

    def __init__(self, state: dict | None = None, *,
                 get: Callable[[str], Answer | None] | None = None,
                 log: list[Post] | None = None) -> None:
        self.state = state
        self.posts: list[Post] = []
        self.gets: list[str] = []
        self.answers: list[Answer] = []
        self.bearer: str | None = None
        self._get, self._log = get, log
        self.server = HttpStub({"GET": self._on_get, "POST": self._on_post})
        self.port, self.url = self.server.port, self.server.url

    @property
    def paths(self) -> list[str]:
        return [p.path for p in self.posts]

    def answer_get(self, path: str) -> Answer:
        got = self._get(path) if self._get is not None else None
        if got is not None:
            return got
        if self.state is not None and path.startswith("/v1/state"):
            return 200, self.state
        return 404, {}

    def _on_get(self, req: Request) -> Answer:
        self.gets.append(req.target)
        return _wire(self.answer_get(req.target))

    def _on_post(self, req: Request) -> Answer:
        return _wire(self.answer_post(Post(req.target, req.headers.get("Authorization"),
                                           req.body)))

    def answer_post(self, post: Post) -> Answer:
        self.posts.append(post)
        if self._log is not None:
            self._log.append(post)
        if self.answers:
            return self.answers.pop(0)
        if self.bearer is not None and post.authorization != f"Bearer {self.bearer}":
            return 401, {"error": "missing or wrong bearer token"}
        if post.path == "/v1/probe":
            return 200, {"results": [], "control": None}
        return 202, {"exiting": True, "mechanism": "fake"}

    def stop(self) -> None:
        self.server.close()


class FakeRanks(list):
    """``n`` fake ranks, each its own server (a probe round needs two hosts); ``posts``: all of
    theirs, in the order they came."""

    def __init__(self, n: int) -> None:
        self.posts: list[Post] = []
        super().__init__(FakeRank(log=self.posts) for _ in range(n))

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self]

    def bearer_only(self, token: str) -> None:
        """Older ranks: each refuses anything but ``token`` as a bearer."""
        for r in self:
            r.bearer = token

    def stop(self) -> None:
        for r in self:
            r.stop()


def _wire(answer: Answer) -> Answer:
    status, body = answer
    if isinstance(body, bytes):
        return status, body, {"Content-Type": "text/plain"}
    return status, json.dumps(body), {"Content-Type": "application/json"}
