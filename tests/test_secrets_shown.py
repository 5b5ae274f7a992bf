"""No password of a URL (``user:password@``, as users put behind a reverse proxy) and no token is
shown: a real Lighthouse, two real ranks (``lightkeeper train``) and two real monitors, every URL
with a password and every token set; every answer, log line and file they give is searched for
the secrets, while the Lighthouse is still reached through the URL with its password."""

from __future__ import annotations

import base64
import json
import os
import sqlite3
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from lightkeeper.cluster import LocalCluster
from lightkeeper.processes import free_port, start_monitor_process, stop_process, wait_until
from tests.support.http_stub import HttpStub

pytestmark = pytest.mark.e2e

LH_PW, MON_PW, ETCD_PW, RANK_PW = "lh-pw-5e1f", "mon-pw-77aa", "etcd-pw-0c3d", "rank-pw-8d90"
TOKENS = {"LIGHTKEEPER_TOKEN": "admin-tok-9b2c", "LIGHTKEEPER_REGISTER_TOKEN": "reg-tok-41d0",
          "LIGHTKEEPER_EXIT_TOKEN": "exit-tok-e6a8", "LIGHTKEEPER_FAULT_TOKEN": "fault-tok-2f17"}
SECRETS = (LH_PW, MON_PW, ETCD_PW, RANK_PW, *TOKENS.values())
MONITOR_GETS = ("/", "/healthz", "/v1/cluster", "/v1/ranks", "/v1/findings", "/v1/evictions",
                "/v1/targets", "/v1/hosts", "/v1/goodput", "/v1/incidents", "/metrics")
RANK_GETS = ("/healthz", "/v1/state", "/v1/stacks", "/v1/fr_trace", "/metrics")


def command_lines(pid: int) -> list[str]:
    """The command lines of ``pid`` and every process below it (one gone meanwhile: none)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except (FileNotFoundError, ProcessLookupError):
        return []
    return [argv, *(a for c in children for a in command_lines(int(c)))]


def with_password(url: str, user: str, password: str) -> str:
    return url.replace("://", f"://{user}:{password}@", 1)


class BasicAuthProxy(HttpStub):
    """The reverse proxy in front of the Lighthouse: forwards a request with the right basic
    credentials, answers 401 to any other. In Python: no such proxy is installed here (nginx,
    haproxy: none in the test image)."""

    def __init__(self, upstream: str, user: str, password: str) -> None:
        self.upstream = upstream
        self.expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.refused = 0
        super().__init__({"GET": self.forward, "POST": self.forward})
        self.url = f"http://{user}:{password}@127.0.0.1:{self.port}"

    def forward(self, req) -> tuple[int, bytes]:
        if req.headers.get("Authorization") != self.expected:
            self.refused += 1
            return 401, b"unauthorized"
        r = requests.request(req.method, self.upstream + req.target, timeout=10)
        return r.status_code, r.content


def leaks(shown: dict[str, str]) -> list[str]:
    return [f"{where}: ...{text[max(0, i - 80):i + 40]}..."
            for where, text in shown.items() for s in SECRETS if (i := text.find(s)) >= 0]


def sqlite_text(path) -> str:
    db = sqlite3.connect(path)
    try:
        return "\n".join(db.iterdump())
    finally:
        db.close()


def test_no_password_or_token_is_shown(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTKEEPER_")}
    closed = 1  # nothing listens on port 1: the unreachable Lighthouse and etcd
    mon_port = free_port()
    monitor_url = with_password(f"http://127.0.0.1:{mon_port}", "ranks", MON_PW)
    cluster = LocalCluster(tmp_path / "job", num_groups=2, steps=100000, step_pause_s=0.2,
                           min_replicas=1, job="lightkeeper",
                           extra_env={"LIGHTKEEPER_MONITOR": monitor_url, **TOKENS})
    procs, proxy = [], None
    given = tmp_path / "given"  # what the test wrote with the secrets: not searched
    try:
        upstream = cluster.start_lighthouse()
        # the ranks are given it with a password too (torchft takes it), the monitor the proxy
        cluster.lighthouse_url = with_password(upstream, "lh", LH_PW)
        proxy = BasicAuthProxy(upstream, "lh", LH_PW)
        lighthouse = proxy.url
        targets_file = tmp_path / "targets.json"
        targets_file.write_text("[]")
        common = [sys.executable, "-m", "lightkeeper.cli", "monitor", "--interval", "0.3",
                  "--min-replicas", "1"]
        # a shard whose Lighthouse and etcd do not answer, its targets file a bad entry: the
        # errors name the URLs
        bad_target = f"http://rk:{RANK_PW}@127.0.0.1:99999"
        given.mkdir()
        bad_file = given / "bad-targets.json"
        bad_file.write_text(json.dumps([{"targets": [bad_target]}]))
        with ThreadPoolExecutor(2) as pool:  # both at once: each start is a monitor's imports
            starts = [pool.submit(
                start_monitor_process,
                [*common, "--port", str(mon_port), "--lighthouse", lighthouse,
                 "--state", str(tmp_path / "m" / "state.sqlite"),
                 "--targets-file", str(targets_file)],
                tmp_path / "mon.out", tmp_path / "mon.err", env={**env, **TOKENS}), pool.submit(
                start_monitor_process,
                [*common, "--port", "0", "--lighthouse", f"http://lh:{LH_PW}@127.0.0.1:{closed}",
                 "--shard", "0/1", "--lead", "--etcd", f"http://lk:{ETCD_PW}@127.0.0.1:{closed}",
                 "--state", str(tmp_path / "s" / "state.sqlite"),
                 "--targets-file", str(bad_file)],
                tmp_path / "shard.out", tmp_path / "shard.err", env={**env, **TOKENS})]
        procs += [f.result()[0] for f in starts if f.exception() is None]  # stopped below
        (mon, mon_url), (shard, shard_url) = (f.result() for f in starts)
        for g in range(2):
            cluster.start_group(g)
        ranks = [u for g in range(2) for u in cluster.wait_for_workers(g, 120).values()]
        # the tokens reach the ranks (the demo's launcher) and monitors in the environment: no
        # command line, which every user of the host reads (ps), holds one
        started = [mon, shard, *(p for g in range(2) for p in cluster.groups[g].processes())]
        argvs = [a for p in started for a in command_lines(p.pid)]
        assert len(argvs) >= len(started), argvs
        assert not [a for a in argvs if any(t in a for t in TOKENS.values())], argvs
        targets_file.write_text(json.dumps([{"targets": [u.split("://", 1)[1] for u in ranks]}]))

        def groups_verified():
            groups = requests.get(mon_url + "/v1/cluster", timeout=5).json()["groups"]
            return len([g for g in groups if g["replica_id"] and g["in_quorum"]]) == 2

        wait_until(groups_verified, 120, interval=0.2, what="both groups verified")
        wait_until(lambda: requests.get(shard_url + "/v1/cluster", timeout=5).json()["shard"]
                   ["error"], 30, interval=0.3, what="the shard's etcd error")
        r = requests.post(mon_url + "/v1/evict", timeout=30, json={"replica_group": 1,
                          "reason": "secrets test"},
                          headers={"Authorization": f"Bearer {TOKENS['LIGHTKEEPER_TOKEN']}"})
        # verified and killed through the proxy: the real URL, password and all, is used
        assert r.status_code == 200 and r.json()["decision"] == "evict", r.text
        assert r.json()["detail"].startswith("HTTP 500"), r.text
        assert proxy.refused == 0
        # the proxy goes down: the monitor is blind and says why (log, answers)
        proxy.close()
        wait_until(lambda: requests.get(mon_url + "/v1/cluster", timeout=5).json()
                   ["verification"]["blind"], 30, interval=0.3, what="the monitor blind")

        shown = {"bad registration": requests.post(
            shard_url + "/v1/targets", json={"url": bad_target}, timeout=5,
            headers={"Authorization": f"Bearer {TOKENS['LIGHTKEEPER_REGISTER_TOKEN']}"}).text}
        for name, base in (("monitor", mon_url), ("shard", shard_url)):
            for path in MONITOR_GETS:
                shown[f"{name} GET {path}"] = requests.get(base + path, timeout=10).text
        for url in ranks[:1]:  # group 0 runs on; group 1 was evicted
            for path in RANK_GETS:
                shown[f"rank GET {path}"] = requests.get(url + path, timeout=10).text
        for item in requests.get(mon_url + "/v1/incidents", timeout=5).json()["bundles"]:
            bundle = tmp_path / f"{item['id']}.tar.gz"
            bundle.write_bytes(requests.get(mon_url + item["download"], timeout=10).content)
            with tarfile.open(bundle) as tar:
                for m in tar.getmembers():
                    if m.isfile():
                        shown[f"bundle {m.name}"] = tar.extractfile(m).read().decode()
        assert any(k.endswith("manifest.json") for k in shown), list(shown)
    finally:
        try:
            cluster.stop()  # before the monitors: a SIGTERMed rank waits for its next read
        finally:
            for proc in procs:
                stop_process(proc, grace=3.0)
        if proxy is not None:
            proxy.close()  # again: harmless
    for path in sorted(tmp_path.rglob("*")):
        if given in path.parents:
            continue
        if path.suffix == ".sqlite":
            shown[str(path)] = sqlite_text(path)
        elif path.is_file() and path.suffix != ".gz":
            text = path.read_text(errors="replace")
            # torchft's own log line names the Lighthouse as given: not ours to change
            shown[str(path)] = "\n".join(line for line in text.splitlines()
                                         if "[torchft::" not in line)
    assert not leaks(shown), "\n".join(leaks(shown))
    # shown with its password hidden, not dropped
    assert f"http://lh:***@{lighthouse.rsplit('@', 1)[1]}/status unreachable" in \
        shown["monitor GET /v1/cluster"]
    assert f"http://lk:***@127.0.0.1:{closed}" in shown["shard GET /v1/cluster"]
    assert f"http://lh:***@127.0.0.1:{closed}/status unreachable" in \
        shown["shard GET /v1/cluster"]
    assert "target 'http://rk:***@127.0.0.1:99999' has a bad port" in \
        shown["shard GET /v1/cluster"] and "http://rk:***@" in shown["bad registration"]
    assert f"monitor http://ranks:***@127.0.0.1:{mon_port} " in \
        (tmp_path / "job" / "replica_group_0" / "train.log").read_text()


BAD_URLS = [
    (["monitor", "--port", "0", "--lighthouse", f"htp://lh:{LH_PW}@h:1"],
     "--lighthouse 'htp://lh:***@h:1': not an http(s)://host:port URL"),
    # a base64 password, its / not percent-encoded: no URL, and refused without it
    (["monitor", "--port", "0", "--lighthouse", f"http://lh:{LH_PW}/a+b==@h:1"],
     "--lighthouse 'http://lh:***@h:1': not an http(s)://host:port URL"),
    (["monitor", "--port", "0", "--shard", "0/1", "--etcd", f"htp://lk:{ETCD_PW}@h:1"],
     "got 'htp://lk:***@h:1'"),
    (["monitor", "--port", "0", "--targets", f"http://rk:{RANK_PW}@127.0.0.1:99999"],
     "--targets entry 'http://rk:***@127.0.0.1:99999': target 'http://rk:***@127.0.0.1:99999' "
     "has a bad port"),
    # was a traceback (Port out of range)
    (["monitor", "--port", "0", "--action", f"webhook:http://q:{RANK_PW}@127.0.0.1:99999/hook",
      "--webhook-secret", "whsec"],
     "--action 'webhook:http://127.0.0.1...': expected k8s, slurm, exec:CMD or webhook:URL"),
    (["monitor", "--port", "0", "--action", f"webhook:htp://q:{RANK_PW}@h:1/hook",
      "--webhook-secret", "whsec"], "--action 'webhook:htp://h:1...': expected"),
    (["monitor", "--port", "0", "--action", f"webhook:http://q:{RANK_PW}@h:1/hook"],
     "--action webhook:http://h:1...: a signing secret is required"),
    # a webhook URL's path is its secret (Slack-style), an exec hook's arguments may hold one
    (["monitor", "--port", "0", "--action", f"webhook:http://h:1/{RANK_PW}"],
     "--action webhook:http://h:1...: a signing secret is required"),
    (["monitor", "--port", "0", "--action", f"exec:/no/such/hook --token {RANK_PW}"],
     "--action 'exec:/no/such/hook ...': '/no/such/hook' is not an executable on PATH"),
    (["train", "--lighthouse", f"htp://lh:{LH_PW}@h:1"],
     "Lighthouse 'htp://lh:***@h:1' is not an http(s)://host:port URL"),
    (["run", "--monitor", f"htp://ranks:{MON_PW}@h:1", "--", "true"],
     "--monitor 'htp://ranks:***@h:1' is not an http(s)://host:port URL"),
    (["run", "--monitor", f"ranks:{MON_PW}@h:1", "--", "true"],  # no scheme
     "--monitor 'ranks:***@h:1' is not an http(s)://host:port URL"),
]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> list[subprocess.CompletedProcess]:
    """Each of BAD_URLS run as a command, all started at once rather than one after another:
    each is mostly its interpreter's start and imports, which the two cores share."""
    cwd = tmp_path_factory.mktemp("bad_urls")
    procs = [subprocess.Popen([sys.executable, "-m", "lightkeeper.cli", *argv],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
             for argv, _ in BAD_URLS]
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:  # none left running after a timeout
            stop_process(p, grace=0)
    return out


@pytest.mark.parametrize("case", range(len(BAD_URLS)),
                         ids=[said for _, said in BAD_URLS])
def test_a_bad_url_is_refused_without_its_password(refusals, case):
    res, said = refusals[case], BAD_URLS[case][1]
    assert res.returncode == 2 and said in res.stderr, res.stderr
    assert not leaks({"stdout": res.stdout, "stderr": res.stderr})


def test_an_exec_hook_gets_no_url_password_and_its_error_shows_none(tmp_path, monkeypatch):
    """The Lighthouse's and etcd's URLs hold their passwords in the monitor's environment (the
    Trust model): a hook got them verbatim, and a failing hook's stderr (curl -v, set -x, an
    env dump) went to GET /v1/hosts and the audit log as it was."""
    from monitor.act.sinks.hooks import ExecSink

    hook = tmp_path / "hook.sh"
    hook.write_text("#!/bin/sh\necho \"LH=$TORCHFT_LIGHTHOUSE ETCD=$LIGHTKEEPER_ETCD "
                    "CALLED=http://ops:hookpw@cmdb:80/\" >&2\nexit 1\n")
    hook.chmod(0o755)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://u:lhpass@lh:29510")
    monkeypatch.setenv("LIGHTKEEPER_ETCD", "http://root:etcdpw@etcd:2379")
    res = ExecSink(str(hook)).run({"event": "quarantine", "host": "h1"})
    assert not res.ok and "lh:29510" in res.detail and "etcd:2379" in res.detail, res.detail
    for secret in ("lhpass", "etcdpw", "hookpw"):
        assert secret not in res.detail, res.detail
