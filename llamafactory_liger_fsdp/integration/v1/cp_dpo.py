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

On the first training call the guard holds LLaMA-Factory's own ``DPOTrainer.compute_loss`` against it on the same
split forward (:mod:`...guard_split`): the method runs on stand-in models whose logits are the model's own head on
this call's hidden states (policy and reference, gathered across the CP group; two columns whose cross-entropy is
those log-probs and whose mean is the logits' mean), and the per-token log-probs the loss received are compared too.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from types import SimpleNamespace
from typing import Any

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

        from ... import guard_split
        from .dpo import causal_lm_in
        from .ulysses import gather_grad, shifted_targets, without_full_mask

        length = labels.shape[-1]
        split = sp.padding_and_split_data({**without_full_mask(inputs), "labels": labels},
                                          DistributedInterface().get_device_mesh(Dim.CP))
        group = sp.get_ulysses_sequence_parallel_group()
        targets = shifted_targets(split.pop("labels"), group)
        logps, sums_, vocab = guard_split.token_logps(model, causal_lm_in(model), split, targets, sums=sums, step=step)
        logps = gather_grad(logps, group)[:, :length - 1]
        if sums_ is not None:
            sums_ = gather_grad(sums_, group)[:, :length]
        return logps, sums_, vocab

    return logps_of


class _StandIn:
    """A model for LLaMA-Factory's own ``compute_loss``: returns the given logits whatever its inputs; with
    ``reference``, PEFT's ``disable_adapter()`` too (LoRA as the reference model), under which it returns those."""

    def __init__(self, logits, reference=None):
        self.logits, self.reference, self.off = logits, reference, False
        if reference is not None:
            self.disable_adapter = self._disabled

    @contextlib.contextmanager
    def _disabled(self):
        self.off = True
        try:
            yield
        finally:
            self.off = False

    def __call__(self, *args: Any, **kwargs: Any):
        return SimpleNamespace(logits=self.reference if self.off else self.logits)


def _whole(record, length: int, group):
    """(the stand-in's logits ``[B, T, 2]``, the reference log-probs ``[B, T-1]``) of a probed record, whole rows."""
    import torch.nn.functional as F

    from ... import guard_split
    from .ulysses import gather

    logps = gather(record.reference, group)[:, :length - 1]
    means = None if record.sums is None else gather(record.sums, group)[:, :length] / record.vocab
    return guard_split.two_columns(F.pad(logps, (0, 1)), means), logps


def own_loss(sp: Any, trainer: Any, batch: dict, records: list):
    """LLaMA-Factory's own ``compute_loss`` (and ``_compute_ref_logps``) on stand-in models answering the probed
    reference log-probs of the policy (the record with logit sums) and of the reference model; (loss, metrics, the
    policy's and the reference's per-token log-probs)."""
    from ... import guard_split

    cls, length = type(trainer), batch["labels"].shape[-1]
    group = sp.get_ulysses_sequence_parallel_group()
    policy = [_whole(r, length, group) for r in records if r.sums is not None]
    reference = [_whole(r, length, group) for r in records if r.sums is None]
    if len(policy) != 1 or len(reference) > 1:
        raise RuntimeError(f"the fused DPO loss made {len(policy)} policy and {len(reference)} reference log-probs "
                           "calls")
    ref_logits = reference[0][0] if reference else None
    proxy = object.__new__(cls)
    proxy.__dict__.update(trainer.__dict__)
    lora = getattr(trainer, "ref_model", None) is None and trainer._use_lora_ref
    proxy.model = _StandIn(policy[0][0], ref_logits if lora else None)
    proxy.ref_model = None if lora or ref_logits is None else _StandIn(ref_logits)
    original = getattr(cls.compute_loss, "__wrapped__", cls.compute_loss)
    original_ref = getattr(cls._compute_ref_logps, "__wrapped__", cls._compute_ref_logps)
    proxy._compute_ref_logps = original_ref.__get__(proxy)
    value = original(proxy, {**batch, "labels": guard_split.class_zero(batch["labels"])})
    return value, dict(proxy._step_metrics), policy[0][1], reference[0][1] if reference else None


def loss(sp: Any, trainer: Any, batch: dict):
    """The DPO loss of ``batch`` under CP, held against LLaMA-Factory's own on the same split forward on the first
    training call."""
    from ... import engage, forward, guard, guard_split
    from ...losses import IGNORE_INDEX
    from . import dpo

    honest = cp_logps(sp)  # looked up when called (a test replaces it)

    def run(probe):
        received = []

        def logps_of(*args: Any, **kwargs: Any):
            out = honest(*args, **kwargs)
            received.append(out)
            return out

        value = dpo.compute_loss(trainer, batch, logps_of)
        ours = (value, dict(trainer._step_metrics))
        theirs_value, theirs_metrics, policy, reference = own_loss(sp, trainer, batch, probe.records)
        pairs = dpo.compare_outputs((theirs_value, theirs_metrics), ours)
        mine = {("policy" if sums is not None else "reference"): logps for logps, sums, _ in received}
        pairs["per-token log-probs (policy)"] = (policy, mine.get("policy"))
        if reference is not None:
            pairs["per-token log-probs (reference)"] = (reference, mine.get("reference"))
        return value, pairs

    causal_lm = dpo.causal_lm_in(trainer.model)
    labels = batch["labels"]
    check = guard_split.Split("LLaMA-Factory's DPOTrainer.compute_loss", run,
                              lambda: dpo.compute_loss(trainer, batch, honest))
    def facts() -> dict:
        return dict(step=int(getattr(trainer, "global_step", 0) or 1),
                    problem=guard.vocab_problem(causal_lm, batch.get("input_ids"), labels, None, IGNORE_INDEX),
                    labelled=bool((labels != IGNORE_INDEX).any()),
                    where=f"the whole micro-batch ({labels.shape[0]} pair rows x {labels.shape[-1]}), each rank's "
                          "shard of its split forward")

    return guard_split.first_call(forward.state_of(causal_lm), check, causal_lm,
                                  engage.engaged(causal_lm).family.model_type, facts)


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
