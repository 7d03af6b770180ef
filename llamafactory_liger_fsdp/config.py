"""The ``liger_fsdp*`` keys of a LLaMA-Factory yaml: their parsing and validation.

LLaMA-Factory rejects unknown keys (``Some keys are not used by the HfArgumentParser``). The
integration takes our keys out of the arguments *before* LLaMA-Factory's parser sees them
(:func:`split`), validates them here, and hangs the resulting :class:`LigerFsdpConfig` on the
parsed ``FinetuningArguments`` as ``liger_fsdp_config``. Every other unknown key is still rejected by
LLaMA-Factory. Refusals of other settings are in :mod:`.refusals`. This module imports no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .args import argv_options, true_or_false, truthy

#: The keys this plugin adds to LLaMA-Factory's arguments, with their help text.
KEYS = {
    "liger_fsdp": "true/false: compute the causal-LM loss with the fused linear cross-entropy, through the FSDP units "
    "or DeepSpeed modules that own the trained lm_head.",
    "liger_fsdp_backend": "auto/triton_fast/triton/torch: kernel of the fused loss. auto = triton_fast on CUDA, torch "
    "elsewhere; triton_fast computes the gradients in the forward (fastest; working memory grows with the "
    "vocabulary); triton recomputes them in the backward (lean: less working memory, slower); torch = chunked "
    "PyTorch, any device.",
    "liger_fsdp_memory_report": "true/false (default false): on step 1 (rank 0) log the memory the fused kernel "
    "really used, measured by tracking its tensor allocations; the CUDA peak-memory counters are never reset.",
    "liger_fsdp_guard": "true/false (default true): on step 1 (every rank) compare the fused loss with the model's own "
    "forward on a slice of the batch (one row, at most 256 positions) and stop with both numbers if they differ beyond "
    "rounding.",
    "liger_fsdp_checkpoint_repair": "true/false (default true): under FSDP2 with an adapter, save and load the "
    "adapter as full tensors where the installed accelerate (< 1.15) writes rank 0's shards only.",
    "liger_fsdp_allow_untested_versions": "no longer needed (accepted so older yamls parse): versions newer than "
    "tested train by default, with one line naming them and the first-step guard checking the loss.",
}
#: Keys accepted so that older yamls parse, which change nothing (said once per run: :func:`no_effect_line`).
NO_EFFECT = ("liger_fsdp_allow_untested_versions",)
BACKENDS = ("auto", "triton", "triton_fast", "torch")
ATTR = "liger_fsdp_config"
DISABLE_ENV = "LLAMAFACTORY_LIGER_FSDP_DISABLE"


class LigerFsdpConfigError(ValueError):
    """A configuration that cannot work with ``liger_fsdp: true``; the message names the key and the fix."""


class LigerFsdpDataError(ValueError):
    """The data cannot be trained on by this model (token ids or labels outside its vocabulary), with or without the
    plugin; the message names the key that fixes it (``resize_vocab``)."""


@dataclass(frozen=True)
class LigerFsdpConfig:
    """The validated ``liger_fsdp*`` keys of one run, and the run's sharding (decided at parse time)."""

    enabled: bool = False
    backend: str = "auto"
    memory_report: bool = False
    checkpoint_repair: bool = True
    guard: bool = True
    sharding: Any = None  # sharding.Sharding, set once the training arguments are parsed
    start_step: int = 0  # the global step a resumed run starts from (trainer_state.json of its checkpoint)
    grad_accum: int = 1  # micro-batches per optimizer step
    label_smoothing: float = 0.0  # the Trainer's label_smoothing_factor


#: yaml key -> :class:`LigerFsdpConfig` field (a key left unset keeps the field's default).
FIELDS = {"liger_fsdp": "enabled", "liger_fsdp_backend": "backend", "liger_fsdp_memory_report": "memory_report",
          "liger_fsdp_checkpoint_repair": "checkpoint_repair", "liger_fsdp_guard": "guard"}


def disabled_by_env() -> bool:
    return truthy(os.environ.get(DISABLE_ENV, ""))


def _parse_bool(key: str, value: Any) -> bool:
    parsed = true_or_false(value)
    if parsed is not None:
        return parsed
    raise LigerFsdpConfigError(
        f"`{key}` must be true or false, got {value!r} ({type(value).__name__}). "
        f"Fix: write `{key}: true` (or `false`) in the yaml, or `{key}=true` on the command line."
    )


def _parse_backend(key: str, value: Any) -> str:
    if isinstance(value, str) and value.strip().lower() in BACKENDS:
        return value.strip().lower()
    raise LigerFsdpConfigError(
        f"`{key}` must be one of {', '.join(BACKENDS)}, got {value!r} ({type(value).__name__}). "
        f"Fix: write `{key}: auto` (triton_fast on CUDA, torch elsewhere) or remove the key."
    )


def check_names(values: dict[str, Any]) -> None:
    """Misspelled ``liger_fsdp_*`` keys are an error, also while the plugin is disabled."""
    unknown = sorted(k for k in values if k not in KEYS)
    if unknown:
        raise LigerFsdpConfigError(
            f"Unknown key(s) {', '.join('`' + k + '`' for k in unknown)}. The liger_fsdp plugin knows: "
            f"{', '.join('`' + k + '`' for k in KEYS)}. Fix: correct the spelling or remove them."
        )


def from_mapping(values: dict[str, Any]) -> LigerFsdpConfig:
    """Build and validate a config from ``{key: value}`` taken out of the user's arguments."""
    check_names(values)
    if "liger_fsdp" not in values and values:
        raise LigerFsdpConfigError(
            f"{', '.join('`' + k + '`' for k in sorted(values))} set but `liger_fsdp` is not. "
            "Fix: add `liger_fsdp: true`, or remove them."
        )
    parsed = {k: _parse_bool(k, values[k]) for k in KEYS if k != "liger_fsdp_backend" and k in values}
    if "liger_fsdp_backend" in values:
        parsed["liger_fsdp_backend"] = _parse_backend("liger_fsdp_backend", values["liger_fsdp_backend"])
    return LigerFsdpConfig(**{FIELDS[k]: v for k, v in parsed.items() if k in FIELDS})


def split(args: Any) -> tuple[Any, dict[str, Any]]:
    """LLaMA-Factory's raw arguments (a dict from yaml/json, or an argv list) without our keys, and our keys."""
    if isinstance(args, dict):
        ours = {k: args[k] for k in args if isinstance(k, str) and k.startswith("liger_fsdp")}
        return {k: v for k, v in args.items() if k not in ours}, ours
    if isinstance(args, (list, tuple)):
        items = list(args)
        ours: dict[str, Any] = {}
        taken: set[int] = set()
        for option in argv_options(items):
            if not option.key.startswith("liger_fsdp"):
                continue
            if option.value is None and option.key != "liger_fsdp":
                raise LigerFsdpConfigError(f"`--{option.key}` needs a value. Fix: write `--{option.key} <value>`.")
            ours[option.key] = "true" if option.value is None else option.value  # bare flag, as HfArgumentParser
            taken.update(range(option.start, option.stop))
        return [item for i, item in enumerate(items) if i not in taken], ours
    return args, {}


def no_effect_line(values: dict[str, Any]) -> str | None:
    """The line for keys of :data:`NO_EFFECT` in ``values`` (None when there are none)."""
    found = [k for k in NO_EFFECT if k in values]
    if not found:
        return None
    return (f"[liger_fsdp] `{found[0]}` no longer does anything: versions newer than tested train, with one line naming "
            "them and the first-step guard checking the loss. Fix: remove the key.")


def get_config(finetuning_args: Any) -> LigerFsdpConfig:
    """The config hung on LLaMA-Factory's ``FinetuningArguments`` by the integration (default: off)."""
    return getattr(finetuning_args, ATTR, None) or LigerFsdpConfig()
