"""`lightkeeper train` and `lightkeeper run` used as docs/trainer.md and docs/run.md show them:
bad values are usage errors (one line, status 2, before torch is imported)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[1]


def lightkeeper(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("LIGHTKEEPER_", "REPLICA_GROUP", "NUM_REPLICA", "TORCHFT_"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "lightkeeper.cli", *argv], cwd=ROOT,
                          env={**base, **(env or {})}, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("argv, env, said", [
    (["--steps", "-1"], {}, "--steps must be >= 0"),
    (["--pg-timeout", "0"], {}, "--pg-timeout must be"),
    (["--worker-port", "70000"], {}, "--worker-port 70000 is not a port"),
    (["--replica-group", "5"], {}, "replica group 5 is not in [0, 2)"),
    (["--num-replica-groups", "0"], {}, "--num-replica-groups 0 must be >= 1"),
    (["--min-replica-size", "0"], {}, "--min-replica-size must be >= 1"),
    (["--inject", "crash:at_step=3,rank=2"], {}, "rank=2 in 'crash:at_step=3,rank=2' is out of "
                                                 "range"),
    (["--inject", "hang:at_step=3,where=group"], {}, "where=group in"),
    ([], {"RANK": "abc"}, "RANK='abc' is not an integer"),
    ([], {"REPLICA_GROUP_ID": "x"}, "REPLICA_GROUP_ID='x' is not an integer"),
    ([], {"LIGHTKEEPER_WORKER_PORT": "abc"}, "LIGHTKEEPER_WORKER_PORT='abc' is not an integer"),
    ([], {"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not in [0, WORLD_SIZE=2)"),
])
def test_a_bad_value_is_one_line_and_status_2(argv, env, said):
    res = lightkeeper("train", "--lighthouse", "http://127.0.0.1:1", *argv, env=env)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert said in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""


def test_no_lighthouse_is_a_usage_error():
    res = lightkeeper("train")
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "no Lighthouse: pass --lighthouse URL or set TORCHFT_LIGHTHOUSE" in res.stderr


@pytest.mark.parametrize("url", ["foo", "127.0.0.1:29510", "http://127.0.0.1:99999"])
def test_a_lighthouse_that_is_not_a_url_is_a_usage_error(url):
    # before: torchft's RuntimeError traceback after the whole connect timeout (60 s)
    res = lightkeeper("train", "--lighthouse", url)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"Lighthouse {url!r} is not an http(s)://host:port URL" in res.stderr
    res = lightkeeper("train", env={"TORCHFT_LIGHTHOUSE": url})
    assert res.returncode == 2 and "is not an http(s)://host:port URL" in res.stderr


def test_a_bad_worker_port_in_the_environment_does_not_break_help():
    # read at parse time before, so even --help died with status 1 on it
    res = lightkeeper("train", "--help", env={"LIGHTKEEPER_WORKER_PORT": "abc"})
    assert res.returncode == 0 and "--worker-port" in res.stdout, res.stderr


@pytest.mark.parametrize("argv, env, said", [
    (["--worker-port", "-1"], {}, "--worker-port -1 is not a port (0-65535)"),
    ([], {"LIGHTKEEPER_WORKER_PORT": "abc"}, "LIGHTKEEPER_WORKER_PORT 'abc' is not a port"),
    ([], {"LIGHTKEEPER_WORKER_PORT": "70000"}, "LIGHTKEEPER_WORKER_PORT '70000' is not a port"),
    ([], {"LIGHTKEEPER_WORKER_PORT": "²"}, "LIGHTKEEPER_WORKER_PORT '²' is not a port"),
    ([], {"LIGHTKEEPER_WORKER_SERVER": "nginx"}, "LIGHTKEEPER_WORKER_SERVER='nginx' is not flask"),
    ([], {"LIGHTKEEPER_CUDA_TIMING": "sometimes"},
     "LIGHTKEEPER_CUDA_TIMING='sometimes': expected one of auto, off"),
])
def test_run_refuses_a_setting_every_rank_would_refuse(argv, env, said):
    # before: exit 0, and each rank said "WorkerServer not started" and trained unobserved
    res = lightkeeper("run", *argv, "--", sys.executable, "-c", "print('job')", env=env)
    assert res.returncode == 2 and res.stdout == "", (res.returncode, res.stdout, res.stderr)
    assert said in res.stderr and res.stderr.count("\n") == 1, res.stderr


def test_run_passes_good_settings_and_the_commands_status():
    env = {"LIGHTKEEPER_WORKER_PORT": "29600", "LIGHTKEEPER_WORKER_SERVER": "Torch"}
    res = lightkeeper("run", "--", sys.executable, "-c", "import sys; sys.exit(3)", env=env)
    assert res.returncode == 3, res.stderr


@pytest.mark.parametrize("host, why", [("999.1.1.1", "Name or service not known"),
                                       ("192.0.2.1", "Cannot assign requested address")])
def test_a_worker_host_not_of_this_host_is_a_usage_error(host, why):
    # before: the one-rank store advertised there, and the rank waited out its connect timeout
    # (a 999.1.1.1 run was still waiting after 90 s)
    res = lightkeeper("train", "--lighthouse", "http://127.0.0.1:1", "--num-replica-groups", "1",
                      "--worker-host", host)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"--worker-host {host!r} cannot be bound on this host: {why}" in res.stderr


def test_a_taken_worker_port_is_one_line_not_a_traceback():
    # no Lighthouse needed: the WorkerServer starts before the Manager connects to it
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = lightkeeper("train", "--lighthouse", "http://127.0.0.1:1", "--num-replica-groups",
                          "1", "--worker-port", str(port), "--connect-timeout", "5")
    assert res.returncode == 1, res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert (f"lightkeeper train: error: WorkerServer: [Errno 98] cannot bind "
            f"http://127.0.0.1:{port}: Address already in use\n") in res.stderr


def test_a_worker_server_variable_it_cannot_read_is_one_line_not_a_traceback():
    res = lightkeeper("train", "--lighthouse", "http://127.0.0.1:1", "--num-replica-groups",
                      "1", "--connect-timeout", "5", env={"LIGHTKEEPER_EXIT_AUTH": "sometimes"})
    assert res.returncode == 1, res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    [line] = [x for x in res.stderr.splitlines() if x.startswith("lightkeeper train: error:")]
    assert "LIGHTKEEPER_EXIT_AUTH" in line, line


def test_an_unreachable_lighthouse_is_one_line_not_a_traceback():
    port = 1  # nothing listens on port 1: refused
    res = lightkeeper("train", "--lighthouse", f"http://127.0.0.1:{port}",
                      "--num-replica-groups", "1", "--connect-timeout", "1")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert (f"lightkeeper train: error: torchft's Manager did not start: failed to connect to "
            f"http://127.0.0.1:{port} within timeout of 1s") in res.stderr, res.stderr[-2000:]


def test_the_trainer_under_lightkeeper_run_says_finished_on_the_hooks_server(tmp_path):
    # `lightkeeper train --no-worker-server` under `lightkeeper run` knows it completed: before,
    # only its own server (absent there) was told, so the rank ended as dead to a monitor
    from torchft.coordination import LighthouseServer

    from lightkeeper.processes import stop_process, wait_until
    from rank_wire import MONITOR_AGENT

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=1000,
                                  heartbeat_timeout_ms=5000)
    log = tmp_path / "rank.log"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LIGHTKEEPER_", "REPLICA_GROUP", "TORCHFT_"))}
    env.update(TORCHFT_LIGHTHOUSE="http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1])
    proc = None
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "lightkeeper.cli", "run", "--", sys.executable, "-m",
                 "lightkeeper.cli", "train", "--no-worker-server", "--num-replica-groups", "1",
                 "--steps", "30", "--step-pause", "0.05"],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

        def hook_url():
            m = re.search(r"worker_server=(\S+) \(lightkeeper run\)", log.read_text())
            return m and m.group(1)

        url = wait_until(hook_url, 90, what="the hook's WorkerServer line")
        answers = []
        with requests.Session() as http:  # read as a monitor does, until the rank is gone:
            http.headers["User-Agent"] = MONITOR_AGENT  # finish() waits for a monitor's read
            while proc.poll() is None:
                try:
                    state = http.get(url + "/v1/state", timeout=2).json()
                    answers.append((state["phase"], state.get("finished")))
                except (requests.RequestException, ValueError):
                    pass
                time.sleep(0.05)  # the poll interval, not a synchronization: finish() waits 3 s
        assert proc.wait(30) == 0, log.read_text()[-3000:]
        assert ("stopped", True) in answers, answers[-5:]
        # the loop reads the hook's instrumented state: its log says the quorum it trains in
        # (it read a private state nothing updated: quorum_id=-1 participants=0 every step)
        steps = re.findall(r"step=\d+ quorum_id=(-?\d+) participants=(\d+) ", log.read_text())
        assert steps and all(q != "-1" and n == "1" for q, n in steps), steps[-3:]
    finally:
        if proc is not None:
            stop_process(proc)
        lighthouse.shutdown()
