"""v1's reward-model trainer (``llamafactory-cli rm``) under Ulysses sequence parallelism (``cp_size > 1``), patched
by :func:`.engine.engage_v1` for a score-head model in an RM run, recorded on the model and undone with it:

* ``llamafactory.v1.trainers.rm_trainer.RMTrainer.__init__`` -- LLaMA-Factory refuses cp_size > 1 there; for a
  model taken here it runs as written without that one statement (:mod:`.cp_init`).
* the registered ``sequence_parallel_loss`` (:func:`.ulysses.slot`) -- under CP v1's trainer calls it instead of
  ``compute_loss``, which would train the SFT loss. Answered by :func:`cp_loss`: ``RMTrainer.compute_loss``'s own
  model inputs (recorded from the method: token_type_ids as attention mask, positions restarting at the rejected
  part, of the whole row), v1's padding and split, each rank's scores of its shard, gathered across the CP group with
  autograd (every rank holds the full loss; the gather's backward sums the copies, as in v1's own CP loss), then
  ``RMTrainer.compute_loss`` itself on the gathered scores. The attention is what ``flash_attention_2`` gives the
  same micro-batch at cp_size 1: a micro-batch without padding gets no attention mask (transformers drops an
  all-nonzero one), so the positions decide -- flash-attention's varlen segments (chosen, rejected) for one row,
  causal over each row for more; with padding, causal over each row's tokens (token_type_ids is a padding mask to
  transformers, not a document mask). v1's own padding to a multiple of cp_size must not change that: git main's
  Ulysses attention takes the mask path as soon as one shard has a padded position.

On the first training call (``liger_fsdp_guard``) the scores of that very split forward are gathered apart from the
loss (no autograd) and ``RMTrainer.compute_loss`` runs on them, held against :func:`cp_loss` on every rank together
(:mod:`...guard_split`): no unsplit side, so any micro-batch length is checked. Each run's guard state is its
:class:`Seam`, on the model.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

from ... import _patch
from ..._log import info_rank0
from . import ulysses
from .cp_args import RM_MODULE
from .train import Captured, Recorder

FIX = ("Fix: set `cp_size: 1` (`dist_config.cp_size` on LLaMA-Factory 0.9.5) and remove `liger_fsdp` from "
       "`kernel_config.name`, and report this line with your LLaMA-Factory version")


def rm_run() -> bool:
    """Whether this process runs v1's RM trainer (``llamafactory-cli rm`` imports its module before the model)."""
    return hasattr(sys.modules.get(RM_MODULE), "RMTrainer")


def _model_inputs(cls: type, batch: dict, device) -> dict:
    recorder = Recorder()
    try:
        cls.compute_loss(SimpleNamespace(device=device, model=recorder), batch)
    except Captured:
        pass
    if not recorder.kwargs or "input_ids" not in recorder.kwargs:
        raise _patch.PatchError("v1's RMTrainer.compute_loss no longer calls model(input_ids=..., ...)")
    return recorder.kwargs


def cp_loss(sp: Any, cls: type, model: Any, batch: dict, keep: list | None = None):
    """``RMTrainer.compute_loss`` of ``batch`` with each rank scoring its own shard of every row (``keep``: gets
    this rank's scores of its shard and the gathered scores the loss read)."""
    import torch
    from llamafactory.v1.accelerator.interface import Dim, DistributedInterface

    interface = DistributedInterface()
    device = interface.current_device
    kwargs = _model_inputs(cls, batch, device)
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    length = tensors["input_ids"].shape[-1]
    split = sp.padding_and_split_data(ulysses.without_full_mask(tensors), interface.get_device_mesh(Dim.CP))
    outputs = model(**split, **{k: v for k, v in kwargs.items() if k not in tensors})
    scores = ulysses.gather_grad(outputs.logits, sp.get_ulysses_sequence_parallel_group())[:, :length]
    if keep is not None:
        keep += [outputs.logits, scores]
    gathered = SimpleNamespace(logits=scores)
    return cls.compute_loss(SimpleNamespace(device=device, model=lambda *a, **k: gathered), batch)


def taken(model: Any) -> bool:
    """Whether ``model``'s loss under CP is answered here (this run's :class:`Seam` is on it)."""
    return isinstance(ulysses.seam_of(model), Seam)


class Seam:
    """The CP loss of one score-head model in one run; ``guard``: the first-step check is still to run."""

    def __init__(self, cls: type, guard: bool):
        self.cls, self.guard = cls, guard

    def __call__(self, sp: Any, original: Any, model: Any, model_inputs: dict):
        import torch
        from llamafactory.v1.accelerator.interface import DistributedInterface

        from ... import guard, guard_split

        cls, device = self.cls, DistributedInterface().current_device

        def run(probe):
            kept: list = []
            value = cp_loss(sp, cls, model, model_inputs, keep=kept)  # looked up when called (a test replaces it)
            shard, received = kept
            scores = ulysses.gather(shard.detach(), sp.get_ulysses_sequence_parallel_group())[:, :received.shape[1]]
            gathered = SimpleNamespace(logits=scores)
            theirs = cls.compute_loss(SimpleNamespace(device=device, model=lambda *a, **k: gathered),
                                      dict(model_inputs))
            return value, {"loss": (theirs, value), "scores": (scores, received)}

        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        check = guard_split.Split("LLaMA-Factory's RMTrainer.compute_loss", run,
                                  lambda: cp_loss(sp, cls, model, model_inputs), dtype=dtype,
                                  precision="the scores of the same split forward, gathered apart from the loss",
                                  fix=FIX, said_as="with the scores the plugin gathered")
        ids = model_inputs["input_ids"]

        def facts() -> dict:
            return dict(step=ulysses.trainer_step() or 1, problem=guard.vocab_problem(model, ids, None, None, -100),
                        labelled=True, where=f"the whole micro-batch ({ids.shape[0]} pair rows x {ids.shape[-1]}), "
                                             "each rank's shard of its split forward")

        return guard_split.first_call(self, check, model, getattr(model.config, "model_type", type(model).__name__),
                                      facts)


def patch(model: Any, cfg: Any) -> list:
    """Take v1's RM trainer under CP for ``model``: its refusal lifted, its loss answered at the CP seam."""
    from . import cp_init

    size = ulysses.cp_size()
    rm = sys.modules[RM_MODULE]
    cls = rm.RMTrainer
    _patch.require_params(cls.compute_loss, ("self", "batch"), "RMTrainer.compute_loss")
    undo = ulysses.take(model, Seam(cls, bool(getattr(cfg, "guard", True))))

    def built(trainer: Any, model: Any) -> None:
        info_rank0(f"[liger_fsdp] v1 reward modelling under sequence parallelism (Ulysses, cp_size {size}): "
                   "LLaMA-Factory's RMTrainer refuses cp_size > 1; with `liger_fsdp` each rank scores its "
                   f"1/{size} of every pair row (the row's own positions), the scores are gathered across the CP "
                   "group with autograd and RMTrainer.compute_loss runs on them (nothing to fuse: a one-logit "
                   "score head).")

    undo += cp_init.patch(cls, taken, built, "v1 RM under CP: RMTrainer.__init__ without its cp_size refusal for a "
                                             "model whose loss the plugin answers")
    return undo
