"""What the monitor keeps of a ``/v1/state`` answer (monitor/poll/packed_state.py): the fields
docs/CONTRACTS.md lists, each bounded, whatever else an answer carries. ``--max-state-bytes``
bounds the bytes on the wire; 1 MiB of ``{}`` under an unknown key parsed to ~25 MB kept per
target. In process: ``judge_body``, as the poller (thread or process) reads every answer."""

from __future__ import annotations

import json
import time
import tracemalloc

from monitor.api.views import ranks_json
from monitor.evidence.rank import valid_state
from monitor.evidence.view import ViewBuilder
from monitor.poll.discovery import Target
from monitor.poll.packed_state import (
    MAX_FAULTS,
    NAME_CHARS,
    STATE_FIELDS,
    TEXT_CHARS,
    pack_state,
)
from monitor.poll.poller import MAX_BODY, judge_body
from rank_wire import TIMING_ROW, TIMING_ROWS
from tests.support.monitor_sim import rank_state
from tests.support.virtual_ranks import VirtualRanks
from tests.test_contracts_doc import CONTRACTS, key_table, section, tables

MB = 1 << 20


def answers() -> list[bytes]:
    """A WorkerServer's answers as the monitor asks them (packed) and as an older server
    serves them (lists), with and without timing rows."""
    vr = VirtualRanks(16, 0, 8, 1.0, epoch=time.monotonic() - 40.3)
    step = json.loads(vr.state_asked(0))["step"]
    fresh = VirtualRanks(16, 0, 8, 1.0, epoch=time.monotonic())
    return [vr.state_asked(0, f"?since={step - 1}&recent=16&packed=1"),
            vr.state_asked(1, "?recent=16&packed=1"), vr.state_asked(2), fresh.state_asked(3)]


def padded(doc: dict, key: str = "x", filler: bytes = b"{},", limit: int = MAX_BODY) -> bytes:
    """``doc`` with ``key`` holding a list of ``filler`` up to ``limit`` bytes: valid JSON."""
    head = json.dumps(doc)[:-1].encode() + f', "{key}": ['.encode()
    n = (limit - len(head) - 2) // len(filler)
    return head + (filler * n)[:-1] + b"]}"


def kept(body: bytes) -> tuple[dict, int]:
    """The state judge_body keeps of ``body`` and the bytes that still holds once parsed."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        p = judge_body("u", body, 0.0, 1.0, state=True)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert p.ok, p.error
    return p.data, held


def test_an_answer_padded_to_the_limit_keeps_none_of_the_padding():
    normal = answers()[1]
    doc = json.loads(normal)
    for body in (padded(doc),  # the usual decoder: the unknown key is never built
                 padded({**doc, "loss": float("nan")}),  # NaN: read by json.loads, then cut
                 padded({**doc, "step": True}),  # the wrong type: read leniently, then cut
                 padded(doc, "x", b'"' + b"x" * 4096 + b'",')):
        assert len(body) > MAX_BODY - 8192
        state, held = kept(body)
        assert "x" not in state and set(state) == set(doc)
        assert held < 2 * MB, held
    state, _ = kept(padded(doc))
    assert state == judge_body("u", normal, 0.0, 1.0, state=True).data


def test_padding_inside_the_known_fields_is_cut_to_bounded_sizes():
    """Each known field a registrant can fill: strings, lists, objects and their rows."""
    doc = json.loads(answers()[2])
    big = "h" * (MAX_BODY // 8)
    many = [{}] * 20_000
    bodies = [
        json.dumps({**doc, "host": big, "node": big, "job": many, "lighthouse": big}),
        json.dumps({**doc, "faults": [big] * 4 + ["f"] * 5000,
                    "faults_struck_at": {f"s{i}": 1.0 for i in range(20_000)}}),
        json.dumps({**doc, "device": {"type": "cpu", "x": many},
                    "timing": {**doc["timing"], "x": many, "waiting": {"scope": "group",
                                                                        "x": many},
                               "recent": doc["timing"]["recent"] * 200}}),
        json.dumps({**doc, "recent_step_seconds": [0.5] * 50_000, "pid": many, "loss": "NaN"}),
    ]
    for body in bodies:
        body = body.encode()
        assert len(body) <= MAX_BODY
        state, held = kept(body)
        assert held < 2 * MB, held
        assert set(state) <= STATE_FIELDS
    host, faults, device, steps = (kept(b.encode())[0] for b in bodies)
    assert len(host["host"]) == len(host["node"]) == TEXT_CHARS and len(host["job"]) <= 8
    assert len(host["lighthouse"]) == TEXT_CHARS
    assert len(faults["faults"]) == MAX_FAULTS
    assert all(len(f) <= NAME_CHARS for f in faults["faults"])
    assert len(faults["faults_struck_at"]) == MAX_FAULTS
    assert device["device"] == {"type": "cpu"} and "x" not in device["timing"]
    assert device["timing"]["waiting"] == {"scope": "group"}
    assert len(device["timing"]["recent"]) == TIMING_ROWS * TIMING_ROW.size
    assert len(steps["recent_step_seconds"]) == 64 * 8
    # a wrong type is still named (and so no state), shortened
    assert valid_state(steps) == f"pid is {[{}] * 8!r}"


def test_identities_are_kept_whole_and_the_newest_faults():
    """A job name or a torchft replica id (a pod name as its prefix, then ``:uuid``) past 256
    characters is compared whole with --job, the Lighthouse's ids and a signature's identity:
    never cut. Over MAX_FAULTS faults, the newest are kept: a finding is timed from them."""
    doc = json.loads(answers()[2])
    job, rid = "j" * 300, "g" * 240 + ":0b0f6a52-6d55-4e7a-9c2e-1f6a52d0b0f6"
    for extra in ({}, {"loss": "NaN"}):  # the typed decoder and the lenient path alike
        state, _ = kept(json.dumps({**doc, **extra, "job": job, "replica_id": rid}).encode())
        assert (state["job"], state["replica_id"]) == (job, rid)
    specs = [f"slow:delay=0.1,from_step={i}" for i in range(MAX_FAULTS + 6)]
    state, _ = kept(json.dumps({**doc, "faults": specs, "faults_struck_at": {
        s: 1000.0 + i for i, s in enumerate(specs)}}).encode())
    assert state["faults"] == specs[-MAX_FAULTS:]
    assert max(state["faults_struck_at"].values()) == 1000.0 + len(specs) - 1


def test_a_normal_answer_keeps_every_field():
    for body in answers():
        served = json.loads(body)
        state = judge_body("u", body, 0.0, 1.0, state=True).data
        assert set(state) == set(served)
        assert set(state["timing"]) == set(served["timing"])
        assert state == pack_state(json.loads(body))
        nan = body.replace(b'"loss": ', b'"loss": NaN, "was": ', 1)  # the lenient path
        assert nan != body
        assert judge_body("u", nan, 0.0, 1.0, state=True).data == {**state, "loss": None}


def test_the_fields_kept_are_the_contracts():
    """A field added to docs/CONTRACTS.md's /v1/state table and not to the monitor's schema
    would be dropped from every answer, unseen."""
    keyed = [body for head, body in tables(section(CONTRACTS, "WorkerServer `GET /v1/state`"))
             if head[0] == "key"]
    assert STATE_FIELDS == key_table(keyed[0])[0]


def test_the_api_echoes_bounded_host_and_faults():
    now = time.time()
    t = Target("http://127.0.0.1:9000", "static")
    doc = {**rank_state(0, 0, now=now), "host": "h" * 100_000, "faults": ["f" * 1000] * 1000}
    poll = judge_body(t.url, json.dumps(doc).encode(), 0.0, now, state=True)
    view = ViewBuilder().update([t], {t.url: poll}, now=now, polled={t.url})
    row, = ranks_json(view, now)
    assert row["reachable"] and row["host"] == "h" * TEXT_CHARS
    assert row["faults"] == ["f" * NAME_CHARS] * MAX_FAULTS
