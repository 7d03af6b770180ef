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

On the policy's first training call the replacement is held against LLaMA-Factory's own method on a slice of the
batch (:mod:`..guard`): a release that changed the method stops the run instead of being silently replaced.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _patch, config, forward, guard, preference
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


def _hold(trainer: Any, model: Any, what: str, original, ours, compare, batch: dict, labels: Any,
          pairs: bool = False) -> None:
    """The policy's first training call: LLaMA-Factory's own method against the replacement (:mod:`..guard`)."""
    from .. import engage

    causal_lm = engage.causal_lm_of(trainer.accelerator.unwrap_model(model))
    check = guard.Check(f"LLaMA-Factory's {what}", original, ours, compare, models=(causal_lm,))
    guard.first_call(causal_lm, engage.engaged(causal_lm).family, check, batch, labels,
                     step=trainer.state.global_step + 1, pairs=pairs)


def _per_row(t: torch.Tensor, reduce) -> torch.Tensor:
    """A full ``[B, T, V]`` logits tensor reduced per row as the replacement reports it."""
    return reduce(t.float(), dim=tuple(range(1, t.dim()))) if t.dim() > 1 else t


def _dpo_compare(theirs: Any, ours: dict) -> dict:
    if not isinstance(theirs, dict) or theirs.keys() != ours.keys():
        keys = sorted(theirs) if isinstance(theirs, dict) else type(theirs).__name__
        return {f"the outputs ({keys} against {sorted(ours)})": (torch.zeros(1), torch.full((1,), float("nan")))}
    out = {k: (theirs[k], ours[k]) for k in ("chosen_logps", "rejected_logps", "chosen_logps_avg")}
    out.update({f"{k} (mean per row)": (_per_row(theirs[k], torch.mean), ours[k])
                for k in ("chosen_logits", "rejected_logits")})
    return out


def _kto_compare(theirs: tuple, ours: tuple) -> dict:
    if not isinstance(theirs, tuple) or len(theirs) != len(ours):
        return {f"the outputs ({type(theirs).__name__} against {len(ours)} values)":
                (torch.zeros(1), torch.full((1,), float("nan")))}
    return {"logits (sum per row)": (_per_row(theirs[0], torch.nansum), ours[0]), "logps": (theirs[1], ours[1]),
            "logps / length": (theirs[2], ours[2])}


def patch_dpo(module: Any) -> None:
    cls = module.CustomDPOTrainer
    _patch.require_params(cls.concatenated_forward, ("self", "model", "batch", "is_ref_model"), "concatenated_forward")
    nested_detach = module.nested_detach

    def make(original):
        def concatenated_forward(self, model, batch, is_ref_model=False):
            if not _fused_model(self, model):
                return original(self, model, batch, is_ref_model)
            if not is_ref_model:
                _hold(self, model, "CustomDPOTrainer.concatenated_forward",
                      lambda b: original(self, model, b, is_ref_model),
                      lambda b: fused(self, model, b, is_ref_model), _dpo_compare, batch, batch["labels"], pairs=True)
            return fused(self, model, batch, is_ref_model)

        return concatenated_forward

    def fused(self, model, batch, is_ref_model):
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
            if prefix == "":
                _hold(self, model, "CustomKTOTrainer.forward", lambda b: original(self, model, b, prefix),
                      lambda b: fused(self, model, b, prefix), _kto_compare, batch, batch["labels"])
            return fused(self, model, batch, prefix)

        return forward

    def fused(self, model, batch, prefix):
        batch = nested_detach(batch, clone=True)
        inputs = {name: batch[f"{prefix}{name}" if prefixed else name] for name, prefixed in _KTO_INPUTS
                  if (f"{prefix}{name}" if prefixed else name) in batch}
        labels = batch[f"{prefix}labels"]
        token_logps, sums, _ = _logps(self, model, inputs, labels)
        logps, valid_length = preference.sequence_logps(token_logps, labels)
        return sums.sum(-1), logps, logps / valid_length  # logits.nansum() per row, as LF logs it

    return _patch.apply(cls, "forward", make, "KTO: log-probs from the fused kernel, no [N, V] logits")


def patch_stage(stage: str) -> list:
    """Patch the trainer of this run's preference stage (only that one); the undo callables."""
    import importlib

    from ..hooked import DPO, KTO

    name, patcher = {"dpo": (DPO, patch_dpo), "kto": (KTO, patch_kto)}[stage]
    patch = patcher(importlib.import_module(name))
    return [] if patch is None else [lambda: _patch.undo(patch.owner, patch.name)]
