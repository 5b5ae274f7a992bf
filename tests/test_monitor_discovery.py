"""Discovery's target list (monitor/poll/discovery.py) is kept between sweeps and made again only
when a source changes: the same Target objects come back, so the view and the schedule, which
tell unchanged targets by identity, keep their caches (docs/scaling.md)."""

from __future__ import annotations

import json
import os

from monitor.poll.discovery import Discovery


def test_targets_are_kept_until_a_source_changes(tmp_path):
    d = Discovery(static=["127.0.0.1:9001"])
    d.register({"url": "http://127.0.0.1:9003", "rank": 3, "replica_group": 1}, now=10.0)
    d.register({"url": "http://127.0.0.1:9002", "rank": 2, "replica_group": 1}, now=10.0)
    first = d.targets()
    assert [t.url for t in first] == ["http://127.0.0.1:9002", "http://127.0.0.1:9003",
                                      "http://127.0.0.1:9001"]
    again = d.targets()
    assert again is not first and all(a is b for a, b in zip(again, first, strict=True))

    # the same registration again (a rank's periodic re-registration): the same object, with
    # its new registration time, and no change of the list
    t = d.register({"url": "http://127.0.0.1:9003", "rank": 3, "replica_group": 1}, now=20.0)
    assert t is first[1] and t.last_registered == 20.0
    assert all(a is b for a, b in zip(d.targets(), first, strict=True))

    # a changed hint replaces the target
    t2 = d.register({"url": "http://127.0.0.1:9003", "rank": 1, "replica_group": 1}, now=30.0)
    assert t2 is not t
    assert [x.url for x in d.targets()] == ["http://127.0.0.1:9003", "http://127.0.0.1:9002",
                                            "http://127.0.0.1:9001"]

    # a new file_sd content, then forgetting, change the list too
    path = tmp_path / "sd.json"
    path.write_text(json.dumps([{"targets": ["127.0.0.1:9000"], "labels": {"rank": "0"}}]))
    d.targets_file = str(path)
    assert d.refresh() is None
    assert d.targets()[0].url == "http://127.0.0.1:9000"
    assert d.forget_unreachable({"http://127.0.0.1:9002": 31.0}, now=31.0 + 60) == \
        ["http://127.0.0.1:9002"]
    assert "http://127.0.0.1:9002" not in {x.url for x in d.targets()}
    assert os.path.exists(path)


def test_file_sd_is_written_again_only_when_a_target_or_its_hints_change(tmp_path):
    d = Discovery(static=["127.0.0.1:1"], job="train")
    out = tmp_path / "sd.json"

    def groups():
        return {g["targets"][0]: g["labels"].get("replica_group")
                for g in json.loads(out.read_text())}

    assert d.write_file_sd(str(out)) is True
    assert out.stat().st_mode & 0o777 == 0o644  # Prometheus may run as another user
    assert d.write_file_sd(str(out)) is False
    d.register({"url": "http://127.0.0.1:2", "replica_group": 3, "rank": 0})
    assert d.write_file_sd(str(out)) is True
    assert groups() == {"127.0.0.1:1": None, "127.0.0.1:2": "3"}
    d.register({"url": "http://127.0.0.1:2", "replica_group": 3, "rank": 0})  # the same again
    assert d.write_file_sd(str(out)) is False
    d.register({"url": "http://127.0.0.1:2", "replica_group": 4, "rank": 0})  # restarted elsewhere
    assert d.write_file_sd(str(out)) is True
    assert groups()["127.0.0.1:2"] == "4"
    out.unlink()  # removed under the monitor: written again though nothing changed
    assert d.write_file_sd(str(out)) is True and groups()["127.0.0.1:2"] == "4"
