"""v1's Ulysses sequence parallelism (``cp_size > 1``) with the fused loss, patched once a model engaged
(:func:`.v1.engage_v1`), recorded on the model and undone by :func:`...engage.disengage`:

* the registered ``sequence_parallel_loss`` of ``llamafactory.v1.plugins.model_plugins.parallelization.
  sequence_parallel`` (v1's trainer calls it instead of ``compute_loss`` under CP and reads ``outputs.logits``,
  fp32 ``[B, T/cp, V]`` a rank) -- the same loss from the fused kernel: v1's own padding and split of the
  micro-batch, the labels gathered, shifted globally and re-split (a shard's last position predicts the next shard's
  first label), each rank's per-token log-probs from :func:`...forward.token_logps` on its shard, gathered with
  autograd, and ``sum(-logp * w) / (sum(w) + 1e-6)`` over the whole micro-batch with v1's shifted loss weights.

Every CP rank thus holds the full loss, as in v1, and the backward of the autograd all-gather sums the CP ranks'
copies (v1's FSDP2 mean over the whole mesh cancels it), so the gradients are v1's. On the first training call the
guard holds v1's own ``sequence_parallel_loss`` (logits) against this one on a slice of the micro-batch (the CP ranks
of a group hold the same micro-batch, so they cut the same slice and split it together).
"""

from __future__ import annotations

import importlib
from typing import Any

from ... import _patch
from ..._log import info_rank0
from . import args as v1_args
from .ulysses import LOSS, SP_MODULE, gather, gather_grad, shifted_targets, slot
from .ulysses import cp_size  # noqa: F401  (read as cp.cp_size by the engine)


def fused_sequence_parallel_loss(sp: Any, model: Any, model_inputs: dict):
    """v1's ``sequence_parallel_loss`` with each rank's log-probs from the fused kernel (no logits)."""
    import torch
    from llamafactory.v1.accelerator.interface import Dim, DistributedInterface

    from ... import engage, forward
    from .train import unwrapped

    interface = DistributedInterface()
    inputs = {k: v.to(interface.current_device, non_blocking=True) for k, v in model_inputs.items()
              if isinstance(v, torch.Tensor)}
    inputs = sp.padding_and_split_data(inputs, interface.get_device_mesh(Dim.CP))
    group = sp.get_ulysses_sequence_parallel_group()
    targets = shifted_targets(inputs.pop("labels"), group)
    logps, _, _ = forward.token_logps(model, engage.causal_lm_of(unwrapped(model)), inputs, targets, sums=False,
                                      shifted=True)
    logps = gather_grad(logps, group)[..., :-1]
    weights = gather(inputs["loss_weights"], group)[..., 1:]
    return (-logps * weights).sum() / (weights.sum() + 1e-6)


def patch(model: Any) -> list:
    """Answer v1's sequence-parallel loss through the fused kernel (held against v1's own on the first step)."""
    size = cp_size()
    if size <= 1:
        return []
    import torch.distributed.nn  # noqa: F401  (the autograd all_gather)

    from ... import engage, forward, guard
    from . import cp_dpo
    from .train import unwrapped

    sp = importlib.import_module(SP_MODULE)
    mapping, key, where = slot(sp)
    original = mapping[key]
    if getattr(original, _patch.MARK, False):  # a second engaged model (a reference): the loss is ours already
        return []
    _patch.require_params(original, ("model", "model_inputs"), LOSS)
    said: list = []

    def sequence_parallel_loss(model: Any, model_inputs: dict):
        inner = unwrapped(model)
        engaged = engage.engaged(inner)
        if engaged is None:
            return original(model, model_inputs)
        trainer = cp_dpo.trainer_of(inner)
        if trainer is not None:  # a DPO trainer's own objective (v1 would train the SFT loss)
            return cp_dpo.loss(sp, trainer, model_inputs)
        if not said:
            said.append(True)
            info_rank0(f"[liger_fsdp] v1 sequence parallelism (Ulysses, cp_size {size}): each rank's per-token "
                       "log-probs from the fused kernel on its own shard, labels shifted across shards as v1's "
                       f"`{LOSS}` shifts them, no [N/cp, V] logits.")
        causal_lm = engage.causal_lm_of(inner)
        check = guard.Check(f"LLaMA-Factory's {LOSS}", lambda b: original(model, b),
                            lambda b: fused_sequence_parallel_loss(sp, model, b), lambda a, b: {"loss": (a, b)},
                            models=(causal_lm,))
        # the CP ranks of a group hold the same micro-batch, so they cut the same slice and split it together
        state = forward.state_of(causal_lm)  # this seam gets no trainer step: the forwards so far give it
        step = None if state is None else state.start_step + 1 + state.steps // state.grad_accum
        guard.first_call(causal_lm, engaged.family, check, model_inputs, model_inputs["labels"], step=step)
        return fused_sequence_parallel_loss(sp, model, model_inputs)

    setattr(sequence_parallel_loss, _patch.MARK, True)
    _patch.put(mapping, key, sequence_parallel_loss, f"v1 sequence parallelism: the loss from the fused kernel "
               f"(`{v1_args.NAME}`), no logits", where)
    return [lambda: _patch.undo(mapping, key)]
