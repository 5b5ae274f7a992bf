"""A TorchTitan config (``--module lk_titan_config --config llama3_torchft_cpu``): torchtitan's
own ``llama3_torchft_debugmodel`` (``torchtitan/experiments/torchft/llama3/config_registry.py``,
torchtitan 0.3.0) made to fit a CPU and a few seconds a step.

What differs from torchtitan's config, and why:

- ``process_group="gloo"`` (torchtitan's is NCCL) and ``semi_sync_method=None`` (torchtitan's is
  DiLoCo): every step is a torchft quorum and a cross-group all-reduce through the
  ``ManagedProcessGroup`` that TorchTitan hooks into FSDP, which is what the monitor's straggler
  detector reads;
- ``seq_len=64``, ``local_batch_size=2``, float32 parameters (no bfloat16 mixed precision on a
  CPU), no activation checkpointing, no profiler, CUDA graphs off; checkpointing on (torchtitan
  hands torchft the state dict a joining group heals from only then) but not due before step
  100000, and no per-step dataloader checkpoints;
- the tokenizer and data that ``make_assets.py`` writes (torchtitan's wheel ships neither):
  ``--hf_assets_path DIR/tokenizer --dataloader.dataset_path DIR/data``.

The model (``debugmodel``: 6 layers, dim 256, vocabulary 2048, FlexAttention) is torchtitan's,
unchanged. Each replica group passes ``--fault_tolerance.replica_id N``; ``group_size`` is the
number of groups (``--fault_tolerance.group_size``, default 2).
"""

from __future__ import annotations

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import CommConfig, TrainingConfig
from torchtitan.experiments.torchft.checkpoint import TorchFTCheckpointManager
from torchtitan.experiments.torchft.config.job_config import FaultTolerance
from torchtitan.experiments.torchft.llama3 import model_registry
from torchtitan.experiments.torchft.optimizer import TorchFTOptimizersContainer
from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.tools.profiler import Profiler


def llama3_torchft_cpu() -> FaultTolerantTrainer.Config:
    model_spec = model_registry("debugmodel")
    return FaultTolerantTrainer.Config(
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec)),
        hf_assets_path="./lk_titan_assets/tokenizer",
        profiler=Profiler.Config(enable_profiling=False),
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        model_spec=model_spec,
        optimizer=TorchFTOptimizersContainer.Config(
            param_groups=default_adamw(lr=8e-4).param_groups),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0),
        training=TrainingConfig(
            local_batch_size=2, seq_len=64, steps=100_000, dtype="float32",
            mixed_precision_param="float32", disable_cuda_graphs=True),
        dataloader=HuggingFaceTextDataLoader.Config(
            dataset="c4_test", dataset_path="./lk_titan_assets/data"),
        # enable: torchtitan registers the state dict torchft heals a joining group from only
        # when checkpointing is on; no disk checkpoint is due before step 100000
        checkpoint=TorchFTCheckpointManager.Config(
            enable=True, interval=100_000, enable_ft_dataloader_checkpoints=False),
        activation_checkpoint=None,
        comm=CommConfig(train_timeout_seconds=60),
        fault_tolerance=FaultTolerance(
            enable=True, process_group="gloo", process_group_timeout_ms=10_000,
            semi_sync_method=None, group_size=2, min_replica_size=1),
    )
