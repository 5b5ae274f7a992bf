"""Secrets off the command line and out of what the CLI prints, and no raw terminal control
characters from a dump in ``lightkeeper analyze``'s text.

A flag's value is on the process's command line, which every user of the host reads (``ps``,
``/proc/PID/cmdline``): each secret is also read from its variable, the flag still works and
says so in one line. ``lightkeeper run --print-env`` writes a container spec, which is shared
and kept: it never holds the registration token."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightkeeper import run as lk_run
from lightkeeper.cli import main
from tests.support.frgen import FRJob, write_dumps

REPO = Path(__file__).resolve().parents[1]
SECRET = "s3cr3t-4e9a"


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    lk_run.add_arguments(p)
    return p


def test_print_env_never_prints_the_registration_token(capsys):
    args = run_parser().parse_args(["--monitor", "http://m:19400", "--register-token", SECRET,
                                    "--print-env"])
    assert lk_run.run(args) == 0
    out, err = capsys.readouterr()
    assert SECRET not in out + err and "LIGHTKEEPER_REGISTER_TOKEN=" not in out
    assert "LIGHTKEEPER_MONITOR=http://m:19400" in out.splitlines()
    assert err.count("\n") == 1 and "LIGHTKEEPER_REGISTER_TOKEN not printed" in err
    assert "secretKeyRef" in err
    # a monitor URL's password is a secret too
    args = run_parser().parse_args(["--monitor", f"http://lk:{SECRET}@m:19400", "--print-env"])
    assert lk_run.run(args) == 0
    out, err = capsys.readouterr()
    assert SECRET not in out + err and "LIGHTKEEPER_MONITOR=" not in out
    assert err.count("\n") == 1 and "LIGHTKEEPER_MONITOR not printed" in err


@pytest.mark.parametrize("how", ["flag", "env"])
def test_run_hands_the_token_on_from_a_flag_with_one_line_or_from_its_variable(how):
    """The command gets the token either way; only the flag, on the command line, is said."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTKEEPER_")}
    flag = ["--register-token", SECRET] if how == "flag" else []
    if how == "env":
        env["LIGHTKEEPER_REGISTER_TOKEN"] = SECRET
    res = subprocess.run([sys.executable, "-m", "lightkeeper.cli", "run", *flag, "--", "/bin/sh",
                          "-c", 'printf %s "$LIGHTKEEPER_REGISTER_TOKEN"'], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stdout) == (0, SECRET), res.stderr
    said = [ln for ln in res.stderr.splitlines() if "--register-token" in ln]
    if how == "flag":
        assert len(said) == 1 and "every user of this host can read it (ps)" in said[0], said
        assert "set LIGHTKEEPER_REGISTER_TOKEN instead" in said[0], res.stderr
    else:
        assert said == [], res.stderr
    assert SECRET not in res.stderr


def test_monitor_secret_flags_work_and_each_says_its_variable(monkeypatch, caplog):
    from monitor.cli import add_arguments, config_from_args

    for name in ("LIGHTKEEPER_TOKEN", "LIGHTKEEPER_REGISTER_TOKEN", "LIGHTKEEPER_EXIT_TOKEN",
                 "LIGHTKEEPER_WEBHOOK_SECRET"):
        monkeypatch.delenv(name, raising=False)
    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = ["--port", "0", "--token", "adm-" + SECRET, "--rank-exit-token=exit-" + SECRET]
    monkeypatch.setattr(sys, "argv", ["lightkeeper", "monitor", *argv])  # what ps shows
    with caplog.at_level("WARNING", logger="monitor.cli"):
        cfg = config_from_args(p.parse_args(argv))
    assert (cfg.token, cfg.rank_exit_token) == ("adm-" + SECRET, "exit-" + SECRET)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("command line" in m and "(ps)" in m for m in said), said
    assert "set LIGHTKEEPER_TOKEN instead" in said[0]
    assert "set LIGHTKEEPER_EXIT_TOKEN instead" in said[1]
    assert not any(SECRET in m for m in said)
    caplog.clear()
    monkeypatch.setenv("LIGHTKEEPER_TOKEN", "adm-" + SECRET)
    with caplog.at_level("WARNING", logger="monitor.cli"):
        assert config_from_args(p.parse_args(["--port", "0"])).token == "adm-" + SECRET
    assert caplog.records == []


def test_analyze_text_shows_a_dumps_control_characters_escaped(tmp_path, capsys):
    """A process group or collective name with a terminal escape (retitle the window, clear the
    screen) or a newline (a forged line) is printed as its escape; JSON is json's own."""
    pg, op = "0\x1b]0;pwned\x07\x1b[2J\n[hang] forged", "all_reduce\x1b[31m\u202e"
    job = FRJob(4)
    job.group(pg, [0, 1, 2, 3])
    job.repeat(4, [(pg, op, [[8]])])
    job.collective(pg, op, [[8]], absent=[2])
    write_dumps(job.dumps(), tmp_path, fmt="json")
    assert main(["analyze", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert all(line.isprintable() for line in out.splitlines()), out
    assert "\\x1b]0;pwned\\x07\\x1b[2J\\n[hang] forged" in out and "all_reduce\\x1b[31m\\u202e" in out
    assert not any(line.startswith("[hang] forged") for line in out.splitlines())
    assert main(["analyze", "--format", "json", str(tmp_path)]) == 1
    (finding,) = json.loads(capsys.readouterr().out)["findings"]
    assert (finding["pg"], finding["op"]) == (pg, op)


def test_monitor_reads_flags_holding_a_secret_from_an_at_file(tmp_path, monkeypatch):
    """A webhook URL (its path is the secret), a hook's arguments or a URL's password have no
    variable of their own: ``lightkeeper monitor @FILE`` reads flags from a file, one a line."""
    from monitor.cli import add_arguments, config_from_args

    url = f"https://hooks.example.com/services/T0/{SECRET}"
    args = tmp_path / "monitor.args"
    args.write_text(f"--action=webhook:{url}\n--lighthouse\nhttp://lh:{SECRET}@lh:29510\n")
    monkeypatch.setenv("LIGHTKEEPER_WEBHOOK_SECRET", "whsec")
    top = argparse.ArgumentParser(prog="lightkeeper")  # as lightkeeper.cli builds it
    add_arguments(top.add_subparsers(dest="command").add_parser("monitor"))
    cfg = config_from_args(top.parse_args(["monitor", f"@{args}", "--port", "0"]))
    assert cfg.quarantine.actions == (f"webhook:{url}",)
    assert cfg.lighthouse == f"http://lh:{SECRET}@lh:29510" and cfg.port == 0


def test_a_kill_refused_for_its_url_shows_the_lighthouse_url_without_its_password():
    """requests' InvalidURL says the whole URL; the kill's outcome goes to the audit rows."""
    from monitor.act.actions import Lighthouse

    lh = Lighthouse(f"http://lk:{SECRET}@lh host:29510")  # is_http_url takes it; requests not
    out = lh.kill("replica_group_0:x")
    lh.close()
    assert not out.sent and SECRET not in out.detail, out
    assert "InvalidURL" in out.detail and "http://lk:***@lh host:29510" in out.detail, out
    # a host label over 63 characters: urllib3 raises a ValueError, not requests' own error
    lh = Lighthouse(f"http://lk:{SECRET}@{'a' * 64}.example:29510")
    out = lh.kill("replica_group_0:x")
    lh.close()
    assert not out.sent and SECRET not in out.detail and "LocationParseError" in out.detail, out


def test_a_url_password_on_the_monitors_command_line_is_said_not_one_from_an_at_file(
        tmp_path, monkeypatch, caplog):
    """--lighthouse and --etcd take a URL whose password is a secret: on the command line it is
    said, with the variable to use; from an @FILE (docs/monitor.md) or a variable it is not, nor
    is a token from an @FILE."""
    from monitor.cli import add_arguments, config_from_args

    top = argparse.ArgumentParser(prog="lightkeeper")
    add_arguments(top.add_subparsers(dest="command").add_parser("monitor"))
    lh, etcd = f"http://lk:{SECRET}@lh:29510", f"http://lk:{SECRET}@etcd:2379"
    (tmp_path / "args").write_text(f"--lighthouse={lh}\n--etcd\n{etcd}\n--token={SECRET}\n")
    said = {}
    for case, argv in (("flags", [f"--lighthouse={lh}", "--etcd", etcd]),
                       ("@FILE", [f"@{tmp_path / 'args'}"]),
                       ("no password", ["--lighthouse", "http://lh:29510", "--etcd", "http://e:1"])):
        argv = ["monitor", "--port", "0", "--shard", "0/1", *argv]
        monkeypatch.setattr(sys, "argv", ["lightkeeper", *argv])  # what ps shows
        caplog.clear()
        with caplog.at_level("WARNING", logger="monitor.cli"):
            assert config_from_args(top.parse_args(argv)).lighthouse
        said[case] = [r.getMessage() for r in caplog.records]
    assert said["flags"] == [
        "--lighthouse's password on the command line: every user of this host can read it (ps); "
        "set TORCHFT_LIGHTHOUSE instead",
        "--etcd's password on the command line: every user of this host can read it (ps); "
        "set LIGHTKEEPER_ETCD instead"], said
    assert said["@FILE"] == said["no password"] == [], said


@pytest.mark.parametrize("how", ["flag", "env"])
def test_grafana_url_password_on_the_command_line_is_said_and_never_shown(how, monkeypatch,
                                                                          capsys):
    port = 1  # nothing listens on port 1: the upload is refused at once
    url = f"http://admin:{SECRET}@127.0.0.1:{port}"
    argv = ["dashboards", "upload", "--timeout", "2"] + (["--grafana-url", url] if how == "flag"
                                                         else [])
    monkeypatch.setenv("GRAFANA_TOKEN", "glsa_" + SECRET)
    monkeypatch.delenv("GRAFANA_URL", raising=False)
    if how == "env":
        monkeypatch.setenv("GRAFANA_URL", url)
    monkeypatch.setattr(sys, "argv", ["lightkeeper", *argv])  # what ps shows
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert SECRET not in out + err and f"http://***@127.0.0.1:{port}" in err, err
    said = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert said == (["warning: --grafana-url's password on the command line: every user of this "
                     "host can read it (ps); set GRAFANA_URL instead"] if how == "flag" else [])


def test_a_token_given_as_a_urls_user_name_is_not_shown():
    from http_serving.urls import redact_url

    assert redact_url("GET https://ghp_SECRET@lh:29510/status: refused") == \
        "GET https://***@lh:29510/status: refused"
    assert redact_url("http://u:SECRET@h:1 and http://h:2/x") == "http://u:***@h:1 and http://h:2/x"


def test_a_query_parameter_named_for_a_secret_is_not_shown():
    from http_serving.urls import redact_url

    assert redact_url("http://h:1/?token=SECRET&page=2") == "http://h:1/?token=***&page=2"
    assert redact_url("cannot reach https://lh/x?a=1&API_Key=SECRET#f") == \
        "cannot reach https://lh/x?a=1&API_Key=***#f"
    assert redact_url("http://h:9/?page=2&replica=1") == "http://h:9/?page=2&replica=1"


def test_a_registration_refused_for_its_query_does_not_repeat_the_token_in_it(tmp_path):
    """A rank registering ``http://host:port/?token=...`` is refused (a target has no query);
    the refusal, which the monitor logs and answers, does not hold the token."""
    from monitor.poll.discovery import BadTarget, normalize_url

    with pytest.raises(BadTarget) as e:
        normalize_url(f"http://10.0.0.1:9500/?token={SECRET}")
    assert SECRET not in str(e.value) and "token=***" in str(e.value), e.value
    with pytest.raises(BadTarget) as e:
        normalize_url(f"torch+https://u:{SECRET}@h:1")
    assert SECRET not in str(e.value), e.value


def test_the_monitors_log_escapes_and_indents_a_tracebacks_lines():
    """An exception whose text a rank supplied (a newline that forges a log line, a terminal
    escape): every line of the logged traceback is printable and indented, so none reads as a
    line of the monitor's log."""
    import io
    import logging

    from monitor.cli import log_formatter

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(log_formatter())
    log = logging.getLogger("test.escapes")
    log.addHandler(handler)
    log.propagate = False
    try:
        try:
            raise ValueError("bad\x1b[2J\n2026-01-01T00:00:00.000Z monitor ERROR forged")
        except ValueError:
            log.exception("a rank's answer failed", stack_info=True)
    finally:
        log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("ERROR a rank's answer failed") and len(lines) > 3, lines
    assert all(ln.isprintable() for ln in lines), lines
    assert all(ln.startswith("    ") for ln in lines[1:]), lines
    assert any("bad\\x1b[2J" in ln for ln in lines), lines
