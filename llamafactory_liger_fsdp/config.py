"""The ``liger_fsdp`` keys of a LLaMA-Factory yaml: parsing, validation and every error text.

LLaMA-Factory rejects unknown keys (``Some keys are not used by the HfArgumentParser``). The
integration takes our keys out of the arguments *before* LLaMA-Factory's parser sees them
(:func:`extract`), validates them here, and hangs the resulting :class:`LigerFsdpConfig` on the
parsed ``FinetuningArguments`` as ``liger_fsdp_config``. Every other unknown key is still
rejected by LLaMA-Factory.

All user-facing errors are :class:`LigerFsdpConfigError` (a ``ValueError``) and each names the
key and the fix. This module imports no torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

#: The keys this plugin adds to LLaMA-Factory's arguments, with their help text.
KEYS = {
    "liger_fsdp": "true/false: compute the causal-LM loss with the FSDP-safe fused linear cross-entropy.",
    "liger_fsdp_backend": "auto/triton_fast/triton/torch: kernel of the fused loss. auto = triton_fast on CUDA "
    "(gradients in forward: faster than the unfused loss, ~3.6 GiB working memory at 16k x 128k), torch elsewhere; "
    "triton = lean (~0.3 GiB, gradients recomputed in backward, ~35% slower than triton_fast).",
}
BACKENDS = ("auto", "triton", "triton_fast", "torch")
#: Stages whose loss is the plain causal-LM loss; every other stage needs the full logits.
SUPPORTED_STAGES = ("sft", "pt")
ATTR = "liger_fsdp_config"


class LigerFsdpConfigError(ValueError):
    """A configuration that cannot work with ``liger_fsdp: true``; the message says how to fix it."""


@dataclass(frozen=True)
class LigerFsdpConfig:
    """The validated ``liger_fsdp*`` keys of one run."""

    enabled: bool = False
    backend: str = "auto"

    @property
    def kernel_backend(self) -> str:
        """What the plugin passes as ``backend=`` (``"auto"`` is resolved per device in :mod:`.head`)."""
        return self.backend


def _parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise LigerFsdpConfigError(
        f"`{key}` must be true or false, got {value!r} ({type(value).__name__}). "
        f"Fix: write `{key}: true` (or `false`) in the yaml, or `{key}=true` on the command line."
    )


def _parse_backend(key: str, value: Any) -> str:
    if isinstance(value, str) and value.strip().lower() in BACKENDS:
        return value.strip().lower()
    raise LigerFsdpConfigError(
        f"`{key}` must be one of {', '.join(BACKENDS)}, got {value!r} ({type(value).__name__}). "
        f"Fix: write `{key}: auto` (triton on CUDA, torch on CPU) or remove the key."
    )


def from_mapping(values: dict[str, Any]) -> LigerFsdpConfig:
    """Build and validate a config from ``{key: value}`` taken out of the user's arguments."""
    unknown = sorted(k for k in values if k not in KEYS)
    if unknown:
        raise LigerFsdpConfigError(
            f"Unknown key(s) {', '.join('`' + k + '`' for k in unknown)}. "
            f"The liger_fsdp plugin knows: {', '.join('`' + k + '`' for k in KEYS)}. Fix: correct the spelling or remove them."
        )
    enabled = _parse_bool("liger_fsdp", values["liger_fsdp"]) if "liger_fsdp" in values else False
    backend = _parse_backend("liger_fsdp_backend", values["liger_fsdp_backend"]) if "liger_fsdp_backend" in values else "auto"
    if backend != "auto" and not enabled and "liger_fsdp" not in values:
        raise LigerFsdpConfigError(
            "`liger_fsdp_backend` is set but `liger_fsdp` is not. Fix: add `liger_fsdp: true` or remove `liger_fsdp_backend`."
        )
    return LigerFsdpConfig(enabled=enabled, backend=backend)


def extract(args: Any) -> tuple[Any, LigerFsdpConfig]:
    """Take our keys out of LLaMA-Factory's raw arguments (a dict from yaml/json, or an argv list).

    Returns the arguments without our keys and the validated config.
    """
    if isinstance(args, dict):
        ours = {k: args[k] for k in args if isinstance(k, str) and k.startswith("liger_fsdp")}
        rest = {k: v for k, v in args.items() if k not in ours}
        return rest, from_mapping(ours)
    if isinstance(args, (list, tuple)):
        ours: dict[str, Any] = {}
        rest: list[str] = []
        items = list(args)
        i = 0
        while i < len(items):
            item = items[i]
            if isinstance(item, str) and item.startswith("--liger_fsdp"):
                key, eq, value = item[2:].partition("=")
                if not eq:
                    nxt = items[i + 1] if i + 1 < len(items) else None
                    if isinstance(nxt, str) and not nxt.startswith("--"):
                        value, i = nxt, i + 1
                    elif key == "liger_fsdp":
                        value = "true"  # bare flag, as HfArgumentParser treats booleans
                    else:
                        raise LigerFsdpConfigError(f"`--{key}` needs a value. Fix: write `--{key} <value>`.")
                ours[key] = value
            else:
                rest.append(item)
            i += 1
        return rest, from_mapping(ours)
    return args, LigerFsdpConfig()


def get_config(finetuning_args: Any) -> LigerFsdpConfig:
    """The config hung on LLaMA-Factory's ``FinetuningArguments`` by the integration (default: off)."""
    return getattr(finetuning_args, ATTR, None) or LigerFsdpConfig()


def _deepspeed_zero_stage(training_args: Any) -> int | None:
    ds = getattr(training_args, "deepspeed", None)
    stage = None
    if isinstance(ds, str) and ds:
        try:
            with open(ds, encoding="utf-8") as f:
                ds = json.load(f)
        except (OSError, ValueError):
            ds = None
    if isinstance(ds, dict):
        stage = (ds.get("zero_optimization") or {}).get("stage")
    if stage is None and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    try:
        return int(stage) if stage is not None else None
    except (TypeError, ValueError):
        return None


def check_training_args(cfg: LigerFsdpConfig, model_args: Any, training_args: Any, finetuning_args: Any) -> None:
    """Refuse settings that cannot work with ``liger_fsdp: true`` (called right after parsing)."""
    if not cfg.enabled:
        return
    stage = getattr(finetuning_args, "stage", "sft")
    if stage not in SUPPORTED_STAGES:
        raise LigerFsdpConfigError(
            f"`liger_fsdp: true` does not work with `stage: {stage}`: that stage needs the full logits, which the fused "
            f"loss never builds. Supported stages: {', '.join(SUPPORTED_STAGES)}. Fix: remove `liger_fsdp` for this run."
        )
    for key in ("use_dft_loss", "use_eaft_loss", "use_asft_loss"):
        if getattr(finetuning_args, key, False):
            raise LigerFsdpConfigError(
                f"`liger_fsdp: true` does not work with `{key}: true`: that loss reads the logits, which the fused loss "
                f"never builds. Fix: remove `liger_fsdp` or set `{key}: false`."
            )
    if getattr(model_args, "use_unsloth", False):
        raise LigerFsdpConfigError(
            "`liger_fsdp: true` does not work with `use_unsloth: true`: unsloth replaces the model's forward and loss. "
            "Fix: set `use_unsloth: false` or remove `liger_fsdp`."
        )
    if getattr(finetuning_args, "use_mca", False):
        raise LigerFsdpConfigError(
            "`liger_fsdp: true` does not work with `use_mca: true`: Megatron-Core (mcore_adapter) builds its own model "
            "and loss, so there is no Hugging Face head to fuse. Fix: set `use_mca: false` or remove `liger_fsdp`."
        )
    if getattr(model_args, "use_kt", False):
        raise LigerFsdpConfigError(
            "`liger_fsdp: true` does not work with `use_kt: true`: KTransformers replaces the model's modules and "
            "forward. Fix: set `use_kt: false` or remove `liger_fsdp`."
        )
    stage_ds = _deepspeed_zero_stage(training_args)
    if stage_ds == 3:
        raise LigerFsdpConfigError(
            "`liger_fsdp: true` does not support DeepSpeed ZeRO-3 yet (`deepspeed:` config with "
            "`zero_optimization.stage: 3`). Fix: use FSDP (`fsdp: full_shard auto_wrap` or an accelerate FSDP config), "
            "or ZeRO-2, or remove `liger_fsdp`."
        )
