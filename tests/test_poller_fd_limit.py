"""The poller under a file descriptor limit (monitor/poll/fd_budget.py): every rank still answers.

Each case runs a real Poller in a child process whose ``RLIMIT_NOFILE`` is set low (soft and
hard, so it cannot be raised) and polls real ranks (tests/support/monitor_sim.py, each on its
own port in this process) over loopback. Before the budget, a poller under a soft limit of 256
opened up to 1,024 connections at once and kept every one idle: the connects past the limit
failed with EMFILE and those healthy ranks read as unreachable at every sweep.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys

import pytest

from monitor.poll import fd_budget
from tests.support.monitor_sim import SimRanks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the child: a Poller under the limit its parent set, sweeping as told; prints what it saw
CHILD = r"""
import json, os, resource, sys
from monitor.poll.poller import Poller
plan = json.loads(sys.argv[1])
p = Poller(timeout_s=10.0, max_concurrency=plan["concurrency"], max_idle=plan["max_idle"])
out = {"limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
       "fd_limit": getattr(p, "fd_limit", None), "in_flight": p.max_concurrency,
       "idle_cap": getattr(p, "idle_cap", None), "sweeps": []}
held = []
for step in plan["steps"]:
    if step == "eat":  # every descriptor left taken, as another part of a process could
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        continue
    polls = p.sweep(plan["urls"][step[0]:step[1]])
    out["sweeps"].append({"ok": sum(q.ok for q in polls.values()),
                          "errors": sorted({q.error for q in polls.values() if not q.ok})[:3],
                          "reasons": sorted({q.reason for q in polls.values() if not q.ok}),
                          "idle": p._n_idle, "idle_cap": getattr(p, "idle_cap", None)})
print(json.dumps(out))
p.close()
"""


def run_child(urls: list[str], steps: list, limit: int, concurrency: int = 1024,
              max_idle: int | None = None) -> dict:
    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    plan = {"urls": urls, "steps": steps, "concurrency": concurrency,
            "max_idle": len(urls) + 1024 if max_idle is None else max_idle}
    got = subprocess.run([sys.executable, "-c", CHILD, json.dumps(plan)], cwd=ROOT,
                         preexec_fn=low_limit, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout)


@pytest.fixture(scope="module")
def ranks():
    sim = SimRanks.start(400, groups=100)
    yield sim
    sim.stop()


def test_more_ranks_than_descriptors_all_answer_every_sweep(ranks):
    """400 ranks on 400 addresses under a limit of 256: requests in flight and idle
    connections are kept under it (the least recently used closed), and every rank answers
    in every sweep; the monitor asked for one idle connection per target and 1,024 more."""
    out = run_child(ranks.urls, [[0, 400], [0, 400], [0, 400]], limit=256)
    assert out["limit"] == 256
    in_flight, idle = fd_budget.budget(256, 1024)
    assert (out["in_flight"], out["idle_cap"]) == (in_flight, idle)
    assert in_flight + idle + 64 <= 256
    assert [s["ok"] for s in out["sweeps"]] == [400, 400, 400], out["sweeps"]
    assert all(s["idle"] <= idle for s in out["sweeps"])


def test_a_connect_without_descriptors_makes_room_in_the_idle_pool(ranks):
    """Something else in the process took every descriptor left: a connect that fails with
    EMFILE closes idle connections (the pool keeps fewer from then on) and is retried, so
    ranks the poller never connected to still answer."""
    out = run_child(ranks.urls, [[0, 40], "eat", [40, 80]], limit=256, concurrency=1)
    first, second = out["sweeps"]
    assert first["ok"] == 40 and first["idle"] == 40
    assert second["ok"] == 40, second["errors"]
    assert second["idle_cap"] < out["idle_cap"]  # the budget learned what is really left


def test_no_descriptor_and_nothing_idle_is_an_error_that_names_the_limit(ranks):
    """With no descriptor left and no idle connection to close, the poll fails with reason
    ``monitor`` (the monitor could not ask: test_a_poll_the_monitor_could_not_make_is_no_
    evidence) and an error that says it is the monitor's own limit and how to raise it."""
    out = run_child(ranks.urls, ["eat", [0, 3]], limit=256, concurrency=1)
    (sweep,) = out["sweeps"]
    assert sweep["ok"] == 0
    assert sweep["reasons"] == ["monitor"]
    (error,) = sweep["errors"]
    assert "Too many open files" in error
    assert "the monitor's own file descriptors, limit 256" in error
    assert "LimitNOFILE=" in error and "ulimit -n" in error


def test_the_soft_limit_is_raised_to_the_hard_one():
    """A Poller raises its process's soft limit to the hard limit (never above, never down)."""
    script = ("import resource; from monitor.poll.poller import Poller; p = Poller(); "
              "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], p.fd_limit); p.close()")
    got = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=60,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                               (256, 512)))
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["512", "512"]


def test_budget_and_advice():
    """The budget leaves a reserve (at most a quarter of the limit), puts at most half of the
    rest in flight; the advice names a limit under which every target keeps its connection."""
    assert fd_budget.budget(1024, 1024) == (384, 384)
    assert fd_budget.budget(20_000, 1024) == (1024, 20_000 - 256 - 1024)
    assert fd_budget.budget(8, 1024) == (3, 3)
    assert fd_budget.advice(1000, 20_000, 1024) is None
    text = fd_budget.advice(100_000, 20_000, 1024)
    assert "(20000)" in text
    need = int(re.search(r"raise the limit to (\d+)", text)[1])
    in_flight, idle = fd_budget.budget(need, 1024)
    assert in_flight == 1024 and idle >= 100_000 + 1024


def test_the_monitor_says_once_when_its_targets_do_not_fit(tmp_path, monkeypatch, caplog):
    """A monitor whose targets do not each fit a pooled connection under its limit says so
    once, with the limit that would fit them (here the limit is read as 256: in-process, the
    test's own limit is the machine's)."""
    import logging

    from monitor import service
    from monitor.config import MonitorConfig

    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(400)]
    mon = service.Monitor(MonitorConfig(port=0, targets=urls, state_path=str(tmp_path / "m.db"),
                                        job="unit"))
    try:
        monkeypatch.setattr(fd_budget, "soft_limit", lambda: 256)
        with caplog.at_level(logging.WARNING, logger="monitor.polling"):
            mon.sweep_once()
            mon.sweep_once()
        said = [r.getMessage() for r in caplog.records if "file descriptor limit" in r.getMessage()]
        assert len(said) == 1
        assert "400 targets" in said[0] and "(256)" in said[0]
        need = int(re.search(r"raise the limit to (\d+)", said[0])[1])
        assert fd_budget.budget(need, mon.cfg.max_concurrency)[1] >= 400 + 1024
    finally:
        mon.stop()


def test_a_poll_the_monitor_could_not_make_is_no_evidence():
    """A rank the monitor could not ask (reason ``monitor``: no file descriptor of its own)
    keeps its last answer, as a rank not asked this sweep: reachable, not fresh, no failure
    counted, never ``dead`` however many sweeps it lasts; the first real failure counts. Both
    ways of building the view (from the last one, and afresh) agree."""
    from monitor.config import DetectorConfig
    from monitor.detect import Detectors
    from monitor.evidence.verification import Verifier
    from monitor.evidence.view import ViewBuilder
    from monitor.poll.discovery import Target
    from monitor.poll.poller import REASONS, RankPoll
    from tests.support.monitor_sim import rank_state

    assert "monitor" in REASONS
    targets = [Target(f"http://127.0.0.1:{9000 + r}", "static") for r in range(4)]
    states = [rank_state(r, r // 2, now=100.0) for r in range(4)]
    for r, s in enumerate(states):
        s.update(group_rank=r % 2, group_world_size=2)
    urls = {t.url for t in targets}
    out_of_fds = RankPoll(targets[3].url, False, reason="monitor",
                          error="OSError: [Errno 24] Too many open files (the monitor's own ...)")
    for polled in (urls, None):  # leader polling's incremental view; every rank, afresh
        vb, det, verifier = ViewBuilder(), Detectors(DetectorConfig(dead_sweeps=3)), Verifier()

        def judge(ranks, changed, verifier=verifier):  # as a monitor without --lighthouse
            return verifier.judge(ranks, changed, None, None, False, 100.0)

        view = vb.update(targets, {t.url: RankPoll(t.url, True, data=dict(s), at=100.0)
                                   for t, s in zip(targets, states, strict=True)},
                         now=100.0, polled=polled, judge=judge)
        first = view.ranks[targets[3].url]
        findings = det.update(view.evidence(), None, 100.0, full_view=view)
        for sweep in range(1, 6):
            now = 100.0 + sweep
            polls = {t.url: RankPoll(t.url, True, data=dict(s, step=100 + sweep), at=now)
                     for t, s in zip(targets[:3], states[:3], strict=True)}
            polls[targets[3].url] = out_of_fds
            view = vb.update(targets, polls, now=now, polled=polled, judge=judge)
            rv = view.ranks[targets[3].url]
            assert rv.reachable and not rv.fresh and rv.failures == 0
            assert rv.state is first.state and rv.answered_at == 100.0
            findings += det.update(view.evidence(), None, now, full_view=view)
        assert not [f for f in findings if f.kind in ("dead", "dead_rank")]
        polls[targets[3].url] = RankPoll(targets[3].url, False, reason="connection",
                                         error="refused")
        view = vb.update(targets, polls, now=106.0, polled=polled, judge=judge)
        rv = view.ranks[targets[3].url]
        assert not rv.reachable and rv.failures == 1 and rv.reason == "connection"


def test_the_url_cache_is_bounded_by_the_sweeps_not_by_a_million(monkeypatch):
    """Ranks that come and go under new addresses (pods rescheduled) left every URL ever polled
    in the request cache until a million (~470 MiB, more than a 10,000-rank monitor): it now
    keeps twice the largest sweep, at least MIN_KEPT."""
    from monitor.poll import http11

    monkeypatch.setattr(http11, "_kept", [http11.MIN_KEPT])  # no larger sweep of other tests
    http11.TARGETS.clear()
    for i in range(http11.MIN_KEPT + 5_000):  # churned addresses, sweeps of 100 at a time
        if i % 100 == 0:
            http11.note_sweep(100)
        http11.target(f"http://10.{i >> 16}.{(i >> 8) & 255}.{i & 255}:9400")
    assert len(http11.TARGETS) <= http11.MIN_KEPT + 1
    http11.TARGETS.clear()
