"""How long a sweep waits for Flight Recorder dumps: as long as the slowest rank asked took
lately, so a host gone silent holds the sweep about a second, not the whole ``--fr-timeout``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping

from .poller import RankPoll

log = logging.getLogger(__name__)

FLOOR_S = 1.0  # never less: a healthy dump takes tens of milliseconds
SLACK = 4.0  # times the slowest recent answer of the ranks asked
DECAY = 0.5  # a rank's remembered time falls at most by half per answer
REST_S = 10.0  # a rank that ran out of the whole timeout is not asked for this long,
REST_MOST_S = 160.0  # twice as long after each further such miss, up to this


class FrBound:
    """Per rank, how long its dumps take; :meth:`wait_s` the bound of one fetch. A new rank gets
    all of ``most_s``; one that runs out of its bound counts as having taken it (a grown dump is
    missed once, not twice); one that runs out of all of ``most_s`` rests REST_S, doubling per
    further miss, so a dump wedged in a rank does not hold every look."""

    def __init__(self, most_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.most_s = most_s
        self._clock = clock
        self._took: dict[str, float] = {}
        self._rest: dict[str, tuple[float, float]] = {}  # url -> (asked again at, rest length)

    def fetch(self, urls: list[str], sweep: Callable[[list[str], float], dict[str, RankPoll]],
              wait_s: float | None = None) -> dict[str, RankPoll]:
        """``sweep(ranks, wait)`` of the ``urls`` not :meth:`resting`, waiting as long as
        :meth:`wait_s` allows them (or ``wait_s``), and learning from it; by URL, the resting
        ones' failed polls beside its answers."""
        got = self.resting(urls)
        live = [u for u in urls if u not in got]
        if live:
            wait = self.wait_s(live) if wait_s is None else wait_s
            answered = sweep(live, wait)
            self.learn(answered, wait)
            got.update(answered)
        return got

    def resting(self, urls: Iterable[str]) -> dict[str, RankPoll]:
        """The ranks of ``urls`` not to ask now, each with a failed poll that says why."""
        now = self._clock()
        return {u: RankPoll(u, False, reason="timeout", error=(
                    f"its dump did not answer in {self.most_s:g} s; not asked for "
                    f"{rest[1]:g} s, again in {rest[0] - now:.0f} s"))
                for u in urls if (rest := self._rest.get(u)) is not None and rest[0] > now}

    def wait_s(self, urls: Iterable[str]) -> float:
        slowest = 0.0
        for url in urls:
            took = self._took.get(url)
            if took is None:
                return self.most_s
            slowest = max(slowest, took)
        return min(self.most_s, max(FLOOR_S, SLACK * slowest))

    def learn(self, polls: Mapping[str, RankPoll], waited_s: float) -> None:
        """Remember the answers of one fetch that asked ``polls``' ranks and waited ``waited_s``;
        an error other than a timeout (refused, cut off) says nothing about how long a dump
        takes."""
        took, now = self._took, self._clock()
        for url, p in polls.items():
            if p.ok or p.status is not None:
                took[url] = max(p.latency_s, DECAY * took.get(url, 0.0))
                self._rest.pop(url, None)
            elif p.reason == "timeout":
                took[url] = waited_s
                if waited_s >= self.most_s:
                    rest = self._rest.get(url)  # the last one, over: this miss doubles it
                    length = REST_S if rest is None else min(REST_MOST_S, 2 * rest[1])
                    self._rest[url] = (now + length, length)
                    log.warning("%s: no Flight Recorder dump in the whole %g s; not asked for "
                                "one for %g s", url, waited_s, length)

    def keep(self, watched: Collection[str]) -> None:
        """Forget the ranks not ``watched`` once more than twice as many (and 1,024) are
        remembered: restarted ranks' old addresses, not those a sweep merely left out."""
        if len(self._took) > 2 * len(watched) + 1024:
            self._took = {u: t for u, t in self._took.items() if u in watched}
            self._rest = {u: r for u, r in self._rest.items() if u in watched}
