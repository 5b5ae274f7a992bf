"""A trouble that lasts is said once, then once a minute while it lasts, and once when it ends:
not a warning every sweep. An unreachable Lighthouse (its error names a new connection object
each time), a broken targets file, an --sd-out that cannot be written, a sweep that fails."""

from __future__ import annotations

import json
import logging
import sqlite3

from lightkeeper.processes import wait_until
from monitor.act.trouble import WARN_EVERY_S
from monitor.config import MonitorConfig
from monitor.evidence.lighthouse_status import LighthouseStatus
from monitor.service import Monitor

# nothing listens on port 1 (refused): a port picked with bind(0) and let go may be another
# test's server by the time it is asked
CLOSED_PORT = 1


def test_an_unreachable_lighthouse_is_said_once_a_minute_and_when_it_answers(tmp_path, caplog):
    clock = [1000.0]
    mon = Monitor(MonitorConfig(port=0, lighthouse=f"http://127.0.0.1:{CLOSED_PORT}",
                                lighthouse_timeout_s=1.0, state_path=str(tmp_path / "m.db"),
                                job="unit"), clock=lambda: clock[0])

    def said(words: str) -> int:
        return sum(words in r.getMessage() for r in caplog.records  # under the monitor's own
                   if r.levelno == logging.WARNING and r.name == "monitor.service")  # logger

    try:
        with caplog.at_level(logging.WARNING, logger="monitor.service"):
            for _ in range(5):  # a sweep a second
                mon.sweep_once()
                clock[0] += 1.0
            assert said("cannot verify ranks") == 1
            assert mon.cluster_json()["verification"]["lighthouse_ok"] is False
            clock[0] += WARN_EVERY_S
            mon.sweep_once()
            mon.sweep_once()
            assert said("cannot verify ranks") == 2  # still down a minute later: said again
            assert said("answers again") == 0
            mon.lighthouse_reader.read = lambda: (LighthouseStatus(1, {}, {}, at=clock[0]), None)
            for _ in range(3):
                mon.sweep_once()
            assert said("answers again") == 1
            assert said("cannot verify ranks") == 2
            assert mon.cluster_json()["verification"]["lighthouse_ok"] is True
    finally:
        mon.stop()


def test_a_broken_targets_file_and_an_unwritable_sd_out_are_said_once(tmp_path, caplog):
    clock = [1000.0]
    targets = tmp_path / "targets.json"
    targets.write_text("{broken")
    (tmp_path / "afile").write_text("")
    mon = Monitor(MonitorConfig(port=0, targets_file=str(targets), state_path=str(tmp_path / "m.db"),
                                sd_out=str(tmp_path / "afile" / "sd.json"), job="unit"),
                  clock=lambda: clock[0])

    def said(words: str) -> int:
        return sum(words in r.getMessage() for r in caplog.records
                   if r.levelno == logging.WARNING)

    try:
        with caplog.at_level(logging.WARNING, logger="monitor.service"):
            for _ in range(4):
                mon.sweep_once()
                clock[0] += 1.0
            assert said("last good targets kept (none before a good read): targets file") == 1
            assert said("cannot write") == 1
            targets.write_text(json.dumps([{"targets": ["127.0.0.1:1"]}]))
            for _ in range(2):
                mon.sweep_once()
            assert said("the targets file is read again") == 1
            assert said("last good targets kept") == 1
    finally:
        mon.stop()


def test_a_sweep_failing_on_is_said_once_a_minute_with_its_traceback(tmp_path, caplog):
    """Before: said once however long it lasted (a rotated log kept no trace of it)."""
    clock = [1000.0]
    mon = Monitor(MonitorConfig(port=0, interval_s=0.05, state_path=str(tmp_path / "m.db"),
                                job="unit"), clock=lambda: clock[0])
    calls = []

    def sweep():  # 10 s of the monitor's clock each: fails through 80 s, then recovers
        calls.append(clock[0])
        clock[0] += 10.0
        if len(calls) <= 8:
            raise RuntimeError("a bug in a stage")

    mon.sweep_once = sweep
    try:
        with caplog.at_level(logging.WARNING, logger="monitor.service"):
            mon.start(serve=False)
            wait_until(lambda: len(calls) >= 12, 30, what="12 sweeps")
            failed = [r for r in caplog.records
                      if r.getMessage() == "sweep failed: RuntimeError: a bug in a stage"]
            assert len(failed) == 2, failed  # at its start and a minute later
            assert all(r.levelno == logging.ERROR and r.exc_info for r in failed)
            assert sum(r.getMessage() == "sweeps succeed again" for r in caplog.records) == 1
    finally:
        mon.stop()


def test_another_kind_of_sweep_failure_is_said_at_once(tmp_path, caplog):
    """A full disk fails sweep after sweep; a bug in one stage fails one sweep between: its line
    and traceback are said at once (before: hidden, the disk's minute not over); the disk's
    again, within its minute, is not."""
    clock = [1000.0]
    mon = Monitor(MonitorConfig(port=0, interval_s=0.05, state_path=str(tmp_path / "m.db"),
                                job="unit"), clock=lambda: clock[0])
    calls = []

    def sweep():  # 5 s of the monitor's clock each
        calls.append(clock[0])
        clock[0] += 5.0
        if len(calls) == 4:
            raise KeyError("a bug in a stage")
        if len(calls) <= 7:
            raise sqlite3.OperationalError("database or disk is full")

    mon.sweep_once = sweep
    try:
        with caplog.at_level(logging.WARNING, logger="monitor.service"):
            mon.start(serve=False)
            wait_until(lambda: len(calls) >= 9, 30, what="9 sweeps")
            said = [r for r in caplog.records if r.getMessage().startswith("sweep failed")]
            assert [r.getMessage() for r in said] == [
                "sweep failed: OperationalError: database or disk is full",
                "sweep failed: KeyError: 'a bug in a stage'"], said
            assert said[1].exc_info and not said[0].exc_info
    finally:
        mon.stop()


def test_two_kinds_of_sweep_failure_taking_turns_are_each_said_once_a_minute(tmp_path, caplog):
    """A full disk fails one sweep in the audit log, the next in a file write, for 100 s: each
    kind is said once a minute (before: every sweep, each with its traceback)."""
    clock = [1000.0]
    mon = Monitor(MonitorConfig(port=0, interval_s=0.05, state_path=str(tmp_path / "m.db"),
                                job="unit"), clock=lambda: clock[0])
    calls = []

    def sweep():  # 5 s of the monitor's clock each
        calls.append(clock[0])
        clock[0] += 5.0
        if len(calls) <= 20:
            raise (sqlite3.OperationalError if len(calls) % 2 else OSError)("disk full")

    mon.sweep_once = sweep
    try:
        with caplog.at_level(logging.WARNING, logger="monitor.service"):
            mon.start(serve=False)
            wait_until(lambda: len(calls) >= 22, 30, what="22 sweeps")
            said = [r.getMessage() for r in caplog.records if r.name == "monitor.service"
                    and r.getMessage().startswith("sweep")]
            assert said == ["sweep failed: OperationalError: disk full",
                            "sweep failed: OSError: disk full"] * 2 + ["sweeps succeed again"]
    finally:
        mon.stop()


def test_a_failing_host_ledger_is_said_once_a_minute_and_when_it_works_again(tmp_path, caplog,
                                                                             monkeypatch):
    """The audit log full under the host ledger: an error line (no traceback: no bug) when it
    starts and a minute later, the error in ``GET /v1/hosts``, one line when it works again.
    Before: said once however long it lasted, its end never."""
    import sqlite3

    clock = [1000.0]
    mon = Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "m.db"), job="unit"),
                  clock=lambda: clock[0])
    record, full = mon.enforcer.hosts.record, [True]

    def record_or_full(*args, **kwargs):
        if full[0]:
            raise sqlite3.OperationalError("database or disk is full")
        return record(*args, **kwargs)

    monkeypatch.setattr(mon.enforcer.hosts, "record", record_or_full)

    def failed() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.getMessage() == "host ledger failed (its offences "
                "kept, tried again next sweep): OperationalError: database or disk is full"]

    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(5):  # a sweep a second
                mon.sweep_once()
                clock[0] += 1.0
            assert len(failed()) == 1
            assert mon.enforcer.hosts_json()["error"] == \
                "OperationalError: database or disk is full"
            clock[0] += WARN_EVERY_S
            mon.sweep_once()
            assert len(failed()) == 2  # still failing a minute later: said again
            assert all(r.levelno == logging.ERROR and not r.exc_info for r in failed())
            full[0] = False
            for _ in range(2):
                mon.sweep_once()
            assert sum(r.getMessage() == "the host ledger works again"
                       for r in caplog.records) == 1
            assert len(failed()) == 2 and mon.enforcer.hosts_json()["error"] is None
    finally:
        mon.stop()


def test_a_lighthouse_host_urllib3_cannot_parse_is_unreachable_not_a_crash():
    from monitor.evidence.lighthouse_status import LighthouseReader

    # a DNS label over 63 characters passes the URL check; urllib3 raises ValueError on it
    url = "http://" + "a" * 64 + ".example:29510"
    status, why = LighthouseReader(url, timeout_s=1).read()
    assert status is None and why.startswith(f"{url}/status unreachable: "), why
