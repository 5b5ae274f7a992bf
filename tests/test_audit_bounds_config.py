"""The monitor's and the rank's settings at their edges: ``--forget-after`` and secrets with
surrounding whitespace (a secret file's final newline)."""

from __future__ import annotations

import argparse
import json
import logging
from types import SimpleNamespace

import pytest
import requests

from monitor.act.actions import RankCalls
from monitor.cli import add_arguments, config_from_args, warn_about_tokens
from monitor.config import ConfigError, DetectorConfig, MonitorConfig, ProbeConfig
from monitor.evidence.probes import ProbeMesh
from rank_wire import auth
from tests.support.fake_rank import FakeRank
from worker_server.server import registration_token

SECRETS = ("LIGHTKEEPER_TOKEN", "LIGHTKEEPER_REGISTER_TOKEN", "LIGHTKEEPER_EXIT_TOKEN",
           "LIGHTKEEPER_WEBHOOK_SECRET")


@pytest.fixture(autouse=True)
def no_secrets(monkeypatch):
    for name in (*SECRETS, "TORCHFT_LIGHTHOUSE", "LIGHTKEEPER_ETCD"):
        monkeypatch.delenv(name, raising=False)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--state", "/tmp/lk-bounds-config.sqlite", *argv])


@pytest.mark.parametrize("value", ["-5", "0"])
def test_a_forget_after_not_above_zero_is_refused(value):
    with pytest.raises(ConfigError, match="--forget-after must be > 0"):
        config_from_args(parse("--forget-after", value))
    with pytest.raises(ConfigError, match="--forget-after must be > 0"):
        MonitorConfig(forget_after_s=float(value)).validate()


def test_torch_stores_without_a_lighthouse_is_refused():
    """The groups' TCPStore addresses are read from the Lighthouse's status page: without it
    --torch-stores would find no rank and never say why."""
    with pytest.raises(ConfigError, match="--torch-stores needs --lighthouse"):
        config_from_args(parse("--torch-stores", "--targets", "torch+http://127.0.0.1:1"))
    assert config_from_args(parse("--torch-stores", "--lighthouse",
                                  "http://127.0.0.1:1")).torch_stores


def test_a_straggler_window_longer_than_the_rows_ranks_serve_is_refused():
    """40 steps to a window, 32 served and kept: never a window, stragglers never judged."""
    with pytest.raises(ConfigError, match="--straggler-steps must be at most 32"):
        config_from_args(parse("--straggler-steps", "40"))
    assert config_from_args(parse("--straggler-steps", "32")).detectors.straggler_steps == 32


def test_a_forget_after_shorter_than_finding_a_rank_dead_is_warned_of():
    """Forgotten first, a dead self-registered rank is never found ``dead``."""
    short = config_from_args(parse("--forget-after", "2", "--interval", "1", "--dead-sweeps", "3"))
    why = short.forget_after_warning()
    assert why is not None and "--forget-after 2s" in why and "--dead-sweeps 3" in why
    assert MonitorConfig(forget_after_s=3.5, interval_s=1,
                         detectors=DetectorConfig(dead_sweeps=3)).forget_after_warning() is None
    assert MonitorConfig().forget_after_warning() is None  # the defaults: 30 s, 3 x 1 s


def test_the_rank_registers_with_its_token_stripped():
    """A token read from a secret file ends in a newline, which requests refuses as a header
    value (InvalidHeader): no rank ever registered."""
    token = registration_token({"LIGHTKEEPER_REGISTER_TOKEN": "s3cret\n"})
    assert token == "s3cret"
    requests.Request("POST", "http://m:19400/v1/targets",
                     headers={"Authorization": f"Bearer {token}"}).prepare()
    assert registration_token({"LIGHTKEEPER_TOKEN": " adm1n\n"}) == "adm1n"
    assert registration_token({"LIGHTKEEPER_REGISTER_TOKEN": " \n",
                               "LIGHTKEEPER_TOKEN": "adm1n"}) == "adm1n"
    assert registration_token({"LIGHTKEEPER_REGISTER_TOKEN": " \n"}) is None


def test_a_blank_monitor_secret_is_unset(monkeypatch, caplog):
    """A whitespace-only admin token required one nothing can match (the routes strip it):
    registration refused every rank, the admin routes said 401 for 403, and the start-up
    warning said the ranks must hold it."""
    for name in SECRETS:
        monkeypatch.setenv(name, "  \n")
    cfg = config_from_args(parse())
    assert (cfg.token, cfg.register_token, cfg.rank_exit_token,
            cfg.quarantine.webhook_secret) == (None, None, None, None)
    with caplog.at_level(logging.WARNING):
        warn_about_tokens(cfg)
    assert "--token" not in caplog.text
    assert config_from_args(parse("--token", " ")).token is None


def test_each_monitor_secret_is_stripped(monkeypatch):
    monkeypatch.setenv("LIGHTKEEPER_EXIT_TOKEN", "tok\n")
    monkeypatch.setenv("LIGHTKEEPER_WEBHOOK_SECRET", "hm4c\n")
    cfg = config_from_args(parse("--register-token", " reg\n", "--token", "adm\n"))
    assert (cfg.token, cfg.register_token, cfg.rank_exit_token,
            cfg.quarantine.webhook_secret) == ("adm", "reg", "tok", "hm4c")


def test_the_exit_token_the_monitor_sends_is_stripped():
    """With a final newline every exit, abort and probe call failed with InvalidHeader."""
    fake = FakeRank()
    rank = SimpleNamespace(url=fake.url, state={"replica_group": 0, "group_rank": 0})
    calls = RankCalls("tok\n", timeout_s=5, auth="bearer")
    signed = RankCalls("tok\n", timeout_s=5)
    try:
        assert calls.exit(rank, "evicted").sent
        assert calls.abort(rank, "evicted", 1).sent
        assert [p.authorization for p in fake.posts] == ["Bearer tok", "Bearer tok"]
        fake.posts.clear()
        assert signed.exit(rank, "evicted").sent
        body = b'{"reason": "evicted"}'
        assert [p.authorization for p in fake.posts] == [
            auth.header("tok", "POST", "/v1/exit", "0/0/", body)]
    finally:
        calls.close()
        signed.close()
        fake.stop()
    assert RankCalls(" \n").exit(rank, "x").detail == "no --rank-exit-token"
    assert ProbeMesh(ProbeConfig(), " \n").to_json()["enabled"] is False
    assert ProbeMesh(ProbeConfig(), "tok\n").to_json()["enabled"] is True


@pytest.mark.parametrize("names", ["state", "wal", "targets_file"])
def test_an_sd_out_naming_a_file_of_the_monitors_own_is_refused(tmp_path, names):
    """--sd-out's atomic replace would put a JSON list over the audit log (or its WAL), or
    feed the monitor its own output as listed targets, never forgotten."""
    state = tmp_path / "m.sqlite"
    sd_out = {"state": state, "wal": f"{state}-wal", "targets_file": tmp_path / "t.json"}[names]
    argv = ["--state", str(state), "--sd-out", str(sd_out)]
    if names == "targets_file":
        argv += ["--targets-file", str(tmp_path / "." / "t.json")]  # another spelling
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ConfigError, match="--sd-out .* is this monitor's"):
        config_from_args(p.parse_args(argv))


def test_an_sd_out_that_is_not_json_is_never_replaced(tmp_path):
    """--sd-out naming another monitor's audit log (a SQLite file): the monitor refuses to
    start and the file is left as it was."""
    import sqlite3

    from monitor.service import Monitor

    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE decisions (id INTEGER)")
    before = other.read_bytes()
    cfg = MonitorConfig(port=0, state_path=str(tmp_path / "m.sqlite"), sd_out=str(other))
    with pytest.raises(ConfigError, match="not a file_sd JSON file"):
        Monitor(cfg)
    assert other.read_bytes() == before
    # an empty file, or one of zeros (a power loss before an unsynced write): restores nothing
    for name, content in (("empty.json", b""), ("zeros.json", b"\0" * 4096)):
        (tmp_path / name).write_bytes(content)
        mon = Monitor(MonitorConfig(port=0, state_path=str(tmp_path / f"{name}.sqlite"),
                                    sd_out=str(tmp_path / name)))
        mon.stop()


@pytest.mark.parametrize("value", ["", " "])
def test_a_blank_job_is_refused(value):
    """Every rank (of the default job) would be refused, and no series would have a job."""
    with pytest.raises(ConfigError, match="--job: empty"):
        config_from_args(parse("--job", value))


def test_a_float_flag_too_large_to_wait_on_is_refused(capsys):
    """--interval 1e10 passed, then the sweep loop's first timed wait overflowed and ended it
    while /healthz said ok (a stall is said after 10 intervals)."""
    with pytest.raises(SystemExit) as e:
        parse("--interval", "1e10")
    assert e.value.code == 2
    assert "expected a finite number of at most 1e+08, got '1e10'" in capsys.readouterr().err


def test_an_at_file_line_is_taken_without_its_blanks(tmp_path, monkeypatch):
    """A trailing space stayed in the value (a webhook URL posting to /abc%20 at the first
    quarantine, days later), and a last blank line was an unnamed unrecognized argument."""
    monkeypatch.setenv("LIGHTKEEPER_WEBHOOK_SECRET", "whsec")
    args = tmp_path / "monitor.args"
    args.write_text("--action=webhook:https://hooks.example.com/abc \n  --job\n train \n\n\n")
    cfg = config_from_args(parse(f"@{args}"))
    assert cfg.quarantine.actions == ("webhook:https://hooks.example.com/abc",)
    assert cfg.job == "train"


def test_a_targets_file_moved_away_and_back_unchanged_is_read_again(tmp_path):
    """mv keeps its mtime and size: the signature matched the last good read, so the file was
    said missing for good."""
    import os

    from monitor.poll.discovery import Discovery

    path = tmp_path / "t.json"
    path.write_text(json.dumps([{"targets": ["127.0.0.1:9001"]}]))
    d = Discovery(targets_file=str(path))
    assert d.refresh() is None
    os.rename(path, f"{path}.bak")
    assert "does not exist" in d.refresh()
    os.rename(f"{path}.bak", path)
    assert d.refresh() is None and [t.url for t in d.targets()] == ["http://127.0.0.1:9001"]
