"""Settings that cannot work with ``liger_fsdp: true``, decided from the arguments alone.

One function, :func:`check`, one text per refusal, each naming the key and the fix. It runs twice on
the same rules: in the launching process before any rank starts (on the raw yaml/CLI arguments,
:func:`check_raw`) and in every rank right after LLaMA-Factory parsed them (:func:`check_parsed`),
so a run started any other way is refused with the same text. Refusals that need the model (family,
head kind) live next to the code that inspects it.
"""

from __future__ import annotations

from typing import Any, Callable

from .config import LigerFsdpConfigError

#: Preference stages: per-token log-probs through the fused kernel (:mod:`.preference`).
PREFERENCE_STAGES = ("dpo", "kto")
#: Stages the plugin computes: the causal-LM loss, and the preference stages' log-probs.
SUPPORTED_STAGES = ("sft", "pt", *PREFERENCE_STAGES)
_STAGE_WHY = {
    "rm": "it trains a value head (one scalar per sequence from `v_head`), not lm_head, so there is no vocabulary "
          "loss to fuse",
    "ppo": "it samples with generate() and scores with a reward model's value head; rollouts need the full "
           "logits of the sampled tokens",
}
_LOGIT_LOSSES = ("use_dft_loss", "use_eaft_loss", "use_asft_loss")
_REPLACED = {
    "use_unsloth": "unsloth replaces the model's forward and loss",
    "use_mca": "Megatron-Core (mcore_adapter) builds its own model and loss, so there is no Hugging Face head to fuse",
    "use_kt": "KTransformers replaces the model's modules and forward",
}


def _flag(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def check(get: Callable[[str, Any], Any], sharding: Any = None) -> None:
    """Raise :class:`LigerFsdpConfigError` for the first setting that cannot work with the flag on.

    ``sharding`` (the decided :class:`.sharding.Sharding`) is there for rules that depend on it; every sharding
    the plugin knows (none, DDP, FSDP1/2, DeepSpeed ZeRO-0..3) is supported today."""
    stage = str(get("stage", "sft"))
    if stage not in SUPPORTED_STAGES:
        why = _STAGE_WHY.get(stage, "its loss is not the plain causal-LM loss")
        raise LigerFsdpConfigError(
            f"`liger_fsdp: true` does not work with `stage: {stage}`: {why}. Supported stages: "
            f"{', '.join(SUPPORTED_STAGES)}. Fix: remove `liger_fsdp` (or set it to false) for `stage: {stage}`."
        )
    for key in _LOGIT_LOSSES:
        if _flag(get(key, False)):
            raise LigerFsdpConfigError(
                f"`liger_fsdp: true` does not work with `{key}: true`: that loss reads the logits, which the fused "
                f"loss never builds. Fix: set `{key}: false` or remove `liger_fsdp`."
            )
    for key, why in _REPLACED.items():
        if _flag(get(key, False)):
            raise LigerFsdpConfigError(
                f"`liger_fsdp: true` does not work with `{key}: true`: {why}. Fix: set `{key}: false` or remove "
                "`liger_fsdp`."
            )


def _argv_to_dict(argv: list) -> dict[str, Any]:
    out: dict[str, Any] = {}
    items = [a for a in argv if isinstance(a, str)]
    for i, item in enumerate(items):
        if item.startswith("--"):
            key, eq, value = item[2:].partition("=")
            if not eq:
                nxt = items[i + 1] if i + 1 < len(items) else None
                value = nxt if isinstance(nxt, str) and not nxt.startswith("--") else "true"
            out[key] = value
    return out


def check_raw(args: Any, sharding: Any = None) -> None:
    """:func:`check` on LLaMA-Factory's raw arguments (dict from yaml/json, or an argv list)."""
    values = args if isinstance(args, dict) else _argv_to_dict(list(args or []))
    check(lambda key, default: values.get(key, default), sharding)


def check_parsed(parsed: dict[str, Any], sharding: Any = None) -> None:
    """:func:`check` on LLaMA-Factory's parsed dataclasses (``thirdparty.parsed_args``)."""
    order = [parsed[r] for r in ("finetuning", "model", "training", "data") if r in parsed]

    def get(key: str, default: Any) -> Any:
        for obj in order:
            if hasattr(obj, key):
                return getattr(obj, key)
        return default

    check(get, sharding)
