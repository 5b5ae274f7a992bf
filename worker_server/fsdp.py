"""FSDP2's in-group collectives, timed: the ``group`` waits of :mod:`worker_server.timing`.

FSDP2 lets a module swap the callables that issue its all-gathers and reduce-scatters
(``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``). The ones here are FSDP's
defaults with the training thread's time inside them counted as in-group wait: a synchronous call
(gloo, FSDP's default on CPU) is timed whole; an asynchronous one returns a Work whose ``wait()``
is timed. They subclass FSDP's defaults, so FSDP treats them as default comms.

Imported only when a model is instrumented (it imports torch).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
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


class TimedAllGather(DefaultAllGather):
    def __init__(self, timer: StepTimer) -> None:
        super().__init__()
        self.timer = timer

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        return _timed(super().__call__, self.timer, output_tensor, input_tensor, group,
                      async_op=async_op)


class TimedReduceScatter(DefaultReduceScatter):
    def __init__(self, timer: StepTimer) -> None:
        super().__init__()
        self.timer = timer

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        return _timed(super().__call__, self.timer, output_tensor, input_tensor, group, op,
                      async_op=async_op)


def time_fsdp_collectives(model: nn.Module, timer: StepTimer) -> int:
    """Install timed comms on every FSDP2 module of ``model``; returns how many took them.

    A module FSDP cannot give one custom comm (several parameter groups, from a per-parameter
    mesh) keeps FSDP's own and is not timed. Call it before anything else sets custom comms."""
    count = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            module.set_custom_all_gather(TimedAllGather(timer))
            module.set_custom_reduce_scatter(TimedReduceScatter(timer))
        except ValueError:
            continue
        count += 1
    return count
