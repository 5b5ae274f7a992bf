"""Two ``bin/bootstrap`` runs at once, as ``bin/lightkeeper monitor &`` and ``bin/lightkeeper run
...`` start them after a pull: one installs, the other waits for it and then finds nothing to do,
instead of two pips writing into one .venv together.

Faked as in tests/test_audit_install_bootstrap.py: .venv's ``python`` is a stand-in whose
``-m pip install -e .[dev]`` records when it starts and ends and takes half a second."""

from __future__ import annotations

import os
import subprocess

from tests.test_audit_install_bootstrap import bootstrap, checkout

SLOW_PIP = """#!/bin/sh
if [ "$1 $2" = "-m pip" ]; then
  case "$*" in *"-e .[dev]"*)
    echo start >> "{log}"; sleep 0.5; echo end >> "{log}" ;;
  esac
fi
exit 0
"""


def test_two_bootstraps_at_once_install_one_after_the_other(tmp_path):
    root = checkout(tmp_path)
    log = root / "install.log"
    (root / ".venv/bin/python").write_text(SLOW_PIP.format(log=log))
    env = {"PATH": os.environ["PATH"], "CC": "true", "HOME": str(root)}
    # both started well before the first's install ends
    runs = [subprocess.Popen(["bash", str(root / "bin/bootstrap")], cwd=root, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    for run in runs:
        _, err = run.communicate(timeout=30)
        assert run.returncode == 0, err
    # the second waited for the first, then found the project installed
    assert log.read_text().splitlines() == ["start", "end"]
    assert bootstrap(root).returncode == 0 and log.read_text().splitlines() == ["start", "end"]
