"""``POST /v1/probe`` and ``GET /v1/probe/payload`` between real WorkerServers on 127.0.0.1:
a peer that answers, one that is down, one that accepts and never answers; payload bounds;
the token and the request's checks."""

from __future__ import annotations

import socket
import time

import pytest
import requests

from worker_server import RankIdentity, RankState, WorkerServer
from worker_server.probe import DEFAULT_BYTES, MAX_BYTES

TOKEN = "probe-unit-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def ranks():
    servers = [WorkerServer(RankState(RankIdentity(replica_group=g)), exit_token=TOKEN).serve()
               for g in range(2)]
    yield servers
    for s in servers:
        s.stop()


# nothing listens on port 1 (refused): a port picked with bind(0) and let go may be another
# test's server by the time it is asked
CLOSED_PORT = 1


def probe(url: str, body, headers=AUTH, timeout: float = 30) -> requests.Response:
    return requests.post(url + "/v1/probe", json=body, headers=headers, timeout=timeout)


def test_probe_measures_a_live_peer_and_names_a_down_one(ranks):
    a, b = ranks
    down = f"http://127.0.0.1:{CLOSED_PORT}"
    r = probe(a.url, {"peers": [b.url, down, a.url + "/"], "bytes": 65536})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["from"]["worker_url"] == a.url and doc["from"]["replica_group"] == 0
    assert doc["from"]["host"] == doc["from"]["node"] == a.state.identity.host
    assert (doc["bytes"], doc["timeout_s"]) == (65536, 2.0)
    live, dead, itself = doc["results"]  # in the order asked
    assert live["peer"] == b.url and live["ok"] is True and live["error"] is None
    assert live["connect_s"] >= 0 and live["transfer_s"] > 0 and live["mbit_s"] > 0
    assert itself["peer"] == a.url and itself["ok"] is True  # trailing "/" dropped
    assert dead == {"peer": down, "ok": False, "connect_s": None, "transfer_s": None,
                    "mbit_s": None, "error": dead["error"]}
    assert dead["error"].startswith("connect: ConnectionRefusedError")
    # and its transfer from itself, with no network in it: the control the monitor reads
    control = doc["control"]
    assert control["peer"] == a.url and control["ok"] is True and control["mbit_s"] > 0


def test_a_down_peer_fails_fast_and_a_silent_one_within_the_timeout(ranks):
    a, _ = ranks
    started = time.monotonic()
    r = probe(a.url, {"peers": [f"http://127.0.0.1:{CLOSED_PORT}"], "timeout_s": 5})
    assert r.status_code == 200 and r.json()["results"][0]["ok"] is False
    assert time.monotonic() - started < 2.5  # refused at once, not after the 5 s timeout

    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        [res] = probe(a.url, {"peers": [url], "bytes": 1024, "timeout_s": 0.5}).json()["results"]
    assert res["ok"] is False and res["connect_s"] is not None and res["transfer_s"] is None
    assert res["error"] == "transfer: timed out (0.5 s) after 0 of 1024 bytes"


def test_payload_is_bounded_zeros(ranks):
    a, _ = ranks
    get = lambda q: requests.get(a.url + "/v1/probe/payload" + q, timeout=10)  # noqa: E731
    assert get("?bytes=0").content == b""
    r = get(f"?bytes={MAX_BYTES}")
    assert r.status_code == 200 and r.content == bytes(MAX_BYTES)
    assert r.headers["Content-Type"] == "application/octet-stream"
    assert len(get("").content) == DEFAULT_BYTES
    for bad in (f"?bytes={MAX_BYTES + 1}", "?bytes=-1", "?bytes=lots"):
        r = get(bad)
        assert r.status_code == 400 and "bytes must be an integer" in r.json()["error"]


def test_probe_needs_the_exit_token(ranks):
    a, b = ranks
    body = {"peers": [b.url]}
    assert probe(a.url, body, headers={}).status_code == 401
    assert probe(a.url, body, headers={"Authorization": "Bearer nope"}).status_code == 401
    off = WorkerServer(RankState(RankIdentity())).serve()  # no LIGHTKEEPER_EXIT_TOKEN
    try:
        r = probe(off.url, body)
        assert r.status_code == 403 and "LIGHTKEEPER_EXIT_TOKEN" in r.json()["error"]
        assert requests.get(off.url + "/v1/probe/payload?bytes=3", timeout=5).content == b"\0" * 3
    finally:
        off.stop()


@pytest.mark.parametrize("body, says", [
    ([], "body must be JSON"),
    ({}, "peers must be a non-empty list"),
    ({"peers": []}, "peers must be a non-empty list"),
    ({"peers": "http://127.0.0.1:1"}, "peers must be a non-empty list"),
    ({"peers": [f"http://127.0.0.1:{p}" for p in range(1, 66)]}, "at most 64 peers"),
    ({"peers": ["https://127.0.0.1:1"]}, "only http:// peers"),
    ({"peers": ["127.0.0.1:1"]}, "only http:// peers"),
    ({"peers": ["http://127.0.0.1:1/v1/state"]}, "nothing after it"),
    ({"peers": ["http://u:p@127.0.0.1:1"]}, "nothing after it"),
    ({"peers": ["http://127.0.0.1"]}, "bad peer URL"),
    ({"peers": [7]}, "each peer must be a worker URL"),
    ({"peers": ["http://127.0.0.1:1", "http://127.0.0.1:1/"]}, "distinct"),
    ({"peers": ["http://127.0.0.1:1"], "bytes": MAX_BYTES + 1}, "bytes must be an integer"),
    ({"peers": ["http://127.0.0.1:1"], "bytes": "1"}, "bytes must be an integer"),
    ({"peers": ["http://127.0.0.1:1"], "timeout_s": 0}, "timeout_s must be"),
    ({"peers": ["http://127.0.0.1:1"], "timeout_s": 10.5}, "timeout_s must be"),
    ({"peers": ["http://127.0.0.1:1"], "timeout_s": "2"}, "timeout_s must be"),
])
def test_bad_requests_are_400_with_the_reason(ranks, body, says):
    r = probe(ranks[0].url, body)
    assert r.status_code == 400 and says in r.json()["error"], r.json()
