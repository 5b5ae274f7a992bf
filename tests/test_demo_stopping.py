"""What the demo started is stopped, and only that: a reaped process is signalled nothing (its PID
may be another process's by now), a Lighthouse or Prometheus interrupted while it starts is
stopped, and a Ctrl-C or SIGTERM while the namespaced hosts are built ends the demo after
removing them instead of falling back to loopback hosts.

In-process; the "servers" are ``sleep`` scripts, no namespace is made (``Fabric._build`` is
replaced)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightkeeper import cluster as cluster_mod
from lightkeeper import demo as demo_mod
from lightkeeper import processes, prometheus
from lightkeeper.cluster import LocalCluster
from lightkeeper.fabric import Fabric, FabricError
from lightkeeper.processes import stop_process
from tests.support.demo import demo_args


def _sleeper(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in server: writes its PID to a file, then sleeps (whatever its arguments)."""
    pid_file = tmp_path / "server.pid"
    exe = tmp_path / "server"
    exe.write_text(f'#!/bin/sh\necho $$ > "{pid_file}.tmp"\nmv "{pid_file}.tmp" "{pid_file}"\n'
                   "exec sleep 30\n")
    exe.chmod(0o755)
    return exe, pid_file


def _started_pid(pid_file: Path) -> int:
    deadline = time.monotonic() + 10
    while not pid_file.exists():
        assert time.monotonic() < deadline, "the stand-in server never started"
        time.sleep(0.005)
    return int(pid_file.read_text())


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill_left(pid: int | None) -> None:
    if pid is not None and _running(pid):  # only where the code under test left it
        os.kill(pid, signal.SIGKILL)


# --- a reaped process ------------------------------------------------------------------------
def test_a_reaped_process_is_signalled_nothing(monkeypatch):
    proc = subprocess.Popen(["true"])
    proc.wait()
    sent = []
    monkeypatch.setattr(processes.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    stop_process(proc, grace=0)
    stop_process(proc, grace=1.0)
    assert sent == []


def test_a_demo_stops_none_of_its_processes_that_already_exited(tmp_path, monkeypatch):
    from lightkeeper.scenario import Scenario

    demo = demo_mod.Demo(demo_args(), Scenario(), tmp_path)
    done = subprocess.Popen(["true"])
    done.wait()  # an evicted group's process, long gone: its PID may be reused
    demo.procs.append(done)
    sent = []
    monkeypatch.setattr(processes.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    demo.stop(grace=0)
    assert sent == []


def test_a_remembered_pid_that_is_another_process_now_is_not_signalled(monkeypatch):
    proc = subprocess.Popen(["sleep", "30"])
    try:
        remembered = processes.stamped([proc.pid])
        assert [pid for pid, _ in remembered] == [proc.pid]
        sent = []
        with monkeypatch.context() as m:
            m.setattr(processes.os, "kill", lambda pid, sig: sent.append((pid, sig)))
            processes.signal_same(remembered, signal.SIGTERM)
            # the same PID with another start time: a process that came after it
            processes.signal_same([(proc.pid, remembered[0][1] + 1)], signal.SIGKILL)
        assert sent == [(proc.pid, signal.SIGTERM)]
    finally:
        stop_process(proc, grace=0)
    assert proc.returncode == -signal.SIGKILL


# --- what a killed demo left ------------------------------------------------------------------
@pytest.mark.parametrize("hosts", [("--hosts", "loopback"), ("--one-host",)])
def test_a_demo_kills_what_a_killed_earlier_demo_left_whatever_its_hosts(tmp_path, monkeypatch,
                                                                          capsys, hosts):
    """A SIGKILLed demo stops nothing: its processes, in sessions of their own, train on. The
    next demo kills, before it starts anything, every process whose environment names a demo
    that no longer runs (``OWNER_ENV``), and no other; each process it starts names it."""
    from lightkeeper.processes import OWNER_ENV, owner_mark
    from lightkeeper.scenario import Scenario

    monkeypatch.delenv(OWNER_ENV, raising=False)
    killed = subprocess.Popen(["sleep", "30"])  # the demo that was killed
    mark = owner_mark(killed.pid)
    killed.kill()
    killed.wait()
    env = {k: v for k, v in os.environ.items() if k != OWNER_ENV}
    left = subprocess.Popen(["sleep", "60"], env={**env, OWNER_ENV: mark},
                            start_new_session=True)
    running = subprocess.Popen(["sleep", "60"], env={**env, OWNER_ENV: owner_mark(os.getpid())})
    other = subprocess.Popen(["sleep", "60"], env=env)
    demo = demo_mod.Demo(demo_args(*hosts), Scenario(), tmp_path)
    named = []

    def lighthouse():  # the first process a demo starts: nothing more is needed here
        named.append(os.environ.get(OWNER_ENV))
        raise processes.ClusterError("stopped here")

    monkeypatch.setattr(demo.cluster, "start_lighthouse", lighthouse)
    try:
        with pytest.raises(processes.ClusterError):
            demo.start()
        assert left.wait(timeout=10) == -signal.SIGKILL
        assert running.poll() is None and other.poll() is None
        assert named == [owner_mark(os.getpid())]
        assert str(left.pid) in capsys.readouterr().out
        demo.stop(grace=0)
        assert OWNER_ENV not in os.environ
    finally:
        for p in (left, running, other):
            stop_process(p, grace=0)


# a demo in a container: its processes name its owner by its own PID namespace's pid
_CONTAINED_DEMO = """
import os, subprocess, sys
from lightkeeper.processes import OWNER_ENV, owner_mark
os.environ[OWNER_ENV] = owner_mark(os.getpid())
child = subprocess.Popen(["sleep", "60"])
print(os.getpid(), flush=True)
sys.stdin.read()  # runs until the test closes its stdin
"""


def test_a_demo_running_in_another_pid_namespace_is_not_swept(monkeypatch):
    """A demo running in a container (its own PID namespace) marks its processes with its pid
    there, which names another process (or none) out here: a demo started out here leaves
    them running."""
    from lightkeeper.processes import OWNER_ENV, descendants, kill_orphans

    cmd = ["unshare", "--pid", "--fork", "--mount-proc"]
    try:
        probe = subprocess.run([*cmd, "true"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no unshare(1) here to run a demo in a PID namespace of its own")
    if probe.returncode != 0:
        pytest.skip(f"unshare --pid is not permitted here (root or user namespaces needed): "
                    f"{probe.stderr.strip()}")
    monkeypatch.delenv(OWNER_ENV, raising=False)
    root = str(Path(__file__).resolve().parents[1])
    demo = subprocess.Popen([*cmd, sys.executable, "-c", _CONTAINED_DEMO], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": root})
    try:
        assert demo.stdout.readline().strip() == "1"  # the container's first process
        theirs = descendants(demo.pid)
        assert len(theirs) == 2  # the demo and its sleep
        killed = kill_orphans()
        assert not set(killed) & set(theirs)
        for pid in theirs:  # not a zombie either: the contained demo reaps nothing
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    finally:
        stop_process(demo, grace=0)


# --- interrupted while starting --------------------------------------------------------------
@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, TimeoutError])
def test_a_lighthouse_interrupted_while_it_starts_is_stopped(tmp_path, monkeypatch, interrupt):
    exe, pid_file = _sleeper(tmp_path)
    monkeypatch.setattr(sys, "executable", str(exe))

    def wait_until(predicate, timeout, **_):
        _started_pid(pid_file)
        raise interrupt()  # a Ctrl-C, or the 30 s running out, as it waits for the URL

    monkeypatch.setattr(cluster_mod, "wait_until", wait_until)  # as cluster.py calls it
    cluster = LocalCluster(tmp_path / "logs")
    pid = None
    try:
        with pytest.raises(interrupt):
            cluster.start_lighthouse()
        pid = _started_pid(pid_file)
        assert not _running(pid)
    finally:
        _kill_left(pid)


def test_a_prometheus_interrupted_while_it_starts_is_stopped(tmp_path, monkeypatch):
    exe, pid_file = _sleeper(tmp_path)
    monkeypatch.setenv("PROMETHEUS_BIN", str(exe))

    def ready(*_a, **_k):
        _started_pid(pid_file)
        raise KeyboardInterrupt

    monkeypatch.setattr(prometheus.requests, "get", ready)
    pid = None
    try:
        with pytest.raises(KeyboardInterrupt):
            prometheus.start(["127.0.0.1:9"], tmp_path / "prom")
        pid = _started_pid(pid_file)
        assert not _running(pid)
    finally:
        _kill_left(pid)


# --- interrupted while the hosts are built ---------------------------------------------------
@pytest.fixture
def fabric_build(monkeypatch):
    """``Fabric`` with its checks passing and ``_build`` replaced (set ``.build``); records
    ``close`` calls. Going on after the hosts is a test failure, not a demo."""
    state = argparse.Namespace(build=None, closed=0)
    monkeypatch.setattr(Fabric, "unavailable", staticmethod(lambda: None))
    monkeypatch.setattr(Fabric, "sweep_stale", staticmethod(lambda: []))
    monkeypatch.setattr(Fabric, "_build", lambda self: state.build())
    close = Fabric.close

    def closing(self):
        state.closed += 1
        close(self)

    monkeypatch.setattr(Fabric, "close", closing)

    def went_on(*_):
        raise AssertionError("the demo went on after the hosts were interrupted")

    # the lock is taken before the hosts are built: a file of no consequence stands for it
    monkeypatch.setattr(demo_mod, "acquire_lock", lambda: os.open(os.devnull, os.O_RDONLY))
    monkeypatch.setattr(demo_mod, "Demo", went_on)
    monkeypatch.setattr(demo_mod, "missing_trainer_packages", lambda: [])
    return state


def test_ctrl_c_while_the_hosts_are_built_removes_them_and_ends_the_demo(fabric_build, capsys):
    def interrupted():
        raise KeyboardInterrupt

    fabric_build.build = interrupted
    with pytest.raises(KeyboardInterrupt):
        demo_mod.build_fabric(3)
    assert fabric_build.closed == 1
    before = signal.getsignal(signal.SIGTERM)
    assert demo_mod.run(demo_args("--no-faults")) == 130
    assert fabric_build.closed == 2
    assert "interrupted" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before


def test_sigterm_while_the_hosts_are_built_removes_them_and_ends_the_demo(fabric_build):
    def terminated():
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.SIG_IGN, None):
            # its default action would end this process with the namespaces left behind
            raise AssertionError("no SIGTERM handler while the hosts are built")
        signal.raise_signal(signal.SIGTERM)

    fabric_build.build = terminated
    assert demo_mod.run(demo_args("--no-faults", "--hosts", "netns")) == 130
    assert fabric_build.closed == 1


def test_a_second_demo_exits_before_building_any_host(fabric_build, monkeypatch, capsys):
    """The lock used to be taken after the hosts: a second demo built (as root) and removed
    five namespaces before saying another one runs."""
    def built():
        raise AssertionError("hosts built for a demo that cannot run")

    def locked():
        raise demo_mod.DemoLocked("another demo is running (PID 1)")

    fabric_build.build = built
    monkeypatch.setattr(demo_mod, "acquire_lock", locked)
    assert demo_mod.run(demo_args("--no-faults", "--hosts", "netns")) == 1
    assert "another demo is running" in capsys.readouterr().err
    assert fabric_build.closed == 0


def test_a_build_that_fails_is_still_a_fabric_error(fabric_build):
    def fails():
        raise OSError("no bridge here")

    fabric_build.build = fails
    with pytest.raises(FabricError, match="building the fabric failed: no bridge here"):
        Fabric.create(["node-0"])
    assert fabric_build.closed == 1
