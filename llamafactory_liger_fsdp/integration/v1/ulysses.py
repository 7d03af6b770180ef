"""What the plugin's losses under v1's Ulysses sequence parallelism share (:mod:`.cp` for SFT, :mod:`.cp_dpo`,
:mod:`.cp_rm`): the run's CP size, the slot of v1's registered ``sequence_parallel_loss``, a no-gradient gather along
the sequence, and v1's Ulysses attention switched off (the guard's cp_size-1 side)."""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any

from ... import _patch

SP_MODULE = "llamafactory.v1.plugins.model_plugins.parallelization.sequence_parallel"
LOSS = "sequence_parallel_loss"


def cp_size() -> int:
    """The CP group's size of this run (v1's DistributedInterface, set up before the model is built)."""
    from llamafactory.v1.accelerator.interface import Dim, DistributedInterface

    instance = getattr(DistributedInterface, "_instance", None)
    if instance is None or not getattr(instance, "_initialized", False):  # not set up by a v1 run: never create it
        return 1
    return int(instance.get_world_size(Dim.CP) or 1)


def slot(sp: Any) -> tuple[dict, str, str]:
    """(mapping, key, label) of the registered loss: 0.9.5 keeps ``{name: {"__call__": fn}}`` on BasePlugin, git
    main ``{name: fn}`` per plugin class."""
    plugin = getattr(sp, "SequenceParallelLossPlugin", None)
    registry = getattr(plugin, "_registry", None)
    entry = registry.get(LOSS) if isinstance(registry, dict) else None
    where = f"{SP_MODULE}.SequenceParallelLossPlugin[{LOSS!r}]"
    if isinstance(entry, dict) and callable(entry.get("__call__")):
        return entry, "__call__", where
    if callable(entry):
        return registry, LOSS, where
    raise _patch.PatchError(f"v1's registered `{LOSS}` not found")


def gather(t, group):
    """The CP group's shards of ``t`` side by side along the sequence (no gradient)."""
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def gather_grad(t, group):
    """The CP group's shards of ``t`` side by side along the sequence, with autograd (the backward sums the ranks'
    gradients of the copies)."""
    import torch
    import torch.distributed.nn  # noqa: F401  (the autograd all_gather)

    return torch.cat(torch.distributed.nn.all_gather(t.contiguous(), group=group), dim=1)


def shifted_targets(labels, group):
    """This rank's chunk of the whole row's labels shifted by one (a shard's last position predicts the next shard's
    first label; -100 at the row's end), as v1's ``sequence_parallel_loss`` shifts them."""
    import torch.distributed as dist
    import torch.nn.functional as F

    whole = F.pad(gather(labels, group)[..., 1:], (0, 1), value=-100)
    return whole.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)].contiguous()


def without_full_mask(inputs: dict) -> dict:
    """``inputs`` without an all-nonzero attention mask, as transformers drops it for ``flash_attention_2`` at
    cp_size 1 (v1's padding to a multiple of cp_size must not bring it back: git main's Ulysses attention takes the
    mask path as soon as one shard holds padding)."""
    mask = inputs.get("attention_mask")
    if mask is not None and bool(mask.ne(0).all()):
        return {k: v for k, v in inputs.items() if k != "attention_mask"}
    return inputs


@contextlib.contextmanager
def ulysses_off(sp: Any):
    """transformers' ``_flash_attention_forward`` as it was before LLaMA-Factory's Ulysses patch, in every module it
    replaced it in (a ``functools.partial`` of its ``new_flash_attn_forward``)."""
    swapped = []
    for module in list(sys.modules.values()):
        fn = getattr(module, "_flash_attention_forward", None) if module is not None else None
        if isinstance(fn, functools.partial) and fn.func is getattr(sp, "new_flash_attn_forward", None):
            swapped.append((module, fn))
            module._flash_attention_forward = fn.keywords["attn_fn"]
    try:
        yield bool(swapped)
    finally:
        for module, fn in swapped:
            module._flash_attention_forward = fn
