"""Flight Recorder times from ranks whose wall clocks are off or stepped, read by ``lightkeeper
analyze`` as a user runs it (docs/analyze.md): dumps written by tests/support/frgen.py."""

from __future__ import annotations

from tests.support.frgen import FRJob, write_dumps
from tests.support.workers import analyze_cli


def test_a_hang_whose_waiting_ranks_clock_was_set_back_is_still_a_hang(tmp_path):
    """Rank 3 never enqueued seq 8; the others' wall clocks were set back 10 minutes after
    they enqueued it, so their dumps are dated before it. Before, that age (-600 s) was read as
    "enqueued just before the dump: in flight" and the hang was not reported."""
    job = FRJob(4, flavour="gloo")
    job.repeat(8, [("0", "all_reduce", [[1024]])])
    dumps = job.dumps()
    dumps[3]["entries"] = dumps[3]["entries"][:-1]
    for d in dumps.values():
        d["dump_time_ns"] = max(e["time_created_ns"] for e in d["entries"]) - 600 * 10**9
    rc, out = analyze_cli(*write_dumps(dumps, tmp_path, fmt="json"))
    hangs = [f for f in out["findings"] if f["kind"] == "hang"]
    assert rc == 1 and len(hangs) == 1, (rc, out["findings"])
    assert hangs[0]["culprit_ranks"] == [3] and hangs[0]["seq"] == 8, hangs[0]
