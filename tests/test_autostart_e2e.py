"""``lightkeeper run -- COMMAND`` on real processes: a real torchft Lighthouse, gloo, the monitor
(in this process, serving its real HTTP API so ranks register themselves; one Lighthouse and one
monitor per job, the jobs started at once), and jobs that carry no Lightkeeper code: the
project's trainer with its own WorkerServer switched off, and a torchft script written here
against torchft's public API only (Manager, ProcessGroupGloo, DistributedDataParallel or
Manager.allreduce, Optimizer), once with torch's debug server started by the script and
Lightkeeper's endpoints on it (``LIGHTKEEPER_WORKER_SERVER=torch``). Also: a Python program that never imports torchft (the hook
starts nothing and imports nothing) and a WorkerServer that cannot bind its port (one line, the
job finishes with status 0)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import requests

from lightkeeper.processes import stop_process, wait_until
from monitor.config import MonitorConfig
from monitor.service import Monitor
from tests.support.workers import try_state
from worker_server import RankIdentity, RankState

# solo: its Pythons importing torch at once fill both cores, slowing a job beside it
pytestmark = [pytest.mark.e2e, pytest.mark.solo]

LIGHTKEEPER = [sys.executable, "-m", "lightkeeper.cli"]
HOOK_LINE = re.compile(r"^\[lightkeeper\] replica_group=(\d+) group_rank=(\d+) "
                       r"worker_server=(http://\S+) \(lightkeeper run\)$", re.M)

# A torchft job as a user writes it: torch and torchft's public API, nothing of Lightkeeper.
FT_SCRIPT = textwrap.dedent('''
    import faulthandler
    import os
    import signal
    import sys
    import time
    from datetime import timedelta
    from pathlib import Path

    import torch
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    stop_file, max_steps, replica, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's view of a stuck exit
    torch.manual_seed(0)
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    if os.environ.get("START_DEBUG_SERVER"):  # torch's own per-rank debug server, started first
        from torch.distributed.debug import start_debug_server
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
        start_debug_server()
        print(f"store_port={store.port}", flush=True)
    model = torch.nn.Linear(8, 1)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
        load_state_dict=model.load_state_dict, state_dict=model.state_dict,
        replica_id=f"ddp_job_{replica}", store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30))
    if mode == "ddp":
        model = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.01))
    while manager.current_step() < max_steps and not stop_file.exists():
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        if mode == "allreduce":  # what DDP does, by hand
            for p in model.parameters():
                manager.allreduce(p.grad).wait()
        optimizer.step()
        time.sleep(0.05)  # the step's compute
    print(f"done at step {manager.current_step()}", flush=True)
    manager.shutdown(wait=False)
''')


class Env:
    """A real torchft Lighthouse and a monitor (serving its HTTP API, verifying against that
    Lighthouse) for one job: jobs that share a Lighthouse would meet in one quorum."""

    def __init__(self, d: Path, job: str = "lightkeeper") -> None:
        from torchft.coordination import LighthouseServer

        self.dir = d
        self.lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1,
                                           join_timeout_ms=5000, heartbeat_timeout_ms=5000)
        self.lighthouse_url = "http://127.0.0.1:" + self.lighthouse.address().rsplit(":", 1)[1]
        self.monitor = Monitor(MonitorConfig(port=0, interval_s=0.5, job=job,
                                             lighthouse=self.lighthouse_url,
                                             state_path=str(d / "monitor.sqlite"))).start()

    def stop(self) -> None:
        self.monitor.stop()
        self.lighthouse.shutdown()


def start(env: Env, name: str, command: list[str], **extra: str) -> tuple[subprocess.Popen, Path]:
    """``lightkeeper run --monitor URL -- command`` with the env's Lighthouse; stdout+stderr
    go to a log file."""
    log = env.dir / f"{name}.log"
    full_env = {k: v for k, v in os.environ.items() if k != "REPLICA_GROUP_ID"}
    full_env.update(TORCHFT_LIGHTHOUSE=env.lighthouse_url, PYTHONUNBUFFERED="1", **extra)
    with open(log, "wb") as out:
        proc = subprocess.Popen([*LIGHTKEEPER, "run", "--monitor", env.monitor.url, "--",
                                 *command], stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                cwd=env.dir, start_new_session=True)
    return proc, log


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The module's three torch jobs, started at once (most of each one's time is importing
    torch and waiting for its quorum and its monitor); each test checks its own."""
    envs: list[Env] = []
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}
    taken = socket.socket()
    try:
        for name in ("trainer", "ft_job", "clash", "torch_server"):
            d = tmp_path_factory.mktemp(name)
            (d / "ft_job.py").write_text(FT_SCRIPT)
            envs.append(Env(d, job="zero-code" if name == "trainer" else "lightkeeper"))
        trainer, ft_job, clash, torch_server = envs
        procs["trainer"] = start(trainer, "trainer", [
            *LIGHTKEEPER, "train", "--no-worker-server", "--steps", "100000",
            "--step-pause", "0.05", "--pg-timeout", "10"],
            REPLICA_GROUP_ID="1", NUM_REPLICA_GROUPS="2", LIGHTKEEPER_JOB="zero-code")
        stop = ft_job.dir / "stop_b"
        procs["ft_job"] = start(ft_job, "ft_job", [sys.executable, "ft_job.py", str(stop),
                                                   "100000", "2", "ddp"])
        # the port the clash job's WorkerServer asks for is taken until that job has finished
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        procs["clash"] = start(clash, "clash", [sys.executable, "ft_job.py",
                                                str(clash.dir / "never"), "3", "5", "allreduce"],
                               LIGHTKEEPER_WORKER_PORT=str(taken.getsockname()[1]))
        # on torch's server (start_debug_server first): a rank other than 0, as rank 0's
        # start_debug_server also starts torch's HTML frontend, which needs aiohttp (not here)
        (torch_server.dir / "ft_job.py").write_text(FT_SCRIPT)
        procs["torch_server"] = start(
            torch_server, "torch_server", [sys.executable, "ft_job.py", str(torch_server.dir / "stop"),
                                           "100000", "3", "allreduce"],
            LIGHTKEEPER_WORKER_SERVER="torch", START_DEBUG_SERVER="1", RANK="1", WORLD_SIZE="2")
        yield {"trainer": (trainer, *procs["trainer"]), "ft_job": (ft_job, *procs["ft_job"], stop),
               "clash": (clash, *procs["clash"], taken),
               "torch_server": (torch_server, *procs["torch_server"])}
    finally:
        for proc, _ in procs.values():
            stop_process(proc, grace=3)
        taken.close()
        for env in envs:
            env.stop()


def hook_url(proc: subprocess.Popen, log: Path, timeout: float = 90) -> tuple[int, int, str]:
    def found():
        m = HOOK_LINE.search(log.read_text(errors="replace"))
        if m:
            return int(m.group(1)), int(m.group(2)), m.group(3)
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {log.read_text()[-3000:]}")
        return None
    return wait_until(found, timeout, what="the hook's WorkerServer line")


def seen_by_monitor(mon: Monitor, url: str) -> dict:
    """The monitor's row for ``url`` once it registered itself, trains and is verified against
    the Lighthouse (``GET /v1/ranks``)."""
    last: list = [None]

    def rank():
        ranks = requests.get(mon.url + "/v1/ranks", timeout=5).json()
        r = last[0] = next((r for r in ranks if r.get("url") == url), None)
        return r if (r and r["source"] == "registered" and (r["step"] or 0) >= 2
                     and (r["verification"] or {}).get("state") == "verified") else None
    try:
        return wait_until(rank, 60, interval=0.3, what=f"the monitor polling {url}")
    except TimeoutError as e:
        raise AssertionError(f"{e}; the monitor's last row: {last[0]}") from None


def test_trainer_without_its_own_server_is_served_by_the_hook(jobs):
    env, proc, log = jobs["trainer"]
    group, group_rank, url = hook_url(proc, log)
    assert (group, group_rank) == (1, 0)
    assert log.read_text().count("worker_server=") == 1  # the trainer started none
    state = wait_until(lambda: (s := try_state(url)) and s["step"] >= 3 and s, 60,
                       what="3 steps on the hook's WorkerServer")
    assert (state["replica_group"], state["group_rank"], state["group_world_size"],
            state["rank"], state["job"]) == (1, 0, 1, 1, "zero-code")
    assert state["replica_id"].startswith("replica_group_1:")
    assert state["quorum_id"] >= 0 and state["num_participants"] == 1
    rank = seen_by_monitor(env.monitor, url)
    assert rank["replica_group"] == 1
    stop_process(proc, grace=3)  # its cores to the other jobs


def test_plain_torchft_script_is_served_and_seen_by_the_monitor(jobs):
    env, proc, log, stop = jobs["ft_job"]
    group, group_rank, url = hook_url(proc, log)
    # No REPLICA_GROUP_ID: the group comes from the Manager's replica_id, "ddp_job_2".
    assert (group, group_rank) == (2, 0)
    rank = seen_by_monitor(env.monitor, url)
    assert rank["replica_group"] == 2
    state = try_state(url)
    assert state["replica_id"].startswith("ddp_job_2:") and state["commits"] >= 2
    dump = requests.get(url + "/v1/fr_trace", timeout=10).json()
    assert dump["incarnations"] and any(e["profiling_name"] == "gloo:all_reduce"
                                        for e in dump["entries"])
    stop.touch()
    assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    # a clean end without finish() in the script: the hook says it finished, so the monitor
    # forgets the rank as ended instead of finding its group dead
    wait_until(lambda: all(r.get("url") != url for r in
                           requests.get(env.monitor.url + "/v1/ranks", timeout=5).json()),
               30, interval=0.3, what="the monitor forgetting the finished rank")
    findings = requests.get(env.monitor.url + "/v1/findings", timeout=5).json()
    assert not [f for f in findings if f["kind"] == "dead"], findings


def test_a_program_without_torchft_gets_nothing(jobs):
    env = jobs["trainer"][0]
    code = ("import sys, json; print(json.dumps({m: m in sys.modules for m in "
            "('torch', 'torchft', 'flask', 'worker_server.server', 'worker_server.autostart')}))")
    res = subprocess.run([*LIGHTKEEPER, "run", "--monitor", env.monitor.url, "--",
                          sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=env.dir)
    assert res.returncode == 0, res.stderr
    assert "[lightkeeper]" not in res.stdout + res.stderr
    # The hook is installed (its module is loaded) but nothing heavy is imported.
    assert res.stdout.strip() == ('{"torch": false, "torchft": false, "flask": false, '
                                  '"worker_server.server": false, '
                                  '"worker_server.autostart": true}')


def test_a_worker_server_that_cannot_start_costs_one_line_and_the_job_finishes(jobs):
    _, proc, log, taken = jobs["clash"]
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    taken.close()
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.startswith("[lightkeeper]")]
    assert len(lines) == 1, text[-3000:]
    assert lines[0].startswith("[lightkeeper] WorkerServer not started (")
    assert "training goes on without it" in lines[0]
    assert "done at step 3" in text


def test_a_rank_on_torchs_server_is_polled_and_verified_through_its_handlers(jobs):
    """LIGHTKEEPER_WORKER_SERVER=torch in a job that started torch's debug server: one port,
    torch's, with torch's handlers and Lightkeeper's; the monitor reads the rank through
    ``lightkeeper_state`` and verifies it against the Lighthouse like any other."""
    from torch.distributed import TCPStore

    env, proc, log = jobs["torch_server"]
    line = re.compile(r"^\[lightkeeper\] replica_group=3 group_rank=0 "
                      r"worker_server=(torch\+http://127\.0\.0\.1:(\d+)) \(lightkeeper run\)$", re.M)

    def found():
        m = line.search(log.read_text(errors="replace"))
        if m is None and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {log.read_text()[-3000:]}")
        return m and m.groups()
    url, port = wait_until(found, 90, what="the hook's torch+http line")
    # the job's server listens on every address, whatever the WorkerServer's host: said
    assert "which torch binds to every address, not 127.0.0.1" in log.read_text()
    # the port start_debug_server published in the job's store: one server for both
    store_port = int(re.search(r"^store_port=(\d+)$", log.read_text(), re.M).group(1))
    store = TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=10))
    assert store.get("debug_server/rank1").decode().endswith(f":{port}")
    base = f"http://127.0.0.1:{port}"
    assert {"ping", "fr_trace_json", "torch_profile", "lightkeeper_state", "lightkeeper_metrics",
            "lightkeeper_stacks", "lightkeeper_fr_trace"} <= set(
        requests.get(base + "/handler/", timeout=10).json())
    rank = seen_by_monitor(env.monitor, url)  # verified against the Lighthouse
    assert rank["replica_group"] == 3 and rank["group_rank"] == 0
    state = requests.post(base + "/handler/lightkeeper_state", timeout=10).json()
    assert state.keys() == RankState(RankIdentity(job="j", replica_group=0)).snapshot().keys()
    assert state["worker_url"] == url and state["replica_id"].startswith("ddp_job_3:")
    dump = requests.post(base + "/handler/lightkeeper_fr_trace", timeout=10).json()
    assert dump["incarnations"] and any(e["profiling_name"] == "gloo:all_reduce"
                                        for e in dump["entries"])
    assert "lightkeeper_step{" in requests.post(base + "/handler/lightkeeper_metrics",
                                                timeout=10).text
    (env.dir / "stop").touch()
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:  # every thread's stack into its log, then the failure
        proc.send_signal(signal.SIGUSR1)
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: "Thread 0x" in log.read_text(errors="replace"), 5, what="stacks")
        raise AssertionError(f"did not exit within 60 s: {log.read_text()[-6000:]}") from None
    assert code == 0, log.read_text()[-3000:]  # exits clean, torch's server too
