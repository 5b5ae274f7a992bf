"""The monitor against a real torchft job whose ranks run only torch's own debug server.

A real Lighthouse and two replica groups of one rank each (tests/fixtures/
torch_debug_server_job.py: torchft Manager, ProcessGroupGloo, ``start_debug_server()``, no
Lightkeeper code). Group 1 stops at a step before its all-reduce; group 0 blocks in it. The
monitor, given only the Lighthouse and ``--torch-stores``, finds both ranks through the
TCPStores the Lighthouse lists, verifies them, confirms the hang from their Flight Recorder
dumps, names group 1's rank, keeps both ranks' stacks and dumps in an incident bundle that
``lightkeeper analyze`` reads to the same culprit, and evicts group 1 through the Lighthouse (the
kill ends it). The hang starts while the monitor is restarted: the groups the first run timed
stay timed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import requests

from lightkeeper.cluster import LIGHTHOUSE_SCRIPT
from lightkeeper.processes import free_port, stop_process, wait_until
from tests.conftest import IN_CI

pytestmark = pytest.mark.e2e

JOB = Path(__file__).parent / "fixtures" / "torch_debug_server_job.py"


def _need_tabulate() -> None:
    """torch's rank-0 frontend (started by start_debug_server) imports tabulate."""
    try:
        import tabulate  # noqa: F401
    except ImportError:
        msg = "torch's debug server needs tabulate (the test extra: pip install -e '.[test]')"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


def _start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log, "wb") as out:
        # a session of its own: torch's frontend process outlives a rank the Lighthouse kills
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    stop_process(proc, grace=2)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # its session: what it forked (torch's frontend)


def _get(url: str):
    r = requests.get(url, timeout=5)
    r.raise_for_status()
    return r.json() if "json" in r.headers.get("content-type", "") else r.text


def _check_bundle(mon_url: str, decision: dict, tmp_path: Path) -> None:
    """The eviction's incident bundle holds both ranks' stacks (torch's traceback, text) and
    Flight Recorder (the monitor's read), and ``lightkeeper analyze`` names the same rank."""
    bid = decision["bundle"]  # set before the kill is sent
    assert bid, decision
    got = requests.get(f"{mon_url}/v1/incidents/{bid}/bundle", timeout=10)
    assert got.status_code == 200, got.text
    path = tmp_path / "bundle.tar.gz"
    path.write_bytes(got.content)
    with tarfile.open(path) as tar:
        files = {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar if m.isfile()}
    manifest = json.loads(files["manifest.json"])
    rows = {r["rank"]: r for r in manifest["ranks"]}
    assert sorted(rows) == [0, 1], manifest["ranks"]
    for rank, row in rows.items():
        assert row["torch_only"] and (row["stacks"], row["fr_trace"]) == ("ok", "ok"), row
        assert row["fr_trace_at"] <= manifest["created_at"] + 1, row
        assert b"torch_debug_server_job.py" in files[f"stacks/rank{rank}.txt"]
        dump = json.loads(files[f"fr/rank{rank}.json"])
        assert dump["rank"] == rank and dump["entries"], dump.keys()
    out = subprocess.run([sys.executable, "-m", "lightkeeper.cli", "analyze", "--format",
                          "json", str(path)], capture_output=True, text=True, timeout=120)
    report = json.loads(out.stdout)
    [b] = report["bundles"]
    assert (b["culprit_ranks"], b["analysis_agrees"]) == ([1], True), (b, report["findings"])


class TorchOnlyJob:
    """A real Lighthouse, two one-rank groups of tests/fixtures/torch_debug_server_job.py (group
    1 hangs once ``hang`` exists) and the monitor on --torch-stores; every process ``stop``s."""

    def __init__(self, tmp_path: Path, transport: str = "http") -> None:
        self.tmp, self.transport, self.procs = tmp_path, transport, []
        self.hang = tmp_path / "hang"
        self.groups: dict[int, subprocess.Popen] = {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        url_file = tmp_path / "lighthouse.url"
        # min_replicas 2: the groups start training together; with 1, a group that starts a
        # few seconds sooner trains alone and the other never forms a quorum with it
        self.procs.append(_start([sys.executable, "-u", "-c", LIGHTHOUSE_SCRIPT, "2", "1000",
                                  "3000", str(url_file), "127.0.0.1"], tmp_path / "lighthouse.log"))
        self.lighthouse = wait_until(lambda: url_file.exists() and url_file.read_text().strip(),
                                     30, what="the Lighthouse")

    def start_group(self, g: int, log: str) -> None:
        env = {**os.environ, "REPLICA_GROUP_ID": str(g), "RANK": "0", "WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "DEBUG_FRONTEND_PORT": str(free_port()), "TORCHFT_LIGHTHOUSE": self.lighthouse,
               "CHECKPOINT_TRANSPORT": self.transport,
               **({"HANG_FILE": str(self.hang)} if g == 1 else {})}
        self.groups[g] = _start([sys.executable, "-u", str(JOB)], self.tmp / log, env)
        self.procs.append(self.groups[g])

    def start_monitor(self, log: str) -> None:
        self.procs.append(_start([sys.executable, "-m", "lightkeeper.cli", "monitor", "--port",
                                  str(self.port), "--lighthouse", self.lighthouse,
                                  "--torch-stores", "--state", str(self.tmp / "monitor.sqlite"),
                                  "--interval", "0.5", "--hang-floor", "2", "--min-replicas",
                                  "1", "--cooldown", "5"], self.tmp / log))
        self.monitor = self.procs[-1]
        wait_until(self.serving, 30, interval=0.2, what="the monitor to serve")

    def stop_monitor(self) -> None:
        _stop(self.monitor)
        self.procs.remove(self.monitor)

    def serving(self) -> bool:
        assert self.monitor.poll() is None, "the monitor exited"
        with contextlib.suppress(requests.RequestException):
            return requests.get(self.url + "/healthz", timeout=1).ok
        return False

    def timed(self) -> set[str]:
        """The replica ids the monitor shows stepped twice since it first saw them (a killed
        incarnation's row stays until it is forgotten)."""
        return {r["replica_id"] for r in _get(self.url + "/v1/ranks")
                if r.get("torch_only") and r["torch_only"]["timed"]}

    def hang_found(self) -> dict | None:
        for p in (self.procs[0], self.monitor, self.groups[0]):  # the Lighthouse first
            assert p.poll() is None, (p.args, p.returncode)
        found = [f for f in _get(self.url + "/v1/findings") if f["kind"] == "hang"]
        return found[0] if found else None

    def stop(self) -> None:
        for p in reversed(self.procs):
            _stop(p)


@pytest.fixture
def job(tmp_path):
    """``job(transport)`` makes the test's :class:`TorchOnlyJob`, stopped after it."""
    _need_tabulate()
    made: list[TorchOnlyJob] = []

    def make(transport: str = "http") -> TorchOnlyJob:
        made.append(TorchOnlyJob(tmp_path, transport))
        return made[-1]

    yield make
    for j in made:
        j.stop()


def test_torch_only_ranks_hang_found_and_group_evicted(job, tmp_path):
    job = job()
    for g in range(2):
        job.start_group(g, f"group{g}.log")
    job.start_monitor("monitor.log")
    mon_url = job.url
    # a group the monitor first sees is held as on its first step until it steps twice
    # (docs/torch_debug_server.md): group 1 hangs once both are timed, while the monitor is
    # restarted on its --state, which keeps the groups it timed (else held to 300 s)
    wait_until(lambda: len(job.timed()) == 2, 60, interval=0.2, what="both groups timed")
    job.stop_monitor()
    job.hang.touch()
    job.start_monitor("monitor.restarted.log")

    finding = wait_until(job.hang_found, 90, interval=0.2, what="the monitor to find the hang")
    # the culprit: group 1's rank (global rank 1), never in the all-reduce group 0 waits in
    assert finding["replica_group"] == 1 and finding["ranks"] == [1], finding
    assert finding["replica_id"].startswith("torch_only_1:")
    ev = finding["evidence"]
    assert ev["level"] == "cross_group" and ev["waiting_ranks"] == [0], ev
    assert ev["waits"]["0"]["scope"] == "cross"
    culprit = ev["culprits"][0]
    assert culprit["stacks"].endswith("/handler/dump_traceback")
    # its stacks, read through torch's handler when the hang was confirmed (the eviction
    # ends the process): the rank stopped where the script hangs
    assert 'torch_debug_server_job.py", line' in culprit["stacks_text"], culprit

    def evicted():  # past "sending": its bundle is linked before the kill goes out
        done = [d for d in _get(mon_url + "/v1/evictions")
                if d["decision"] == "evict" and d["replica_group"] == 1
                and d.get("status") != "sending"]
        return done[0] if done else None

    decision = wait_until(evicted, 30, interval=0.2, what="group 1 evicted")
    assert decision["replica_id"] == finding["replica_id"]
    _check_bundle(mon_url, decision, tmp_path)
    # the Lighthouse's kill ends group 1's process; group 0 is left alone
    wait_until(lambda: job.groups[1].poll() is not None, 20, what="group 1 to exit")
    assert job.groups[0].poll() is None

    # both ranks were read through torch's server only, verified like any other rank
    rows = _get(mon_url + "/v1/ranks")
    torch_rows = [r for r in rows if r["url"].startswith("torch+http://")]
    assert sorted(r["rank"] for r in torch_rows) == [0, 1], rows
    for r in torch_rows:
        assert r["source"] == "torch_store" and r["torch_only"]["cannot_show"]
        assert "fr_trace_json" in r["torch_only"]["handlers"]
    row0 = next(r for r in torch_rows if r["rank"] == 0)
    assert row0["verification"]["state"] == "verified", row0
    cluster = _get(mon_url + "/v1/cluster")
    assert cluster["torch_only"]["store_discovery"] is True
    assert any("compute/wait" in c for c in cluster["torch_only"]["cannot_show"])
    assert "torch&#39;s server only" in _get(mon_url + "/") or \
        "torch's server only" in _get(mon_url + "/")


def test_a_hang_after_a_heal_over_pgtransport_is_found(job):
    """A group restarted into the job heals over torchft's PGTransport on the Manager's gloo
    group: gloo counts that send/recv in ``pg_status`` and records no entry of them. A hang
    after it is still named (the counts read as the entries' sequence ids; before, every rank
    read as blocked in nothing and no hang was found)."""
    job = job("pg")
    for g in range(2):
        job.start_group(g, f"group{g}.log")
    job.start_monitor("monitor.log")
    first = wait_until(lambda: len(t := job.timed()) == 2 and t, 60, interval=0.2,
                       what="both groups timed")
    _stop(job.groups[1])
    job.start_group(1, "group1.restarted.log")
    [healed] = wait_until(lambda: job.timed() - first, 90, interval=0.2,
                          what="group 1's new incarnation healed and timed")
    assert healed.startswith("torch_only_1:"), healed
    log = (job.tmp / "group1.restarted.log").read_text()
    assert "healed over PGTransport" in log, log[-2000:]
    job.hang.touch()
    finding = wait_until(job.hang_found, 30, interval=0.2, what="the monitor to find the hang")
    assert (finding["replica_group"], finding["ranks"]) == (1, [1]), finding
    assert finding["replica_id"] == healed
    assert finding["evidence"]["waiting_ranks"] == [0], finding["evidence"]
