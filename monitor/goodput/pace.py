"""The job's pace, the healthy baseline step time ``b``, and the pace window ``W`` and horizon
``H`` that follow from it (docs/goodput.md, "Definitions")."""

from __future__ import annotations

import statistics
from collections import deque

from .model import JOB_RESTART_STEPS, GoodputConfig, Incident


def window_start(history: deque, window: float, end: float) -> tuple[float, int]:
    """The last ``(t, steps)`` at or before ``end - window``, else the first."""
    return next((h for h in reversed(history) if h[0] <= end - window), history[0])


def pace_of(history: deque, window: float, b: float | None, end: float | None = None
            ) -> float | None:
    """Steps in the trailing window of ``(t, steps)`` (ending at ``end``, else its newest) x b
    / its length; None without data or over less than ``2 x b`` (a step more or less would
    swing it by half or more)."""
    if b is None or len(history) < 2:
        return None
    end = history[-1][0] if end is None else end
    t0, v0 = window_start(history, window, end)
    span = end - t0
    if span <= 0 or span < 2 * b:
        return None
    return max(0, history[-1][1] - v0) * b / span


def trim(history: deque, now: float, keep: float, steps: int = 0) -> None:
    """Drop what is older than ``keep`` seconds, but not below ``steps`` steps held."""
    while len(history) >= 2 and history[1][0] <= now - keep and (
            history[-1][1] - history[1][1] >= steps or history[1][1] == history[0][1]):
        history.popleft()


class JobPace:
    """The baseline: the rolling median of the job's mean step time, sampled only on healthy sweeps
    (a fault must not move the norm it is measured by)."""

    def __init__(self, cfg: GoodputConfig) -> None:
        self.cfg = cfg
        self.step: int | None = None  # the newest step of a group in the quorum
        self.history: deque = deque()  # (t, job step) over the window
        self.samples: deque = deque(maxlen=cfg.baseline_samples)
        # when the newest samples were taken (restored or settled ones: not known, kept)
        self.taken: deque = deque(maxlen=cfg.baseline_samples)
        self.baseline: float | None = None
        self.slow_since: float | None = None  # below pace, unexplained, since
        self.ratio: float | None = None
        self.steady: tuple[float, int] | None = None  # see track_steady
        # the incarnations in the quorum when it last reached ``step`` (None: not known)
        self.rids: set[str] | None = None

    @property
    def window(self) -> float:
        return max(self.cfg.pace_window_s, self.cfg.pace_window_steps * (self.baseline or 0.0))

    @property
    def horizon(self) -> float:
        return max(self.cfg.horizon_s, self.cfg.horizon_steps * (self.baseline or 0.0))

    def ingest(self, steps: list[int], now: float, step_at: float | None = None,
               rids: list[str | None] | None = None,
               seen: list[str | None] | None = None, prev: float | None = None) -> bool:
        """True if the in-quorum groups' steps moved the job on, dated by ``step_at`` (the ranks'
        clock) if it falls after the previous sweep (``prev``), else at ``now``. The step falling far, or
        with only new incarnations left (``rids`` in the quorum, ``seen`` in the view): a
        relaunch."""
        moved, at = False, now
        if steps:
            s = max(steps)
            if self.step is not None and s > self.step:
                moved = True
                # a step the previous sweep did not see was committed after it: a date at or
                # before it is a rank clock behind the monitor's (clamping to it would pile
                # every later commit onto one instant), one after ``now`` a clock ahead
                if step_at is not None and prev is not None and step_at > prev:
                    at = min(now, step_at)
            if self.step is not None and s < self.step and (
                    s < self.step - JOB_RESTART_STEPS or self._relaunched(rids, seen)):
                self.history.clear()  # started over (e.g. from a checkpoint)
            if self.step is None or s >= self.step or not self.history:
                self.step = s
                self.rids = set(rids or ()).difference((None,)) or None
        if self.step is not None:
            self.history.append((at, self.step))
            # no baseline yet: W's 3 s floor holds no 3 steps of over a second (a LocalSGD
            # sync), so the window stretches to 3 steps and startup ends
            trim(self.history, now, self.window, 3 if self.baseline is None else 0)
        return moved

    def _relaunched(self, rids: list[str | None] | None, seen: list[str | None] | None
                    ) -> bool:
        # a new incarnation alone in the quorum for a sweep (the others' answers late at a
        # quorum change) is no relaunch while a group of the view still reports an old one
        return bool(rids) and bool(self.rids) and all(
            r is not None and r not in self.rids for r in rids) and (
            seen is None or self.rids.isdisjoint(seen))

    def frozen(self, now: float, incident: int | None) -> str | None:
        """Why the baseline takes no samples now (None: it does); ``incident``: the newest open
        one holding it (Incidents.unsettled)."""
        if incident is not None and self.baseline is not None:
            return f"incident {incident} open"
        # a young baseline (a quarter of its samples) follows a job that warms up, slow or not
        if len(self.samples) >= self.cfg.baseline_samples // 4 and self.slow_since is not None \
                and now - self.slow_since < self.horizon:
            return "unexplained slowness, waiting for an explanation"
        return None

    def sample(self, now: float, incident: int | None) -> None:
        hist = self.history
        if len(hist) < 2 or self.frozen(now, incident):
            return
        span = hist[-1][0] - hist[0][0]
        steps = hist[-1][1] - hist[0][1]
        if steps < 3 or span < 0.9 * self.window:
            return
        self.samples.append(span / steps)
        self.taken.append(now)
        if len(self.samples) >= self.cfg.baseline_min_samples:
            self.baseline = statistics.median(self.samples)

    def forget_since(self, onset: float) -> None:
        """A fault found: drop the samples taken since its onset (a young baseline samples a
        slow job too: the fault's pace would become the norm), unless fewer than startup's
        would remain."""
        k = next((i for i, t in enumerate(reversed(self.taken)) if t <= onset), len(self.taken))
        if k and len(self.samples) - k >= self.cfg.baseline_min_samples:
            for _ in range(k):
                self.samples.pop()
                self.taken.pop()
            self.baseline = statistics.median(self.samples)

    def track_steady(self, now: float, waiting: list[Incident], open_findings: int
                     ) -> tuple[float, float] | None:
        """The "settled" rule (docs/goodput.md): (start, step time) of a pace steady
        for the horizon after every waiting incident's action, no finding open; else None."""
        hist = self.history
        if not waiting or open_findings or self.baseline is None or len(hist) < 2:
            self.steady = None
            return None
        (t0, s0), (t1, s1) = hist[0], hist[-1]
        after = max(i.search_from for i in waiting)
        if s1 - s0 < 3 or t1 - t0 < 0.9 * self.window or t0 < after - 1e-9:
            self.steady = None
            return None
        if self.steady is None:
            self.steady = (t0, s0)
            return None
        st, ss = self.steady
        mean = (s1 - ss) / (t1 - st) if t1 > st else 0.0
        if mean <= 0 or abs((s1 - s0) / (t1 - t0) / mean - 1) > 0.1:
            self.steady = (t0, s0)  # the pace changed: a new period may begin here
            return None
        if now - st < self.horizon:
            return None
        level = 1 / mean
        self.baseline = level
        self.samples.clear()
        self.taken.clear()
        self.samples.extend([level] * self.cfg.baseline_min_samples)
        self.slow_since = None
        self.steady = None
        return st, level

    def back_at(self, after: float, now: float, b: float | None) -> float | None:
        """Start of the trailing window (from ``after`` on) at pace by baseline ``b``, never
        before the job first committed again (by the ranks' clock, or the sweep that saw it);
        None if it is not at pace."""
        hist, w = self.history, self.window
        pace = pace_of(hist, w, b, now)
        if pace is None or pace < self.cfg.pace_threshold:
            return None
        start = window_start(hist, w, now)
        if start[0] > now - w or start[0] < after - 1e-9:  # not a whole window after ``after``
            return None
        first_move = next((hist[i][0] for i in range(1, len(hist))
                           if hist[i][0] > after and hist[i][1] > hist[i - 1][1]), start[0])
        return max(start[0], first_move)
