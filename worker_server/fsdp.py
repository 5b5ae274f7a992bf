"""FSDP2's in-group collectives, timed: the ``group`` waits of :mod:`worker_server.timing`.

FSDP2 lets a module swap the callables that issue its all-gathers and reduce-scatters
(``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``). The ones here wrap the
comm a module already has (FSDP's default, or one the training script installed) and count the
training thread's time inside it as in-group wait: a synchronous call (gloo, FSDP's default on CPU)
is timed whole; an asynchronous one returns a Work whose ``wait()`` is timed.

Imported only when a model is instrumented (it imports torch).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)

from .timing import StepTimer


class _TimedWork(dist.Work):
    """A Work whose ``wait()`` counts as in-group wait; everything else is the wrapped Work's."""

    def __init__(self, work: dist.Work, timer: StepTimer) -> None:
        super().__init__()
        self._work = work
        self._timer = timer

    def wait(self, timeout: timedelta | None = None) -> bool:
        with self._timer.waiting("group"):
            return self._work.wait() if timeout is None else self._work.wait(timeout)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def get_future(self) -> Any:
        return self._work.get_future()

    def synchronize(self) -> None:
        self._work.synchronize()

    def block_current_stream(self) -> None:
        self._work.block_current_stream()

    def result(self) -> Any:
        return self._work.result()


def _timed(call, timer: StepTimer, *args: Any, async_op: bool = False, **kwargs: Any):
    if async_op:
        work = call(*args, async_op=True, **kwargs)
        return _TimedWork(work, timer) if isinstance(work, dist.Work) else work
    with timer.waiting("group"):
        return call(*args, async_op=False, **kwargs)


class TimedAllGather(AllGather):
    def __init__(self, timer: StepTimer, inner: AllGather | None = None) -> None:
        self.timer = timer
        self.inner = inner or DefaultAllGather()

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        return _timed(self.inner, self.timer, output_tensor, input_tensor, group,
                      async_op=async_op)


class TimedReduceScatter(ReduceScatter):
    def __init__(self, timer: StepTimer, inner: ReduceScatter | None = None) -> None:
        self.timer = timer
        self.inner = inner or DefaultReduceScatter()

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        return _timed(self.inner, self.timer, output_tensor, input_tensor, group, op,
                      async_op=async_op)


def _installed_comms(module: FSDPModule) -> tuple[AllGather | None, ReduceScatter | None]:
    # FSDP2 has setters but no getters for its comms; read them from its one parameter group
    # (None, i.e. FSDP's defaults, if this torch lays its state out differently).
    try:
        (group,) = module._get_fsdp_state()._fsdp_param_groups
        return group._all_gather_comm, group._reduce_scatter_comm
    except (AttributeError, ValueError):
        return None, None


def time_fsdp_collectives(model: nn.Module, timer: StepTimer) -> int:
    """Wrap the comms of every FSDP2 module of ``model`` in timed ones; returns how many took them.

    Idempotent. A module FSDP cannot give one custom comm (several parameter groups, from a
    per-parameter mesh) keeps its own and is not timed."""
    count = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        all_gather, reduce_scatter = _installed_comms(module)
        if isinstance(all_gather, TimedAllGather):
            count += 1
            continue
        try:
            module.set_custom_all_gather(TimedAllGather(timer, all_gather))
            module.set_custom_reduce_scatter(TimedReduceScatter(timer, reduce_scatter))
        except ValueError:
            continue
        count += 1
    return count
