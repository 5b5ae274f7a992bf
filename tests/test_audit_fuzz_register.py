"""``POST /v1/targets`` (a rank's self-registration) fuzzed against a real ``lightkeeper
monitor``: every body gets a 4xx with a reason or is admitted, never a 500 or a traceback."""

from __future__ import annotations

import json
import random
import sys

import requests

from lightkeeper.processes import start_monitor_process, stop_process

WEIRD = [None, True, 0, -1, 2**70, 1e308, "", "x", "\u00e9\u2603", "a" * 3000, [], {}, [1],
         {"a": 1}, 0.5, "1", "127.0.0.1:1", "http://[::1]:80/x", "http://h:99999",
         "torch+http://127.0.0.1:1", "https://127.0.0.1:1/p/", "http://127.0.0.1:1?x", "[::1",
         "::1:80", "http://u:p@127.0.0.1:1", "http://127.0.0.1:0", "http://10.0.0.1:5",
         "http://[::ffff:127.0.0.1]:5", "http://2130706433:5", "http://a..b:5",
         "http://" + "a" * 300 + ":5"]  # no name a resolver would be asked


def test_registration_bodies_get_an_answer_never_a_500(tmp_path):
    """Before: a URL whose host IDNA refuses (``a..b``, a label over 63 characters) raised
    UnicodeError out of the name lookup: 500 and a traceback in the monitor's log."""
    proc, url = start_monitor_process(
        [sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0", "--interval", "60",
         "--job", "j", "--state", str(tmp_path / "state.sqlite")],
        tmp_path / "out.log", tmp_path / "err.log")
    try:
        for bad in ("http://a..b:5", "http://" + "a" * 300 + ":5"):
            r = requests.post(url + "/v1/targets", json={"url": bad}, timeout=10)
            assert r.status_code == 403 and "does not resolve" in r.json()["error"], r.text
        rng = random.Random(3)
        for _ in range(150):
            body = {"url": rng.choice(WEIRD), "job": rng.choice(["j", None, 5, "k"]),
                    "replica_group": rng.choice(WEIRD), "rank": rng.choice(WEIRD)}
            body = {k: v for k, v in body.items() if rng.random() > 0.1}
            r = requests.post(url + "/v1/targets", data=json.dumps(body), timeout=10,
                              headers={"Content-Type": "application/json"})
            assert r.status_code in (200, 400, 403, 409), (body, r.status_code, r.text)
        assert "Traceback" not in (tmp_path / "err.log").read_text()
    finally:
        stop_process(proc)


def test_a_registration_cannot_write_a_line_of_its_own_into_the_log(tmp_path):
    """The refusal of another job's rank logged the body's URL as it came, before any check:
    anyone who reaches the monitor could add lines (a forged "evicted ...") to its log."""
    proc, url = start_monitor_process(
        [sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0", "--interval", "60",
         "--job", "j", "--state", str(tmp_path / "state.sqlite")],
        tmp_path / "out.log", tmp_path / "err.log")
    try:
        r = requests.post(url + "/v1/targets", timeout=10, json={
            "url": "http://127.0.0.1:1\nFORGED evicted replica group 3", "job": "other"})
        assert r.status_code == 409
    finally:
        stop_process(proc)
    log = (tmp_path / "err.log").read_text()
    assert "refusing ranks of job 'other'" in log
    assert not [line for line in log.splitlines() if line.startswith("FORGED")], log
