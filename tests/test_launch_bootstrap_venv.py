"""``bin/bootstrap`` repairs a ``.venv`` it cannot install into: one ``python -m venv`` left
half-made (a machine without python3-venv: a python, no pip; every later run exited 127 with
".venv/bin/pip: No such file or directory"), or one an older Python made. It says so in one line
and rebuilds it; a good one is left alone.

Faked as in tests/test_audit_install_bootstrap.py: the Python bootstrap builds .venv with
(``PYTHON``) records its arguments and makes a stand-in .venv whose ``pip`` records what it
would install, so nothing is downloaded; the half-made .venv is a real one without pip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.test_audit_install_bootstrap import checkout

# the stand-in venv is checkout()'s: a python that answers yes, a pip that logs
STAND_IN_PYTHON = """#!/bin/sh
echo "$*" >> "{root}/py.log"
[ "$1" = -c ] && exec "{real}" "$@"
rm -rf .venv && mkdir -p .venv/bin
printf '#!/bin/sh\\nexit 0\\n' > .venv/bin/python
printf '#!/bin/sh\\necho "$*" >> "{root}/pip.log"\\n' > .venv/bin/pip
chmod 755 .venv/bin/python .venv/bin/pip
"""
# a Python 3.10's .venv, as far as bootstrap asks it (no torch there either)
OLD_PYTHON = """#!/bin/sh
[ "$1" = -c ] && exec "{real}" -I -c "import sys; sys.version_info = (3, 10, 12, 'final', 0)
sys.modules['torch'] = None
$2"
exit 0
"""


def bootstrap(root: Path) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "CC": "true", "HOME": str(root),
           "PYTHON": str(root / "stand-in-python")}
    return subprocess.run(["bash", str(root / "bin/bootstrap")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=60)


def prepared(tmp_path: Path) -> Path:
    root = checkout(tmp_path)
    py = root / "stand-in-python"
    py.write_text(STAND_IN_PYTHON.format(root=root, real=sys.executable))
    py.chmod(0o755)
    return root


def rebuilds(root: Path) -> int:
    log = root / "py.log"
    return log.read_text().count("-m venv --clear .venv") if log.exists() else 0


def assert_rebuilt_once(root: Path, why: str) -> None:
    first = bootstrap(root)
    assert first.returncode == 0, first.stderr
    said = [line for line in first.stderr.splitlines() if ".venv with" in line]
    assert said == [f"bootstrap: rebuilding .venv with {root / 'stand-in-python'}: {why}"], \
        first.stderr
    assert rebuilds(root) == 1
    assert "-e .[dev]" in (root / "pip.log").read_text()  # the project installed in the new one
    second = bootstrap(root)  # now whole: left alone
    assert second.returncode == 0 and rebuilds(root) == 1, second.stderr
    assert ".venv with" not in second.stderr, second.stderr


def test_a_venv_left_without_pip_is_rebuilt(tmp_path):
    root = prepared(tmp_path)
    subprocess.run(["rm", "-rf", str(root / ".venv")], check=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / ".venv")],
                   check=True, timeout=30)
    assert_rebuilt_once(root, "it has no working python or pip (python3-venv missing when it "
                              "was made?)")


def test_a_venv_an_older_python_made_is_rebuilt(tmp_path):
    root = prepared(tmp_path)
    old = root / ".venv/bin/python"
    old.write_text(OLD_PYTHON.format(real=sys.executable))
    assert_rebuilt_once(root, "it was made by a Python older than 3.11")
