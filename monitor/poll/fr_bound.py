"""How long a sweep waits for Flight Recorder dumps: long enough for the slowest rank asked, as
its last answers tell, and no longer. A host that goes silent in the middle of a fetch then holds
the sweep (and with it the polls that would find the host gone) for about a second, not for the
whole ``--fr-timeout``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from .poller import RankPoll

FLOOR_S = 1.0  # never less: a healthy dump takes tens of milliseconds
SLACK = 4.0  # times the slowest recent answer of the ranks asked
DECAY = 0.5  # a rank's remembered time falls at most by half per answer


class FrBound:
    """Per rank, how long its dumps take; :meth:`wait_s` the bound of one fetch.

    A rank never answered before is given the whole ``most_s``. One that runs out of its bound
    is remembered as having taken all of it, so its next fetch waits SLACK times as long (up to
    ``most_s``): a dump that grew is missed once, never twice in a row.
    """

    def __init__(self, most_s: float) -> None:
        self.most_s = most_s
        self._took: dict[str, float] = {}

    def wait_s(self, urls: Iterable[str]) -> float:
        slowest = 0.0
        for url in urls:
            took = self._took.get(url)
            if took is None:
                return self.most_s
            slowest = max(slowest, took)
        return min(self.most_s, max(FLOOR_S, SLACK * slowest))

    def learn(self, polls: Mapping[str, RankPoll], waited_s: float) -> None:
        """Remember the answers of one fetch that waited ``waited_s``; an error other than a
        timeout (refused, cut off) says nothing about how long a dump takes."""
        took = self._took
        for url, p in polls.items():
            if p.ok or p.status is not None:
                took[url] = max(p.latency_s, DECAY * took.get(url, 0.0))
            elif p.reason == "timeout":
                took[url] = waited_s

    def keep(self, watched: Collection[str]) -> None:
        """Forget the ranks not ``watched`` once more than twice as many (and 1,024) are
        remembered: restarted ranks' old addresses, not those a sweep merely left out."""
        if len(self._took) > 2 * len(watched) + 1024:
            self._took = {u: t for u, t in self._took.items() if u in watched}
