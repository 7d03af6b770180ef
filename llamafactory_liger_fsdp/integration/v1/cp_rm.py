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

On the first training call ``RMTrainer.compute_loss`` at cp_size 1 (LLaMA-Factory's Ulysses attention switched off,
the whole micro-batch on every rank) is held against :func:`cp_loss` (``liger_fsdp_guard``).
"""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace
from typing import Any

from ... import _patch
from ..._log import info_rank0, rank
from ...config import LigerFsdpConfigError
from . import ulysses
from .cp_args import RM_MODULE
from .train import Captured, Recorder

TAKEN = "_liger_fsdp_cp_rm"  # on the model's inner module: this model's RM loss is answered here
UNSPLIT_TOKENS = 1 << 16  # the guard's cp_size-1 side runs the whole micro-batch on every rank: at most this many


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


def cp_loss(sp: Any, cls: type, model: Any, batch: dict):
    """``RMTrainer.compute_loss`` of ``batch`` with each rank scoring its own shard of every row."""
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
    gathered = SimpleNamespace(logits=scores)
    return cls.compute_loss(SimpleNamespace(device=device, model=lambda *a, **k: gathered), batch)


def _stop(what: str, text: str) -> LigerFsdpConfigError:
    return LigerFsdpConfigError(
        f"`liger_fsdp_guard`: on the first step {what}, rank {rank()}: {text}. Training would optimise another "
        "objective than LLaMA-Factory's RM trainer at cp_size 1. Fix: set `cp_size: 1` (`dist_config.cp_size` on "
        "LLaMA-Factory 0.9.5) and remove `liger_fsdp` from `kernel_config.name`, and report this line with your "
        "LLaMA-Factory version (`liger_fsdp_guard: false` skips the check).")


def hold(sp: Any, cls: type, model: Any, batch: dict) -> None:
    """``RMTrainer.compute_loss`` at cp_size 1 against :func:`cp_loss` on the same micro-batch (every rank)."""
    import torch

    from ... import guard

    what = "LLaMA-Factory's RMTrainer.compute_loss at cp_size 1"
    tokens = int(batch["input_ids"].numel())
    if tokens > UNSPLIT_TOKENS:
        guard.unchecked(1, what, f"its micro-batch of {tokens} tokens is too long to run unsplit on one rank (at most "
                                 f"{UNSPLIT_TOKENS})")  # stops the run where installed versions are untested
        return
    device = next(model.parameters()).device
    rng = guard.Rng()
    with torch.no_grad():
        with ulysses.ulysses_off(sp) as found:
            if not found:
                raise _stop(f"{what} could not run", "LLaMA-Factory's Ulysses attention patch was not found in "
                                                     "transformers' modules, so the unsplit side cannot be computed")
            theirs = cls.compute_loss(SimpleNamespace(device=device, model=model), dict(batch))
        rng.restore()
        ours = cp_loss(sp, cls, model, dict(batch))
        rng.restore()
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    rtol, atol = guard.bounds(dtype)
    bad, _, a, f = guard.worst_element({"loss": (theirs, ours)}, rtol, atol)
    (mismatch,) = guard.all_max([float(bad)], device)
    text = f"{what}: loss {a:.7g}, with the scores gathered across the CP group {f:.7g} (|diff| {abs(f - a):.3g}, " \
           f"bound {rtol * abs(a) + atol:.3g})"
    if mismatch:
        raise _stop("the plugin's sequence-parallel RM loss does not give what LLaMA-Factory's own gives",
                    text if bad else f"this rank agreed ({text}); another rank did not (see its error)")
    info_rank0(f"[liger_fsdp] guard: step 1 exact: {text}.")


def patch(model: Any, cfg: Any) -> list:
    """Take v1's RM trainer under CP for ``model``: its refusal lifted, its loss answered at the CP seam."""
    import torch

    from ... import engage
    from . import cp_init
    from .train import unwrapped

    size = ulysses.cp_size()
    rm = sys.modules[RM_MODULE]
    cls = rm.RMTrainer
    _patch.require_params(cls.compute_loss, ("self", "batch"), "RMTrainer.compute_loss")
    sp = importlib.import_module(ulysses.SP_MODULE)
    mapping, key, where = ulysses.slot(sp)
    inner = engage.causal_lm_of(unwrapped(model))
    inner.__dict__[TAKEN] = True
    undo = [lambda: inner.__dict__.pop(TAKEN, None)]
    state = {"guard": bool(getattr(cfg, "guard", True))}

    def taken(m: Any) -> bool:
        return bool(engage.causal_lm_of(unwrapped(m)).__dict__.get(TAKEN))

    def built(trainer: Any, model: Any) -> None:
        info_rank0(f"[liger_fsdp] v1 reward modelling under sequence parallelism (Ulysses, cp_size {size}): "
                   "LLaMA-Factory's RMTrainer refuses cp_size > 1; with `liger_fsdp` each rank scores its "
                   f"1/{size} of every pair row (the row's own positions), the scores are gathered across the CP "
                   "group with autograd and RMTrainer.compute_loss runs on them (nothing to fuse: a one-logit "
                   "score head).")

    undo += cp_init.patch(cls, taken, built, "v1 RM under CP: RMTrainer.__init__ without its cp_size refusal for a "
                                             "model whose loss the plugin answers")
    original = mapping[key]
    if getattr(original, _patch.MARK, False):
        return undo

    def sequence_parallel_loss(model: Any, model_inputs: dict):
        if not taken(model):
            return original(model, model_inputs)
        if state["guard"] and model.training and torch.is_grad_enabled():
            state["guard"] = False
            hold(sp, cls, model, model_inputs)
        return cp_loss(sp, cls, model, model_inputs)  # looked up when called (a test replaces it)

    setattr(sequence_parallel_loss, _patch.MARK, True)
    _patch.put(mapping, key, sequence_parallel_loss, "v1 RM under CP: RMTrainer.compute_loss on scores gathered "
               "across the CP group", where)
    undo.append(lambda: _patch.undo(mapping, key))
    return undo
