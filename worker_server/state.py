"""What one rank is doing right now: the record behind ``/v1/state`` and ``/metrics``.

The training thread writes (``set_phase``, ``step_finished``, ``set_quorum``), HTTP threads
read (``snapshot``). A lock keeps every snapshot consistent; writes are a few attribute
stores, so the training thread never waits on a slow reader for long.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import metadata
from pathlib import Path

from http_serving import redact_url
from rank_wire import RECENT_STEPS

from .timing import StepTimer, _cuda_in_use

PHASES = (
    "starting",
    "quorum",
    "forward",
    "backward",
    "allreduce",
    "commit",
    "optimizer",
    "healing",
    "stopped",
    "checkpoint",  # writing a checkpoint (worker_server.checkpoint)
    "busy",  # the group's own work outside the collectives (worker_server.checkpoint.busy)
)  # a new phase goes last: the dashboards encode one by its position


@cache
def library_versions() -> tuple[str, str]:
    """(torch, torchft) versions of the packages this process imports (see
    :func:`module_version`); "unknown" when one is not installed."""
    return module_version("torch"), module_version("torchft")


def module_version(name: str) -> str:
    """The version of the top-level package ``name`` as imported here: its ``__version__``, else
    that of the distribution whose files it is, whatever that is called (``torchft-nightly``
    installs ``torchft``); ``"0.2.0|2026.10.26"`` when two wrote into the same directory (a mixed
    install), "unknown" when none is found."""
    version = getattr(sys.modules.get(name), "__version__", None)
    if version:
        return str(version)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin or not spec.submodule_search_locations:
        return "unknown"
    site = Path(spec.origin).parent.parent
    owners = {d.version for d in metadata.distributions(path=[str(site)])
              if f"\n{name}/" in "\n" + (d.read_text("RECORD") or "")}
    return "|".join(sorted(owners)) or "unknown"


def node_name() -> str:
    """The host this rank runs on: ``NODE_NAME`` when set (Kubernetes' downward API puts the
    node's name there; a pod's own hostname is the pod's), else the hostname."""
    return os.environ.get("NODE_NAME", "").strip() or socket.gethostname()


def rank_device(local_rank: int) -> dict:
    """The accelerator this rank uses, as ``/v1/state`` ``device`` reports it.

    ``{"type": "cuda", "index": i, "uuid": "GPU-..."}`` when the process has imported torch and
    initialized CUDA: the index is ``local_rank`` modulo the visible devices (the usual one GPU
    per local rank; the current device is per thread, so an HTTP thread cannot read the training
    thread's: a trainer that maps differently calls :meth:`RankState.set_device`); the UUID is
    ``torch.cuda.get_device_properties(i).uuid``. ``{"type": "cpu"}`` otherwise. torch is never
    imported and CUDA never initialized here: a rank that has not done so itself is a CPU rank so
    far (asking would put a CUDA context on a GPU and switch its step timing to CUDA events); a
    CUDA error is reported as ``{"type": "cuda", "index": i, "uuid": None, "error": "..."}``,
    never raised."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is None or not _cuda_in_use() or not cuda.is_available():
            return {"type": "cpu"}
        idx = local_rank % max(1, cuda.device_count())
    except Exception as e:  # a broken driver: say so, do not fail /v1/state
        return {"type": "cpu", "error": f"{type(e).__name__}: {e}"}
    try:
        return {"type": "cuda", "index": idx, "uuid": str(cuda.get_device_properties(idx).uuid)}
    except Exception as e:
        return {"type": "cuda", "index": idx, "uuid": None, "error": f"{type(e).__name__}: {e}"}


def env_local_rank(env: Mapping[str, str] | None = None) -> int:
    """``LOCAL_RANK`` of ``env`` (this process's environment by default; torchrun and most
    launchers set it), 0 when unset.

    Raises ValueError naming the variable when it is not an integer."""
    raw = (os.environ if env is None else env).get("LOCAL_RANK", "").strip()
    if not raw:
        return 0
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={raw!r} is not an integer") from None


@dataclass
class RankIdentity:
    """Who this rank is; fixed for the life of the process."""

    job: str = "lightkeeper"
    replica_group: int = 0
    group_rank: int = 0
    group_world_size: int = 1
    host: str = field(default_factory=node_name)
    pid: int = field(default_factory=os.getpid)
    lighthouse: str | None = None
    local_rank: int = field(default_factory=env_local_rank)  # the rank's index on its host
    # srun/sbatch's: the slurm sink drains only a node that runs this job
    slurm_job_id: str | None = field(
        default_factory=lambda: os.environ.get("SLURM_JOB_ID", "").strip() or None)

    @property
    def rank(self) -> int:
        return self.replica_group * self.group_world_size + self.group_rank


class RankState:
    """Thread-safe training state of one rank."""

    def __init__(self, identity: RankIdentity, faults: list[str] | None = None) -> None:
        self.identity = identity
        self.faults = list(faults or [])
        self.faults_struck_at: dict[str, float] = {}  # spec -> unix time it first acted here
        self._lock = threading.Lock()
        self.started_at = time.time()
        self.worker_url: str | None = None
        self.control_url: str | None = None  # this server reached by itself (probe control)
        self.hostname = socket.gethostname()
        self._device: dict | None = None  # rank_device(), kept once the rank initialized CUDA
        self._device_index: int | None = None  # set_device()'s; None: local_rank's
        self.replica_id: str | None = None
        self.step = 0
        self.quorum_id = -1
        self.num_participants = 0
        self.participating = False
        self.phase = "starting"
        self.phase_since = self.started_at
        self._phase_began = time.monotonic()  # durations on a clock that a step of NTP leaves
        self.last_step_seconds: float | None = None
        self.last_step_at: float | None = None
        self.recent_step_seconds: deque[float] = deque(maxlen=RECENT_STEPS)
        self.commits = 0
        self.commit_failures = 0
        self.heals = 0
        self.quorum_changes = 0
        self.loss: float | None = None
        # Per-step compute and collective waits on this rank's own clock (timing.py).
        self.timing = StepTimer()
        self._step_started_at: float | None = None
        # Callbacks (e.g. Prometheus metrics) told about every finished step.
        self._step_listeners: list = []
        self.finished = False  # training completed (finish()); never set on an error
        self.stopped_by: str | None = None  # "SIGTERM": it ended because it was asked to
        self._read = threading.Condition(self._lock)  # wakes finish's wait for a reader
        self.state_read_at: float | None = None  # the last /v1/state answer sent (monotonic)
        self.read_gap_s: float | None = None  # the longer of the last two gaps between reads
        self._gap = 0.0  # the last gap
        self.finished_read = False  # a /v1/state answer saying finished was sent

    # --- writers (training thread) -------------------------------------------------
    def set_phase(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        now = time.time()
        with self._lock:
            if phase != self.phase and not self.finished:  # a stopped rank's loop may run on
                self.phase = phase
                self.phase_since, self._phase_began = now, time.monotonic()

    def finish(self, stopped_by: str | None = None) -> None:
        """Training completed, or (``stopped_by``, e.g. ``"SIGTERM"``) the rank was asked to
        stop: ``/v1/state`` says ``"finished": true`` and phase ``stopped`` from now on, so a
        monitor that reads it counts this rank ended, not dead, once it stops answering. Never
        call it on an error path: a crashed rank must be found dead."""
        now = time.time()
        with self._lock:
            self.finished = True
            self.stopped_by = self.stopped_by or stopped_by
            if self.phase != "stopped":
                self.phase, self.phase_since = "stopped", now
                self._phase_began = time.monotonic()

    def state_read(self, finished: bool) -> None:
        """A ``/v1/state`` answer was sent; ``finished``: it said so (the server calls this)."""
        with self._read:
            now = time.monotonic()
            if self.state_read_at is not None:  # a read soon after another (asked ahead, a
                gap = now - self.state_read_at  # retry) is not the monitor's interval
                self.read_gap_s, self._gap = max(gap, self._gap), gap
            self.state_read_at = now
            if finished:
                self.finished_read = True
                self._read.notify_all()

    def wait_finished_read(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a ``/v1/state`` answer saying finished to be sent."""
        with self._read:
            return self._read.wait_for(lambda: self.finished_read, timeout_s)

    def step_started(self) -> None:
        with self._lock:
            self._step_started_at = time.monotonic()

    def set_quorum(self, quorum_id: int, num_participants: int, participating: bool) -> None:
        with self._lock:
            if quorum_id != self.quorum_id:
                self.quorum_changes += 1 if self.quorum_id != -1 else 0
            self.quorum_id = quorum_id
            self.num_participants = num_participants
            self.participating = participating

    def step_finished(self, step: int, committed: bool, loss: float | None = None) -> float | None:
        """Record the end of a step; returns its duration (None if its start was not seen)."""
        now, mono = time.time(), time.monotonic()
        with self._lock:
            duration = None if self._step_started_at is None else mono - self._step_started_at
            self._step_started_at = None
            self.step = step
            if committed:
                self.commits += 1
            else:
                self.commit_failures += 1
            if loss is not None:
                self.loss = loss
            if duration is not None:
                self.last_step_seconds = duration
                self.recent_step_seconds.append(duration)
            self.last_step_at = now
            listeners = list(self._step_listeners)
        for listener in listeners:
            listener(duration, committed)
        return duration

    def set_loss(self, loss: float) -> None:
        with self._lock:
            self.loss = float(loss)

    def healed(self, step: int) -> None:
        """This group loaded a peer's state and now stands at ``step``."""
        with self._lock:
            self.heals += 1
            self.step = step

    def fault_struck(self, spec: str) -> None:
        """A fault injected into this rank acted for the first time (its strike time stays)."""
        now = time.time()
        with self._lock:
            self.faults_struck_at.setdefault(spec, now)

    def phase_seconds(self) -> float:
        """Seconds in the current phase, on this rank's monotonic clock."""
        return time.monotonic() - self._phase_began

    def add_step_listener(self, listener) -> None:
        with self._lock:
            self._step_listeners.append(listener)

    def set_device(self, index: int) -> None:
        """Report CUDA device ``index`` (when the rank does not use ``local_rank``'s GPU), looked
        up by the next snapshot once the rank has initialized CUDA."""
        with self._lock:
            self._device_index, self._device = index, None

    # --- readers (HTTP threads) ----------------------------------------------------
    def snapshot(self) -> dict:
        """The ``/v1/state`` document (see docs/CONTRACTS.md)."""
        torch_version, torchft_version = library_versions()
        ident = self.identity
        timing = self.timing.snapshot()
        with self._lock:
            # under the lock: a lookup must not overwrite a set_device() made meanwhile
            device = self._device
            if device is None:  # kept only once CUDA is initialized: a CPU rank asks again
                final = _cuda_in_use()
                index = self._device_index
                device = rank_device(ident.local_rank if index is None else index)
                self._device = device if final else None
            return {
                "job": ident.job,
                "replica_group": ident.replica_group,
                "replica_id": self.replica_id,
                "group_rank": ident.group_rank,
                "group_world_size": ident.group_world_size,
                "rank": ident.rank,
                "host": ident.host,
                "node": ident.host,
                "slurm_job_id": ident.slurm_job_id,
                "hostname": self.hostname,
                "device": dict(device),
                "local_rank": ident.local_rank,
                "pid": ident.pid,
                "worker_url": self.worker_url,
                "step": self.step,
                "quorum_id": self.quorum_id,
                "num_participants": self.num_participants,
                "participating": self.participating,
                "phase": self.phase,
                "phase_since": self.phase_since,
                "finished": self.finished,
                "stopped_by": self.stopped_by,
                "last_step_seconds": self.last_step_seconds,
                "last_step_at": self.last_step_at,
                "recent_step_seconds": list(self.recent_step_seconds),
                "commits": self.commits,
                "commit_failures": self.commit_failures,
                "heals": self.heals,
                "quorum_changes": self.quorum_changes,
                "loss": self.loss,
                "lighthouse": redact_url(ident.lighthouse),
                "torch_version": torch_version,
                "torchft_version": torchft_version,
                "started_at": self.started_at,
                "faults": list(self.faults),
                "faults_struck_at": dict(self.faults_struck_at),
                "timing": timing,
            }
