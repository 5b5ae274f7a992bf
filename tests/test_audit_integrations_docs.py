"""docs/torchtitan.md's GPU-cluster commands as a user copies them: the monitor started from the
page's own ``lightkeeper monitor`` flags (addresses and secrets swapped for the test's) takes the
registration a rank started by the page's ``lightkeeper run`` line sends (its ``--job`` and
registration token, from the variable the page sets, as every secret: a flag would put it on the
command line, where ``ps`` shows it), as a real WorkerServer sends it
(``worker_server/server.py``)."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import requests

from monitor.cli import add_arguments, config_from_args
from monitor.service import Monitor
from worker_server.server import registration_token

PAGE = Path(__file__).resolve().parent.parent / "docs" / "torchtitan.md"
SECRETS = {"$LIGHTKEEPER_TOKEN": "admin-t", "$LIGHTKEEPER_REGISTER_TOKEN": "reg-t"}


def commands(section: str) -> list[list[str]]:
    """Each command of the first bash block after ``section``'s heading, continuation lines
    joined, as argv."""
    text = PAGE.read_text().split(section, 1)[1]
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1).replace("\\\n", " ")
    out = []
    for line in block.splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            out.append([SECRETS.get(a, a) for a in shlex.split(line.replace('"', ""))])
    return out


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_the_pages_monitor_takes_the_pages_ranks(tmp_path, monkeypatch):
    cmds = commands("## On a GPU cluster")
    assert not any(a.startswith(("--token", "--register-token")) for c in cmds for a in c), cmds
    for name, value in SECRETS.items():  # what the page's shell holds
        monkeypatch.setenv(name[1:], value)
    mon_argv = next(c for c in cmds if c[:2] == ["lightkeeper", "monitor"])[2:]
    run_argv = next(c for c in cmds if c[:2] == ["lightkeeper", "run"])
    run_argv = run_argv[:run_argv.index("--")]
    for name, value in (("--bind", "127.0.0.1"), ("--port", "0"),
                        ("--lighthouse", "http://127.0.0.1:1"),
                        ("--state", str(tmp_path / "monitor.sqlite"))):
        mon_argv[mon_argv.index(name) + 1] = value
    p = argparse.ArgumentParser()
    add_arguments(p)
    mon = Monitor(config_from_args(p.parse_args(mon_argv))).start()
    try:
        body = {"url": "http://127.0.0.1:9", "job": flag(run_argv, "--job") or "lightkeeper",
                "replica_group": 0, "rank": 0}
        assert requests.post(mon.url + "/v1/targets", json=body, timeout=5).status_code == 401
        token = registration_token()  # the rank's, from its environment
        r = requests.post(mon.url + "/v1/targets", json=body, timeout=5,
                          headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200, r.text
    finally:
        mon.stop()
