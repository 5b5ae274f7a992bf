"""Replica groups of different sizes in one job (trainer/loop.py): each rank all-reduces its
gradient shard with, and heals from, the same group rank of the other groups, so a group of
another size refuses to join, or (groups that started at once) the group of the size fewer have
leaves, in one line. Real trainer processes and a real torchft Lighthouse; the page-reading
rules against a served /status page; a heal from another size in a group of the size most
have, in the real loop over a stand-in for torchft's Manager."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightkeeper.cluster import LocalCluster
from lightkeeper.processes import free_port, stop_process, wait_until
from tests.support.http_stub import HttpStub
from tests.test_trainer_fault_steps import AsyncQuorumManager
from trainer.config import TrainConfig

MISMATCH = "lightkeeper train: error: replica group 1 has 2 rank(s) (WORLD_SIZE) but " \
           "replica_group_0 has 1: groups of different sizes cannot train together"


def loop():
    """trainer.loop, imported by the tests that use it, not at collection: it imports torch,
    which costs every pytest-xdist worker a second of CPU."""
    from trainer import loop

    return loop


def _member(rid: str, world_size: int) -> str:
    return (f'<div class="member\n \n">\n  <b>{rid}</b> <br/>\n  Step: 7 <br/>\n'
            f"  Manager: http://127.0.0.1:1 <br/>\n  TCPStore: 127.0.0.1:2 <br/>\n"
            f"  World size: {world_size} <br/>\n</div>\n")


def _page(members: list[tuple[str, int, str]]) -> str:
    """A torchft 0.2.0 Lighthouse /status page: (replica_id, world size, seen ago) members."""
    beats = "".join(f'<li class="heartbeat\n  ">\n    {rid}: seen {ago} ago\n  </li>\n'
                    for rid, _, ago in members)
    return ("Current quorum_id: 4 <br>\n<h3>Previous Quorum</h3>\nPrevious quorum id: 4 <br>\n"
            f"Num participants: {len(members)} <br>\n<div>\n"
            + "".join(_member(rid, ws) for rid, ws, _ in members)
            + f"</div>\n<h2>Heartbeats</h2>\n<ul>\n{beats}</ul>\n")


@pytest.mark.parametrize("members, refused", [
    ([("replica_group_0:a1", 1, "0.05s")], True),  # a live group of another size
    ([("replica_group_0:a1", 2, "0.05s")], False),  # the same size
    ([("replica_group_0:a1", 1, "3.2s")], False),  # a group that ended: no heartbeat since
    ([("replica_group_1:b2", 1, "0.05s")], False),  # this group's earlier run, restarted
])
def test_only_a_live_other_group_of_another_size_refuses(members, refused):
    with HttpStub({"GET": (200, _page(members))}) as lighthouse:
        why = loop().other_sized_peer(lighthouse.url, 1, 2)
    assert (why is not None) == refused, why
    if refused:
        assert f"lightkeeper train: error: {why}".startswith(MISMATCH)


G0, G1, G2 = "replica_group_0", "replica_group_1", "replica_group_2"


@pytest.mark.parametrize("sizes, group, world_size, tie, leaves", [
    ({G0: 1, G1: 2, G2: 2}, 0, 1, False, G1),  # fewer groups have its size: it leaves
    ({G0: 1, G1: 2, G2: 2}, 1, 2, True, None),  # most have its size: it stays, even healing
    ({G0: 1, G1: 2}, 0, 1, False, None),  # a tie: the heal source stays...
    ({G0: 1, G1: 2}, 1, 2, True, G0),  # ...and the group that heals from it leaves
    (None, 1, 2, False, None),  # /status unread: nothing to go by
])
def test_the_group_of_the_size_fewer_groups_have_leaves(sizes, group, world_size, tie, leaves):
    why = loop().outnumbered(sizes, group, world_size, tie=tie)
    assert (why is None) == (leaves is None), why
    if leaves:
        assert why.startswith(f"replica group {group} has {world_size} rank(s) (WORLD_SIZE) "
                              f"but {leaves} has {sizes[leaves]}: groups of different sizes")


def _serve(pages: list[bytes]) -> HttpStub:
    """A Lighthouse ``/status`` that answers ``pages`` in turn, then the last one for good."""
    return HttpStub({"GET": lambda req: (200, pages.pop(0) if len(pages) > 1 else pages[0])})


class HealsFromAnotherSize(AsyncQuorumManager):
    """torchft's Manager for a one-rank group whose first ``times`` quorums heal it from a
    two-rank group 0: the heal counts the source's step (7), then hands the state to the
    trainer."""

    times = 1

    def __call__(self, **kw):
        self.load_user_state = kw["load_state_dict"]
        return super().__call__(**kw)

    def should_commit(self, timeout=None) -> bool:
        self.wait_quorum()
        if self.quorums <= self.times and self.step == 0:
            self.step = 7
            self.load_user_state({"group_world_size": 2, "replica_group": 0})
        return super().should_commit(timeout)

    def load_state_dict(self, sd) -> None:  # torchft's own part of the state
        self.step = sd["step"]

    def report_error(self, e: Exception) -> None:
        self.error = e


NO_QUORUM = b"Current quorum_id: 0 <br>\n<h3>Previous Quorum</h3>\n<h2>Heartbeats</h2>\n"


def _train_group_1(monkeypatch, pages: list[bytes], manager: AsyncQuorumManager,
                   steps: int = 3) -> int:
    """Group 1's one rank in ``train()`` over ``manager``, its Lighthouse's ``/status`` pages
    answered in turn (the first one read before it joins); three steps."""
    import torch
    import torchft

    lighthouse = _serve(pages)
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "RANK",
                 "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torchft, "Manager", manager)
    cfg = TrainConfig(lighthouse=lighthouse.url, steps=steps, replica_group=1,
                      num_replica_groups=3, worker_server=False,
                      torch_threads=torch.get_num_threads(), connect_timeout_s=5)
    try:
        return loop().train(cfg)
    finally:
        lighthouse.close()


MOST_HAVE_ONE = _page([("replica_group_0:a1", 2, "0.05s"), ("replica_group_1:b2", 1, "0.05s"),
                       ("replica_group_2:c3", 1, "0.05s")]).encode()


def test_a_group_of_the_size_most_have_fails_that_heal_and_trains_on(monkeypatch, caplog):
    """Group 1 (one rank) heals from group 0 (two ranks) while group 2 has one rank too: it
    does not exit (before: it did, status 1); the step is not committed and not counted as
    healed (the next all_reduce is step 0's again, not 7's)."""
    manager = HealsFromAnotherSize(heals={})
    assert _train_group_1(monkeypatch, [NO_QUORUM, MOST_HAVE_ONE], manager) == 0
    assert [step for step, _ in manager.allreduced] == [0, 0, 1, 2]
    assert "not healed: replica group 1 has 1 rank(s) (WORLD_SIZE) but replica_group_0 has 2" \
        in caplog.text


def test_heals_failed_step_after_step_end_in_the_one_line(monkeypatch, caplog, capsys):
    """The odd group stayed (its /status unread after its first quorum, say) and is the heal
    source at every step: before, the heal failed at every step, for ever, committing nothing;
    now the heal after MAX_NOT_HEALED failed ones in a row exits, status 1, with the line."""
    manager = HealsFromAnotherSize(heals={})
    manager.times = loop().MAX_NOT_HEALED + 3  # then it would train on
    assert _train_group_1(monkeypatch, [NO_QUORUM, MOST_HAVE_ONE], manager) == 1
    assert caplog.text.count("not healed: ") == loop().MAX_NOT_HEALED
    err = capsys.readouterr().err
    assert err.count("lightkeeper train: error:") == 1 and "lightkeeper train: error: replica " \
        "group 1 has 1 rank(s) (WORLD_SIZE) but replica_group_0 has 2" in err, err


def test_an_unread_status_after_the_first_quorum_is_read_at_the_next(monkeypatch, capsys):
    """/status unread after the first quorum (a Lighthouse slow then): before, it was never read
    again and the odd group stayed; now the next quorum reads it, and the group leaves."""
    outnumbered_page = _page([("replica_group_0:a1", 2, "0.05s"),
                              ("replica_group_1:b2", 1, "0.05s"),
                              ("replica_group_2:c3", 2, "0.05s")]).encode()
    manager = AsyncQuorumManager(heals={})
    assert _train_group_1(monkeypatch, [NO_QUORUM, b"502 Bad Gateway", outnumbered_page],
                          manager) == 1
    assert [step for step, _ in manager.allreduced] == [0]  # one step, then the next quorum
    err = capsys.readouterr().err
    assert err.count("lightkeeper train: error:") == 1 and "lightkeeper train: error: replica " \
        "group 1 has 1 rank(s) (WORLD_SIZE) but replica_group_0 has 2" in err, err


def test_a_status_that_never_answers_is_read_a_few_times_not_at_every_step(monkeypatch):
    """/status unread quorum after quorum (each read may take seconds): before, every step read
    it again, for good; now a few quorums do, then the heal's own check is left."""
    pages = [NO_QUORUM] + [b"502 Bad Gateway"] * 10 + [MOST_HAVE_ONE]
    manager = AsyncQuorumManager(heals={})
    assert _train_group_1(monkeypatch, pages, manager, steps=8) == 0
    assert len(manager.allreduced) == 8
    assert 11 - len(pages) == loop().SIZE_READS  # the unread pages read after the first quorums


def _rank(tmp: Path, lighthouse: str, group: int, name: str, groups: int = 2, **env) -> tuple:
    out, err = tmp / f"{name}.out", tmp / f"{name}.err"
    base = {k: v for k, v in os.environ.items()
            if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                         "TORCHELASTIC_USE_AGENT_STORE")}
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lightkeeper.cli", "train", "--lighthouse", lighthouse,
             "--num-replica-groups", str(groups), "--replica-group", str(group), "--steps",
             "100000", "--step-pause", "0.1", "--pg-timeout", "5", "--connect-timeout", "20",
             "--quorum-timeout", "180"],
            env={**base, "PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in env.items()}},
            stdout=o, stderr=e, start_new_session=True)
    return proc, out, err


def _group_of_two(tmp: Path, lighthouse: str, group: int = 1, groups: int = 2,
                  name: str = "g1") -> list[tuple]:
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port(), "WORLD_SIZE": 2}
    return [_rank(tmp, lighthouse, group, f"{name}r{r}", groups, RANK=r, LOCAL_RANK=r,
                  **rendezvous) for r in range(2)]


def _steps(out: Path) -> list[str]:
    return re.findall(r"step=\d+ quorum_id=.*", out.read_text())


@pytest.mark.e2e
def test_a_group_of_another_size_refuses_to_join_and_the_job_trains_on(tmp_path):
    """A one-rank group trains; a two-rank group started beside it exits, each rank with the
    one line naming the mismatch (before: it joined, stalled the job's step and died healing
    with a tensor-size traceback); the first group never has it in a quorum and trains on."""
    cluster = LocalCluster(tmp_path, num_groups=2)
    procs = []
    try:
        lighthouse = cluster.start_lighthouse()
        procs.append(g0 := _rank(tmp_path, lighthouse, 0, "g0"))
        wait_until(lambda: len(_steps(g0[1])) >= 3 or g0[0].poll() is not None, 120,
                   what="group 0's first steps")
        procs += (g1 := _group_of_two(tmp_path, lighthouse))
        for proc, _, _ in g1:
            wait_until(lambda proc=proc: proc.poll() is not None, 120, what="group 1 to exit")
        at_exit = len(_steps(g0[1]))
        wait_until(lambda: len(_steps(g0[1])) >= at_exit + 5 or g0[0].poll() is not None, 60,
                   what="group 0 to train on")
        for proc, out, err in g1:
            text = err.read_text()
            assert proc.returncode == 1, out.read_text()[-2000:] + text[-3000:]
            assert MISMATCH in text and "Traceback" not in text, text[-3000:]
            assert text.count("lightkeeper train: error:") == 1, text[-3000:]
        assert g0[0].poll() is None, g0[2].read_text()[-3000:]
        steps = _steps(g0[1])
        assert all("participants=1 " in s and "committed=True" in s for s in steps), steps
    finally:
        for proc, _, _ in procs:
            stop_process(proc, grace=0)
        cluster.stop()


@pytest.mark.e2e
def test_groups_of_different_sizes_that_start_at_once_refuse_at_the_heal(tmp_path):
    """Neither sees the other before its first quorum (the Lighthouse waits for both): they meet
    in it, and the two-rank group, healing from group 0 at step 0, exits with the same line
    instead of the tensor-size traceback of loading the other group's unsharded state."""
    cluster = LocalCluster(tmp_path, num_groups=2, min_replicas=2)
    procs = []
    try:
        lighthouse = cluster.start_lighthouse()
        procs.append(_rank(tmp_path, lighthouse, 0, "g0"))
        procs += (g1 := _group_of_two(tmp_path, lighthouse))
        proc, out, err = g1[0]  # group rank 0 heals from group 0's only rank
        wait_until(lambda: proc.poll() is not None, 120, what="group 1's rank 0 to exit")
        text = err.read_text()
        assert proc.returncode == 1, out.read_text()[-2000:] + text[-3000:]
        assert MISMATCH in text and "Traceback" not in text, text[-3000:]
        assert "participants=2" not in out.read_text()  # it committed nothing with group 0
    finally:
        for proc, _, _ in procs:
            stop_process(proc, grace=0)
        cluster.stop()


@pytest.mark.e2e
def test_a_group_of_another_size_started_with_the_others_leaves_and_they_train(tmp_path):
    """Three groups start at once, the odd one (one rank; the others two) first: torchft makes
    it the heal source at step 0. Before, the two-rank groups exited at the heal, their
    restarts were refused for the odd group that stayed, and the job was stuck. Now the odd
    group sees most groups of the quorum have another size and leaves with the one line; the
    others fail that step's heal without exiting and train on, with group 0 restarted at the
    job's size as a scheduler would."""
    cluster = LocalCluster(tmp_path, num_groups=3, min_replicas=3)  # all three in the 1st quorum
    procs = []
    try:
        lighthouse = cluster.start_lighthouse()
        procs.append(odd := _rank(tmp_path, lighthouse, 0, "g0", 3))
        procs += (right := _group_of_two(tmp_path, lighthouse, 1, 3, "g1")
                  + _group_of_two(tmp_path, lighthouse, 2, 3, "g2"))
        wait_until(lambda: any(p.poll() is not None for p, _, _ in procs), 240,
                   what="a rank to exit")
        wait_until(lambda: odd[0].poll() is not None, 30, what="the odd group to exit")
        text = odd[2].read_text()
        assert odd[0].returncode == 1 and "Traceback" not in text, text[-3000:]
        assert text.count("lightkeeper train: error:") == 1, text[-3000:]
        assert "lightkeeper train: error: replica group 0 has 1 rank(s) (WORLD_SIZE) but " \
               "replica_group_1 has 2: groups of different sizes" in text, text[-3000:]
        procs += (again := _group_of_two(tmp_path, lighthouse, 0, 3, "g0b"))
        wait_until(lambda: all(sum("participants=3 " in s and "committed=True" in s
                                   for s in _steps(out)) >= 3 for _, out, _ in right + again)
                   or any(p.poll() is not None for p, _, _ in right + again), 240,
                   what="the three groups of two to train together")
        for proc, out, err in right + again:
            assert proc.poll() is None, out.read_text()[-2000:] + err.read_text()[-3000:]
    finally:
        for proc, _, _ in procs:
            stop_process(proc, grace=0)
        cluster.stop()
