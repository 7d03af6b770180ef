"""The ``liger_fsdp*`` keys of a LLaMA-Factory yaml: their parsing and validation.

LLaMA-Factory rejects unknown keys (``Some keys are not used by the HfArgumentParser``). The
integration takes our keys out of the arguments *before* LLaMA-Factory's parser sees them
(:func:`extract`), validates them here, and hangs the resulting :class:`LigerFsdpConfig` on the
parsed ``FinetuningArguments`` as ``liger_fsdp_config``. Every other unknown key is still rejected by
LLaMA-Factory. Refusals of other settings are in :mod:`.refusals`. This module imports no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

#: The keys this plugin adds to LLaMA-Factory's arguments, with their help text.
KEYS = {
    "liger_fsdp": "true/false: compute the causal-LM loss with the fused linear cross-entropy, through the FSDP units "
    "or DeepSpeed modules that own the trained lm_head.",
    "liger_fsdp_backend": "auto/triton_fast/triton/torch: kernel of the fused loss. auto = triton_fast on CUDA "
    "(gradients in forward; about 3.3 GiB working memory at a 128k vocabulary, 6.6 GiB at 262k), torch elsewhere; "
    "triton = lean (0.4-0.7 GiB, gradients recomputed in backward, 1.21-1.29x the matmul floor).",
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


def disabled_by_env() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


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
    bools = {k: _parse_bool(k, values[k]) for k in KEYS if k != "liger_fsdp_backend" and k in values}
    return LigerFsdpConfig(
        enabled=bools.get("liger_fsdp", False),
        backend=_parse_backend("liger_fsdp_backend", values["liger_fsdp_backend"]) if "liger_fsdp_backend" in values else "auto",
        memory_report=bools.get("liger_fsdp_memory_report", False),
        checkpoint_repair=bools.get("liger_fsdp_checkpoint_repair", True),
        guard=bools.get("liger_fsdp_guard", True),
    )


def split(args: Any) -> tuple[Any, dict[str, Any]]:
    """LLaMA-Factory's raw arguments (a dict from yaml/json, or an argv list) without our keys, and our keys."""
    if isinstance(args, dict):
        ours = {k: args[k] for k in args if isinstance(k, str) and k.startswith("liger_fsdp")}
        return {k: v for k, v in args.items() if k not in ours}, ours
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
        return rest, ours
    return args, {}


def get_config(finetuning_args: Any) -> LigerFsdpConfig:
    """The config hung on LLaMA-Factory's ``FinetuningArguments`` by the integration (default: off)."""
    return getattr(finetuning_args, ATTR, None) or LigerFsdpConfig()
