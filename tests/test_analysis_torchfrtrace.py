"""Where torch's own analyzer (torchfrtrace) can run, its mismatch and hang culprits agree with ours.

torchfrtrace reads NCCL-flavour pickles (``<prefix><rank>``) whose ``pg_config`` lists every
group's ranks, and aligns ranks by ``record_id``; the scenarios here keep ring buffers unwrapped
so that it can, and its reference rank (the first it reads) healthy, since it blames whoever
differs from that rank. Skipped when torch's analyzer is not importable.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from monitor.analysis import analyze
from tests.support.frgen import FRJob, write_dumps


def torchfrtrace():
    """torch's analyzer (builder, config_manager, loader), or the test skips. Imported by the
    test, not at collection, where torch would cost every pytest-xdist worker a second of CPU."""
    return [pytest.importorskip(f"torch.distributed.flight_recorder.components.{name}")
            for name in ("builder", "config_manager", "loader")]


def torchfrtrace_culprits(directory: Path) -> dict[str, tuple[str, int, set[int]]]:
    """Per group: (kind, seq, culprits) of the first collective torchfrtrace flags."""
    components, config_manager, loader = torchfrtrace()
    args = config_manager.JobConfig().parse_args([str(directory), "-p", "rank"])
    # torchfrtrace judges every rank against the first one it reads (os.walk order); read them
    # in rank order so that its reference is rank 0, which is healthy in every scenario here
    files = sorted(directory.iterdir(), key=lambda p: int(p.name[len("rank") :]))
    details = {p.name: loader.read_dump("rank", str(p)) for p in files}
    version = str(next(iter(details.values()))["version"])
    logging.getLogger("Flight Recorder").setLevel(logging.ERROR)
    db = components.build_db(details, args, version)
    first: dict[str, tuple[str, int, set[int]]] = {}
    for c in db.collectives:
        # a collective some ranks never joined keeps pass_check=True but lists missing_ranks
        if (c.pass_check and not c.missing_ranks) or c.pg_desc.split(":")[0] in first:
            continue
        pg = c.pg_desc.split(":")[0]
        if c.missing_ranks:
            first[pg] = ("hang", c.collective_seq_id, set(c.missing_ranks))
        elif c.mismatch_collectives:
            first[pg] = ("mismatch", c.collective_seq_id, set(c.mismatch_collectives))
    return first


def ours(dumps) -> dict[str, tuple[str, int, set[int]]]:
    return {f.pg: (f.kind, f.seq, set(f.culprit_ranks)) for f in analyze(dumps).findings}


def scenario(kind: str) -> FRJob:
    job = FRJob(4, seed=7)
    job.group("1", [0, 1])
    job.group("2", [2, 3])
    step = [("0", "all_reduce", [[1024]]), ("1", "all_gather", [[64]]), ("2", "all_gather", [[64]])]
    job.repeat(8, step)
    if kind == "size":
        job.collective("0", "all_reduce", [[1024]], rank_sizes={3: [[2048]]})
    elif kind == "op":
        job.collective("0", "all_reduce", [[1024]], ops={2: "broadcast"})
    elif kind == "dtype":
        job.collective("0", "all_reduce", [[1024]], dtypes={1: "Half"})
    elif kind == "hang":
        job.collective("0", "all_reduce", [[1024]], absent=[2])
    return job


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("size", {"0": ("mismatch", 9, {3})}),
        ("op", {"0": ("mismatch", 9, {2})}),
        ("dtype", {"0": ("mismatch", 9, {1})}),
        ("hang", {"0": ("hang", 9, {2})}),
        ("healthy", {}),
    ],
)
def test_culprits_agree_with_torchfrtrace(tmp_path, kind, expected):
    torchfrtrace()
    dumps = scenario(kind).dumps(fmt="pickle")
    write_dumps(dumps, tmp_path, fmt="pickle", prefix="rank")
    assert ours(dumps) == expected
    assert torchfrtrace_culprits(tmp_path) == expected
