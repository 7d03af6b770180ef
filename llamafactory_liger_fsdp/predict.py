"""What the plugin will decide for a parsed yaml, without weights: the same code as training.

:func:`decide` reads the model's config once, as training reads it
(:func:`.integration.common.read_model_config`), builds the model on the ``meta`` device, lets
LLaMA-Factory's own ``init_adapter`` turn it into the PEFT model training would build, and runs the training-time
checks on it (family and its class, quirks, loss function, head kind: :func:`..engage.engage` minus the
forward). A 70B model costs nothing on ``meta``; no GPU is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import LigerFsdpConfigError


@dataclass
class Decision:
    family: str | None = None
    model_class: str | None = None  # the class LLaMA-Factory builds for it
    quirks: list[str] = field(default_factory=list)
    head: str | None = None  # head.describe(), when it will engage
    not_engaged: str | None = None  # why the plain loss has nothing to fix
    error: str | None = None  # a refusal: training would stop with this text
    note: str | None = None  # what could not be evaluated here


def build_meta_model(model_config: Any, model_args: Any, finetuning_args: Any):
    """The (PEFT) causal LM of this yaml on the meta device, as LLaMA-Factory's loader would set it up."""
    import torch
    from llamafactory.model.adapter import init_adapter
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    trust = bool(getattr(model_args, "trust_remote_code", False))
    # LLaMA-Factory's loader: image-text models through AutoModelForImageTextToText, the rest as causal LMs
    auto = AutoModelForImageTextToText if type(model_config) in AutoModelForImageTextToText._model_mapping else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(model_config, trust_remote_code=trust)
    return init_adapter(model_config, model, model_args, finetuning_args, is_trainable=True)


def head_from_yaml(finetuning_args: Any) -> str:
    """The head kind the yaml alone trains (``head=...``), or why the head is frozen: what ``doctor`` can say
    without the model's config (an offline hub id). The output embedding is named as users name it in LLaMA-Factory
    (``lm_head``, ``embed_out``)."""
    from .refusals import PREFERENCE_STAGES, head_targets

    kind = getattr(finetuning_args, "finetuning_type", "lora")
    for key, what in (("additional_target", "modules_to_save"), ("lora_target", "lora")):
        named = head_targets(getattr(finetuning_args, key, None))
        if kind == "lora" and named:
            return f"head={what} ({named[0]}; `{key}`)"
    if kind == "full":
        return "head=full (lm_head; full fine-tuning)"
    if kind == "freeze" and head_targets(getattr(finetuning_args, "freeze_extra_modules", None)):
        return "head=full (lm_head; `freeze_extra_modules`)"
    if getattr(finetuning_args, "stage", "sft") in PREFERENCE_STAGES:
        return "head=frozen (lm_head; the preference log-probs still come from the fused kernel)"
    return "the yaml trains no lm_head (not in `additional_target` or `lora_target`, no full fine-tuning)"


def decide(model_args: Any, finetuning_args: Any) -> Decision:
    from . import families, heads
    from .engage import causal_lm_of, check_model
    from .integration.common import read_model_config

    out = Decision()
    try:
        model_config = read_model_config(model_args)
    except Exception as exc:  # offline hub id, missing file
        out.note = (f"could not read the model's config here ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); "
                    "its family, class and quirks are checked at load time")
        head = head_from_yaml(finetuning_args)
        if head.startswith("head="):
            out.head = head
        else:
            out.not_engaged = head
        return out
    out.family = getattr(model_config, "model_type", None)
    try:
        family = families.family_of(out.family, model_config)
        out.quirks = families.describe(family, model_config)
        model = build_meta_model(model_config, model_args, finetuning_args)
        causal_lm = causal_lm_of(model)
        out.model_class = type(causal_lm).__name__
        check_model(causal_lm)
        head = heads.detect(causal_lm)
    except LigerFsdpConfigError as exc:
        out.error = str(exc)
        return out
    except Exception as exc:  # e.g. quantization that cannot be set up on meta
        out.note = f"could not build the model on the meta device ({type(exc).__name__}: {exc}); the head is checked at load time"
        return out
    if isinstance(head, str):
        out.not_engaged = head
    else:
        out.head = head.describe()
    return out
