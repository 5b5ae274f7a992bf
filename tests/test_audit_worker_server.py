"""WorkerServer audit: what a curl-ing user sees under a wedged Flight Recorder and bad input."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from rank_wire import MONITOR_AGENT, auth
from worker_server import RankIdentity, RankState, WorkerServer
from worker_server.probe import MAX_BYTES, PAYLOAD_PATH


def test_a_wedged_flight_recorder_dump_does_not_starve_healthz():
    # A dump that never returns is faked: torch offers no way to wedge its own dump on demand.
    entered, release = threading.Event(), threading.Event()

    def wedged(*_a, **_k) -> bytes:
        entered.set()
        release.wait(30)
        return b"{}"

    state = RankState(RankIdentity(job="audit", replica_group=0, group_rank=0,
                                   group_world_size=1))
    srv = WorkerServer(state, fr_dumper=wedged)
    srv.serve()
    pool = ThreadPoolExecutor(8)
    try:
        first = pool.submit(requests.get, srv.url + "/v1/fr_trace", timeout=40)
        assert entered.wait(10)
        # more dumps than the server has threads (4): each waits for the first, then gives up
        others = [pool.submit(requests.get, srv.url + "/v1/fr_trace", timeout=40)
                  for _ in range(5)]
        t0 = time.monotonic()
        assert requests.get(srv.url + "/healthz", timeout=5).json() == {"status": "ok"}
        # the monitor's poll: this client's 503'd dumps may have it pace an anonymous read (429)
        assert requests.get(srv.url + "/v1/state", headers={"User-Agent": MONITOR_AGENT},
                            timeout=5).status_code == 200
        assert time.monotonic() - t0 < 4
        # each refused before the wedged dump ends: it waited for that one (503), or, on a
        # loaded machine, was a paced read past the server's slots (429); one at least is a 503
        codes = []
        for f in others:
            r = f.result(timeout=10)
            codes.append(r.status_code)
            assert r.status_code in (503, 429) and r.headers["Retry-After"] == "1"
            assert r.json()["status"] == r.status_code
            assert r.status_code == 429 or "another" in r.json()["error"]
        assert 503 in codes, codes
        release.set()
        assert first.result(timeout=10).status_code == 200
        # the lock is free again: the next dump is served
        assert requests.get(srv.url + "/v1/fr_trace", timeout=5).status_code == 200
    finally:
        release.set()
        pool.shutdown(wait=True)
        srv.stop()


def test_large_answers_need_no_writable_temp_dir(monkeypatch, tmp_path, caplog):
    # a read-only root: no temp file can be made, where waitress put any answer over 1 MiB
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "absent"))
    dump = json.dumps({"entries": [{"x": "y" * 500}] * 6000}).encode()  # 3 MB
    srv = WorkerServer(RankState(RankIdentity(job="audit")), fr_dumper=lambda *_a, **_k: dump,
                       exit_token="t")
    srv.serve()
    try:
        r = requests.get(srv.url + "/v1/fr_trace", timeout=20)
        assert r.status_code == 200 and len(r.json()["entries"]) == 6000
        path = f"{PAYLOAD_PATH}?bytes={MAX_BYTES}"
        r = requests.get(srv.url + path, timeout=20,
                         headers={"Authorization": auth.peer_authorization("t", path, srv.url)})
        assert r.status_code == 200 and len(r.content) == MAX_BYTES
    finally:
        srv.stop()
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING], caplog.text


FAILING_RANK = """
import sys
from worker_server import RankIdentity, RankState, WorkerServer
from worker_server.flight_recorder import FlightRecorderUnavailable

def failing(*_a, **_k):
    raise FlightRecorderUnavailable("Flight Recorder is disabled here")

state = RankState(RankIdentity(job="audit", replica_group=0, group_rank=0, group_world_size=1))
srv = WorkerServer(state, fr_dumper=failing)
srv.serve()
print(srv.url, flush=True)
sys.stdin.read()
srv.stop()
"""


def test_a_failing_endpoint_says_one_line_per_request():
    # a process of its own: its stderr is what a training job's log would hold
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", FAILING_RANK], cwd=repo, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        for _ in range(2):
            r = requests.get(url + "/v1/fr_trace", timeout=5)
            assert r.status_code == 500 and "disabled here" in r.json()["error"]
        assert requests.get(url + "/healthz", timeout=5).status_code == 200
        _, err = proc.communicate("", timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 2, err
    assert all("/v1/fr_trace failed: FlightRecorderUnavailable: Flight Recorder is disabled "
               "here" in line for line in lines), err


EXITING_RANK = """
import sys, threading
from worker_server import RankIdentity, RankState, WorkerServer

state = RankState(RankIdentity(job="audit", replica_group=0, group_rank=0, group_world_size=1))
srv = WorkerServer(state, exit_token="s3cret")
srv.serve()
print(srv.url, flush=True)
threading.Event().wait(60)
"""


def test_exit_reason_is_one_bounded_line_in_the_log():
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", EXITING_RANK], cwd=repo, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        reason = "evicted\n[lightkeeper] forged line " + "x" * 5000
        r = requests.post(url + "/v1/exit", json={"reason": reason}, timeout=5,
                          headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 202 and r.json()["exiting"] is True
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # beside the bearer's deprecation warning; a forged line would be a second of these
    lines = [line for line in err.splitlines() if line.startswith("[lightkeeper]")]
    assert len(lines) == 1, lines
    assert lines[0].startswith("[lightkeeper] exiting (status 1): evicted [lightkeeper] forged")
    assert len(lines[0]) < 1100


def test_an_empty_worker_host_variable_binds_loopback(monkeypatch):
    # LIGHTKEEPER_WORKER_HOST= (set, empty: a template left blank) is as unset: 127.0.0.1
    monkeypatch.setenv("LIGHTKEEPER_WORKER_HOST", "")
    server = WorkerServer.start(replica_group=0)
    try:
        assert server.url.startswith("http://127.0.0.1:"), server.url
        assert requests.get(server.url + "/healthz", timeout=5).ok
    finally:
        server.stop()
    import argparse

    from trainer.cli import add_arguments  # the trainer's flag takes its default from it
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).worker_host == "127.0.0.1"


def test_a_monitor_url_with_a_password_beside_a_token_says_the_monitor_will_refuse(
        capfd, monkeypatch):
    # requests turns the URL's user:password into the Authorization header, in place of the
    # bearer token: the monitor would answer 401 for ever, and the rank says why at once
    monkeypatch.setenv("LIGHTKEEPER_REGISTER_TOKEN", "t0ken")
    for url in ("http://u:pw@127.0.0.1:1", "http://127.0.0.1:1"):
        WorkerServer.start(replica_group=0, monitor_url=url).stop()
    err = capfd.readouterr().err
    said = "its URL's user:password and the registration token both need the Authorization"
    assert err.count(said) == 1, err  # the URL without a password: nothing said
    assert f"monitor http://u:***@127.0.0.1:1: {said}" in err, err


def test_a_ranks_action_and_fault_tokens_are_stripped_and_a_blank_one_is_off(monkeypatch):
    # read from a secret file, a token ends in a newline: the route takes the token without it;
    # a blank one leaves the route off (403), not on behind a token no request can carry
    for exit_token, want in (("tok\n", 400), ("  \n", 403)):
        monkeypatch.setenv("LIGHTKEEPER_EXIT_TOKEN", exit_token)
        server = WorkerServer.start(replica_group=0)
        try:
            r = requests.post(server.url + "/v1/probe", data="not json", timeout=5,
                              headers={"Authorization": "Bearer tok"})
            assert r.status_code == want, (exit_token, r.status_code, r.text)
        finally:
            server.stop()
