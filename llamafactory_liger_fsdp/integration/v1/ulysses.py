"""What the plugin's losses under v1's Ulysses sequence parallelism share (:mod:`.cp` for SFT, :mod:`.cp_dpo`,
:mod:`.cp_rm`): the run's CP size, v1's registered ``sequence_parallel_loss`` answered per model (:func:`take`: one
shared replacement of the slot; each model's own seam object holds that run's state), gathers along the sequence, the
globally shifted targets, the real step of the calling trainer, and v1's own loss called with its device by the group
(:func:`rank_as_device`; it addresses ``cuda:{global rank}``)."""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any

from ... import _patch

SP_MODULE = "llamafactory.v1.plugins.model_plugins.parallelization.sequence_parallel"
LOSS = "sequence_parallel_loss"
SEAM = "_liger_fsdp_cp_seam"  # on a model's causal LM (or score model): the object answering its CP loss this run


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


def seam_of(model: Any):
    """The seam object answering ``model``'s CP loss (None: v1's own loss)."""
    from ... import engage
    from .train import unwrapped

    return engage.causal_lm_of(unwrapped(model)).__dict__.get(SEAM)


def take(model: Any, seam: Any) -> list:
    """Answer v1's ``sequence_parallel_loss`` for ``model`` by ``seam(sp, original, model, model_inputs)``; the
    undo callables. The slot's replacement only dispatches (no state of its own): it is held by every model that
    takes it and undone when the last one disengages; the seam object, this run's state, goes with its model."""
    from ... import engage
    from .train import unwrapped

    inner = engage.causal_lm_of(unwrapped(model))
    inner.__dict__[SEAM] = seam
    engage.hold(model, "v1 sequence_parallel_loss", _take_slot)
    return [lambda: inner.__dict__.pop(SEAM, None)]


def _take_slot() -> list:
    sp = importlib.import_module(SP_MODULE)
    mapping, key, where = slot(sp)
    original = mapping[key]
    if getattr(original, _patch.MARK, False):  # in place (a run before this one in the process): it dispatches
        return []
    _patch.require_params(original, ("model", "model_inputs"), LOSS)

    def sequence_parallel_loss(model: Any, model_inputs: dict):
        seam = seam_of(model)
        return original(model, model_inputs) if seam is None else seam(sp, original, model, model_inputs)

    setattr(sequence_parallel_loss, _patch.MARK, True)
    _patch.put(mapping, key, sequence_parallel_loss, "v1 sequence parallelism: the loss of a model the plugin takes "
               "(SFT and DPO from the fused kernel, RM from the gathered scores)", where)
    return [lambda: _patch.undo(mapping, key)]


def trainer_step() -> int | None:
    """The optimizer step of the v1 trainer whose ``fit`` called the CP seam (v1 hands the seam only the model and
    the micro-batch): its ``global_step``, read from the calling frames (first calls only)."""
    from llamafactory.v1.core.base_trainer import BaseTrainer

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, BaseTrainer):
            return int(owner.global_step)
        frame = frame.f_back
    return None


class _GroupDevice:
    """``torch.distributed`` as v1's sequence_parallel module sees it, except that ``get_rank()`` without a group
    (which it uses only as the device to move the inputs to) is the process group's device."""

    def __init__(self, dist: Any, device: Any):
        self._dist, self._device = dist, device

    def __getattr__(self, name: str):
        return getattr(self._dist, name)

    def get_rank(self, group=None):
        return self._device if group is None else self._dist.get_rank(group)


@contextlib.contextmanager
def rank_as_device(sp: Any):
    """For its duration v1's ``sequence_parallel_loss`` moves its inputs to the process group's device, not to
    ``cuda:{global rank}`` (which does not exist on a second node)."""
    from ... import collective

    before = sp.dist
    sp.dist = _GroupDevice(before, collective.collective_device())
    try:
        yield
    finally:
        sp.dist = before
