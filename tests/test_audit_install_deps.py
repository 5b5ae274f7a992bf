"""What ``pip install lightkeeper`` (and so ``lightkeeper[worker]``, into a training job's own
environment) puts there besides Lightkeeper: no start-up hook of another package. grafana-client
brought niquests and urllib3-future, whose ``urllib3_future.pth`` copies urllib3-future over the
environment's ``urllib3`` at every interpreter start (``pip list`` still naming urllib3's own
version); only ``dashboards upload`` needs it, so it is the ``grafana`` extra, and the upload
says so in one line where it is missing.

Faked: the core install is the core requirements' distributions linked from .venv into a fresh
venv (tests/test_install_core.py's way, without its wheel build), and grafana-client's absence
is ``sys.modules['grafana_client'] = None`` in the one process (.venv has it, for the upload
tests).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from tests.test_install_core import linked_venv

ROOT = Path(__file__).resolve().parents[1]


def test_the_core_install_adds_no_startup_hook(tmp_path):
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    _, site = linked_venv(tmp_path / "venv", deps)
    assert sorted(p.name for p in site.glob("*.pth")) == []


def test_upload_without_grafana_client_says_which_extra(tmp_path):
    code = ("import sys; sys.modules['grafana_client'] = None; "
            "from lightkeeper.cli import main; sys.exit(main(sys.argv[1:]))")
    res = subprocess.run([sys.executable, "-c", code, "dashboards", "upload", "--grafana-url",
                          "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "GRAFANA_TOKEN": "glsa_x"})
    assert res.returncode == 1, res.stderr
    assert res.stderr.count("\n") == 1 and "pip install 'lightkeeper[grafana]'" in res.stderr, \
        res.stderr
