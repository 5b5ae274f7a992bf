"""``lightkeeper demo --inject GROUP[.RANK]:SPEC``: placements are checked before anything starts.

Unit tests of :func:`lightkeeper.scenario.parse_inject` (the grammar is the trainer's,
``trainer/faults.py``), and the command itself: a bad placement exits with status 2 and a
message naming the problem, without starting a process or writing a report.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightkeeper.scenario import FaultPlan, default_faults, parse_inject


@pytest.mark.parametrize("value,plan", [
    ("1.1:slow_compute:factor=3", FaultPlan(1, "slow_compute", "slow_compute:factor=3,rank=1", 1)),
    ("1.1:slow_compute:delay=0.5,from_step=20",
     FaultPlan(1, "slow_compute", "slow_compute:delay=0.5,from_step=20,rank=1", 1)),
    ("0:hang:at_step=40", FaultPlan(0, "hang", "hang:at_step=40", None)),
    ("2:slow:delay=0.3,from_step=20", FaultPlan(2, "slow", "slow:delay=0.3,from_step=20", None)),
    ("2.0:hang:at_step=9,where=group", FaultPlan(2, "hang", "hang:at_step=9,where=group,rank=0", 0)),
    ("1:mismatch:at_step=5,rank=1", FaultPlan(1, "mismatch", "mismatch:at_step=5,rank=1", 1)),
    ("1.1:crash:at_step=5,rank=1", FaultPlan(1, "crash", "crash:at_step=5,rank=1", 1)),
    (" 1.1 :slow_compute:factor=2", FaultPlan(1, "slow_compute", "slow_compute:factor=2,rank=1", 1)),
    ("0:partition:at_step=30", FaultPlan(0, "partition", "partition:at_step=30", None)),
    ("2:slow_link:mbit=20", FaultPlan(2, "slow_link", "slow_link:mbit=20", None)),
])
def test_good_placements(value, plan):
    got = parse_inject(value, groups=3, ranks_per_group=2)
    assert got == plan and got.at_start


@pytest.mark.parametrize("value,groups,ranks,message", [
    ("3:hang:at_step=4", 3, 2, "group 3 is out of range: the demo runs 3 replica groups (0..2"),
    ("1.2:hang:at_step=4", 3, 2, "rank 2 is out of range: each group has 2 ranks (0..1"),
    ("1.1:hang:at_step=4", 3, 1, "rank 1 is out of range: each group has 1 rank (0..0"),
    ("1:hang:at_step=4,rank=2", 3, 2, "rank=2 in 'hang:at_step=4,rank=2' is out of range"),
    ("1.0:hang:at_step=4,rank=1", 3, 2, "the placement says rank 0, the spec rank=1"),
    ("1:hang:at_step=4,where=group", 3, 1, "where=group in 'hang:at_step=4,where=group' needs"),
    ("x:hang:at_step=4", 3, 2, "expected GROUP[.RANK]:SPEC"),
    ("1.:hang:at_step=4", 3, 2, "expected GROUP[.RANK]:SPEC"),
    ("-1:hang:at_step=4", 3, 2, "expected GROUP[.RANK]:SPEC"),
    ("1.1.1:hang:at_step=4", 3, 2, "expected GROUP[.RANK]:SPEC"),
    ("1", 3, 2, "expected GROUP[.RANK]:SPEC"),
    ("1:hang", 3, 2, "fault 'hang' has no parameters"),
    ("1:hang:at=3", 3, 2, "hang takes at_step, where, rank; got unknown parameter 'at'"),
    ("1:slow_compute:factor=0.5", 3, 2, "factor in 'slow_compute:factor=0.5' must be > 1"),
    ("1:bogus:x=1", 3, 2, "unknown fault kind 'bogus'"),
    ("1.1:partition:at_step=4", 3, 2, "strikes the group's host, every rank on it: give GROUP"),
])
def test_bad_placements_name_the_problem(value, groups, ranks, message):
    with pytest.raises(ValueError) as e:
        parse_inject(value, groups=groups, ranks_per_group=ranks)
    assert message in str(e.value), str(e.value)
    assert str(e.value).startswith(f"--inject {value!r}: ")


def test_default_faults_strike_single_ranks():
    slow, hang = default_faults(3, 2)
    assert (slow.replica_group, slow.kind, slow.group_rank, slow.at_start) == (
        1, "slow_compute", 1, False)
    assert (hang.replica_group, hang.kind, hang.group_rank, hang.at_start) == (2, "hang", 1, False)
    assert [p.replica_group for p in default_faults(2, 1)] == [1, 1]


def test_namespaced_hosts_add_a_partition_of_the_fault_free_group():
    *_, part = default_faults(3, 2, network=True)
    assert (part.replica_group, part.kind, part.group_rank, part.at_start) == (
        0, "partition", None, False)
    assert [p.kind for p in default_faults(2, 2, network=True)] == ["slow_compute", "hang"]


@pytest.mark.parametrize("args,message", [
    (["--inject", "3:hang:at_step=4"], "group 3 is out of range"),
    (["--inject", "1.5:slow_compute:factor=3"], "rank 5 is out of range"),
    (["--ranks-per-group", "1", "--inject", "1:hang:at_step=4,where=group"], "needs a replica"),
    (["--inject", "1:hang:at_step=4", "--inject", "one:hang:at_step=4"],
     "expected GROUP[.RANK]:SPEC"),
    (["--steps", "30", "--inject", "0:hang:at_step=40"],
     "at_step is never reached with --steps 30 (steps 0 to 29)"),
])
def test_the_demo_rejects_a_bad_placement_before_starting(tmp_path, args, message):
    report_dir = tmp_path / "report"
    proc = _demo("--report-dir", str(report_dir), *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and proc.stderr.startswith("lightkeeper demo: --inject ")
    assert "Traceback" not in proc.stderr
    assert not report_dir.exists()  # nothing started, nothing written


def test_a_network_fault_without_namespaced_hosts_is_refused_before_starting(tmp_path):
    report_dir = tmp_path / "report"
    proc = _demo("--report-dir", str(report_dir), "--hosts", "loopback", "--inject",
                 "1:host_offline:at_step=9")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "host_offline:at_step=9 is a network fault: it needs hosts that are network " \
           "namespaces" in proc.stderr
    assert not report_dir.exists()


def _demo(*args: str) -> subprocess.CompletedProcess:
    """``lightkeeper demo ARGS``, expected to refuse at once. Should it start a job instead, it
    is stopped with SIGTERM, which stops every process it started, and the test fails."""
    cmd = [sys.executable, "-m", "lightkeeper.cli", "demo", *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.terminate()
            p.communicate(timeout=120)
            raise AssertionError(f"lightkeeper demo {' '.join(args)} started a job") from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


@pytest.mark.parametrize("args,message", [
    (["--groups", "1"], "--groups must be >= 2, got 1"),
    (["--ranks-per-group", "0"], "--ranks-per-group must be >= 1, got 0"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--duration", "-5"], "--duration must be a number of seconds > 0, got -5"),
    (["--duration", "0"], "--duration must be a number of seconds > 0, got 0"),
    (["--step-pause", "-1"], "--step-pause must be a number >= 0, got -1"),
    (["--pg-timeout", "nan"], "--pg-timeout must be a number >= 0, got nan"),
    (["--seed", "3"], "--seed needs --soak"),
    (["--one-host", "--hosts", "netns"], "--one-host and --hosts netns exclude each other"),
    # refused before the hosts are built (as root, network namespaces)
    (["--soak", "0"], "--soak takes seconds > 0 and draws its own faults"),
    (["--soak", "30", "--no-faults"], "--soak takes seconds > 0 and draws its own faults"),
    # inf: its monitor restart at half-time never came, and soak.json held Infinity
    (["--soak", "inf"], "--soak takes seconds > 0 and draws its own faults"),
    (["--hosts", "loopback", "--inject", "1:partition:at_step=20"],
     "partition:at_step=20 is a network fault: it needs hosts that are network namespaces "
     "(--hosts netns; not with --hosts loopback)"),
])
def test_a_bad_option_is_one_line_naming_it_before_starting(tmp_path, args, message):
    report_dir = tmp_path / "report"
    proc = _demo("--report-dir", str(report_dir), *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == f"lightkeeper demo: {message}\n" or message in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert not report_dir.exists()


def test_a_report_dir_that_cannot_be_one_is_refused_before_starting(tmp_path):
    """A file, or a directory holding a run: its monitor would reopen that run's audit log
    and quarantines (and drain the new run's groups off the old run's quarantined hosts)."""
    a_file = tmp_path / "f"
    a_file.write_text("mine")
    proc = _demo("--report-dir", str(a_file))
    assert proc.returncode == 2 and "--report-dir" in proc.stderr and "not a directory" in \
        proc.stderr and "Traceback" not in proc.stderr
    assert a_file.read_text() == "mine"
    used = tmp_path / "used"
    used.mkdir()
    (used / "monitor.sqlite").write_bytes(b"an earlier run")
    proc = _demo("--report-dir", str(used))
    assert proc.returncode == 2 and "holds a run already (monitor.sqlite)" in proc.stderr
    assert (used / "monitor.sqlite").read_bytes() == b"an earlier run"
    assert sorted(p.name for p in used.iterdir()) == ["monitor.sqlite"]


def test_the_demos_lock_is_never_taken_through_a_link_or_from_another_user(tmp_path,
                                                                            monkeypatch):
    """The lock lives in /tmp under a fixed name: root's demo truncated and wrote its PID into
    whatever a local user had linked there (/etc/...), and offered to kill a PID read from a
    file anyone could plant."""
    import os
    import tempfile

    from lightkeeper.demo import LOCK_NAME, DemoLocked, acquire_lock

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / LOCK_NAME).symlink_to(victim)
    with pytest.raises(DemoLocked, match="cannot hold the demo's lock"):
        acquire_lock()
    assert victim.read_text() == "precious\n"
    (tmp_path / LOCK_NAME).unlink()
    if os.geteuid() == 0:  # a planted file of another user
        (tmp_path / LOCK_NAME).write_text("1\n")
        os.chown(tmp_path / LOCK_NAME, 65534, 65534)
        with pytest.raises(DemoLocked, match="not a regular file of this user"):
            acquire_lock()
        (tmp_path / LOCK_NAME).unlink()
    fd = acquire_lock()  # its own: held
    os.close(fd)


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="the check is root's")
def test_as_root_a_report_dir_others_may_write_in_is_refused(tmp_path):
    """Root's spare hosts read what to run (environment, arguments) from files there."""
    from lightkeeper.demo_reportdir import check_report_dir

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match="another user owns or may write in"):
        check_report_dir(str(shared))
    shared.chmod(0o755)
    assert check_report_dir(str(shared)) == shared
