"""As root, ``--report-dir`` under a directory someone else may change is refused: its owner (or
anyone who may write in it) could move the report directory away and put their own, or a link,
in its place, and root's spare hosts run what they read there. Under sudo the invoking user's
own directories are fine (``sudo bin/lightkeeper demo --report-dir ~/x``).

In-process, with tests/test_demo_refusals.py's stand-ins: nothing is started."""

from __future__ import annotations

import os

import pytest

from lightkeeper import demo as demo_mod
from tests import test_demo_refusals
from tests.support.demo import demo_args

cli = test_demo_refusals.cli
_scenario = test_demo_refusals._scenario
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the check is root's")
NOBODY = 65534


@pytest.fixture(autouse=True)
def _no_sudo(monkeypatch):
    monkeypatch.delenv("SUDO_UID", raising=False)


def _theirs(path):
    path.mkdir(mode=0o755)
    os.chown(path, NOBODY, NOBODY)
    return path


def _refused(target, capsys) -> str:
    code = demo_mod.run(demo_args("--no-faults", "--hosts", "loopback", "--report-dir", str(target)))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"lightkeeper demo: --report-dir {target}: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize("below", ["run1", "a/run1"])
def test_a_report_dir_under_another_users_directory_is_refused(cli, tmp_path, capsys, below):
    alice = _theirs(tmp_path / "alice")
    err = _refused(alice / below, capsys)
    assert f"{alice} is owned by another user (uid {NOBODY})" in err, err
    assert not os.listdir(alice) and cli.built == 0


def test_a_report_dir_under_a_directory_others_may_write_in_needs_its_sticky_bit(cli, tmp_path,
                                                                                 capsys):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    err = _refused(shared / "run1", capsys)
    assert f"{shared} may be written in by group or others (and has no sticky bit)" in err, err
    assert not os.listdir(shared)
    shared.chmod(0o1777)  # as /tmp: no one else can move root's entry in it
    _scenario("--no-faults", "--hosts", "loopback", "--report-dir", str(shared / "run1"))
    st = (shared / "run1").stat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o700)


def test_under_sudo_the_invoking_users_directory_is_fine(cli, tmp_path, monkeypatch):
    home = _theirs(tmp_path / "home")
    monkeypatch.setenv("SUDO_UID", str(NOBODY))
    _scenario("--no-faults", "--hosts", "loopback", "--report-dir", str(home / "x"))
    st = (home / "x").stat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o700)


@pytest.mark.parametrize("swap", ["theirs", "link"])
def test_a_parent_made_by_someone_else_after_the_check_is_refused(cli, monkeypatch, tmp_path,
                                                                  capsys, swap):
    parent = tmp_path / "p"
    target = parent / "report"

    def appears():  # between the check (it did not exist) and the demo creating it
        if swap == "link":
            parent.symlink_to(_theirs(tmp_path / "theirs"))
        else:
            _theirs(parent)
        return os.open(os.devnull, os.O_RDONLY)

    monkeypatch.setattr(demo_mod, "acquire_lock", appears)
    err = _refused(target, capsys)
    said = "is no directory (a link?)" if swap == "link" else f"is owned by another user " \
        f"(uid {NOBODY})"
    assert f"{parent} {said}" in err, err
    assert not os.listdir(parent)  # nothing made in it
