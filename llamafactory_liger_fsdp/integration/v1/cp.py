"""v1's Ulysses sequence parallelism (``cp_size > 1``) with the fused loss, taken once a model engaged
(:func:`.v1.engage_v1`), recorded on the model and undone by :func:`...engage.disengage`.

v1's trainer calls the registered ``sequence_parallel_loss`` (:mod:`.ulysses`) instead of ``compute_loss`` under CP;
it reads ``outputs.logits``, fp32 ``[B, T/cp, V]`` a rank. For an engaged model :class:`Seam` answers the same loss
from the fused kernel: v1's own padding and split of the micro-batch, the labels gathered, shifted globally and
re-split (a shard's last position predicts the next shard's first label), each rank's per-token log-probs on its
shard, gathered with autograd, and ``sum(-logp * w) / (sum(w) + 1e-6)`` with v1's shifted loss weights. Every CP rank
thus holds the full loss, as in v1, and the backward of the gather sums the CP ranks' copies (v1's FSDP2 mean over the
whole mesh cancels it), so the gradients are v1's. A model with a DPO trainer goes to :mod:`.cp_dpo`.

On the first training call the guard holds v1's own ``sequence_parallel_loss`` against it on the same split forward
(:mod:`...guard_split`): v1's function run on the model's own head applied to this call's hidden states (a stand-in
model hands it two-column logits whose cross-entropy is those log-probs), and the per-token log-probs themselves.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ..._log import info_rank0
from .ulysses import gather, gather_grad, rank_as_device, shifted_targets, take, trainer_step
from .ulysses import cp_size  # noqa: F401  (read as cp.cp_size by the engine)


def fused_sequence_parallel_loss(sp: Any, model: Any, model_inputs: dict):
    """v1's ``sequence_parallel_loss`` with each rank's log-probs from the fused kernel (no logits)."""
    import torch
    from llamafactory.v1.accelerator.interface import Dim, DistributedInterface

    from ... import engage, guard_split
    from .train import unwrapped

    interface = DistributedInterface()
    inputs = {k: v.to(interface.current_device, non_blocking=True) for k, v in model_inputs.items()
              if isinstance(v, torch.Tensor)}
    inputs = sp.padding_and_split_data(inputs, interface.get_device_mesh(Dim.CP))
    group = sp.get_ulysses_sequence_parallel_group()
    targets = shifted_targets(inputs.pop("labels"), group)
    logps, _, _ = guard_split.token_logps(model, engage.causal_lm_of(unwrapped(model)), inputs, targets, sums=False)
    logps = gather_grad(logps, group)[..., :-1]
    weights = gather(inputs["loss_weights"], group)[..., 1:]
    return (-logps * weights).sum() / (weights.sum() + 1e-6)


def own_loss(sp: Any, original: Any, model_inputs: dict, reference):
    """v1's own ``sequence_parallel_loss`` (``original``) on this rank's reference log-probs of its shard."""
    from ... import guard_split

    def stand_in(**split):
        if split["input_ids"].shape != reference.shape:
            raise RuntimeError(f"v1's split gave {tuple(split['input_ids'].shape)}, the probed shard was "
                               f"{tuple(reference.shape)}")
        return SimpleNamespace(logits=guard_split.two_columns(reference))

    with rank_as_device(sp):
        return original(stand_in, {**model_inputs, "labels": guard_split.class_zero(model_inputs["labels"])})


class Seam:
    """The CP loss of one engaged model in one run (its state: whether the line was said)."""

    def __init__(self, size: int):
        self.size, self.said = size, False

    def __call__(self, sp: Any, original: Any, model: Any, model_inputs: dict):
        from ... import engage, forward, guard, guard_split
        from ...losses import IGNORE_INDEX
        from . import cp_dpo
        from .train import unwrapped

        inner = unwrapped(model)
        trainer = cp_dpo.trainer_of(inner)
        if trainer is not None:  # a DPO trainer's own objective (v1 would train the SFT loss)
            return cp_dpo.loss(sp, trainer, model_inputs)
        if not self.said:
            self.said = True
            info_rank0(f"[liger_fsdp] v1 sequence parallelism (Ulysses, cp_size {self.size}): each rank's per-token "
                       "log-probs from the fused kernel on its own shard, labels shifted across shards as v1's "
                       "`sequence_parallel_loss` shifts them, no [N/cp, V] logits.")
        causal_lm = engage.causal_lm_of(inner)
        labels = model_inputs["labels"]

        def run(probe):
            loss = fused_sequence_parallel_loss(sp, model, model_inputs)  # looked up when called (a test replaces it)
            if len(probe.records) != 1:
                raise RuntimeError(f"the fused CP loss made {len(probe.records)} log-probs calls, not 1")
            (rec,) = probe.records
            theirs = own_loss(sp, original, model_inputs, rec.reference)
            return loss, {"per-token log-probs": (rec.reference, rec.ours), "loss": (theirs, loss)}

        check = guard_split.Split("LLaMA-Factory's sequence_parallel_loss", run,
                                  lambda: fused_sequence_parallel_loss(sp, model, model_inputs))
        state = forward.state_of(causal_lm)

        def facts() -> dict:
            return dict(
                step=trainer_step() or (1 if state is None else state.start_step + 1 + state.steps // state.grad_accum),
                problem=guard.vocab_problem(causal_lm, model_inputs.get("input_ids"), labels, None, IGNORE_INDEX),
                labelled=bool((labels != IGNORE_INDEX).any()),
                where=f"the whole micro-batch ({labels.shape[0]} x {labels.shape[-1]}), each rank's shard of its "
                      "split forward")

        return guard_split.first_call(state, check, causal_lm, engage.engaged(causal_lm).family.model_type, facts)


def patch(model: Any) -> list:
    """Answer v1's sequence-parallel loss for ``model`` through the fused kernel (held against v1's own on the first
    step); nothing at cp_size 1."""
    size = cp_size()
    return take(model, Seam(size)) if size > 1 else []
