"""``--action slurm`` at start-up: a ``scontrol`` that cannot read Slurm's configuration stops
the monitor with exit status 2 and one line (every drain would fail so, retried for days), a
slurmctld that does not answer right now does not (docs/quarantine.md, ``slurm``). The real
``scontrol``; no Slurm daemon runs."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys

import pytest

from monitor.act.sinks import SinkConfigError, build_sink
from monitor.act.sinks.hooks import SlurmSink
from monitor.config import QuarantineConfig
from tests.conftest import require_binary


def _monitor(tmp_path, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0",
                           "--state", str(tmp_path / "m.sqlite"), "--action", "slurm"],
                          env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("conf,said", [
    (None, "Could not establish a configuration source"),
    ("absent.conf", "absent.conf is not a file"),
    ("", "SLURM_CONF= is not a file"),  # `SLURM_CONF=${SLURM_CONF}` in a unit, say
    ("bad.conf", "Unable to process configuration file")])
def test_a_scontrol_without_slurms_configuration_stops_the_monitor(tmp_path, conf, said):
    require_binary("scontrol")
    if conf is None and os.path.exists("/etc/slurm/slurm.conf"):
        pytest.skip("this host has a Slurm configuration at the default path")
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    if conf is not None:
        env["SLURM_CONF"] = conf and str(tmp_path / conf)
        (tmp_path / "bad.conf").write_text("ClusterName=lk\nNoSuchKey=1\n")
    p = _monitor(tmp_path, env)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    line = p.stderr.strip().splitlines()[-1]
    assert "Traceback" not in p.stderr and line.startswith("lightkeeper monitor: --action slurm")
    assert said in line, line


def test_a_slurmctld_that_does_not_answer_now_stops_nothing(tmp_path, monkeypatch):
    """A readable slurm.conf whose controller's port nothing listens on: the sink is built (its
    drains fail and are retried until slurmctld answers)."""
    require_binary("scontrol")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"ClusterName=lk\nSlurmctldHost=localhost(127.0.0.1)\n"
                    f"SlurmctldPort={port}\nNodeName=n1 CPUs=1 State=UNKNOWN\n"
                    "PartitionName=p Nodes=n1 Default=YES State=UP\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    assert isinstance(build_sink("slurm", QuarantineConfig(action_timeout_s=5)), SlurmSink)


def test_configless_slurm_whose_controller_does_not_answer_now_stops_nothing(tmp_path,
                                                                             monkeypatch):
    """Configless Slurm (DNS SRV) fetches the configuration from slurmctld: that fetch failing
    is the controller not answering, not a configuration error. A stand-in ``scontrol`` says
    what Slurm's says then; one that says no configuration source was found stops it."""
    fake = tmp_path / "scontrol"
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_CONF", raising=False)
    fatal = "scontrol: fatal: Could not establish a configuration source"
    for error in ("_fetch_child: failed to fetch remote configs: Connection refused",
                  "fetch_config: DNS SRV lookup failed"):
        fake.write_text(f'#!/bin/sh\necho "scontrol: error: {error}" >&2\n'
                        f'echo "{fatal}" >&2\nexit 1\n')
        fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
        if "remote" in error:
            assert isinstance(build_sink("slurm"), SlurmSink)
        else:
            with pytest.raises(SinkConfigError, match="DNS SRV lookup failed"):
                build_sink("slurm")
