"""``doctor`` on a default-engine yaml: what the plugin will decide, with the same code as training (parsing by
LLaMA-Factory, refusals, sharding, the head decided on a meta-device model by :mod:`.predict`). A yaml LLaMA-Factory
rejects on this machine only is evaluated as on the GPU machine it is for (:data:`FOR_THE_GPU_MACHINE`)."""

from __future__ import annotations

import dataclasses
import os
import sys

from . import refusals


def _parse(path: str, overrides: list[str], machine_overrides: dict | None = None):
    from llamafactory.hparams import get_train_args
    from llamafactory.hparams.parser import read_args

    saved = sys.argv
    sys.argv = ["llamafactory-cli", path, *overrides]
    try:
        raw = read_args()
    finally:
        sys.argv = saved
    args = {k: v for k, v in dict(raw, **(machine_overrides or {})).items() if v is not None}
    with refusals.for_another_machine():  # what this machine cannot run is reported apart
        return raw, get_train_args(args)


#: Parsed "as on the GPU machine the yaml is for": no bf16/GPU check, and no `deepspeed:` key (LLaMA-Factory parses it
#: inside a torchrun rank only); the sharding is then decided from the yaml's DeepSpeed json.
FOR_THE_GPU_MACHINE = {"use_cpu": True, "deepspeed": None}


def check_yaml(path: str, overrides: list[str] | None = None, accelerate: dict | None = None) -> tuple[bool, list[str]]:
    """(would train, report lines); ``accelerate``: the config of an ``accelerate launch`` (its yaml as a dict). The
    plugin's own log lines are quiet meanwhile (a clean report)."""
    from ._log import logger

    level = logger.level
    logger.setLevel("WARNING")
    try:
        return _check_yaml(path, overrides, accelerate)
    finally:
        logger.setLevel(level)


class _Rejected(Exception):
    """LLaMA-Factory rejects the yaml (not for this machine only)."""


def _parse_for_report(path: str, overrides: list[str], lines: list[str]):
    """(raw yaml, LLaMA-Factory's parsed arguments); a yaml rejected on this machine only is evaluated as on the GPU
    machine it is for, said in ``lines``."""
    from types import SimpleNamespace

    from . import config, sharding
    from .config import LigerFsdpConfigError

    try:
        return _parse(path, overrides)
    except LigerFsdpConfigError:
        raise
    except (ValueError, ImportError) as exc:
        try:
            raw, parsed = _parse(path, overrides, FOR_THE_GPU_MACHINE)
        except LigerFsdpConfigError:
            raise
        except Exception:
            raise _Rejected(exc) from None
        lines.append(f"this machine: LLaMA-Factory would reject the yaml here ({exc}); what follows is evaluated as on "
                     "the GPU machine it is for" + (" (launched with FORCE_TORCHRUN=1, as DeepSpeed needs)"
                                                     if raw.get("deepspeed") else "") + ".")
        finetuning = parsed[3]
        cfg = config.get_config(finetuning)
        if cfg.enabled and raw.get("deepspeed"):  # decided from the yaml's json, as every rank will
            decided = sharding.decide(SimpleNamespace(deepspeed=raw["deepspeed"]))
            setattr(finetuning, config.ATTR, dataclasses.replace(cfg, sharding=decided))
            refusals.check_raw(raw, decided, cfg, machine=False)
        return raw, parsed


def _under_accelerate(cfg, accelerate: dict, model_args, training_args, finetuning_args):
    """The config with the sharding the processes of ``accelerate launch`` decide from its config file (refused as
    every rank would refuse it)."""
    from . import config, sharding

    decided = sharding.decide(training_args, {**os.environ, **sharding.accelerate_env(accelerate)})
    cfg = dataclasses.replace(cfg, sharding=decided)
    refusals.check_parsed(dict(training=training_args, finetuning=finetuning_args, model=model_args), decided, cfg,
                          machine=False)
    setattr(finetuning_args, config.ATTR, cfg)
    return cfg


def _check_yaml(path: str, overrides: list[str] | None, accelerate: dict | None) -> tuple[bool, list[str]]:
    """(would train, report lines)."""
    from . import config
    from .config import LigerFsdpConfigError

    lines: list[str] = []
    try:
        raw, parsed = _parse_for_report(path, list(overrides or []), lines)
        model_args, _, training_args, finetuning_args, _ = parsed
        cfg = config.get_config(finetuning_args)
        if cfg.enabled and accelerate is not None:
            cfg = _under_accelerate(cfg, accelerate, model_args, training_args, finetuning_args)
    except _Rejected as exc:
        return False, [f"LLaMA-Factory rejects this yaml: {exc}"]
    except LigerFsdpConfigError as exc:
        return False, lines + [f"error: {exc}"]
    if not cfg.enabled:
        why = f"disabled by {config.DISABLE_ENV}" if config.disabled_by_env() else "`liger_fsdp` is not true in this yaml"
        return True, lines + [f"plugin off ({why}): the run trains without it."]
    return _plan(raw, cfg, model_args, training_args, finetuning_args, lines)


def _plan(raw: dict, cfg, model_args, training_args, finetuning_args, lines: list[str]) -> tuple[bool, list[str]]:
    """(would train, report lines) of an enabled run: machine, sharding, dtypes, model, head, checkpoints."""
    from . import predict, sharding

    problem = refusals.machine_problem(cfg)
    if problem:
        lines.append(f"this machine: {problem}")
    lines.append(f"liger_fsdp: on (backend {cfg.backend}); stage {finetuning_args.stage}; first-step exactness guard "
                 f"{'on' if cfg.guard else 'off (`liger_fsdp_guard: false`)'}.")
    if cfg.sharding.kind == sharding.NONE:
        lines.append("sharding: none as one process; under `accelerate launch` it is what the accelerate config says "
                     "(FSDP, DeepSpeed or DDP: give it as `--accelerate-config <file>`), under torchrun "
                     "(FORCE_TORCHRUN=1) DDP unless the yaml sets `fsdp` or `deepspeed`.")
    else:
        lines.append(f"sharding: {cfg.sharding.label} (from {cfg.sharding.source}).")
    if cfg.sharding.kind == sharding.DEEPSPEED and cfg.sharding.zero_stage == 3 and (raw.get("bf16") or raw.get("fp16")):
        lines.append("dtypes: DeepSpeed ZeRO-3 in 16 bits: trainable parameters of mixed dtypes are cast to the compute "
                     "dtype after loading, as DeepSpeed does itself under ZeRO-0/1/2 (fp32 masters in its optimizer).")
    decision = predict.decide(model_args, finetuning_args)
    if decision.family:
        quirks = f" (quirks: {', '.join(decision.quirks)})" if decision.quirks else ""
        lines.append(f"model type {decision.family}{quirks}.")
        if decision.model_class:
            lines.append(f"model class {decision.model_class} (the class LLaMA-Factory builds for it).")
    if decision.error:
        return False, lines + [f"error: {decision.error}"]
    if decision.note:
        lines.append(decision.note + ".")
    if decision.not_engaged:
        return True, lines + [f"not engaged: {decision.not_engaged}; the plain loss has nothing to fix (the run trains)."]
    if getattr(training_args, "label_smoothing_factor", 0):
        lines.append(f"label_smoothing_factor {training_args.label_smoothing_factor}: the fused kernel computes the "
                     "smoothed loss for causal-LM classes; for image-text classes the Trainer smooths the full logits "
                     "itself and the fused path is bypassed (the run trains correctly, without the memory saving).")
    if decision.head:
        where = "on the meta-device model LLaMA-Factory would build" if decision.family else "from the yaml alone"
        lines.append(f"will engage: {decision.head} (decided {where}).")
    if cfg.sharding.fsdp_version:
        sd = os.environ.get("FSDP_STATE_DICT_TYPE") or (
            "FULL_STATE_DICT (set at load time for an FSDP2 adapter run)" if cfg.sharding.fsdp_version == 2 and
            finetuning_args.finetuning_type in ("lora", "oft") else "accelerate's default")
        lines.append(f"checkpoints: state dict {sd}.")
    return True, lines
