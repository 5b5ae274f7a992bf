"""deploy/kubernetes/ read as a cluster would run it: what the pod specs imply for the processes
they start. No kubelet or container runtime runs here, so a pod's PID namespace is made with
``unshare`` (util-linux), and the signal the kubelet sends on a delete is sent by the test."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml

# torchft_lighthouse's Rust main without importing torch
from tests.test_deploy_kubernetes import LIGHTHOUSE_MAIN

KDIR = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
GRACE_S = 30  # the pod's default terminationGracePeriodSeconds


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _pod_specs() -> list[tuple[str, dict]]:
    out = []
    for f in sorted(KDIR.rglob("*.yaml")):
        for d in _docs(f):
            spec = d.get("spec", {})
            if d["kind"] in {"Deployment", "StatefulSet"}:
                out.append((f"{d['kind']}/{d['metadata']['name']}", spec["template"]["spec"]))
            elif d["kind"] == "LeaderWorkerSet":
                for k in ("leaderTemplate", "workerTemplate"):
                    if k in spec["leaderWorkerTemplate"]:
                        out.append((f"LeaderWorkerSet/{d['metadata']['name']} {k}",
                                    spec["leaderWorkerTemplate"][k]["spec"]))
    return out


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _poll(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := cond()):
            return value
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout_s} s")


def test_the_lighthouse_pod_ends_on_the_kubelets_sigterm(tmp_path):
    """`kubectl delete`, a rollout restart or a node drain sends SIGTERM to the container's
    process. torchft_lighthouse sets no handler for it, so as its PID namespace's init (PID 1)
    it would ignore it, and every restart of the job's Lighthouse would wait out the grace
    period. Run the manifest's command as the pod spec places it and send that SIGTERM."""
    if not shutil.which("unshare"):
        pytest.skip("unshare (util-linux) not on PATH")
    (dep,) = [d for d in _docs(KDIR / "base" / "lighthouse.yaml") if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["torchft_lighthouse"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the ConfigMap's values do not matter here; the address is loopback, not [::]
    args = [f"--bind=127.0.0.1:{port}" if a.startswith("--bind=") else re.sub(r"\$\(\w+\)", "1", a)
            for a in c["args"]]
    script = tmp_path / "torchft_lighthouse"
    script.write_text(LIGHTHOUSE_MAIN)
    main = [sys.executable, str(script), *args]
    # with shareProcessNamespace the pause container is PID 1 (a shell stands in for it)
    init = ["sh", "-c", '"$@" & wait', "pause", *main] if pod.get("shareProcessNamespace") \
        else main
    userns = [] if os.geteuid() == 0 else ["--map-root-user"]
    ns = subprocess.Popen(["unshare", *userns, "--pid", "--kill-child", *init],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        first = _poll(lambda: _children(ns.pid) or ns.poll() is not None, 10, "PID 1")
        if ns.poll() is not None:
            pytest.skip(f"unshare --pid refused here: {ns.stderr.read().decode().strip()}")
        (pid1,) = first
        lighthouse = pid1 if not pod.get("shareProcessNamespace") else \
            _poll(lambda: _children(pid1), 10, "Lighthouse under the pause stand-in")[0]

        def answers() -> bool:
            try:
                return requests.get(f"http://127.0.0.1:{port}/status", timeout=2).ok
            except requests.ConnectionError:
                return False
        _poll(answers, 60, "Lighthouse answering /status")
        os.kill(lighthouse, signal.SIGTERM)
        _poll(lambda: _gone(lighthouse), 10, f"exit on SIGTERM (the kubelet waits {GRACE_S} s, "
                                             "then kills)")
    finally:
        ns.kill()  # --kill-child: the namespace's PID 1, and with it every process in it
        ns.wait(timeout=10)


def test_every_container_drops_all_linux_capabilities():
    """No container keeps the runtime's default capabilities (NET_RAW, CHOWN, SETUID, ...):
    none of these processes needs one, the trainers included (GPUs are reached through device
    files, not capabilities)."""
    checked = []
    for where, spec in _pod_specs():
        for c in spec["containers"]:
            caps = c.get("securityContext", {}).get("capabilities", {})
            assert caps.get("drop") == ["ALL"], f"{where} {c['name']}: {caps}"
            checked.append(where)
    assert len(checked) == 4, checked  # Lighthouse, monitor, StatefulSet and LWS trainers


# a rank: the hook of `lightkeeper run` (armed at interpreter start) and a WorkerServer, its
# main thread blocked in C as a rank in a collective
RANK_SCRIPT = """
import select
from worker_server import WorkerServer
server = WorkerServer.start()  # held, as the hook holds it on the rank's Manager
print("url:", server.url, flush=True)
select.select([], [], [])
"""


@pytest.mark.parametrize("workload", ["statefulset", "leaderworkerset"])
def test_a_trainer_rank_sigtermed_by_kubernetes_says_it_stopped(workload):
    """A rolling update, `kubectl delete pod`, a drain and the quarantine's own pod deletes
    SIGTERM the ranks. Unsaid, the monitor counts the group dead against its node
    (docs/run.md, Planned stops). Run a rank with the environment the manifest gives it
    (its env, then what its `lightkeeper run` command adds, then torchrun's RANK), poll it as
    the monitor does and SIGTERM it."""
    import argparse

    from lightkeeper.processes import stop_process
    from lightkeeper.run import add_arguments, hook_env
    from rank_wire import MONITOR_AGENT

    (doc,) = _docs(KDIR / "training" / workload / "training.yaml")[:1]
    tpl = doc["spec"]["template"] if workload == "statefulset" else \
        doc["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    (c,) = tpl["spec"]["containers"]
    # literal values as written; no monitor to register with, and an ephemeral port here
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e and "$(" not in e["value"]}
    env.update(LIGHTKEEPER_WORKER_PORT="0", LIGHTKEEPER_WORKER_HOST="127.0.0.1")
    env.pop("LIGHTKEEPER_MONITOR")
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(c["command"][2:])
    assert args.cmd[:2] == ["--", "torchrun"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTKEEPER_")}
    env = {**base, **env}
    env = {**env, **hook_env(args, env), "RANK": "0", "LOCAL_RANK": "0"}
    proc = subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    answers: list[dict] = []

    def poll_as_the_monitor(url: str) -> None:
        with requests.Session() as s:
            while proc.poll() is None:
                try:
                    answers.append(s.get(url, timeout=5, headers={
                        "User-Agent": MONITOR_AGENT}).json())
                except requests.RequestException:
                    pass
                time.sleep(0.2)  # the monitor's poll interval, not a synchronization

    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("url: "), line + proc.stdout.read()
        threading.Thread(target=poll_as_the_monitor, args=(line.split()[1] + "/v1/state",),
                         daemon=True).start()
        _poll(lambda: len(answers) >= 2, 10, "two reads")
        assert answers[-1]["stopped_by"] is None
        proc.send_signal(signal.SIGTERM)  # as torchrun passes the kubelet's on to its ranks
        assert proc.wait(timeout=20) == -signal.SIGTERM
        assert answers[-1]["stopped_by"] == "SIGTERM", answers[-1]
    finally:
        stop_process(proc, grace=0)
