"""A job across hosts as the docs deploy it (docs/run.md, Across hosts): every host a network
namespace of its own with its own host name (lightkeeper/fabric.py), a real Lighthouse and the
real monitor on one (``--bind 0.0.0.0``, ``LIGHTKEEPER_REGISTER_TOKEN``), replica groups of the real
trainer on two others under ``lightkeeper run --monitor http://mon:19400 --worker-host 0.0.0.0``,
and a bare WorkerServer left at the default 127.0.0.1 on a third. Checked: what each part binds,
advertises and registers, that the groups train in one quorum and a group restarted on another
host heals from its peer, and what the monitor reports and hands Prometheus (``--sd-out``).
Needs root, iproute2 and unshare: skipped with ``Fabric.unavailable()``'s reason elsewhere. The
other tests run in-process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from lightkeeper.fabric import Fabric
from lightkeeper.processes import stop_process
from tests.support.lines import first_line

TOKEN = "multihost-register-token"
RANK = r"""
import sys
from worker_server import WorkerServer
srv = WorkerServer.start(replica_group=int(sys.argv[1]))
print(srv.url, flush=True)
sys.stdin.read()
srv.stop()
"""


def poll(fn, timeout: float = 20.0):
    """``fn()``'s first truthy answer within ``timeout`` s (AssertionError otherwise)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out := fn():
            return out
        time.sleep(0.1)
    raise AssertionError(f"nothing within {timeout:g}s")


def group_on(fab: Fabric, node: str, group: int, log: Path) -> subprocess.Popen:
    """Replica group ``group`` of the trainer on ``node``, as docs/run.md's Across hosts runs a
    training host's ranks (its output in ``log``)."""
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": "http://mon:29510", "REPLICA_GROUP_ID": str(group),
           "LIGHTKEEPER_REGISTER_TOKEN": TOKEN}
    lk = [sys.executable, "-m", "lightkeeper.cli"]
    with log.open("w") as out:  # the child keeps its own
        return subprocess.Popen(fab.wrap(node, [
            *lk, "run", "--monitor", "http://mon:19400", "--worker-host", "0.0.0.0",
            "--", *lk, "train", "--no-worker-server",
            "--steps", "100000", "--step-pause", "0.1", "--pg-timeout", "5",
            "--quorum-timeout", "20", "--connect-timeout", "10"]),
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)


def served_url(proc: subprocess.Popen, log: Path) -> str:
    """The URL the hook's line in ``log`` says ``proc``'s rank is served at (polled)."""
    def line():
        assert proc.poll() is None, log.read_text()[-3000:]
        return next((ln for ln in log.read_text().splitlines() if "worker_server=" in ln), None)
    return poll(line, 60.0).split("worker_server=")[1].split()[0]


@pytest.mark.e2e
@pytest.mark.solo
@pytest.mark.skipif(bool(Fabric.unavailable()), reason=f"no network namespaces: {Fabric.unavailable()}")
def test_ranks_on_other_hosts_register_reachably_and_train(tmp_path):
    Fabric.sweep_stale()  # what a killed earlier run left
    procs: list[subprocess.Popen] = []
    with Fabric.create(["trn-a", "trn-b", "mon", "trn-c"]) as fab:
        try:
            sd_out = tmp_path / "sd.json"
            lighthouse = [str(Path(sys.executable).with_name("torchft_lighthouse")),
                          "--min_replicas", "1", "--bind", "[::]:29510",
                          "--join_timeout_ms", "500", "--heartbeat_timeout_ms", "1500"]
            procs.append(subprocess.Popen(fab.wrap("mon", lighthouse), stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
            monitor = subprocess.Popen(fab.wrap("mon", [
                sys.executable, "-m", "lightkeeper.cli", "monitor", "--bind", "0.0.0.0",
                "--port", "19400", "--interval", "0.5",
                "--lighthouse", "http://mon:29510",
                "--state", str(tmp_path / "m.sqlite"), "--sd-out", str(sd_out),
                "--no-bundles"]), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                env={**os.environ, "LIGHTKEEPER_REGISTER_TOKEN": TOKEN})
            procs.append(monitor)
            # replica groups 0 and 1 on two hosts, bound to every address
            zero, first = (group_on(fab, "trn-a", 0, tmp_path / "g0.log"),
                           group_on(fab, "trn-c", 1, tmp_path / "g1.log"))
            procs += [zero, first]
            env = {**os.environ, "LIGHTKEEPER_MONITOR": "http://mon:19400",
                   "LIGHTKEEPER_REGISTER_TOKEN": TOKEN}
            with (tmp_path / "trn-b.err").open("w") as err:  # the child keeps its own
                loop = subprocess.Popen(fab.wrap("trn-b", [sys.executable, "-c", RANK, "9"]),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=err, env=env)
            procs.append(loop)
            assert "monitor=" in first_line(monitor, 30.0)
            loop_url = first_line(loop, 30.0)
            assert loop_url.startswith("http://127.0.0.1:"), loop_url
            # a wildcard bind advertises the host's name, which the monitor's host resolves
            wild_url, other_url = (served_url(zero, tmp_path / "g0.log"),
                                  served_url(first, tmp_path / "g1.log"))
            assert wild_url.startswith("http://trn-a:") and other_url.startswith("http://trn-c:")
            base = f"http://{fab.host('mon').addr}:19400"

            def cluster():
                with fab.entered():  # from another host: the monitor's --bind 0.0.0.0 serves it
                    return requests.get(base + "/v1/cluster", timeout=5).json()

            def groups(want: dict[int, str], min_step: int = 1):
                """Each group of ``want`` in the quorum, its rank served at that URL stepping at
                ``min_step`` or beyond: {group: step}."""
                gs = {g["replica_group"]: g for g in cluster()["groups"]}
                ranks = {(g, r["url"]): r for g in gs for r in gs[g]["ranks"]}
                ok = all(g in gs and gs[g]["in_quorum"] and (g, url) in ranks
                         and (ranks[g, url]["step"] or 0) >= min_step for g, url in want.items())
                return ok and {g: ranks[g, url]["step"] for g, url in want.items()}
            # two groups on two hosts commit steps in one quorum, each reported by the monitor
            # under its own host name, polled and answering
            poll(lambda: groups({0: wild_url, 1: other_url}, min_step=3), 60.0)
            ranks = {r["url"]: r for g in cluster()["groups"] for r in g["ranks"]}
            assert [(ranks[u]["host"], ranks[u]["reachable"]) for u in (wild_url, other_url)] \
                == [("trn-a", True), ("trn-c", True)], ranks
            # group 1 restarted on another host heals from group 0 (on trn-a): its step catches up
            stop_process(first, grace=0)
            at = groups({0: wild_url})[0]
            procs.append(moved_proc := group_on(fab, "trn-b", 1, tmp_path / "g1b.log"))
            moved = served_url(moved_proc, tmp_path / "g1b.log")
            assert moved.startswith("http://trn-b:"), moved
            poll(lambda: groups({0: wild_url, 1: moved}, min_step=at), 60.0)
            # its first step follows group 0's (a group trained from scratch logs step=1 first)
            first_step = re.search(r"lightkeeper.trainer INFO step=(\d+)",
                                   (tmp_path / "g1b.log").read_text())
            assert first_step and int(first_step[1]) > at, first_step
            # the loopback rank says in one line why it is not registered, and is not
            err = poll(lambda: "loopback" in (t := (tmp_path / "trn-b.err").read_text()) and t)
            assert err.count("[lightkeeper]") == 1 and "cannot reach this host's loopback" in err \
                and "LIGHTKEEPER_WORKER_HOST" in err, err
            with fab.entered():
                targets = requests.get(base + "/v1/targets", timeout=5).json()
            assert {t["url"] for t in targets} >= {wild_url, moved}, targets
            assert not [t for t in targets if "127.0.0.1" in t["url"]], targets
            # Prometheus on another host is handed the names the ranks registered
            sd = poll(lambda: sd_out.exists() and json.loads(sd_out.read_text()))
            assert {wild_url.removeprefix("http://"), moved.removeprefix("http://")} <= \
                {t for e in sd for t in e["targets"]}, sd
        finally:
            for p in procs:
                stop_process(p, grace=2.0)


def test_a_name_the_monitor_cannot_resolve_is_refused_with_a_token(tmp_path):
    """With a token any address registers, but a rank on 0.0.0.0 registers its host name: one
    the monitor's host cannot resolve (a pod's name) was taken and polled in vain, with no line
    on either side. It is refused now (403, saying why), so the rank says so once. (In-process:
    no namespace needed; ``.invalid`` never resolves.)"""
    from monitor.config import MonitorConfig
    from monitor.service import Monitor

    mon = Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "m.sqlite"),
                                sd_out=str(tmp_path / "sd.json"), register_token=TOKEN)).start()
    try:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        r = requests.post(mon.url + "/v1/targets", json={"url": "http://gpu-node-17.invalid:9400"},
                          headers=auth, timeout=10)
        assert r.status_code == 403 and "gpu-node-17.invalid does not resolve" in r.json()["error"], \
            r.text
        ok = requests.post(mon.url + "/v1/targets", json={"url": "http://10.1.2.3:9400"},
                           headers=auth, timeout=10)  # an address: as before, any
        assert ok.status_code == 200, ok.text
        assert [t["url"] for t in requests.get(mon.url + "/v1/targets", timeout=10).json()] == \
            ["http://10.1.2.3:9400"]
    finally:
        mon.stop()


def test_an_unreachable_lighthouse_is_said_in_a_few_words():
    """A Lighthouse on another host that cannot be reached was logged as urllib3's whole text
    (object reprs, retry counts: 300 characters) in the monitor's line; now as the rank's
    registration failure is, in a few words."""
    from monitor.evidence.lighthouse_status import LighthouseReader

    url = "http://127.0.0.1:1"  # nothing listens on port 1: refused
    status, why = LighthouseReader(url, timeout_s=1).read()
    assert status is None and why == f"{url}/status unreachable: Connection refused", why


@pytest.mark.parametrize("argv, env, said", [
    (["--worker-host", "0.0.0.0:9500"], None, "--worker-host '0.0.0.0:9500' is not an address"),
    (["--worker-host", "http://10.0.0.7"], None, "--worker-host 'http://10.0.0.7' is not"),
    ([], "10.0.0.7:9500", "LIGHTKEEPER_WORKER_HOST '10.0.0.7:9500' is not"),
])
def test_run_refuses_a_worker_host_every_rank_would_refuse(capsys, monkeypatch, argv, env, said):
    """``host:port``, as the Lighthouse's own ``--bind`` takes it, made every rank say in a line
    that it cannot bind, and the job ran unobserved; a port or server kind every rank would
    refuse was already exit 2 before the job started."""
    import argparse

    from lightkeeper import run as lk_run

    parser = argparse.ArgumentParser()
    lk_run.add_arguments(parser)
    monkeypatch.delenv("LIGHTKEEPER_WORKER_HOST", raising=False)
    if env is not None:
        monkeypatch.setenv("LIGHTKEEPER_WORKER_HOST", env)
    assert lk_run.run(parser.parse_args([*argv, "--", "no-such-command-lk"])) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lightkeeper run: {said}") and err.count("\n") == 1, err
    for good in ("0.0.0.0", "::", "[::1]", "10.0.0.7", "trn-a", "node-3.train.example"):
        assert lk_run.bad_worker_host(good, None) is None, good
    # --print-env writes a container spec, whose host may be Kubernetes' $(POD_IP)
    assert lk_run.run(parser.parse_args(["--worker-host", "$(POD_IP)", "--print-env"])) == 0
    assert "LIGHTKEEPER_WORKER_HOST=$(POD_IP)" in capsys.readouterr().out
