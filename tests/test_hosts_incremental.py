"""The host ledger's ``observe`` reads only the ranks whose RankView a sweep made anew
(``ViewBuilder.changed``, docs/scaling.md), or of those only the ones that did more than progress
(``ViewBuilder.reshaped``: what the monitor passes): sweep after sweep of leader polling (ranks
changing host, node, device, replica id, going dark and superseded), what it knows equals what a
ledger that reads every rank afresh knows."""

from __future__ import annotations

import pytest

from monitor.act.hosts import HostLedger
from monitor.config import QuarantineConfig
from monitor.evidence.view import ViewBuilder
from monitor.poll.discovery import Target
from monitor.poll.poller import RankPoll
from monitor.store import Store
from tests.support.monitor_sim import rank_state

T0 = 1000.0


def _state(r: int, host: str, rid: str, device: int = 0) -> dict:
    s = rank_state(r, r // 4, now=T0)
    s.update(group_rank=r % 4, group_world_size=4, host=host, node=f"node-{host}",
             replica_id=rid, device={"type": "cuda", "index": device})
    return s


def _known(led: HostLedger, view) -> tuple:
    return ({h: (d["last_seen"], d["node"], list(d["devices"])) for h, d in led.hosts.items()},
            {h: led._on_host(h) for h in led.known_hosts()}, led.known_hosts())


@pytest.mark.parametrize("told", ["changed", "reshaped"])
def test_observe_of_the_changed_ranks_equals_observe_of_every_rank(tmp_path, told):
    # target 16: silent until it takes rank 14's slot (on h8) while rank 14 is dark and not
    # asked: rank 14's RankView is then superseded without being polled
    targets = [Target(f"http://127.0.0.1:{9000 + r}", "static") for r in range(17)]
    states = {r: _state(r, f"h{r // 2}", f"g{r // 4}:a") for r in range(16)}
    states[14] = _state(14, "h10", "g3:a")  # alone on its host
    states[16] = _state(14, "h8", "g3:a")
    down: set[int] = {16}
    vb = ViewBuilder()
    inc = HostLedger(Store(str(tmp_path / "a.sqlite")), QuarantineConfig(), [], "job",
                     lambda: T0)
    inc.hosts = {"h1": {"host": "h1", "node": "h1", "devices": [], "state": "suspect",
                        "state_since": T0, "first_seen": T0, "last_seen": None},
                 "h6": {"host": "h6", "node": "h6", "devices": [], "state": "suspect",
                        "state_since": T0, "first_seen": T0, "last_seen": None}}
    changes = {  # sweep -> what changes before it
        2: lambda: states[3].update(device={"type": "cuda", "index": 5}),
        4.5: lambda: states[3].update(node="node-elsewhere"),  # h1's last rank: its node
        3: lambda: states.__setitem__(5, _state(5, "h9", "g1:a")),  # rank 5 moved host
        4: lambda: down.add(13),
        5: lambda: states.__setitem__(13, _state(13, "h6", "g3:b")),
        6: lambda: (down.discard(13), states.__setitem__(12, _state(12, "h6", "g3:b")),
                    states.__setitem__(2, _state(2, "h1", "g0:b")),  # a new incarnation
                    down.add(14)),
        8: lambda: down.discard(16),  # rank 14 last polled at 6: carried since
    }
    for sweep in range(10):
        now = T0 + sweep
        for at, change in changes.items():
            if int(at) == sweep:
                change()
        # leaders every sweep, one member in four: leader polling's shape
        asked = {r for r in range(16) if r % 4 == 0 or r % 4 == sweep % 4 or r in (12, 13)} \
            | {16}
        polls = {targets[r].url: (RankPoll(targets[r].url, False, reason="connection",
                                           error="refused") if r in down else
                                  RankPoll(targets[r].url, True, data=dict(states[r])))
                 for r in asked}
        # with verdicts (as the monitor): progress only is told apart (ViewBuilder's moved ranks)
        view = vb.update(targets, polls, now=now,
                         polled=None if sweep == 0 else {targets[r].url for r in asked},
                         judge=(lambda ranks, changed: {}) if told == "reshaped" else None)
        inc.observe(view, now, getattr(vb, told))
        if told == "reshaped" and sweep == 8:
            assert len(vb.reshaped) < len(vb.changed)  # progress only: not read again
        full = HostLedger(Store(str(tmp_path / f"f{sweep}.sqlite")), QuarantineConfig(), [],
                          "job", lambda: T0)
        full.hosts = {h: {**d, "devices": []} for h, d in inc.hosts.items()}
        full.observe(view, now)
        assert _known(inc, view) == _known(full, view), sweep
    assert inc._on_host("h9") == {"g1:a"} and "g0:b" in inc._on_host("h1")
    assert view.ranks[targets[14].url].superseded and inc._on_host("h8") == {"g3:a"}
    assert not inc._on_host("h10")  # its superseded process no longer counts there
    assert inc.hosts["h1"]["devices"] == ["cuda:0", "cuda:5"]
