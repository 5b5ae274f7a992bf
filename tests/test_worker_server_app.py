"""WorkerServer over real HTTP (waitress on an ephemeral port) without a training job:
every endpoint's contract, errors as JSON, and a failing endpoint not taking the server down."""

from __future__ import annotations

import base64
import json
import select
import socket
import struct
import threading
import time
from importlib import metadata
from pathlib import Path

import pytest
import requests

from http_serving import wsgi
from lightkeeper.processes import wait_until
from worker_server import RankIdentity, RankState, WorkerServer
from worker_server.flight_recorder import IncarnationTracker
from worker_server.packed import TIMING_KEYS, state_packed


def imported_versions() -> tuple[str, str]:
    """torch's ``__version__``; the torchft distribution (whatever its name) that holds the
    ``torchft`` package this process imports (torchft has no ``__version__``)."""
    import torch
    import torchft

    site = Path(torchft.__file__).parents[1]
    owners = [d.version for d in metadata.distributions(path=[str(site)])
              if "\ntorchft/manager.py," in "\n" + (d.read_text("RECORD") or "")]
    assert len(owners) == 1, owners
    return str(torch.__version__), owners[0]


@pytest.fixture
def server():
    state = RankState(RankIdentity(job="unit", replica_group=2, group_rank=1, group_world_size=2,
                                   lighthouse="http://127.0.0.1:1"), faults=["slow:delay=1"])
    srv = WorkerServer(state)
    srv.serve()
    yield srv
    srv.stop()


def test_binds_loopback_on_an_ephemeral_port(server):
    assert server.host == "127.0.0.1" and server.port > 0
    assert server.url == f"http://127.0.0.1:{server.port}"
    assert requests.get(server.url + "/healthz", timeout=2).json() == {"status": "ok"}


def test_state_reports_identity_and_steps(server):
    st = server.state
    st.step_started()
    st.set_phase("forward")
    st.set_quorum(5, 3, True)
    st.step_finished(1, committed=True, loss=2.5)
    st.step_started()
    st.step_finished(1, committed=False)
    body = requests.get(server.url + "/v1/state", timeout=2).json()
    assert body["job"] == "unit" and body["replica_group"] == 2 and body["group_rank"] == 1
    assert body["rank"] == 5  # replica_group * group_world_size + group_rank
    assert body["quorum_id"] == 5 and body["num_participants"] == 3 and body["participating"]
    assert body["commits"] == 1 and body["commit_failures"] == 1 and body["loss"] == 2.5
    assert len(body["recent_step_seconds"]) == 2 and body["last_step_seconds"] >= 0
    assert body["phase"] == "forward" and body["faults"] == ["slow:delay=1"]
    assert (body["torch_version"], body["torchft_version"]) == imported_versions()
    assert body["worker_url"] == server.url
    assert body["local_rank"] == 0 and body["host"]
    # No instrumented Manager drove a step here: timing is there, empty (tests/test_worker_timing.py).
    assert body["timing"] == {"last_step": None, "window": None, "waiting": None, "recent": [],
                              "recent_quorum": [], "clock": "host"}


def test_finish_says_so_and_waits_for_a_monitor_to_get_it(server):
    # a user's reads (curl, a dashboard) are not a monitor's: nothing to wait for
    assert requests.get(server.url + "/v1/state", timeout=2).json()["finished"] is False
    assert server.finish(wait_s=5) is False
    assert requests.get(server.url + "/v1/state", timeout=2).json()["finished"] is True
    fresh = WorkerServer(RankState(RankIdentity())).serve()
    got, stop = [], threading.Event()

    def monitor():  # polls as the monitor's poller does, on one keep-alive connection
        with requests.Session() as s:
            s.headers["User-Agent"] = "lightkeeper-monitor"
            while not stop.is_set():
                try:
                    got.append(s.get(fresh.url + "/v1/state?packed=1", timeout=2).json())
                except requests.RequestException:
                    pass
                stop.wait(0.2)

    reader = threading.Thread(target=monitor)
    reader.start()
    try:
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            stop.wait(0.05)
        assert got and got[-1]["finished"] is False and got[-1]["phase"] == "starting"
        assert fresh.finish(wait_s=5) is True
        fresh.stop()
    finally:
        stop.set()
        reader.join()
        fresh.stop()
    assert got[-1]["finished"] is True and got[-1]["phase"] == "stopped", got[-1]


def test_finish_returns_once_the_answer_saying_finished_went_out(monkeypatch):
    """On a busy host waitress' loop thread sends an answer well after its handler returned:
    finish() returns (and the process may exit) only once the answer saying finished left the
    server, not after a fixed pause (before: 0.1 s, and a clean end read as a crash). The
    loop's sending is held here for ~0.8 s."""
    release = threading.Event()
    release.set()
    monkeypatch.setattr(wsgi._Channel, "_held", lambda self: not release.is_set())
    fresh = WorkerServer(RankState(RankIdentity())).serve()
    ask = (b"GET /v1/state HTTP/1.1\r\nHost: x\r\nUser-Agent: lightkeeper-monitor\r\n"
           b"Connection: close\r\n\r\n")
    try:
        with socket.create_connection((fresh.host, fresh.port), timeout=5) as first:
            first.sendall(ask)  # a monitor polls this rank
            assert first.recv(12) == b"HTTP/1.1 200"
            while first.recv(1 << 16):  # to the server's close: its handler is done, read counted
                pass
        release.clear()
        outcome: dict = {}
        with socket.create_connection((fresh.host, fresh.port), timeout=5) as last:

            def end() -> None:
                outcome["read"] = fresh.finish(wait_s=5)
                # what the monitor's socket holds as the process could exit (loopback hands
                # sent bytes over in a softirq: a moment, not the ~0.8 s sending was held)
                ready, _, _ = select.select([last], [], [], 0.1)
                outcome["there"] = last.recv(1 << 16, socket.MSG_PEEK) if ready else b""

            ender = threading.Thread(target=end)
            ender.start()
            wait_until(lambda: fresh.state.finished, 5, what="finish() said so")
            last.sendall(ask)  # the next poll, answered finished and held in the server
            threading.Timer(0.8, release.set).start()
            ender.join(10)
            assert outcome["read"] is True
            head, _, body = outcome["there"].partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            assert b'"finished":true' in body.replace(b" ", b"")
    finally:
        release.set()
        fresh.stop()


def test_unknown_path_and_method_are_json_errors(server):
    r = requests.get(server.url + "/v1/nope", timeout=2)
    assert r.status_code == 404 and r.json()["status"] == 404
    r = requests.post(server.url + "/v1/state", timeout=2)  # read-only
    assert r.status_code == 405 and "error" in r.json()
    assert r.headers["Content-Type"] == "application/json"
    assert "GET" in r.headers["Allow"] and "POST" not in r.headers["Allow"]  # RFC 9110 15.5.6


def test_state_since_serves_only_the_newer_timing_rows(server):
    """``/v1/state?since=N`` (a monitor that folded this rank's rows up to step N): the rows of
    the steps after N, ``timing.since`` N; every other key as the whole document has it."""
    timer = server.state.timing
    for step in range(10, 16):
        timer.begin_step()
        timer.end_step(step)
    whole = requests.get(server.url + "/v1/state", timeout=2).json()
    assert [r["step"] for r in whole["timing"]["recent"]] == list(range(10, 16))
    assert "since" not in whole["timing"]
    for since, want in ((12, [13, 14, 15]), (15, []), (-5, list(range(10, 16))), (99, [])):
        cut = requests.get(server.url + f"/v1/state?since={since}", timeout=2).json()
        assert [r["step"] for r in cut["timing"]["recent"]] == want, since
        assert cut["timing"]["since"] == since
        assert cut["timing"]["last_step"] == whole["timing"]["last_step"]
        assert cut["timing"]["window"] == whole["timing"]["window"]
        rest = {k: v for k, v in cut.items() if k not in ("timing", "phase_since")}
        assert rest == {k: v for k, v in whole.items() if k not in ("timing", "phase_since")}
    for bad in ("x", "1.5", str(1 << 63), ""):
        r = requests.get(server.url + f"/v1/state?since={bad}", timeout=2)
        assert r.status_code == 400 and "since must be an integer" in r.json()["error"], bad


def test_state_recent_serves_only_the_newest_step_times(server):
    """``/v1/state?recent=N`` (what a monitor reads of a rank's 64 step times): the newest N of
    ``recent_step_seconds``, every other key as the whole document has it; with ``since`` both
    cuts, each as it would be alone."""
    st = server.state
    for step in range(1, 71):  # more steps than the 64 a rank keeps
        st.step_started()
        st.step_finished(step, committed=True)
        server.state.timing.begin_step()
        server.state.timing.end_step(step)
    whole = requests.get(server.url + "/v1/state", timeout=2).json()
    times = whole["recent_step_seconds"]
    assert len(times) == 64
    for recent, want in ((16, times[-16:]), (0, []), (64, times), (500, times), (1, times[-1:])):
        cut = requests.get(server.url + f"/v1/state?recent={recent}", timeout=2).json()
        assert cut["recent_step_seconds"] == want, recent
        rest = {k: v for k, v in cut.items() if k not in ("recent_step_seconds", "phase_since")}
        assert rest == {k: v for k, v in whole.items()
                        if k not in ("recent_step_seconds", "phase_since")}
    both = requests.get(server.url + "/v1/state?since=68&recent=16", timeout=2).json()
    assert both["recent_step_seconds"] == times[-16:]
    assert [r["step"] for r in both["timing"]["recent"]] == [69, 70]
    assert both["timing"]["since"] == 68
    for bad in ("x", "-1", str((1 << 20) + 1), "1.5", "", "1_0", "+1", " 1", "\u0661"):
        r = requests.get(server.url + f"/v1/state?recent={bad}", timeout=2)
        assert r.status_code == 400 and "recent must be an integer" in r.json()["error"], bad


def test_state_packed_serves_the_number_lists_as_base64_records(server):
    """``/v1/state?packed=1`` (what a monitor asks): ``timing.recent`` as base64 of one
    ``<q4d`` record per row (step, then step_s, compute_s, wait_cross_s, wait_group_s) and
    ``recent_step_seconds`` as base64 of ``<f8`` values, the same numbers as the lists, and
    ``"packed": 1``; everything else as served without it; with ``since`` and ``recent`` the
    lists are cut first. A bad value is a 400 with the reason."""
    st = server.state
    for step in range(1, 21):
        st.step_started()
        st.step_finished(step, committed=True)
        st.timing.begin_step()
        st.timing.end_step(step)
    whole = requests.get(server.url + "/v1/state", timeout=2).json()
    assert "packed" not in whole
    for query, rows, times in (("?packed=1", whole["timing"]["recent"],
                                whole["recent_step_seconds"]),
                               ("?since=17&recent=3&packed=true",
                                whole["timing"]["recent"][-3:], whole["recent_step_seconds"][-3:]),
                               ("?packed=yes&since=20", [], whole["recent_step_seconds"])):
        got = requests.get(server.url + "/v1/state" + query, timeout=2).json()
        assert got["packed"] == 1
        raw = base64.b64decode(got["timing"]["recent"], validate=True)
        assert [dict(zip(("step", *TIMING_KEYS), r, strict=True))
                for r in struct.iter_unpack("<q4d", raw)] == rows, query
        raw = base64.b64decode(got["recent_step_seconds"], validate=True)
        assert [v for (v,) in struct.iter_unpack("<d", raw)] == times, query
        assert {k: v for k, v in got.items()
                if k not in ("timing", "recent_step_seconds", "packed", "phase_since")} == \
            {k: v for k, v in whole.items()
             if k not in ("timing", "recent_step_seconds", "phase_since")}
    plain = requests.get(server.url + "/v1/state?packed=0", timeout=2).json()
    assert "packed" not in plain and plain["timing"]["recent"] == whole["timing"]["recent"]
    r = requests.get(server.url + "/v1/state?packed=maybe", timeout=2)
    assert r.status_code == 400 and "packed must be true or false" in r.json()["error"]


def test_state_packed_serves_only_the_valid_numbers():
    """rank_wire's rule (tests/test_rank_wire.py has the vectors): a row whose step is beyond
    int64 or not an integer, or whose seconds are not four numbers >= 0, and a step time that
    is not such a number, are left out of what is served packed."""
    doc = {"timing": {"recent": [{"step": 2**70, "step_s": 1.0}, {"step": True},
                                 {"step": 3, "step_s": 0.5, "compute_s": 0.25,
                                  "wait_cross_s": 0, "wait_group_s": 0.0},
                                 {"step": 4, "step_s": "x", "compute_s": 0.25}, "not a row"]},
           "recent_step_seconds": [0.5, None, -1.0]}
    got = state_packed(doc)
    assert got["packed"] == 1
    assert struct.unpack("<d", base64.b64decode(got["recent_step_seconds"])) == (0.5,)
    assert list(struct.iter_unpack("<q4d", base64.b64decode(got["timing"]["recent"]))) == \
        [(3, 0.5, 0.25, 0.0, 0.0)]


@pytest.mark.parametrize("path", ["/v1/fr_trace?onlyactive=maybe", "/v1/stacks?format=xml"])
def test_bad_parameters_are_400_with_reason(server, path):
    r = requests.get(server.url + path, timeout=2)
    assert r.status_code == 400
    assert "must be" in r.json()["error"]


def test_fr_trace_is_self_describing(server):
    body = requests.get(server.url + "/v1/fr_trace?onlyactive=true", timeout=5).json()
    for key in ("rank", "replica_group", "replica_id", "host", "job", "dump_time_ns",
                "incarnations", "version"):
        assert key in body, key
    assert body["rank"] == 5 and body["job"] == "unit"


def test_stacks_show_every_thread_text_and_json(server):
    blocker = threading.Event()
    t = threading.Thread(target=blocker.wait, name="blocked-worker", daemon=True)
    t.start()
    try:
        text = requests.get(server.url + "/v1/stacks", timeout=2).text
        assert 'Thread' in text and '"blocked-worker"' in text and "in wait" in text
        body = requests.get(server.url + "/v1/stacks?format=json", timeout=2).json()
        names = {th["name"] for th in body["threads"]}
        assert "blocked-worker" in names and "MainThread" in names
    finally:
        blocker.set()


def test_stacks_are_read_with_the_collector_off(server, monkeypatch):
    """CPython 3.11's ``sys._current_frames()`` builds frame objects holding the interpreter's
    thread-list lock; a collection they set off that frees a ``threading.local`` takes the lock
    again and the process deadlocks (a test run hung so; a loop of it beside threads dropping
    locals in cycles hangs in seconds at ``gc.set_threshold(20)``). No collection may run in it,
    and the collector is on again after."""
    import gc
    import sys

    seen = []
    real = sys._current_frames
    monkeypatch.setattr(sys, "_current_frames", lambda: seen.append(gc.isenabled()) or real())
    assert gc.isenabled()
    assert requests.get(server.url + "/v1/stacks", timeout=2).status_code == 200
    assert seen == [False] and gc.isenabled()


def test_failing_endpoint_is_500_and_server_keeps_serving():
    def broken(*_a, **_k):
        raise RuntimeError("ring buffer exploded")

    srv = WorkerServer(RankState(RankIdentity()), fr_dumper=broken)
    srv.serve()
    try:
        r = requests.get(srv.url + "/v1/fr_trace", timeout=2)
        assert r.status_code == 500 and "ring buffer exploded" in r.json()["error"]
        assert requests.get(srv.url + "/healthz", timeout=2).status_code == 200
    finally:
        srv.stop()


def _entry(record_id, pg_id, name):
    return {"record_id": record_id, "pg_id": pg_id, "process_group": [name, name],
            "collective_seq_id": 1, "input_sizes": [[4]], "profiling_name": "gloo:all_reduce"}


@pytest.mark.parametrize("sort_keys", [True, False], ids=["torch-layout", "other-layout"])
def test_incarnation_tracker_resolves_pg_ids_from_entries(sort_keys):
    tracker = IncarnationTracker(group_rank=0)
    tracker.record(quorum_id=3, replica_rank=1, replica_world_size=2, global_ranks=[0, 1],
                   first_record_id=10)
    tracker.record(quorum_id=4, replica_rank=0, replica_world_size=3, global_ranks=[0, 1, 2],
                   first_record_id=20)
    dump = {"version": "2.10", "entries": [
        _entry(9, 0, ""),
        _entry(10, 7, "0"),  # not torchft's group
        _entry(11, 1, ""),
        _entry(21, 2, "torchft_quorum_4_rank_0"),
    ]}
    raw = json.dumps(dump, sort_keys=sort_keys).encode()
    incs = tracker.annotate(raw)
    assert [(i["quorum_id"], i["pg_id"], i["pg_name"]) for i in incs] == [
        (3, 1, ""), (4, 2, "torchft_quorum_4_rank_0")]
    # Once resolved, an id survives the ring buffer wrapping past its entries.
    assert [i["pg_id"] for i in tracker.annotate(b'{"entries": []}')] == [1, 2]


def test_entry_index_reads_torch_layout_without_parsing_and_others_by_parsing():
    from worker_server.flight_recorder import entry_index

    entries = [_entry(5, 1, 'we"ird'), _entry(6, 2, "")]
    for sort_keys in (True, False):
        raw = json.dumps({"entries": entries}, sort_keys=sort_keys).encode()
        assert entry_index(raw) == [(5, 1, 'we"ird'), (6, 2, "")]


def test_fr_trace_splices_identity_into_the_dump_bytes():
    from worker_server.flight_recorder import fr_dump

    body = json.loads(fr_dump(IncarnationTracker(0), {"rank": 3, "job": "j"}))
    assert body["rank"] == 3 and body["job"] == "j" and body["incarnations"] == []
    assert "version" in body and body["dump_time_ns"] > 0  # torch's keys are all still there


def test_fault_injection_is_off_by_default(server):
    """Without a fault handler (``lightkeeper run``, a plain script) the 403 says so, not to
    set the token; with one but no token, to set the token."""
    r = requests.post(server.url + "/v1/faults", json={"spec": "hang:at_step=1"}, timeout=2)
    assert r.status_code == 403 and "no fault handler" in r.json()["error"]
    srv = WorkerServer(RankState(RankIdentity()), fault_handler=lambda spec: None).serve()
    try:
        r = requests.post(srv.url + "/v1/faults", json={"spec": "hang:at_step=1"}, timeout=2)
        assert r.status_code == 403 and "LIGHTKEEPER_FAULT_TOKEN" in r.json()["error"]
    finally:
        srv.stop()


def test_fault_injection_needs_the_token_and_a_valid_spec():
    from trainer.faults import FaultInjector

    injector = FaultInjector([])
    srv = WorkerServer(RankState(RankIdentity()), fault_handler=injector.inject,
                       fault_token="s3cret").serve()
    try:
        url = srv.url + "/v1/faults"
        assert requests.post(url, json={"spec": "hang:at_step=4"}, timeout=2).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert requests.post(url, json={"spec": "hang:at_step=4"}, headers=wrong,
                             timeout=2).status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        bad = requests.post(url, json={"spec": "hang:when=4"}, headers=auth, timeout=2)
        assert bad.status_code == 400 and "unknown parameter 'when'" in bad.json()["error"]
        assert requests.post(url, data="x", headers=auth, timeout=2).status_code == 400
        assert injector.faults == []
        ok = requests.post(url, json={"spec": "hang:at_step=4"}, headers=auth, timeout=2)
        assert ok.status_code == 200 and ok.json()["injected"] == "hang:at_step=4"
        assert [f.kind for f in injector.faults] == ["hang"]
    finally:
        srv.stop()


def test_fr_trace_filters_by_process_group_and_newest_entries():
    """?pg=torchft (every incarnation of torchft's group, by pg_id or name), ?pg=<name> (an
    in-group group), ?last=N (newest N); the rest of the dump is kept, bad values are 400."""
    entries = [_entry(1, 0, ""), _entry(2, 4, "fsdp"), _entry(3, 9, "renamed"),
               _entry(4, 4, "fsdp"), _entry(5, 11, "torchft_quorum_5_rank_0"),
               _entry(6, 4, "fsdp")]
    incarnations = [{"pg_id": 9, "pg_name": "renamed", "quorum_id": 4, "group_rank": 0}]

    def dumper(tracker, identity, only_active=False):
        return json.dumps({"version": "2.10", "pg_config": {"4": {"name": "fsdp"}},
                           "entries": entries, **identity,
                           "incarnations": incarnations}).encode()

    srv = WorkerServer(RankState(RankIdentity(job="unit")), fr_dumper=dumper)
    srv.serve()
    try:
        def get(query):
            return requests.get(f"{srv.url}/v1/fr_trace{query}", timeout=5)

        def ids(query):
            return [e["record_id"] for e in get(query).json()["entries"]]

        assert ids("") == [1, 2, 3, 4, 5, 6]  # unfiltered: the bytes straight through
        assert "filter" not in get("").json()
        assert ids("?pg=torchft") == [1, 3, 5]
        assert ids("?pg=torchft&last=2") == [3, 5]
        assert ids("?pg=fsdp") == [2, 4, 6]
        assert ids("?last=1") == [6]
        body = get("?pg=fsdp&last=1").json()
        assert body["filter"] == {"pg": "fsdp", "last": 1, "entries_total": 6}
        assert body["pg_config"] == {"4": {"name": "fsdp"}} and body["job"] == "unit"
        assert ids("?pg=nosuchgroup") == []
        for bad in ("?last=0", "?last=x", "?last=-3", "?pg="):
            r = get(bad)
            assert r.status_code == 400, bad
            assert "must" in r.json()["error"]
    finally:
        srv.stop()


def test_a_port_that_is_no_port_or_taken_is_said_with_its_name(server):
    """LIGHTKEEPER_WORKER_PORT outside 0-65535 is refused by name (it bound port % 65536 and
    advertised the number given); a taken one names the address."""
    from worker_server.autostart import worker_port

    kw = {"replica_group": 0, "group_rank": 0, "group_world_size": 1}
    for value in ("70000", "-1", "abc"):
        with pytest.raises(ValueError, match=f"LIGHTKEEPER_WORKER_PORT='{value}' is not a port"):
            worker_port({"LIGHTKEEPER_WORKER_PORT": value})
    assert worker_port({"LIGHTKEEPER_WORKER_PORT": "9500", "LOCAL_RANK": "2"}) == 9502
    taken = int(server.url.rsplit(":", 1)[1])
    with pytest.raises(OSError, match=f"cannot bind http://127.0.0.1:{taken}"):
        WorkerServer.start(**kw, port=taken)


def _free_pair() -> int:
    """A port P with P + 1 free as well, both left unbound."""
    import socket

    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
            return base
    raise AssertionError("no two adjacent free ports")


def test_the_environments_port_is_offset_by_the_local_rank(monkeypatch, capfd):
    """The two-line API bound LIGHTKEEPER_WORKER_PORT as is: in a torchrun pod local rank 1
    raised EADDRINUSE into the training script (rank 0 held the port), where `lightkeeper
    run` and the trainer add LOCAL_RANK. Now it is a base everywhere; an environment's port
    that is taken or no port is served on an ephemeral one and said in one line naming it (the
    explicit ``port=`` still raises)."""
    base = _free_pair()
    monkeypatch.setenv("LIGHTKEEPER_WORKER_PORT", str(base))
    kw = {"replica_group": 0, "group_rank": 0, "group_world_size": 1}
    started = []
    try:
        for local_rank in (0, 1):
            monkeypatch.setenv("LOCAL_RANK", str(local_rank))
            started.append(WorkerServer.start(**kw))
            assert started[-1].port == base + local_rank
            assert requests.get(started[-1].url + "/healthz", timeout=2).status_code == 200
        assert capfd.readouterr().err == ""
        monkeypatch.setenv("LOCAL_RANK", "1")  # its port is taken: the job goes on, said
        started.append(WorkerServer.start(**kw))
        assert started[-1].port not in (0, base, base + 1)
        assert requests.get(started[-1].url + "/healthz", timeout=2).status_code == 200
        # said once served, naming where: fixed-port discovery will not find it
        said = capfd.readouterr().err.splitlines()
        assert len(said) == 1 and f"127.0.0.1:{base + 1}" in said[0] \
            and f"serving on {started[-1].url} instead" in said[0] \
            and "misses this rank" in said[0], said
        monkeypatch.setenv("LIGHTKEEPER_WORKER_PORT", "abc")
        started.append(WorkerServer.start(**kw))
        assert started[-1].port > 0
        said = capfd.readouterr().err.splitlines()
        assert len(said) == 1 and "LIGHTKEEPER_WORKER_PORT='abc' is not a port" in said[0] \
            and f"serving on {started[-1].url} instead" in said[0], said
        with pytest.raises(OSError):
            WorkerServer.start(**kw, port=base)
    finally:
        for srv in started:
            srv.stop()


def test_an_address_this_host_lacks_is_not_said_as_a_taken_port(monkeypatch, capfd):
    """With LIGHTKEEPER_WORKER_PORT set, any bind error was said as the port's ("serving on an
    ephemeral port instead") and the ephemeral bind then raised the same error: a line
    promising a server that never started. Only a taken port is the port's; an address this
    host lacks (a stale LIGHTKEEPER_WORKER_HOST) raises OSError naming it, as on any port,
    unsaid (the two-line API's callers catch it to train unobserved)."""
    import errno

    import http_serving.wsgi as wsgi

    def not_here(host, port):
        raise OSError(errno.EADDRNOTAVAIL,
                      f"cannot bind http://{host}:{port}: Cannot assign requested address")

    monkeypatch.setattr(wsgi, "_bind", not_here)
    monkeypatch.setenv("LIGHTKEEPER_WORKER_PORT", "9650")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(OSError, match="cannot bind http://127.0.0.1:9650: Cannot assign"):
        WorkerServer.start(replica_group=0, group_rank=0, group_world_size=1)
    assert capfd.readouterr().err == ""


def test_a_token_from_a_secret_file_matches_without_its_newline():
    from http_serving.auth import bearer_token_matches

    assert bearer_token_matches("Bearer s3cret", "s3cret\n")
    assert not bearer_token_matches("Bearer s3cret", "other\n")
    assert not bearer_token_matches("Bearer ", " \n")  # a blank token still matches nothing


def test_a_token_no_header_carries_is_said_as_such(monkeypatch, capfd):
    """A registration token with a character outside Latin-1 failed every request with a
    UnicodeEncodeError, said as "it is not an http(s)://host:port URL": the operator checked
    the monitor's address. Now the token is named (never shown) and nothing is sent."""
    import socket

    from lightkeeper.processes import wait_until

    token = "s3cr\u20acT"  # the euro sign: no Latin-1 for it
    monkeypatch.setenv("LIGHTKEEPER_REGISTER_TOKEN", token)
    err: list[str] = []

    def said() -> bool:
        err.extend(capfd.readouterr().err.splitlines())
        return bool(err)

    with socket.socket() as monitor:  # a monitor's address that listens
        monitor.bind(("127.0.0.1", 0))
        monitor.listen()
        srv = WorkerServer.start(replica_group=0, group_rank=0, group_world_size=1,
                                 monitor_url=f"http://127.0.0.1:{monitor.getsockname()[1]}")
        try:
            wait_until(said, 5, what="a line about the registration")
        finally:
            srv.stop()
    err.extend(capfd.readouterr().err.splitlines())
    assert len(err) == 1 and "LIGHTKEEPER_REGISTER_TOKEN" in err[0], err
    assert "not ASCII/Latin-1" in err[0] and "URL" not in err[0] and token not in err[0], err


def test_a_monitor_it_cannot_reach_is_said_once(monkeypatch, capfd):
    """A mistyped LIGHTKEEPER_MONITOR left the rank unmonitored without a word (debug only):
    said once on stderr, whatever the job's logging, in a few words (not urllib3's reprs),
    however often it is tried."""
    from worker_server import server as server_module

    monkeypatch.setattr(server_module, "REGISTER_INTERVAL_S", 0.02)
    closed = 1  # nothing listens on port 1: refused
    srv = WorkerServer.start(replica_group=0, group_rank=0, group_world_size=1,
                             monitor_url=f"http://127.0.0.1:{closed}")
    try:
        from lightkeeper.processes import wait_until

        tried = []
        real = requests.post
        monkeypatch.setattr(server_module.requests, "post",
                            lambda *a, **k: (tried.append(1), real(*a, **k))[1])
        wait_until(lambda: len(tried) >= 5, 10, what="five attempts")
    finally:
        srv.stop()
    said = [line for line in capfd.readouterr().err.splitlines()
            if "cannot register with monitor" in line]
    assert said == [f"[lightkeeper] cannot register with monitor http://127.0.0.1:{closed} "
                    "(Connection refused); this rank is not monitored until it can, tried "
                    "every 0 s"], said


def test_a_registration_refused_for_its_token_says_which_token_to_give(monkeypatch, capfd):
    """A monitor started with --token alone refuses a rank without it (HTTP 401): the rank's
    one line names the variable that fixes it, said once however often it is tried."""
    from lightkeeper.processes import wait_until
    from tests.support.http_stub import HttpStub
    from worker_server import server as server_module

    monitor = HttpStub({"POST": (401, b'{"error":"missing or wrong bearer token","status":401}',
                                 {"Content-Type": "application/json"})})
    monkeypatch.setattr(server_module, "REGISTER_INTERVAL_S", 0.02)
    srv = WorkerServer.start(replica_group=0, group_rank=0, group_world_size=1,
                             monitor_url=monitor.url)
    try:
        wait_until(lambda: len(monitor.requests) >= 3, 10, what="three registrations")
    finally:
        srv.stop()
        monitor.close()
    said = [line for line in capfd.readouterr().err.splitlines() if "refused" in line]
    assert len(said) == 1 and "HTTP 401" in said[0], said
    assert "LIGHTKEEPER_REGISTER_TOKEN" in said[0] and "--register-token" in said[0], said


def test_registrations_stopped_during_a_slow_lookup_say_nothing(monkeypatch, capfd):
    """With two monitors, stop() waited for the last registration only, and one whose lookup
    of a monitor's host (DNS) outlasted stop() still said it was not registering."""
    from worker_server import server as server_module

    srv = WorkerServer(RankState(RankIdentity(job="unit"))).serve()
    looked_up, threads = threading.Semaphore(0), []

    def slow_lookup(own_url: str, monitor_url: str) -> bool:  # a DNS answer that comes late
        threads.append(threading.current_thread())
        looked_up.release()
        deadline = time.monotonic() + 5
        while srv.state.phase != "stopped" and time.monotonic() < deadline:
            time.sleep(0.005)
        return True  # on another host: the rank's loopback is out of its reach

    monkeypatch.setattr(server_module, "loopback_for_remote", slow_lookup)
    try:
        srv.register_with("http://monitor-a.example:9400")
        srv.register_with("http://monitor-b.example:9400")
        assert looked_up.acquire(timeout=5) and looked_up.acquire(timeout=5)
    finally:
        t0 = time.monotonic()
        srv.stop()
        took = time.monotonic() - t0
    assert not [t for t in threads if t.is_alive()], "stop() left a registration running"
    for t in threads:
        t.join(5)
    assert took < 1.5
    assert "not registering" not in capfd.readouterr().err


def test_stop_waits_one_second_in_all_for_monitors_that_never_answer(capfd):
    """Two monitors that take the registration and never answer: stop() gives them 1 s in
    all, not each, and neither says anything once the server stopped."""
    import socket

    srv = WorkerServer(RankState(RankIdentity(job="unit"))).serve()
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    taken = []
    before = set(threading.enumerate())
    try:
        for ls in listeners:
            srv.register_with(f"http://127.0.0.1:{ls.getsockname()[1]}")
        registering = [t for t in threading.enumerate() if t not in before]
        for ls in listeners:  # each registration is in flight: its request was sent
            ls.settimeout(5)
            taken.append(ls.accept()[0])
    finally:
        t0 = time.monotonic()
        srv.stop()
        took = time.monotonic() - t0
        for conn in taken + listeners:
            conn.close()  # the requests fail now, not at their 2 s timeout
    for t in registering:
        t.join(5)
    assert took < 1.5
    assert "monitor" not in capfd.readouterr().err
