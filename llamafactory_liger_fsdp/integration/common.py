"""What the default engine's and v1's integrations share: the model's config read as LLaMA-Factory reads it, the
DeepSpeed ZeRO-3 dtype cast, and the keys of the lines said once per run."""

from __future__ import annotations

import sys
from typing import Any

from .._log import error_text, info_rank0

#: Keys of the lines said once per run (:func:`.._log.say_once`).
SAID_DISABLED, SAID_VERSIONS, SAID_NO_EFFECT = "disabled", "versions", "no_effect"


def read_model_config(model_args: Any):
    """The model's config (no weights), read as LLaMA-Factory's loader reads it: training's family check and
    ``doctor``'s dry run (:mod:`..predict`) read it here, once each."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(
        model_args.model_name_or_path, trust_remote_code=bool(getattr(model_args, "trust_remote_code", False)),
        cache_dir=getattr(model_args, "cache_dir", None), revision=getattr(model_args, "model_revision", "main"),
    )


def zero3_dtypes(model: Any) -> list:
    """DeepSpeed ZeRO-3 (both engines): trainable parameters in the compute dtype when their dtypes are mixed
    (:mod:`..precision`), said once; the undo callables."""
    from .. import precision

    cast, undo = precision.to_compute_dtype(model)
    if not cast:
        return []
    info_rank0(f"[liger_fsdp] DeepSpeed ZeRO-3: trainable parameters in the compute dtype, as DeepSpeed casts them "
               f"itself under ZeRO-0/1/2 (its optimizer keeps fp32 master weights; ZeRO-3's cannot take mixed dtypes): "
               f"{cast}.")
    return [undo]


def refused(exc: Exception) -> None:
    """A launching process's end on a refusal (either engine's launcher, ``accelerate launch``): the message, once
    and last (wrapped in LlamaBoard's web UI mode: :func:`.._log.error_text`); exit 1."""
    print(error_text(exc), file=sys.stderr, flush=True)
    sys.exit(1)
