"""Clients audit: many, slow or stalled clients against a rank's WorkerServer and the monitor."""

from __future__ import annotations

import os
import resource
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_client import generate_latest

from monitor.api.metrics import MonitorMetrics
from monitor.config import MonitorConfig
from monitor.service import Monitor
from rank_wire import MONITOR_AGENT
from worker_server import RankIdentity, RankState, WorkerServer


def test_queued_dumps_leave_state_to_the_monitor():
    # A dump held open is faked: torch offers no way to hold its own dump on demand. A handful
    # of clients asking /v1/fr_trace at once used to take all 4 server threads (one dumping,
    # one waiting 1 s on it, two paced), so a monitor's /v1/state waited in waitress' queue.
    entered, release = threading.Event(), threading.Event()

    def held(*_a, **_k) -> bytes:
        entered.set()
        release.wait(30)
        return b'{"entries": []}'

    state = RankState(RankIdentity(job="audit", replica_group=0, group_rank=0,
                                   group_world_size=1))
    srv = WorkerServer(state, fr_dumper=held).serve()
    stop, answers = threading.Event(), []
    monitor = {"User-Agent": MONITOR_AGENT}  # the monitor's polls, never paced

    def ask_dumps() -> None:
        with requests.Session() as s:
            while not stop.is_set():
                answers.append(s.get(srv.url + "/v1/fr_trace", timeout=30).status_code)

    pool = ThreadPoolExecutor(8)
    try:
        first = pool.submit(requests.get, srv.url + "/v1/fr_trace", timeout=30)
        assert entered.wait(10)
        with requests.Session() as s:
            # the first to ask waits while the dump could still be a normal one...
            assert s.get(srv.url + "/v1/fr_trace", headers=monitor, timeout=5).status_code == 503
            # ...then it is wedged: asking holds no thread, it is refused at once
            t0 = time.monotonic()
            busy = s.get(srv.url + "/v1/fr_trace", headers=monitor, timeout=5)
            assert busy.status_code == 503 and busy.headers["Retry-After"] == "1"
            assert time.monotonic() - t0 < 0.5, "a request waited for a wedged dump"
            askers = [pool.submit(ask_dumps) for _ in range(6)]
            deadline = time.monotonic() + 10
            while len(answers) < 6 and time.monotonic() < deadline:  # the askers in their loops
                time.sleep(0.01)
            for _ in range(5):
                t0 = time.monotonic()
                assert s.get(srv.url + "/v1/state", headers=monitor, timeout=5).status_code == 200
                assert time.monotonic() - t0 < 0.5  # the monitor's poll timeout is 0.8 s
        assert 503 in answers  # told at once to come back (Retry-After: 1)
        release.set()
        assert first.result().status_code == 200
        stop.set()
        for a in askers:  # the others' reads done (paced reads in flight take the slots)
            a.result(timeout=30)
        assert requests.get(srv.url + "/v1/fr_trace", timeout=5).status_code == 200
    finally:
        release.set()
        stop.set()
        pool.shutdown(wait=True)
        srv.stop()


def test_a_scrape_during_a_sweep_sees_every_host_in_trouble():
    # every sweep publishes the host ledger; a scrape in the middle of it used to find the
    # per-host series cleared (an alert on them restarted its `for`)
    m = MonitorMetrics("audit")
    hosts = [{"host": f"h{i}", "node": f"n{i}", "state": "quarantined",
              "offences": [{"in_window": True}], "last_action": {"status": "failed",
                                                                 "sink": "k8s"}}
             for i in range(3)]
    stop = threading.Event()

    def sweeps() -> None:
        while not stop.is_set():
            m.set_hosts({"quarantined": 3}, hosts)

    m.set_hosts({"quarantined": 3}, hosts)
    sweeper = threading.Thread(target=sweeps)
    sweeper.start()
    try:
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            lines = generate_latest(m.registry).decode().splitlines()
            for name in ("host_quarantine_state", "host_offences", "host_action_failed"):
                got = [x for x in lines if x.startswith(f"lightkeeper_monitor_{name}{{")]
                assert len(got) == 3, (name, got)
    finally:
        stop.set()
        sweeper.join()


@pytest.fixture
def many_descriptors():
    """Opens descriptors until the next one is past 1023, as in a training process (data
    loaders, NCCL's sockets) or a monitor polling a thousand ranks on kept-alive connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the descriptor limit ({hard}) stays below 1024")
    want = max(soft, 2048) if soft != resource.RLIM_INFINITY else soft
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
    fds: list[int] = []

    def open_past_1023() -> None:
        while not fds or fds[-1] < 1100:
            fds.append(os.open(os.devnull, os.O_RDONLY))

    try:
        yield open_past_1023
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_servers_answer_with_descriptors_past_1023(tmp_path, many_descriptors):
    # waitress' select() loop raised on a client socket past FD_SETSIZE and its thread ended:
    # the rank never answered again (found dead, evicted), nor did the monitor's API
    state = RankState(RankIdentity(job="audit", replica_group=0, group_rank=0,
                                   group_world_size=1))
    srv = WorkerServer(state).serve()
    mon = Monitor(MonitorConfig(port=0, state_path=str(tmp_path / "s.sqlite"),
                                sd_out=str(tmp_path / "t.json"), job="audit")).start()
    try:
        many_descriptors()
        for _ in range(2):
            assert requests.get(srv.url + "/v1/state", timeout=5).status_code == 200
            assert requests.get(mon.url + "/healthz", timeout=5).status_code == 200
    finally:
        mon.stop()
        srv.stop()
