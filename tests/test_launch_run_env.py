"""``lightkeeper run``'s environment and checks against what the ranks do with it: the job's
``PYTHONPATH`` kept entry for entry (an empty one is the current directory), and a monitor list
with a blank entry accepted as the ranks accept it (docs/run.md)."""

from __future__ import annotations

import argparse
import os

from lightkeeper import run as lk_run
from worker_server.autostart import SITE_DIR
from worker_server.server import monitor_urls

SITE = str(SITE_DIR)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    lk_run.add_arguments(parser)
    return parser.parse_args([*argv, "--", "true"])


def test_an_empty_pythonpath_entry_the_current_directory_is_kept():
    """It was dropped: a job importing a package from its cwd (``export
    PYTHONPATH=$PYTHONPATH:/opt/x`` while unset gives ":/opt/x") died of ModuleNotFoundError."""
    sep = os.pathsep
    for theirs, ours in ((f"{sep}/opt/x", f"{SITE}{sep}{sep}/opt/x"),
                         (f"/opt/x{sep}", f"{SITE}{sep}/opt/x{sep}"),
                         (f"/opt/x{sep}{SITE}", f"{SITE}{sep}/opt/x"),
                         (SITE, SITE)):
        assert lk_run.hook_env(_args(), {"PYTHONPATH": theirs})["PYTHONPATH"] == ours, theirs


def test_no_pythonpath_gives_the_hook_directory_alone():
    # a trailing separator would add the current directory the job never had on its path
    assert lk_run.hook_env(_args(), {})["PYTHONPATH"] == SITE
    assert lk_run.hook_env(_args(), {"PYTHONPATH": ""})["PYTHONPATH"] == SITE


def test_a_blank_monitor_entry_is_skipped_as_the_ranks_skip_it(capsys, monkeypatch):
    """A trailing comma exited 2 ("LIGHTKEEPER_MONITOR '' is not an http(s)://host:port URL")
    though every rank registers with the monitors the other entries name."""
    value = "http://m1:19400, ,"
    assert monitor_urls(None, {"LIGHTKEEPER_MONITOR": value}) == ["http://m1:19400"]
    assert lk_run.bad_monitor_url(None, "http://m1:19400,") is None
    assert lk_run.bad_monitor_url(value, None) is None
    assert lk_run.bad_monitor_url(None, ",") is None  # all blank: as if unset, as the ranks do
    assert lk_run.bad_monitor_url(None, ",m1:19400") == \
        "LIGHTKEEPER_MONITOR 'm1:19400' is not an http(s)://host:port URL"
    monkeypatch.setenv("LIGHTKEEPER_MONITOR", "http://m1:19400,")
    assert lk_run.run(_args("--print-env")) == 0
    assert "LIGHTKEEPER_AUTOSTART=1" in capsys.readouterr().out.splitlines()
