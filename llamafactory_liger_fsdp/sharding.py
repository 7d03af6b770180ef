"""The run's sharding, decided once: none | DDP | FSDP1 | FSDP2 | DeepSpeed ZeRO-0..3.

:func:`decide` reads what the Trainer and accelerate will read, in their order: a DeepSpeed config
(the yaml's ``deepspeed:`` json, or ``accelerate launch``'s DeepSpeed environment), then FSDP (the
yaml's ``fsdp:``/``fsdp_config:``, or ``accelerate launch``'s ``ACCELERATE_USE_FSDP``/``FSDP_VERSION``),
then the process count. The result is kept on the plugin's config (``LigerFsdpConfig.sharding``) and
read by the refusals, checkpoints, doctor and the engaged line. :func:`observed` says what a live
model really is (on CPU accelerate trains DDP even when FSDP was asked for).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from . import thirdparty
from .args import truthy

NONE, DDP, FSDP1, FSDP2, DEEPSPEED = "none", "ddp", "fsdp1", "fsdp2", "deepspeed"


@dataclass(frozen=True)
class Sharding:
    kind: str = NONE
    zero_stage: int | None = None  # DeepSpeed only
    offload_param: str | None = None  # DeepSpeed ZeRO-3 / FSDP: "cpu" when parameters are offloaded
    offload_optimizer: str | None = None
    source: str = ""  # where it was read

    @property
    def fsdp_version(self) -> int | None:
        return {FSDP1: 1, FSDP2: 2}.get(self.kind)

    @property
    def label(self) -> str:
        if self.kind == DEEPSPEED:
            offload = [f"{what} offload {dev}" for what, dev in (("param", self.offload_param),
                       ("optimizer", self.offload_optimizer)) if dev and dev != "none"]
            return f"DeepSpeed ZeRO-{self.zero_stage}" + (f" ({', '.join(offload)})" if offload else "")
        return {NONE: "none", DDP: "DDP", FSDP1: "FSDP1", FSDP2: "FSDP2"}[self.kind]


def _read_json(value: Any) -> dict | None:
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value:
        try:
            with open(value, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None
    return None


def _device(section: Any) -> str | None:
    return (section or {}).get("device") if isinstance(section, dict) else None


def _deepspeed(training_args: Any, env: Mapping[str, str]) -> Sharding | None:
    hf_config = getattr(training_args, "hf_deepspeed_config", None)
    config = getattr(hf_config, "config", None) or _read_json(getattr(training_args, "deepspeed", None))
    source = "the yaml's `deepspeed:` config"
    if config is None and truthy(env.get("ACCELERATE_USE_DEEPSPEED", "")):
        config = _read_json(env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")) or {}
        source = "accelerate's DeepSpeed config"
        zero = dict(config.get("zero_optimization") or {})
        zero.setdefault("stage", env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE"))
        for key in ("offload_param", "offload_optimizer"):
            device = env.get(f"ACCELERATE_DEEPSPEED_{key.upper()}_DEVICE")
            if device and key not in zero:
                zero[key] = {"device": device}
        config = dict(config, zero_optimization=zero)
    if config is None:
        return None
    zero = config.get("zero_optimization") or {}
    try:
        stage = int(zero.get("stage", 0))
    except (TypeError, ValueError):
        stage = 0
    return Sharding(DEEPSPEED, stage, _device(zero.get("offload_param")), _device(zero.get("offload_optimizer")), source)


def _fsdp(training_args: Any, env: Mapping[str, str]) -> Sharding | None:
    if truthy(env.get("ACCELERATE_USE_FSDP", "")):
        version = int(env.get("FSDP_VERSION") or 1)
        offload = "cpu" if truthy(env.get("FSDP_OFFLOAD_PARAMS", "")) else None
        return Sharding(FSDP2 if version == 2 else FSDP1, offload_param=offload, source="accelerate's FSDP config")
    if getattr(training_args, "fsdp", None):
        cfg = getattr(training_args, "fsdp_config", None) or {}
        if isinstance(cfg, str):  # a json file, as transformers accepts
            cfg = _read_json(cfg) or {}
        version = int(cfg.get("version", cfg.get("fsdp_version", 1)) or 1)
        options = " ".join(map(str, training_args.fsdp)) if isinstance(training_args.fsdp, list) else str(training_args.fsdp)
        offload = "cpu" if "offload" in options else None
        return Sharding(FSDP2 if version == 2 else FSDP1, offload_param=offload, source="the yaml's `fsdp:` keys")
    return None


def world_size(env: Mapping[str, str]) -> int:
    """Processes of this run: torchrun's ``WORLD_SIZE``, else what ``FORCE_TORCHRUN`` will start."""
    if (env.get("WORLD_SIZE") or "").isdigit():
        return int(env["WORLD_SIZE"])
    if truthy(env.get("FORCE_TORCHRUN", "")):
        try:
            return int(env.get("NPROC_PER_NODE") or 1) * int(env.get("NNODES") or 1)
        except ValueError:
            return 1
    return 1


def accelerate_env(config: Mapping[str, Any]) -> dict[str, str]:
    """The environment ``accelerate launch --config_file`` gives its processes, as far as :func:`decide` reads it,
    from the accelerate config (a dict of its yaml)."""
    kind = str(config.get("distributed_type", "NO")).upper()
    env = {"WORLD_SIZE": str(config.get("num_processes") or 1)}
    if kind == "FSDP":
        fsdp = config.get("fsdp_config") or {}
        env.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION=str(fsdp.get("fsdp_version") or 1),
                   FSDP_OFFLOAD_PARAMS=str(fsdp.get("fsdp_offload_params", False)).lower())
    elif kind == "DEEPSPEED":
        ds = config.get("deepspeed_config") or {}
        env.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE=str(ds.get("zero_stage", 0)))
        if ds.get("deepspeed_config_file"):
            env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(ds["deepspeed_config_file"])
        for key in ("offload_param", "offload_optimizer"):
            if ds.get(f"{key}_device"):
                env[f"ACCELERATE_DEEPSPEED_{key.upper()}_DEVICE"] = str(ds[f"{key}_device"])
    return env


def decide(training_args: Any = None, env: Mapping[str, str] | None = None) -> Sharding:
    """The sharding this run will use, from its training arguments and launcher environment."""
    env = os.environ if env is None else env
    found = _deepspeed(training_args, env) or _fsdp(training_args, env)
    if found is not None:
        return found
    if world_size(env) > 1:
        return Sharding(DDP, source="the process count")
    return Sharding(NONE, source="one process")


def observed(model: Any) -> str | None:
    """What the live model is sharded with (``FSDP1``/``FSDP2``/``DeepSpeed ZeRO-3``), None if unsharded."""
    for module in model.modules():
        if thirdparty.is_fsdp1(module):
            return "FSDP1"
        if thirdparty.is_fsdp2(module):
            return "FSDP2"
    for param in model.parameters():
        if thirdparty.is_flat_param(param):
            return "FSDP1"
        if thirdparty.is_dtensor(param):
            return "FSDP2"
        if thirdparty.is_zero3_param(param):
            return "DeepSpeed ZeRO-3"
    return None
