"""What the slurm sink checks a claimed node against: each rank's Slurm job (``SLURM_JOB_ID``,
set by srun/sbatch) reported in ``/v1/state``, kept through the monitor's decoding, carried by
a finding's culprits into the host's record and the sink's event (the sink against a real
controller: tests/test_slurm_sink_claims.py)."""

from __future__ import annotations

import json

from monitor.detect.rank_state import describe_ranks
from monitor.evidence.rank import last_known
from monitor.poll.packed_state import STATE_DECODER
from tests.test_hosts import Clock, RecordingSink, finding, ledger
from worker_server.state import RankIdentity, RankState


def test_a_rank_reports_its_slurm_job_and_the_monitor_keeps_it(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    state = RankState(RankIdentity(job="unit")).snapshot()
    assert state["slurm_job_id"] == "4242"
    decoded = STATE_DECODER.decode(json.dumps(state))
    assert decoded["slurm_job_id"] == "4242"
    assert last_known(decoded)["slurm_job_id"] == "4242"  # a dead rank's node is checked too
    view = type("V", (), {"rank_view": lambda self, r: type("R", (), {
        "state": decoded, "url": "http://127.0.0.1:1", "reachable": True})()})()
    assert describe_ranks(view, [0])[0]["slurm_job_id"] == "4242"
    monkeypatch.delenv("SLURM_JOB_ID")
    assert RankState(RankIdentity(job="unit")).snapshot()["slurm_job_id"] is None


def test_the_sink_event_names_the_slurm_jobs_the_hosts_ranks_ran_in(tmp_path):
    clock, sink = Clock(), RecordingSink()
    led = ledger(tmp_path, clock, [sink])
    f = finding("hang", "h1", 1)
    f["evidence"]["culprits"][0]["slurm_job_id"] = "4242"
    f["evidence"]["culprits"].append({"rank": 3, "host": "h1", "slurm_job_id": "4243"})
    led.record([f], clock())
    assert [d["decision"] for d in led.decide(clock(), None, 10)] == ["quarantine"]
    assert led.run_actions(clock()) == 1
    assert sink.calls[0]["slurm_jobs"] == ["4242", "4243"]
