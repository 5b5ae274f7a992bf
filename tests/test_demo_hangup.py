"""A closed terminal (SIGHUP) ends the demo as Ctrl-C does: its processes run in sessions of
their own and would outlive it, unreported. What a killed demo leaves running inside its
namespaces is killed when the next demo sweeps them.

In-process: ``_run`` is replaced; the sweep's test (root and iproute2 only) makes one namespace
and one ``sleep`` in it."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import time

import pytest

from lightkeeper import demo as demo_mod
from lightkeeper.fabric import NETNS_RUN, Fabric
from tests.support.demo import demo_args


@pytest.fixture
def demo_run(monkeypatch):
    """``demo.run`` up to its ``_run``, which the test gives; the terminal's fds are left as
    they are whatever the handler decides."""
    monkeypatch.setattr(demo_mod, "missing_trainer_packages", lambda: [])
    monkeypatch.setattr(os, "dup2", lambda *a: None)

    def with_run(fake):
        monkeypatch.setattr(demo_mod, "_run", fake)
        return demo_mod.run(demo_args("--no-faults"))

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

    # from a terminal's default (pytest run under nohup inherits SIGHUP ignored: kept so)
    before = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        assert demo_run(hung_up) == 130
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_demo_started_under_nohup_keeps_ignoring_sighup(demo_run):
    seen = []
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert demo_run(lambda *_: seen.append(signal.getsignal(signal.SIGHUP)) or 0) == 0
        assert seen == [signal.SIG_IGN]
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)


class _HungUpDemo:
    """A demo whose terminal closes while it starts: ``tee``, the reader of its output, dies
    and the demo gets SIGHUP. Stopping it says nothing."""

    reader: int | None = None  # the read end of the pipe on fd 1

    def __init__(self, args, sc, report_dir, fabric) -> None:
        self.tracks, self.faults, self.monitor_url, self.monitor_proc = [], [], None, None
        self.keeping = self.interrupted = False
        self.error = None

    def start(self) -> None:
        if self.reader is not None:
            os.close(self.reader)  # from here a write to fd 1 fails (EPIPE)
        signal.raise_signal(signal.SIGHUP)

    def run_scenario(self) -> None:
        pass

    def stop(self) -> None:
        pass


@pytest.fixture
def piped_demo(monkeypatch, tmp_path):
    """``demo.run`` of a ``_HungUpDemo`` (:func:`_piped_run`) as ``lightkeeper demo | tee
    demo.out``. ``write_report`` writes report.json and calls ``during_report``; the SIGTERM
    and SIGHUP handlers the demo started with record what reaches them (``seen``)."""
    from lightkeeper import report

    state = argparse.Namespace(seen=[], during_report=lambda: None, dir=tmp_path / "r")

    def write_report(demo, report_dir, final=True):
        state.during_report()
        (report_dir / "report.json").write_text("{}")
        return "the summary"

    monkeypatch.setattr(demo_mod, "missing_trainer_packages", lambda: [])
    monkeypatch.setattr(demo_mod, "acquire_lock", lambda: os.open(os.devnull, os.O_RDONLY))
    monkeypatch.setattr(demo_mod, "Demo", _HungUpDemo)
    monkeypatch.setattr(report, "write_report", write_report)
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    handlers = {sig: signal.signal(sig, lambda sig, _f: state.seen.append(sig))
                for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield state
    finally:
        for fd, dup in saved.items():  # pytest's capture
            os.dup2(dup, fd)
            os.close(dup)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _piped_run(state, monkeypatch, piped: bool = True) -> int:
    """Run with fd 1 (and ``sys.stdout``, which pytest swaps in for each test phase) a pipe,
    or as pytest left it."""
    if not piped:
        return demo_mod.run(demo_args("--no-faults", "--hosts", "loopback", "--report-dir",
                                  str(state.dir)))
    r, w = os.pipe()
    os.dup2(w, 1)
    os.close(w)
    monkeypatch.setattr(_HungUpDemo, "reader", r)
    out = open(1, "w", closefd=False)  # noqa: SIM115 - closed below, its fd restored
    monkeypatch.setattr("sys.stdout", out)
    try:
        return demo_mod.run(demo_args("--no-faults", "--hosts", "loopback", "--report-dir",
                                  str(state.dir)))
    finally:
        with contextlib.suppress(OSError):
            out.close()


def test_a_hangup_with_its_output_piped_still_writes_the_report(piped_demo, monkeypatch):
    assert _piped_run(piped_demo, monkeypatch) == 130
    assert (piped_demo.dir / "report.json").exists()
    assert piped_demo.seen == []


def test_a_signal_while_the_report_is_written_does_not_cost_the_report(piped_demo,
                                                                       monkeypatch):
    def signalled() -> None:  # once everything is stopped: the old handlers would end the run
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGHUP)

    piped_demo.during_report = signalled
    assert _piped_run(piped_demo, monkeypatch, piped=False) == 130
    assert (piped_demo.dir / "report.json").exists()
    assert piped_demo.seen == []
    # and the handlers it started with are back once the report is out
    signal.raise_signal(signal.SIGTERM)
    assert piped_demo.seen == [signal.SIGTERM]


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


class _ClosedPipeDemo(_HungUpDemo):
    """``lightkeeper demo | head -5``: the reader goes after its lines, with no SIGHUP; the
    demo's next line fails (EPIPE), and so would the lines its stop prints."""

    def start(self) -> None:
        os.close(self.reader)
        print("a line nobody reads", flush=True)

    def stop(self) -> None:
        print("stopping everything", flush=True)


class _GoneAfterTheLastLine(_ClosedPipeDemo):
    """``| head -N`` with N past the scenario's lines: the stop's line is the first to fail."""

    def start(self) -> None:
        os.close(self.reader)


class _GoneQuietly(_HungUpDemo):
    """The reader leaves and nothing more is printed until the summary."""

    def start(self) -> None:
        os.close(self.reader)


class _CtrlCWithTee(_HungUpDemo):
    """``| tee out``, then Ctrl-C: SIGINT ends tee too, so "interrupted; stopping" fails."""

    def start(self) -> None:
        os.close(self.reader)
        raise KeyboardInterrupt


@pytest.mark.parametrize("demo, code", [(_ClosedPipeDemo, 141), (_GoneAfterTheLastLine, 141),
                                        (_GoneQuietly, 141), (_CtrlCWithTee, 130)])
def test_a_reader_that_stops_reading_still_gets_the_report_written(piped_demo, monkeypatch, demo,
                                                                   code):
    monkeypatch.setattr(demo_mod, "Demo", demo)
    assert _piped_run(piped_demo, monkeypatch) == code  # 141: as a shell reports SIGPIPE
    assert (piped_demo.dir / "report.json").exists()
