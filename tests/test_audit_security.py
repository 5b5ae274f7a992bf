"""Trust boundaries an operator checks before a shared cluster: registration through the
allow-list and the tokens' start-up warning, over a real monitor on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import requests

from monitor.config import MonitorConfig
from monitor.service import Monitor


def test_allow_listed_registration_keeps_the_path_prefix(tmp_path):
    """A rank behind a proxy prefix is polled at that prefix, at the checked address (the
    token path kept it; the allow-list path dropped it and polled the proxy's root)."""
    cfg = MonitorConfig(port=0, interval_s=0.2, state_path=str(tmp_path / "state.sqlite"),
                        sd_out=str(tmp_path / "targets.json"), job="unit")
    mon = Monitor(cfg).start()
    try:
        r = requests.post(mon.url + "/v1/targets", timeout=5,
                          json={"url": "http://localhost:9/rank-0/", "job": "unit"})
        assert r.status_code == 200, r.text
        assert r.json()["url"] == "http://127.0.0.1:9/rank-0"
        known = [t["url"] for t in requests.get(mon.url + "/v1/targets", timeout=5).json()]
        assert known == ["http://127.0.0.1:9/rank-0"]
    finally:
        mon.stop()


def test_tokens_equal_but_for_a_newline_are_warned_about(tmp_path):
    """The routes strip the tokens (a secret file's final newline), so a registration token
    that differs from the admin one only by it can evict: the start-up warning says so."""
    env = {**os.environ, "LIGHTKEEPER_TOKEN": "same-token\n",
           "LIGHTKEEPER_REGISTER_TOKEN": "same-token"}
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0",
             "--state", str(tmp_path / "s.sqlite"), "--no-bundles"], env=env, stdout=o, stderr=e)
    try:
        deadline = time.monotonic() + 30
        # the warning comes before the start line
        while "monitor=" not in out.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        assert "monitor=" in out.read_text(), err.read_text()
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert "--register-token equals --token" in err.read_text(), err.read_text()
