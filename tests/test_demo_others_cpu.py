"""The CPU the machine's other processes took while the demo ran: the demo's sampler
(:class:`lightkeeper.demo_sampling.TreeCpu`) on real processes burning CPU in and out of the
tree it watches, the report's ``phases[].others_cores`` from its samples, and the story's clause
where a fault was not back at pace while those processes took more than in the healthy phase
(plain data in the demo's shapes, as tests/test_demo_report_not_back.py builds them)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightkeeper import recovery
from lightkeeper.demo_sampling import TreeCpu
from lightkeeper.report import phases, recoveries
from lightkeeper.report_text import cost_markdown, story_lines, summary_markdown
from tests.test_demo_recovery import T0
from tests.test_demo_report_not_back import EVICTIONS, HANG, RATE, STRAGGLER, paced_run

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc")


def burner(cpu_s: float) -> list[str]:
    """A process that burns ``cpu_s`` seconds of CPU (its own clock, not the wall's), then
    exits."""
    return [sys.executable, "-c", "import time\nend = time.process_time() + " + str(cpu_s)
            + "\nwhile time.process_time() < end:\n    pass"]


# the tree's root: on a line from the test it starts a burner of its own, says its pid and
# waits for it; then it stays until its stdin closes
ROOT = ("import subprocess, sys\nsys.stdin.readline()\np = subprocess.Popen(sys.argv[1:])\n"
        "print(p.pid, flush=True)\np.wait()\nsys.stdin.read()")


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def sample_until(cpu: TreeCpu, done, timeout: float = 60.0) -> list[tuple[float, float]]:
    """The sampler's samples, one a look (as the demo's ticks, more often), until ``done()``."""
    got = [cpu.sample()]
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the burner did not finish"
        time.sleep(0.05)  # the look's period, not a wait for anything
        got.append(cpu.sample())
    got.append(cpu.sample())
    return got


def test_the_trees_own_burner_is_its_own_and_an_outsiders_is_the_others():
    root = subprocess.Popen([sys.executable, "-c", ROOT, *burner(1.0)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    outsider = None
    try:
        cpu = TreeCpu(root.pid)
        first = cpu.sample()
        assert first is not None
        # the tree's own burner: 1 s of CPU counted as the tree's (what the last look before
        # it exited saw: a look's period of it may be missed)
        root.stdin.write("go\n")
        root.stdin.flush()
        pid = int(root.stdout.readline())
        looks = sample_until(cpu, lambda: not running(pid))
        assert looks[-1][1] - first[1] >= 0.8, looks
        owns = [own for _, own in looks]
        assert owns == sorted(owns), "the tree's CPU fell when its burner exited"
        # an outsider's burner, the test's child, not the root's: 1.5 s of CPU in the others'
        before = cpu.sample()
        outsider = subprocess.Popen(burner(1.5))
        looks = sample_until(cpu, lambda: outsider.poll() is not None)
        busy, own = looks[-1][0] - before[0], looks[-1][1] - before[1]
        assert busy - own >= 1.3, (busy, own)
        assert own < 0.5, own
        # the root gone: its last figure stays
        root.stdin.close()
        root.wait(timeout=30)
        assert cpu.sample()[1] >= looks[-1][1]
    finally:
        for p in (root, outsider):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


# the demo's samples: (t, the machine's busy CPU s, the demo's tree's), one every 0.5 s; the
# tree takes 1.2 cores throughout, the others 0.02 to 20 s, then 0.6
def cpu_ticks(end: float = 45.0) -> list[tuple[float, float, float]]:
    out, busy, own = [], 0.0, 0.0
    for i in range(int(end / 0.5) + 1):
        t = i * 0.5
        out.append((t, busy, own))
        busy += 0.5 * (1.2 + (0.02 if t < 20.0 else 0.6))
        own += 0.5 * 1.2
    return out


def test_each_phase_has_the_cores_the_others_took():
    ticks = [(t, int(t * RATE)) for t, _, _ in cpu_ticks()]
    fault = {**STRAGGLER, "group_rank": 1, "evicted_at_s": None, "rejoined_at_s": 30.0}
    got = phases(1.0, 45.0, [fault], 3, ticks, cpu=cpu_ticks())
    assert [(p["name"], p["others_cores"]) for p in got] == [
        ("healthy", 0.02), ("slow_compute in group 1 rank 1", 0.31),
        ("healthy (group 1 rejoined)", 0.6)]
    # not measured (not Linux): null, and the table has no column for it
    got = phases(1.0, 45.0, [fault], 3, ticks)
    assert [p["others_cores"] for p in got] == [None, None, None]
    table = summary_markdown({"faults": [], "phases": got})
    assert "others' CPU" not in table


def not_back_report(others: list[float | None], faults=(STRAGGLER,)) -> dict:
    """The straggler evicted at 11.5 s, the job at 0.78x from 12 s to the end (30 s) or to the
    hang at 30 s (then back at full pace); ``others``: each phase's others' cores."""
    faults = [dict(f) for f in faults]
    names = ["healthy", "slow_compute in group 1", "group 1 evicted (2 groups)",
             "healthy (group 1 rejoined)", "hang in group 2", "group 2 evicted (2 groups)",
             "healthy (group 2 rejoined)"]
    bounds = [0.0, 10.0, 11.5, 14.0, 30.0, 31.5, 34.0, 45.0]
    n = 4 if len(faults) == 1 else 7
    ph = [{"name": names[i], "start_s": bounds[i], "end_s": bounds[i + 1], "steps": None,
           "step_rate": RATE if i == 0 else None, "vs_healthy": 1.0 if i == 0 else None,
           "others_cores": others[i]} for i in range(n)]
    run = paced_run((10.0, 1 / RATE), (11.5, 1.0), 12.0, (30.0, 1 / (0.78 * RATE)),
                    *(() if n == 4 else (32.0, (45.0, 1 / RATE))))
    recoveries(faults, ph, run, [], EVICTIONS[:len(faults)], None, T0, bounds[n], 3,
               recovery.TORCHFT_DEFAULTS)
    return {"faults": faults, "phases": ph}


def test_a_fault_not_back_while_the_others_took_more_says_so():
    rep = not_back_report([0.02, 0.3, 0.5, 0.62])
    line = story_lines(rep)[0]
    assert ("not back at pace by the end; the machine's other processes took 0.62 cores then "
            "(14.0s-30.0s), 0.02 in the healthy phase: the slowdown may be theirs") in line, line
    row = next(r for r in summary_markdown(rep).splitlines() if r.startswith("| healthy (group"))
    assert row.endswith("| 0.62 |"), row
    # what is charged stays as it was
    assert cost_markdown(rep) == cost_markdown(not_back_report([None] * 4))
    # before the next fault: the phase that judged it is the last before its onset
    rep = not_back_report([0.02, 0.3, 0.5, 0.62, 0.9, 0.9, 0.9], faults=(STRAGGLER, HANG))
    line = story_lines(rep)[0]
    assert "not back at pace before fault 2 (30.0s); the machine's other processes took " \
           "0.62 cores then (14.0s-30.0s)" in line, line
    # a fault back at pace: nothing to explain
    assert "back at pace at" in story_lines(rep)[1], story_lines(rep)[1]
    assert "other processes" not in story_lines(rep)[1]


@pytest.mark.parametrize("others", [
    [0.02, 0.6, 0.6, 0.26],   # 0.24 more than the healthy phase: not enough to say
    [None, 0.6, 0.6, 0.62],   # the healthy phase not measured
    [0.02, 0.6, 0.6, None],   # nor the one that judged it
    [0.4, 0.02, 0.02, 0.62]])  # 0.22 more: the others took much of it in the healthy phase
def test_no_clause_where_the_others_took_no_more(others):
    line = story_lines(not_back_report(others))[0]
    assert "not back at pace by the end" in line and "other processes" not in line, line
