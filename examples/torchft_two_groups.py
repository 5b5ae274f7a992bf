"""Two torchft replica groups training one model, watched by Lightkeeper.

A torchft job as a user writes it, with torchft's public API only (``Manager``,
``ProcessGroupGloo``, ``Optimizer``, ``Manager.allreduce``), on torchft 0.2.x or torchft-nightly.
Each replica group is one process started with this script (one rank per group; under
``torchrun`` a group has ``--nproc-per-node`` ranks and torchrun's store). The groups meet through
a torchft Lighthouse and average their gradients across groups every step.

Run a Lighthouse, a monitor and two groups (each command in its own terminal; with a heartbeat
timeout of 1 s, not torchft's 5 s, a group that leaves holds the other up for a second, and the
monitor warns of a Lighthouse slower than 2 s: docs/lighthouse.md)::

    torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510 --heartbeat_timeout_ms 1000
    lightkeeper monitor --lighthouse http://127.0.0.1:29510 --port 9400 --dry-run
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510

    # group 0, no Lightkeeper code: lightkeeper run's hook serves every Manager it creates
    REPLICA_GROUP_ID=0 lightkeeper run --monitor http://127.0.0.1:9400 -- \\
        python examples/torchft_two_groups.py
    # group 1, the explicit API: --worker-server calls WorkerServer.start(manager)
    REPLICA_GROUP_ID=1 LIGHTKEEPER_MONITOR=http://127.0.0.1:9400 \\
        python examples/torchft_two_groups.py --worker-server

Then ``curl 127.0.0.1:9400/v1/cluster`` shows both groups, every rank verified against the
Lighthouse; each rank's own ``/v1/state``, ``/v1/fr_trace``, ``/v1/stacks`` and ``/metrics`` are
at the URL it printed. ``tests/test_torchft_versions_e2e.py`` runs exactly this on every torchft
the suite knows (docs/install.md).

Across hosts (docs/run.md, Across hosts: the monitor with ``--bind 0.0.0.0`` and the
registration token in ``LIGHTKEEPER_REGISTER_TOKEN`` on every host),
give each group its host's name or address as ``MASTER_ADDR``, where the other groups reach its
store; torchft advertises its own servers under the host's name (``socket.gethostname()``),
which the other hosts must resolve::

    MASTER_ADDR=$(hostname) TORCHFT_LIGHTHOUSE=http://lh:29510 REPLICA_GROUP_ID=0 \\
        lightkeeper run --monitor http://mon:9400 --worker-host 0.0.0.0 \\
        -- python examples/torchft_two_groups.py

The store and torchft 0.2's own servers (its ManagerServer, the checkpoint a healing group
fetches) listen on every address, whatever address is given: keep the job inside the cluster's
network.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

# Flight Recorder on, before torch is imported (torch 2.8 records nothing without it; lightkeeper
# run sets the same default)
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")

import torch  # noqa: E402
from torch.distributed import TCPStore  # noqa: E402
from torchft import Manager, Optimizer, ProcessGroupGloo  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000, help="steps to train (%(default)s)")
    p.add_argument("--step-pause", type=float, default=0.05,
                   help="seconds each step sleeps: the compute a real model would do (%(default)s)")
    p.add_argument("--worker-server", action="store_true",
                   help="serve this rank with WorkerServer.start(manager) (lightkeeper[worker])")
    args = p.parse_args()
    group = int(os.environ.get("REPLICA_GROUP_ID", 0))

    store = None
    if "MASTER_PORT" not in os.environ:  # not under torchrun: a group of one rank, its own store
        # the other groups connect to it at MASTER_ADDR: across hosts this host's name or address
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        store = TCPStore(addr, 0, is_master=True, wait_for_workers=False)
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(store.port), RANK="0", WORLD_SIZE="1")

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(16, 1)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=1,
        load_state_dict=model.load_state_dict,  # a group that joins late heals from a peer
        state_dict=model.state_dict,
        replica_id=f"two_groups_{group}",
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=30),
    )
    if args.worker_server:
        from worker_server import WorkerServer

        server = None
        try:  # 127.0.0.1, an ephemeral port unless LIGHTKEEPER_WORKER_PORT says
            server = WorkerServer.start(manager)
            print(f"group {group} rank {os.environ['RANK']}: worker_server={server.url}",
                  flush=True)
        except (OSError, ValueError) as e:  # a port taken or misspelt: train unobserved
            print(f"group {group}: no WorkerServer ({e}); training goes on", flush=True)
    optimizer = Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.01))

    while manager.current_step() < args.steps:
        optimizer.zero_grad()  # starts this step's quorum
        x = torch.randn(8, 16)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        loss.backward()
        for param in model.parameters():  # what torchft's DistributedDataParallel does
            manager.allreduce(param.grad).wait()
        optimizer.step()  # commits the step if every group's allreduce went through
        time.sleep(args.step_pause)
    print(f"group {group}: done at step {manager.current_step()}", flush=True)
    manager.shutdown(wait=False)
    if args.worker_server and server is not None:
        server.finish()  # a monitor counts this rank ended, not dead (not on an error path)
        server.stop()
    del store


if __name__ == "__main__":
    main()
