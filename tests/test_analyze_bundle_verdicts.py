"""``lightkeeper analyze`` on incident bundles and truncated dumps: a straggler is judged from its
finding's onset, a lag naming the culprit agrees, what the dumps cannot check is ``null`` (not
"does not name them"), and input that failed to load gives no healthy verdict (docs/analyze.md,
Exit status and Incident bundles)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightkeeper.cli import main
from monitor.analysis.bundle import FORMAT
from tests.support.frgen import FRJob, write_dumps

NIGHTLY_HANG = Path(__file__).parent / "data" / "nightly_cross_hang_bundle.tar.gz"


def bundle(folder: Path, kind: str, culprits: list[int], dumps: dict, finding: dict | None = None,
           ranks: list[dict] | None = None, left_out: list[dict] | None = None) -> str:
    """An unpacked bundle of the monitor's ``kind`` finding naming ``culprits``; ``ranks``: the
    manifest's rows of the ranks asked, ``left_out``: what the size cap left out."""
    write_dumps(dumps, folder / "fr", fmt="json")
    (folder / "manifest.json").write_text(json.dumps({
        "format": FORMAT, "id": folder.name, "trigger": "evict", "kind": kind, "replica_group": 1,
        "culprit_ranks": culprits, "ranks": ranks or [], "left_out": left_out or []}))
    if finding is not None:
        (folder / "findings.json").write_text(json.dumps({"finding": {"kind": kind, **finding}}))
    return str(folder)


def run(capsys, path: str) -> tuple[int, dict, int, str]:
    """(exit status, JSON report, exit status, text) of the same input."""
    code = main(["analyze", "--format", "json", path])
    report = json.loads(capsys.readouterr().out)
    text_code = main(["analyze", path])
    return code, report, text_code, capsys.readouterr().out


def slow_after_healthy(tmp_path: Path, ranks: int, healthy: int, slow: int, onset_before: int = 0) -> str:
    """torchft's group over ``ranks`` one-rank replica groups on one host: ``healthy`` steps, then
    ``slow`` with rank 1 600 ms late into each; the finding's onset ``onset_before`` steps before
    the slow ones end (0: when they began)."""
    job = FRJob(ranks, flavour="gloo", replica_group_size=1, hosts=dict.fromkeys(range(ranks), "vm"),
                compute_ms=120.0, jitter_ms=5.0, seed=3)
    job.quorum(1, list(range(ranks)))
    for _ in range(healthy):
        job.ft_collective()
    for i in range(slow):
        if i == slow - onset_before:
            onset = max(d["entries"][-1]["time_created_ns"] for d in job.dumps().values())
        job.ft_collective(delay_ms={1: 600.0})
    if not onset_before:
        onset = max(d["entries"][healthy - 1]["time_created_ns"] for d in job.dumps().values())
    return bundle(tmp_path / "straggler", "straggler", [1], job.dumps(),
                  {"ranks": [1], "first_seen": onset / 1e9 + 0.001, "confirmed_at": onset / 1e9 + 5})


def test_a_straggler_is_judged_from_its_onset_not_over_the_healthy_steps_before(tmp_path, capsys):
    """16 slow steps after 148 healthy ones: over the whole dump rank 1 was last at too few
    collectives to stand out, and the bundle said "does not name them", exit 0."""
    code, report, text_code, text = run(capsys, slow_after_healthy(tmp_path, 3, 148, 16))
    [b] = report["bundles"]
    assert (b["analysis_agrees"], b["unchecked"]) == (True, False), b
    [f] = report["findings"]
    assert (f["kind"], f["culprit_ranks"], f["collectives"]) == ("straggler", [1], 16), f
    assert (code, text_code) == (1, 1)
    assert "(straggler, kept before the kill); the analysis agrees\n" in text
    assert "note: stragglers judged over the collectives enqueued since the monitor's finding began" in text


def test_a_bundles_fr_folder_given_alone_says_to_give_the_bundle(tmp_path, capsys):
    """The bundle's ``fr/`` folder read as plain dumps judges every step (the healthy ones outvote
    the straggler: no finding), which an on-call reader took for "the dumps clear it": a note says
    to give the bundle itself."""
    folder = slow_after_healthy(tmp_path, 3, 148, 16)
    code, report, _, text = run(capsys, folder + "/fr")
    assert "bundles" not in report or not report["bundles"]
    said = f"{folder}/fr is an incident bundle's fr/ folder: analyze the bundle ({folder}"
    assert any(n.startswith(said) for n in report["notes"]), report["notes"]
    assert said in text
    code, report, _, _ = run(capsys, folder)  # the bundle itself: no such note
    assert not any("incident bundle's fr/ folder" in n for n in report["notes"])


def test_too_few_collectives_since_the_onset_is_unchecked_not_a_disagreement(tmp_path, capsys):
    """The monitor's finding began 5 steps before the bundle: too few to time anyone."""
    code, report, _, text = run(capsys, slow_after_healthy(tmp_path, 3, 148, 16, onset_before=5))
    [b] = report["bundles"]
    assert (b["analysis_agrees"], b["unchecked"], code) == (None, True, 0), b
    assert "these dumps cannot check it: no other rank could be timed against rank(s) 1 since the finding's " \
           "onset: fewer than 10 collectives (a group judged per position in its step: whole steps), or " \
           "(two ranks compared) fewer than 3 whole steps\n" in text, text
    assert "does not name" not in text


def test_a_lag_naming_the_culprit_agrees_with_the_monitor(tmp_path, capsys):
    """Two replica groups: rank 1 600 ms behind rank 0 at every step is a lag (no majority says
    which of two is off pace), and was reported beside "the analysis does not name them"."""
    job = FRJob(2, flavour="gloo", replica_group_size=1, hosts={0: "vm", 1: "vm"}, compute_ms=120.0, seed=1)
    job.quorum(1, [0, 1])
    for _ in range(30):
        job.ft_collective(delay_ms={1: 600.0})
    code, report, _, text = run(capsys, bundle(tmp_path / "lag", "straggler", [1], job.dumps()))
    [lag] = report["lags"]
    assert (report["findings"], lag["culprit_ranks"]) == ([], [1])
    [b] = report["bundles"]
    assert b["analysis_agrees"] is True and code == 0, b  # a lag is no finding: exit status 0
    assert "; the analysis agrees\n" in text and "[lag] rank 1 behind rank 0" in text


def test_a_straggler_late_only_at_the_cross_group_step_on_own_hosts_is_unchecked(tmp_path, capsys):
    """Three groups of two ranks, each group on a host of its own; rank 3 (group 1) 400 ms late
    into every cross-group all_reduce only, as the monitor saw (its peer waits in torchft's
    commit vote, which no dump records). Its in-group collectives were timed, in step; its
    cross-group ones cannot be (each of their ranks on another host, gloo: no durations): the
    bundle said "the analysis does not name them" of a right eviction."""
    job = FRJob(6, flavour="gloo", replica_group_size=2, compute_ms=120.0, seed=2,
                hosts={r: f"h{r // 2}" for r in range(6)})
    job.quorum(1, [0, 1, 2])
    for i in range(30):
        for g in range(3):  # group rank 0 waited for group rank 1 in the unrecorded vote
            job.collective("0", "all_gather", [[1000]], members=[2 * g, 2 * g + 1],
                           delay_ms={2 * g: 400.0} if i else None)
        job.ft_collective("all_reduce", [[1000]], delay_ms={3: 400.0})
    finding = {"ranks": [3], "evidence": {"summary": "the other groups wait for replica group 1 at "
                                                     "the cross-group step"}}
    code, report, _, text = run(capsys, bundle(tmp_path / "s", "straggler", [3], job.dumps(), finding))
    [b] = report["bundles"]
    assert (b["analysis_agrees"], b["unchecked"], code) == (None, True, 0), b
    assert "these dumps cannot check it: the monitor timed rank(s) 3 late at the cross-group step, and " \
           "no cross-group collective of theirs could be timed against another group's" in text, text
    assert "does not name" not in text


def cross_hang(ranks: int) -> FRJob:
    """Rank 2 never enters torchft's collective seq 11 the others wait in."""
    job = FRJob(ranks, flavour="gloo", replica_group_size=1, hosts=dict.fromkeys(range(ranks), "vm"))
    job.quorum(1, list(range(ranks)))
    for _ in range(10):
        job.ft_collective()
    job.ft_collective(absent=[2])
    return job


def test_a_hang_bundle_without_a_waiting_ranks_dump_is_unchecked(tmp_path, capsys):
    """Only the culprit's dump came: nothing shows what the others wait in."""
    job = cross_hang(3)
    path = bundle(tmp_path / "hang", "hang", [2], job.dumps(ranks=[2]),
                  {"ranks": [2], "evidence": {"waiting_ranks": [0, 1]}})
    code, report, _, text = run(capsys, path)
    [b] = report["bundles"]
    assert (b["analysis_agrees"], b["unchecked"], code) == (None, True, 0), b
    assert "these dumps cannot check it: no readable dump of any rank that waited for them (0, 1)\n" in text
    # with them, the same bundle agrees
    write_dumps(job.dumps(ranks=[0, 1]), Path(path) / "fr", fmt="json")
    code, report, _, _ = run(capsys, path)
    assert (report["bundles"][0]["analysis_agrees"], code) == (True, 1)


def test_a_hang_bundle_cut_short_before_the_peers_dumps_is_unchecked_and_incomplete(tmp_path, capsys):
    """``head -c 5000`` of a real bundle: the culprits' dumps only, then the archive breaks."""
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(NIGHTLY_HANG.read_bytes()[:5000])
    code, report, text_code, text = run(capsys, str(cut))
    [b] = report["bundles"]
    assert (report["ranks"], b["culprit_ranks"]) == ([2, 3], [2, 3])
    assert (b["analysis_agrees"], b["unchecked"]) == (None, True), b
    assert (code, text_code) == (2, 2)
    assert "does not name" not in text and text.endswith("no findings in the dumps read: incomplete input, "
                                                         "not a healthy verdict\n"), text


def test_a_truncated_dump_is_no_healthy_verdict(tmp_path, capsys):
    """torch's gloo pickles of two ranks, rank 1 never issuing seq 6 and its dump cut short: the
    hang is in the broken dump, and "no findings", exit 0, read as a healthy job."""
    job = FRJob(2, flavour="gloo")
    job.repeat(5, [("0", "all_reduce", [[16]])])
    job.collective("0", "all_reduce", [[16]], absent=[1])
    [_, rank1] = write_dumps(job.dumps(fmt="pickle"), tmp_path / "dumps", fmt="pickle")
    rank1.write_bytes(rank1.read_bytes()[:900])
    code, report, text_code, text = run(capsys, str(tmp_path / "dumps"))
    assert (report["ranks"], report["findings"], [e["path"] for e in report["errors"]]) == ([0], [], [str(rank1)])
    assert any(n.startswith("1 input(s) could not be read") for n in report["notes"]), report["notes"]
    assert (code, text_code) == (2, 2)
    assert text.endswith("no findings in the dumps read: incomplete input, not a healthy verdict\n"), text
    # whole, the same dumps show the hang
    write_dumps(job.dumps(ranks=[1], fmt="pickle"), tmp_path / "dumps", fmt="pickle")
    assert main(["analyze", str(tmp_path / "dumps")]) == 1


def healthy_nccl(ranks: int, steps: int = 30) -> FRJob:
    job = FRJob(ranks, flavour="nccl", seed=2)
    job.repeat(steps, [("0", "all_reduce", [[1024]])])
    return job


@pytest.mark.parametrize("kind", ["hang", "mismatch", "straggler", "left out"])
def test_a_bundle_listing_dumps_that_did_not_come_is_incomplete(kind, tmp_path, capsys):
    """Only the culprit's dump came, its peers' downloads timed out (or the size cap left one
    out): nothing found in one dump read as a healthy "no findings", exit 0."""
    timed_out = [{"rank": r, "fr_trace": "timeout", "stacks": "ok"} for r in (0, 2)]
    rows, left = (timed_out, []) if kind != "left out" else \
        ([], [{"what": "fr/rank0.json", "bytes": 9000, "why": "over --bundle-max-bytes 8000"}])
    path = bundle(tmp_path / "b", "hang" if kind == "left out" else kind, [1], healthy_nccl(3).dumps(ranks=[1]),
                  {"ranks": [1]}, rows, left)
    code, report, text_code, text = run(capsys, path)
    assert (report["ranks"], report["findings"], code, text_code) == ([1], [], 2, 2), report["notes"]
    n = len(rows or left)
    assert any(x.startswith(f"{n} input(s) could not be read") for x in report["notes"]), report["notes"]
    assert text.endswith("no findings in the dumps read: incomplete input, not a healthy verdict\n"), text
    # a kind no dump shows is judged on the monitor's evidence: the dumps missed change nothing
    path = bundle(tmp_path / "n", "network", [1], healthy_nccl(3).dumps(ranks=[1]), {"ranks": [1]}, rows, left)
    assert main(["analyze", path]) == 0


def test_a_mismatch_bundle_of_the_named_rank_alone_is_unchecked(tmp_path, capsys):
    """No peer's dump to compare the named rank's with: it read "the analysis does not name them"."""
    path = bundle(tmp_path / "m", "mismatch", [1], healthy_nccl(3).dumps(ranks=[1]), {"ranks": [1]})
    code, report, _, text = run(capsys, path)
    [b] = report["bundles"]
    assert (b["analysis_agrees"], b["unchecked"], code) == (None, True, 0), b
    assert "these dumps cannot check it: no other rank's dump to compare rank(s) 1 with\n" in text, text
    assert "does not name" not in text


def test_a_quorum_level_hang_is_unchecked_by_the_dumps(tmp_path, capsys):
    """Rank 3 never asked for the quorum: every dump whole and no collective pending, so no
    dump shows it, and every dump read said "the analysis does not name them"."""
    path = bundle(tmp_path / "q", "hang", [3], healthy_nccl(4).dumps(),
                  {"ranks": [3], "evidence": {"level": "quorum", "never_arrived": [3], "waiting_ranks": [0, 1, 2]}})
    code, report, _, text = run(capsys, path)
    [b] = report["bundles"]
    assert (b["analysis_agrees"], b["unchecked"], report["findings"], code) == (None, True, [], 0), b
    assert "these dumps cannot check it: rank(s) 3 never asked for the quorum: no collective is pending, " \
           "which a dump could show\n" in text, text
    assert "does not name" not in text


def test_a_quorum_level_hang_the_dumps_show_elsewhere_is_not_named(tmp_path, capsys):
    """The monitor said rank 1 never asked for the quorum, yet the dumps show rank 2 never
    entering a collective ranks 0 and 1 wait in: they can check it, and read "cannot check"."""
    path = bundle(tmp_path / "q", "hang", [1], cross_hang(3).dumps(),
                  {"ranks": [1], "evidence": {"level": "quorum", "never_arrived": [1], "waiting_ranks": [0, 2]}})
    code, report, _, text = run(capsys, path)
    [b] = report["bundles"]
    assert ([f["culprit_ranks"] for f in report["findings"]], b["analysis_agrees"], b["unchecked"], code) == \
        ([[2]], False, False, 1), b
    assert "; the analysis does not name them\n" in text, text
