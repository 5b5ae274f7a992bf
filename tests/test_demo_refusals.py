"""What ``lightkeeper demo`` refuses before it runs, or still does when it fails: network faults
without host quarantine (their host is healed only once quarantined; a --dry-run, which ends on
its own, takes them) or more of them than spare hosts, or that the monitor could never find (a bad link with two groups, a slow
link before its baseline), a fault whose step --steps never reaches, a report directory another user made or swapped between the check and the run (as
root), more hosts than a fabric has addresses for; namespaces a killed demo left are removed and
said; and a bug in the run still stops everything and writes the report.

In-process: nothing is started (``Demo`` is replaced; the lock is a file of no consequence)."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import pytest

from lightkeeper import demo as demo_mod
from lightkeeper import report
from tests.support.demo import demo_args
from trainer.faults import NETWORK_KINDS


class Reached(Exception):
    """The demo got as far as starting its processes, with this scenario."""

    def __init__(self, sc) -> None:
        super().__init__("reached")
        self.faults = list(sc.faults)
        self.rest = getattr(sc.faults, "rest", iter(()))  # a soak's schedule goes on


class FakeFabric:
    hosts: list = []

    def close(self) -> None:
        pass


@pytest.fixture
def cli(monkeypatch):
    """``demo.run`` with namespaced hosts that are built at once (``built`` counts them) and a
    ``Demo`` that ends the run when it is made (:class:`Reached`)."""
    state = argparse.Namespace(built=0)

    def build_fabric(hosts):
        state.built += 1
        return FakeFabric(), None

    def demo(args, sc, report_dir, fabric):
        raise Reached(sc)

    monkeypatch.setattr(demo_mod, "missing_trainer_packages", lambda: [])
    monkeypatch.setattr(demo_mod, "acquire_lock", lambda: os.open(os.devnull, os.O_RDONLY))
    monkeypatch.setattr(demo_mod, "build_fabric", build_fabric)
    monkeypatch.setattr(demo_mod, "Demo", demo)
    return state


def _scenario(*argv: str) -> list:
    return _reached(*argv).faults


def _reached(*argv: str) -> Reached:
    with pytest.raises(Reached) as got:
        demo_mod.run(demo_args(*argv))
    return got.value


# --- network faults need quarantine ------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--no-quarantine", "--quarantine-dry-run", "--dry-run"])
def test_without_quarantine_the_default_scenario_has_no_network_fault(cli, flag, tmp_path,
                                                                       capsys):
    assert any(p.kind == "partition" for p in _scenario("--report-dir", str(tmp_path / "a")))
    capsys.readouterr()
    faults = _scenario(flag, "--report-dir", str(tmp_path / "b"))
    assert faults and not [p for p in faults if p.kind in NETWORK_KINDS], faults
    assert f"no network fault in the scenario: with {flag}" in capsys.readouterr().out


@pytest.mark.parametrize("flags, drop", [
    (["--no-quarantine"], "--no-quarantine"),
    (["--quarantine-dry-run"], "--quarantine-dry-run"),
    # kept running past its end, the group would be restarted onto the broken host
    (["--dry-run", "--duration", "30", "--keep-running"], "--keep-running"),
])
def test_a_network_fault_without_quarantine_is_refused(cli, flags, drop, capsys):
    code = demo_mod.run(demo_args(*flags, "--inject", "0:partition:at_step=20"))
    err = capsys.readouterr().err
    held = "--dry-run --keep-running" if drop == "--keep-running" else drop
    assert code == 2 and cli.built == 0 and "Traceback" not in err
    assert f"partition:at_step=20 is a network fault, and with {held} its host is never " \
           "healed" in err and f"drop {drop} or the fault" in err, err


def test_more_network_faults_than_spare_hosts_are_refused(cli, tmp_path, capsys):
    # the cap (--max-quarantined) is the spares: the third host's quarantine would be held and
    # its group restarted onto it, evicted once, then held there with the fault on
    faults = ("--inject", "0:partition:at_step=60", "--inject", "1:host_offline:at_step=60",
              "--inject", "2:slow_link:mbit=20,from_step=60")
    code = demo_mod.run(demo_args("--spare-hosts", "2", *faults))
    err = capsys.readouterr().err
    assert code == 2 and cli.built == 0
    assert err.strip() == "lightkeeper demo: 3 network faults with --spare-hosts 2: each " \
        "quarantines its host and moves its group to a spare; past the spares the quarantine " \
        "is held and the group restarted onto the broken host; give --spare-hosts 3 or fewer " \
        "network faults", err
    assert len(_scenario("--spare-hosts", "3", *faults,
                         "--report-dir", str(tmp_path / "r"))) == 3


def test_a_dry_run_soak_has_no_network_fault(cli, tmp_path, capsys):
    # --dry-run runs the monitor with --quarantine-dry-run: no host is ever quarantined
    soak = ("--soak", "600", "--seed", "7")
    assert [p for p in _scenario(*soak, "--report-dir", str(tmp_path / "a"))
            if p.kind in NETWORK_KINDS]
    faults = _scenario("--dry-run", *soak, "--report-dir", str(tmp_path / "b"))
    assert faults and not [p for p in faults if p.kind in NETWORK_KINDS], faults
    assert "no network fault in the scenario: with --dry-run" in capsys.readouterr().out


@pytest.mark.parametrize("bound", [(), ("--duration", "30"), ("--steps", "200")])
def test_a_dry_run_takes_a_network_fault_and_says_its_host_stays_broken(cli, bound, tmp_path,
                                                                        capsys):
    # torchft alone (bench_network.py): nothing is evicted nor restarted onto the broken host,
    # and the run ends on its own, bounded or not
    faults = _scenario("--dry-run", *bound, "--inject", "0:partition:at_step=60",
                       "--report-dir", str(tmp_path / "r"))
    assert [p.spec for p in faults] == ["partition:at_step=60"]
    assert "partition:at_step=60: with --dry-run its host is never quarantined nor healed: it " \
           "stays broken until the run's end" in capsys.readouterr().out


@pytest.mark.parametrize("also", ["--quarantine-dry-run", "--no-quarantine"])
def test_a_dry_run_with_quarantine_off_too_takes_a_network_fault(cli, also, tmp_path, capsys):
    # the monitor of a --dry-run quarantines nothing anyway: the run is a plain --dry-run
    faults = _scenario("--dry-run", also, "--inject", "0:partition:at_step=60",
                       "--report-dir", str(tmp_path / "r"))
    assert [p.spec for p in faults] == ["partition:at_step=60"]
    assert "with --dry-run its host is never quarantined nor healed" in capsys.readouterr().out


@pytest.mark.parametrize("hosts", [("--hosts", "loopback"), ("--one-host",)])
def test_a_network_fault_without_namespaces_is_refused_before_anything_is_said(cli, hosts,
                                                                               capsys):
    code = demo_mod.run(demo_args(*hosts, "--dry-run", "--inject", "1:partition:at_step=20"))
    got = capsys.readouterr()
    assert code == 2 and cli.built == 0 and got.out == "", got.out
    assert "partition:at_step=20 is a network fault: it needs hosts that are network " \
           "namespaces (--hosts netns; not with" in got.err, got.err


def test_auto_hosts_without_namespaces_refuse_a_network_fault_saying_nothing_else(
        cli, monkeypatch, capsys):
    # --hosts auto where namespaces cannot be made (not root, no unshare, too many hosts): the
    # dry run's "stays broken" line came before the refusal of a run that never starts
    monkeypatch.setattr(demo_mod, "build_fabric", lambda hosts: (None, "not root"))
    code = demo_mod.run(demo_args("--dry-run", "--inject", "1:partition:at_step=20"))
    got = capsys.readouterr()
    assert code == 2 and got.out == "", got.out
    assert "partition:at_step=20 is a network fault: it needs hosts that are network " \
           "namespaces (--hosts netns; not root)" in got.err, got.err


@pytest.mark.parametrize("spec", ["partition:at_step=60", "slow_link:mbit=20,from_step=60"])
def test_a_link_fault_with_two_groups_is_refused_a_host_gone_is_not(cli, spec, tmp_path,
                                                                    capsys):
    # a bad link between two hosts is placed on neither: the job would stall to its end
    code = demo_mod.run(demo_args("--groups", "2", "--inject", f"0:{spec}"))
    err = capsys.readouterr().err
    assert code == 2 and cli.built == 0 and "Traceback" not in err
    assert err.strip() == f"lightkeeper demo: {spec} with --groups 2: the monitor places a bad " \
        "link among 3 hosts or more, so it would never be found and its group never " \
        "moved off it; give --groups 3 or more"
    assert [p.kind for p in _scenario("--groups", "2", "--inject", "0:host_offline:at_step=60",
                                      "--report-dir", str(tmp_path / "r"))] == ["host_offline"]


def test_a_two_group_soak_draws_no_link_fault_but_takes_a_host_gone(cli, tmp_path):
    from itertools import islice

    got = _reached("--soak", "600", "--seed", "7", "--groups", "2",
                   "--report-dir", str(tmp_path / "r"))
    kinds = {p.kind for p in got.faults + list(islice(got.rest, 300))}
    assert "host_offline" in kinds and not kinds & {"partition", "slow_link"}, kinds
    assert {"slow_compute", "hang"} <= kinds


def test_a_slow_link_before_the_monitors_baseline_is_refused(cli, tmp_path, capsys):
    from monitor.config import DetectorConfig
    from trainer.faults import FaultSpecError, parse_fault

    cfg = DetectorConfig()  # the demo runs the monitor at its defaults
    first = cfg.job_baseline_windows * cfg.straggler_steps
    code = demo_mod.run(demo_args("--inject", f"0:slow_link:mbit=20,from_step={first - 1}"))
    err = capsys.readouterr().err
    assert code == 2 and f"from_step below {first}," in err and "never be judged" in err
    assert _scenario("--inject", f"0:slow_link:mbit=20,from_step={first}",
                     "--report-dir", str(tmp_path / "a"))
    # the trainer's own example is one the demo finds
    with pytest.raises(FaultSpecError) as e:
        parse_fault("slow_link")
    example = str(e.value).split("e.g. ", 1)[1]
    assert _scenario("--inject", f"0:{example}", "--report-dir", str(tmp_path / "b"))


@pytest.mark.parametrize("spec, step", [
    ("hang:at_step=30", "at_step"), ("slow:delay=0.5,from_step=30", "from_step"),
    ("slow_compute:factor=3,from_step=30,rank=1", "from_step"),
    ("slow_link:mbit=20,from_step=30", "from_step"),
])
def test_a_fault_whose_step_the_run_never_reaches_is_refused(cli, spec, step, tmp_path, capsys):
    # a from_step at or past --steps was taken and never struck
    code = demo_mod.run(demo_args("--steps", "30", "--inject", f"0:{spec}"))
    err = capsys.readouterr().err
    assert code == 2 and cli.built == 0
    assert err == f"lightkeeper demo: --inject {spec!r}: {step} is never reached with --steps " \
        "30 (steps 0 to 29)\n"
    assert _scenario("--steps", "31", "--inject", f"0:{spec}", "--report-dir", str(tmp_path))


# --- the report directory, as root -------------------------------------------------------------
@pytest.mark.parametrize("swap", ["world-writable", "link"])
def test_a_report_dir_made_by_someone_else_after_the_check_is_refused(cli, monkeypatch,
                                                                       tmp_path, capsys, swap):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    target, elsewhere = tmp_path / "run" / "report", tmp_path / "theirs"

    def appears():  # between the check (it did not exist) and the demo creating it
        if swap == "link":
            elsewhere.mkdir()
            target.parent.mkdir()
            target.symlink_to(elsewhere)
        else:
            target.mkdir(parents=True)
            target.chmod(0o777)
        return os.open(os.devnull, os.O_RDONLY)

    monkeypatch.setattr(demo_mod, "acquire_lock", appears)
    code = demo_mod.run(demo_args("--no-faults", "--hosts", "loopback", "--report-dir", str(target)))
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"--report-dir {target}: " in err and "Traceback" not in err
    assert not os.listdir(target)  # nothing written there


def test_a_report_dir_the_demo_creates_is_its_own(cli, tmp_path):
    target = tmp_path / "new" / "report"
    _scenario("--no-faults", "--hosts", "loopback", "--report-dir", str(target))
    assert target.is_dir() and target.stat().st_mode & 0o777 == 0o700


# --- hosts -------------------------------------------------------------------------------------
def test_more_namespaced_hosts_than_a_fabric_has_is_refused_up_front(cli, capsys):
    from lightkeeper.fabric import MAX_HOSTS

    code = demo_mod.run(demo_args("--hosts", "netns", "--groups", "3",
                              "--spare-hosts", str(MAX_HOSTS - 2)))
    err = capsys.readouterr().err
    assert code == 2 and cli.built == 0
    assert f"at most {MAX_HOSTS} (one namespace each)" in err


def test_auto_hosts_beyond_a_fabric_fall_back_to_loopback(monkeypatch):
    from lightkeeper.fabric import MAX_HOSTS, Fabric

    monkeypatch.setattr(Fabric, "unavailable", staticmethod(lambda: None))

    def create(nodes):
        raise AssertionError("a fabric built for more hosts than it has addresses")

    monkeypatch.setattr(Fabric, "create", staticmethod(create))
    monkeypatch.setattr(Fabric, "sweep_stale", staticmethod(lambda: []))
    fabric, note = demo_mod.build_fabric(MAX_HOSTS + 1)
    assert fabric is None and f"a fabric has at most {MAX_HOSTS}" in note


def test_namespaces_a_killed_demo_left_are_removed_and_said(monkeypatch, capsys):
    from lightkeeper.fabric import Fabric

    left = ["lkf-4242-0-ctl", "lkf-4242-0-h0"]
    swept = []
    monkeypatch.setattr(Fabric, "unavailable", staticmethod(lambda: None))
    monkeypatch.setattr(Fabric, "create", staticmethod(lambda nodes: FakeFabric()))
    monkeypatch.setattr(Fabric, "sweep_stale", staticmethod(lambda: swept.pop() if swept else []))
    swept.append(left)
    assert demo_mod.build_fabric(3)[0] is not None
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "killed earlier demo left: " + ", ".join(left) in out
    demo_mod.build_fabric(3)  # nothing left: nothing said
    assert capsys.readouterr().out == ""


# --- a bug in the run ------------------------------------------------------------------------
class BuggyDemo:
    def __init__(self, args, sc, report_dir, fabric) -> None:
        self.tracks, self.faults, self.monitor_url, self.monitor_proc = [], [], None, None
        self.keeping = self.interrupted = self.stopped = False
        self.error = None

    def start(self) -> None:
        raise RuntimeError("a bug")

    def stop(self) -> None:
        self.stopped = True


def test_a_bug_in_the_run_still_stops_everything_and_writes_the_report(cli, monkeypatch,
                                                                       tmp_path):
    written = []

    def write_report(demo, report_dir, final=True):
        written.append((demo.stopped, demo.error, Path(report_dir)))
        return "the summary"

    monkeypatch.setattr(demo_mod, "Demo", BuggyDemo)
    monkeypatch.setattr(report, "write_report", write_report)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="a bug"):  # told after the report, not swallowed
        demo_mod.run(demo_args("--no-faults", "--hosts", "loopback", "--report-dir",
                           str(tmp_path / "r")))
    assert written == [(True, "RuntimeError: a bug", tmp_path / "r")]
    assert signal.getsignal(signal.SIGTERM) == before
