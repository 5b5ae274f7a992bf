"""The host ledger failing in a sweep's first half (its observe, the quarantined_host findings;
monitor/act/host_side.py, ``host_findings``) is said as a trouble that lasts, as a failure in its
second half (``judge_hosts``) is: once, the error in ``GET /v1/hosts`` while it lasts, once
when it works again. In-process monitor, no ranks, the monitor's clock the test's."""

from __future__ import annotations

import logging
import sqlite3

from monitor.config import MonitorConfig
from monitor.service import Monitor


def test_a_host_ledger_whose_observe_fails_every_sweep_is_said_once_until_it_works(
        tmp_path, caplog, monkeypatch):
    """The audit log full under the ledger's observe, sweep after sweep; the rest of the ledger
    works. Before: set in host_findings and cleared by judge_hosts in the same sweep, so each
    sweep logged the error with a traceback and "works again", and /v1/hosts' error read None."""
    clock = [1000.0]
    mon = Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "m.db"), job="unit"),
                  clock=lambda: clock[0])
    observe, full = mon.enforcer.hosts.observe, [True]

    def observe_or_full(*args, **kwargs):
        if full[0]:
            raise sqlite3.OperationalError("database or disk is full")
        return observe(*args, **kwargs)

    monkeypatch.setattr(mon.enforcer.hosts, "observe", observe_or_full)

    def said(message: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.getMessage() == message]

    failed = "host ledger failed (its offences kept, tried again next sweep): " \
             "OperationalError: database or disk is full"
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(4):  # a sweep a second
                mon.sweep_once()
                clock[0] += 1.0
                assert mon.enforcer.hosts_json()["error"] == \
                    "OperationalError: database or disk is full"
            assert [(r.levelno, r.exc_info) for r in said(failed)] == [(logging.ERROR, None)]
            assert said("the host ledger works again") == []
            full[0] = False
            for _ in range(2):
                mon.sweep_once()
            assert len(said("the host ledger works again")) == 1
            assert len(said(failed)) == 1 and mon.enforcer.hosts_json()["error"] is None
    finally:
        mon.stop()


def test_a_bug_in_the_host_ledger_during_a_full_disk_is_said_at_once(tmp_path, caplog,
                                                                     monkeypatch):
    """The audit log full, sweep after sweep; one sweep a bug (TypeError) instead: its line and
    traceback are said at once (before: hidden, the full disk's minute not over)."""
    clock = [1000.0]
    mon = Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "m.db"), job="unit"),
                  clock=lambda: clock[0])
    sweeps = [0]

    def observe(*args, **kwargs):
        sweeps[0] += 1
        if sweeps[0] == 3:
            raise TypeError("a bug in the ledger")
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(mon.enforcer.hosts, "observe", observe)
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(5):
                mon.sweep_once()
                clock[0] += 1.0
            bug = [r for r in caplog.records if "TypeError: a bug in the ledger" in r.getMessage()]
            assert len(bug) == 1 and bug[0].exc_info, caplog.text
    finally:
        mon.stop()
