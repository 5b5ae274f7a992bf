"""How one rank shares gradients and state: FT-HSDP.

Inside a replica group the model is sharded with FSDP2 (``fully_shard`` over a 1-D device mesh
of the group's ranks: gloo on CPU, NCCL on GPU), so gradients arrive reduce-scattered and
averaged within the group. Across replica groups each rank all-reduces its *local shard* of the
gradients with the ranks of the same ``group_rank`` in the other groups, through
``Manager.allreduce`` (torchft's fault-tolerant process group, averaged over the quorum's
participants). With one rank per group there is nothing to shard and the model stays plain.

torchft 0.2.0 does not ship ``ft_init_device_mesh`` (the FT-HSDP design's managed mesh), so the
replicate dimension is not part of a DeviceMesh: it is the Manager's process group, used
directly. Healing sends each rank's local shards (plain tensors) to the same ``group_rank`` of
the recovering group, which loads them back into its own shards.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def shard_within_group(model: nn.Module, group_world_size: int,
                       device_type: str) -> tuple[nn.Module, Any]:
    """FSDP2 over the replica group's ranks; returns the model and the all-gather comm its FSDP
    modules share (a :func:`mismatchable_all_gather`, for fault injection), or the model
    unchanged and None for a single-rank group."""
    if group_world_size <= 1:
        return model, None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (group_world_size,), mesh_dim_names=("shard",))
    for module in model.modules():
        if isinstance(module, nn.TransformerEncoderLayer):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    comm = mismatchable_all_gather()
    for module in model.modules():
        if hasattr(module, "set_custom_all_gather"):
            module.set_custom_all_gather(comm)
    return model, comm


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def mismatchable_all_gather() -> Any:
    """FSDP's default all-gather, which can issue its next call as a mismatched collective.

    After ``arm()``, the next all-gather sends and receives the same bytes viewed as integers
    of the same width: the peers all-gather floats at that sequence number, this rank integers,
    so the Flight Recorder records a dtype mismatch, while the data (and training) stay intact.
    (A mismatch of sizes is no use on gloo: the rank that receives more bytes than it expects
    aborts with ``gloo::EnforceNotMet``.)"""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class MismatchableAllGather(DefaultAllGather):
        armed = False

        def arm(self) -> None:
            self.armed = True

        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
            if self.armed:
                self.armed = False
                as_int = _SAME_WIDTH_INT[input_tensor.element_size()]
                output_tensor, input_tensor = output_tensor.view(as_int), input_tensor.view(as_int)
            return super().__call__(output_tensor, input_tensor, group, async_op)

    return MismatchableAllGather()


def flat_local_grads(params: list[nn.Parameter]) -> torch.Tensor:
    """This rank's gradient shards as one flat tensor (one cross-group all_reduce per step)."""
    return torch.cat([_local(p.grad).reshape(-1) for p in params])


def unflatten_into_grads(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
    offset = 0
    for p in params:
        g = _local(p.grad)
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def local_numel(params: list[nn.Parameter]) -> int:
    return sum(_local(p).numel() for p in params)


def _to_local_tree(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _to_local_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_local_tree(v) for v in obj]
    return _local(obj)


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    # Parameters and buffers read directly, not through ``model.state_dict()``: torchft asks for
    # the state from its quorum thread while the main thread runs forward, and FSDP2's
    # state_dict hooks would reshard (free) the parameters the forward pass is using.
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return tensors


def local_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state as plain local tensors: what a healing peer receives."""
    return {"model": {k: _local(v).detach() for k, v in _model_tensors(model).items()},
            "optim": _to_local_tree(optimizer.state_dict())}


def load_local_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                          sd: dict[str, Any]) -> None:
    """Load local shards sent by the same group_rank of a healthy group.

    Model tensors are copied into this rank's shards in place. Optimizer state tensors are
    re-wrapped as DTensors with the placements of the parameter they belong to, so a freshly
    started group (no optimizer state yet) heals too.
    """
    with torch.no_grad():
        own = _model_tensors(model)
        for name, value in sd["model"].items():
            _local(own[name]).copy_(value)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optim_sd = sd["optim"]
    state = {}
    for idx, per_param in optim_sd["state"].items():
        p = params[int(idx)]
        state[idx] = {
            k: _as_param_layout(v, p) for k, v in per_param.items()
        }
    optimizer.load_state_dict({"state": state, "param_groups": optim_sd["param_groups"]})


def _as_param_layout(value: Any, param: nn.Parameter) -> Any:
    if not (isinstance(value, torch.Tensor) and hasattr(param, "device_mesh")):
        return value
    if value.shape != _local(param).shape:
        return value  # e.g. the scalar ``step``: not sharded
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value.to(_local(param).device), param.device_mesh, param.placements,
                              run_check=False)
