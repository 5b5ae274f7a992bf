"""``bin/bootstrap`` repairs a ``.venv`` it cannot install into: one ``python -m venv`` left
half-made (a machine without python3-venv: a python, no pip; every later run exited 127 with
".venv/bin/pip: No such file or directory"), or one an older Python made. It says so in one line
and rebuilds it; a good one is left alone, judged by whether its python imports pip, not by a
``bin/pip`` script: one ``ensurepip`` repaired has only ``pip3``, and a moved checkout leaves
``bin/pip``'s shebang pointing nowhere. Rebuilding such a venv would delete torch and whatever
the user added.

Faked as in tests/test_audit_install_bootstrap.py: the Python bootstrap builds .venv with
(``PYTHON``) records its arguments and makes a stand-in .venv whose ``python -m pip`` records
what it would install, so nothing is downloaded; the half-made .venv is a real one without pip,
the good ones real ones whose ``pip`` is a stub package that records its arguments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_audit_install_bootstrap import checkout

# the stand-in venv is checkout()'s: a python that answers yes, and logs what `-m pip` is asked
STAND_IN_PYTHON = """#!/bin/sh
echo "$*" >> "{root}/py.log"
[ "$1" = -c ] && exec "{real}" "$@"
rm -rf .venv && mkdir -p .venv/bin
printf '#!/bin/sh\\nif [ "$1 $2" = "-m pip" ]; then shift 2; echo "$*" >> "%s"; fi\\n' \\
  "{root}/pip.log" > .venv/bin/python
chmod 755 .venv/bin/python
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


def real_venv(root: Path, at: Path) -> Path:
    """A real venv at ``at`` whose pip is a stub that logs its arguments to pip.log, as
    ``ensurepip`` leaves it: a ``pip3`` script, no ``pip``."""
    subprocess.run(["rm", "-rf", str(at)], check=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(at)], check=True,
                   timeout=30)
    site = at / f"lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"
    (site / "pip").mkdir()
    (site / "pip/__init__.py").write_text("")
    (site / "pip/__main__.py").write_text(
        f"import sys\nwith open({str(root / 'pip.log')!r}, 'a') as f:\n"
        "    f.write(' '.join(sys.argv[1:]) + '\\n')\n")
    (at / "bin/pip3").write_text(f"#!{at}/bin/python\nimport runpy\n"
                                 "runpy.run_module('pip', run_name='__main__')\n")
    (at / "bin/pip3").chmod(0o755)
    return at


def assert_used_as_it_is(root: Path) -> None:
    done = bootstrap(root)
    assert ".venv with" not in done.stderr and rebuilds(root) == 0, done.stderr
    assert done.returncode == 0, done.stderr
    assert (root / ".venv/bin/python").exists()  # not cleared
    assert "-e .[dev]" in (root / "pip.log").read_text(), done.stderr  # installed with its pip


@pytest.mark.parametrize("linked", [False, True], ids=["venv", "symlinked-venv"])
def test_a_good_venv_with_pip_only_as_pip3_is_left_alone(tmp_path, linked):
    root = prepared(tmp_path)
    if linked:  # a .venv that links to one elsewhere: --clear would empty that one
        subprocess.run(["rm", "-rf", str(root / ".venv")], check=True)
        (root / ".venv").symlink_to(real_venv(root, tmp_path / "shared-venv"))
    else:
        real_venv(root, root / ".venv")
    (root / ".venv/kept-by-the-user").write_text("")
    assert_used_as_it_is(root)
    assert (root / ".venv/kept-by-the-user").exists()


def test_a_venv_whose_pip_script_points_to_a_moved_checkout_still_installs(tmp_path):
    root = prepared(tmp_path)
    venv = real_venv(root, root / ".venv")
    (venv / "bin/pip").write_text("#!/old/checkout/.venv/bin/python\nimport pip\n")
    (venv / "bin/pip").chmod(0o755)
    assert_used_as_it_is(root)
