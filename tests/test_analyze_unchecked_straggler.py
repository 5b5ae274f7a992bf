"""``lightkeeper analyze`` on a straggler bundle whose dumps cannot time one rank against
another (gloo dumps naming no host, as the demo's): no verdict either way, and the line says
why, rather than "the analysis does not name them" (docs/analyze.md, Incident bundles)."""

from __future__ import annotations

import json

from lightkeeper.cli import main
from monitor.analysis.bundle import FORMAT
from tests.support.frgen import FRJob, write_dumps


def straggler_bundle(tmp_path):
    """An unpacked bundle: the monitor named rank 1 a straggler; rank 1's dumps are on time."""
    folder = tmp_path / "b1"
    job = FRJob(2, flavour="gloo")
    job.repeat(40, [("0", "all_reduce", [[8]])])
    write_dumps(job.dumps(), folder / "fr", fmt="json")
    (folder / "manifest.json").write_text(json.dumps({
        "format": FORMAT, "id": "b1", "trigger": "evict", "kind": "straggler", "replica_group": 1,
        "culprit_ranks": [1], "ranks": [], "left_out": []}))
    return str(folder)


def test_a_straggler_no_dump_can_time_is_not_called_a_disagreement(tmp_path, capsys):
    path = straggler_bundle(tmp_path)
    assert main(["analyze", "--format", "json", path]) == 0
    [b] = json.loads(capsys.readouterr().out)["bundles"]
    assert (b["kind"], b["analysis_agrees"], b.get("unchecked")) == ("straggler", None, True), b
    main(["analyze", path])
    out = capsys.readouterr().out
    assert "(straggler, kept before the kill); these dumps cannot check it: no other rank could " \
           "be timed against rank(s) 1\n" in out, out
    assert "does not name" not in out and "note: no straggler check in 1 group(s)" in out


def test_once_the_ranks_can_be_timed_a_clean_rank_is_a_disagreement(tmp_path, capsys):
    """--same-host: the check runs, names no one, and so does not agree with the monitor."""
    path = straggler_bundle(tmp_path)
    assert main(["analyze", "--format", "json", "--same-host", path]) == 0
    [b] = json.loads(capsys.readouterr().out)["bundles"]
    assert b["analysis_agrees"] is False and not b.get("unchecked"), b
    main(["analyze", "--same-host", path])
    assert "the analysis does not name them" in capsys.readouterr().out
