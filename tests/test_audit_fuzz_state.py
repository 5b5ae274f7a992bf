"""A rank's ``/v1/state`` fuzzed: a bad answer is that rank's ``bad_response``, never a failed
sweep.

The ranks here are fakes (tests/support/monitor_sim.py's SimRanks, real sockets): a real
WorkerServer cannot be made to answer garbage. The monitor is real, as a process
(``lightkeeper monitor``) or in-process where each mutant needs a sweep of its own.
"""

from __future__ import annotations

import copy
import json
import random
import sys

import requests

from lightkeeper.processes import start_monitor_process, stop_process, wait_until
from monitor.config import DetectorConfig, MonitorConfig
from monitor.service import Monitor
from tests.support.monitor_sim import SimRanks, rank_state

WEIRD = [None, True, False, 0, -1, 2**63, 2**70, 1e308, float("nan"), float("inf"), "", "x",
         "\u00e9\u2603", "a" * 3000, [], {}, [1, 2], {"a": 1}, [[[[]]]], 0.5, "1"]


def sample(rank: int) -> dict:
    s = rank_state(rank, rank // 2)
    s.update(group_rank=rank % 2, group_world_size=2, node=f"n{rank // 2}", local_rank=rank % 2,
             device={"type": "cpu"}, timing={
                 "last_step": None, "window": None, "waiting": {"scope": "cross", "seconds": 0.1},
                 "recent": [{"step": i, "step_s": 0.2, "compute_s": 0.1, "wait_cross_s": 0.05,
                             "wait_group_s": 0.05} for i in range(90, 100)], "clock": "host"})
    return s


def mutant(rng: random.Random, doc: dict) -> dict:
    """``doc`` with 1 to 3 values (top level or in ``timing``) replaced, deleted or added."""
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 3)):
        target = doc["timing"] if rng.random() < 0.2 and isinstance(doc.get("timing"), dict) \
            else doc
        if not target:
            continue
        key, op = rng.choice(sorted(target)), rng.random()
        if op < 0.15:
            del target[key]
        elif op < 0.25:
            target[f"extra{rng.randint(0, 9)}"] = copy.deepcopy(rng.choice(WEIRD))
        else:
            target[key] = copy.deepcopy(rng.choice(WEIRD))
    return doc



def monitor_over(sim: SimRanks, tmp_path, sweeps: int):
    """A ``lightkeeper monitor`` process polling ``sim``'s ranks, once it swept ``sweeps`` times."""
    proc, url = start_monitor_process(
        [sys.executable, "-m", "lightkeeper.cli", "monitor", "--port", "0", "--interval", "0.2",
         "--job", "sim", "--targets", ",".join(sim.urls), "--state",
         str(tmp_path / "state.sqlite")], tmp_path / "out.log", tmp_path / "err.log")
    try:
        wait_until(lambda: requests.get(url + "/healthz", timeout=5).json()["sweeps"] >= sweeps,
                   20, what=f"{sweeps} sweeps")
    except BaseException:
        stop_process(proc, grace=3)
        raise
    return proc, url

def test_a_wrong_typed_key_is_that_ranks_bad_response_and_sweeps_go_on(tmp_path):
    """``num_participants: ""`` (int() of it) or a dict as ``replica_id`` (a dict key of the
    view) from one rank failed every sweep of the whole monitor: no sweep ended, nothing was
    detected for any rank. Now that rank alone is a bad_response naming the key."""
    sim = SimRanks.start(4, groups=2)
    proc = None
    try:
        sim.ranks[1].update(num_participants="")
        sim.ranks[2].update(replica_id={"a": 1})
        proc, url = monitor_over(sim, tmp_path, sweeps=3)
        ranks = {r["url"]: r for r in requests.get(url + "/v1/ranks", timeout=5).json()}
        good, bad = [sim.ranks[0], sim.ranks[3]], {sim.ranks[1]: "num_participants is ''",
                                                   sim.ranks[2]: "replica_id is {'a': 1}"}
        assert all(ranks[r.url]["reachable"] for r in good)
        for r, why in bad.items():
            assert not ranks[r.url]["reachable"] and why in ranks[r.url]["error"], ranks[r.url]
        assert "Traceback" not in (tmp_path / "err.log").read_text()
    finally:
        if proc is not None:
            stop_process(proc)
        sim.stop()


def test_fuzzed_states_never_fail_a_sweep_or_an_api_answer(tmp_path):
    """Seeded mutants of one rank's answer (wrong types, NaN, huge numbers and strings, keys
    missing or added, packed or not), one sweep each: no sweep raises, no API answer is a
    500, and a good answer after them is read again."""
    rng = random.Random(20261127)
    sim = SimRanks.start(4, groups=2)
    mon = Monitor(MonitorConfig(port=0, interval_s=3600, state_path=str(tmp_path / "s.sqlite"),
                                job="sim", targets=sim.urls,
                                detectors=DetectorConfig(dead_sweeps=2)))
    try:
        mon.start()  # its loop sweeps once, then waits an hour: this test sweeps
        wait_until(lambda: mon.sweeps >= 1, 20, what="the loop's first sweep")
        for i in range(60):
            for n, r in enumerate(sim.ranks):
                r.state = sample(n)
            victim = sim.ranks[rng.randrange(4)]
            victim.state = bad = mutant(rng, victim.state)
            if rng.random() < 0.3:
                bad["packed"] = 1
                if isinstance(bad.get("timing"), dict):
                    bad["timing"]["recent"] = rng.choice(["", "AAAA", "@@", "A" * 53 + "=", 5])
            mon.sweep_once()
            for path in ("/v1/cluster", "/v1/ranks", "/metrics", "/v1/findings", "/"):
                got = requests.get(mon.url + path, timeout=10)
                assert got.status_code < 500, (i, bad, path, got.text[:500])
        for n, r in enumerate(sim.ranks):
            r.state = sample(n)
        mon.sweep_once()
        assert all(r["reachable"] for r in requests.get(mon.url + "/v1/ranks", timeout=10).json())
    finally:
        mon.stop()
        sim.stop()


def test_a_rank_number_beyond_int64_is_a_bad_response_not_a_broken_ledger(tmp_path):
    """``replica_group`` or ``rank`` past int64 from one rank broke the goodput ledger for the
    rest of the monitor's life (OverflowError every sweep, also once the rank answered well)."""
    sim = SimRanks.start(3)
    proc = None
    try:
        sim.ranks[1].update(replica_group=2**70)
        sim.ranks[2].update(rank=-2**64)
        proc, url = monitor_over(sim, tmp_path, sweeps=3)
        ranks = {r["url"]: r for r in requests.get(url + "/v1/ranks", timeout=5).json()}
        assert ranks[sim.ranks[0].url]["reachable"]
        for r in sim.ranks[1:]:
            assert "beyond int64" in ranks[r.url]["error"], ranks[r.url]
        assert requests.get(url + "/v1/goodput", timeout=5).json()["error"] is None
        assert "goodput ledger failed" not in (tmp_path / "err.log").read_text()
    finally:
        if proc is not None:
            stop_process(proc)
        sim.stop()


def strict_json(text: str):
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_nan_and_infinity_from_a_rank_never_reach_the_api(tmp_path):
    """A rank serving NaN or 1e400 (read as infinity) in fields the API passes on made
    ``/v1/cluster`` and ``/v1/ranks`` answer ``NaN``/``Infinity``, which no strict JSON reader
    (jq, a browser's JSON.parse) takes: one rank broke the API for every client."""
    sim = SimRanks.start(3)
    proc = None
    try:
        sim.ranks[1].update(last_step_seconds=float("inf"), faults=[float("nan")])
        sim.ranks[2].update(phase_s=float("nan"))
        proc, url = monitor_over(sim, tmp_path, sweeps=3)
        ranks = {r["url"]: r for r in strict_json(requests.get(url + "/v1/ranks",
                                                                timeout=5).text)}
        assert ranks[sim.ranks[1].url]["last_step_seconds"] is None
        assert ranks[sim.ranks[1].url]["faults"] == [None]
        assert ranks[sim.ranks[2].url]["phase_for_s"] is not None  # from its phase_since
        assert all(r["reachable"] for r in ranks.values())
        strict_json(requests.get(url + "/v1/cluster", timeout=5).text)
    finally:
        if proc is not None:
            stop_process(proc)
        sim.stop()


def test_a_rank_cannot_claim_the_keys_only_the_monitor_writes(tmp_path):
    """``stacks_url`` and ``torch_only`` are the monitor's own, for ranks on torch's debug
    server: claimed in a rank's /v1/state, the first chose the address the monitor POSTs to
    for a culprit's stacks (its answer kept in the finding anyone may read), the second made
    the monitor skip the rank's Flight Recorder."""
    sim = SimRanks.start(2)
    proc = None
    try:
        sim.ranks[1].update(stacks_url="http://127.0.0.1:9/anything",
                            torch_only={"cannot_show": ["x"]})
        proc, url = monitor_over(sim, tmp_path, sweeps=2)
        row = {r["url"]: r for r in requests.get(url + "/v1/ranks", timeout=5).json()}[
            sim.ranks[1].url]
        assert row["reachable"] and row["stacks_url"] is None and row["torch_only"] is None
    finally:
        if proc is not None:
            stop_process(proc)
        sim.stop()
