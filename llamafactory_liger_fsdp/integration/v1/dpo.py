"""v1's DPO trainer (``llamafactory.v1.trainers.dpo_trainer.DPOTrainer``, git main) with log-probs from the fused kernel.

Patched by :func:`.v1.engage_v1` when the run's trainer module is v1's DPO one (``llamafactory-cli dpo`` imports it
before the model is built), recorded on the model and undone with it:

* ``compute_loss`` and ``_compute_ref_logps`` -- LLaMA-Factory's methods with ``model(...).logits.float()`` and the
  per-token cross-entropy of ``_extract_chosen_rejected_logps`` replaced by :func:`..forward.token_logps` (the policy;
  LoRA as the reference under PEFT's ``disable_adapter()``; a separate reference model). Everything after the per-token
  log-probs is LLaMA-Factory's logic as of git main ``ff6d4d1`` (masks, LD-DPO, the three losses, ``pref_ftx``, the
  logged metrics): :func:`chosen_rejected` and :func:`compute_loss` below; ``logits/*`` (means of the full logits
  over prompt and answer positions) come from the per-position logit sums divided by the vocabulary size. On the
  policy's first training call LLaMA-Factory's own ``compute_loss`` is held against it (:mod:`..guard`): its loss and
  logged log-probs and logits on a slice of the batch must agree, or the run stops.
* ``_init_ref_model`` -- a full fine-tuning reference is ``copy.deepcopy`` of the policy, which copies the policy's
  instance ``forward`` by reference (functions are atomic to ``deepcopy``): the copy would run the *policy*. The
  copy's forward and engagement are dropped and it is engaged on its own (frozen head, request-only).
"""

from __future__ import annotations

from typing import Any

import torch

from ... import _patch, engage, forward, guard
from ...hooked import V1_DPO
from ...losses import IGNORE_INDEX
from ...preference import ld_sum


def causal_lm_in(model: Any):
    from .train import unwrapped

    return engage.causal_lm_of(unwrapped(model))


def chosen_rejected(trainer: Any, per_token_logps: torch.Tensor, labels: torch.Tensor, token_type_ids: torch.Tensor,
                    use_ld: bool = True):
    """LLaMA-Factory's ``_extract_chosen_rejected_logps`` after its cross-entropy: (chosen, rejected) sums and
    length-normalised means of ``per_token_logps [B, T-1]`` (0 at ignored positions)."""
    shift_labels, shift_types = labels[..., 1:], token_type_ids[..., 1:]
    loss_mask = shift_labels != IGNORE_INDEX
    chosen_mask, rejected_mask = (shift_types == 1) & loss_mask, (shift_types == 2) & loss_mask
    chosen_len, rejected_len = chosen_mask.sum(dim=-1), rejected_mask.sum(dim=-1)
    ld_alpha = trainer.ld_alpha if use_ld else None
    if ld_alpha is not None:
        shortest = torch.min(chosen_len, rejected_len)
        chosen, rejected = (ld_sum(per_token_logps, mask, torch.argmax(mask.int(), dim=1) + shortest, ld_alpha)
                            for mask in (chosen_mask, rejected_mask))
    else:
        chosen = (per_token_logps * chosen_mask.float()).sum(dim=-1)
        rejected = (per_token_logps * rejected_mask.float()).sum(dim=-1)
    return chosen, rejected, chosen / (chosen_len + 1e-6), rejected / (rejected_len + 1e-6)


def _inputs(trainer: Any, batch: dict):
    input_ids, labels, types = (batch[k].to(trainer.device, non_blocking=True)
                                for k in ("input_ids", "labels", "token_type_ids"))
    return trainer._prepare_model_inputs(input_ids, types), labels, types


def fused_logps(model: Any, inputs: dict, labels: torch.Tensor, sums: bool, step: int | None = None):
    """(per-token log-probs ``[B, T-1]``, per-position logit sums or None, vocabulary size) of ``model``."""
    return forward.token_logps(model, causal_lm_in(model), inputs, labels, sums=sums, step=step)


def compute_loss(trainer: Any, batch: dict, logps_of=fused_logps) -> torch.Tensor:
    """LLaMA-Factory's ``DPOTrainer.compute_loss`` on fused log-probs (``logps_of``: :func:`fused_logps` or the
    sequence-parallel one of :mod:`.cp_dpo`, for the policy and the reference)."""
    model_inputs, labels, types = _inputs(trainer, batch)
    logps, sums, vocab = logps_of(trainer.model, model_inputs, labels, True, getattr(trainer, "global_step", None))
    policy_chosen, policy_rejected, chosen_avg, rejected_avg = chosen_rejected(trainer, logps, labels, types)
    means = sums[:, :-1] / vocab  # shift_logits.mean(-1), without the logits
    shift_types = types[..., 1:]
    chosen_mean, rejected_mean = ((means * m).sum() / (m.sum() + 1e-6)
                                  for m in ((shift_types == 1).float(), (shift_types == 2).float()))
    beta = trainer.pref_beta
    if trainer.pref_loss == "sigmoid":
        if not trainer._use_lora_ref and trainer.ref_model is None:
            raise RuntimeError("Reference model is required for sigmoid DPO loss but ref_model is None.")
        ref_chosen, ref_rejected, _, _ = (trainer._compute_ref_logps(batch) if logps_of is fused_logps else
                                          compute_ref_logps(trainer, batch, logps_of))
        losses = trainer._sigmoid_dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
        chosen_rewards = (beta * (policy_chosen - ref_chosen)).detach()
        rejected_rewards = (beta * (policy_rejected - ref_rejected)).detach()
    elif trainer.pref_loss in ("orpo", "simpo"):
        loss_fn = trainer._odds_ratio_loss if trainer.pref_loss == "orpo" else trainer._simpo_loss
        losses = loss_fn(chosen_avg, rejected_avg)
        chosen_rewards, rejected_rewards = (beta * chosen_avg).detach(), (beta * rejected_avg).detach()
    else:
        raise ValueError(f"Unknown pref_loss: {trainer.pref_loss}")
    if trainer.pref_ftx > 1e-6:
        losses = losses + trainer.pref_ftx * -chosen_avg
    trainer._step_metrics = {
        "rewards/chosen": chosen_rewards.mean().item(), "rewards/rejected": rejected_rewards.mean().item(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
        "logps/chosen": policy_chosen.mean().item(), "logps/rejected": policy_rejected.mean().item(),
        "logits/chosen": chosen_mean.item(), "logits/rejected": rejected_mean.item(),
    }
    return losses.mean()


@torch.no_grad()
def compute_ref_logps(trainer: Any, batch: dict, logps_of=fused_logps):
    """LLaMA-Factory's ``DPOTrainer._compute_ref_logps`` on fused log-probs (no LD-DPO for the reference)."""
    model_inputs, labels, types = _inputs(trainer, batch)
    if trainer._use_lora_ref:
        model = trainer._unwrapped_model
        with model.disable_adapter():
            logps, _, _ = logps_of(model, model_inputs, labels, False)
    else:
        logps, _, _ = logps_of(trainer.ref_model, model_inputs, labels, False)
    return chosen_rejected(trainer, logps, labels, types, use_ld=False)


def engage_reference(ref: Any, config: Any) -> None:
    """A deep copy of an engaged policy: drop what the copy shares with the policy, then engage it on its own."""
    causal_lm = engage.causal_lm_of(ref)
    for key in ("forward", engage.ATTR, engage.SIDE_EFFECTS):
        causal_lm.__dict__.pop(key, None)
    engage.engage(ref, config, any_head=True, request_only=True)


#: The logged metrics held against LLaMA-Factory's (rewards are beta x differences of the compared log-probs).
COMPARED = ("logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected")


def compare_outputs(theirs: tuple, ours: tuple) -> dict:
    out = {"loss": (theirs[0], ours[0])}
    for key in COMPARED:
        if key not in theirs[1] or key not in ours[1]:
            return {f"the logged metrics ({sorted(theirs[1])} against {sorted(ours[1])})":
                    (torch.zeros(1), torch.full((1,), float("nan")))}
        out[key] = (torch.tensor(theirs[1][key]), torch.tensor(ours[1][key]))
    return out


def _hold(trainer: Any, batch: dict, original, original_ref) -> None:
    """The policy's first training call: LLaMA-Factory's ``compute_loss`` (with its own ``_compute_ref_logps``)
    against :func:`compute_loss`, on a slice of the batch (:mod:`..guard`)."""
    causal_lm = causal_lm_in(trainer.model)
    ref = getattr(trainer, "ref_model", None)
    models = (causal_lm,) if ref is None else (causal_lm, causal_lm_in(ref))

    def theirs(b: dict):
        trainer._compute_ref_logps = original_ref.__get__(trainer)
        try:
            return original(trainer, b), dict(trainer._step_metrics)
        finally:
            del trainer._compute_ref_logps

    def ours(b: dict):
        return compute_loss(trainer, b), dict(trainer._step_metrics)

    check = guard.Check("LLaMA-Factory's DPOTrainer.compute_loss", theirs, ours, compare_outputs, models=models)
    guard.first_call(causal_lm, engage.engaged(causal_lm).family, check, batch, batch["labels"],
                     step=getattr(trainer, "global_step", None))


def patch(config: Any) -> list:
    """Patch v1's DPOTrainer (when its module is loaded); the undo callables."""
    import sys

    module = sys.modules.get(V1_DPO)
    cls = getattr(module, "DPOTrainer", None)
    if cls is None:
        return []
    for name, params in (("compute_loss", ("self", "batch")), ("_compute_ref_logps", ("self", "batch")),
                         ("_init_ref_model", ("self",)), ("_prepare_model_inputs", ("self", "input_ids",
                                                                                     "token_type_ids"))):
        _patch.require_params(getattr(cls, name, None), params, f"DPOTrainer.{name}")

    def fused(self) -> bool:
        return engage.engaged(causal_lm_in(self.model)) is not None

    original_ref = cls._compute_ref_logps

    def make_loss(original):
        def compute_loss_(self, batch):
            if not fused(self):
                return original(self, batch)
            _hold(self, batch, original, original_ref)
            return compute_loss(self, batch)

        return compute_loss_

    def make_ref(original):
        def _compute_ref_logps(self, batch):
            return compute_ref_logps(self, batch) if fused(self) else original(self, batch)

        return _compute_ref_logps

    def make_init(original):
        def _init_ref_model(self):
            original(self)
            if fused(self) and getattr(self, "ref_model", None) is not None:
                engage_reference(self.ref_model, config)

        return _init_ref_model

    done = [_patch.apply(cls, "compute_loss", make_loss, "v1 DPO: policy log-probs from the fused kernel"),
            _patch.apply(cls, "_compute_ref_logps", make_ref, "v1 DPO: reference log-probs from the fused kernel"),
            _patch.apply(cls, "_init_ref_model", make_init, "v1 DPO: the deep-copied reference engaged on its own")]
    return [lambda p=p: _patch.undo(p.owner, p.name) for p in done if p is not None]
