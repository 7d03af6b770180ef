"""v1's DPO trainer (git main) under Ulysses sequence parallelism (``cp_size > 1``), patched by
:func:`.engine.engage_v1` in a DPO run with an engaged policy, recorded on the model and undone with it:

* ``DPOTrainer.__init__`` -- LLaMA-Factory refuses cp_size > 1 there; for an engaged model the method runs as
  written without that one statement (:mod:`.cp_init`), and the trainer is kept on the model for the CP seam.
* the CP seam (:mod:`.cp` dispatches here when the model has a DPO trainer) -- under CP v1's trainer calls the
  registered ``sequence_parallel_loss`` instead of ``compute_loss``, which would train the SFT loss. Answered by
  :func:`.dpo.compute_loss` with :func:`cp_logps` for the policy and the reference: the pair rows' inputs of
  ``DPOTrainer._prepare_model_inputs`` (an all-nonzero attention mask dropped, as transformers drops it for
  ``flash_attention_2`` at cp_size 1: see :mod:`.cp_rm`), v1's padding and split, the labels shifted globally and
  re-split, each rank's per-token log-probs (and logit sums) from the fused kernel on its shard, gathered with
  autograd (every CP rank holds the full loss; the gather's backward sums the copies), then LLaMA-Factory's DPO
  losses and metrics on the sums.

On the first training call LLaMA-Factory's own ``DPOTrainer.compute_loss`` at cp_size 1 (its Ulysses attention
switched off) is held against it on a slice of the micro-batch (:mod:`...guard`).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from ... import _patch
from ..._log import info_rank0
from ...hooked import V1_DPO

TRAINER = "_liger_fsdp_cp_dpo_trainer"  # on the policy's causal LM: a weak reference to its DPO trainer


def trainer_of(inner: Any):
    from ... import engage

    ref = engage.causal_lm_of(inner).__dict__.get(TRAINER)
    return ref() if ref is not None else None


def cp_logps(sp: Any):
    """:func:`.dpo.fused_logps` with each rank's shard of every row (the labels shifted across shards)."""

    def logps_of(model: Any, inputs: dict, labels, sums: bool, step: int | None = None):
        from llamafactory.v1.accelerator.interface import Dim, DistributedInterface

        from ... import forward
        from .dpo import causal_lm_in
        from .ulysses import gather_grad, shifted_targets, without_full_mask

        length = labels.shape[-1]
        split = sp.padding_and_split_data({**without_full_mask(inputs), "labels": labels},
                                          DistributedInterface().get_device_mesh(Dim.CP))
        group = sp.get_ulysses_sequence_parallel_group()
        targets = shifted_targets(split.pop("labels"), group)
        logps, sums_, vocab = forward.token_logps(model, causal_lm_in(model), split, targets, sums=sums, step=step,
                                                  shifted=True)
        logps = gather_grad(logps, group)[:, :length - 1]
        if sums_ is not None:
            sums_ = gather_grad(sums_, group)[:, :length]
        return logps, sums_, vocab

    return logps_of


def loss(sp: Any, trainer: Any, batch: dict):
    """The DPO loss of ``batch`` under CP, held against LLaMA-Factory's own at cp_size 1 on the first call."""
    from ... import engage, guard
    from . import dpo
    from .ulysses import ulysses_off

    cls = type(trainer)
    original = getattr(cls.compute_loss, "__wrapped__", cls.compute_loss)
    original_ref = getattr(cls._compute_ref_logps, "__wrapped__", cls._compute_ref_logps)
    logps_of = cp_logps(sp)

    def theirs(b: dict):
        trainer._compute_ref_logps = original_ref.__get__(trainer)
        try:
            with ulysses_off(sp) as found:
                if not found:
                    raise _patch.PatchError("LLaMA-Factory's Ulysses attention patch not found in transformers' "
                                            "modules: the cp_size-1 side cannot run")
                return original(trainer, b), dict(trainer._step_metrics)
        finally:
            del trainer._compute_ref_logps

    def ours(b: dict):
        return dpo.compute_loss(trainer, b, logps_of), dict(trainer._step_metrics)

    causal_lm = dpo.causal_lm_in(trainer.model)
    ref = getattr(trainer, "ref_model", None)
    models = (causal_lm,) if ref is None else (causal_lm, dpo.causal_lm_in(ref))
    check = guard.Check("LLaMA-Factory's DPOTrainer.compute_loss at cp_size 1", theirs, ours, dpo.compare_outputs,
                        models=models)
    guard.first_call(causal_lm, engage.engaged(causal_lm).family, check, batch, batch["labels"],
                     step=getattr(trainer, "global_step", None))
    return dpo.compute_loss(trainer, batch, logps_of)


def patch(size: int) -> list:
    """Lift ``DPOTrainer.__init__``'s cp_size refusal for an engaged model (a DPO run under CP only; :mod:`.cp_init`)."""
    module = sys.modules.get(V1_DPO)
    cls = getattr(module, "DPOTrainer", None)
    if cls is None or size <= 1:
        return []
    from ... import engage
    from . import cp_init
    from .train import unwrapped

    def taken(model: Any) -> bool:
        return engage.engaged(unwrapped(model)) is not None

    def built(trainer: Any, model: Any) -> None:
        engage.causal_lm_of(unwrapped(model)).__dict__[TRAINER] = weakref.ref(trainer)
        info_rank0(f"[liger_fsdp] v1 DPO under sequence parallelism (Ulysses, cp_size {size}): LLaMA-Factory's "
                   "DPOTrainer refuses cp_size > 1; with `liger_fsdp` each rank's per-token log-probs of its "
                   f"1/{size} of every pair row from the fused kernel (labels shifted across shards), gathered "
                   "across the CP group with autograd, then LLaMA-Factory's DPO loss on the sums (the reference "
                   "likewise, without gradients).")

    return cp_init.patch(cls, taken, built, "v1 DPO under CP: DPOTrainer.__init__ without its cp_size refusal for an "
                                            "engaged model")
