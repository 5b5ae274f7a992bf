"""A rank listed by one URL (``--targets localhost:PORT``) that registers under another
(``http://127.0.0.1:PORT``) is one target once a sweep reads both answering as one process
(the same host, pid and started_at): monitor/poll/discovery.py, ``fold_same_process``."""

from __future__ import annotations

import os
import types

import requests

from lightkeeper.processes import wait_until
from monitor.poll.discovery import Discovery
from tests.test_monitor_trust import bare_monitor
from worker_server import RankIdentity, RankState, WorkerServer


def test_a_rank_listed_by_name_that_registers_by_address_is_one_verified_target(tmp_path):
    state = RankState(RankIdentity(job="unit", replica_group=0, group_rank=0, group_world_size=1))
    srv = WorkerServer(state, host="127.0.0.1", port=0).serve()
    port = srv.url.rsplit(":", 1)[1]
    listed = f"http://localhost:{port}"
    mon = bare_monitor(tmp_path, targets=[f"localhost:{port}"])
    try:
        srv.register_with(mon.url)  # as every WorkerServer given the monitor's URL does

        def one_row() -> list:  # folded, and a sweep published since
            ranks = requests.get(mon.url + "/v1/ranks", timeout=5).json()
            return ranks if [(r["url"], r["registered_as"]) for r in ranks] == \
                [(listed, srv.url)] else []

        ranks = wait_until(one_row, 10, interval=0.05, what="one row for the rank")
        trust = ranks[0]["verification"]
        assert ranks[0]["reachable"] and ranks[0]["source"] == "static", ranks
        # no Lighthouse here: unverifiable, but evidence; never rank_taken by its own copy
        assert trust["evidence"] and trust["reason"] in ("ok", "no_lighthouse"), trust
        targets = requests.get(mon.url + "/v1/targets", timeout=5).json()
        assert [(t["url"], t["source"], t["rank"]) for t in targets] == [(listed, "static", 0)]
    finally:
        srv.stop()
        mon.stop()


def answering(**states) -> dict:
    """URL -> what the sweep saw (a RankView's ``reachable`` and ``state``)."""
    return {u: types.SimpleNamespace(reachable=s is not None, state=s) for u, s in states.items()}


def ident(pid=7, started_at=100.5, host="node-a") -> dict:
    return {"host": host, "pid": pid, "started_at": started_at, "replica_group": 0, "rank": 3}


NAME, ADDR = "http://trainer-a:9500", "http://10.0.0.7:9500"


def known(d: Discovery) -> list[tuple]:
    return sorted((t.url, t.source, t.rank, t.registered_as) for t in d.targets())


def test_one_process_under_two_urls_is_folded_and_its_registrations_annotate_the_listed():
    d = Discovery(["trainer-a:9500"], forget_after_s=30)
    d.register({"url": ADDR, "rank": 3}, now=1.0)
    assert known(d) == [(ADDR, "registered", 3, None), (NAME, "static", None, None)]
    d.fold_same_process(answering(**{NAME: ident(), ADDR: ident()}), now=2.0)
    assert known(d) == [(NAME, "static", 3, ADDR)]
    # its next registrations annotate the listed target instead of adding it back
    d.register({"url": ADDR, "rank": 3}, now=6.0)
    d.fold_same_process(answering(**{NAME: ident()}), now=7.0)
    assert known(d) == [(NAME, "static", 3, ADDR)]


def test_processes_of_other_or_missing_identity_are_never_folded_nor_a_listed_target_dropped():
    pairs = [(ident(), ident(pid=8)), (ident(), ident(started_at=100.6)),
             (ident(), ident(host="node-b")),
             (ident(), {**ident(), "rank": 4}), (ident(), {**ident(), "replica_group": 1}),
             # missing on both sides: no telling two processes apart
             (ident(pid=None), ident(pid=None)), (ident(started_at=None), ident(started_at=None)),
             (ident(host=None), ident(host=None))]
    for listed_state, registered_state in pairs:
        d = Discovery(["trainer-a:9500", "10.0.0.9:9500"])
        d.register({"url": ADDR, "rank": 3}, now=1.0)
        d.fold_same_process(answering(**{NAME: listed_state, ADDR: registered_state,
                                         "http://10.0.0.9:9500": None}), now=2.0)
        assert sorted(t.url for t in d.targets()) == [ADDR, "http://10.0.0.9:9500", NAME], \
            registered_state
    # two listed targets of one process both stay listed (the operator's to fix)
    d = Discovery(["trainer-a:9500", "10.0.0.7:9500"])
    d.fold_same_process(answering(**{NAME: ident(), ADDR: ident()}), now=2.0)
    assert known(d) == [(ADDR, "static", None, None), (NAME, "static", None, None)]


def test_a_copied_identity_folds_away_only_the_registrant_itself():
    d = Discovery(["trainer-a:9500"])
    d.register({"url": "http://10.6.6.6:9500", "rank": 0}, now=1.0)  # serves NAME's identity
    d.fold_same_process(answering(**{NAME: ident(), "http://10.6.6.6:9500": ident()}), now=2.0)
    assert [(t.url, t.source) for t in d.targets()] == [(NAME, "static")]


def test_the_alias_ends_when_the_listed_target_restarts_goes_or_stops_registering():
    # restarted: the listed target answers as another process, the address registers again
    d = Discovery(["trainer-a:9500"], forget_after_s=30)
    d.register({"url": ADDR, "rank": 3}, now=1.0)
    d.fold_same_process(answering(**{NAME: ident(), ADDR: ident()}), now=2.0)
    d.fold_same_process(answering(**{NAME: ident(started_at=200.0)}), now=3.0)
    assert known(d) == [(NAME, "static", None, None)]  # the old process's hints went with it
    d.register({"url": ADDR, "rank": 3}, now=4.0)
    assert known(d) == [(ADDR, "registered", 3, None), (NAME, "static", None, None)]
    # folded again once a sweep reads both as the new process
    d.fold_same_process(answering(**{NAME: ident(started_at=200.0),
                                     ADDR: ident(started_at=200.0)}), now=5.0)
    assert known(d) == [(NAME, "static", 3, ADDR)]

    # the listed target stops answering: a registration under the address is polled again
    d.fold_same_process(answering(**{NAME: None}), now=6.0)
    d.register({"url": ADDR, "rank": 3}, now=7.0)
    assert (ADDR, "registered", 3, None) in known(d)

    # no registration for --forget-after: the alias is forgotten
    d = Discovery(["trainer-a:9500"], forget_after_s=30)
    d.register({"url": ADDR, "rank": 3}, now=1.0)
    d.fold_same_process(answering(**{NAME: ident(), ADDR: ident()}), now=2.0)
    d.fold_same_process(answering(**{NAME: ident()}), now=40.0)
    d.register({"url": ADDR, "rank": 3}, now=41.0)
    assert (ADDR, "registered", 3, None) in known(d)


def test_a_listed_url_that_misses_a_poll_has_the_registered_one_polled_again_at_once():
    """The listed spelling (a Service, a forwarder) fails while the rank's own address works:
    the registered URL is back in the targets in the same sweep, not at the rank's next
    registration, so the rank is read at the next sweep and never judged dead meanwhile."""
    d = Discovery(["trainer-a:9500"], forget_after_s=30)
    d.register({"url": ADDR, "rank": 3}, now=1.0)
    d.fold_same_process(answering(**{NAME: ident(), ADDR: ident()}), now=2.0)
    assert known(d) == [(NAME, "static", 3, ADDR)]
    d.fold_same_process(answering(**{NAME: None}), now=3.0)
    assert known(d) == [(ADDR, "registered", 3, None), (NAME, "static", None, None)]
    # restarted, not unreachable: nothing put back (the new process registers anew)
    d.fold_same_process(answering(**{NAME: ident(), ADDR: ident()}), now=4.0)
    d.fold_same_process(answering(**{NAME: ident(started_at=200.0)}), now=5.0)
    assert known(d) == [(NAME, "static", None, None)]


def test_an_alias_to_a_listed_target_gone_from_the_file_registers_as_itself(tmp_path):
    sd = tmp_path / "sd.json"
    sd.write_text('[{"targets": ["trainer-a:9500"]}]')
    d = Discovery(targets_file=str(sd))
    d.refresh()
    d.register({"url": ADDR, "rank": 3}, now=1.0)
    d.fold_same_process(answering(**{NAME: ident(), ADDR: ident()}), now=2.0)
    assert known(d) == [(NAME, "file_sd", 3, ADDR)]
    sd.write_text("[]")
    os.utime(sd, (10, 10))  # another mtime: re-read
    d.refresh()
    d.register({"url": ADDR, "rank": 3}, now=3.0)
    assert known(d) == [(ADDR, "registered", 3, None)]


def test_a_store_found_rank_that_registers_too_is_polled_once():
    """Lightkeeper's handlers on the job's own torch server: torch's store names the host,
    the WorkerServer registers its address; two targets of one process claimed its rank twice,
    so neither was verified (and its group's hang went unseen)."""
    store_url, reg_url = "torch+http://trainer-a:9500", "torch+http://127.0.0.1:9500"
    d = Discovery()
    d.set_torch({store_url: (0, 3)})
    d.register({"url": reg_url, "rank": 3}, now=1.0)
    assert sorted(t.url for t in d.targets()) == [reg_url, store_url]
    d.fold_same_process(answering(**{store_url: ident(), reg_url: ident()}), now=2.0)
    assert [(t.url, t.source) for t in d.targets()] == [(reg_url, "registered")]
    d.fold_same_process(answering(**{reg_url: ident()}), now=3.0)  # the store's not polled
    assert [t.url for t in d.targets()] == [reg_url]
    # the registered one out of reach (or another process): the store's is polled again
    d.fold_same_process(answering(**{reg_url: None}), now=4.0)
    assert sorted(t.url for t in d.targets()) == [reg_url, store_url]
    d.fold_same_process(answering(**{store_url: ident(), reg_url: ident(pid=8)}), now=5.0)
    assert sorted(t.url for t in d.targets()) == [reg_url, store_url]
