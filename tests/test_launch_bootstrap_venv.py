"""``bin/bootstrap`` repairs a ``.venv`` it cannot install into. One without pip (``uv venv``,
conda), or whose pip fails to import, gets it from ``ensurepip``, else from the pip wheel the
rebuilding Python's ensurepip bundles, its site-packages kept; a repair that fails (disk full, a
kill) stops bootstrap with its error and clears nothing. One that no Python can add pip to, or
one an older Python made, is rebuilt, in one line. A good one is left alone, judged by whether its
python imports pip, not by a ``bin/pip`` script: one ``ensurepip`` repaired has only ``pip3``, and
a moved checkout leaves ``bin/pip``'s shebang pointing nowhere. Rebuilding such a venv would
delete torch and whatever the user added. A moved checkout gets the project installed again
(``bin/lightkeeper``'s shebang and the editable install named the old path) and every other
script in .venv pointed at the new one.

Faked as in tests/test_audit_install_bootstrap.py: the Python bootstrap builds .venv with
(``PYTHON``) records its arguments and makes a stand-in .venv whose ``python -m pip`` records
what it would install, so nothing is downloaded; the venvs without pip are real ones, the good
ones real ones whose ``pip`` is a stub package that records its arguments. ``ensurepip`` is a
stand-in ahead of the stdlib's on PYTHONPATH (the real one takes seconds): missing as on Debian
without python3-venv, failing, or leaving that stub pip."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.test_audit_install_bootstrap import checkout

# the stand-in venv is checkout()'s: a python that answers yes, and logs what `-m pip` is asked
STAND_IN_PYTHON = """#!/bin/sh
echo "$*" >> "{root}/py.log"
[ "$1" = -c ] && exec "{real}" "$@"
[ "$1 $2" = "-m ensurepip" ] && exit 0
rm -rf .venv && mkdir -p .venv/bin
printf '#!/bin/sh\\nif [ "$1 $2" = "-m pip" ]; then shift 2; echo "$*" >> "%s"; fi\\n' \\
  "{root}/pip.log" > .venv/bin/python
chmod 755 .venv/bin/python
"""
# Debian's python3.11 without python3.11-venv: no ensurepip, and `venv --clear` empties the
# directory before it fails for want of it
NO_ENSUREPIP_PYTHON = """#!/bin/sh
echo "$*" >> "{root}/py.log"
[ "$1" = -c ] && exec "{real}" "$@"
[ "$1 $2" = "-m ensurepip" ] && {{ echo "No module named ensurepip" >&2; exit 1; }}
[ "$1 $2 $3" = "-m venv --clear" ] && rm -rf "$4"
exit 1
"""
# a Python 3.10's .venv, as far as bootstrap asks it (no torch there either)
OLD_PYTHON = """#!/bin/sh
[ "$1" = -c ] && exec "{real}" -I -c "import sys; sys.version_info = (3, 10, 12, 'final', 0)
sys.modules['torch'] = None
$2"
exit 0
"""


def bootstrap(root: Path, **extra: str) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "CC": "true", "HOME": str(root),
           "PYTHON": str(root / "stand-in-python"), **extra}
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


def assert_rebuilt_once(root: Path, why: str, **extra: str) -> None:
    first = bootstrap(root, **extra)
    assert first.returncode == 0, first.stderr
    said = [line for line in first.stderr.splitlines() if ".venv with" in line]
    assert said == [f"bootstrap: rebuilding .venv with {root / 'stand-in-python'}, deleting what "
                    f"was installed in it: {why}"], first.stderr
    assert rebuilds(root) == 1
    assert "-e .[dev]" in (root / "pip.log").read_text()  # the project installed in the new one
    second = bootstrap(root)  # now whole: left alone
    assert second.returncode == 0 and rebuilds(root) == 1, second.stderr
    assert ".venv with" not in second.stderr, second.stderr


def site_packages(venv: Path) -> Path:
    return venv / f"lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"


def stub_pip_main(root: Path) -> str:
    """A ``pip/__main__.py`` that logs its arguments to pip.log and installs nothing."""
    return (f"import sys\nwith open({str(root / 'pip.log')!r}, 'a') as f:\n"
            "    f.write(' '.join(sys.argv[1:]) + '\\n')\n")


def stub_pip(root: Path, site: Path) -> None:
    (site / "pip").mkdir()
    (site / "pip/__init__.py").write_text("")
    (site / "pip/__main__.py").write_text(stub_pip_main(root))


def adds_stub_pip(root: Path, site: Path) -> str:
    """Python source that does :func:`stub_pip`: what a stand-in ensurepip or wheel runs."""
    return ("from pathlib import Path\n"
            f"pip = Path({str(site)!r}) / 'pip'\n"
            "pip.mkdir()\n"
            "(pip / '__init__.py').write_text('')\n"
            f"(pip / '__main__.py').write_text({stub_pip_main(root)!r})\n")


def venv_without_pip(at: Path) -> Path:
    subprocess.run(["rm", "-rf", str(at)], check=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(at)], check=True,
                   timeout=30)
    return at


def ensurepip(tmp_path: Path, body: str, init: str = "") -> str:
    """A PYTHONPATH whose ``ensurepip`` runs ``body`` in the venv's python."""
    where = tmp_path / "ensurepip-stand-in"
    (where / "ensurepip").mkdir(parents=True)
    (where / "ensurepip/__init__.py").write_text(init)
    (where / "ensurepip/__main__.py").write_text(body)
    return str(where)


def bundled_wheel(stand_in: str, main: str) -> Path:
    """A pip wheel in the stand-in ``ensurepip``'s ``_bundled``, whose ``pip`` runs ``main``."""
    bundled = Path(stand_in) / "ensurepip/_bundled"
    bundled.mkdir()
    wheel = bundled / "pip-99.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as whl:  # run as `python <wheel>/pip install <wheel>`
        whl.writestr("pip/__main__.py", main)
    return wheel


def no_ensurepip(tmp_path: Path) -> str:
    """A PYTHONPATH without ``ensurepip``, as Debian's python3.X is without python3.X-venv."""
    return ensurepip(tmp_path, "", init="raise ModuleNotFoundError(\"No module named 'ensurepip'\","
                                        " name='ensurepip')\n")


def test_a_venv_without_pip_that_no_python_can_add_it_to_is_rebuilt(tmp_path):
    root = prepared(tmp_path)
    venv_without_pip(root / ".venv")
    assert_rebuilt_once(root, "it has no pip and its Python no ensurepip (python3-venv missing "
                              "when it was made?)", PYTHONPATH=no_ensurepip(tmp_path))


@pytest.mark.parametrize("pip_state", ["no pip", "pip failing to import"])
def test_a_venv_whose_ensurepip_fails_is_kept_and_bootstrap_stops_saying_why(tmp_path,
                                                                            pip_state):
    """ensurepip there but failing (disk full, permissions, a kill) was taken for "no
    ensurepip", and ``venv --clear`` deleted torch and all for a repair that might work next
    time."""
    root = prepared(tmp_path)
    site = site_packages(venv_without_pip(root / ".venv"))
    if pip_state == "pip failing to import":
        stub_pip(root, site)
        (site / "pip/__init__.py").write_text("raise RuntimeError('broken')\n")
    (site / "kept-by-the-user").write_text("")
    full = ensurepip(tmp_path, "import sys\n"
                               "sys.exit('OSError: [Errno 28] No space left on device')\n")
    done = bootstrap(root, PYTHONPATH=full)
    assert done.returncode == 1, done.stderr
    assert rebuilds(root) == 0 and "rebuilding" not in done.stderr, done.stderr
    assert (site / "kept-by-the-user").exists()
    assert done.stderr.splitlines()[-2:] == [
        "bootstrap: .venv kept as it is: .venv/bin/python -m ensurepip --upgrade failed; "
        "bin/bootstrap tries again once that is fixed:",
        "OSError: [Errno 28] No space left on device"], done.stderr
    assert not (root / "pip.log").exists()  # nothing installed into it either


def test_a_venv_whose_python_lacks_ensurepip_gets_pip_from_the_bundled_wheel(tmp_path):
    """``uv venv`` with a Python that has no ensurepip, while the Python bootstrap would rebuild
    it with has one: pip is installed from that Python's bundled wheel, nothing cleared."""
    root = prepared(tmp_path)
    site = site_packages(venv_without_pip(root / ".venv"))
    (site / "kept-by-the-user").write_text("")
    # the venv's Python alone has no ensurepip
    (site / "no-ensurepip.pth").write_text("import sys; sys.modules['ensurepip'] = None\n")
    stand_in = ensurepip(tmp_path, "")
    wheel = bundled_wheel(stand_in, (
        "import sys\nfrom pathlib import Path\n"
        f"Path({str(root / 'wheel.log')!r}).write_text(' '.join(sys.argv[1:]))\n"
        + adds_stub_pip(root, site)))
    done = bootstrap(root, PYTHONPATH=stand_in)
    assert done.returncode == 0, done.stderr
    assert "rebuilding" not in done.stderr and rebuilds(root) == 0, done.stderr
    assert f"bootstrap: .venv had no pip: added it with {wheel}" in done.stderr.splitlines()
    assert (root / "wheel.log").read_text().endswith(f"--no-index --no-deps --force-reinstall "
                                                     f"{wheel}")
    assert (site / "kept-by-the-user").exists()
    assert "-e .[dev]" in (root / "pip.log").read_text(), done.stderr  # installed with that pip


def test_a_venv_made_without_pip_gets_it_from_ensurepip_and_keeps_its_packages(tmp_path):
    """``uv venv`` and conda make no pip: ensurepip adds it, offline; --clear would have deleted
    torch and all."""
    if importlib.util.find_spec("ensurepip") is None:
        pytest.skip("this Python has no ensurepip (Debian's without python3-venv)")
    root = prepared(tmp_path)
    site = site_packages(venv_without_pip(root / ".venv"))
    (site / "kept-by-the-user").write_text("")
    # the stand-in leaves the stub pip where the real one leaves pip
    adds_pip = ensurepip(tmp_path, adds_stub_pip(root, site))
    done = bootstrap(root, PYTHONPATH=adds_pip)
    assert done.returncode == 0, done.stderr
    assert "rebuilding" not in done.stderr and rebuilds(root) == 0, done.stderr
    assert "bootstrap: .venv had no pip: added it with ensurepip" in done.stderr.splitlines()
    assert (site / "kept-by-the-user").exists()
    assert "-e .[dev]" in (root / "pip.log").read_text(), done.stderr  # installed with that pip


def test_a_venv_an_older_python_made_is_rebuilt(tmp_path):
    root = prepared(tmp_path)
    old = root / ".venv/bin/python"
    old.write_text(OLD_PYTHON.format(real=sys.executable))
    assert_rebuilt_once(root, "it was made by a Python older than 3.11")


def real_venv(root: Path, at: Path) -> Path:
    """A real venv at ``at`` whose pip is a stub that logs its arguments to pip.log, as
    ``ensurepip`` leaves it: a ``pip3`` script, no ``pip``."""
    stub_pip(root, site_packages(venv_without_pip(at)))
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


def test_a_moved_checkout_installs_the_project_again(tmp_path):
    """``mv ~/lk ~/src/lk`` keeps mtimes, so the stamp stays newer than pyproject.toml; the
    stamp names the checkout it was installed from."""
    root = prepared(tmp_path)
    (root / "monitor/analysis/_frpickle.cpython-311-x86_64-linux-gnu.so").write_text("")
    (root / ".venv/.lightkeeper-installed").write_text("/home/user/lk\n")  # before the mv
    done = bootstrap(root)
    assert done.returncode == 0, done.stderr
    assert "-e .[dev]" in (root / "pip.log").read_text(), done.stderr
    again = bootstrap(root)  # installed here now: not again
    assert again.returncode == 0 and "installing lightkeeper" not in again.stderr, again.stderr
    assert (root / "pip.log").read_text().count("-e .[dev]") == 1


@pytest.mark.parametrize("old_name", ["lk", "my lk"], ids=["path", "path-with-a-space"])
def test_a_moved_checkout_points_every_script_in_the_venv_here(tmp_path, old_name):
    """``mv ~/lk ~/src/lk``: pip reinstalled only lightkeeper's scripts; pytest, torchrun,
    torchft_lighthouse (nightly's too, its dist-info kept) still named the old python and failed
    to start. For a path with a space pip writes ``#!/bin/sh`` and an ``exec`` line."""
    root = prepared(tmp_path)
    old = tmp_path / "before-the-mv" / old_name  # gone, as after the mv
    venv = real_venv(root, root / ".venv")
    pin = next(line.split("==", 1)[1] for line in
               (root / ".ci/torchft-nightly.txt").read_text().splitlines()
               if line.startswith("torchft-nightly=="))
    (venv / f"torchft-nightly/torchft_nightly-{pin}.dist-info").mkdir(parents=True)
    (venv / "torchft-nightly/bin").mkdir()
    if " " in old_name:
        head = f"#!/bin/sh\n'''exec' \"{old}/.venv/bin/python\" \"$0\" \"$@\"\n' '''\n"
    else:
        head = f"#!{old}/.venv/bin/python\n"
    scripts = [venv / "bin/torchrun", venv / "torchft-nightly/bin/torchft_lighthouse"]
    for script in scripts:
        script.write_text(head + "print('started')\n")
        script.chmod(0o755)
    activate = venv / "bin/activate"
    activate.write_text(activate.read_text().replace(f'"{venv}"', f'"{old}/.venv"'))
    (venv / ".lightkeeper-installed").write_text(f"{old}\n")  # installed before the mv
    done = bootstrap(root)
    assert done.returncode == 0, done.stderr
    for script in scripts:
        ran = subprocess.run([str(script)], capture_output=True, text=True, timeout=10)
        assert (ran.returncode, ran.stdout) == (0, "started\n"), ran.stderr
    assert f"bootstrap: the checkout moved from {old}: 3 scripts in .venv point here now" in \
        done.stderr.splitlines(), done.stderr
    assert f'VIRTUAL_ENV="{root.resolve()}/.venv"' in activate.read_text()
    assert "-e .[dev]" in (root / "pip.log").read_text(), done.stderr  # and lightkeeper itself


def test_a_venv_is_not_cleared_where_the_python_to_rebuild_it_has_no_ensurepip(tmp_path):
    """``venv --clear`` would delete torch and all, then fail the same way at every run: the
    venv is kept, and one line says what to install."""
    root = prepared(tmp_path)
    (root / "stand-in-python").write_text(
        NO_ENSUREPIP_PYTHON.format(root=root, real=sys.executable))
    site = site_packages(venv_without_pip(root / ".venv"))  # `uv venv`, torch in it
    (site / "kept-by-the-user").write_text("")
    debian = no_ensurepip(tmp_path)
    for _ in range(2):  # and so at every run
        done = bootstrap(root, PYTHONPATH=debian)
        assert done.returncode != 0, done.stderr
        assert (site / "kept-by-the-user").exists()
        assert rebuilds(root) == 0, done.stderr
        hint = "python{}.{}-venv".format(*sys.version_info[:2])
        assert done.stderr.splitlines() == [
            f"bootstrap: not rebuilding .venv (it has no pip and its Python no ensurepip "
            f"(python3-venv missing when it was made?)): {root / 'stand-in-python'} has no "
            f"ensurepip, so a new one would have no pip either; install {hint}, or add pip to "
            "it: uv pip install --python .venv/bin/python pip"], done.stderr


@pytest.mark.parametrize("raises", ["raise RuntimeError('broken')", "import not_installed_dep"])
def test_a_venv_whose_pip_fails_to_import_even_after_ensurepip_says_so(tmp_path, raises):
    """Not "no working python": its python runs, its pip is what is broken; ensurepip runs
    first, then its wheel forced, and the venv is rebuilt only when pip still fails to import."""
    root = prepared(tmp_path)
    site = site_packages(venv_without_pip(root / ".venv"))
    stub_pip(root, site)
    (site / "pip/__init__.py").write_text(raises + "\n")
    repairs_nothing = ensurepip(tmp_path, "")
    wheel = bundled_wheel(repairs_nothing, "")
    assert_rebuilt_once(root, f"its pip fails to import, also after ensurepip, then {wheel} "
                              "(.venv/bin/python -c 'import pip' says why)",
                        PYTHONPATH=repairs_nothing)


def test_a_venv_whose_pip_fails_to_import_is_repaired_by_ensurepip(tmp_path):
    """It went straight to ``venv --clear``: ``ensurepip --upgrade`` first, torch and all kept."""
    root = prepared(tmp_path)
    site = site_packages(venv_without_pip(root / ".venv"))
    stub_pip(root, site)
    (site / "pip/__init__.py").write_text("raise RuntimeError('broken')\n")
    (site / "kept-by-the-user").write_text("")
    repairs = ensurepip(tmp_path, (
        "import sys\nfrom pathlib import Path\n"
        f"Path({str(root / 'ensurepip.log')!r}).write_text(' '.join(sys.argv[1:]))\n"
        f"(Path({str(site)!r}) / 'pip/__init__.py').write_text('')\n"))
    done = bootstrap(root, PYTHONPATH=repairs)
    assert done.returncode == 0, done.stderr
    assert "rebuilding" not in done.stderr and rebuilds(root) == 0, done.stderr
    assert "bootstrap: .venv's pip failed to import: reinstalled it with ensurepip" in \
        done.stderr.splitlines()
    assert (root / "ensurepip.log").read_text() == "--upgrade"
    assert (site / "kept-by-the-user").exists()
    assert "-e .[dev]" in (root / "pip.log").read_text(), done.stderr


def test_a_checkout_run_through_a_symlinked_path_is_not_installed_again(tmp_path):
    """The stamp names the checkout's physical path, as the shebangs pip writes do: switching
    between the path and a link to it reinstalls nothing."""
    root = prepared(tmp_path)
    (root / "monitor/analysis/_frpickle.cpython-311-x86_64-linux-gnu.so").write_text("")
    link = tmp_path / "linked"
    link.symlink_to(root)
    for via in (root, link, root, link):
        done = bootstrap(via)
        assert done.returncode == 0, done.stderr
    assert (root / "pip.log").read_text().count("-e .[dev]") == 1


def fake_torch(site: Path, version: str, imported: Path) -> None:
    """A torch distribution of ``version`` whose import leaves ``imported`` behind."""
    (site / "torch").mkdir()
    (site / "torch/__init__.py").write_text(f"open({str(imported)!r}, 'w').close()\n"
                                            f"__version__ = {version!r}\n")
    info = site / f"torch-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")


@pytest.mark.parametrize("version", ["2.13.0+cpu", "2.12.0"])
def test_torchs_version_is_read_without_importing_it(tmp_path, version):
    """``bin/lightkeeper`` runs bootstrap before every command: importing torch there to read its
    version cost seconds a call. The pinned torch is left alone, another one replaced."""
    root = prepared(tmp_path)
    venv = real_venv(root, root / ".venv")
    imported = tmp_path / "torch-imported"
    fake_torch(site_packages(venv), version, imported)
    done = bootstrap(root)
    assert done.returncode == 0, done.stderr
    assert not imported.exists(), "bootstrap imported torch"
    pinned = version.startswith("2.13.0")
    assert ("install -q --disable-pip-version-check torch==2.13.0" in
            (root / "pip.log").read_text().splitlines()) is not pinned, done.stderr
