"""``/v1/state?since=N``: the monitor asks each rank only for the timing rows it has not folded
(Detectors.state_queries), and finds what it finds when it is served every row.

Two real Monitors (leader polling, the real schedule, view, detectors) sweep the same virtual
ranks (tests/support/virtual_ranks.py, which serve ``?since=`` as a WorkerServer does) on one
fake clock, one sweep each in turn: one's poller honours the per-URL queries, the other's
ignores them (as an older WorkerServer does) and serves every row. Through healthy steps, a
straggler group and a hung rank (its group drilled, every rank polled), the two must fold the
same per-step rows for every rank, compute the same straggler lags and open the same findings;
and the answers must really have been cut (else the test would prove nothing). In-process
pollers rather than HTTP: the per-URL query on the wire is tests/test_monitor_poller.py's."""

from __future__ import annotations

import json
import os
import types

import pytest

from monitor.config import MonitorConfig
from monitor.poller import judge_body
from monitor.service import Monitor
from tests.support import virtual_ranks
from tests.support.virtual_ranks import VirtualRanks

GROUPS, SIZE, STEP_S = 12, 4, 1.0


class Answers:
    """A poller answering each URL with its virtual rank's document, honouring ``?since=N``
    (``honour``) or serving every row; it counts the timing rows it served."""

    max_idle = 0

    def __init__(self, vr: VirtualRanks, urls: list[str], honour: bool) -> None:
        self.vr, self.honour = vr, honour
        self.index = {u: i for i, u in enumerate(urls)}
        self.rows_served = 0
        self.cut = 0  # answers asked with ?since=

    def sweep(self, urls, path="/v1/state", timeout_s=None, max_bytes=None, queries=None):
        if path.startswith("/v1/fr_trace"):  # the drilled group's dumps: an in-group hang
            query = path.partition("?")[2]
            return {u: judge_body(u, self.vr.fr(self.index[u], query)[1], 0.0) for u in urls}
        queries = queries or [""] * len(urls)
        out = {}
        for u, q in zip(urls, queries, strict=True):
            since = int(q.removeprefix("?since=")) if q and self.honour else None
            self.cut += since is not None
            body = self.vr.state(self.index[u], since)
            self.rows_served += len(json.loads(body)["timing"]["recent"])
            out[u] = judge_body(u, body, 0.0)
        return out

    def close(self) -> None:
        pass


@pytest.fixture
def clock(monkeypatch):
    now = types.SimpleNamespace(t=1000.0)
    monkeypatch.setattr(virtual_ranks, "time", types.SimpleNamespace(monotonic=lambda: now.t))
    return now


def monitor(tmp_path, name: str, urls: list[str], poller: Answers, clock) -> Monitor:
    mon = Monitor(MonitorConfig(port=0, targets=urls, state_path=os.path.join(tmp_path, name),
                                leader_polling="on", member_interval_s=5.0,
                                max_targets=len(urls)),
                  clock=lambda: 1.7e9 + clock.t)
    mon.poller.close()
    mon.poller = poller
    return mon


def findings(mon: Monitor) -> set:
    return {(f.kind, f.replica_group, tuple(f.ranks), f.confirmed_at)
            for f in mon.detectors.open_findings()}


def test_cut_answers_fold_and_find_what_whole_ones_do(tmp_path, clock):
    n = GROUPS * SIZE
    vr = VirtualRanks(n, 0, SIZE, STEP_S, epoch=900.0)
    urls = [f"http://127.0.0.1:1/r/{r}" for r in range(n)]
    cut, whole = Answers(vr, urls, True), Answers(vr, urls, False)
    mons = [monitor(tmp_path, "cut.db", urls, cut, clock),
            monitor(tmp_path, "whole.db", urls, whole, clock)]
    seen: set = set()
    try:
        # steps of 0.7-1.6 s between sweeps: leaders one or two steps on, sometimes none
        gaps = [0.7, 1.1, 1.6, 0.9, 1.3, 1.0, 0.8, 1.5]
        for i in range(70):
            if i == 20:  # group 5 computes 0.6 s longer from the next step on
                vr.slow[5] = (int((clock.t - 900.0) / STEP_S) + 1, 0.6)
            if i == 40:
                vr.slow.clear()
                vr.hung[7 * SIZE + 2] = clock.t  # a non-leader: its leader waits in its group
            if i == 58:
                vr.hung.clear()
            for mon in mons:
                mon.sweep_once()
            a, b = mons
            assert a.detectors._steps == b.detectors._steps, i
            assert a.detectors.last_lags == b.detectors.last_lags, i
            assert findings(a) == findings(b), i
            seen |= {f[0] for f in findings(a)}
            clock.t += gaps[i % len(gaps)]
    finally:
        for mon in mons:
            mon.stop()
    # both findings were made (so the comparison covered them), and the answers were cut:
    # leaders polled every sweep asked for one or two rows, not the 8 a virtual rank keeps
    assert {"straggler", "hang"} <= seen
    assert cut.cut > 0.5 * 70 * GROUPS
    assert cut.rows_served < 0.5 * whole.rows_served


def test_state_queries_name_the_newest_folded_step(tmp_path, clock):
    """A leader polled last sweep is asked ``?since=<its newest folded step>``; a rank the
    detectors hold no rows for (never polled, or a member not polled last sweep) is asked for
    everything; an unknown URL too."""
    n = 2 * SIZE
    vr = VirtualRanks(n, 0, SIZE, STEP_S, epoch=900.0)
    urls = [f"http://127.0.0.1:1/r/{r}" for r in range(n)]
    mon = monitor(tmp_path, "m.db", urls, Answers(vr, urls, True), clock)
    try:
        assert mon.detectors.state_queries(urls) == [""] * n
        clock.t += 20.0
        mon.sweep_once()  # every rank
        clock.t += 1.0
        mon.sweep_once()  # the leaders only
        step = int((clock.t - 900.0) / STEP_S)
        got = mon.detectors.state_queries(urls + ["http://127.0.0.1:1/r/99"])
        assert got[0] == got[SIZE] == f"?since={step - 1}"  # rows up to the step before
        assert got[1:SIZE] == got[SIZE + 1:2 * SIZE] == [""] * (SIZE - 1)
        assert got[-1] == ""
    finally:
        mon.stop()
