"""Patch 6 of :mod:`.` : FSDP2 adapter checkpoints as full tensors (:mod:`..checkpoint.repair`), applied
only where the installed accelerate loses them and ``liger_fsdp_checkpoint_repair`` is on."""

from __future__ import annotations

from typing import Any

from .. import _patch
from .._log import info_rank0
from ..checkpoint import repair


def patch_checkpointing(cfg: Any) -> None:
    if not repair.needed():
        return  # accelerate >= 1.15 saves and loads FSDP2 adapters correctly
    if not cfg.checkpoint_repair:
        info_rank0("[liger_fsdp] liger_fsdp_checkpoint_repair: false -- FSDP2 adapter checkpoints are saved as this "
                   f"accelerate (< {repair.FIXED_IN}) ships them: rank 0's shards only, not resumable on other ranks.")
        return
    try:
        import transformers.trainer as trainer_module
    except ImportError:  # pragma: no cover
        return
    try:
        for name, make in (("save_fsdp_model", repair.make_save), ("load_fsdp_model", repair.make_load)):
            fn = getattr(trainer_module, name, None)
            if fn is None:
                raise _patch.PatchError(f"transformers.trainer.{name} not found")
            _patch.require_params(fn, ("fsdp_plugin", "accelerator", "model", "adapter_only"), f"transformers.trainer.{name}")
            _patch.apply(trainer_module, name, make, "FSDP2 adapter checkpoints hold full tensors and resume on every rank")
    except _patch.PatchError as exc:
        info_rank0(f"[liger_fsdp] warning: {exc}; FSDP2 adapter checkpoints are saved and loaded as accelerate ships them.")


def patch_label_smoothing() -> None:
    """Patch 9: ``transformers.Trainer.__init__`` -- with ``label_smoothing_factor > 0`` the Trainer pops the labels
    and smooths the full logits itself (``LabelSmoother``); for an engaged causal LM the fused kernel computes the
    same smoothed loss instead (the labels stay with the model, the Trainer's smoother is switched off for it).
    Only for the classes the Trainer itself smooths with ``shift_labels=True`` (its causal-LM mapping); any other
    model keeps the Trainer's own smoothing (the forward says once that the fused path is bypassed)."""
    import transformers.trainer as trainer_module

    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            _take_over_label_smoothing(self)

        return __init__

    _patch.require_params(trainer_module.Trainer.__init__, ("self", "model", "args"), "Trainer.__init__")
    _patch.apply(trainer_module.Trainer, "__init__", make, "label_smoothing_factor: the fused kernel smooths the loss")


def _take_over_label_smoothing(trainer: Any) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from .. import engage

    eps = float(getattr(trainer.args, "label_smoothing_factor", 0) or 0)
    model = getattr(trainer, "model", None)
    if not eps or model is None or getattr(trainer, "label_smoother", None) is None:
        return
    causal_lm = engage.causal_lm_of(model)
    forward = causal_lm.__dict__.get("forward")
    if engage.engaged(causal_lm) is None or not hasattr(forward, "liger_fsdp_state"):
        return
    if type(causal_lm).__name__ not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return  # the Trainer smooths these without shifting the labels; the bypass line says so
    forward.liger_fsdp_state.label_smoothing = eps
    trainer.label_smoother = None
    info_rank0(f"[liger_fsdp] label_smoothing_factor {eps}: the fused kernel computes the smoothed loss (the Trainer's "
               "LabelSmoother, shift_labels=True) without the logits.")
