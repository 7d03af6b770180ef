"""Head kinds: one small strategy class per way the output embedding is trained.

* :class:`.linear.LinearHead` -- one plain Linear weight: PEFT ``modules_to_save`` copy, or full fine-tuning.
* :class:`.lora.LoraHead` -- PEFT LoRA on the head (base weight + exact LoRA delta).

:func:`detect` recognises the kind by type (``isinstance`` against PEFT's classes). A new kind is one
new module with a ``detect`` function and a :class:`.base.Head` subclass, added to ``_KINDS``.
"""

from __future__ import annotations

from torch import nn

from ..config import LigerFsdpConfigError
from . import linear, lora
from .base import Head

_KINDS = (lora.detect, linear.detect)


def _path_of(root: nn.Module, target: nn.Module) -> str:
    for name, module in root.named_modules():
        if module is target:
            return name
    raise LigerFsdpConfigError("`liger_fsdp: true`: the output embedding is not a submodule of the model. "
                               "Fix: remove `liger_fsdp`.")


def detect(causal_lm: nn.Module, trained_only: bool = True) -> Head | str:
    """The head's strategy, or a string saying why nothing needs doing (a frozen head; with ``trained_only``
    False -- preference stages, which need log-probs from any head -- a ``frozen`` strategy instead).

    Raises :class:`LigerFsdpConfigError` for heads the fused loss cannot reproduce exactly."""
    head = causal_lm.get_output_embeddings()
    if head is None:
        raise LigerFsdpConfigError(
            f"`liger_fsdp: true`: {type(causal_lm).__name__} has no output embedding (lm_head). Fix: remove `liger_fsdp`."
        )
    path = _path_of(causal_lm, head)
    for kind in _KINDS:
        found = kind(causal_lm, head, path, trained_only)
        if found is not None:
            return found
    raise LigerFsdpConfigError(
        f"`liger_fsdp: true` does not know the head module {type(head).__name__} (quantized or from another tuner). "
        "Supported: nn.Linear (full fine-tuning), PEFT modules_to_save (`additional_target: lm_head`), plain LoRA. "
        "Fix: remove `liger_fsdp` for this run."
    )


__all__ = ["Head", "detect"]
