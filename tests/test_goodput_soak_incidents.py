"""A long run's early faults keep their ledger incident (lightkeeper.recovery.merge_goodput):
``GET /v1/goodput`` lists only the newest incidents, so a soak's later ones push an early
fault's out of the document the demo polls."""

from __future__ import annotations

from lightkeeper import recovery

T0 = 1_800_000_000.0


def incident(i: int, back: bool = True) -> dict:
    """Incident ``i``: group ``i % 3``, detected at ``10 i`` s, back at pace 5 s later."""
    det = T0 + 10.0 * i
    return {"id": i, "kind": "hang", "replica_group": i % 3, "onset_at": det - 1.0,
            "detected_at": det, "evicted_at": det, "back_to_pace_at": det + 5.0 if back else None,
            "open": False, "cost": {"replica_seconds": float(i), "by_cause": {"stall": float(i)}}}


def doc(ids: list[int], **kw) -> dict:
    return {"since": T0, "incidents": [incident(i, **kw) for i in sorted(ids, reverse=True)]}


def fault(i: int) -> dict:
    return {"replica_group": i % 3, "struck_at_s": 10.0 * i - 1.0, "detected_at_s": 10.0 * i,
            "evicted_at_s": 10.0 * i}


def test_an_early_faults_incident_stays_once_newer_ones_push_it_out_of_the_list():
    n = recovery.GOODPUT_INCIDENTS
    seen = None
    for last in range(1, 61):  # one incident more each poll; the API lists the newest n
        seen = recovery.merge_goodput(seen, doc(list(range(max(1, last - n + 1), last + 1))))
    assert len(doc(list(range(11, 61)))["incidents"]) == n  # what the last poll listed
    assert [i["id"] for i in seen["incidents"]] == list(range(60, 0, -1))
    for k in (1, 3, 10, 60):  # every fault finds its incident, settled
        inc = recovery.ledger_incident(fault(k), seen, T0)
        assert inc is not None and inc["id"] == k and inc["back_to_pace_at"] is not None
        assert recovery.measured_cost(inc, T0, 3)["replica_seconds"] == float(k)


def test_each_incident_is_kept_in_its_newest_version():
    seen = recovery.merge_goodput(None, doc([1, 2], back=False))
    seen = recovery.merge_goodput(seen, doc([2]))  # incident 2 back at pace, 1 no longer listed
    seen = recovery.merge_goodput(seen, None)  # a poll that got nothing keeps what was seen
    one, two = seen["incidents"][::-1]
    assert one["back_to_pace_at"] is None and two["back_to_pace_at"] is not None
