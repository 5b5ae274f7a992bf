"""Text a rank supplies (its host name, phase, error texts, and the findings built from them)
reaches the monitor's log and the demo's terminal with its control characters escaped: a broken
or malicious rank cannot clear or retitle a terminal, nor forge a line with a newline. The
monitor's log handler escapes every message in one place (monitor/cli.py); the demo its story
lines."""

from __future__ import annotations

import argparse
import os
import sys
import time

import requests

from lightkeeper.demo import Demo, add_arguments
from lightkeeper.processes import start_monitor_process, stop_process
from lightkeeper.scenario import Scenario

BAD = "evil\x1b[2J\n[monitor] fake line"
SHOWN = "evil\\x1b[2J\\n[monitor] fake line"
SECRET = "s3cr3t-4e9a"


def test_the_monitors_log_shows_a_ranks_host_name_escaped_and_no_url_password(tmp_path):
    """A rank registering as ``http://<host>:9400`` with a host holding a clear-screen escape
    and a newline: the refusal's log line holds them escaped, on one line. The run also shows
    the --lighthouse password nowhere (start line, log, /v1/cluster), and says it is on the
    command line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIGHTKEEPER_", "TORCHFT_"))}
    lh = f"http://lk:{SECRET}@127.0.0.1:1"  # nobody listens: the reader's error names it
    proc, url = start_monitor_process(
        [sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0", "--interval", "60",
         "--state", str(tmp_path / "state.sqlite"), "--lighthouse", lh],
        tmp_path / "out.log", tmp_path / "err.log", env=env)
    err = tmp_path / "err.log"
    try:
        r = requests.post(url + "/v1/targets", json={"url": f"http://{BAD}:9400"}, timeout=10)
        assert r.status_code == 400, r.text
        cluster = requests.get(url + "/v1/cluster", timeout=10).json()
        assert cluster["lighthouse"] == "http://lk:***@127.0.0.1:1", cluster["lighthouse"]
        deadline = time.monotonic() + 10
        while "registration of" not in err.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop_process(proc)
    log = err.read_text()
    assert [ln for ln in log.splitlines() if "registration of" in ln][0].count(SHOWN) == 2, log
    assert all(ln.isprintable() for ln in log.splitlines()), log
    assert not any(ln.startswith("[monitor] fake line") for ln in log.splitlines()), log
    out = (tmp_path / "out.log").read_text()
    assert SECRET not in log + out and "lighthouse=http://lk:***@127.0.0.1:1" in out, out
    assert "--lighthouse's password on the command line" in log, log


def test_the_demos_story_lines_show_a_ranks_host_name_escaped(tmp_path, capsys):
    """A finding naming a culprit rank on a host a rank reported: the demo's event line (stdout
    is no terminal here: one line per event, as in CI) holds the name escaped, on one line; so
    does the live view's screen (a terminal), whose first line alone clears the screen."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    demo = Demo(p.parse_args([]), Scenario(), tmp_path)
    answers = {"/v1/findings": [{
        "kind": "hang", "replica_group": 1, "replica_id": "r1", "first_seen": 1.0,
        "confirmed_at": demo.t0_unix + 3.0, "ranks": [2, 3],
        "evidence": {"culprit_ranks": [3], "culprit_hosts": [BAD]}}],
        "/v1/evictions": [{"id": 1, "replica_group": 1, "at": 2.0, "decision": "evict",
                           "reason": f"hang on {BAD}"}]}
    demo.monitor_get = answers.get  # the monitor's answers, as it serves a rank's host name
    demo.tty = False
    demo.poll_monitor()
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert all(ln.isprintable() for ln in lines), out
    assert not any(ln.startswith("[monitor] fake line") for ln in lines), out
    assert f"hang (ranks [2, 3], culprit ranks [3] on {SHOWN}) at 3.0s" in out, out
    assert f"evict (hang on {SHOWN})" in out, out
    demo.tty = True
    demo.render()
    screen = capsys.readouterr().out
    first, *rest = screen.split("\n")
    assert first == "\x1b[H\x1b[2J" and all(ln.isprintable() for ln in rest), screen
    assert sum(SHOWN in ln for ln in rest) == 2, screen
