"""Launch semantics of ``lightkeeper train`` (trainer/store.py), torch's ``env://`` convention:
group rank 0 hosts the replica group's TCPStore unless torchrun's agent does, the others connect
with a bound and fail naming the address. Real TCPStores, real trainer processes, a real
torchft Lighthouse."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightkeeper.cluster import LocalCluster
from lightkeeper.processes import free_port, stop_process, wait_until
from trainer.store import StoreUnavailable, group_store


def env(**kv) -> dict[str, str]:
    return {k: str(v) for k, v in kv.items()}


def test_lone_rank_without_master_addr_hosts_its_own_store():
    gs = group_store(0, 1, timeout_s=2, env={})
    assert gs.hosted and gs.addr == "127.0.0.1" and gs.port > 0
    gs.store.set("k", "v")


def test_lone_rank_advertises_the_address_it_binds_and_is_reached_there():
    """Other groups connect to a lone rank's store to build the cross-group process group:
    on a host of its own it must advertise that host's address, not 127.0.0.1."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from trainer.store import advertised_address

    gs = group_store(0, 1, timeout_s=2, env={}, bind="127.0.0.7")
    assert gs.addr == "127.0.0.7"
    gs.store.set("k", "v")
    peer = TCPStore(gs.addr, gs.port, is_master=False, timeout=timedelta(seconds=5))
    assert peer.get("k") == b"v"
    assert advertised_address("0.0.0.0") == socket.gethostname()


def test_rank0_hosts_at_master_port_and_rank1_connects_to_it():
    port = free_port()
    e = env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    host = group_store(0, 2, timeout_s=5, env=e)
    assert host.hosted and host.address == f"127.0.0.1:{port}"
    peer = group_store(1, 2, timeout_s=5, env=e)
    assert not peer.hosted
    host.store.set("from_rank0", "hello")
    assert peer.store.get("from_rank0") == b"hello"


def test_rank1_without_a_store_fails_within_the_bound_naming_the_address():
    port = 1  # nothing listens on port 1; a port picked and let go may be another test's store
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"no TCPStore at 127.0.0.1:{port} .* after 1.5s: "
                                               "group rank 0 hosts"):
        group_store(1, 2, timeout_s=1.5, env=env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
    assert time.monotonic() - started < 3.0


def test_under_torchrun_rank0_connects_to_the_agents_store_instead_of_hosting():
    port = 1  # nothing listens on port 1: no agent's store there
    with pytest.raises(StoreUnavailable, match="torchrun's agent hosts"):
        group_store(0, 2, timeout_s=1, env=env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                               TORCHELASTIC_USE_AGENT_STORE="True"))


def _agent(restart_count: int, port: int) -> dict[str, str]:
    """The variables torchrun's agent gives a worker of attempt ``restart_count``."""
    return env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="True",
               TORCHELASTIC_RESTART_COUNT=restart_count)


def _group_of_two(e: dict[str, str]):
    """Group ranks 0 and 1 of one attempt, started together as torchrun does."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        ranks = [pool.submit(group_store, r, 2, timeout_s=5, env=e) for r in (1, 0)]
        return ranks[1].result(), ranks[0].result()


def test_under_torchrun_each_attempt_gets_a_fresh_store_not_the_agents():
    """torchrun's agent keeps one store, keys and all, across its restarts: a restarted group
    must not see the previous attempt's keys (rendezvous addresses, Manager address, replica
    id)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    agent = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=5))
    rank0, rank1 = _group_of_two(_agent(0, agent.port))
    assert rank0.hosted and not rank1.hosted and rank0.address == rank1.address
    assert rank0.port != agent.port
    rank0.store.set("replica_id", "evicted")
    assert rank1.store.get("replica_id") == b"evicted"

    # attempt 1: rank 0 publishes before rank 1 looks, then rank 1 alone
    new0 = group_store(0, 2, timeout_s=5, env=_agent(1, agent.port))
    new1 = group_store(1, 2, timeout_s=5, env=_agent(1, agent.port))
    assert new1.address == new0.address != rank0.address
    assert not new1.store.check(["replica_id"])
    new0.store.set("replica_id", "fresh")
    assert new1.store.get("replica_id") == b"fresh"
    assert not agent.check(["replica_id"])  # nothing of the group's own lands in the agent's


def test_under_torchrun_rank1_without_rank0_fails_within_the_bound_naming_the_key():
    from datetime import timedelta

    from torch.distributed import TCPStore

    agent = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=5))
    group_store(0, 2, timeout_s=5, env=_agent(0, agent.port))  # attempt 0's is no answer
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match=(
            f"'lightkeeper/attempt_1/store' in torchrun's agent store at 127.0.0.1:{agent.port}"
            r"\) within 0.5s")):
        group_store(1, 2, timeout_s=0.5, env=_agent(1, agent.port))
    assert time.monotonic() - started < 1.5


@pytest.mark.parametrize("e, words", [
    ({}, "a replica group of 2 ranks needs MASTER_ADDR and MASTER_PORT"),
    ({"MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT='' is not a port number"),
    ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"}, "MASTER_PORT='http' is not a port"),
    ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a port number \(1..65535\)"),
])
def test_bad_rendezvous_variables_are_named(e, words):
    with pytest.raises(StoreUnavailable, match=words):
        group_store(1, 2, timeout_s=1, env=e)


def test_rank0_that_cannot_listen_says_where():
    taken = group_store(0, 1, timeout_s=2, env={})  # something already listens there
    with pytest.raises(StoreUnavailable, match=f"cannot listen on 127.0.0.1:{taken.port}"):
        group_store(0, 2, timeout_s=1, env=env(MASTER_ADDR="127.0.0.1", MASTER_PORT=taken.port))


def _train_env(**extra) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                         "TORCHELASTIC_USE_AGENT_STORE")}
    return {**base, "PYTHONUNBUFFERED": "1", **env(**extra)}


def listening(pid: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The address of each TCP socket process ``pid`` listens on, from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            inodes.add(os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[")[:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            local, state, inode = (f := row.split())[1], f[3], f[9]
            if state == "0A" and inode in inodes:  # LISTEN
                raw = bytes.fromhex(local.split(":")[0])  # 32-bit words in host (little) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                addr = ipaddress.ip_address(raw)
                out.append(getattr(addr, "ipv4_mapped", None) or addr)
    return out


# From its last step logged to its exit a rank of a 2-group job measured 3.1-5.4 s under load
# (the interpreter tearing down torch's modules and the cross-group process group, the
# WorkerServer's stop waiting out waitress' 1 s select), and 0.08-0.10 s once it ends after its
# own cleanup (trainer.loop.end_process). The bound is loose for a loaded 2-core machine.
PROMPT_EXIT_S = 2.0


@pytest.mark.e2e
def test_bare_rank0_with_master_variables_trains_and_ranks_exit_promptly(tmp_path):
    """A lone rank 0 under a launcher that sets MASTER_ADDR/MASTER_PORT (no torchrun) hosts the
    store itself and trains (before, it blocked in the Manager's TCPStore connect), in a quorum
    with a second group's lone rank (no MASTER_ADDR: it hosts its own store). Once they trained
    their steps each exits within PROMPT_EXIT_S of its last step, status 0, its log flushed,
    nothing left in its session: neither leaves the other hanging."""
    cluster = LocalCluster(tmp_path, num_groups=2, min_replicas=2)
    steps = 3
    procs, logs = [], []
    try:
        lighthouse = cluster.start_lighthouse()
        for group, extra in ((0, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port(),
                                  "RANK": 0, "WORLD_SIZE": 1}), (1, {})):
            logs.append((tmp_path / f"group{group}.out", tmp_path / f"group{group}.err"))
            with open(logs[-1][0], "wb") as out, open(logs[-1][1], "wb") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "lightkeeper.cli", "train", "--lighthouse", lighthouse,
                     "--num-replica-groups", "2", "--replica-group", str(group),
                     "--steps", str(steps), "--connect-timeout", "10", "--step-pause", "0.4"],
                    env=_train_env(**extra), stdout=out, stderr=err, start_new_session=True))
        try:
            # once training, every server of a rank (WorkerServer, store, torchft's Manager and
            # checkpoint servers, gloo) listens on loopback only, as nobody asked for more
            for out_path, _ in logs:
                wait_until(lambda out_path=out_path: "step=1 " in out_path.read_text(), 180,
                           interval=0.05, what="a rank's first step")
            for proc in procs:
                addrs = listening(proc.pid)
                assert len(addrs) >= 4 and all(a.is_loopback for a in addrs), addrs
            for proc, (out_path, _) in zip(procs, logs, strict=True):
                def last_step_logged(proc=proc, out_path=out_path):
                    if proc.poll() is not None:
                        return True  # exited before we saw the line: the asserts below say why
                    return f"step={steps} " in out_path.read_text()

                wait_until(last_step_logged, 180, interval=0.05, what="a rank's last step")
                wait_until(lambda proc=proc: proc.poll() is not None, PROMPT_EXIT_S,
                           interval=0.05,
                           what=f"the rank to exit within {PROMPT_EXIT_S}s of its last step")
        finally:
            for proc in procs:
                stop_process(proc, grace=0)
        for proc, (out_path, err_path) in zip(procs, logs, strict=True):
            stdout, stderr = out_path.read_text(), err_path.read_text()
            assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
            assert f"step={steps} quorum_id" in stdout and "participants=2" in stdout
            with pytest.raises(ProcessLookupError):  # no process of its session outlived it
                os.killpg(proc.pid, 0)
    finally:
        cluster.stop()


@pytest.mark.e2e
def test_rank1_without_a_store_exits_nonzero_within_the_bound():
    port = 1  # nothing listens on port 1; a port picked and let go may be another test's store
    started = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "lightkeeper.cli", "train", "--lighthouse", "http://127.0.0.1:1",
         "--connect-timeout", "3"],
        env=_train_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=1, WORLD_SIZE=2),
        capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert res.returncode != 0
    assert f"no TCPStore at 127.0.0.1:{port}" in res.stderr, res.stderr[-2000:]
    # 3 s of waiting plus starting Python and importing torch on a shared 2-core machine.
    assert took < 30, took


@pytest.mark.e2e
def test_cross_group_nccl_without_cuda_is_refused_before_anything_starts():
    port = free_port()
    res = subprocess.run(
        [sys.executable, "-m", "lightkeeper.cli", "train", "--lighthouse", "http://127.0.0.1:1",
         "--cross-group", "nccl"],
        env=_train_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=0, WORLD_SIZE=1,
                       CUDA_VISIBLE_DEVICES=""),
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert "--cross-group nccl needs CUDA" in res.stderr
    assert "worker_server=" not in res.stdout  # refused before the WorkerServer or the store
    with socket.socket() as s:  # the store's port was never taken
        s.bind(("127.0.0.1", port))
