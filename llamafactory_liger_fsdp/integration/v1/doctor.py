"""``doctor`` for a yaml of LLaMA-Factory's v1 engine (``USE_V1=1``; ``model:`` instead of ``model_name_or_path:``):
the same rules as the v1 launcher and ranks (:mod:`.v1_args`), the kernel registry of the installed v1, and the head
kind the yaml trains. No weights are read."""

from __future__ import annotations

import os
from typing import Any

from ...args import env_enabled
from ...config import LigerFsdpConfigError
from . import args as v1_args
from . import cp_args as v1_cp_args


def is_v1(raw: Any) -> bool:
    """A v1 yaml: ``USE_V1`` set, or v1's ``model:`` key without the default engine's ``model_name_or_path:``."""
    return env_enabled("USE_V1") or (isinstance(raw, dict) and "model" in raw
                                                     and "model_name_or_path" not in raw)


def registry_line() -> str:
    """Which v1 kernel API is installed and whether ``liger_fsdp`` is registered in it (the hook did it on import)."""
    try:
        from llamafactory.v1.plugins.model_plugins.kernels import interface
    except Exception as exc:  # no v1 in this LLaMA-Factory
        return f"v1 engine: not importable here ({type(exc).__name__}: {str(exc)[:120]})"
    api = "BaseKernel classes (git main)" if hasattr(interface, "apply_kernels") else "functions (0.9.5)"
    registry = getattr(interface.KernelPlugin, "_registry", {})
    found = v1_args.NAME in registry and bool(registry[v1_args.NAME])
    return f"v1 engine: kernel registry of {api}; `{v1_args.NAME}` {'registered' if found else 'NOT registered'}."


def head_of(raw: dict) -> str:
    peft = v1_args.plugin_config(raw.get("peft_config"))
    if not peft:
        return "head=full (lm_head; full fine-tuning)"
    targets = peft.get("target_modules", "all")
    targets = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets or [])
    if "lm_head" in (peft.get("modules_to_save") or []):
        return "head=modules_to_save (lm_head; `peft_config.modules_to_save`)"
    if "lm_head" in targets:
        return "head=lora (lm_head; `peft_config.target_modules`)"
    if peft.get("name") == "freeze" and "lm_head" in str(peft.get("freeze_extra_modules", "")):
        return "head=full (lm_head; `freeze_extra_modules`)"
    return "head=frozen (lm_head; v1's loss still reads its logits, so the log-probs come from the fused kernel)"


#: v1's training commands, as ``doctor [command] <yaml>`` takes them (``llamafactory-cli <command> <yaml>``).
COMMANDS = ("train", "sft", "dpo", "rm")


def command_of(raw: dict, given: str | None) -> str | None:
    """The v1 command a yaml is for: the one given, else ``dpo`` where it sets a preference key (``pref_*``), ``rm``
    for ``model_class: cls``; None where the yaml does not say (every command's line is printed)."""
    if given:
        return given
    if any(isinstance(k, str) and k.startswith("pref_") for k in raw):
        return "dpo"
    return "rm" if raw.get("model_class") == "cls" else None


def check_yaml(path: str, overrides: list[str], command: str | None = None) -> tuple[bool, list[str]]:
    """(would train, report lines) for ``llamafactory-cli <command> <yaml>`` (``command`` None: as the yaml says)."""
    from ... import families
    from .engine import check_kernel_config, model_config_of

    raw = v1_args.read_raw([path, *overrides]) or {}
    command = command_of(raw, command)
    lines = [registry_line()]
    if not env_enabled("USE_V1"):
        lines.append("a v1 yaml (`model:`): train it with USE_V1=1 llamafactory-cli train <yaml> (without USE_V1 the "
                     "default engine rejects its keys).")
    try:
        v1_args.top_level_keys(raw)
        cfg = check_kernel_config(raw.get(v1_args.KEY))
        if not cfg.enabled:
            why = (v1_args.disabled_cause() if v1_args.NAME in v1_args.names(raw.get(v1_args.KEY)) else
                   f"`{v1_args.KEY}.name` does not list `{v1_args.NAME}`")
            return True, lines + [f"plugin off ({why}): the run trains without it."]
        v1_args.check(command, raw, cfg, machine=False)
        decided = v1_args.decide_sharding(raw, os.environ)
        lines.append(f"liger_fsdp: on (backend {cfg.backend}); v1 trainers' log-probs from the fused kernel; "
                     f"first-step exactness guard {'on' if cfg.guard else 'off'}"
                     + (f"; checked for `llamafactory-cli {command}`." if command else "."))
        lines.append(f"sharding: {decided.label} (from {decided.source}).")
        cp_line = v1_cp_args.doctor_line(raw)  # v1 sequence parallelism
        if cp_line:
            lines.append(cp_line)
        model_config = model_config_of(raw)
        if isinstance(model_config, Exception):
            lines.append(f"could not read the model's config here ({type(model_config).__name__}); its family is "
                         "checked when the model is built.")
        else:
            family = families.family_of(getattr(model_config, "model_type", None), model_config)
            quirks = families.describe(family, model_config)
            lines.append(f"model type {family.model_type}" + (f" (quirks: {', '.join(quirks)})." if quirks else "."))
    except LigerFsdpConfigError as exc:
        return False, lines + [f"error: {exc}"]
    lines.append(f"will engage: {head_of(raw)} (decided from the yaml).")
    return True, lines
