"""An answer to ``/v1/fr_trace?last=N`` is read up to what N entries need (monitor.polling
FR_ENTRY_BYTES each, after FR_HEAD_BYTES), not up to ``--max-fr-bytes``: a rank ignoring the
query cannot make the monitor parse a dump of tens of megabytes every look. One past that
bound is refused (a warning names the rank and why); one within it holding more than N entries
keeps its newest N, said as a cut dump. A real WorkerServer's entry is a small part of the
bound."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile

import pytest

from monitor.analysis import normalize
from monitor.config import MonitorConfig
from monitor.evidence.view import ViewBuilder
from monitor.polling import (
    FR_DRILLED_QUERY,
    FR_ENTRY_BYTES,
    FR_GROUP_HEAD_BYTES,
    FR_HEAD_BYTES,
    FR_LAST,
    FR_LEADERS_QUERY,
)
from monitor.service import Monitor
from tests.support.monitor_sim import SimRanks
from worker_server.endpoints import filter_fr_dump


def _entry(i: int, **extra) -> dict:
    return {"record_id": i, "pg_id": 0, "collective_seq_id": i + 1, "p2p_seq_id": 0, "op_id": i + 1,
            "profiling_name": "gloo:all_reduce", "time_created_ns": 0, "input_sizes": [[16]],
            "output_sizes": [[16]], "input_dtypes": ["Float"], "output_dtypes": ["Float"],
            "state": "scheduled", "process_group": ["0", "default_pg"], "is_p2p": False,
            "timeout_ms": 60000, **extra}


def _dump(rank: int, entries: list) -> dict:
    return {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg",
                                                   "ranks": "[0, 1]"}},
            "pg_status": {}, "rank": rank, "replica_group": rank, "entries": entries}


def _fr_dumps(sim: SimRanks, looks: int = 1) -> dict[int, dict]:
    """The last of ``looks`` periodic Flight Recorder looks of a monitor at the simulated ranks
    (all trusted)."""
    urls = [r.url for r in sim.ranks]
    with tempfile.TemporaryDirectory() as d:
        mon = Monitor(MonitorConfig(port=0, targets=urls, state_path=os.path.join(d, "m.db")))
        try:
            view = ViewBuilder().update(mon.discovery.targets(), mon.polling.poller.sweep(urls))
            for r in view.ranks.values():
                r.trust = type("T", (), {"evidence": True})()
            for i in range(looks):
                dumps = mon.polling.fr_dumps(view, 100.0 + 10 * i)
            return dumps
        finally:
            mon.stop()


def test_an_answer_past_what_its_last_entries_need_is_refused(caplog):
    bound = FR_HEAD_BYTES + 2 * FR_GROUP_HEAD_BYTES + FR_LAST * FR_ENTRY_BYTES  # 2 groups
    pad = "x" * (1 << 20)
    sim = SimRanks.start(2)
    try:
        # the query ignored: a dump of a dozen 1 MiB entries, under --max-fr-bytes (64 MiB)
        sim.ranks[0].fr = _dump(0, [_entry(i, pad=pad) for i in range(bound // len(pad) + 2)])
        sim.ranks[1].fr = _dump(1, [_entry(i) for i in range(8)])
        with caplog.at_level(logging.WARNING, logger="monitor.polling"):
            dumps = _fr_dumps(sim, looks=3)  # said once, not every look
    finally:
        sim.stop()
    assert sorted(dumps) == [1]
    said = [m for m in caplog.messages if sim.ranks[0].url in m]
    assert len(said) == 1 and f"?last={FR_LAST}" in said[0] and f"at most {bound} bytes" in said[0]


def test_a_rank_ignoring_last_keeps_its_newest_entries_as_a_cut_dump():
    sim = SimRanks.start(1)
    try:
        sim.ranks[0].fr = _dump(0, [_entry(i) for i in range(FR_LAST + 100)])
        dumps = _fr_dumps(sim)
    finally:
        sim.stop()
    got = dumps[0]
    assert [e["record_id"] for e in got["entries"]] == list(range(100, FR_LAST + 100))
    assert got["filter"] == {"pg": None, "last": FR_LAST, "entries_total": FR_LAST + 100}
    assert normalize(got).cut


GLOO = r"""
import json, os, sys, tempfile
os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"  # before torch is imported: read at startup
import torch, torch.distributed as dist
from worker_server.flight_recorder import fr_dump
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
pair = dist.new_group([0])
for _ in range(50):
    dist.all_reduce(torch.ones(16, 16))
    dist.all_gather([torch.empty(4, 4, 4)], torch.ones(4, 4, 4), group=pair)
    dist.broadcast(torch.ones(8), 0)
doc = json.loads(fr_dump(None, {"rank": 0}))
print(json.dumps([len(json.dumps(e, separators=(",", ":"))) for e in doc["entries"]]))
os._exit(0)
"""


def test_a_real_workerservers_entry_is_a_small_part_of_the_bound(tmp_path):
    """torch's JSON dump carries no stack frames: a gloo entry is some 500 bytes, so the bound
    per entry leaves room for a coalesced collective of many tensors."""
    out = subprocess.run([sys.executable, "-c", GLOO, str(tmp_path / "store")], capture_output=True,
                         text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-2000:]
    sizes = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(sizes) == 150
    assert max(sizes) * 32 < FR_ENTRY_BYTES


@pytest.mark.parametrize("groups", [3, 1_250, 12_500])
def test_a_real_answer_with_every_incarnation_of_a_large_job_is_within_the_bound(groups):
    """The WorkerServer's filtered answer keeps every torchft incarnation (up to 256), each
    naming one global rank a replica group: a job of 12,500 groups of 8 after 256 quorums is
    still read, whichever query."""
    doc = _dump(0, [_entry(i) for i in range(2000)])
    doc["incarnations"] = [
        {"pg_id": 10 + q, "pg_name": f"torchft_quorum_{q}", "quorum_id": q, "group_rank": 0,
         "replica_rank": 3, "replica_world_size": groups,
         "global_ranks": [g * 8 for g in range(groups)], "first_record_id": 100 * q,
         "started_ns": 1_700_000_000_000_000_000 + q} for q in range(256)]
    raw = json.dumps(doc, separators=(",", ":")).encode()
    cfg = MonitorConfig(port=0)
    with tempfile.TemporaryDirectory() as d:
        mon = Monitor(MonitorConfig(port=0, state_path=os.path.join(d, "m.db")))
        try:
            for query, pg, last in ((FR_LEADERS_QUERY, "torchft", 64),
                                    (FR_DRILLED_QUERY, None, FR_LAST)):
                size = len(filter_fr_dump(raw, pg, last))
                assert size <= mon.polling.fr_answer_bytes(query, groups) <= cfg.max_fr_bytes
        finally:
            mon.stop()


def test_a_shards_bound_is_sized_by_the_jobs_groups_not_its_slice():
    """A shard's view holds its slice of the groups; the ranks' incarnations name every group of
    the job (the quorum's participants, as the ranks report them)."""
    from types import SimpleNamespace as NS

    from monitor.polling import job_groups

    slice_ = NS(groups=dict.fromkeys(range(1_562)), quorum_participants=lambda: 12_500)
    assert job_groups(slice_) == 12_500
    assert job_groups(NS(groups=dict.fromkeys(range(3)), quorum_participants=lambda: None)) == 3
