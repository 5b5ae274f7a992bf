"""A monitor restarted on the ``--state`` a killed or older monitor left (docs/monitor.md,
Eviction and safety rails; docs/goodput.md, Storage).

A live monitor (real HTTP, real SQLite) over a real torchft Lighthouse that simulated groups
join (``SimJob``, tests/support/monitor_sim.py: no trainer, the test moves the ranks' steps).
What a SIGKILLed monitor leaves is written with ``Store`` as the monitor itself writes it: the
moment (between a decision's ``sending`` row and its outcome) cannot be hit reliably by a signal.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time

import pytest
import requests

from lightkeeper.processes import stop_process, wait_until
from monitor.config import (
    BundleConfig,
    DetectorConfig,
    MonitorConfig,
    QuarantineConfig,
    RailsConfig,
)
from monitor.service import Monitor
from monitor.store import Store
from tests.support.lines import first_line
from tests.support.monitor_sim import SimJob

TOKEN = "s3cret"


@pytest.fixture
def job(request):
    j = SimJob(3, ranks_per_group=getattr(request, "param", 1))
    yield j
    j.stop()


def start(tmp_path, job, clock: list[float]) -> Monitor:
    cfg = MonitorConfig(port=0, interval_s=3600, state_path=str(tmp_path / "state.sqlite"),
                        targets=job.sim.urls, sd_out=str(tmp_path / "targets.json"), job="sim",
                        lighthouse=job.url, token=TOKEN, expected_groups=3,
                        rails=RailsConfig(min_replicas=1, cooldown_s=0))
    mon = Monitor(cfg, clock=lambda: clock[0]).start()  # sweeps once, then waits an hour
    try:
        wait_until(lambda: mon.sweeps >= 1, 20, what="the loop's first sweep")
    except BaseException:
        mon.stop()
        raise
    return mon


def evict(mon: Monitor, group: int) -> dict:
    r = requests.post(mon.url + "/v1/evict", json={"replica_group": group, "reason": "test"},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_kill_a_killed_monitor_left_sending_is_judged_by_the_replica(tmp_path, job):
    """The monitor died after its eviction's ``sending`` row (fetching the bundle, say) and
    before the kill's outcome. The restart judges it by the replica: still answering, the kill
    never landed (``failed``: the replica may be evicted again); gone, it is ``confirmed``.
    Before, it stayed ``sending`` for ever and held every eviction as ``already_evicted``."""
    rid = job.replica_ids[1]
    store = Store(str(tmp_path / "state.sqlite"))
    for group, replica in ((1, rid), (2, "replica_group_2:killed-before")):
        store.add_decision(replica_group=group, replica_id=replica, decision="evict",
                           reason="hang", detail="hang confirmed", status="sending",
                           at=time.time() - 30)
    store.close()
    clock = [time.time()]
    mon = start(tmp_path, job, clock)
    try:
        rows = requests.get(mon.url + "/v1/evictions", timeout=10).json()
        status = {r["replica_id"]: r["status"] for r in rows}
        assert status == {rid: "failed", "replica_group_2:killed-before": "confirmed"}, rows
        out = evict(mon, 1)
        assert out["decision"] == "evict" and out["sent"], out
        assert job.kills == [rid]
    finally:
        mon.stop()


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_dry_run_restart_tells_no_orphan_of_an_earlier_kill_to_exit(tmp_path, job, dry_run):
    """A kill sent by the run before, its replica still answering: a restart that acts tells
    its ranks to exit (POST /v1/exit; these simulated ranks answer 404); a ``--dry-run`` one,
    started to stop acting, leaves them be. Before, the dry run told them too."""
    rid = job.replica_ids[1]
    store = Store(str(tmp_path / "state.sqlite"))
    store.add_decision(replica_group=1, replica_id=rid, decision="evict", reason="hang",
                       detail="hang confirmed; kill: sent", status="sent", at=time.time() - 10)
    store.close()
    cfg = MonitorConfig(port=0, interval_s=0.2, state_path=str(tmp_path / "state.sqlite"),
                        targets=job.sim.urls, job="sim", lighthouse=job.url, token=TOKEN,
                        expected_groups=3, rank_exit_token="exit-token", orphan_grace_s=0,
                        rails=RailsConfig(min_replicas=1, cooldown_s=0, dry_run=dry_run))
    mon = Monitor(cfg).start()
    try:
        wait_until(lambda: mon.sweeps >= 3, 20, what="three sweeps")
        (row,) = requests.get(mon.url + "/v1/evictions", timeout=10).json()
        assert row["status"] == "sent", row  # its replica still answers: not confirmed
        assert ("told rank(s) the Lighthouse's kill does not reach to exit" in row["detail"]) \
            is not dry_run, row["detail"]
    finally:
        mon.stop()


@pytest.mark.parametrize("saved", ['{"version": 3}', "not json", "[1, 2]"])
def test_an_unreadable_goodput_state_starts_a_fresh_ledger(tmp_path, job, saved):
    """A goodput snapshot that cannot be resumed (malformed, not JSON) is warned about and a
    fresh ledger starts, numbering its incidents after the old rows; before, the monitor did not
    start (a traceback)."""
    path = str(tmp_path / "state.sqlite")
    old = {"id": 4, "kind": "straggler", "replica_group": 0, "replica_id": "replica_group_0:old",
           "ranks": [0], "closed_at": None}
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute("INSERT INTO goodput_state (id, at, data) VALUES (1, 0, ?)", (saved,))
    db.execute("INSERT INTO goodput_incidents (id, updated_at, closed, data) VALUES (4, 0, 0, ?)",
               (json.dumps(old),))
    db.commit()
    db.close()
    clock = [time.time()]
    mon = start(tmp_path, job, clock)
    try:
        job.train_and_sweep(mon, clock, 3)
        assert evict(mon, 2)["sent"]
        job.train_and_sweep(mon, clock, 2)
        g = requests.get(mon.url + "/v1/goodput", timeout=10).json()
        [inc] = g["incidents"]
        assert inc["kind"] == "manual" and inc["replica_group"] == 2 and inc["id"] > 4, inc
    finally:
        mon.stop()
    db = sqlite3.connect(path)
    [(data,)] = db.execute("SELECT data FROM goodput_incidents WHERE id = 4").fetchall()
    db.close()
    assert json.loads(data) == old


def test_a_dry_run_restart_carries_out_no_pending_quarantine_action(tmp_path, job):
    """A drain the previous run queued (or was running when it was killed: still ``pending``)
    waits while the monitor is restarted with ``--dry-run``, and runs once it acts again;
    before, the dry run carried it out."""
    events = tmp_path / "events.jsonl"
    hook = tmp_path / "hook.sh"
    hook.write_text(f"#!/bin/sh\ncat >> {events}\necho >> {events}\n")
    hook.chmod(0o755)
    sink = f"exec:{hook}"
    store = Store(str(tmp_path / "state.sqlite"))
    store.add_host_action(host="h1", sink=sink, op="quarantine", status="pending",
                          event={"event": "quarantine", "host": "h1", "node": "h1"},
                          at=time.time() - 60, next_at=time.time() - 60)
    store.close()

    def run(dry_run: bool) -> None:
        cfg = MonitorConfig(port=0, interval_s=0.2, state_path=str(tmp_path / "state.sqlite"),
                            targets=job.sim.urls, sd_out=str(tmp_path / "targets.json"),
                            job="sim", lighthouse=job.url, token=TOKEN,
                            rails=RailsConfig(min_replicas=1, dry_run=dry_run),
                            quarantine=QuarantineConfig(actions=(sink,), dry_run=dry_run))
        mon = Monitor(cfg).start()
        try:
            wait_until(lambda: mon.sweeps >= 5, 20, what="five sweeps")
            if not dry_run:
                wait_until(events.exists, 20, what="the hook's event")
        finally:
            mon.stop()

    run(dry_run=True)
    assert not events.exists()
    run(dry_run=False)
    [ev] = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    assert (ev["event"], ev["host"]) == ("quarantine", "h1")
    db = sqlite3.connect(str(tmp_path / "state.sqlite"))
    assert db.execute("SELECT status, attempts FROM host_actions").fetchall() == [("done", 1)]
    db.close()


def test_a_restart_deletes_the_partial_bundle_a_killed_write_left(tmp_path):
    """A monitor killed while writing a bundle leaves its temporary file (never listed, never
    pruned, up to --bundle-max-bytes): the next start deletes it, but not a fresh one, which
    may be another monitor's write under way in a shared --bundle-dir."""
    incidents = tmp_path / "incidents"
    incidents.mkdir()
    stale = incidents / ".20261127T065240Z-evict-hang-g2.k2j3h4"
    fresh = incidents / ".20261127T065241Z-evict-hang-g1.a8b7c6"
    for f in (stale, fresh):
        f.write_bytes(b"\x1f\x8b" + b"0" * 4096)
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    proc = subprocess.Popen([sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0",
                             "--state", str(tmp_path / "state.sqlite")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert first_line(proc).startswith("[lightkeeper] monitor=")
        assert not stale.exists() and fresh.exists()
    finally:
        stop_process(proc)


def test_a_monitor_restarted_for_another_job_adopts_none_of_the_old_jobs_ranks(tmp_path):
    """``--sd-out`` holds the ranks that registered with the previous run: a run with another
    ``--job`` (which refuses those ranks' registrations) does not re-adopt them either; before,
    it polled them, judged them and could evict them."""
    rank = "http://127.0.0.1:1"  # never polled successfully: only the target list is read

    def monitor(job: str) -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen([sys.executable, "-m", "lightkeeper.cli", "monitor", "--port",
                                 "0", "--job", job, "--state", str(tmp_path / "state.sqlite")],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            line = first_line(proc)
        except BaseException:
            stop_process(proc)
            raise
        return proc, line.split("monitor=", 1)[1].split()[0]

    def targets(url: str) -> list[str]:
        return [t["url"] for t in requests.get(url + "/v1/targets", timeout=10).json()]

    proc, url = monitor("a")
    try:
        r = requests.post(url + "/v1/targets", json={"url": rank, "job": "a"}, timeout=10)
        assert r.status_code in (200, 201), r.text
        sd = tmp_path / "lightkeeper-targets.json"
        wait_until(lambda: sd.exists() and "127.0.0.1:1\"" in sd.read_text(), 20,
                   what="the file_sd")
    finally:
        stop_process(proc)
    for job, adopted in (("a", [rank]), ("b", [])):
        proc, url = monitor(job)
        try:
            assert targets(url) == adopted
        finally:
            stop_process(proc)


def test_a_second_monitor_on_the_state_through_a_symlink_is_refused(tmp_path):
    """Two monitors on one audit log close each other's findings: the second is refused with
    one line and exit status 1, also when it names the file through a symlink; before, the
    symlink's own ``.lock`` let it run."""
    state = tmp_path / "state.sqlite"
    link = tmp_path / "link.sqlite"
    link.symlink_to(state.name)
    first = subprocess.Popen([sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0",
                              "--state", str(state)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert first_line(first).startswith("[lightkeeper] monitor=")
        second = subprocess.run([sys.executable, "-m", "lightkeeper.cli", "monitor", "--port",
                                 "0", "--state", str(link)], capture_output=True, text=True,
                                timeout=30)
        assert second.returncode == 1, second
        [line] = second.stderr.splitlines()
        assert "in use by another monitor" in line and f"PID {first.pid}" in line, line
    finally:
        stop_process(first)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (a real full disk); skipped where this process may not mount one."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(disk) -> None:
    with open(disk / "fill", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


@pytest.mark.parametrize("job", [2], indirect=True)  # two ranks a group: one dies, dead_rank
def test_a_full_disk_holds_the_eviction_says_so_once_and_recovers(small_disk, tmp_path, caplog,
                                                                  job):
    """The audit log cannot take the eviction: no kill (a restart could not know it was sent),
    one traceback, no ``evict`` decision counted, and ``/v1/cluster``'s ``last_error`` is
    cleared once the disk has room and the eviction goes out. Before, every sweep logged a
    traceback and an ``evicting`` line, counted a decision, and ``last_error`` stayed."""
    cfg = MonitorConfig(port=0, interval_s=0.2, state_path=str(small_disk / "state.sqlite"),
                        targets=job.sim.urls, sd_out=str(tmp_path / "targets.json"), job="sim",
                        lighthouse=job.url, token=TOKEN,
                        rails=RailsConfig(min_replicas=1, cooldown_s=0),
                        detectors=DetectorConfig(dead_sweeps=2),
                        bundles=BundleConfig(enabled=False))
    mon = Monitor(cfg).start()
    try:
        wait_until(lambda: mon.sweeps >= 2, 10, what="two sweeps")
        fill(small_disk)
        bad = job.sim.group(1)[-1]
        bad.set_mode("down")  # one rank of live group 1 dies: dead_rank, to be evicted
        wait_until(lambda: "full" in (requests.get(mon.url + "/v1/cluster", timeout=10).json()[
            "last_error"] or ""), 20, what="a sweep failing on the full disk")
        loops = set()  # the loop's iterations (failed sweeps do not count in ``sweeps``)
        wait_until(lambda: len(loops) > 10 or loops.add(mon.loop_at), 30,
                   what="10 more sweeps on a full disk")
        cluster = requests.get(mon.url + "/v1/cluster", timeout=10).json()
        assert "full" in cluster["last_error"], cluster["last_error"]
        assert job.kills == []
        failed = [r for r in caplog.records if r.getMessage().startswith("sweep failed")]
        assert len(failed) == 1 and not failed[0].exc_info, failed  # one line, no traceback
        assert failed[0].getMessage() == "sweep failed: OperationalError: database or disk is full"
        assert not [r for r in caplog.records if r.getMessage().startswith("evicting")]
        metrics = requests.get(mon.url + "/metrics", timeout=10).text
        assert 'decision="evict"' not in metrics
        (small_disk / "fill").unlink()
        wait_until(lambda: job.kills, 20, what="the eviction once the disk has room")
        wait_until(lambda: requests.get(mon.url + "/v1/cluster", timeout=10).json()[
            "last_error"] is None, 10, what="last_error cleared")
    finally:
        mon.stop()


def test_a_kill_left_sending_waits_while_the_restarted_monitor_reaches_no_rank(tmp_path, job):
    """Restarted where it reaches none of the ranks, the monitor cannot tell a replica gone from
    one it does not hear: the eviction stays ``interrupted`` (no other is sent for that replica)
    and is judged once the ranks answer. Before, hearing nothing confirmed it, and the replica
    the kill never reached was never evicted."""
    rid = job.replica_ids[1]
    store = Store(str(tmp_path / "state.sqlite"))
    store.add_decision(replica_group=1, replica_id=rid, decision="evict", reason="hang",
                       detail="hang confirmed", status="sending", at=time.time() - 30)
    store.close()
    for r in job.sim.ranks:
        r.set_mode("down")
    clock = [time.time()]
    mon = start(tmp_path, job, clock)
    try:
        [row] = requests.get(mon.url + "/v1/evictions", timeout=10).json()
        assert row["status"] == "interrupted", row
        for r in job.sim.ranks:
            r.set_mode("ok")
        job.train_and_sweep(mon, clock, 2)
        [row] = requests.get(mon.url + "/v1/evictions", timeout=10).json()
        assert row["status"] == "failed", row
    finally:
        mon.stop()


def test_an_empty_state_path_is_refused_with_one_line(tmp_path):
    """``--state ""`` (an unset variable in a unit file, say) made SQLite keep the audit log in
    a private temporary file, deleted at exit: a restart forgot every eviction. Now it is
    refused, exit status 2 and one line."""
    out = subprocess.run([sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0",
                          "--state", ""], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert out.returncode == 2, out
    [line] = out.stderr.splitlines()
    assert line.startswith("lightkeeper monitor: --state"), line


def test_a_second_monitor_on_the_state_deletes_none_of_its_bundles(tmp_path):
    """A second monitor started on a state in use by mistake is refused before it touches
    anything: before, it first pruned the bundles by its own ``--bundle-keep``."""
    state = tmp_path / "state.sqlite"
    bundle = tmp_path / "incidents" / "20261127T060000Z-evict-hang-g2.tar.gz"
    bundle.parent.mkdir()
    bundle.write_bytes(b"\x1f\x8b")
    store = Store(str(state))
    store.add_bundle({"id": "20261127T060000Z-evict-hang-g2", "at": time.time() - 3600,
                      "trigger": "evict", "kind": "hang", "replica_group": 2,
                      "path": str(bundle), "bytes": 2})
    store.close()
    first = subprocess.Popen([sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0",
                              "--state", str(state)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        url = first_line(first).split("monitor=", 1)[1].split()[0]
        second = subprocess.run([sys.executable, "-m", "lightkeeper.cli", "monitor", "--port",
                                 "0", "--state", str(state), "--bundle-keep", "60"],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and "in use" in second.stderr, second
        listed = requests.get(url + "/v1/incidents", timeout=10).json()
        assert [b["id"] for b in listed["bundles"]] == ["20261127T060000Z-evict-hang-g2"]
        assert bundle.exists()
    finally:
        stop_process(first)


def test_an_interrupted_kill_is_no_goodput_eviction_until_judged(tmp_path, job):
    """While the restarted monitor cannot verify ranks (the Lighthouse unreachable), a kill a
    previous run left ``sending`` stays ``interrupted`` and the goodput ledger books no
    eviction for it; judged ``failed`` once the Lighthouse answers, it never was one. Before,
    the ledger opened an incident for it, evicted."""
    rid = job.replica_ids[1]
    clock = [time.time()]
    mon = start(tmp_path, job, clock)  # the ledger's first run
    try:
        job.train_and_sweep(mon, clock, 3)
    finally:
        mon.stop()
    store = Store(str(tmp_path / "state.sqlite"))
    store.add_decision(replica_group=1, replica_id=rid, decision="evict", reason="hang",
                       detail="hang confirmed", status="sending", at=clock[0])
    store.close()
    job.front_down()
    mon = start(tmp_path, job, clock)
    try:
        job.train_and_sweep(mon, clock, 3)
        [row] = requests.get(mon.url + "/v1/evictions", timeout=10).json()
        assert row["status"] == "interrupted", row
        job.front_up()
        job.train_and_sweep(mon, clock, 2)
        [row] = requests.get(mon.url + "/v1/evictions", timeout=10).json()
        assert row["status"] == "failed", row
        assert requests.get(mon.url + "/v1/goodput", timeout=10).json()["incidents"] == []
    finally:
        mon.stop()


def stall(job: SimJob, mon: Monitor, clock: list[float], sweeps: int = 4) -> None:
    """Every rank waits in its cross-group all_reduce, ``sweeps`` sweeps 2 s apart."""
    for r in job.sim.ranks:
        r.update(phase="allreduce", timing={"recent": [], "last_step": None, "window": None,
                                            "waiting": {"scope": "cross", "seconds": 0.0}})
    for i in range(sweeps):
        clock[0] += 2.0
        for r in job.sim.ranks:
            r.state["timing"]["waiting"] = {"scope": "cross", "seconds": 2.0 * (i + 1)}
        mon.sweep_once()


def test_a_new_stall_after_the_job_restarted_from_a_checkpoint_counts(tmp_path, job):
    """A ``job_stall`` the first monitor found and counted; the monitor restarts while the job
    is still stalled, and the job is restarted from a checkpoint 80 steps back (new replica
    ids) before the stall is found again. It trains 50 steps, below the stalled one: that
    episode is over (steps past the lowest since), so the job's next stall, below the old step,
    is a new finding, counted. Before, the mark lasted until a step past the stalled one."""
    def stalls() -> tuple[bool, float | None]:
        return (any(f["kind"] == "job_stall" and f["open"] for f in
                    requests.get(mon.url + "/v1/findings", timeout=10).json()),
                mon.metrics.registry.get_sample_value("lightkeeper_monitor_findings_total", {
                    "job": "sim", "kind": "job_stall", "replica_group": "job"}))

    clock = [time.time()]
    mon = start(tmp_path, job, clock)
    try:
        job.train_and_sweep(mon, clock, 6)
        stall(job, mon, clock)
        assert stalls() == (True, 1.0)
        stalled_at = job.sim.ranks[0].state["step"]
    finally:
        mon.stop()
    mon = start(tmp_path, job, clock)
    try:
        for r in job.sim.ranks:  # the whole job stopped, then started from its checkpoint
            r.update(finished=True, stopped_by="SIGTERM", phase="stopped")
        clock[0] += 1.0
        mon.sweep_once()
        for g in range(job.groups):
            job.replica_ids[g] = f"replica_group_{g}:from-checkpoint"
        for r in job.sim.ranks:
            r.update(replica_id=job.replica_ids[r.state["replica_group"]], finished=False,
                     stopped_by=None, phase="forward", step=stalled_at - 80,
                     commits=r.state["commits"] + 1, pid=r.state["pid"] + 100,
                     started_at=clock[0], timing=None)
        job.requorum()
        job.train_and_sweep(mon, clock, 10)
        assert stalls() == (False, None)
        stall(job, mon, clock)
        assert stalls() == (True, 1.0)
    finally:
        mon.stop()


@pytest.mark.parametrize("job", [2], indirect=True)
def test_a_new_fault_of_another_incarnation_after_a_restart_counts(tmp_path, job):
    """The --state holds an open `dead_rank` of group 1 under a replica id the group no longer
    runs (an earlier incarnation, or an earlier job on this --state). Today's group 1 loses a
    rank before it steps: a new fault, counted (a mark by kind and group alone hid it)."""
    s = Store(str(tmp_path / "state.sqlite"))
    s.add_finding({"kind": "dead_rank", "replica_group": 1, "ranks": [3],
                   "replica_id": "replica_group_1:earlier", "evidence": {"summary": "old"},
                   "first_seen": time.time() - 100, "confirmed_at": time.time() - 90})
    s.close()
    cfg = MonitorConfig(port=0, interval_s=0.2, state_path=str(tmp_path / "state.sqlite"),
                        sd_out=str(tmp_path / "t.json"), job="sim", lighthouse=job.url,
                        targets=job.sim.urls, detectors=DetectorConfig(dead_sweeps=2),
                        rails=RailsConfig(dry_run=True))
    mon = Monitor(cfg).start()
    try:
        wait_until(lambda: mon.sweeps >= 3, 15, what="three sweeps")
        victim = job.sim.group(1)[1]
        assert victim.state["replica_id"] != "replica_group_1:earlier"
        victim.set_mode("down")
        wait_until(lambda: any(f["kind"] == "dead_rank" and f["open"] for f in requests.get(
            mon.url + "/v1/findings", timeout=5).json()), 20, what="the new dead_rank")
        assert mon.metrics.registry.get_sample_value("lightkeeper_monitor_findings_total", {
            "job": "sim", "kind": "dead_rank", "replica_group": "1"}) == 1.0
    finally:
        mon.stop()


def test_a_state_file_of_a_newer_format_is_refused_and_left_as_it_is(tmp_path):
    """A monitor rolled back over a file a newer version changed incompatibly (its format,
    SQLite's user_version, raised) refuses it in one line, exit status 1, and keeps its
    format and rows; a file from before the format was kept is taken and marked."""
    import sqlite3

    from monitor.store import FORMAT, Store

    old = tmp_path / "old.sqlite"
    Store(str(old)).close()
    with sqlite3.connect(old) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == FORMAT
        db.execute("PRAGMA user_version = 0")  # as a file from before the format was kept
    Store(str(old)).close()
    with sqlite3.connect(old) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == FORMAT
        db.execute(f"PRAGMA user_version = {FORMAT + 1}")
        db.execute("INSERT INTO hosts (host, data, updated_at) VALUES ('h', '{}', 1)")
    run = subprocess.run([sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0",
                          "--state", str(old)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 1, run
    [line] = run.stderr.splitlines()
    assert f"newer Lightkeeper (state format {FORMAT + 1}" in line and "--state" in line, line
    with sqlite3.connect(old) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == FORMAT + 1
        assert db.execute("SELECT host FROM hosts").fetchall() == [("h",)]
