"""A job across hosts as the docs deploy it: every host a network namespace of its own with its
own host name (lightkeeper/fabric.py), the real monitor on one (``--bind 0.0.0.0``,
``--register-token``), a real WorkerServer on each of two others registering itself with
``LIGHTKEEPER_MONITOR=http://mon:19400``: one bound to every address (``LIGHTKEEPER_WORKER_HOST=
0.0.0.0``), one left at the default 127.0.0.1. No Lighthouse and no trainer: what is checked is
what each part binds, advertises and registers, and what the monitor reports and hands
Prometheus (``--sd-out``). Needs root, iproute2 and unshare: skipped with
``Fabric.unavailable()``'s reason elsewhere. The last test runs in-process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import requests

from lightkeeper.cluster import stop_process
from lightkeeper.fabric import Fabric
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


@pytest.mark.e2e
@pytest.mark.solo
@pytest.mark.skipif(bool(Fabric.unavailable()), reason=f"no network namespaces: {Fabric.unavailable()}")
def test_ranks_on_other_hosts_register_reachably(tmp_path):
    Fabric.sweep_stale()  # what a killed earlier run left
    procs: list[subprocess.Popen] = []
    with Fabric.create(["trn-a", "trn-b", "mon"]) as fab:
        try:
            sd_out = tmp_path / "sd.json"
            monitor = subprocess.Popen(fab.wrap("mon", [
                sys.executable, "-m", "lightkeeper.cli", "monitor", "--bind", "0.0.0.0",
                "--port", "19400", "--register-token", TOKEN, "--interval", "0.5",
                "--state", str(tmp_path / "m.sqlite"), "--sd-out", str(sd_out),
                "--no-bundles"]), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            procs.append(monitor)
            assert "monitor=" in first_line(monitor, 30.0)
            env = {**os.environ, "LIGHTKEEPER_MONITOR": "http://mon:19400",
                   "LIGHTKEEPER_REGISTER_TOKEN": TOKEN}
            for g, (node, extra) in enumerate([("trn-a", {"LIGHTKEEPER_WORKER_HOST": "0.0.0.0"}),
                                               ("trn-b", {})]):
                with (tmp_path / f"{node}.err").open("w") as err:  # the child keeps its own
                    procs.append(subprocess.Popen(
                        fab.wrap(node, [sys.executable, "-c", RANK, str(g)]),
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                        env={**env, **extra}))
            wild, loop = procs[1:]
            wild_url, loop_url = first_line(wild, 30.0), first_line(loop, 30.0)
            # a wildcard bind advertises the host's name, which the monitor's host resolves
            assert wild_url.startswith("http://trn-a:"), wild_url
            assert loop_url.startswith("http://127.0.0.1:"), loop_url
            base = f"http://{fab.host('mon').addr}:19400"

            def ranks():
                with fab.entered():  # from another host: the monitor's --bind 0.0.0.0 serves it
                    c = requests.get(base + "/v1/cluster", timeout=5).json()
                return [r for g in c["groups"] for r in g["ranks"] if r.get("host")]
            seen = poll(ranks)
            # reported under its own host name (its UTS name), polled and answering
            assert [(r["url"], r["host"], r["reachable"]) for r in seen] == \
                [(wild_url, "trn-a", True)], seen
            # the loopback rank says in one line why it is not registered, and is not
            err = poll(lambda: "loopback" in (t := (tmp_path / "trn-b.err").read_text()) and t)
            assert err.count("[lightkeeper]") == 1 and "cannot reach this host's loopback" in err \
                and "LIGHTKEEPER_WORKER_HOST" in err, err
            with fab.entered():
                targets = requests.get(base + "/v1/targets", timeout=5).json()
            assert [t["url"] for t in targets] == [wild_url], targets
            # Prometheus on another host is handed the name the rank registered
            sd = poll(lambda: sd_out.exists() and json.loads(sd_out.read_text()))
            assert [t for e in sd for t in e["targets"]] == [wild_url.removeprefix("http://")]
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

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
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
