"""The training loop of one rank, top to bottom.

FT-DDP across replica groups with torchft: every step asks the Lighthouse for a quorum
(asynchronously in a one-rank group, during the step's pause), all-reduces the flattened
gradients over the quorum's participants through ``Manager.allreduce`` (averaged over
participants), and steps the optimizer only when ``should_commit`` agrees. A group that
(re)joins heals from a healthy peer through torchft's checkpoint transport and continues at the
quorum's step.

Gradients go through ``Manager.allreduce`` rather than torchft's ``DistributedDataParallel``:
measured with torch 2.13 + torchft 0.2.0, the DDP comm hook fails with ``AssertionError`` in the
*survivors* after a peer hangs and times out, while ``Manager.allreduce`` reports the error to the
Manager, which skips the step and reconfigures, so survivors live on.

With several ranks per replica group (under ``torchrun``) the model is sharded inside the group
with FSDP2 and each rank's gradient shard is averaged across groups: FT-HSDP (``parallel.py``).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from .config import TrainConfig
from .faults import FaultInjector, gpu_stall, parse_fault

if TYPE_CHECKING:
    from worker_server import RankState

log = logging.getLogger("lightkeeper.trainer")


@contextmanager
def patched(module: Any, name: str, wrap: Callable[[Any], Any] | None) -> Iterator[None]:
    """``module.name`` is ``wrap(module.name)`` inside (torchft's servers bind a wildcard of
    their own); ``wrap`` None changes nothing, and a torchft without ``name`` is left as it is,
    said in one line."""
    old = getattr(module, name, None)
    if wrap is None or old is None:
        if wrap is not None:
            log.warning("%s has no %s: its server binds what torchft binds", module.__name__,
                        name)
        yield
        return
    setattr(module, name, wrap(old))
    try:
        yield
    finally:
        setattr(module, name, old)


def _configure_env() -> None:
    # Flight Recorder must be sized before torch's process groups are created.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")


def pick_device(local_rank: int, gpus: int, local_world_size: int = 1) -> str:
    """The rank's device: ``cpu`` when the process sees no GPU; ``cuda:0`` when it sees one (a
    launcher that gives each rank its own GPU, as ``srun --gpus-per-task=1``); else
    ``cuda:LOCAL_RANK`` (torchrun's one process per GPU). ValueError when LOCAL_RANK names a
    GPU the process does not see, or ``local_world_size`` (torchrun's LOCAL_WORLD_SIZE) ranks
    share the host's only GPU, no CUDA_VISIBLE_DEVICES set (NCCL: "Duplicate GPU detected")."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus == 0:
        return "cpu"
    # With CUDA_VISIBLE_DEVICES set, one process cannot tell a launcher that gave each rank its
    # own GPU (a per-rank wrapper, srun --gpus-per-task=1) from one that gave all the same: trust it
    if gpus == 1 and local_world_size > 1 and visible is None:
        raise ValueError(f"LOCAL_RANK={local_rank} of LOCAL_WORLD_SIZE={local_world_size} ranks "
                         f"on this host, but it has 1 GPU (CUDA_VISIBLE_DEVICES unset), which "
                         f"they would share (NCCL refuses: Duplicate GPU detected): start 1 "
                         f"rank on this host")
    if gpus == 1:
        return "cuda:0"
    if not 0 <= local_rank < gpus:
        raise ValueError(f"LOCAL_RANK={local_rank}, but this process sees {gpus} GPUs "
                         f"(CUDA_VISIBLE_DEVICES={visible!r}): "
                         f"start at most {gpus} ranks on this host, or give each its own GPU")
    return f"cuda:{local_rank}"


def env_local_world_size() -> int:
    """LOCAL_WORLD_SIZE (torchrun: its ranks on this host; 1 when unset); ValueError if bad."""
    raw = os.environ.get("LOCAL_WORLD_SIZE") or "1"
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={raw!r} is not an integer") from None


def inject_live(injector: FaultInjector, state: RankState, spec: str) -> str:
    """``POST /v1/faults``: inject ``spec`` (FaultSpecError, a ValueError, when refused) and list
    it in ``state.faults`` when it strikes this rank. Listed and returned as the fault's own
    spec (stripped), the key of ``faults_struck_at``, not as posted."""
    # Every rank of the group may be given the spec; only its target rank lists and applies it.
    fault = injector.inject(spec)
    if fault.targets(injector.group_rank):
        state.faults.append(fault.spec)
    return fault.spec


MAX_NOT_HEALED = 3  # failed heals from a group of another size in a row before a rank exits
SIZE_READS = 3  # /status reads tried after the first quorums: each unread one may cost seconds


class GroupSizeMismatch(RuntimeError):
    """This replica group and a peer group have different numbers of ranks: each rank
    all-reduces its gradient shard with, and heals from, the same group rank of the others."""


def size_mismatch(replica_group: int, world_size: int, peer: str, peer_size: int) -> str:
    return (f"replica group {replica_group} has {world_size} rank(s) (WORLD_SIZE) but {peer} "
            f"has {peer_size}: groups of different sizes cannot train together or heal from "
            f"each other (each rank's gradient shard goes to the same group rank of every other "
            f"group); start every group of the job with the same number of ranks")


def quorum_sizes(lighthouse: str, replica_group: int, world_size: int) -> dict[str, int] | None:
    """Each live replica group of the Lighthouse's newest quorum with its size, this group's
    own as ``world_size`` (its entry there may be an earlier run); None when the status cannot
    be read."""
    from monitor.evidence.lighthouse_status import LighthouseReader

    reader = LighthouseReader(lighthouse)
    try:
        status, _ = reader.read()
    finally:
        reader.close()
    if status is None:
        return None
    sizes = {}
    for rid, member in sorted(status.members.items()):
        # torchft appends ":<uuid>" to the replica id; live: torchft's ManagerServer beats
        # every 0.1 s, and a group that ended is past 2 s before another rank gets here
        if status.heartbeats.get(rid, 2.0) < 2.0 and rid not in status.stale:
            sizes[rid.split(":")[0]] = member.world_size
    return {**sizes, f"replica_group_{replica_group}": world_size}


def other_sized_peer(lighthouse: str, replica_group: int, world_size: int) -> str | None:
    """Why this group must not join the job: a live replica group of another size in the
    Lighthouse's newest quorum. None when there is none, or the status cannot be read."""
    # unread: the heal's own check still refuses a peer of another size
    for group, size in sorted((quorum_sizes(lighthouse, replica_group, world_size)
                               or {}).items()):
        if size != world_size:
            return size_mismatch(replica_group, world_size, group, size)
    return None


def outnumbered(sizes: dict[str, int] | None, replica_group: int, world_size: int,
                tie: bool = False) -> str | None:
    """Why this group must leave the job: more groups of ``sizes`` (:func:`quorum_sizes`)
    have another size than have its own (``tie``: as many too). None otherwise, or unread."""
    counts = Counter((sizes or {}).values())
    mine = counts[world_size]
    for group, size in sorted((sizes or {}).items()):
        if size != world_size and (counts[size] > mine or tie and counts[size] == mine):
            return size_mismatch(replica_group, world_size, group, size)
    return None


def train(cfg: TrainConfig) -> int:
    """Run one rank until ``cfg.steps`` committed steps; returns a process exit code."""
    _configure_env()
    import torch
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    from torchft import manager as tf_manager
    from torchft.checkpointing import http_transport
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.optim import OptimizerWrapper

    from worker_server import RankIdentity, RankState, WorkerServer
    from worker_server.instrument import instrument_fsdp
    from worker_server.state import env_local_rank

    class AdvertisedHTTPTransport(HTTPTransport):
        """torchft's checkpoint transport, fetched from at ``host`` (torchft: the hostname) and
        listening on ``bind`` only (torchft: every address)."""

        def __init__(self, host: str, bind: str, **kw) -> None:
            self._advertised = host  # (torchft's __init__ may already ask for the address)

            def bound(base):
                class Server(base):
                    def __init__(self, _address, handler) -> None:
                        family, _, _, _, sockaddr = socket.getaddrinfo(
                            bind, 0, type=socket.SOCK_STREAM)[0]
                        self.address_family = family
                        super().__init__(sockaddr, handler)
                return Server

            with patched(http_transport, "_IPv6HTTPServer", bound if bind else None):
                super().__init__(**kw)

        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{self._advertised}:{port}/checkpoint/"

    from .model import TinyTransformerLM, synthetic_batch
    from .parallel import (
        flat_local_grads,
        load_local_state_dict,
        local_numel,
        local_state_dict,
        shard_within_group,
        unflatten_into_grads,
    )
    from .store import (
        StoreUnavailable,
        advertised_address,
        group_store,
        is_loopback,
        is_wildcard,
    )

    group_rank, group_world_size = cfg.group_rank, cfg.group_world_size
    injector = FaultInjector([parse_fault(s) for s in cfg.faults], group_rank, group_world_size,
                             steps=cfg.steps)
    torch.set_num_threads(cfg.torch_threads)
    torch.manual_seed(cfg.seed)  # identical init in every group

    try:
        device = torch.device(pick_device(env_local_rank(), torch.cuda.device_count(),
                                          env_local_world_size()))
    except ValueError as e:
        sys.stderr.write(f"lightkeeper train: error: {e}\n")
        return 1
    use_cuda = device.type == "cuda"
    cross_group = cfg.cross_group if cfg.cross_group != "auto" else "nccl" if use_cuda else "gloo"
    if cross_group == "nccl" and not use_cuda:
        sys.stderr.write("lightkeeper train: error: --cross-group nccl needs CUDA, which this "
                         "process does not have\n")
        return 1

    # torchft's servers (the group's store, the ManagerServer, the checkpoint server) bind
    # --worker-host too, where torchft binds every address (bind "": as torchft does)
    advertise = advertised_address(cfg.worker_host)
    url_host = f"[{advertise}]" if ":" in advertise else advertise  # IPv6 literal in a URL
    bind = "" if is_wildcard(cfg.worker_host) else advertise
    if bind and is_loopback(bind):  # gloo's device: else its host name's address, maybe not loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Refuse to join a job whose groups have another size, before joining its quorum: joined,
    # this group would stall the others' collectives until --pg-timeout, then fail its heal.
    if why := other_sized_peer(cfg.lighthouse, cfg.replica_group, group_world_size):
        sys.stderr.write(f"lightkeeper train: error: {why}\n")
        return 1
    # The group's TCPStore: under torchrun group rank 0 hosts one per attempt (the agent's
    # outlives restarts), else group rank 0 (torch's env:// convention), else a lone rank hosts
    # its own. Waiting for it is bounded.
    try:
        gstore = group_store(group_rank, group_world_size, cfg.connect_timeout_s, bind=bind)
    except StoreUnavailable as e:
        sys.stderr.write(f"lightkeeper train: error: {e}\n")
        return 1
    if group_world_size > 1:
        # torch's default timeout: it is also every in-group collective's, which must outlast a
        # peer compiling its first step (the per-attempt store keeps the rendezvous fresh)
        dist.init_process_group("nccl" if use_cuda else "gloo", store=gstore.store,
                                rank=group_rank, world_size=group_world_size)

    # Faults can also be injected while training runs (POST /v1/faults), but only when
    # LIGHTKEEPER_FAULT_TOKEN is set: the demo does that, a real job does not.
    server = None
    if cfg.worker_server:
        try:
            server = WorkerServer.start(
                replica_group=cfg.replica_group, group_rank=group_rank,
                group_world_size=group_world_size, job=cfg.job, lighthouse=cfg.lighthouse,
                host=cfg.worker_host, port=cfg.worker_port + group_rank if cfg.worker_port else 0,
                faults=injector.specs,
                fault_handler=lambda spec: inject_live(injector, state, spec),  # the server's state
            )
        except (OSError, ValueError) as e:  # its port taken, a LIGHTKEEPER_* variable it
            # cannot read (LIGHTKEEPER_EXIT_AUTH=...): one line naming it, not a traceback
            sys.stderr.write(f"lightkeeper train: error: WorkerServer: {e}\n")
            return 1
        state = server.state
    else:  # --no-worker-server: the loop's own state, not served
        state = RankState(RankIdentity(job=cfg.job, replica_group=cfg.replica_group,
                                       group_rank=group_rank, group_world_size=group_world_size,
                                       lighthouse=cfg.lighthouse), faults=injector.specs)
    injector.on_strike = lambda fault: state.fault_struck(fault.spec)  # /v1/state faults_struck_at
    if use_cuda:
        state.set_device(device.index)  # /v1/state reports the GPU this rank trains on
        injector.stretch = gpu_stall(device)  # slow_compute slows the GPU, not the host
    # One write(): several ranks (and torch's logs) share the log file, and print() writes the
    # text and the newline separately, so another process's bytes could land between them.
    if server is not None:
        sys.stdout.write(f"[lightkeeper] replica_group={cfg.replica_group} "
                         f"group_rank={group_rank} worker_server={server.url}\n")
        sys.stdout.flush()

    m = cfg.model
    model = TinyTransformerLM(m.vocab_size, m.d_model, m.n_heads, m.n_layers, m.seq_len).to(device)
    model, group_all_gather = shard_within_group(model, group_world_size, device.type)
    inner_optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    not_healed = 0  # heals from a group of another size failed since the last commit

    def load_state_dict(sd):
        nonlocal not_healed
        # a peer that joined with this group at once (neither saw the other's size before)
        peer_size = sd.get("group_world_size", group_world_size)
        if peer_size != group_world_size:
            why = size_mismatch(cfg.replica_group, group_world_size,
                                f"replica_group_{sd['replica_group']}", peer_size)
            sizes = quorum_sizes(cfg.lighthouse, cfg.replica_group, group_world_size)
            not_healed += 1
            # a tie, or unread: the group that heals leaves; so does one that failed its heals
            # step after step (the odd group stayed): a job never loops without a commit
            if sizes is None or outnumbered(sizes, cfg.replica_group, group_world_size, tie=True) \
                    or not_healed > MAX_NOT_HEALED:
                raise GroupSizeMismatch(why)
            # Most groups have this size: the source leaves after its first quorum. This step
            # fails as a failed heal does, torchft's step put back (else it would count as healed)
            log.warning("not healed: %s; this size is the job's (most groups have it)", why)
            manager.load_state_dict(before_quorum)
            manager.report_error(GroupSizeMismatch(why))
            return
        load_local_state_dict(model, inner_optimizer, sd)

    def state_dict():
        return {**local_state_dict(model, inner_optimizer), "group_world_size": group_world_size,
                "replica_group": cfg.replica_group}

    if cross_group == "nccl":
        from torchft import ProcessGroupNCCL

        pg = ProcessGroupNCCL(timeout=timedelta(seconds=cfg.pg_timeout_s))
    else:
        pg = ProcessGroupGloo(timeout=timedelta(seconds=cfg.pg_timeout_s))
    def bound(real_server):
        def bound_server(**kw):  # torchft binds "[::]:{port}"
            kw["bind"] = f"{url_host}:{kw['bind'].rpartition(':')[2]}"
            return real_server(**kw)
        return bound_server

    try:
        with patched(tf_manager, "ManagerServer", bound if bind else None):
            manager = Manager(
                pg=pg,
                min_replica_size=cfg.min_replica_size,
                load_state_dict=load_state_dict,
                state_dict=state_dict,
                replica_id=f"replica_group_{cfg.replica_group}",
                # FSDP2 swaps sharded and unsharded parameters during forward/backward; with an async
                # quorum torchft would read the state for a healing peer from its quorum thread in the
                # middle of that. A synchronous quorum reads it at the step boundary, while sharded.
                use_async_quorum=group_world_size == 1,
                lighthouse_addr=cfg.lighthouse,
                # every address other hosts use is the one this rank binds, not its hostname, which
                # another host may not resolve (the Lighthouse's kill, a healing peer's fetch)
                hostname=url_host,
                store_addr=gstore.addr,
                store_port=gstore.port,
                rank=group_rank,
                world_size=group_world_size,
                timeout=timedelta(seconds=cfg.pg_timeout_s),
                quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
                connect_timeout=timedelta(seconds=cfg.connect_timeout_s),
                checkpoint_transport=AdvertisedHTTPTransport(
                    url_host, bind, timeout=timedelta(seconds=cfg.pg_timeout_s), num_chunks=0),
            )
    except RuntimeError as e:  # its Lighthouse or store unreachable: torchft's words say which
        sys.stderr.write(f"lightkeeper train: error: torchft's Manager did not start: {e}\n")
        if server is not None:
            server.stop()
        return 1
    if server is not None:
        server.attach(manager)
    else:  # --no-worker-server under `lightkeeper run`: the hook's server serves this Manager
        from worker_server.autostart import started_server

        if (hooked := started_server()) is not None:  # its state is the one instrumented
            hooked.state.faults = list(state.faults)
            state = hooked.state  # read by the log line, the SIGTERM check, on_strike
            if use_cuda:
                state.set_device(device.index)
    instrument_fsdp(model, state)  # FSDP's in-group collectives count as this rank's group wait
    # zero_grad() starts the step's quorum; step() steps only when should_commit agrees.
    optimizer = OptimizerWrapper(manager, inner_optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    loss_fn = torch.nn.CrossEntropyLoss()
    backward_s = 0.0  # the last step's backward time, stretched by slow_compute

    completed, size_reads = False, SIZE_READS
    try:
        while manager.current_step() < cfg.steps:
            if state.stopped_by:  # SIGTERM'd: join no next quorum (a group about to be gone
                threading.Event().wait()  # stalls it); the stop ends the process by SIGTERM
            before_quorum = manager.state_dict()  # what a failed heal puts back
            optimizer.zero_grad(set_to_none=False)  # starts the quorum: async in one-rank groups
            if cfg.step_pause_s:  # data loading, overlapping an async quorum
                time.sleep(cfg.step_pause_s)
            # The step once the quorum is known: a one-rank group's async quorum heals on
            # torchft's thread (a multi-rank group's already did), and the faults, the batch and
            # the commit check need the healed step. The forward (a few ms) no longer overlaps it.
            state.set_phase("quorum")  # as a multi-rank group blocked in its synchronous quorum
            manager.wait_quorum()
            if size_reads:  # groups started at once meet here: one of a size fewer have leaves
                sizes = quorum_sizes(cfg.lighthouse, cfg.replica_group, group_world_size)
                # unread (a timeout, refused): again at the next quorum, a few times at most (a
                # Lighthouse whose /status never answers must not slow every step)
                size_reads = 0 if sizes is not None else size_reads - 1
                if why := outnumbered(sizes, cfg.replica_group, group_world_size):
                    raise GroupSizeMismatch(why)
            state.set_phase("forward")
            step = manager.current_step()
            # A quorum that errored (its process group or the heal failed) returns with the step
            # not healed, and torchft discards the step: no one-off fault strikes in it, and its
            # step is not the one this process joined the job at.
            injector.started(step, discarded=manager.errored() is not None)
            tokens, targets = synthetic_batch(step, cfg.replica_group * group_world_size
                                              + group_rank, m.batch_size, m.seq_len, m.vocab_size)
            tokens, targets = tokens.to(device), targets.to(device)
            injector.before_forward(step)  # hang where=group: peers block in FSDP's all-gather
            if group_all_gather is not None and injector.group_mismatch_at(step):
                group_all_gather.arm()  # the forward's first all-gather goes out as integers
            started = time.monotonic()
            logits = model(tokens)
            loss = loss_fn(logits.reshape(-1, m.vocab_size), targets.reshape(-1))
            # slow_compute sleeps here, before backward's in-group collectives, so the group's
            # peers wait for this rank inside FSDP (as they would for a throttled GPU).
            injector.throttle(step, time.monotonic() - started + backward_s)
            state.set_phase("backward")
            started = time.monotonic()
            loss.backward()
            backward_s = time.monotonic() - started

            # Gradients are already averaged inside the group (FSDP2 reduce-scatter); now
            # average this rank's shard across the quorum's replica groups.
            flat = flat_local_grads(params)
            injector.before_allreduce(step)
            if injector.mismatch_at(step):
                flat = torch.cat([flat, flat.new_zeros(1)])  # a shape no peer issues
            manager.allreduce(flat).wait()
            if flat.numel() == local_numel(params):
                unflatten_into_grads(flat, params)

            pre = manager.current_step()
            optimizer.step()
            committed = manager.current_step() > pre
            if committed:  # the step it joined the job at: a one-off fault before it is passed
                injector.joined(pre)
                not_healed = 0
            state.set_loss(loss.item())
            snap = state.snapshot()
            log.info(
                "step=%d quorum_id=%d participants=%d step_time=%.3fs committed=%s loss=%.4f",
                manager.current_step(), snap["quorum_id"], snap["num_participants"],
                snap["last_step_seconds"] or 0.0, committed, loss.item(),
            )
        completed = True
    except GroupSizeMismatch as e:  # one line, not the heal's traceback
        sys.stderr.write(f"lightkeeper train: error: {e}\n")
        return 1
    finally:
        state.set_phase("stopped")
        manager.shutdown(wait=False)
        if dist.is_initialized():
            dist.destroy_process_group()
        if server is None:  # --no-worker-server under `lightkeeper run`: the hook's server says it
            from worker_server.autostart import started_server

            server = started_server()
        if server is not None:
            if completed:  # a monitor reads that this rank ended, not died
                server.finish()
            elif server.state.stopped_by:  # SIGTERM'd, and a peer that went first failed our step
                server.stopped()
            server.stop()
        del gstore
    return 0


def end_process(code: int) -> NoReturn:
    """Exit with ``code`` now that :func:`train` has cleaned up, without the interpreter's
    finalization.

    The rank's own cleanup is done by then (``train``'s ``finally``: the Manager shut down, the
    WorkerServer stopped, the process groups destroyed); the atexit handlers still run here and
    the logs are flushed. What is skipped is tearing down every module torch loaded: seconds of
    CPU that held a finished rank's process (and the group's slot) for 3-5 s under load, with
    nothing in it that the rank, its peers or the Lighthouse need.
    """
    atexit._run_exitfuncs()  # logging.shutdown among them: every handler flushed
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to lose there
            pass
    os._exit(code)


def setup_logging() -> None:
    logging.basicConfig(stream=sys.stdout, level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # torchft logs a line per quorum/commit at INFO; keep ours readable.
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.WARNING)
