"""The transformers patches of :mod:`.` : the Trainer's, each applied only when this run needs it.

* :func:`patch_checkpointing` -- FSDP2 adapter checkpoints as full tensors (:mod:`..checkpoint.repair`), where the
  installed accelerate loses them and ``liger_fsdp_checkpoint_repair`` is on -- whether or not the fused loss engages.
* :func:`patch_label_smoothing` -- ``Trainer.__init__`` only with ``label_smoothing_factor > 0``: the kernel smooths,
  the labels stay.

Each function returns the undo callables of what it patched (for :func:`...engage.disengage`).
"""

from __future__ import annotations

from typing import Any, Callable

from .. import _patch
from .._log import info_rank0
from ..checkpoint import repair


def _undo(patch: _patch.Patch | None) -> list[Callable[[], None]]:
    return [] if patch is None else [lambda: _patch.undo(patch.owner, patch.name)]


def patch_checkpointing(cfg: Any) -> list[Callable[[], None]]:
    if not repair.needed():
        return []  # accelerate >= 1.15 saves and loads FSDP2 adapters correctly
    if not cfg.checkpoint_repair:
        info_rank0("[liger_fsdp] liger_fsdp_checkpoint_repair: false -- FSDP2 adapter checkpoints are saved as this "
                   f"accelerate (< {repair.FIXED_IN}) ships them: rank 0's shards only, not resumable on other ranks.")
        return []
    try:
        import transformers.trainer as trainer_module
    except ImportError:  # pragma: no cover
        return []
    undo = []
    try:
        for name, make in (("save_fsdp_model", repair.make_save), ("load_fsdp_model", repair.make_load)):
            fn = getattr(trainer_module, name, None)
            if fn is None:
                raise _patch.PatchError(f"transformers.trainer.{name} not found")
            _patch.require_params(fn, ("fsdp_plugin", "accelerator", "model", "adapter_only"), f"transformers.trainer.{name}")
            undo += _undo(_patch.apply(trainer_module, name, make,
                                       "FSDP2 adapter checkpoints hold full tensors and resume on every rank"))
    except _patch.PatchError as exc:
        info_rank0(f"[liger_fsdp] warning: {exc}; FSDP2 adapter checkpoints are saved and loaded as accelerate ships them.")
    return undo


def patch_label_smoothing() -> list[Callable[[], None]]:
    """``transformers.Trainer.__init__`` -- with ``label_smoothing_factor > 0`` the Trainer pops the labels
    and smooths the full logits itself (``LabelSmoother``); for an engaged causal LM the fused kernel computes the
    same smoothed loss instead (the labels stay with the model, the Trainer's smoother is switched off for it).
    Only for the classes the Trainer itself smooths with ``shift_labels=True`` (its causal-LM mapping); any other
    model keeps the Trainer's own smoothing (the forward says once that the fused path is bypassed). Where another
    package wrapped ``Trainer.__init__`` so that its parameters cannot be checked, the Trainer smooths (said once)."""
    import transformers.trainer as trainer_module

    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            _take_over_label_smoothing(self)

        return __init__

    try:
        _patch.require_params(trainer_module.Trainer.__init__, ("self", "model", "args"), "Trainer.__init__")
    except _patch.PatchError as exc:
        info_rank0(f"[liger_fsdp] label_smoothing_factor: {exc}; the Trainer smooths the full logits itself (the run "
                   "trains correctly, without the fused loss's memory saving).")
        return []
    return _undo(_patch.apply(trainer_module.Trainer, "__init__", make,
                              "label_smoothing_factor: the fused kernel smooths the loss"))


def _take_over_label_smoothing(trainer: Any) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from .. import engage

    eps = float(getattr(trainer.args, "label_smoothing_factor", 0) or 0)
    model = getattr(trainer, "model", None)
    if not eps or model is None or getattr(trainer, "label_smoother", None) is None:
        return
    causal_lm = engage.causal_lm_of(model)
    forward = causal_lm.__dict__.get("forward")
    done = engage.engaged(causal_lm)
    if done is None or not hasattr(forward, "liger_fsdp_state"):
        return
    # the class was checked by identity at engage (families.model_class); its name is transformers' own
    if done.family.cls not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return  # the Trainer smooths these without shifting the labels; the bypass line says so
    forward.liger_fsdp_state.label_smoothing = eps
    trainer.label_smoother = None
    info_rank0(f"[liger_fsdp] label_smoothing_factor {eps}: the fused kernel computes the smoothed loss (the Trainer's "
               "LabelSmoother, shift_labels=True) without the logits.")
