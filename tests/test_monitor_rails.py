"""Safety rails, the audit log and discovery: each rail holds for its reason, and only then."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from monitor.act.decisions import Situation, blind_reason, decide
from monitor.config import ConfigError, MonitorConfig, RailsConfig
from monitor.poll.discovery import BadTarget, Discovery, normalize_url
from monitor.store import Store

RID = "replica_group_1:abc"


def situation(**kw):
    base = dict(now=1000.0, groups_in_quorum={0, 1, 2},
                evicted_replica_ids=set(), last_eviction_at=None)
    return Situation(**{**base, **kw})


def test_evicts_when_every_rail_is_clear():
    d = decide("hang", 1, RID, situation(), RailsConfig(min_replicas=2))
    assert d.evict and d.reason == "evict"


@pytest.mark.parametrize("kw,rails,reason", [
    ({}, dict(evict_kinds=("hang",)), "kind_not_evicted"),
    (dict(evicted_replica_ids={RID}), {}, "already_evicted"),
    ({}, dict(dry_run=True), "dry_run"),
    (dict(blind_reason="the monitor reaches only 50% of the ranks it knows"), {},
     "monitor_blind"),
    (dict(groups_in_quorum={1, 2}), dict(min_replicas=2), "min_replicas"),
    (dict(quarantine_held="evicted off h2 already", last_eviction_at=990.0),
     dict(cooldown_s=30), "quarantine_held"),
    (dict(last_eviction_at=990.0), dict(cooldown_s=30), "cooldown"),
])
def test_each_rail_holds(kw, rails, reason):
    d = decide("straggler", 1, RID, situation(**kw), RailsConfig(**rails))
    assert not d.evict
    assert d.reason == reason
    assert d.detail


def test_blind_when_ranks_cannot_be_verified():
    s = situation(blind_reason="ranks cannot be verified: Lighthouse unreachable")
    d = decide("hang", 1, RID, s, RailsConfig())
    assert (d.reason, d.detail) == ("monitor_blind",
                                    "ranks cannot be verified: Lighthouse unreachable")
    # the rails before it still come first; a person asking is not held by it
    assert decide("hang", 1, RID, s, RailsConfig(dry_run=True)).reason == "dry_run"
    assert decide("manual", 1, RID, s, RailsConfig(), manual=True).evict


def test_blind_when_it_reaches_no_more_than_min_reachable():
    rails = RailsConfig(min_reachable_fraction=0.5)
    assert blind_reason(None, 0.51, rails) is None
    assert blind_reason(None, 0.5, rails) == (
        "the monitor reaches only 50% of the ranks it knows; it may be the problem")
    assert blind_reason(None, 0.0, rails, "shard 2").startswith("shard 2 reaches only 0% ")
    # unverifiable ranks say why first, whatever the reach
    assert blind_reason("ranks cannot be verified", 0.1, rails) == "ranks cannot be verified"


def test_no_replica_id_holds():
    assert decide("hang", 1, None, situation(), RailsConfig()).reason == "no_replica_id"


def test_cooldown_expires():
    rails = RailsConfig(cooldown_s=30)
    assert decide("hang", 1, RID, situation(last_eviction_at=969.0), rails).evict


def test_min_replicas_counts_remaining_groups():
    rails = RailsConfig(min_replicas=2)
    assert decide("hang", 1, RID, situation(groups_in_quorum={0, 1, 2}), rails).evict
    assert decide("hang", 1, RID, situation(groups_in_quorum={0, 1}), rails).reason \
        == "min_replicas"
    # the culprit already out of the quorum: the others still count
    assert decide("hang", 1, RID, situation(groups_in_quorum={0, 2}), rails).evict


def test_manual_skips_cooldown_blindness_and_a_held_quarantine_not_min_replicas():
    rails = RailsConfig(min_replicas=2, cooldown_s=60)
    s = situation(last_eviction_at=999.0, blind_reason="it reaches only 10% of the ranks",
                  quarantine_held="evicted off h2 already")
    assert decide("manual", 1, RID, s, rails, manual=True).evict
    s = situation(groups_in_quorum={0, 1})
    assert decide("manual", 1, RID, s, rails, manual=True).reason == "min_replicas"
    assert decide("manual", 1, RID, situation(), RailsConfig(dry_run=True),
                  manual=True).reason == "dry_run"


def test_config_validation():
    with pytest.raises(ConfigError):
        RailsConfig(evict_kinds=("bogus",)).validate()
    with pytest.raises(ConfigError):
        MonitorConfig(interval_s=0).validate()
    with pytest.raises(ConfigError):
        RailsConfig(min_replicas=0).validate()


def test_store_survives_reopen(tmp_path):
    path = str(tmp_path / "state.sqlite")
    s = Store(path)
    fid = s.add_finding({"kind": "hang", "replica_group": 1, "replica_id": RID, "ranks": [1],
                         "evidence": {"x": 1}, "first_seen": 1.0, "confirmed_at": 2.0})
    did = s.add_decision(replica_group=1, replica_id=RID, decision="evict", reason="hang",
                         finding_id=fid, status="sent", at=5.0)
    s.add_decision(replica_group=2, replica_id="replica_group_2:x", decision="hold",
                   reason="min_replicas", at=6.0)
    s.add_decision(replica_group=0, replica_id="replica_group_0:y", decision="evict",
                   reason="manual", status="failed", at=7.0)
    s.close()
    s = Store(path)
    assert s.evicted_replica_ids() == {RID}  # a failed kill does not count as evicted
    assert s.last_eviction_at() == 7.0
    assert [d["decision"] for d in s.decisions()] == ["evict", "hold", "evict"]
    assert s.findings()[0]["evidence"] == {"x": 1}
    assert [d["id"] for d in s.pending_confirmations()] == [did]
    s.update_decision(did, status="confirmed", confirmed_at=9.0)
    assert s.pending_confirmations() == []
    with pytest.raises(ValueError):
        s.update_decision(did, decision="hold")
    s.close()


def test_normalize_url():
    assert normalize_url("127.0.0.1:80") == "http://127.0.0.1:80"
    assert normalize_url("http://h:1/") == "http://h:1"
    for bad in ("", "h", "ftp://h:1", "http://h:notaport"):
        with pytest.raises(BadTarget):
            normalize_url(bad)


def test_registration_and_forgetting():
    d = Discovery(static=["127.0.0.1:1"], forget_after_s=30)
    d.register({"url": "http://127.0.0.1:2", "replica_group": 1, "rank": 1}, now=100.0)
    assert {t.url for t in d.targets()} == {"http://127.0.0.1:1", "http://127.0.0.1:2"}
    with pytest.raises(BadTarget):
        d.register({"nope": 1})
    with pytest.raises(BadTarget):
        d.register({"url": "http://h:3", "rank": "x"})
    unreachable = {"http://127.0.0.1:1": 100.0, "http://127.0.0.1:2": 101.0}
    assert d.forget_unreachable(unreachable, now=120.0) == []
    # it registered again after going dark: keep it
    d.register({"url": "http://127.0.0.1:2"}, now=125.0)
    assert d.forget_unreachable(unreachable, now=140.0) == []
    unreachable["http://127.0.0.1:2"] = 130.0
    assert d.forget_unreachable(unreachable, now=161.0) == ["http://127.0.0.1:2"]
    assert [t.url for t in d.targets()] == ["http://127.0.0.1:1"]  # static stays


def test_file_sd_in_and_out(tmp_path):
    src = tmp_path / "in.json"
    src.write_text(json.dumps([{"targets": ["127.0.0.1:5", "127.0.0.1:6"],
                                "labels": {"replica_group": "0"}}]))
    d = Discovery(targets_file=str(src), job="train")
    assert d.refresh() is None
    assert [t.url for t in d.targets()] == ["http://127.0.0.1:5", "http://127.0.0.1:6"]
    assert d.targets()[0].replica_group == 0
    src.write_text("{broken")
    os.utime(src, (1, 1))
    assert "in.json" in d.refresh()
    assert len(d.targets()) == 2  # the last good set stays
    src.write_text(json.dumps([{"targets": ["127.0.0.1:7"]}]))
    os.utime(src, (2, 2))
    assert d.refresh() is None
    assert [t.url for t in d.targets()] == ["http://127.0.0.1:7"]
    out = tmp_path / "sd" / "out.json"
    assert d.write_file_sd(str(out)) is True
    assert d.write_file_sd(str(out)) is False  # unchanged
    groups = json.loads(out.read_text())
    assert groups == [{"targets": ["127.0.0.1:7"],
                       "labels": {"job": "train", "lightkeeper_source": "file_sd"}}]


def test_cli_flags_map_to_config_and_bad_values_exit_2(tmp_path, capsys):
    import argparse

    from monitor import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--targets", "127.0.0.1:1,127.0.0.1:2", "--min-replicas", "3",
                         "--dry-run", "--evict-on", "hang", "--state", str(tmp_path / "s.db"),
                         "--hang-floor", "4", "--targets", "127.0.0.1:3"])
    cfg = cli.config_from_args(args)
    # repeated, as --action is: the last one no longer replaces the others
    assert cfg.targets == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    assert (cfg.rails.min_replicas, cfg.rails.dry_run, cfg.rails.evict_kinds) == (3, True,
                                                                                   ("hang",))
    assert cfg.detectors.hang_floor_s == 4
    assert cfg.sd_out == str(tmp_path / "lightkeeper-targets.json")
    bad = p.parse_args(["--interval", "0", "--state", str(tmp_path / "s.db")])
    assert cli.run(bad) == 2
    assert "--interval must be > 0" in capsys.readouterr().err  # the flag, not the field
    for target, said in (("foo bar", "has no port"), ("[::1:9500", "Invalid IPv6 URL")):
        bad = p.parse_args(["--targets", target, "--state", str(tmp_path / "s.db")])
        assert cli.run(bad) == 2
        err = capsys.readouterr().err  # the flag the user gave, not --allow-targets
        assert f"--targets entry {target!r}: " in err and said in err, err


def test_what_a_monitor_cannot_start_on_is_one_line_and_changes_nothing(tmp_path, capsys):
    """A state another monitor holds (whose open findings stay open), a state that cannot be
    opened, an address that cannot be served, a Lighthouse that is no URL, a bundle folder that
    cannot be written: one line each, exit 1 or 2, no traceback."""
    import argparse

    from monitor import cli
    from monitor.service import Monitor

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    state = str(tmp_path / "s.db")
    (tmp_path / "afile").write_text("")
    first = Monitor(MonitorConfig(port=0, state_path=state, sd_out=str(tmp_path / "sd.json")))
    try:
        fid = first.store.add_finding({"kind": "hang", "replica_group": 1, "ranks": [2],
                                       "first_seen": 1.0})
        for argv, code, words in (
                (["--state", state], 1, f"in use by another monitor (PID {os.getpid()})"),
                (["--state", str(tmp_path / "afile" / "s.db")], 1, "--state"),
                (["--state", str(tmp_path / "b.db"), "--bind", "999.1.1.1"], 1,
                 "cannot serve on 999.1.1.1:0"),
                (["--state", str(tmp_path / "c.db"), "--lighthouse", "notaurl"], 2,
                 "--lighthouse 'notaurl'"),
                (["--state", str(tmp_path / "d.db"), "--bundle-dir",
                  str(tmp_path / "afile" / "b")], 2, "--bundle-dir")):
            assert cli.run(p.parse_args(["--port", "0", *argv])) == code, argv
            err = capsys.readouterr().err
            assert words in err and "Traceback" not in err, err
            assert len(err.strip().splitlines()) == 1, err
        assert [f["id"] for f in first.store.findings(open_only=True)] == [fid]
    finally:
        first.stop()


@pytest.mark.parametrize("argv,said,files", [
    (["--action", "slurm"], "--action slurm: scontrol cannot read Slurm's configuration", ()),
    (["--action", "exec:/no/such/hook"],
     "--action 'exec:/no/such/hook': '/no/such/hook' is not an executable", ()),
    (["--bundle-dir", "{tmp}/afile/b"], "--bundle-dir {tmp}/afile/b: ", ()),
    (["--bundle-dir", "{state}"], "--bundle-dir {state}: {state} is --state's file", ()),
    (["--bundle-dir", "{state}/b"], "--bundle-dir {state}/b: ", ()),
    ([], "the bundles' default folder {dir}/incidents (beside --state): {dir}/incidents is "
     "not a folder", ("incidents", "new/incidents")),
    (["--sd-out", "{tmp}/other.json"], "--sd-out {tmp}/other.json exists and is not a file_sd",
     ()),
    (["--sd-out", "{tmp}/object.json"],
     "--sd-out {tmp}/object.json exists and is not a file_sd", ()),
    (["--sd-out", "{tmp}/afolder"], "--sd-out {tmp}/afolder is a folder", ()),
    (["--bundle-dir", "{tmp}/x.json", "--sd-out", "{tmp}/x.json"],
     "--bundle-dir {tmp}/x.json: it is --sd-out's file", ())],
    ids=["slurm", "exec", "bundle-dir", "bundle-dir-state", "bundle-dir-in-state",
         "default-bundle-dir", "sd-out", "sd-out-json-object", "sd-out-folder",
         "bundle-dir-sd-out"])
def test_a_refused_start_leaves_the_state_as_it_was(tmp_path, argv, said, files):
    """What may refuse the configuration is checked before ``--state`` is touched: a refused
    ``--action``, bundles' folder (``--bundle-dir`` or the default beside ``--state``) or
    ``--sd-out`` (a folder, or a file that is not file_sd JSON) makes no state file (nor its
    folder, its lock, the default ``--sd-out``'s lock or bundle folder), and leaves an existing
    one byte for byte. A stand-in ``scontrol`` that cannot read Slurm's configuration, as
    Slurm's says it."""
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "scontrol"
    fake.write_text('#!/bin/sh\necho "scontrol: fatal: Could not establish a configuration '
                    'source" >&2\nexit 1\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("SLURM_CONF", None)
    for name in ("afile", "other.json", *files):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("not json")
    (tmp_path / "object.json").write_text('{"x": 1}')  # JSON, not a list of target groups
    (tmp_path / "afolder").mkdir()
    Store(str(tmp_path / "old.sqlite")).close()
    kept = (tmp_path / "old.sqlite").read_bytes()
    before = sorted(tmp_path.rglob("*"))
    for state in (tmp_path / "new" / "m.sqlite", tmp_path / "old.sqlite"):
        said_here = said.format(tmp=tmp_path, state=state, dir=state.parent)
        p = subprocess.run([sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0",
                            "--state", str(state),
                            *(a.format(tmp=tmp_path, state=state) for a in argv)],
                           env=env, capture_output=True, text=True, timeout=30)
        assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
        line = p.stderr.strip().splitlines()[-1]
        assert line.startswith(f"lightkeeper monitor: {said_here}"), line
    assert (tmp_path / "old.sqlite").read_bytes() == kept
    # no state file nor folder, no -wal, -shm nor .lock; no incidents/ nor the --sd-out's lock
    assert sorted(tmp_path.rglob("*")) == before


def test_a_restarted_monitor_re_adopts_registrations_not_old_static_targets(tmp_path):
    """The --sd-out file of the last run holds its --targets too: those are this run's to give
    again (one removed from --targets is not polled for --forget-after); its registered ranks
    are re-adopted, as they will register again anyway."""
    sd = str(tmp_path / "targets.json")
    before = Discovery(static=["127.0.0.1:1", "127.0.0.1:2"])
    before.register({"url": "http://127.0.0.1:3", "replica_group": 1, "rank": 1}, now=100.0)
    before.write_file_sd(sd)
    after = Discovery(static=["127.0.0.1:4"])
    after.restore(sd)
    assert {(t.url, t.source) for t in after.targets()} == {
        ("http://127.0.0.1:4", "static"), ("http://127.0.0.1:3", "registered")}


def test_a_rank_dark_since_before_a_restart_is_forgotten_after_it(tmp_path, monkeypatch):
    """Re-adopted from --sd-out, a rank whose death the last run recorded (--state keeps when
    it went dark) counted as registered at the restart, after it went dark: it was never
    forgotten, its group's dead finding stayed open and it held a --max-targets slot."""
    import time as _time

    sd = str(tmp_path / "targets.json")
    url = "http://127.0.0.1:3"
    before = Discovery(static=[])
    before.register({"url": url, "replica_group": 1, "rank": 1}, now=100.0)
    before.write_file_sd(sd)
    monkeypatch.setattr(_time, "time", lambda: 1000.0)  # the restart
    after = Discovery(forget_after_s=30.0)
    after.restore(sd)
    dark = {url: 400.0}  # went dark 600 s before the restart (the seeded view says)
    assert after.forget_unreachable(dark, now=1010.0) == []  # given --forget-after from now
    assert after.forget_unreachable(dark, now=1031.0) == [url]
    assert after.targets() == []
    # one that registers again after the restart is kept while it keeps registering
    again = Discovery(forget_after_s=30.0)
    again.restore(sd)
    again.register({"url": url, "replica_group": 1, "rank": 1}, now=1020.0)
    assert again.forget_unreachable({url: 1010.0}, now=1045.0) == []
