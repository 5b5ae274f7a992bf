"""``POST /v1/probe`` and ``GET /v1/probe/payload`` between real WorkerServers on 127.0.0.1:
a peer that answers, one that is down, one that accepts and never answers; payload bounds;
the token and the request's checks."""

from __future__ import annotations

import socket
import time

import pytest
import requests

from rank_wire import auth
from worker_server import RankIdentity, RankState, WorkerServer
from worker_server.probe import DEFAULT_BYTES, MAX_BYTES, PAYLOAD_PATH

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


def signed_get(url: str, query: str, token: str = TOKEN) -> requests.Response:
    path = PAYLOAD_PATH + query
    return requests.get(url + path, timeout=10,
                        headers={"Authorization": auth.peer_authorization(token, path, url)})


def test_payload_is_bounded_zeros(ranks):
    a, _ = ranks
    get = lambda q: signed_get(a.url, q)  # noqa: E731
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
        r = signed_get(off.url, "?bytes=3")
        assert r.status_code == 403 and "LIGHTKEEPER_EXIT_TOKEN" in r.json()["error"]
    finally:
        off.stop()


def test_the_payload_is_only_for_a_peer_holding_the_ranks_token(ranks):
    """Its bytes cost the rank's threads: a reader looping on an open payload slowed a rank
    into a straggler the monitor evicted. Unsigned, signed with another token, for another
    size or as a rank call: refused at once, with no bytes."""
    a, b = ranks
    url = a.url + PAYLOAD_PATH + "?bytes=4096"
    for headers in ({}, {"Authorization": f"Bearer {TOKEN}"},
                    {"Authorization": auth.peer_authorization("other", PAYLOAD_PATH + "?bytes=4096",
                                                              a.url)},
                    {"Authorization": auth.peer_authorization(TOKEN, PAYLOAD_PATH + "?bytes=1",
                                                              a.url)},
                    # a fetch of rank b seen on the wire, replayed to rank a
                    {"Authorization": auth.peer_authorization(TOKEN, PAYLOAD_PATH + "?bytes=4096",
                                                              b.url)},
                    {"Authorization": auth.header(TOKEN, "GET", PAYLOAD_PATH + "?bytes=4096",
                                                  auth.identity(0, 0, None), b"")}):
        r = requests.get(url, headers=headers, timeout=5)
        assert r.status_code == 401 and "signed with the ranks' token" in r.json()["error"], headers
    assert signed_get(a.url, "?bytes=4096").content == bytes(4096)
    # a peer holding another token measures nothing: its fetch is refused, said in the result
    other = WorkerServer(RankState(RankIdentity(replica_group=5)), exit_token="other").serve()
    try:
        r = probe(other.url, {"peers": [a.url], "bytes": 1024},
                  headers={"Authorization": "Bearer other"})
        [res] = r.json()["results"]
        assert res["ok"] is False and res["error"] == f"transfer: HTTP 401 from {PAYLOAD_PATH}"
        assert r.json()["control"]["ok"] is True  # its own payload: its own token
    finally:
        other.stop()


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
