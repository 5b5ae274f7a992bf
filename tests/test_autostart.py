"""The import hook behind ``lightkeeper run`` (worker_server/autostart.py), without torch.

The hook's mechanics are checked in fresh interpreters (the hook runs at interpreter start):
the ``torchft`` they import is a stand-in package written by the test, because what is checked
here is when and how ``torchft.manager.Manager.__init__`` gets wrapped, which must not need
torch; the real torchft under ``lightkeeper run`` is tests/test_autostart_e2e.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from lightkeeper import run as lk_run
from worker_server import RankIdentity, RankState, WorkerServer, autostart

SITE = str(autostart.SITE_DIR)

FAKE_MANAGER = textwrap.dedent('''
    class Manager:
        """stand-in for torchft.manager.Manager"""
        def __init__(self, pg=None, *, replica_id=None, lighthouse_addr=None):
            self._replica_id = replica_id
            self.built = True
''')

PROBE = textwrap.dedent('''
    import json, sys
    from worker_server import autostart
    out = {"hooked_at_start": any(isinstance(f, autostart.ManagerFinder) for f in sys.meta_path),
           "torchft_at_start": "torchft" in sys.modules}
    import torchft.manager
    m = torchft.manager.Manager(replica_id="job_3")
    out["wrapped"] = getattr(torchft.manager.Manager.__init__, "_lightkeeper_autostart_wrapped",
                             False)
    out["built"] = m.built
    out["server_module"] = "worker_server.server" in sys.modules
    print(json.dumps(out))
''')


def run_python(tmp_path, code: str, env: dict[str, str], pythonpath: list[str]):
    full = {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", autostart.ENV_AUTOSTART, "LIGHTKEEPER_MONITOR")}
    full.update(env, PYTHONPATH=os.pathsep.join(pythonpath))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, cwd=tmp_path, timeout=60)


@pytest.fixture
def fake_torchft(tmp_path):
    pkg = tmp_path / "fakes" / "torchft"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "manager.py").write_text(FAKE_MANAGER)
    return str(tmp_path / "fakes")


def test_hook_wraps_the_manager_only_once_torchft_is_imported_and_never_breaks_it(
        tmp_path, fake_torchft):
    res = run_python(tmp_path, PROBE, {autostart.ENV_AUTOSTART: "1"}, [SITE, fake_torchft])
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out == {"hooked_at_start": True, "torchft_at_start": False, "wrapped": True,
                   "built": True, "server_module": True}
    # The stand-in has none of a Manager's internals: one line says what is not instrumented,
    # no exception, and the rest is served (the usual line with the WorkerServer's address).
    lines = [line for line in res.stderr.splitlines() if line.startswith("[lightkeeper]")]
    assert len(lines) == 2, res.stderr
    assert lines[0].startswith("[lightkeeper] WorkerServer: cannot instrument "), res.stderr
    assert "training goes on" in lines[0] and "worker_server=http://" in lines[1], res.stderr


def test_hook_is_off_without_lightkeeper_autostart(tmp_path, fake_torchft):
    res = run_python(tmp_path, PROBE, {autostart.ENV_AUTOSTART: "0"}, [SITE, fake_torchft])
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert (out["hooked_at_start"], out["wrapped"], out["server_module"]) == (False, False, False)
    assert "[lightkeeper]" not in res.stderr


def test_the_environments_own_sitecustomize_still_runs(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import builtins\nbuiltins.THEIRS = 'ran'\n")
    res = run_python(tmp_path, "import builtins; print(getattr(builtins, 'THEIRS', 'missing'))",
                     {autostart.ENV_AUTOSTART: "1"}, [SITE, str(theirs)])
    assert (res.returncode, res.stdout.strip(), res.stderr) == (0, "ran", "")


def test_a_failing_sitecustomize_of_the_environment_is_one_line(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("raise RuntimeError('broken site')\n")
    res = run_python(tmp_path, "print('job ran')", {autostart.ENV_AUTOSTART: "1"},
                     [SITE, str(theirs)])
    assert res.returncode == 0 and res.stdout.strip() == "job ran"
    assert res.stderr.count("\n") == 1 and "RuntimeError: broken site" in res.stderr


def test_pth_file_installs_the_hook_only_with_the_variable(tmp_path, fake_torchft):
    """The .pth a wheel install puts in site-packages, processed as Python's site module does."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "lightkeeper-autostart.pth").write_text(
        (autostart.SITE_DIR / "lightkeeper-autostart.pth").read_text())
    code = (f"import site, sys; site.addsitedir({str(site_dir)!r}); "
            "from worker_server import autostart; "
            "print(any(isinstance(f, autostart.ManagerFinder) for f in sys.meta_path))")
    root = str(autostart.SITE_DIR.parents[1])
    for value, hooked in (("1", "True"), ("", "False")):
        res = run_python(tmp_path, code, {autostart.ENV_AUTOSTART: value}, [root])
        assert (res.returncode, res.stdout.strip(), res.stderr) == (0, hooked, ""), value


def test_pth_file_arms_planned_stops_as_lightkeeper_run_does(tmp_path):
    """With LIGHTKEEPER_PLANNED_STOPS=1 (the Kubernetes templates set it) the .pth route arms
    the SIGTERM watcher in a rank, as sitecustomize does: SIGTERM is blocked in the main thread
    and watch_sigterm() says it is armed (None), though another thread now runs."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "lightkeeper-autostart.pth").write_text(
        (autostart.SITE_DIR / "lightkeeper-autostart.pth").read_text())
    code = (f"import site, signal; site.addsitedir({str(site_dir)!r}); "
            "from worker_server.stop_signal import watch_sigterm; "
            "print(signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []), "
            "watch_sigterm())")
    root = str(autostart.SITE_DIR.parents[1])
    env = {autostart.ENV_AUTOSTART: "1", "LIGHTKEEPER_PLANNED_STOPS": "1", "RANK": "0"}
    res = run_python(tmp_path, code, env, [root])
    assert (res.returncode, res.stdout.strip(), res.stderr) == (0, "True None", "")


def test_identity_from_the_environment_and_the_managers_replica_id(capfd):
    m = SimpleNamespace(_replica_id="torchtitan_ft_12")
    assert autostart.replica_group_of(m, {"REPLICA_GROUP_ID": "4"}) == (4, "REPLICA_GROUP_ID")
    assert autostart.replica_group_of(m, {}) == (12, "replica_id")
    assert capfd.readouterr().err == ""
    for bad in ("x", "-3", "1.0"):  # said, not a silent fallback or a negative group
        assert autostart.replica_group_of(m, {"REPLICA_GROUP_ID": bad}) == (12, "replica_id")
        assert capfd.readouterr().err == (f"[lightkeeper] REPLICA_GROUP_ID={bad!r} is not a "
                                          "replica group (an integer >= 0): ignored\n")
    assert autostart.replica_group_of(SimpleNamespace(_replica_id=None), {}) == (0, "default")
    assert autostart.worker_port({"LIGHTKEEPER_WORKER_PORT": "9500", "LOCAL_RANK": "3"}) == 9503
    assert autostart.worker_port({"LOCAL_RANK": "3"}) == 0
    with pytest.raises(ValueError, match="LOCAL_RANK='x' is not an integer"):
        autostart.worker_port({"LIGHTKEEPER_WORKER_PORT": "9500", "LOCAL_RANK": "x"})


def test_an_explicit_worker_server_keeps_the_manager(monkeypatch):
    """The two-line API called before the Manager exists wins: the hook starts nothing."""
    monkeypatch.setattr(autostart, "_server", None)
    explicit = WorkerServer(RankState(RankIdentity())).serve()
    try:
        manager = SimpleNamespace(_replica_id="g_1", _group_rank=0, _group_world_size=1)
        assert autostart.on_manager(manager) is None
        assert not hasattr(manager, "_lightkeeper_server")
    finally:
        explicit.stop()


def test_explicit_start_after_the_hook_returns_the_hooks_server():
    hooked = SimpleNamespace(url="http://127.0.0.1:1")
    assert WorkerServer.start(SimpleNamespace(_lightkeeper_server=hooked)) is hooked


def test_run_environment_and_errors(capsys, monkeypatch):
    parser = __import__("argparse").ArgumentParser()
    lk_run.add_arguments(parser)
    args = parser.parse_args(["--monitor", "http://m:19400", "--worker-port", "9500", "--print-env"])
    monkeypatch.setenv("PYTHONPATH", "/theirs")
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")
    assert lk_run.run(args) == 0
    printed = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert printed == {"LIGHTKEEPER_AUTOSTART": "1", "PYTHONPATH": SITE + os.pathsep + "/theirs",
                       "LIGHTKEEPER_MONITOR": "http://m:19400", "LIGHTKEEPER_WORKER_PORT": "9500"}
    assert lk_run.run(parser.parse_args([])) == 2
    assert "no command" in capsys.readouterr().err
    assert lk_run.run(parser.parse_args(["--", "no-such-command-lk"])) == 127
    assert "no-such-command-lk: command not found" in capsys.readouterr().err
    assert lk_run.run(parser.parse_args(["--worker-port", "70000", "--", "true"])) == 2


@pytest.mark.parametrize("argv, env, said", [
    (["--monitor", "notaurl"], None, "--monitor 'notaurl' is not an http(s)://host:port URL"),
    (["--monitor", "http://m:1,ftp://m"], None, "--monitor 'ftp://m' is not"),
    (["--monitor", "http://m:99999"], None, "--monitor 'http://m:99999' is not"),
    ([], "m:19400", "LIGHTKEEPER_MONITOR 'm:19400' is not"),
])
def test_run_refuses_a_monitor_it_could_not_register_with(capsys, monkeypatch, argv, env, said):
    parser = __import__("argparse").ArgumentParser()
    lk_run.add_arguments(parser)
    if env is None:
        monkeypatch.delenv("LIGHTKEEPER_MONITOR", raising=False)
    else:
        monkeypatch.setenv("LIGHTKEEPER_MONITOR", env)
    assert lk_run.run(parser.parse_args([*argv, "--", "no-such-command-lk"])) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lightkeeper run: {said}") and err.count("\n") == 1, err
    monkeypatch.setenv("LIGHTKEEPER_MONITOR", "http://m:19400,https://m2")
    args = parser.parse_args(["--print-env"])
    assert lk_run.run(args) == 0


def test_run_says_126_for_a_path_it_cannot_execute(tmp_path, capsys):
    """As a shell: an existing file that is not executable, or a directory, is 126 with the
    reason; only a name found nowhere is 127 'command not found'."""
    parser = __import__("argparse").ArgumentParser()
    lk_run.add_arguments(parser)
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\necho hi\n")  # mode 644
    for path, reason in ((str(script), "Permission denied"), (str(tmp_path), "denied")):
        assert lk_run.run(parser.parse_args(["--", path])) == 126, path
        err = capsys.readouterr().err
        assert f"lightkeeper run: {path}: " in err and reason in err, err
    assert lk_run.run(parser.parse_args(["--", str(tmp_path / "nope.sh")])) == 127


def test_a_python_without_worker_server_says_so_only_where_torchft_is_used(tmp_path,
                                                                          fake_torchft):
    """Under ``lightkeeper run`` every Python process the job starts loads the hook; one whose
    Python lacks lightkeeper[worker] says so in one line only once it imports torchft (a
    system python or a tool the job runs has nothing to serve)."""
    broken = tmp_path / "broken" / "worker_server"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('not installed here')\n")
    path = [SITE, str(tmp_path / "broken"), fake_torchft]
    env = {autostart.ENV_AUTOSTART: "1"}
    res = run_python(tmp_path, "print('tool ran')", env, path)
    assert (res.returncode, res.stdout.strip(), res.stderr) == (0, "tool ran", "")
    res = run_python(tmp_path, "import torchft.manager; import torchft.manager; print('job ran')",
                     env, path)
    assert res.returncode == 0 and res.stdout.strip() == "job ran"
    assert res.stderr.count("\n") == 1 and "cannot import worker_server" in res.stderr, \
        res.stderr
