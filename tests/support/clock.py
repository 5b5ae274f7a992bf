"""A clock tests set by hand: ``clock()`` reads it, ``advance(s)`` moves it."""

from __future__ import annotations


class ManualClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
