"""Run ``torchtitan.train`` on a machine without an accelerator (CPU + gloo), unchanged otherwise.

    python lk_titan_cpu.py --module lk_titan_config --config llama3_torchft_cpu \\
        --fault_tolerance.replica_id 0 --hf_assets_path A/tokenizer --dataloader.dataset_path A/data

(under ``lightkeeper run -- ...`` or ``torchrun``; the arguments are ``torchtitan.train``'s).
This file carries no Lightkeeper code: the WorkerServer comes from ``lightkeeper run``'s hook
when TorchTitan's ``TorchFTManager`` builds its ``torchft.Manager``.

The adaptation, and only it (docs/torchtitan.md):

1. **Device.** torchtitan 0.3.0 picks its device once, at import, in
   ``torchtitan/tools/utils.py``: ``device_type = _get_available_device_type() or "cuda"``, and
   ``device_module`` is ``torch.cuda`` then; every later ``set_device``/``memory_stats`` call
   fails on a machine without CUDA. Before any other torchtitan module imports those names, this
   sets them to ``"cpu"`` and to :class:`CpuDeviceModule`, which answers the calls torchtitan
   makes (``set_device``, ``device_count``, ``current_device``, ``get_device_name``,
   ``get_device_properties().total_memory``, ``memory_stats``, ``reset_peak_memory_stats``,
   ``empty_cache``, ``synchronize``) with CPU facts or no-ops. torchtitan then picks gloo as
   ``torch.distributed``'s backend itself (``Backend.default_device_backend_map["cpu"]``).
2. **Attention.** The debug model's attention is FlexAttention, and torch (2.13) cannot train it
   on a CPU: ``torch/nn/attention/flex_attention.py`` ``_validate_device`` raises
   ``NotImplementedError: FlexAttention does not support backward on CPU``. On the CPU only,
   :func:`sdpa_flex_attention` replaces the compiled ``flex_attention`` call
   (``FlexAttention._compiled_flex_attn``) with the same attention computed by
   ``scaled_dot_product_attention`` under the dense mask of the same ``BlockMask``
   (``create_mask(block_mask.mask_mod, ...)``): same model, same mask, an unfused kernel.
3. **torch 2.13.** torchtitan 0.3.0 calls ``torch.distributed.set_timeout(timeout, group)``
   after the first step (``torchtitan/distributed/utils.py`` ``set_pg_timeouts``); torch 2.13
   does not have it (``AttributeError``), only its private predecessor with the same signature,
   ``torch.distributed.distributed_c10d._set_pg_timeout``, which is used when the public name is
   missing. (torchtitan declares no torch requirement; a torch that has ``set_timeout`` is left
   alone.)
4. **Fault injection (tests and demos only).** ``LK_TITAN_SLOW_S=S`` sleeps S seconds inside
   every step's forward/backward, i.e. between the step's torchft quorum and its cross-group
   all-reduce: this replica group computes slower, a straggler. Unset: nothing is wrapped.

Everything else (config parsing, the model, FSDP, torchft's Manager, quorum, all-reduce, commit)
is torchtitan's and torchft's own code. ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` default to 1 so
nothing is downloaded.
"""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402


class CpuDeviceModule:
    """What torchtitan calls on ``torch.cuda``, answered for the CPU."""

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 1 << 30
        return SimpleNamespace(name="cpu", total_memory=total)

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    manual_seed = staticmethod(torch.manual_seed)
    manual_seed_all = staticmethod(torch.manual_seed)


def use_cpu() -> None:
    """Point torchtitan's device globals at the CPU before anything else imports them."""
    import torchtitan.tools.utils as tt_utils

    loaded = [m for m in ("torchtitan.components.metrics", "torchtitan.distributed.utils",
                          "torchtitan.distributed.parallel_dims", "torchtitan.tools.profiler")
              if m in sys.modules]
    if loaded:  # they hold their own copies of device_type/device_module
        raise RuntimeError(f"lk_titan_cpu: {loaded} imported before the CPU patch")
    tt_utils.device_type = "cpu"
    tt_utils.device_module = CpuDeviceModule
    tt_utils.get_device_info = lambda: ("cpu", CpuDeviceModule)


def sdpa_flex_attention(q, k, v, *, score_mod=None, block_mask=None, scale=None,
                        enable_gqa=False, return_aux=None, kernel_options=None):
    """``flex_attention(q, k, v, block_mask=...)`` as dense-masked SDPA (trainable on a CPU).

    Raises NotImplementedError for a ``score_mod`` (the debug model has none)."""
    from torch.nn.attention.flex_attention import AuxOutput, create_mask
    from torch.nn.functional import scaled_dot_product_attention

    if score_mod is not None:
        raise NotImplementedError("lk_titan_cpu: score_mod is not supported on the CPU path")
    mask = None
    if block_mask is not None:
        b, h, q_len, kv_len = block_mask.shape
        mask = create_mask(block_mask.mask_mod, b, h, q_len, kv_len, device=q.device)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=enable_gqa)
    lse = None
    if return_aux is not None and getattr(return_aux, "lse", False):
        kk = k.repeat_interleave(q.size(1) // k.size(1), dim=1) if enable_gqa else k
        scores = (q @ kk.transpose(-2, -1)) * (scale if scale is not None else q.size(-1) ** -0.5)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        lse = scores.logsumexp(dim=-1)
    return out, AuxOutput(lse=lse)


def torch_compat() -> None:
    """``torch.distributed.set_timeout`` on a torch that only has ``_set_pg_timeout``."""
    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout


def use_sdpa_attention() -> None:
    """Swap FlexAttention's compiled kernel for :func:`sdpa_flex_attention`."""
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = sdpa_flex_attention


def maybe_slow_down() -> None:
    """``LK_TITAN_SLOW_S``: sleep that long inside every step's forward/backward."""
    raw = os.environ.get("LK_TITAN_SLOW_S", "").strip()
    if not raw:
        return
    delay = float(raw)
    if delay < 0:
        raise ValueError(f"LK_TITAN_SLOW_S must be >= 0, got {raw!r}")
    from torchtitan.trainer import Trainer

    original = Trainer.forward_backward_step

    def forward_backward_step(self, *args, **kwargs):
        time.sleep(delay)
        return original(self, *args, **kwargs)

    Trainer.forward_backward_step = forward_backward_step
    print(f"lk_titan_cpu: every step's forward/backward sleeps {delay} s (LK_TITAN_SLOW_S)",
          file=sys.stderr, flush=True)


def main() -> None:
    use_cpu()
    torch_compat()
    use_sdpa_attention()
    maybe_slow_down()
    from torchtitan.train import main as titan_main

    titan_main()


if __name__ == "__main__":
    main()
