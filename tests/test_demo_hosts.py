"""The demo's hosts, cheaply: where the supervisor places a group (``HostPool``, as a scheduler
honouring the quarantine taint), the loopback address each host gets, the monitor's quarantine
flags the demo passes, and how a fault's story meets the hosts (``FaultTrack.note_hosts``, the
report's story lines). The live story (a real monitor quarantining a real host, the group
restarted on the spare) is asserted in tests/test_demo_e2e.py on the demo run it already makes."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from lightkeeper.cluster import Host, HostPool, loopback_hosts
from lightkeeper.demo import Demo
from lightkeeper.faulttrack import FaultTrack, Observation
from lightkeeper.report import host_state
from lightkeeper.report_text import story_lines
from lightkeeper.scenario import Scenario
from tests.support.demo import demo_args


def test_loopback_hosts_each_have_their_own_address():
    hosts = loopback_hosts(5)
    assert [h.node for h in hosts] == ["node-0", "node-1", "node-2", "node-3", "node-4"]
    assert [h.addr for h in hosts] == [f"127.0.0.{i}" for i in range(2, 7)]
    assert str(hosts[3]) == "node-3 (127.0.0.5)" and str(Host("h")) == "h"
    with pytest.raises(ValueError, match="at most 250"):
        loopback_hosts(251)


def test_a_group_stays_on_its_host_until_it_is_quarantined_then_moves_to_a_spare():
    pool = HostPool(loopback_hosts(5), groups=3)
    assert [pool.place(g).node for g in range(3)] == ["node-0", "node-1", "node-2"]
    assert [h.node for h in pool.spares()] == ["node-3", "node-4"]
    # a restart on a host that is fine: the same host (a suspect host is not quarantined)
    assert pool.place(1, quarantined=["node-2"]).node == "node-1"
    # its host quarantined: the first spare, recorded
    assert pool.place(2, quarantined=["node-2"]) == Host("node-3", "127.0.0.5")
    assert pool.host_of(2).node == "node-3" and pool.moves[-1] == (2, "node-2", "node-3",
                                                                    "quarantined")
    # a spare that is itself quarantined is skipped; the other one is taken
    pool2 = HostPool(loopback_hosts(5), groups=3)
    assert pool2.place(0, quarantined=["node-0", "node-3"]).node == "node-4"


def test_no_free_host_means_the_group_waits_and_a_never_used_spare_comes_first():
    pool = HostPool(loopback_hosts(4), groups=3)
    assert pool.place(1, quarantined=["node-1"]).node == "node-3"
    # node-1 was used and is now free (released); group 2's host goes bad: node-1 is the only
    # free host left
    assert pool.place(2, quarantined=["node-2", "node-1"]) is None  # nothing free: it waits
    assert pool.host_of(2).node == "node-2"  # not moved while it waits
    assert pool.place(2, quarantined=["node-2"]).node == "node-1"  # node-1 released: there
    pool = HostPool([Host("a"), Host("b"), Host("c"), Host("d")], groups=2)
    pool.place(0, ["a"])  # -> c (never used), a is left free but used before
    assert pool.host_of(0).node == "c"
    assert [h.node for h in pool.spares()] == ["d", "a"]  # never-used first


def test_a_pool_refuses_duplicate_or_too_few_hosts():
    with pytest.raises(ValueError, match="distinct"):
        HostPool([Host("a"), Host("a")], groups=1)
    with pytest.raises(ValueError, match="3 groups need at least 3 hosts"):
        HostPool(loopback_hosts(2), groups=3)


NO_QUARANTINE = "hang=0,mismatch=0,dead_rank=0,straggler=0,network=0,dead=0"


@pytest.mark.parametrize("argv,flags", [
    ((), ["--max-quarantined", "2"]),
    (("--spare-hosts", "3"), ["--max-quarantined", "3"]),
    (("--spare-hosts", "0"), ["--max-quarantined", "1"]),
    (("--quarantine-dry-run",), ["--max-quarantined", "2", "--quarantine-dry-run"]),
    (("--dry-run",), ["--max-quarantined", "2", "--quarantine-dry-run"]),
    (("--no-quarantine",), ["--quarantine-after", NO_QUARANTINE]),
    (("--one-host",), ["--quarantine-after", NO_QUARANTINE]),
])
def test_the_monitor_quarantines_with_a_cap_of_the_spare_hosts(tmp_path, argv, flags):
    demo = Demo(demo_args(*argv), Scenario(), tmp_path)
    assert demo.quarantine_args() == flags
    if "--one-host" in argv:
        assert demo.pool is None
    else:
        assert len(demo.pool.hosts) == 3 + demo.args.spare_hosts


def test_a_bad_spare_hosts_value_exits_2_before_starting(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lightkeeper.cli", "demo", "--report-dir",
                           str(tmp_path / "r"), "--spare-hosts", "-1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--spare-hosts must be >= 0" in proc.stderr, proc.stderr
    assert not (tmp_path / "r").exists()


def _obs(**kw) -> Observation:
    base = dict(t=50.0, t0_unix=1000.0, groups=3, ranks_per_group=2, states={},
                incarnation={}, alive={}, finished={}, strikes=[], findings=[], evictions=[],
                restarts=[])
    return Observation(**{**base, **kw})


def test_a_story_notes_its_host_quarantined_and_the_spare_it_restarted_on():
    tr = FaultTrack(1, replica_group=2, group_rank=1, spec="hang:at_step=9,rank=1", kind="hang",
                    trigger_step=9, given="live", armed_at_s=10.0, counting_from_s=10.0,
                    incarnation=0, step_at_arming=5, ranks_per_group=2)
    r = tr.record
    r.update(struck_at_s=12.0, host="node-2", detected_at_s=15.0, detected_kind="hang",
             culprit_ranks=[5], culprit_hosts=["node-2"], evicted_at_s=15.5,
             restarted_at_s=17.0, rejoined_at_s=30.0, rank=5, outcome="recovered")
    placed = [{"replica_group": 2, "at_s": 0.0, "node": "node-2", "addr": "127.0.0.4"},
              {"replica_group": 1, "at_s": 16.0, "node": "node-1", "addr": "127.0.0.3"},
              {"replica_group": 2, "at_s": 17.0, "node": "node-3", "addr": "127.0.0.5"}]
    # a quarantine of the host from before the strike is not this fault's
    tr.note_hosts(_obs(quarantines={"node-2": 5.0}, placements=placed[:2]))
    assert r["host_quarantined_at_s"] is None and r["restarted_on"] is None
    tr.note_hosts(_obs(quarantines={"node-2": 15.6}, placements=placed))
    assert (r["host_quarantined_at_s"], r["restarted_on"], r["restarted_addr"]) == (
        15.6, "node-3", "127.0.0.5")
    (line,) = story_lines({"faults": [r], "hosts": None})
    assert line == ("fault 1 (hang): struck group 2 rank 5 on node-2 at 12.0s -> hang finding "
                    "naming rank 5 on node-2 at 15.0s -> evicted at 15.5s -> node-2 quarantined "
                    "at 15.6s -> restarted on node-3 (127.0.0.5), a spare host at 17.0s -> "
                    "rejoined at 30.0s; recovered")
    # a host's fault (a partition) strikes the group, not one rank of it
    (line,) = story_lines({"faults": [{**r, "rank": None}], "hosts": None})
    assert line.startswith("fault 1 (hang): struck group 2 on node-2 at 12.0s -> ")


def test_a_host_not_quarantined_says_why_and_a_waiting_group_is_told():
    view = {"hosts": [{"host": "node-1", "state": "suspect", "hold": None, "offences": [
        {"kind": "straggler", "in_window": True}]}], "quarantined": []}
    assert host_state(view, "node-1") == "suspect (1 straggler offence)"
    assert host_state(view, "node-0") == "ok" and host_state(None, "node-0") is None
    f = {"replica_group": 1, "group_rank": 1, "rank": 3, "host": "node-1", "spec": "slow_compute:x",
         "struck_at_s": 10.0, "detected_at_s": 14.0, "detected_kind": "straggler",
         "culprit_ranks": [3], "culprit_hosts": ["node-1"], "evicted_at_s": 14.2,
         "host_quarantined_at_s": None, "host_state": host_state(view, "node-1"),
         "restarted_at_s": 16.0, "restarted_on": "node-1", "restarted_addr": "127.0.0.3",
         "rejoined_at_s": None, "outcome": "evicted, did not rejoin in time"}
    lines = story_lines({"faults": [f], "hosts": {"waiting": {"2": 40.0}}})
    assert "node-1 not quarantined: suspect (1 straggler offence) -> restarted on node-1 " \
           "(127.0.0.3), same host at 16.0s" in lines[0]
    assert lines[1].startswith("group 2 waits since 40.0s: its host is quarantined")


class _Gone:
    """A group whose processes all exited (stand-in: the supervisor's decision is what is
    tested here; the demo e2e restarts real groups)."""

    def __init__(self, code: int = 1) -> None:
        self.proc = argparse.Namespace(returncode=code)

    def alive(self) -> bool:
        return False

    def processes(self) -> list:
        return []


class _Cluster:
    def __init__(self, groups: int) -> None:
        self.groups = {g: _Gone() for g in range(groups)}
        self.started: list[tuple[int, Host | None]] = []

    def start_group(self, g, faults=None, extra_args=None, host=None):
        self.started.append((g, host))
        new = self.groups[g] = argparse.Namespace(alive=lambda: True, warm=True,
                                                  processes=lambda: [])
        return new


def test_the_supervisor_restarts_off_a_quarantined_host_and_waits_when_none_is_free(tmp_path):
    demo = Demo(demo_args("--spare-hosts", "1"), Scenario(), tmp_path)
    demo.cluster = _Cluster(3)
    demo.cluster.groups[0] = demo.cluster.groups[1] = argparse.Namespace(alive=lambda: True)
    demo.hosts_view = {"quarantined": ["node-2"]}
    demo.supervise()  # group 2's host is quarantined: to the spare node-3
    assert demo.cluster.started == [(2, Host("node-3", "127.0.0.5"))]
    assert demo.placements[-1]["why"] == "node-2 quarantined"
    (ev,) = [e for e in demo.events if e["kind"] == "restarted"]
    assert "on node-3 (127.0.0.5), spare host (node-2 quarantined)" in ev["detail"]
    # group 2 exits again and node-3 is quarantined too: no host is free (node-2 still is)
    demo.cluster.groups[2] = _Gone()
    demo.hosts_view = {"quarantined": ["node-2", "node-3"]}
    demo.supervise()
    demo.supervise()  # told once, not every tick
    assert len(demo.cluster.started) == 1 and list(demo.waiting) == [2]
    assert [e["kind"] for e in demo.events].count("waiting") == 1
    # node-2 released: the group starts there, and says how long it waited
    demo.hosts_view = {"quarantined": ["node-3"]}
    demo.supervise()
    assert demo.cluster.started[-1] == (2, Host("node-2", "127.0.0.4")) and not demo.waiting
    assert "after waiting" in demo.events[-1]["detail"]


def test_one_host_restarts_in_place_with_no_host_given(tmp_path):
    demo = Demo(demo_args("--one-host"), Scenario(), tmp_path)
    demo.cluster = _Cluster(3)
    demo.cluster.groups[0] = demo.cluster.groups[1] = argparse.Namespace(alive=lambda: True)
    demo.hosts_view = {"quarantined": ["vm"]}  # nothing to move to: ignored
    demo.supervise()
    assert demo.cluster.started == [(2, None)] and not demo.waiting
    assert demo.events[-1]["detail"] == ("process exited (1); supervisor restarted it "
                                         "(restart 1, warm spare)")


def test_a_group_still_running_on_a_quarantined_host_is_drained_then_restarted(tmp_path):
    """A host off the network never hears the Lighthouse's kill: once its quarantine is older
    than the drain grace, the supervisor stops its group's processes (a real process here) as a
    scheduler evicts a tainted node's pods, and restarts the group on a spare."""
    import subprocess
    import sys

    from lightkeeper.demo_supervisor import DRAIN_GRACE_S

    demo = Demo(demo_args("--spare-hosts", "1"), Scenario(), tmp_path)
    demo.cluster = _Cluster(3)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        demo.cluster.groups[0] = demo.cluster.groups[1] = argparse.Namespace(alive=lambda: True)
        demo.cluster.groups[2] = argparse.Namespace(alive=lambda: proc.poll() is None,
                                                    processes=lambda: [proc], proc=proc)
        demo.hosts_view = {"quarantined": ["node-2"]}
        demo.quarantines["node-2"] = demo.now()  # just now: an evicted group exits by itself
        demo.supervise()
        assert proc.poll() is None and demo.cluster.started == []
        demo.quarantines["node-2"] = demo.now() - DRAIN_GRACE_S
        demo.supervise()
        assert proc.poll() is not None  # stopped by PID
        assert demo.cluster.started == [(2, Host("node-3", "127.0.0.5"))]
        assert any(e["kind"] == "drained" and "node-2" in e["detail"] for e in demo.events)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


class _Ended:
    """A group that trained and exited (``returncode``), or still runs (None)."""

    def __init__(self, returncode):
        self.proc = argparse.Namespace(returncode=returncode)

    def alive(self) -> bool:
        return self.proc.returncode is None


def test_the_run_ends_by_its_duration_or_once_every_group_trained_its_steps(tmp_path):
    demo = Demo(demo_args("--no-faults", "--duration", "3"), Scenario(), tmp_path)
    demo.deadline, demo.train_start_s = 3.0, None
    assert demo.run_over(100.0) is None  # --duration counts from training's start
    demo.train_start_s = 10.0
    assert demo.run_over(12.9) is None and demo.run_over(13.0) == "--duration 3s reached"
    demo.keeping = True  # --keep-running: only Ctrl-C or SIGTERM ends it now
    assert demo.run_over(60.0) is None
    demo = Demo(demo_args("--no-faults", "--steps", "8"), Scenario(), tmp_path)
    demo.deadline = None
    demo.cluster.groups = {0: _Ended(0), 1: _Ended(None)}
    assert demo.run_over(60.0) is None
    demo.cluster.groups[1] = _Ended(1)  # a group that failed did not train its steps
    assert demo.run_over(60.0) is None
    demo.cluster.groups[1] = _Ended(0)
    assert demo.run_over(60.0) == "every group trained 8 steps"
