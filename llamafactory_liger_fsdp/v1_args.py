"""LLaMA-Factory's v1 engine (``USE_V1=1``): what a v1 yaml asks of the plugin, decided from the yaml alone.

A v1 run picks the plugin as a kernel: ``kernel_config: {name: liger_fsdp}`` (git main also takes a comma-separated
list, e.g. ``liger_kernel,liger_fsdp``). v1's parser rejects unknown top-level keys, so the plugin's keys live inside
``kernel_config`` (``liger_fsdp_backend``, ``liger_fsdp_guard``, ``liger_fsdp_memory_report``; dotlist overrides
``kernel_config.liger_fsdp_guard=false``). :func:`config_of` validates them, :func:`decide_sharding` reads v1's
``dist_config`` and :func:`check` refuses what cannot be exact. The launching process reads the raw yaml
(:func:`read_raw`), every rank the parsed arguments (:func:`values_of`): one set of rules. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

from . import config, sharding, versions
from .config import LigerFsdpConfigError

NAME = "liger_fsdp"
KEY = "kernel_config"
FIX_REMOVE = f"or remove `{NAME}` from `{KEY}.name`"


def read_raw(argv: list[str]) -> dict | None:
    """The arguments of ``<cfg.yaml|json> [dotlist overrides]`` merged as v1's ``get_args`` merges them; None for
    other forms (argv flags), which only the ranks check."""
    if not argv or not argv[0].endswith((".yaml", ".yml", ".json")):
        return None
    from omegaconf import OmegaConf

    path = Path(argv[0]).absolute()
    if argv[0].endswith(".json"):
        with open(path, encoding="utf-8") as f:
            base = OmegaConf.create(json.load(f))
    else:
        base = OmegaConf.load(path)
    merged = OmegaConf.to_container(OmegaConf.merge(base, OmegaConf.from_cli(argv[1:])))
    return merged if isinstance(merged, dict) else None


def plugin_config(value: Any) -> dict:
    """A v1 ``*_config`` value as a dict (v1 also takes a JSON string)."""
    if isinstance(value, str) and value.strip().startswith("{"):
        value = json.loads(value)
    return dict(value) if isinstance(value, Mapping) else {}


def names(kernel_config: Any) -> list[str]:
    name = plugin_config(kernel_config).get("name")
    return [n.strip() for n in name.split(",") if n.strip()] if isinstance(name, str) else []


def config_of(kernel_config: Any) -> config.LigerFsdpConfig:
    """The plugin's config from ``kernel_config`` (off unless ``name`` lists ``liger_fsdp``); misspelled keys and keys
    without the name are errors."""
    values = plugin_config(kernel_config)
    ours = {k: v for k, v in values.items() if isinstance(k, str) and k.startswith(NAME)}
    if NAME not in names(values):
        if ours:
            raise LigerFsdpConfigError(
                f"{', '.join(f'`{KEY}.{k}`' for k in sorted(ours))} set but `{KEY}.name` does not list `{NAME}`. "
                f"Fix: `{KEY}: {{name: {NAME}}}`, or remove them.")
        return config.LigerFsdpConfig()
    if config.disabled_by_env():
        config.check_names(ours)
        return config.LigerFsdpConfig()
    return config.from_mapping({NAME: True, **ours})


def top_level_keys(raw: Mapping) -> None:
    """v1's parser rejects unknown keys; say where ours go instead."""
    found = sorted(k for k in raw if isinstance(k, str) and k.startswith(NAME))
    if found:
        raise LigerFsdpConfigError(
            f"{', '.join(f'`{k}`' for k in found)}: on LLaMA-Factory's v1 engine (USE_V1=1) the plugin is a kernel and "
            f"its keys go inside `{KEY}`. Fix: `{KEY}: {{name: {NAME}}}` (with `liger_fsdp_guard`, "
            f"`liger_fsdp_backend` beside `name` if needed) instead of top-level keys.")


def values_of(model_args: Any, training_args: Any) -> dict:
    """The parsed arguments as the raw yaml's keys (what :func:`check` and :func:`decide_sharding` read)."""
    return {KEY: getattr(model_args, KEY, None), "model_class": str(getattr(model_args, "model_class", "llm") or "llm"),
            "dist_config": getattr(training_args, "dist_config", None), "cp_size": getattr(training_args, "cp_size", 1),
            "cp_mode": getattr(training_args, "cp_mode", None),  # git main; 0.9.5 keeps both in dist_config
            "micro_batch_size": getattr(training_args, "micro_batch_size", None)}


def cp_size(values: Mapping) -> int:
    """Ulysses context-parallel size: git main's top-level ``cp_size``, 0.9.5's ``dist_config.cp_size``."""
    for value in (values.get("cp_size"), plugin_config(values.get("dist_config")).get("cp_size")):
        try:
            if value is not None and int(value) > 1:
                return int(value)
        except (TypeError, ValueError):
            continue
    return 1


def decide_sharding(values: Mapping, env: Mapping[str, str]) -> sharding.Sharding:
    """The run's sharding from v1's ``dist_config`` (fsdp2 | deepspeed) and the process count (DDP)."""
    dist = plugin_config(values.get("dist_config"))
    name = dist.get("name")
    if name == "fsdp2":
        offload = "cpu" if str(dist.get("offload_params", False)).lower() == "true" else None
        return sharding.Sharding(sharding.FSDP2, offload_param=offload, source="v1's dist_config")
    if name == "deepspeed":
        found = sharding.decide(SimpleNamespace(deepspeed=dist.get("config_file")), env={})
        if found.kind == sharding.DEEPSPEED:
            return dataclasses.replace(found, source="v1's dist_config")
        return sharding.Sharding(sharding.DEEPSPEED, 0, source="v1's dist_config (config_file not readable here)")
    if sharding.world_size(env) > 1:
        return sharding.Sharding(sharding.DDP, source="the process count")
    return sharding.Sharding(sharding.NONE, source="one process")


def check(command: str | None, values: Mapping, cfg: config.LigerFsdpConfig | None = None) -> None:
    """What the plugin refuses on v1, from the arguments and the installed versions (the launching process and every
    rank); with ``cfg`` also what this machine cannot run (:func:`.refusals.machine_problem`, as on the default
    engine)."""
    old = versions.too_old()
    if old:
        raise LigerFsdpConfigError(
            f"`{KEY}.name: {NAME}` needs newer releases than installed: {', '.join(old)}. Fix: "
            f"{versions.upgrade_command()}, {FIX_REMOVE}.")
    if command == "rm" or values.get("model_class") == "cls":
        raise LigerFsdpConfigError(
            f"`{KEY}.name: {NAME}` computes log-probs over the vocabulary through lm_head; v1's reward-model trainer "
            f"(`rm`, model_class cls) replaces lm_head by a one-logit score head, so there is nothing to fuse. Fix: "
            f"{FIX_REMOVE} for reward modelling.")
    size = cp_size(values)
    if size > 1:  # v1 sequence parallelism: what the plugin makes exact (v1_cp_args)
        from . import v1_cp_args

        v1_cp_args.check(command, values, size)
    dist = plugin_config(values.get("dist_config")).get("name")
    if dist not in (None, "fsdp2", "deepspeed"):
        raise LigerFsdpConfigError(
            f"`dist_config.name: {dist}` with `{KEY}.name: {NAME}`: the plugin knows v1's fsdp2 and deepspeed "
            f"engines (and DDP without dist_config), not `{dist}`'s sharding of the head. Fix: `dist_config: "
            f"{{name: fsdp2}}`, {FIX_REMOVE}.")
    if cfg is not None:
        from .refusals import machine_problem

        problem = machine_problem(cfg)
        if problem:
            raise LigerFsdpConfigError(problem)
