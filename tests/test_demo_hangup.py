"""A closed terminal (SIGHUP) ends the demo as Ctrl-C does: its processes run in sessions of
their own and would outlive it, unreported. What a killed demo leaves running inside its
namespaces is killed when the next demo sweeps them.

In-process: ``_run`` is replaced; the sweep's test (root and iproute2 only) makes one namespace
and one ``sleep`` in it."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import time

import pytest

from lightkeeper import demo as demo_mod
from lightkeeper.fabric import NETNS_RUN, Fabric


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    demo_mod.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture
def demo_run(monkeypatch):
    """``demo.run`` up to its ``_run``, which the test gives; the terminal's fds are left as
    they are whatever the handler decides."""
    monkeypatch.setattr(demo_mod, "missing_trainer_packages", lambda: [])
    monkeypatch.setattr(os, "dup2", lambda *a: None)

    def with_run(fake):
        monkeypatch.setattr(demo_mod, "_run", fake)
        return demo_mod.run(_args("--no-faults"))

    return with_run


def test_a_closed_terminal_stops_the_demo_as_ctrl_c_does(demo_run):
    def hung_up(*_):
        if signal.getsignal(signal.SIGHUP) in (signal.SIG_DFL, signal.SIG_IGN, None):
            # its default action would end the demo with every process it started left running
            raise AssertionError("no SIGHUP handler while the demo runs")
        try:
            signal.raise_signal(signal.SIGHUP)
        except KeyboardInterrupt:
            return 130  # what _run returns for Ctrl-C, after stopping everything
        return 0

    before = signal.getsignal(signal.SIGHUP)
    assert demo_run(hung_up) == 130
    assert signal.getsignal(signal.SIGHUP) == before


def test_a_demo_started_under_nohup_keeps_ignoring_sighup(demo_run):
    seen = []
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert demo_run(lambda *_: seen.append(signal.getsignal(signal.SIGHUP)) or 0) == 0
        assert seen == [signal.SIG_IGN]
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _ip(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=10)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"),
                    reason="needs root and iproute2 (network namespaces)")
def test_the_sweep_kills_what_runs_in_a_stale_namespace_then_removes_it():
    ns = f"lkf-{_dead_pid()}-0-h0"  # a fabric's host whose demo was SIGKILLed
    proc = None
    assert _ip("netns", "add", ns).returncode == 0
    try:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "30"])
        deadline = time.monotonic() + 5
        while str(proc.pid) not in _ip("netns", "pids", ns).stdout.split():
            assert time.monotonic() < deadline, "the sleep never entered the namespace"
            time.sleep(0.01)
        assert ns in Fabric.sweep_stale()
        assert proc.wait(timeout=5) == -signal.SIGKILL
        assert not (NETNS_RUN / ns).exists()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if (NETNS_RUN / ns).exists():
            _ip("netns", "del", ns)
