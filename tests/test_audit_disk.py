"""Disk and filesystem trouble under a running monitor (docs/monitor.md, ``--state``): the
audit log's folder deleted, its file replaced, a finding it could not take. In-process, with the
real SQLite ``Store`` (and a live monitor over simulated groups in a real torchft Lighthouse:
``SimJob``, tests/support/monitor_sim.py)."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time

import pytest
import requests

from lightkeeper.processes import wait_until
from monitor.config import BundleConfig, DetectorConfig, MonitorConfig, RailsConfig
from monitor.locks import StateInUse, hold_state
from monitor.service import Monitor
from monitor.store import Store
from tests.support.monitor_sim import SimJob


def evict(store: Store, replica_id: str) -> int:
    return store.add_decision(replica_group=1, replica_id=replica_id, decision="evict",
                              reason="hang", status="sent")


def test_a_state_folder_deleted_while_in_use_is_written_back_with_its_lock(tmp_path):
    """The state's folder removed under a running monitor (a cleanup job, a volume emptied):
    the next write puts the whole audit log back at its path, with its lock, so a restart
    still knows every kill and a second monitor is still refused. Before, the monitor wrote
    on into the deleted file: a restart forgot every eviction (and evicted again) and a
    second monitor could take the same state."""
    folder = tmp_path / "state"
    path = str(folder / "monitor.sqlite")
    lock = hold_state(path)
    store = Store(path)
    try:
        evict(store, "replica_group_1:a")
        shutil.rmtree(folder)
        evict(store, "replica_group_2:b")
        assert store.evicted_replica_ids() == {"replica_group_1:a", "replica_group_2:b"}
        with pytest.raises(StateInUse):
            hold_state(path)
        assert (folder / "monitor.sqlite.lock").read_text() == str(os.getpid())
    finally:
        store.close()
        os.close(lock)
    again = Store(path)
    try:
        assert again.evicted_replica_ids() == {"replica_group_1:a", "replica_group_2:b"}
    finally:
        again.close()


def test_a_state_that_cannot_be_written_back_says_why_and_is_tried_again(tmp_path):
    """Deleted, and its copy cannot be made (here a folder is where the copy goes): the
    write fails with SQLite's reason, the open database is kept, and the next write that can
    puts it back. Before, the error was SQLite's "unable to open database file" alone, not
    saying the state was deleted (or an OSError cleaning up the copy took its place)."""
    path = tmp_path / "monitor.sqlite"
    store = Store(str(path))
    try:
        evict(store, "replica_group_1:a")
        path.unlink()
        (tmp_path / "monitor.sqlite.restoring").mkdir()
        with pytest.raises(sqlite3.OperationalError, match="deleted and cannot be written again"):
            evict(store, "replica_group_2:b")
        (tmp_path / "monitor.sqlite.restoring").rmdir()
        evict(store, "replica_group_2:b")
    finally:
        store.close()
    again = Store(str(path))
    try:
        assert again.evicted_replica_ids() == {"replica_group_1:a", "replica_group_2:b"}
    finally:
        again.close()


def test_a_state_file_replaced_under_the_monitor_is_not_written_over(tmp_path):
    """Another file put in the state's place (a backup restored by hand) is not overwritten
    by the running monitor: its writes fail and say why, and that file stays as it was."""
    path = str(tmp_path / "monitor.sqlite")
    store = Store(path)
    try:
        evict(store, "replica_group_1:a")
        os.rename(path, str(tmp_path / "moved.sqlite"))
        other = sqlite3.connect(path)
        other.execute("CREATE TABLE mine (x)")
        other.commit()
        other.close()
        with pytest.raises(sqlite3.OperationalError, match="replaced by another file"):
            evict(store, "replica_group_2:b")
        tables = sqlite3.connect(path).execute("SELECT name FROM sqlite_master").fetchall()
        assert tables == [("mine",)]
    finally:
        store.close()


@pytest.fixture
def job():
    j = SimJob(3, ranks_per_group=2)
    yield j
    j.stop()


def _dry_run_config(tmp_path, job) -> MonitorConfig:
    """A monitor of ``job`` that acts on nothing and finds a rank dead after 2 sweeps."""
    return MonitorConfig(port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"),
                         targets=job.sim.urls, sd_out=str(tmp_path / "targets.json"), job="sim",
                         lighthouse=job.url, rails=RailsConfig(min_replicas=1, dry_run=True),
                         detectors=DetectorConfig(dead_sweeps=2),
                         bundles=BundleConfig(enabled=False))


def test_a_finding_the_audit_log_could_not_take_is_recorded_once_it_can(tmp_path, job):
    """A confirmed finding whose write fails (a full disk; here its table is moved away by
    another connection, which fails the findings' writes alone) is written at the next sweep
    that can: listed in /v1/findings, counted, and its decision names it. Before, the detectors
    held it as confirmed, so it was never new again: it never reached the audit log and its
    decisions named no finding; and a resolution refused so left it open for good."""
    cfg, clock = _dry_run_config(tmp_path, job), [time.time()]
    mon = Monitor(cfg, clock=lambda: clock[0]).start()  # sweeps once, then waits an hour
    other = sqlite3.connect(cfg.state_path, isolation_level=None)
    try:
        wait_until(lambda: mon.sweeps >= 1, 20, what="the loop's first sweep")
        job.sim.group(1)[-1].set_mode("down")  # dead_rank once 2 sweeps miss it
        other.execute("ALTER TABLE findings RENAME TO findings_away")
        failed = 0
        for _ in range(4):
            clock[0] += 1
            try:
                mon.sweep_once()
            except sqlite3.OperationalError as e:
                assert "findings" in str(e), e
                failed += 1
        assert failed >= 1
        other.execute("ALTER TABLE findings_away RENAME TO findings")
        clock[0] += 1
        mon.sweep_once()
        [finding] = requests.get(mon.url + "/v1/findings", timeout=10).json()
        assert (finding["kind"], finding["replica_group"]) == ("dead_rank", 1), finding
        holds = requests.get(mon.url + "/v1/evictions", timeout=10).json()
        assert holds and {d["finding_id"] for d in holds} == {finding["id"]}, holds
        metrics = requests.get(mon.url + "/metrics", timeout=10).text
        assert 'findings_total{job="sim",kind="dead_rank",replica_group="1"} 1.0' in metrics
        # its resolution, refused the same way, is written too: it does not stay open
        job.sim.group(1)[-1].set_mode("ok")
        other.execute("ALTER TABLE findings RENAME TO findings_away")
        with pytest.raises(sqlite3.OperationalError):
            clock[0] += 1
            mon.sweep_once()
        other.execute("ALTER TABLE findings_away RENAME TO findings")
        clock[0] += 1
        mon.sweep_once()
        [finding] = requests.get(mon.url + "/v1/findings", timeout=10).json()
        assert finding["resolution"] == "reachable", finding
    finally:
        other.close()
        mon.stop()


def test_a_state_path_that_is_a_folder_is_named_as_one(tmp_path):
    """``--state`` naming a folder: SQLite said only "unable to open database file"."""
    with pytest.raises(IsADirectoryError, match="a folder, not a file"):
        hold_state(str(tmp_path))


def test_a_monitor_started_on_a_full_disk_says_so_in_one_line(tmp_path):
    """A restart on a full volume (the audit log and lock a clean stop left there): SQLite
    cannot even read a WAL database without room for its write-ahead and shared-memory files,
    and said "disk I/O error". The monitor exits 1 with one line that says the filesystem is full. A real full
    disk: a 512 KiB tmpfs in a private mount namespace (gone with the process); skipped where
    this process may not make one."""
    disk = tmp_path / "disk"
    disk.mkdir()
    script = (f"mount -t tmpfs -o size=512k tmpfs {disk} || exit 99; "
              f"{sys.executable} -c 'import sys; from monitor.locks import hold_state; from monitor.store import Store; "
              f"hold_state(sys.argv[1]); Store(sys.argv[1]).close()' {disk}/state.sqlite && "
              f"dd if=/dev/zero of={disk}/fill bs=1k 2>/dev/null; "
              f"exec {sys.executable} -m lightkeeper.cli monitor --port 0 "
              f"--state {disk}/state.sqlite")
    try:
        out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                             capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if out.returncode == 99 or "unshare:" in out.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    assert out.returncode == 1, out
    [line] = out.stderr.splitlines()
    assert line.startswith(f"lightkeeper monitor: --state {disk}/state.sqlite: ") and \
        line.endswith("its filesystem is full"), line


RESTORE_ON_A_FULL_DISK = """
import json, os, shutil, sys
from monitor.locks import StateInUse, hold_state
from monitor.store import Store
disk = sys.argv[1]
path = os.path.join(disk, "state", "monitor.sqlite")
lock = hold_state(path)
store = Store(path)
store.add_decision(replica_group=1, replica_id="r1", decision="evict", reason="hang",
                   status="sent")
with open(os.path.join(disk, "fill"), "wb", buffering=0) as f:
    try:
        while True:
            f.write(bytes(4096))
    except OSError:
        pass
shutil.rmtree(os.path.join(disk, "state"))  # its space stays taken: the files are open
out = {}
try:
    store.add_decision(replica_group=2, replica_id="r2", decision="evict", reason="hang",
                       status="sent")
except Exception as e:
    out["full"] = str(e)
try:
    hold_state(path)
except StateInUse as e:
    out["second_while_full"] = str(e)
os.unlink(os.path.join(disk, "fill"))
store.add_decision(replica_group=2, replica_id="r2", decision="evict", reason="hang",
                   status="sent")
try:
    hold_state(path)
except StateInUse as e:
    out["second"] = str(e)
store.close()
out["kept"] = sorted(Store(path).evicted_replica_ids())
print(json.dumps(out))
"""


def test_a_state_deleted_on_a_full_disk_is_written_back_once_there_is_room(tmp_path):
    """The state's folder deleted while its volume is full: the write fails and says why, its
    lock is held again all the same (before, left unheld: a second monitor could take the
    state), and once there is room the audit log is back. A real full disk: a tmpfs in a
    private mount namespace."""
    disk = tmp_path / "disk"
    disk.mkdir()
    script = (f"mount -t tmpfs -o size=512k tmpfs {disk} || exit 99; "
              f"exec {sys.executable} -c '{RESTORE_ON_A_FULL_DISK}' {disk}")
    try:
        out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                             capture_output=True, text=True, timeout=30, cwd=os.getcwd())
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if out.returncode == 99 or "unshare:" in out.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert "was deleted and cannot be written again" in got["full"], got
    assert "in use by another monitor" in got["second_while_full"], got
    assert "in use by another monitor" in got["second"] and got["kept"] == ["r1", "r2"], got


def test_a_kill_goes_out_when_its_bundle_cannot_be_named_in_its_decision(tmp_path, job):
    """The bundle written and indexed, then the audit log refuses the decision's ``bundle``
    column (the bundle took the volume's last room; here a trigger of another connection
    fails that one write as SQLite does on a full disk): the kill is still sent and judged,
    and the bundle still names its decision. Before, the kill was never sent and its decision
    stayed ``sending``, so every later one held as ``already_evicted``: the group was never
    evicted."""
    cfg = MonitorConfig(port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"),
                        targets=job.sim.urls, sd_out=str(tmp_path / "targets.json"), job="sim",
                        lighthouse=job.url, rails=RailsConfig(min_replicas=1, cooldown_s=0),
                        detectors=DetectorConfig(dead_sweeps=2))
    clock = [time.time()]
    mon = Monitor(cfg, clock=lambda: clock[0]).start()
    other = sqlite3.connect(cfg.state_path, isolation_level=None)
    try:
        wait_until(lambda: mon.sweeps >= 1, 20, what="the loop's first sweep")
        other.execute("CREATE TRIGGER full BEFORE UPDATE OF bundle ON decisions "
                      "BEGIN SELECT RAISE(FAIL, 'database or disk is full'); END")
        job.sim.group(1)[-1].set_mode("down")
        for _ in range(4):
            clock[0] += 1
            mon.sweep_once()
        assert job.kills == [job.replica_ids[1]]

        def confirmed() -> dict | None:  # once the Lighthouse no longer hears the replica
            clock[0] += 1
            mon.sweep_once()
            [row] = requests.get(mon.url + "/v1/evictions", timeout=10).json()
            return row if row["status"] == "confirmed" else None

        row = wait_until(confirmed, 10, what="the kill confirmed")
        assert row["decision"] == "evict", row
        [bundle] = requests.get(mon.url + "/v1/incidents", timeout=10).json()["bundles"]
        assert bundle["decision_id"] == row["id"], bundle
    finally:
        other.close()
        mon.stop()


def test_findings_written_before_a_failed_write_still_count_against_their_hosts(tmp_path, job):
    """Two groups lose a rank in one sweep; the audit log takes the first finding and refuses the
    second (a full disk, once). Both hosts get their offence: the second once it is written, the
    first although the sweep that wrote it failed. Before, the first was in the audit log but
    never handed on to the host ledger."""
    for r in job.sim.ranks:
        r.update(host=f"host-{r.state['replica_group']}")
    cfg, clock = _dry_run_config(tmp_path, job), [time.time()]
    mon = Monitor(cfg, clock=lambda: clock[0]).start()  # sweeps once, then waits an hour
    add, calls = mon.store.add_finding, []

    def second_refused(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise sqlite3.OperationalError("database or disk is full")
        return add(*a, **kw)

    mon.store.add_finding = second_refused
    try:
        wait_until(lambda: mon.sweeps >= 1, 20, what="the loop's first sweep")
        for g in (1, 2):
            job.sim.group(g)[-1].set_mode("down")
        failed = 0
        for _ in range(8):
            clock[0] += 1
            try:
                mon.sweep_once()
            except sqlite3.OperationalError:
                failed += 1
            hosts = requests.get(mon.url + "/v1/hosts", timeout=10).json()["hosts"]
            if len(hosts) == 2:
                break
        assert failed == 1 and len(calls) >= 3, (failed, calls)
        assert sorted(h["host"] for h in hosts) == ["host-1", "host-2"], hosts
    finally:
        mon.stop()
