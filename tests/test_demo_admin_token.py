"""The demo's monitor has an admin token, so the runbook's host release works in the demo: the
token's header line sits in a file only its user reads (made anew at each start, never through
a link planted there), the printed curl line has curl read it from there (-H @file: not in
curl's argv either), the ranks register with a token of their own (never the admin one), and no
token is on a command line, in the printed text or in demo.log; the file goes with the monitor.
A real monitor, started as the demo starts it; the whole demo's run with it is
tests/test_demo_e2e.py's."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import requests

from lightkeeper.demo import Demo, print_keep_running
from lightkeeper.processes import free_port
from lightkeeper.scenario import Scenario
from tests.support.demo import demo_args


def test_the_demos_monitor_releases_a_host_with_the_token_the_printed_line_reads(
        tmp_path, capsys):
    demo = Demo(demo_args("--no-prometheus"), Scenario(), tmp_path / "report")
    demo.logs.mkdir(parents=True, exist_ok=True)
    demo._log = open(demo.dir / "demo.log", "a")
    demo.cluster.lighthouse_url = f"http://127.0.0.1:{free_port()}"  # none: it only reports
    tokens = (demo.admin_token, demo.register_token, demo.exit_token, demo.token)
    # what a killed run, or another user, left where the file goes: a link to someone's file
    victim, path = tmp_path / "victim", demo.dir / "monitor-admin-token"
    victim.write_text("theirs\n")
    path.symlink_to(victim)
    try:
        demo.start_monitor()
        assert victim.read_text() == "theirs\n" and not path.is_symlink()
        mon = demo.monitor_url
        argv = Path(f"/proc/{demo.monitor_proc.pid}/cmdline").read_bytes().decode()
        assert not [t for t in tokens if t in argv], argv

        print_keep_running(demo)
        printed = capsys.readouterr().out
        (line,) = [ln for ln in printed.splitlines() if "/release" in ln]
        assert f"-H @{path} " in line and f"{mon}/v1/hosts/<host>/release" in line, line
        assert os.stat(path).st_mode & 0o777 == 0o600
        # the printed line, run by a shell as the user would, through a curl that records its
        # argv (what ps shows): the monitor took the token (the ledger knows no such host: 404,
        # not 403 "state changes are disabled" nor 401), and no argv held it
        stub = tmp_path / "bin"
        stub.mkdir()
        (stub / "curl").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> {tmp_path}/argv\n'
                                   f'exec {shutil.which("curl")} "$@"\n')
        (stub / "curl").chmod(0o755)
        env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}"}
        cmd = line.split("#")[0].strip().replace("<host>", "node-9")
        for run, status in ((cmd, "404"), (re.sub(r" -H \S+", "", cmd), "401")):
            run = re.sub(r"^curl ", "curl -s -o /dev/null -w '%{http_code}' ", run)
            out = subprocess.run(["bash", "-c", run], capture_output=True, text=True,
                                 timeout=30, env=env)
            assert out.stdout == status, (run, out.stdout, out.stderr)
        argv = (tmp_path / "argv").read_text()
        assert "/release" in argv and demo.admin_token not in argv, argv

        # the ranks hold a registration token, not the admin one, and it admits them
        env = demo.cluster.extra_env
        assert env["LIGHTKEEPER_REGISTER_TOKEN"] == demo.register_token
        assert "LIGHTKEEPER_TOKEN" not in env and demo.register_token != demo.admin_token
        body = {"url": f"http://127.0.0.1:{free_port()}", "job": demo.cluster.job,
                "replica_group": 0, "rank": 0}
        r = requests.post(f"{mon}/v1/targets", json=body, timeout=5,
                          headers={"Authorization": f"Bearer {demo.register_token}"})
        assert r.status_code == 200, r.text
        r = requests.post(f"{mon}/v1/hosts/node-9/release", timeout=5,
                          headers={"Authorization": f"Bearer {demo.register_token}"})
        assert r.status_code == 403, r.text
    finally:
        demo.stop()
    assert demo.monitor_proc.poll() is not None
    assert not path.exists()
    shown = printed + (demo.dir / "demo.log").read_text() + "".join(
        p.read_text(errors="replace") for p in demo.logs.iterdir())
    assert not [t for t in tokens if t in shown]
