"""Trainer configuration: one dataclass, filled from flags and the env vars torchft users know."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    vocab_size: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    seq_len: int = 32
    batch_size: int = 8


@dataclass
class TrainConfig:
    replica_group: int = 0
    num_replica_groups: int = 2
    # This rank inside its replica group (RANK / WORLD_SIZE, as torchrun and other launchers set).
    group_rank: int = 0
    group_world_size: int = 1
    lighthouse: str | None = None
    steps: int = 100
    worker_host: str = "127.0.0.1"
    worker_port: int = 0
    job: str = "lightkeeper"
    lr: float = 1e-3
    seed: int = 0
    # torchft timeouts (seconds). torchft's defaults are 60/60/60; tests and the demo use
    # shorter ones so a failure shows within seconds.
    pg_timeout_s: float = 60.0
    quorum_timeout_s: float = 60.0
    # torchft's connect timeout, and how long a rank waits for its group's TCPStore (store.py).
    connect_timeout_s: float = 60.0
    min_replica_size: int = 1
    # torchft's process group across replica groups: "auto" is NCCL on CUDA, else gloo; gloo
    # on CUDA tensors is what TorchTitan's torchft integration uses across groups.
    cross_group: str = "auto"
    # A pause per step (seconds) that stands for data loading / a bigger model, so the demo's
    # step time is realistic and steady on a shared 2-core machine.
    step_pause_s: float = 0.0
    # Intra-process threads for torch; several ranks share the machine's cores.
    torch_threads: int = 1
    faults: list[str] = field(default_factory=list)
    # False: start no WorkerServer of its own (under `lightkeeper run`, whose hook serves the
    # Manager; the trainer's phases and POST /v1/faults are then not served).
    worker_server: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
