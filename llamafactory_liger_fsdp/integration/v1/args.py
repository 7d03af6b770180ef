"""LLaMA-Factory's v1 engine (``USE_V1=1``): what a v1 yaml asks of the plugin, decided from the yaml alone.

A v1 run picks the plugin as a kernel: ``kernel_config: {name: liger_fsdp}`` (git main also takes a comma-separated
list, e.g. ``liger_kernel,liger_fsdp``). v1's parser rejects unknown top-level keys, so the plugin's keys live inside
``kernel_config`` (``liger_fsdp_backend``, ``liger_fsdp_guard``, ``liger_fsdp_memory_report``; dotlist overrides
``kernel_config.liger_fsdp_guard=false``). :func:`config_of` validates them, :func:`decide_sharding` reads v1's
``dist_config`` and :func:`check` refuses what cannot be exact (the sequence-parallel settings: :mod:`.cp_args`, their
one reader). The launching process reads the raw yaml
(:func:`read_raw`), every rank the parsed arguments (:func:`values_of`): one set of rules. Imports no torch.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, Mapping

from ... import config, sharding, versions
from ...args import read_args
from ...config import LigerFsdpConfigError
from . import cp_args
from .cp_args import KEY, NAME, REMOVE, plugin_config  # noqa: F401  (REMOVE: the fix that trains without the plugin)


def read_raw(argv: list[str]) -> dict | None:
    """The arguments of ``<cfg.yaml|json> [dotlist overrides]`` merged as v1's ``get_args`` merges them; None for
    other forms (argv flags), which only the ranks check."""
    raw = read_args(argv)
    return raw if isinstance(raw, dict) and argv and argv[0].endswith((".yaml", ".yml", ".json")) else None


def names(kernel_config: Any) -> list[str]:
    name = plugin_config(kernel_config).get("name")
    return [n.strip() for n in name.split(",") if n.strip()] if isinstance(name, str) else []


#: The plugin's keys written inside ``kernel_config`` without their prefix (``guard`` for ``liger_fsdp_guard``).
UNPREFIXED = {k[len(NAME) + 1:]: k for k in config.KEYS if k.startswith(NAME + "_")}
#: Keys of the default engine that no v1 path reads.
NOT_ON_V1 = {"liger_fsdp_checkpoint_repair": "v1 saves and loads checkpoints with its own code, which the plugin's "
                                             "repair (of accelerate's FSDP2 adapter checkpoints) never touches"}


def _misspelled(name: str) -> bool:
    return name != NAME and name.lower().replace("-", "_").replace(" ", "_") in (NAME, "ligerfsdp")


def config_of(kernel_config: Any) -> config.LigerFsdpConfig:
    """The plugin's config from ``kernel_config`` (off unless ``name`` lists ``liger_fsdp``, or with ``liger_fsdp:
    false``); misspelled names and keys, unprefixed keys, keys without the name and keys v1 never reads are errors."""
    values = plugin_config(kernel_config)
    listed = names(values)
    wrong = [n for n in listed if _misspelled(n)]
    if wrong:
        raise LigerFsdpConfigError(
            f"`{KEY}.name: {values.get('name')}`: `{wrong[0]}` is not a kernel LLaMA-Factory knows (every rank would "
            f"stop with `plugin {wrong[0]} is not registered`); the plugin's kernel is `{NAME}`. Fix: write `{NAME}` "
            f"in `{KEY}.name`.")
    ours = {k: v for k, v in values.items() if isinstance(k, str) and k.startswith(NAME)}
    if NAME not in listed:
        if ours:
            raise LigerFsdpConfigError(
                f"{', '.join(f'`{KEY}.{k}`' for k in sorted(ours))} set but `{KEY}.name` does not list `{NAME}`. "
                f"Fix: `{KEY}: {{name: {NAME}}}`, or remove them.")
        return config.LigerFsdpConfig()
    bare = sorted(k for k in values if k in UNPREFIXED)
    if bare:
        raise LigerFsdpConfigError(
            f"{', '.join(f'`{KEY}.{k}`' for k in bare)}: the plugin's keys keep their `{NAME}_` prefix inside `{KEY}` "
            f"(unprefixed, nothing reads them). Fix: {', '.join(f'`{KEY}.{UNPREFIXED[k]}`' for k in bare)} instead.")
    config.check_names(ours)
    for key, why in NOT_ON_V1.items():
        if key in ours:
            raise LigerFsdpConfigError(f"`{KEY}.{key}` has no effect on LLaMA-Factory's v1 engine: {why}. Fix: remove "
                                       f"`{key}` from `{KEY}`.")
    if config.disabled_by_env():
        return config.LigerFsdpConfig()
    return config.from_mapping({NAME: True, **ours})


def check_name_form(kernel_config: Any, takes_list: bool) -> None:
    """A list of kernel names where the installed v1 takes one name only (0.9.5: ``KernelPlugin(name)`` of the whole
    string)."""
    listed = names(kernel_config)
    if NAME in listed and len(listed) > 1 and not takes_list:
        value = plugin_config(kernel_config).get("name")
        raise LigerFsdpConfigError(
            f"`{KEY}.name: {value}`: the installed LLaMA-Factory's v1 takes one kernel name, not a list (every rank "
            f"would stop with `plugin {value} is not registered`; lists need LLaMA-Factory newer than 0.9.5). Fix: "
            f"`{KEY}.name: {NAME}`, or upgrade LLaMA-Factory.")


def disabled_cause() -> str:
    """Why a ``kernel_config`` that lists ``liger_fsdp`` leaves the plugin off."""
    return f"{config.DISABLE_ENV}=1" if config.disabled_by_env() else f"`{KEY}.{NAME}: false`"


def top_level_keys(raw: Mapping) -> None:
    """v1's parser rejects unknown keys; say where ours go instead (or that the yaml is the default engine's)."""
    found = sorted(k for k in raw if isinstance(k, str) and k.startswith(NAME))
    if found and "model_name_or_path" in raw:
        raise LigerFsdpConfigError(
            f"{', '.join(f'`{k}`' for k in found)} in a yaml of LLaMA-Factory's default engine (`model_name_or_path`), "
            f"launched with USE_V1=1: the v1 engine reads another yaml (`model:`, `{KEY}`). Fix: unset USE_V1 to train "
            "this yaml, or write it for v1.")
    if found:
        raise LigerFsdpConfigError(
            f"{', '.join(f'`{k}`' for k in found)}: on LLaMA-Factory's v1 engine (USE_V1=1) the plugin is a kernel and "
            f"its keys go inside `{KEY}`. Fix: `{KEY}: {{name: {NAME}}}` (with `liger_fsdp_guard`, "
            f"`liger_fsdp_backend` beside `name` if needed) instead of top-level keys.")


def without_v1(raw: Any) -> None:
    """A v1 yaml that names the plugin, launched for the default engine (USE_V1 unset)."""
    if isinstance(raw, Mapping) and NAME in names(raw.get(KEY)) and "model_name_or_path" not in raw:
        raise LigerFsdpConfigError(
            f"`{KEY}.name: {plugin_config(raw.get(KEY)).get('name')}` is a yaml of LLaMA-Factory's v1 engine, launched "
            "without USE_V1: the default engine rejects its keys. Fix: USE_V1=1 llamafactory-cli train <yaml>.")


def values_of(model_args: Any, training_args: Any) -> dict:
    """The parsed arguments as the raw yaml's keys (what :func:`check` and :func:`decide_sharding` read); a field the
    installed v1 does not have is None (0.9.5 has no top-level ``cp_size`` / ``cp_mode``)."""
    flash = getattr(model_args, "flash_attn", None)
    return {KEY: getattr(model_args, KEY, None), "model_class": str(getattr(model_args, "model_class", "llm") or "llm"),
            "dist_config": getattr(training_args, "dist_config", None), "cp_size": getattr(training_args, "cp_size", None),
            "cp_mode": getattr(training_args, "cp_mode", None), "flash_attn": None if flash is None else str(flash),
            "micro_batch_size": getattr(training_args, "micro_batch_size", None)}


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


def check(command: str | None, values: Mapping, cfg: config.LigerFsdpConfig | None = None,
          machine: bool = True) -> None:
    """What the plugin refuses on v1, from the arguments and the installed versions (the launching process, every
    rank and ``doctor``); with ``cfg`` the plugin's keys too and, with ``machine``, what this machine cannot run
    (:func:`.refusals.machine_problem`, as on the default engine; ``doctor`` reports it apart)."""
    versions.refuse_too_old(f"`{KEY}.name: {NAME}`", f"or {REMOVE}")
    cp_args.check(command, values, cfg)  # the sequence-parallel settings (and v1 DPO where there is none)
    size = cp_args.size(values)
    if (command == "rm" or values.get("model_class") == "cls") and size <= 1:  # under CP: the CP part (cp_rm)
        raise LigerFsdpConfigError(
            f"`{KEY}.name: {NAME}` computes log-probs over the vocabulary through lm_head; v1's reward-model trainer "
            f"(`rm`, model_class cls) replaces lm_head by a one-logit score head, so there is nothing to fuse. Fix: "
            f"{REMOVE} for reward modelling (with `cp_size` > 1 the plugin gathers the scores across the CP group).")
    dist = plugin_config(values.get("dist_config")).get("name")
    if dist not in (None, "fsdp2", "deepspeed"):
        raise LigerFsdpConfigError(
            f"`dist_config.name: {dist}` with `{KEY}.name: {NAME}`: the plugin knows v1's fsdp2 and deepspeed "
            f"engines (and DDP without dist_config), not `{dist}`'s sharding of the head. Fix: `dist_config: "
            f"{{name: fsdp2}}`, or {REMOVE}.")
    if cfg is not None and machine:
        from ...refusals import machine_problem

        problem = machine_problem(cfg)
        if problem:
            raise LigerFsdpConfigError(problem)
