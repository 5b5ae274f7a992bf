"""The per-step timings the detectors remember of each rank, in numpy columns: a sweep folds in
one pass, the straggler's window is one indexing. Nothing here raises on what a rank served.
"""

from __future__ import annotations

from collections.abc import Container

import numpy as np

from rank_wire import QUORUM_RECORD, TIMING_KEYS, TIMING_ROW

NONE = np.iinfo(np.int64).min  # no step (a free place, a rank with nothing folded)
QUORUM_SLACK_S = 0.001  # a quorum wait over its row's step_s by more cannot be true (ms?)


class StepMemory:

    def __init__(self, depth: int = 32, capacity: int = 1024) -> None:
        self.depth = depth
        self.slot: dict[str, int] = {}  # URL -> slot; read-only outside
        self.rid: list = [None] * capacity  # slot -> replica id; read-only, changed in place
        self._free = list(range(capacity - 1, -1, -1))
        self._steps = np.full((capacity, depth), NONE, np.int64)
        self._seconds = np.zeros((capacity, depth, len(TIMING_KEYS)), np.float64)
        self._newest = np.full(capacity, NONE, np.int64)
        self._quorum = np.full((capacity, depth), np.nan)  # each row's wait_quorum_s

    def newest(self, url: str) -> int | None:
        slot = self.slot.get(url)
        if slot is None:
            return None
        step = int(self._newest[slot])
        return None if step == NONE else step

    def newest_of(self, slots: list[int]) -> list[int | None]:
        return [None if s == NONE else s for s in self._newest[slots].tolist()]

    def common_steps(self, slots: np.ndarray) -> list[int]:
        if not len(slots):
            return []
        top = int(self._newest[slots].min())
        if top == NONE:
            return []
        cand = np.arange(top - self.depth + 1, top + 1, dtype=np.int64)
        # a place holding a step older than its rank's newest ``depth`` (skipped steps) is stale
        present = (self._steps[slots][:, cand % self.depth] == cand) \
            & (cand > self._newest[slots][:, None] - self.depth)
        return cand[present.all(axis=0)].tolist()

    def held(self, slots: np.ndarray) -> np.ndarray:
        """Per slot, how many of its newest ``depth`` steps it holds."""
        newest = self._newest[slots]
        steps = self._steps[slots]
        return ((steps != NONE) & (steps > newest[:, None] - self.depth)).sum(axis=1)

    def seconds(self, slots: np.ndarray, steps: list[int]) -> np.ndarray:
        """slots x steps x TIMING_KEYS (``steps``: from :meth:`common_steps`)."""
        at = np.asarray(steps, np.int64) % self.depth
        return self._seconds[np.asarray(slots)[:, None], at[None, :]]

    def quorum(self, slots: np.ndarray, steps: list[int]) -> np.ndarray:
        """slots x steps of wait_quorum_s, NaN where none was served or it could not be true."""
        at = np.asarray(steps, np.int64) % self.depth
        return self._quorum[np.asarray(slots)[:, None], at[None, :]]

    def take(self, url: str, replica_id) -> int:
        """``url``'s slot for ``replica_id`` (emptied if its replica id changed)."""
        slot = self.slot.get(url)
        if slot is not None:
            if self.rid[slot] != replica_id:
                self._empty([slot])
                self.rid[slot] = replica_id
            return slot
        if not self._free:
            self._resize(2 * len(self.rid))
        slot = self.slot[url] = self._free.pop()
        self.rid[slot] = replica_id
        return slot

    def fold(self, slots: list[int], blobs: list[bytes], quorum: list[bytes] | None = None
             ) -> list[int]:
        """How many rows each answer added: ``blobs[i]`` into ``slots[i]``, rows newer than its last
        step and within ``depth`` of the new newest; a step served twice keeps its last row.
        ``quorum[i]``: that answer's quorum waits, kept for the steps it added."""
        added = self._fold(slots, blobs)
        if quorum is not None and any(added):
            self._fold_quorum(slots, quorum)
        return added

    def _fold_quorum(self, slots: list[int], blobs: list[bytes]) -> None:
        raw = np.frombuffer(b"".join(blobs), np.float64).reshape(-1, 2)
        counts = np.fromiter(map(len, blobs), np.int64, len(blobs)) // QUORUM_RECORD.size
        steps = raw[:, 0].view(np.int64)
        place = np.asarray(slots, np.int64)[np.repeat(np.arange(len(slots)), counts)] \
            * self.depth + steps % self.depth
        held = (self._steps.reshape(-1)[place] == steps) & (steps != NONE)
        place, secs = place[held], raw[held, 1]
        # trusted only when it could be true: finite, >= 0, within its row's step
        ok = (secs >= 0) & (secs <= self._seconds.reshape(-1, len(TIMING_KEYS))[place, 0]
                            + QUORUM_SLACK_S)
        self._quorum.reshape(-1)[place] = np.where(ok, secs, np.nan)

    def _fold(self, slots: list[int], blobs: list[bytes]) -> list[int]:
        counts = np.fromiter(map(len, blobs), np.int64, len(blobs)) // TIMING_ROW.size
        # float64 columns, the first the step's int64 bits (faster than a structured array)
        raw = np.frombuffer(b"".join(blobs), np.float64).reshape(-1, 1 + len(TIMING_KEYS))
        if not len(raw):
            return [0] * len(slots)
        steps = raw[:, 0].view(np.int64)
        answer = np.repeat(np.arange(len(slots)), counts)  # each row's answer
        owner = np.asarray(slots, np.int64)[answer]
        newest = self._newest
        # new steps only; a step near int64's least is no step (it would wrap: steps - depth)
        at = np.flatnonzero((steps > newest[owner]) & (steps > NONE + self.depth))
        if len(at):  # of those, the valid rows (NaN fails both tests)
            sec = raw[at, 1:]
            at = at[((sec >= 0) & (sec < np.inf)).all(axis=1)]
        if not len(at):
            return [0] * len(slots)
        owner, steps = owner[at], steps[at]
        np.maximum.at(newest, owner, steps)
        # only the newest ``depth`` steps fit (one served out of order far behind: dropped)
        fits = steps > newest[owner] - self.depth
        if not fits.all():
            at, owner, steps = at[fits], owner[fits], steps[fits]
        place = owner * self.depth + steps % self.depth
        # a step served twice: its last row (a sort, only then)
        if len(at) > 1 and ((steps[1:] <= steps[:-1]) & (owner[1:] == owner[:-1])).any():
            last = len(place) - 1 - np.unique(place[::-1], return_index=True)[1]
            at, owner, place, steps = at[last], owner[last], place[last], steps[last]
        self._steps.reshape(-1)[place] = steps
        self._seconds.reshape(-1, len(TIMING_KEYS))[place] = raw[at, 1:]
        self._quorum.reshape(-1)[place] = np.nan  # until its answer's quorum waits say
        return np.bincount(answer[at], minlength=len(slots)).tolist()

    def keep_only(self, urls: Container[str]) -> None:
        gone = [u for u in self.slot if u not in urls]
        if not gone:
            return
        slots = [self.slot.pop(u) for u in gone]
        self._empty(slots)
        for s in slots:
            self.rid[s] = None
        self._free.extend(slots)
        # the first sweep folds every rank, leader polling then keeps a fraction
        if len(self.rid) > 4096 and 4 * len(self.slot) < len(self.rid):
            self._resize(max(1024, 2 * len(self.slot)))

    def _empty(self, slots: list[int]) -> None:
        self._steps[slots] = NONE
        self._newest[slots] = NONE

    def _resize(self, capacity: int) -> None:
        """``capacity`` slots, the live ones moved to the front in slot order (with none free,
        as when growing, every slot keeps its number)."""
        urls = sorted(self.slot, key=self.slot.__getitem__)
        live = [self.slot[u] for u in urls]
        n = len(live)
        steps = np.full((capacity, self.depth), NONE, np.int64)
        seconds = np.zeros((capacity, self.depth, len(TIMING_KEYS)), np.float64)
        newest = np.full(capacity, NONE, np.int64)
        quorum = np.full((capacity, self.depth), np.nan)
        steps[:n], seconds[:n], newest[:n] = self._steps[live], self._seconds[live], self._newest[live]
        quorum[:n] = self._quorum[live]
        self._steps, self._seconds, self._newest, self._quorum = steps, seconds, newest, quorum
        # in place: readers hold self.rid
        self.rid[:] = [self.rid[s] for s in live] + [None] * (capacity - n)
        self.slot.update(zip(urls, range(n), strict=True))
        self._free = list(range(capacity - 1, n - 1, -1))
