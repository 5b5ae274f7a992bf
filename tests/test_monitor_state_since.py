"""``/v1/state?since=N&recent=16&packed=1``: the monitor asks each rank only for the timing rows it
has not folded and the 16 newest of its 64 step times, both packed (Detectors.state_queries), and
finds what it finds when it is served the whole document as lists.

Two real Monitors (leader polling, the real schedule, view, detectors) sweep the same virtual
ranks (tests/support/virtual_ranks.py, which serve ``?since=`` as a WorkerServer does) on one
fake clock, one sweep each in turn: one's poller honours the per-URL queries, the other's
ignores them (as an older WorkerServer does) and serves every row. Through healthy steps, a
straggler group and a hung rank (its group drilled, every rank polled), the two must fold the
same per-step rows for every rank (a member polled at its slower cadence: its newest ones, all the
straggler's window reads), compute the same straggler lags and median step times and open the same
findings; and the answers must really have been cut (else the test would prove nothing).
In-process pollers rather than HTTP: the per-URL query on the wire is tests/test_monitor_poller.py's."""

from __future__ import annotations

import base64
import json
import os
import types

import pytest

from monitor.config import DetectorConfig, MonitorConfig
from monitor.detect.straggler import WINDOW_SLACK_STEPS
from monitor.poll.poller import judge_body
from monitor.service import Monitor
from tests.support import virtual_ranks
from tests.support.virtual_ranks import VirtualRanks
from tests.test_step_memory import rows as folded_rows

GROUPS, SIZE, STEP_S = 12, 4, 1.0


def served(value, record: int) -> int:
    """How many values a served list holds: a JSON list's length, or the records of a packed
    one (base64, ``record`` bytes each)."""
    return len(base64.b64decode(value)) // record if isinstance(value, str) else len(value)


class Answers:
    """A poller answering each URL with its virtual rank's document, honouring its query
    (``?since=N&recent=16&packed=1``: ``honour``) or serving the whole document, lists and all;
    it counts the timing rows it served."""

    max_idle = 0

    def __init__(self, vr: VirtualRanks, urls: list[str], honour: bool) -> None:
        self.vr, self.honour = vr, honour
        self.index = {u: i for i, u in enumerate(urls)}
        self.rows_served = self.seconds_served = 0
        self.cut = 0  # answers asked with ?since=
        self.answers = self.packed = 0  # state answers; of them served packed (?packed=1)
        # of them, answers of 6 rows or more: a rank asked since its group's newest step less
        # the window (a member), not since its own newest (1 or 2 rows at these sweeps)
        self.member_cut = 0

    def sweep(self, urls, path="/v1/state", timeout_s=None, max_bytes=None, queries=None):
        if path.startswith("/v1/fr_trace"):  # the drilled group's dumps: an in-group hang
            query = path.partition("?")[2]
            return {u: judge_body(u, self.vr.fr(self.index[u], query)[1], 0.0) for u in urls}
        queries = queries or [""] * len(urls)
        out = {}
        for u, q in zip(urls, queries, strict=True):
            honoured = q if self.honour else ""
            self.cut += "since=" in honoured
            body = self.vr.state_asked(self.index[u], honoured)
            doc = json.loads(body)
            rows = served(doc["timing"]["recent"], 40)
            self.answers += 1
            self.packed += isinstance(doc["recent_step_seconds"], str)
            self.rows_served += rows
            self.member_cut += "since=" in honoured and rows >= 6
            self.seconds_served += served(doc["recent_step_seconds"], 8)
            out[u] = judge_body(u, body, 0.0, state=True)  # packed, as the poller keeps it
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
    mon.polling.poller.close()
    mon.polling.poller = poller
    return mon


def snapshot(mon: Monitor) -> dict:
    """{url: (replica id, {step: its four seconds})} of every rank the detectors hold rows of."""
    mem = mon.detectors.straggler.memory
    return {u: (mem.rid[s], folded_rows(mem, u)) for u, s in mem.slot.items()}


def same_rows(cut: dict, whole: dict) -> bool:
    """The rows folded from cut answers are those folded from whole ones: the same ranks, each
    rank's rows those of the whole fold on its steps, and its newest ones all there (a member
    polled at its slower cadence is asked for its group's newest steps only: the straggler's
    window of 6 and 2 more, where a whole answer has 16)."""
    if cut.keys() != whole.keys():
        return False
    for url, (rid, rows) in whole.items():
        got_rid, got = cut[url]
        newest = sorted(rows)[-(DetectorConfig().straggler_steps + WINDOW_SLACK_STEPS):]
        if got_rid != rid or any(got[s] != rows.get(s) for s in got) \
                or not set(newest) <= got.keys():
            return False
    return True


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
            assert same_rows(snapshot(a), snapshot(b)), i
            assert a.detectors.last_lags == b.detectors.last_lags, i
            assert findings(a) == findings(b), i
            assert a.view.median_step_seconds() == b.view.median_step_seconds(), i
            assert [gv.median_step_seconds() for gv in a.view.groups.values()] == \
                [gv.median_step_seconds() for gv in b.view.groups.values()], i
            seen |= {f[0] for f in findings(a)}
            clock.t += gaps[i % len(gaps)]
    finally:
        for mon in mons:
            mon.stop()
    # both findings were made (so the comparison covered them), and the answers were cut:
    # leaders polled every sweep asked for one or two rows, not the 16 a virtual rank keeps
    assert {"straggler", "hang"} <= seen
    assert cut.cut > 0.5 * 70 * GROUPS
    assert cut.rows_served < 0.5 * whole.rows_served
    assert cut.member_cut > 0  # members asked for their group's newest rows
    assert cut.seconds_served < 0.3 * whole.seconds_served  # 16 of 64
    assert cut.packed == cut.answers > 0 and whole.packed == 0  # every asked answer packed


def test_state_queries_name_the_newest_folded_step(tmp_path, clock):
    """A leader polled last sweep is asked ``?since=<its newest folded step>``; a rank the
    detectors hold no rows for (never polled, or a member not polled last sweep) is asked for
    every row; an unknown URL too. Each is asked for the 16 newest step times the view reads
    (``recent=16``), not the 64 a rank keeps, and for both lists packed (``packed=1``)."""
    n = 2 * SIZE
    vr = VirtualRanks(n, 0, SIZE, STEP_S, epoch=900.0)
    urls = [f"http://127.0.0.1:1/r/{r}" for r in range(n)]
    mon = monitor(tmp_path, "m.db", urls, Answers(vr, urls, True), clock)
    try:
        assert mon.detectors.state_queries(urls) == ["?recent=16&packed=1"] * n
        clock.t += 20.0
        mon.sweep_once()  # every rank
        clock.t += 1.0
        mon.sweep_once()  # the leaders only
        step = int((clock.t - 900.0) / STEP_S)
        got = mon.detectors.state_queries(urls + ["http://127.0.0.1:1/r/99"])
        # rows up to the step before
        assert got[0] == got[SIZE] == f"?since={step - 1}&recent=16&packed=1"
        assert got[1:SIZE] == got[SIZE + 1:2 * SIZE] == ["?recent=16&packed=1"] * (SIZE - 1)
        assert got[-1] == "?recent=16&packed=1"
        # with the view: a member is asked for the rows its group's window needs (its group's
        # newest folded step less the 6 of the window and 2)
        got = mon.detectors.state_queries(urls + ["http://127.0.0.1:1/r/99"], view=mon.view)
        assert got[0] == got[SIZE] == f"?since={step - 1}&recent=16&packed=1"
        assert got[1:SIZE] == got[SIZE + 1:2 * SIZE] == [f"?since={step - 9}&recent=16&packed=1"] * (
            SIZE - 1)
        assert got[-1] == "?recent=16&packed=1"  # not a rank of the view
    finally:
        mon.stop()
