"""Upgrading the monitor under a running job: the new version started on the files of the last
release (9bbeb0b).

``tests/data/upgrade_9bbeb0b/`` holds what a 9bbeb0b monitor left when it was stopped (its README
says how it was made): its ``--state`` (a straggler found and evicted, its host quarantined, an
exec hook's quarantine action retrying) and its ``--sd-out``. The new monitor runs with its wall
clock set back to 20 s after the old one stopped (libfaketime), as an upgrade restarts it; else
the stored quarantine would have expired since the files were made.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import sys
import time
from pathlib import Path

import requests

from lightkeeper.processes import start_monitor_process, stop_process, wait_until
from monitor.act.hosts import HostLedger
from monitor.act.sinks.hooks import ExecSink
from monitor.config import QuarantineConfig
from monitor.store import Store
from tests.conftest import require_binary
from tests.support.faketime import faketime_env

OLD = Path(__file__).parent / "data" / "upgrade_9bbeb0b"
SECRET = "drain-token-s3cr3t"
# the --action the old monitor ran with: a hook whose argument is a secret, which logs each
# event it is given and exits $LK_HOOK_RC (the old monitor's attempts failed: 1)
HOOK = ("sh -c 'cat >> \"$LK_HOOK_LOG\"; echo >> \"$LK_HOOK_LOG\"; exit \"${LK_HOOK_RC:-1}\"' "
        + SECRET)
EVICTED = "replica_group_2:238049a1-0fd5-4906-b699-b5c3de70c233"


def old_files(tmp_path: Path) -> tuple[Path, Path, float]:
    """A copy of the old monitor's files (never opened in place: SQLite writes beside them) and
    when that monitor last saved."""
    d = tmp_path / "state"
    d.mkdir()
    shutil.copy(OLD / "monitor.sqlite", d / "monitor.sqlite")
    shutil.copy(OLD / "sd-out.json", d / "sd-out.json")
    db = sqlite3.connect(d / "monitor.sqlite")
    try:
        stopped = db.execute("SELECT at FROM goodput_state").fetchone()[0]
    finally:
        db.close()
    return d, d / "sd-out.json", stopped


def hook_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
        if path.exists() else []


def test_new_monitor_keeps_an_old_monitors_files_and_hides_its_hook_secret(tmp_path):
    require_binary("faketime")
    d, sd_out, stopped = old_files(tmp_path)
    hook_log = tmp_path / "hook.log"
    env = faketime_env(stopped + 20 - time.time(), tmp_path / "shim")
    env = {**os.environ, **env, "LK_HOOK_LOG": str(hook_log), "LK_HOOK_RC": "0",
           "PYTHONPATH": os.pathsep.join([env["PYTHONPATH"], str(Path(__file__).parent.parent)])}
    log = tmp_path / "monitor.log"
    proc, url = start_monitor_process(
        [sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0",
         "--state", str(d / "monitor.sqlite"), "--sd-out", str(sd_out), "--interval", "0.2",
         "--quarantine-after", "straggler=1", "--action", f"exec:{HOOK}",
         "--token", "admin-token", "--register-token", "register-token"],
        tmp_path / "monitor.out", log, env=env)
    try:
        def get(path: str):
            r = requests.get(url + path, timeout=5)
            r.raise_for_status()
            return r.json() if path != "/metrics" else r.text

        # the old monitor's queued action is carried out by the new one, under the sink's name
        def done():
            node = {h["host"]: h for h in get("/v1/hosts")["hosts"]}["node-2"]
            return node if (node.get("last_action") or {}).get("status") == "done" else None

        node = wait_until(done, 30, what="the old monitor's retrying hook action to be done")
        assert [(e["event"], e["action_id"], e["attempt"]) for e in hook_events(hook_log)] == [
            ("quarantine", 1, 3)]
        assert node["state"] == "quarantined"
        hosts = get("/v1/hosts")
        assert SECRET not in json.dumps(hosts), hosts
        assert node["last_action"]["sink"] == hosts["actions"][0]
        assert SECRET not in get("/metrics")
        # the audit history, the evicted set, goodput, bundles and targets are the old run's
        evictions = get("/v1/evictions")
        assert [(e["id"], e["decision"], e["status"], e["replica_id"]) for e in evictions
                if e["decision"] == "evict"] == [(1, "evict", "confirmed", EVICTED)]
        findings = {f["id"]: f for f in get("/v1/findings")}
        assert findings[1]["resolution"] == "left_job"
        assert findings[2]["resolution"] == "monitor_restarted"
        assert (findings[2]["reconfirms"], findings[2]["job"]) == (None, None)  # columns added
        goodput = get("/v1/goodput")
        assert goodput["error"] is None
        assert [(i["id"], i["eviction_id"]) for i in goodput["incidents"]] == [(1, 1)]
        assert [b["decision_id"] for b in get("/v1/incidents")["bundles"]] == [1]
        assert sorted(t["url"] for t in get("/v1/targets")) == [
            "http://127.0.0.2:33111", "http://127.0.0.3:40279", "http://127.0.0.4:44555"]
    finally:
        stop_process(proc, grace=10)
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert SECRET not in log.read_text()


def test_an_old_monitors_retry_is_superseded_by_a_new_monitors_release(tmp_path, monkeypatch):
    """A release queued by the new monitor overtakes a quarantine the old one left retrying, as
    between two of one version's actions: the host is never drained after its release."""
    d, _, stopped = old_files(tmp_path)
    hook_log = tmp_path / "hook.log"
    monkeypatch.setenv("LK_HOOK_LOG", str(hook_log))  # the hook's environment is the monitor's
    store = Store(str(d / "monitor.sqlite"))
    try:
        ledger = HostLedger(store, QuarantineConfig(), [ExecSink(HOOK)], "lightkeeper",
                            lambda: stopped + 20)
        ledger.release("node-2", "drained by hand")
        ledger.run_actions(now=stopped + 600)
    finally:
        store.close()
    assert [e["event"] for e in hook_events(hook_log)] == ["release"]
