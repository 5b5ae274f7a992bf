"""Replica groups of different sizes in one job (trainer/loop.py): each rank all-reduces its
gradient shard with, and heals from, the same group rank of the other groups, so a group of
another size refuses to join, in one line. Real trainer processes and a real torchft Lighthouse;
the page-reading rules against a served /status page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from lightkeeper.cluster import LocalCluster
from lightkeeper.processes import free_port, stop_process, wait_until
from trainer.loop import other_sized_peer

MISMATCH = "lightkeeper train: error: replica group 1 has 2 rank(s) (WORLD_SIZE) but " \
           "replica_group_0 has 1: groups of different sizes cannot train together"


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
    page = _page(members).encode()

    class Status(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    lighthouse = ThreadingHTTPServer(("127.0.0.1", 0), Status)
    threading.Thread(target=lighthouse.serve_forever, args=(0.05,), daemon=True).start()
    try:
        why = other_sized_peer(f"http://127.0.0.1:{lighthouse.server_address[1]}", 1, 2)
    finally:
        lighthouse.shutdown()
        lighthouse.server_close()
    assert (why is not None) == refused, why
    if refused:
        assert f"lightkeeper train: error: {why}".startswith(MISMATCH)


def _rank(tmp: Path, lighthouse: str, group: int, name: str, **env) -> tuple:
    out, err = tmp / f"{name}.out", tmp / f"{name}.err"
    base = {k: v for k, v in os.environ.items()
            if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                         "TORCHELASTIC_USE_AGENT_STORE")}
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lightkeeper.cli", "train", "--lighthouse", lighthouse,
             "--num-replica-groups", "2", "--replica-group", str(group), "--steps", "100000",
             "--step-pause", "0.1", "--pg-timeout", "5", "--connect-timeout", "20"],
            env={**base, "PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in env.items()}},
            stdout=o, stderr=e, start_new_session=True)
    return proc, out, err


def _group_of_two(tmp: Path, lighthouse: str) -> list[tuple]:
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port(), "WORLD_SIZE": 2}
    return [_rank(tmp, lighthouse, 1, f"g1r{r}", RANK=r, LOCAL_RANK=r, **rendezvous)
            for r in range(2)]


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
