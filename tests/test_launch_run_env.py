"""``lightkeeper run``'s environment and checks against what the ranks do with it: the job's
``PYTHONPATH`` kept entry for entry (an empty one is the current directory), a monitor list
with a blank entry accepted as the ranks accept it, and one of blanks alone refused, as the ranks
say it (docs/run.md)."""

from __future__ import annotations

import argparse
import os

from http_serving.urls import redact_entry
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
    assert lk_run.bad_monitor_url(None, ",m1:19400") == \
        "LIGHTKEEPER_MONITOR 'm1:19400' is not an http(s)://host:port URL"
    monkeypatch.setenv("LIGHTKEEPER_MONITOR", "http://m1:19400,")
    assert lk_run.run(_args("--print-env")) == 0
    assert "LIGHTKEEPER_AUTOSTART=1" in capsys.readouterr().out.splitlines()


def test_a_monitor_url_without_a_port_is_refused_as_the_ranks_leave_it_out(capsys):
    """``--monitor http://mon`` was run, and every rank registered with ``mon:80`` (the monitor
    is on 19400): run.md says a URL that is not http(s)://host:port is refused with status 2.
    Only https may leave the port out."""
    for url in ("http://mon", "http://mon/v1", "http://u:pw@mon"):
        assert lk_run.run(_args("--monitor", url, "--print-env")) == 2
        assert capsys.readouterr().err == \
            f"lightkeeper run: --monitor {redact_entry(url)!r} is not an http(s)://host:port URL\n"
        assert monitor_urls(None, {"LIGHTKEEPER_MONITOR": f"{url},http://m1:19400"}) == \
            ["http://m1:19400"]
        assert "not an http(s)://host:port URL" in capsys.readouterr().err
    # https may leave it out: 443, a monitor behind a TLS ingress (worker_server.md)
    assert lk_run.bad_monitor_url("https://mon,https://m:8443,http://[::1]:19400/", None) is None
    assert lk_run.bad_monitor_url("HTTPS://mon,Https://mon.example/lk", None) is None
    assert monitor_urls(None, {"LIGHTKEEPER_MONITOR": "https://mon"}) == ["https://mon"]


def test_a_monitor_list_of_blanks_alone_is_refused_and_said_on_a_rank(capsys, monkeypatch):
    """``--monitor "$A,$B"`` with both unset, or ``LIGHTKEEPER_MONITOR=" , "``, was taken for no
    monitor: every rank trained unmonitored and nothing said so. Unset or empty stays none."""
    monkeypatch.delenv("LIGHTKEEPER_MONITOR", raising=False)
    assert lk_run.run(_args("--monitor", ",", "--print-env")) == 2
    assert capsys.readouterr().err == "lightkeeper run: --monitor ',' names no monitor URL\n"
    monkeypatch.setenv("LIGHTKEEPER_MONITOR", " , ")
    assert lk_run.run(_args("--print-env")) == 2
    assert capsys.readouterr().err == \
        "lightkeeper run: LIGHTKEEPER_MONITOR ' , ' names no monitor URL\n"
    # a rank keeps training, registered with none, and says so in one line
    assert monitor_urls(None, {"LIGHTKEEPER_MONITOR": " , "}) == []
    assert capsys.readouterr().err == \
        "[lightkeeper] LIGHTKEEPER_MONITOR ' , ' names no monitor URL; this rank is registered " \
        "with none\n"
    for unset in ("", " "):
        assert lk_run.bad_monitor_url(unset, None) is None
        assert monitor_urls(None, {"LIGHTKEEPER_MONITOR": unset}) == []
    assert capsys.readouterr().err == ""
