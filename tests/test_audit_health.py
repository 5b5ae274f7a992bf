"""The monitor's own health and log (docs/monitor.md, ``/healthz``; docs/dashboards.md,
LightkeeperMonitorNotSweeping). In-process monitors on ephemeral ports, no ranks unless said."""

from __future__ import annotations

import re

import requests

from lightkeeper.processes import wait_until
from monitor.config import MonitorConfig
from monitor.service import Monitor


def _sweeps(url: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=5).text
    m = re.search(r"^lightkeeper_monitor_sweeps_total\{[^}]*\} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_failing_sweeps_are_said_by_healthz_and_stop_the_sweep_counter(tmp_path):
    """A monitor whose sweeps fail (a bug here; a full --state filesystem alike) kept
    answering {"status": "ok"}, its metrics frozen, nothing saying it was blind. Now /healthz
    says "failing" with the error (still 200: a restart mends no full disk), the sweep counter
    the alert watches stops, and both recover with the sweeps. An idle monitor (no ranks)
    counts its sweeps, so the alert cannot fire on it."""
    mon = Monitor(MonitorConfig(port=0, interval_s=0.05,
                                state_path=str(tmp_path / "state.sqlite"))).start()
    try:
        wait_until(lambda: _sweeps(mon.url) >= 3, 10, what="an idle monitor's sweeps counted")
        collect = mon.polling.collect

        def broken(*a, **k):
            raise RuntimeError("a bug in a stage")

        mon.polling.collect = broken
        wait_until(lambda: requests.get(f"{mon.url}/healthz", timeout=5).json()["status"]
                   == "failing", 10, what="healthz says failing")
        r = requests.get(f"{mon.url}/healthz", timeout=5)
        assert r.status_code == 200
        assert r.json()["last_error"] == "RuntimeError: a bug in a stage"
        frozen = _sweeps(mon.url)
        wait_until(lambda: requests.get(f"{mon.url}/healthz", timeout=5).json()["since_s"]
                   >= 0.3, 10, what="failing for a few intervals")
        assert _sweeps(mon.url) == frozen
        mon.polling.collect = collect
        wait_until(lambda: requests.get(f"{mon.url}/healthz", timeout=5).json()["status"]
                   == "ok", 10, what="healthz ok again")
        assert _sweeps(mon.url) > frozen
    finally:
        mon.stop()


def test_goodput_saves_that_succeed_again_are_said(tmp_path, caplog):
    """The writer warned when a save failed and never when saves worked again: an operator
    reading the log could not tell whether the ledger was still unsaved."""
    from monitor.goodput import GoodputWriter
    from tests.test_goodput_writer import GatedStore, failed_first, interval, state

    store = GatedStore(str(tmp_path / "m.sqlite"))
    writer = GoodputWriter(store)
    try:
        store.fail_next = 1
        writer.submit(state(1), [], [interval(1)], at=1.0)
        failed_first(writer)
        writer.submit(state(2), [], [interval(2)], at=2.0)
        assert writer.flush(10)
        said = [r.getMessage() for r in caplog.records if "goodput ledger" in r.getMessage()]
        assert said[0].startswith("goodput ledger save failed") and "disk is full" in said[0]
        assert said[1:] == ["goodput ledger saved again"]
    finally:
        writer.close(10)
        store.close()


def test_sd_out_lock_is_taken_again_when_its_folder_is_deleted(tmp_path):
    """--sd-out's folder deleted under the monitor (a cleanup job): the file was written back
    but its lock not, so a second monitor could take the same file and each replace the
    other's targets. Now the lock is taken again with the file, as the state's is."""
    import os
    import shutil
    import subprocess
    import sys

    from monitor.poll.discovery import Discovery

    folder = tmp_path / "sd"
    path = str(folder / "lightkeeper.json")
    d = Discovery(["http://127.0.0.1:9"], job="train")
    d.restore(path)
    assert d.write_file_sd(path)
    shutil.rmtree(folder)
    assert d.write_file_sd(path)
    lock = folder / "lightkeeper.json.lock"
    # another process (a second monitor) is refused the lock: a POSIX lock, so not this one
    # (which lets go of it on closing any descriptor of the file: its PID is read last)
    probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\n"
             "try: fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
             "except OSError: sys.exit(3)")
    assert subprocess.run([sys.executable, "-c", probe, str(lock)], timeout=30).returncode == 3
    assert lock.read_text() == str(os.getpid())


def test_a_refused_registration_is_said_once_per_address_and_reason(tmp_path, caplog):
    """Every refused registration was logged at INFO, and a refused rank asks again every
    5 s: a flood at scale. Now once per address and reason, again only every 10 minutes."""
    import logging

    import pytest

    from monitor.poll.discovery import BadTarget

    now = [1000.0]
    mon = Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "state.sqlite")),
                  clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="monitor.poll.admission")

    def refused(url: str) -> list[str]:
        with pytest.raises(BadTarget):
            mon.register_target({"url": url}, None)
        return [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]

    try:
        for _ in range(5):
            said = refused("no-port")
            now[0] += 5
        assert len(said) == 1 and "no-port" in said[0] and "bad_request" in said[0]
        assert len(refused("http://h:bad")) == 2  # another address: said
        now[0] += 600
        assert len(refused("no-port")) == 3  # still refused 10 minutes on: said again
        from prometheus_client import generate_latest  # (what /metrics serves)
        text = generate_latest(mon.metrics.registry).decode()
        assert re.search(r'registrations_total\{.*outcome="bad_request"\} 7\.0', text), text
    finally:
        mon.stop()


def test_the_start_line_says_what_the_monitor_binds_and_how_to_reach_it():
    """With --bind 0.0.0.0 the start line said only monitor=http://127.0.0.1:PORT, as if
    served on loopback. Now it says the bind address and, for every address, the URL by this
    host's name (no socket bound here: tests stay on 127.0.0.0/8)."""
    import socket

    from monitor.cli import start_line

    line = start_line("http://127.0.0.1:19400", MonitorConfig(bind="0.0.0.0"))
    assert "monitor=http://127.0.0.1:19400 bind=0.0.0.0:19400 " in line
    assert f" remote=http://{socket.gethostname()}:19400 " in line
    line = start_line("http://[::1]:19400", MonitorConfig(bind="::"))
    assert "monitor=http://[::1]:19400 bind=[::]:19400 remote=" in line
    line = start_line("http://127.0.0.2:19400", MonitorConfig(bind="127.0.0.2"))
    assert "monitor=http://127.0.0.2:19400 bind=127.0.0.2:19400 state=" in line


def test_a_host_offence_the_audit_log_refused_is_kept_and_said_in_one_line(tmp_path, caplog):
    """A host offence whose write failed (a full disk: played by the store's write raising
    SQLite's own error, as SQLite cannot be filled on demand here) was lost, and the host ledger
    logged a traceback every sweep. Now it is said in one line and written at the next sweep."""
    import sqlite3

    from monitor.detect.findings import Finding

    mon = Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "state.sqlite")))
    try:
        view = mon.sweep_once()  # no ranks: an empty view
        add = mon.store.add_host_offence

        def full(*a, **k):
            raise sqlite3.OperationalError("database or disk is full")

        mon.store.add_host_offence = full
        culprits = {"culprits": [{"rank": 2, "host": "h1", "node": "n1",
                                  "device": {"type": "cpu"}}]}
        for g in (1, 2, 3):  # the next sweeps fail alike: said once
            mon.enforcer.judge_hosts(view, [Finding("hang", g, f"g{g}:a", [2], culprits,
                                                    10.0, 10.0)], mon.clock())
        said = [r for r in caplog.records if "host ledger" in r.getMessage()]
        assert len(said) == 1 and not said[0].exc_info, said  # no traceback
        assert "disk is full" in said[0].getMessage()
        assert "disk is full" in mon.enforcer.hosts_json()["error"]
        mon.store.add_host_offence = add
        mon.enforcer.judge_hosts(view, [], mon.clock())
        assert mon.enforcer.hosts_json()["error"] is None
        kept = mon.store.host_offences("h1")
        assert sorted(o["data"]["replica_group"] for o in kept) == [1, 2, 3]
    finally:
        mon.stop()
