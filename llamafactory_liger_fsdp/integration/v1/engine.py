"""The patches of :mod:`.` for LLaMA-Factory's v1 engine (``USE_V1=1``): the plugin as v1's kernel ``liger_fsdp``.

Always (hooked modules, :mod:`...hooked`):

* ``llamafactory.v1.launcher.launch`` -- the launching process checks the yaml (:mod:`...v1_args`) before any rank
  starts: one error, printed once, last.
* ``llamafactory.v1.config.arg_parser.get_args`` -- every rank validates ``kernel_config``'s keys, decides the sharding
  and keeps the run's config (0.9.5 never hands ``kernel_config`` to a kernel).
* the kernel registry of ``llamafactory.v1.plugins.model_plugins.kernels.interface`` -- entry ``liger_fsdp``: a
  function (0.9.5) or a ``BaseKernel`` class (git main). v1 applies kernels after PEFT, before sharding; the entry
  engages the model (:func:`engage_v1`).

Once a model engaged: :mod:`.v1_train` (``BaseTrainer.compute_log_probs``, v1's FSDP2 ``fully_shard``), :mod:`.layers`
(v1's FSDP2 layer finder, where it misses the decoder layers) and, in a DPO run, :mod:`.v1_dpo`. A score-head model
of an RM run under CP is not engaged: :mod:`.cp_rm` takes its loss.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import sys
from types import SimpleNamespace
from typing import Any

from ... import _log, _patch, config, sharding, versions
from ..._log import say_once
from ...config import LigerFsdpConfigError
from . import args as v1_args
from .. import stop
from ..common import SAID_DISABLED, SAID_NO_EFFECT, SAID_VERSIONS, read_model_config, refused, zero3_dtypes

COMMANDS = ("train", "sft", "dpo", "rm")
_RUN: dict[str, Any] = {"config": None}  # this run's config, from get_args (reset when a run starts)


def takes_list() -> bool:
    """Whether the installed v1 takes a comma-separated list in ``kernel_config.name`` (git main's
    ``apply_kernels``; 0.9.5 looks the whole string up); True where v1's registry cannot be imported here."""
    try:
        from llamafactory.v1.plugins.model_plugins.kernels import interface
    except Exception:
        return True
    return hasattr(interface, "apply_kernels")


def check_kernel_config(kernel_config: Any) -> config.LigerFsdpConfig:
    """The plugin's config of a ``kernel_config`` and the refusals of its form (launcher, every rank, doctor)."""
    cfg = v1_args.config_of(kernel_config)
    v1_args.check_name_form(kernel_config, takes_list())
    if v1_args.NAME in v1_args.names(kernel_config):
        say_once(SAID_NO_EFFECT, config.no_effect_line(v1_args.plugin_config(kernel_config)))
    return cfg


# --------------------------------------------------------------------------- launcher and parser
def model_config_of(raw: dict):
    """The model config of a v1 yaml (``model:``), read as training reads it; the exception where it cannot be read."""
    try:
        return read_model_config(SimpleNamespace(model_name_or_path=raw.get("model"),
                                                 trust_remote_code=bool(raw.get("trust_remote_code"))))
    except Exception as exc:
        return exc


def precheck(command: str, argv: list[str]) -> None:
    """What the yaml alone decides, in the launching process (the ranks repeat it in get_args)."""
    raw = v1_args.read_raw(argv)
    if raw is None:
        return
    v1_args.top_level_keys(raw)
    cfg = check_kernel_config(raw.get(v1_args.KEY))
    if not cfg.enabled:
        return
    v1_args.check(command, raw, cfg)
    model_config = model_config_of(raw)
    if not isinstance(model_config, Exception):  # not readable here (hub id offline, ...): checked at build time
        from ... import families

        families.family_of(getattr(model_config, "model_type", None))
    say_once(SAID_VERSIONS, versions.note(cfg.guard))


def patch_v1_launcher(launcher_module: Any) -> None:
    _patch.require_params(launcher_module.launch, (), "launch")

    def make(original):
        def launch_():
            _log.new_run()
            _RUN["config"] = None
            if sys.argv[1:2] and sys.argv[1] in COMMANDS:
                try:
                    precheck(sys.argv[1], sys.argv[2:])
                except LigerFsdpConfigError as exc:
                    refused(exc)
            with _log.handed_on():
                return stop.run_collecting(original)  # the ranks' stops printed last

        return launch_

    _patch.apply(launcher_module, "launch", make, "v1: refuse what the yaml alone decides before any rank starts")


def before_parse(args: Any) -> None:
    """What v1's parser would stop on before the plugin sees the parsed arguments: CP keys in the spelling the
    installed v1 does not read (0.9.5: a top-level ``cp_size`` is an unknown key) -- refused with the launcher's text."""
    try:
        raw = args if isinstance(args, dict) else v1_args.read_raw(sys.argv[1:]) if args is None else None
    except Exception:  # not readable here: v1's parser says why
        return
    if isinstance(raw, dict) and v1_args.NAME in v1_args.names(raw.get(v1_args.KEY)):
        if v1_args.config_of(raw.get(v1_args.KEY)).enabled:
            v1_args.cp_args.check_spelling(raw)


def patch_v1_parser(parser_module: Any) -> None:
    _patch.require_params(parser_module.get_args, ("args",), "v1 get_args")

    def make(original):
        def get_args(args=None):
            _log.new_run()
            _RUN["config"] = None
            with _log.one_message_per_run():
                before_parse(args)
            result = original(args)
            model_args, training_args = result[0], result[2]
            with _log.one_message_per_run():
                cfg = check_kernel_config(getattr(model_args, v1_args.KEY, None))
                if cfg.enabled:
                    values = v1_args.values_of(model_args, training_args)
                    v1_args.check(None, values, cfg)
                    cfg = dataclasses.replace(cfg, sharding=v1_args.decide_sharding(values, os.environ))
            if cfg.enabled:
                _patch.log_once()
                say_once(SAID_VERSIONS, versions.note(cfg.guard))
            _RUN["config"] = cfg
            return result

        return get_args

    _patch.apply(parser_module, "get_args", make, "v1: validate kernel_config's liger_fsdp keys, decide the sharding")


# --------------------------------------------------------------------------- the kernel registry
def _kernel_class(base: type) -> type:
    class LigerFsdpKernel(base):
        """v1 kernel ``liger_fsdp``: exact fused log-probs through the units that own the head."""

        @staticmethod
        def check_device() -> None:
            return None  # any device: the Triton kernels on CUDA, the torch backend elsewhere

        @staticmethod
        def _apply(**kwargs: Any):
            return engage_v1(kwargs["model"], kwargs.get("config"))

    return LigerFsdpKernel


def patch_v1_kernels(interface_module: Any) -> None:
    """Register ``liger_fsdp`` in the registry shape of the installed v1 (its line says which one)."""
    plugin = getattr(interface_module, "KernelPlugin", None)
    registry = getattr(plugin, "_registry", None)
    if plugin is None or not isinstance(registry, dict):
        raise _patch.PatchError("v1's KernelPlugin registry not found")
    if hasattr(interface_module, "apply_kernels"):  # git main: BaseKernel classes, apply(model=, config=, ...)
        base = getattr(importlib.import_module(interface_module.__package__ + ".base"), "BaseKernel", None)
        if base is None:
            raise _patch.PatchError("v1's BaseKernel not found")
        _patch.put(registry, v1_args.NAME, _kernel_class(base), "v1 kernel `liger_fsdp` (registry of BaseKernel "
                   "classes, git main)", f"{plugin.__module__}.KernelPlugin[{v1_args.NAME!r}]")
    elif "method_name" in inspect.signature(plugin.register).parameters:  # 0.9.5: functions, (model, include_kernels)
        def apply_liger_fsdp(model: Any, include_kernels: Any = None, **kwargs: Any):
            return engage_v1(model, None)

        _patch.put(registry[v1_args.NAME], "__call__", apply_liger_fsdp, "v1 kernel `liger_fsdp` (registry of "
                   "functions, 0.9.5)", f"{plugin.__module__}.KernelPlugin[{v1_args.NAME!r}]")
    else:
        raise _patch.PatchError("v1's KernelPlugin registry has an unknown shape")


def run_config(kernel_config: Any = None) -> config.LigerFsdpConfig:
    """This run's config: get_args' (with the sharding), else read from the kernel's own ``kernel_config``."""
    return _RUN["config"] or v1_args.config_of(kernel_config if kernel_config is not None else
                                               {"name": v1_args.NAME})


def engage_v1(model: Any, kernel_config: Any = None):
    """v1's kernel entry: engage the (PEFT) model for log-probs requests and patch what this run needs."""
    from ... import engage, fingerprints

    cfg = run_config(kernel_config)
    if not cfg.enabled:
        say_once(SAID_DISABLED, f"[liger_fsdp] {v1_args.disabled_cause()}: kernel `{v1_args.NAME}` does nothing; this "
                                "run trains as without the plugin.")
        return model
    causal_lm = engage.causal_lm_of(model)
    from . import cp as v1_cp
    from . import cp_rm as v1_cp_rm

    if causal_lm.get_output_embeddings() is None and v1_cp_rm.rm_run() and v1_cp.cp_size() > 1:
        engage.record_undo(model, v1_cp_rm.patch(model, cfg))  # RM under CP: the CP part only (a score head)
        fingerprints.settle(cfg.guard)  # the upstream code this run depends on, against what CI saw
        return model
    if causal_lm.get_output_embeddings() is None:
        raise LigerFsdpConfigError(
            f"`{v1_args.KEY}.name: {v1_args.NAME}`: {type(causal_lm).__name__} has no output embedding (lm_head), so "
            f"there are no vocabulary log-probs to fuse. Fix: {v1_args.REMOVE}.")
    done = engage.engage(model, cfg, any_head=True, request_only=True)
    if done is None:
        return model
    from . import dpo as v1_dpo
    from . import train as v1_train

    # process-wide patches, held by every engaged model: undone when the last one disengages
    engage.hold(model, "v1 compute_log_probs", v1_train.patch_compute_log_probs)
    engage.hold(model, "v1 DPOTrainer", lambda: v1_dpo.patch(cfg))  # a DPO run (its trainer module is loaded) only
    engage.record_undo(model, v1_cp.patch(model))  # Ulysses sequence parallelism (cp_size > 1) only
    from . import cp_dpo as v1_cp_dpo

    engage.hold(model, "v1 DPOTrainer under CP", lambda: v1_cp_dpo.patch(v1_cp.cp_size()))  # DPO, cp_size > 1
    if getattr(cfg.sharding, "kind", None) == sharding.FSDP2:
        engage.hold(model, "v1 fully_shard", v1_train.patch_fully_shard)
        from . import layers as v1_layers

        v1_layers.patch(model)  # each decoder layer a unit where v1's finder misses them (0.9.5, a PeftModel)
    if getattr(cfg.sharding, "kind", None) == sharding.DEEPSPEED and cfg.sharding.zero_stage == 3:
        engage.record_undo(model, zero3_dtypes(model))  # v1 loads under zero.init too
    fingerprints.settle(cfg.guard)  # the upstream code this run depends on, against what CI saw
    return model
