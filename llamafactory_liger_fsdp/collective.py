"""Collectives on the process group's device: the one place that decides where a collective's tensors live (the CPU
for a gloo group, else the current accelerator device -- never a parameter's, which CPU offload puts on the CPU, and
never a device picked by the global rank), and the element-wise maximum over ranks that the guard's decisions take
together."""

from __future__ import annotations

import torch


def collective_device(group=None) -> torch.device:
    """The device the tensors of a collective over ``group`` (default: the world) live on: the CPU for a gloo-only
    group, else the current accelerator device (NCCL: the current CUDA device) -- never a parameter's (CPU offload).
    Without a process group: the accelerator's device (where training computes), else the CPU."""
    dist = torch.distributed
    backend = str(dist.get_backend(group)).lower() if dist.is_available() and dist.is_initialized() else None
    accelerator = getattr(torch, "accelerator", None)
    if backend == "gloo" or accelerator is None or not accelerator.is_available():
        return torch.device("cpu")
    return torch.device(accelerator.current_accelerator().type, accelerator.current_device_index())


def all_max(values: list[float], group=None) -> list[float]:
    """The element-wise maximum of ``values`` over every rank of ``group`` (default: the world), on its device."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
        return values
    flag = torch.tensor(values, device=collective_device(group), dtype=torch.float64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag.tolist()
