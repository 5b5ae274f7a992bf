"""The handler lists TorchPoller keeps (monitor/poll/torch_server.py): each rank's ``GET /handler/``
is asked every HANDLERS_TTL_S, not every sweep, however many torch-only ranks there are and
whatever part of them a sweep asks. The network is faked at the poller (1,100 real servers would
be 1,100 sockets and threads): every rank lists ``fr_trace_json`` and answers its dump."""

from __future__ import annotations

import pytest

from monitor.poll import torch_server
from monitor.poll.poller import RankPoll
from monitor.poll.torch_server import FR_HANDLER, TorchPoller

RANKS = 1_100  # above the 1,024 kept lists beyond which old addresses are dropped
URLS = [f"torch+http://127.0.0.1:{20_000 + i}" for i in range(RANKS)]


class _Network:
    """What the ranks answer through the poller; ``lists``: the ranks each of its sweeps of
    ``GET /handler/`` asked; a rank in ``dark`` does not answer its dump in time."""

    lists: list[int] = []
    dark: set[str] = set()

    def __init__(self, *args, **kwargs) -> None:
        pass

    def sweep(self, urls, path="", timeout_s=None, max_bytes=None, on_rows=None, **kwargs):
        urls = list(urls)
        if path == "/handler/":
            self.lists.append(len(urls))
            on_rows([(i, True, f'["{FR_HANDLER}"]'.encode(), None, None, None, 0.001, 0.0)
                     for i in range(len(urls))])
            return {}
        return {u: RankPoll(u, False, reason="timeout", error="no answer within 1.00s")
                if u.rpartition("/handler/")[0] in self.dark
                else RankPoll(u, True, {"version": "2.10", "entries": []}) for u in urls}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("then, lists", [
    ("every rank", [RANKS, 0, 0]),
    ("a drill", [RANKS, 0, 0]),  # a sweep of one group's ranks (monitor/polling.py drill_now)
    ("a dump timeout", [RANKS, 1, 1]),  # that rank's list asked again, and next sweep
])
def test_kept_handler_lists_are_not_asked_again_each_sweep(monkeypatch, then, lists):
    monkeypatch.setattr(torch_server, "Poller", _Network)
    monkeypatch.setattr(_Network, "lists", [])
    monkeypatch.setattr(_Network, "dark", set())
    poller, asked = TorchPoller(), []
    try:
        for i, urls in enumerate([URLS, URLS[:8] if then == "a drill" else URLS, URLS]):
            if i == 1 and then == "a dump timeout":
                _Network.dark.add(URLS[0])
            before = sum(_Network.lists)
            got = poller.sweep(urls)
            asked.append(sum(_Network.lists) - before)
            assert all(p.ok for p in got.values())
    finally:
        poller.close()
    assert asked == lists
