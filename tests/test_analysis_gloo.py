"""The engine on real gloo Flight Recorder dumps from real processes (plain torch.distributed).

Three ranks rendezvous through a FileStore (gloo itself talks over loopback), and go through:
a healthy phase (default group and a 2-rank group) after which every rank dumps; a straggler
phase (steps of a broadcast, an all_reduce and an all_gather in the default group; rank 1
computes longer before each all_reduce only: last at too few of the group's collectives to stand
out but at every all_reduce); a size mismatch (rank 2 all_reduces a
[4, 4] tensor where the others use [16] in group "2"); and a hang (ranks 0 and 1 enqueue an all_reduce in group "3" that
rank 2 never enqueues). Unfinished collectives are async and never waited on, and every process
leaves with ``os._exit`` once all have dumped, so nothing can block the test.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from monitor.analysis import GroupKey, analyze
from monitor.analysis.loader import load_paths
from tests.support.workers import finish_all

WORLD = 3

WORKER = r"""
import json, os, sys, time
from datetime import timedelta

rank, world, store_path, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"  # before torch is imported: read at startup
import torch
import torch.distributed as dist
import torch._C._distributed_c10d as c10d

store = dist.FileStore(store_path, world)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
pair = dist.new_group([0, 1])            # "1"
group_b = dist.new_group([0, 1, 2])      # "2": the mismatch
group_c = dist.new_group([0, 1, 2])      # "3": the hang

def dump(name):
    with open(os.path.join(out, f"{name}-rank{rank}.json"), "wb") as f:
        f.write(c10d._dump_fr_trace_json(includeCollectives=True))
    with open(os.path.join(out, f"{name}-pickle-rank{rank}"), "wb") as f:
        f.write(c10d._dump_fr_trace())

t = torch.ones(16)
for _ in range(6):
    dist.all_reduce(t)
    if rank in (0, 1):
        dist.all_gather([torch.empty(4), torch.empty(4)], torch.ones(4), group=pair)
dist.all_reduce(t, group=group_b)
dist.all_reduce(t, group=group_c)
dist.barrier()
dump("healthy")

for _ in range(24):  # rank 1 is the straggler: its peers wait for it at the step's all_reduce
    dist.broadcast(t, 0)
    if rank == 1:
        time.sleep(0.04)
    dist.all_reduce(t)
    dist.all_gather([torch.empty(16) for _ in range(world)], t)

# mismatch: rank 2's tensor has another shape but the same byte count, so gloo does not abort
# the processes (it does on a byte-count mismatch, racing the dump) and the collective completes
dist.all_reduce(torch.ones(4, 4) if rank == 2 else torch.ones(16), group=group_b)
if rank != 2:
    dist.all_reduce(t, group=group_c, async_op=True)  # rank 2 never arrives: a hang
dump("final")

done = store.add("dumped", 1)
if done == world:
    store.set("all_dumped", "1")
store.wait(["all_dumped"], timedelta(seconds=60))
os._exit(0)
"""


@pytest.fixture(scope="module")
def gloo_dumps(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gloo-dumps")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", TORCH_FR_BUFFER_SIZE="2000")
    store = out / "store"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(rank), str(WORLD), str(store), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in range(WORLD)
    ]
    finish_all(procs, "rank")
    return out


def load(out: Path, name: str) -> dict[int, dict]:
    return {r: json.loads((out / f"{name}-rank{r}.json").read_bytes()) for r in range(WORLD)}


def test_real_gloo_dump_shape(gloo_dumps):
    dump = load(gloo_dumps, "final")[0]
    # the default group is '' in pg_config but "0" in entries; there are no timings
    assert set(dump["pg_config"]) == {""}
    names = {e["process_group"][0] for e in dump["entries"]}
    assert names == {"0", "1", "2", "3"}
    assert {e["state"] for e in dump["entries"]} == {"scheduled"}
    assert all(e["time_discovered_started_ns"] == 0 for e in dump["entries"])


def test_healthy_phase_has_no_findings(gloo_dumps):
    result = analyze(load(gloo_dumps, "healthy"), same_host=True)
    assert result.findings == []
    assert result.ranks == [0, 1, 2] and result.unknown_ranks == []
    assert result.last_seq[GroupKey("1")] == {0: 6, 1: 6}


def test_a_rank_without_a_dump_is_blamed_only_when_asked(gloo_dumps):
    """pg_config's '' entry lists no ranks here (a job that built groups of its own): rank 2 is
    unknown given --world-size, and blamed (gloo: it did all but the newest collective) only when
    asked."""
    dumps = load(gloo_dumps, "healthy")
    del dumps[2]
    result = analyze(dumps, world_size=3)
    assert (result.unknown_ranks, result.findings) == ([2], [])
    blamed = analyze(dumps, blame_missing=True, world_size=3)
    # (groups "2" and "3" list nobody on gloo: rank 2 is a member only by its own dump)
    assert [(f.kind, f.pg, f.culprit_ranks) for f in blamed.findings] == [("hang", "0", [2])]


def test_straggler_mismatch_and_hang_are_found_with_the_right_culprits(gloo_dumps):
    result = analyze(load(gloo_dumps, "final"), same_host=True)
    found = [(f.kind, f.pg, f.seq, f.culprit_ranks) for f in result.findings]
    assert found == [
        ("hang", "3", 2, [2]),
        ("mismatch", "2", 2, [2]),
        ("straggler", "0", None, [1]),
    ]
    hang, mismatch, straggler = result.findings
    assert hang.waiting_ranks == [0, 1] and hang.last_seq_by_rank == {0: 2, 1: 2, 2: 1}
    assert hang.last_activity[2]["pg"] == "2"  # rank 2's newest entry: its mismatched all_reduce
    assert mismatch.mismatch == "size" and mismatch.variants[0]["ranks"] == [0, 1]
    assert straggler.evidence == "host_clock" and straggler.median_wait_ms > 10
    assert "all_reduce collectives" in straggler.detail, straggler.detail


def test_real_gloo_pickles_through_the_loader(gloo_dumps, tmp_path):
    for rank in range(WORLD):
        raw = (gloo_dumps / f"final-pickle-rank{rank}").read_bytes()
        assert isinstance(pickle.loads(raw), dict)
        (tmp_path / f"rank{rank}").write_bytes(raw)
    loaded = load_paths([tmp_path])
    assert loaded.errors == [] and sorted(loaded.traces) == [0, 1, 2]
    result = analyze(loaded.traces)
    # without --same-host nothing compares clocks: the structural findings remain
    assert [(f.kind, f.culprit_ranks) for f in result.findings] == [("hang", [2]), ("mismatch", [2])]
