"""Settings that cannot work with ``liger_fsdp: true``, decided from the arguments alone.

One function, :func:`check`, one text per refusal, each naming the key and the fix. It runs twice on
the same rules: in the launching process before any rank starts (on the raw yaml/CLI arguments,
:func:`check_raw`) and in every rank right after LLaMA-Factory parsed them (:func:`check_parsed`),
so a run started any other way is refused with the same text. Refusals that need the model (family,
head kind) live next to the code that inspects it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

from . import versions
from .args import argv_values, env_enabled, truthy
from .config import LigerFsdpConfigError

#: Names LLaMA-Factory users give the output embedding in `lora_target` / `oft_target` (gpt_neox: embed_out).
HEAD_NAMES = ("lm_head", "embed_out")

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
    "use_kt": "KTransformers replaces the model's modules and forward",
    "use_hyper_parallel": "HyperParallel shards the model with its own tensor/context parallelism and trainer, which "
                          "the plugin does not gather through",
}
#: Environment switches of LLaMA-Factory that train without its `load_model` (the plugin would never engage).
_ENGINES = {
    "USE_MCA": "Megatron-Core (mcore_adapter) builds its own model and loss, so there is no Hugging Face head to fuse",
    "USE_MEGATRON_BRIDGE": "Megatron-Bridge converts the model and trains it with Megatron's own loss; LLaMA-Factory's "
                           "load_model, where the plugin engages, never runs",
}


def head_targets(value: Any) -> list[str]:
    """The output-embedding names (:data:`HEAD_NAMES`) in a LLaMA-Factory module list (``lora_target``,
    ``additional_target``, ...): ``"q_proj,lm_head"`` in a yaml, a list once parsed."""
    items = value if isinstance(value, (list, tuple)) else str(value or "").split(",")
    return [name for name in (str(x).strip() for x in items) if name in HEAD_NAMES]


def _head_variant(get: Callable[[str, Any], Any]) -> None:
    """Adapters on the head that are not plain LoRA, read from the yaml (the loader would refuse them per rank)."""
    kind = str(get("finetuning_type", "lora"))
    if kind == "lora" and truthy(get("use_dora", False)):
        on_head = head_targets(get("lora_target", ""))
        if on_head:
            raise LigerFsdpConfigError(
                f"`liger_fsdp: true` supports plain LoRA on the head; `use_dora: true` with `{on_head[0]}` in "
                f"`lora_target` makes the head a DoRA layer, whose weight norm the fused loss does not compute. Fix: "
                f"take `{on_head[0]}` out of `lora_target` (and put it in `additional_target` to train a full copy), "
                "or set `use_dora: false`, or remove `liger_fsdp`."
            )
    if kind == "oft":
        on_head = head_targets(get("oft_target", ""))
        if on_head:
            raise LigerFsdpConfigError(
                f"`liger_fsdp: true` does not support OFT on the head (`{on_head[0]}` in `oft_target`): the fused loss "
                f"reads a plain or LoRA head weight. Fix: take `{on_head[0]}` out of `oft_target` (put it in "
                "`additional_target` to train a full copy), or remove `liger_fsdp`."
            )


_ANOTHER_MACHINE = [False]


@contextlib.contextmanager
def for_another_machine():
    """Inside: the yaml is evaluated for another machine (``doctor`` on a login node); :func:`check` skips
    :func:`machine_problem`, which the caller reports apart."""
    _ANOTHER_MACHINE[0] = True
    try:
        yield
    finally:
        _ANOTHER_MACHINE[0] = False


def machine_problem(cfg: Any) -> str | None:
    """What this machine cannot run (checked where the ranks start, reported apart by ``doctor``)."""
    backend = getattr(cfg, "backend", "auto")
    for entry in versions.broken(backend):
        found = ", ".join(f"{name} {versions.installed(name)}" for name, _ in entry.match)
        return (f"`liger_fsdp_backend: {backend}` cannot run with {found}: {entry.reason}. Fix: {entry.fix}; or set "
                "`liger_fsdp_backend: auto`.")
    if backend in ("triton", "triton_fast"):
        import torch

        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "") != "1":
            return (f"`liger_fsdp_backend: {backend}` needs a CUDA GPU and this machine has none (Triton would stop at "
                    "step 1 with '0 active drivers'). Fix: set `liger_fsdp_backend: auto` (triton_fast on CUDA, torch "
                    "elsewhere), or run on the GPU machine.")
    return None


def check(get: Callable[[str, Any], Any], sharding: Any = None, cfg: Any = None, machine: bool = True) -> None:
    """Raise :class:`LigerFsdpConfigError` for the first setting that cannot work with the flag on.

    ``sharding`` (the decided :class:`.sharding.Sharding`) is there for rules that depend on it; every sharding
    the plugin knows (none, DDP, FSDP1/2, DeepSpeed ZeRO-0..3) is supported today. ``cfg`` (the plugin's keys): the
    installed versions (:mod:`.versions`: too old is refused) and, with ``machine``, what this machine cannot run."""
    stage = str(get("stage", "sft"))
    if stage not in SUPPORTED_STAGES:
        why = _STAGE_WHY.get(stage, "its loss is not the plain causal-LM loss")
        raise LigerFsdpConfigError(
            f"`liger_fsdp: true` does not work with `stage: {stage}`: {why}. Supported stages: "
            f"{', '.join(SUPPORTED_STAGES)}. Fix: remove `liger_fsdp` (or set it to false) for `stage: {stage}`."
        )
    for key in _LOGIT_LOSSES:
        if truthy(get(key, False)):
            raise LigerFsdpConfigError(
                f"`liger_fsdp: true` does not work with `{key}: true`: that loss reads the logits, which the fused "
                f"loss never builds. Fix: set `{key}: false` or remove `liger_fsdp`."
            )
    for key, why in _REPLACED.items():
        if truthy(get(key, False)):
            raise LigerFsdpConfigError(
                f"`liger_fsdp: true` does not work with `{key}: true`: {why}. Fix: set `{key}: false` or remove "
                "`liger_fsdp`."
            )
    for var, why in _ENGINES.items():
        key = var.lower()
        if env_enabled(var) or truthy(get(key, False)):
            raise LigerFsdpConfigError(
                f"`liger_fsdp: true` does not work with {var}={os.environ.get(var) or 1} (`{key}`): {why}. Fix: unset "
                f"{var} to train with LLaMA-Factory's default engine, or remove `liger_fsdp`."
            )
    _head_variant(get)
    if cfg is not None:
        versions.refuse_too_old("`liger_fsdp: true`", "or remove `liger_fsdp`")
    problem = machine_problem(cfg) if cfg is not None and machine and not _ANOTHER_MACHINE[0] else None
    if problem:
        raise LigerFsdpConfigError(problem)


def check_raw(args: Any, sharding: Any = None, cfg: Any = None, machine: bool = True) -> None:
    """:func:`check` on LLaMA-Factory's raw arguments (dict from yaml/json, or an argv list)."""
    values = args if isinstance(args, dict) else argv_values(args or [])
    check(lambda key, default: values.get(key, default), sharding, cfg, machine)


def check_parsed(parsed: dict[str, Any], sharding: Any = None, cfg: Any = None, machine: bool = True) -> None:
    """:func:`check` on LLaMA-Factory's parsed dataclasses (``thirdparty.parsed_args``)."""
    order = [parsed[r] for r in ("finetuning", "model", "training", "data") if r in parsed]

    def get(key: str, default: Any) -> Any:
        for obj in order:
            if hasattr(obj, key):
                return getattr(obj, key)
        return default

    check(get, sharding, cfg, machine)
