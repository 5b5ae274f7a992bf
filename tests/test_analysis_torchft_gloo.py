"""The engine on real torchft gloo dumps: torchft's cross-group process group is read from its
incarnations, never from the ``''`` entry gloo keeps in ``pg_config``.

Two processes, one per replica group, build a real torchft ``ProcessGroupGloo`` and configure it
as torchft 0.2's Manager does (quorum 1, both groups), the WorkerServer's ``IncarnationTracker``
hooked on it; each rank's document is ``fr_dump``'s, what ``/v1/fr_trace`` serves and an incident
bundle keeps. After five all_reduces, replica group 0 enqueues a sixth that group 1 never does:
a hang. gloo's ``pg_config`` then holds ``{'': {'ranks': '[0, 1]'}}``: torchft's group, by
replica rank. Read as a group inside the rank's replica group, replica group 1's dump made it
global ranks (1, 2), and ``lightkeeper analyze`` said ``no dump from rank(s): 2`` of a job with
ranks 0 and 1 only (found by a new user on examples/torchft_two_groups.py's shape).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightkeeper.cli import main
from monitor.analysis import GroupKey, analyze
from tests.support.frgen import FRJob
from tests.support.workers import finish_all

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import os, sys, time
from datetime import timedelta
from types import SimpleNamespace

group, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
group_rank, group_world_size = int(sys.argv[4]), int(sys.argv[5])
os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"  # before torch is imported: read at startup
import torch
import torch.distributed as dist
from torchft import ProcessGroupGloo
from worker_server.flight_recorder import IncarnationTracker, fr_dump

rank = group * group_world_size + group_rank
store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
tracker = IncarnationTracker(group_rank)
tracker.hook(SimpleNamespace(_pg=pg))
# torchft 0.2's Manager: store_addr, replica_id, replica rank and world size, quorum_id,
# group_rank, group_world_size, the global ranks in the quorum
pg.configure(f"127.0.0.1:{port}/torchft/1/{group_rank}", f"g{group}", group, 2, 1, group_rank,
             group_world_size, [g * group_world_size + group_rank for g in (0, 1)])
t = torch.ones(16)
for _ in range(5):
    pg.allreduce([t], dist.AllreduceOptions()).wait()
if group == 0:
    pg.allreduce([t], dist.AllreduceOptions())  # replica group 1 never joins: a hang
time.sleep(1.5)  # older than the analysis' MIN_PENDING_S: hung, not in flight
identity = {"rank": rank, "replica_group": group, "replica_id": f"g{group}",
            "group_rank": group_rank, "group_world_size": group_world_size, "host": "h0",
            "job": "ft"}
with open(os.path.join(out, f"rank{rank}.json"), "wb") as f:
    f.write(fr_dump(tracker, identity))
store.add("dumped", 1)
deadline = time.monotonic() + 60
while store.add("dumped", 0) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
os._exit(0)
"""

# (group_rank, group_world_size): examples/torchft_two_groups.py's shape, and group rank 1 of
# two replica groups of two ranks (global ranks 1 and 3; gloo names that group '' as well)
SHAPES = {"one_rank_per_group": (0, 1), "group_rank_1_of_2": (1, 2)}


@pytest.fixture(scope="module", params=list(SHAPES))
def ft_dumps(request, tmp_path_factory) -> tuple[tuple[int, int], Path]:
    pytest.importorskip("torchft")
    from torch.distributed import TCPStore

    group_rank, size = SHAPES[request.param]
    out = tmp_path_factory.mktemp(f"torchft-gloo-{request.param}")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(group), str(store.port), str(out),
                               str(group_rank), str(size)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for group in (0, 1)]
    finish_all(procs, "group")
    return (group_rank, size), out


def test_real_dump_shape(ft_dumps):
    (group_rank, size), out = ft_dumps
    dump = json.loads((out / f"rank{size + group_rank}.json").read_bytes())
    # gloo's '' entry: torchft's group by replica rank; the incarnation by global rank
    assert dump["pg_config"] == {"": {"name": "", "desc": "", "ranks": "[0, 1]"}}
    (inc,) = dump["incarnations"]
    assert (inc["pg_name"], inc["global_ranks"]) == ("", [group_rank, size + group_rank])
    assert dump["replica_group"] == 1 and dump["group_world_size"] == size


def test_the_hang_is_found_and_no_rank_is_made_up(ft_dumps, capsys):
    (group_rank, size), out = ft_dumps
    ranks = [group_rank, size + group_rank]
    code = main(["analyze", "--format", "json", str(out)])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    assert (report["ranks"], report["unknown_ranks"], report["errors"]) == (ranks, [], [])
    (hang,) = report["findings"]
    assert (hang["kind"], hang["seq"], hang["culprit_ranks"], hang["waiting_ranks"]) == \
        ("hang", 6, [ranks[1]], [ranks[0]])
    assert hang["unknown_ranks"] == []
    main(["analyze", str(out)])
    assert "no dump from" not in capsys.readouterr().out


def test_generated_torchft_gloo_dumps_with_real_pg_config():
    """The same on generated dumps (no torchft needed): two replica groups of one rank, gloo's
    ``''`` entry listing torchft's group by replica rank on both ranks."""
    job = FRJob(2, flavour="gloo", replica_group_size=1, seed=3)
    job.quorum(1, [0, 1])
    for _ in range(5):
        job.ft_collective("all_reduce", [[4096]])
    job.ft_collective("all_reduce", [[4096]], absent=[1])
    dumps = job.dumps()
    for d in dumps.values():
        d["pg_config"] = {"": {"name": "", "desc": "", "ranks": "[0, 1]"}}
    result = analyze(dumps)
    assert (result.ranks, result.unknown_ranks) == ([0, 1], [])
    assert [(f.kind, f.group, f.culprit_ranks) for f in result.findings] == [
        ("hang", GroupKey("", None, 1, 0), [1])]
    assert list(result.last_seq) == [GroupKey("", None, 1, 0)]  # no '' group of pg_config's
