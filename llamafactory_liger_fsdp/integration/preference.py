"""The patches of :mod:`.` to LLaMA-Factory's preference trainers: they take log-probs from the fused kernel, patched
when a DPO or KTO run engages (:func:`patch_stage`), the one of its stage only.

* ``llamafactory.train.dpo.trainer.CustomDPOTrainer.concatenated_forward`` (DPO, IPO, hinge, kto_pair, ORPO, SimPO,
  with ``pref_ftx``, ``ld_alpha``, ``dpo_label_smoothing``)
* ``llamafactory.train.kto.trainer.CustomKTOTrainer.forward`` (KTO)

Each replacement is LLaMA-Factory 0.9.5's method with ``model(...).logits`` + ``get_batch_logps`` replaced by the
model's fused forward (:func:`..forward.token_logps`; LLaMA-Factory's sequence sums in :mod:`..preference`): the policy, the LoRA-as-reference pass (PEFT's ``disable_adapter()``:
the head strategy switches to the base weights) and a separate ``ref_model`` (engaged on first use, frozen head,
forward-only kernel under ``no_grad``). ``logits/chosen``/``logits/rejected`` (DPO: ``logits.mean()``) come out as
per-sequence means of the full logits -- every sequence of a batch has the same ``T x V`` count, so their mean is
LLaMA-Factory's; for KTO (``logits.nansum()``) as per-sequence sums. A model that did not engage runs the original.
"""

from __future__ import annotations

from typing import Any

from .. import _patch, config, forward, preference
from .._log import info_rank0


def _fused_model(trainer: Any, model: Any) -> bool:
    """Whether ``model``'s causal LM runs the fused forward; a separate reference model is engaged on first use."""
    from .. import engage

    cfg = config.get_config(getattr(trainer, "finetuning_args", None))
    if not cfg.enabled:
        return False
    unwrapped = trainer.accelerator.unwrap_model(model)
    if engage.engaged(unwrapped) is not None:
        return True
    if model is not getattr(trainer, "ref_model", None):
        return False
    done = engage.engage(unwrapped, cfg, any_head=True)
    if done is not None:
        info_rank0(f"[liger_fsdp] reference model: {done.head.describe()}; its log-probs come from the fused kernel too.")
    return done is not None


def _logps(trainer: Any, model: Any, inputs: dict, labels: Any):
    """(per-token log-probs, per-position logit sums, vocabulary size) from the fused forward (:mod:`..forward`)."""
    from .. import engage

    return forward.token_logps(model, engage.causal_lm_of(trainer.accelerator.unwrap_model(model)), inputs, labels)


def patch_dpo(module: Any) -> None:
    cls = module.CustomDPOTrainer
    _patch.require_params(cls.concatenated_forward, ("self", "model", "batch", "is_ref_model"), "concatenated_forward")
    nested_detach = module.nested_detach

    def make(original):
        def concatenated_forward(self, model, batch, is_ref_model=False):
            if not _fused_model(self, model):
                return original(self, model, batch, is_ref_model)
            if self.finetuning_args.use_ref_model:
                batch = nested_detach(batch, clone=True)
            labels = batch.pop("labels")
            token_logps, sums, vocab_size = _logps(self, model, batch, labels)
            ld_alpha = self.ld_alpha if not is_ref_model else None
            all_logps, valid_length = preference.sequence_logps(token_logps, labels, ld_alpha=ld_alpha)
            if self.loss_type in ["ipo", "orpo", "simpo"]:
                all_logps = all_logps / valid_length
            batch_size = batch["input_ids"].size(0) // 2
            chosen_logps, rejected_logps = all_logps.split(batch_size, dim=0)
            means = sums.sum(-1) / (sums.shape[-1] * vocab_size)  # = logits.mean() per row
            chosen_logits, rejected_logits = means.split(batch_size, dim=0)
            chosen_length, _ = valid_length.split(batch_size, dim=0)
            average = self.loss_type in ["ipo", "orpo", "simpo"]
            return {
                "chosen_logps": chosen_logps,
                "rejected_logps": rejected_logps,
                "chosen_logits": chosen_logits,
                "rejected_logits": rejected_logits,
                "chosen_logps_avg": chosen_logps if average else chosen_logps / chosen_length,
            }

        return concatenated_forward

    return _patch.apply(cls, "concatenated_forward", make, "DPO: log-probs from the fused kernel, no [N, V] logits")


#: What LLaMA-Factory 0.9.5's CustomKTOTrainer.forward passes to the model, and whether the key takes the prefix.
_KTO_INPUTS = (("input_ids", True), ("attention_mask", True), ("token_type_ids", True), ("pixel_values", False),
               ("image_sizes", False), ("image_grid_thw", False), ("aspect_ratio_ids", False),
               ("aspect_ratio_mask", False), ("cross_attention_mask", True))


def patch_kto(module: Any) -> None:
    cls = module.CustomKTOTrainer
    _patch.require_params(cls.forward, ("self", "model", "batch", "prefix"), "CustomKTOTrainer.forward")
    nested_detach = module.nested_detach

    def make(original):
        def forward(self, model, batch, prefix=""):
            if not _fused_model(self, model):
                return original(self, model, batch, prefix)
            batch = nested_detach(batch, clone=True)
            inputs = {name: batch[f"{prefix}{name}" if prefixed else name] for name, prefixed in _KTO_INPUTS
                      if (f"{prefix}{name}" if prefixed else name) in batch}
            labels = batch[f"{prefix}labels"]
            token_logps, sums, _ = _logps(self, model, inputs, labels)
            logps, valid_length = preference.sequence_logps(token_logps, labels)
            return sums.sum(-1), logps, logps / valid_length  # logits.nansum() per row, as LF logs it

        return forward

    return _patch.apply(cls, "forward", make, "KTO: log-probs from the fused kernel, no [N, V] logits")


def patch_stage(stage: str) -> list:
    """Patch the trainer of this run's preference stage (only that one); the undo callables."""
    import importlib

    from ..hooked import DPO, KTO

    name, patcher = {"dpo": (DPO, patch_dpo), "kto": (KTO, patch_kto)}[stage]
    patch = patcher(importlib.import_module(name))
    return [] if patch is None else [lambda: _patch.undo(patch.owner, patch.name)]
