"""The patches of :mod:`.` for LLaMA-Factory's v1 engine (``USE_V1=1``): the plugin as v1's kernel ``liger_fsdp``.

Always (hooked modules, :mod:`...hooked`):

* ``llamafactory.v1.launcher.launch`` -- the launching process checks the yaml (:mod:`...v1_args`) before any rank
  starts: one error, printed once, last.
* ``llamafactory.v1.config.arg_parser.get_args`` -- every rank validates ``kernel_config``'s keys, decides the sharding
  and keeps the run's config (0.9.5 never hands ``kernel_config`` to a kernel).
* the kernel registry of ``llamafactory.v1.plugins.model_plugins.kernels.interface`` -- entry ``liger_fsdp``: a
  function (0.9.5) or a ``BaseKernel`` class (git main). v1 applies kernels after PEFT, before sharding; the entry
  engages the model (:func:`engage_v1`).

Once a model engaged (recorded on it, undone by :func:`...engage.disengage`):

* ``llamafactory.v1.core.base_trainer.BaseTrainer.compute_log_probs`` -- every v1 trainer's ``logits.float()`` +
  ``cross_entropy(reduction="none")``, answered by :func:`...forward.token_logps` (the loss seam's per-row kernel,
  through the head's units). The inputs are the original method's own: it runs with a stand-in model that records
  them (device moves, git main's mRoPE ``position_ids`` pop).
* v1's ``DPOTrainer`` (a DPO run, git main): :mod:`.v1_dpo`.
* ``llamafactory.v1.plugins.trainer_plugins.distributed.fsdp2.fully_shard`` (FSDP2 only) -- before a module is
  sharded, its tagged head modules that are not units yet become units: a full/freeze head and a LoRA head's
  ``base_layer`` (v1 already makes every trainable leaf a unit under LoRA, a ``modules_to_save`` head included); a
  module that is a unit already is left as it is (v1 itself shards an untied ``modules_to_save: [embed_tokens]`` copy
  twice and stops on the second call, with or without the plugin).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import sys
from types import SimpleNamespace
from typing import Any

from .. import _patch, config, refusals, sharding, thirdparty, v1_args, versions, wrapping
from .._log import info_rank0
from ..config import LigerFsdpConfigError
from .llamafactory import SAID_ENV, SAID_VERSIONS_ENV, _say_once, read_model_config

COMMANDS = ("train", "sft", "dpo", "rm")
_RUN: dict[str, Any] = {"config": None}  # this process's config, from get_args


# --------------------------------------------------------------------------- launcher and parser
def precheck(command: str, argv: list[str]) -> None:
    """What the yaml alone decides, in the launching process (the ranks repeat it in get_args)."""
    raw = v1_args.read_raw(argv)
    if raw is None:
        return
    v1_args.top_level_keys(raw)
    cfg = v1_args.config_of(raw.get(v1_args.KEY))
    if not cfg.enabled:
        return
    v1_args.check(command, raw)
    problem = refusals.machine_problem(cfg)
    if problem:
        raise LigerFsdpConfigError(problem)
    from .. import families

    try:
        model_config = read_model_config(SimpleNamespace(model_name_or_path=raw.get("model"),
                                                         trust_remote_code=bool(raw.get("trust_remote_code"))))
    except Exception:  # not readable here (hub id offline, ...): checked again when the model is built
        model_config = None
    if model_config is not None:
        families.family_of(getattr(model_config, "model_type", None))
    _say_once(SAID_VERSIONS_ENV, versions.note(cfg.guard))


def patch_v1_launcher(launcher_module: Any) -> None:
    _patch.require_params(launcher_module.launch, (), "launch")

    def make(original):
        def launch():
            if sys.argv[1:2] and sys.argv[1] in COMMANDS:
                try:
                    precheck(sys.argv[1], sys.argv[2:])
                except LigerFsdpConfigError as exc:
                    print(f"[liger_fsdp] error: {exc}", file=sys.stderr, flush=True)
                    sys.exit(1)
            return original()

        return launch

    _patch.apply(launcher_module, "launch", make, "v1: refuse what the yaml alone decides before any rank starts")


def patch_v1_parser(parser_module: Any) -> None:
    _patch.require_params(parser_module.get_args, ("args",), "v1 get_args")

    def make(original):
        def get_args(args=None):
            result = original(args)
            model_args, training_args = result[0], result[2]
            cfg = v1_args.config_of(getattr(model_args, v1_args.KEY, None))
            if cfg.enabled:
                values = v1_args.values_of(model_args, training_args)
                v1_args.check(None, values)
                problem = refusals.machine_problem(cfg)
                if problem:
                    raise LigerFsdpConfigError(problem)
                cfg = dataclasses.replace(cfg, sharding=v1_args.decide_sharding(values, os.environ))
                _patch.log_once()
                _say_once(SAID_VERSIONS_ENV, versions.note(cfg.guard))
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
    from .. import engage

    cfg = run_config(kernel_config)
    if not cfg.enabled:
        _say_once(SAID_ENV, f"[liger_fsdp] {config.DISABLE_ENV}=1: kernel "
                  f"`{v1_args.NAME}` does nothing; this run trains as without the plugin.")
        return model
    causal_lm = engage.causal_lm_of(model)
    if causal_lm.get_output_embeddings() is None:
        raise LigerFsdpConfigError(
            f"`{v1_args.KEY}.name: {v1_args.NAME}`: {type(causal_lm).__name__} has no output embedding (lm_head), so "
            f"there are no vocabulary log-probs to fuse. Fix: {v1_args.FIX_REMOVE}.")
    done = engage.engage(model, cfg, any_head=True, request_only=True)
    if done is None:
        return model
    engage.record(model, patch_compute_log_probs())
    from . import v1_dpo

    engage.record(model, v1_dpo.patch(cfg))  # a DPO run (its trainer module is loaded) only
    if getattr(cfg.sharding, "kind", None) == sharding.FSDP2:
        engage.record(model, patch_fully_shard())
    return model


# --------------------------------------------------------------------------- once engaged
class _Captured(Exception):
    pass


class _Recorder:
    """A stand-in model: records the keyword arguments the original ``compute_log_probs`` calls it with."""

    kwargs: dict | None = None

    def __call__(self, *args: Any, **kwargs: Any):
        self.kwargs = dict(kwargs) if not args else None
        raise _Captured


def unwrapped(model: Any) -> Any:
    """The model inside DDP or a DeepSpeed engine (FSDP2 keeps the model object)."""
    while thirdparty.is_module_wrapper(model):
        model = model.module
    return model


def patch_compute_log_probs() -> list:
    from llamafactory.v1.core import base_trainer

    from .. import engage, forward

    cls = base_trainer.BaseTrainer
    _patch.require_params(cls.compute_log_probs, ("self", "model", "batch"), "BaseTrainer.compute_log_probs")

    def make(original):
        def compute_log_probs(self, model, batch):
            inner = unwrapped(model)
            if engage.engaged(inner) is None:
                return original(self, model, batch)
            recorder = _Recorder()
            try:
                original(self, recorder, batch)
            except _Captured:
                pass
            if not recorder.kwargs or "labels" not in recorder.kwargs:
                raise _patch.PatchError("v1's compute_log_probs no longer calls model(**inputs) with labels; "
                                        f"{v1_args.FIX_REMOVE} and report your LLaMA-Factory version")
            inputs = recorder.kwargs
            labels = inputs.pop("labels")
            logps, _, _ = forward.token_logps(model, engage.causal_lm_of(inner), inputs, labels, sums=False,
                                              step=getattr(self, "global_step", None))
            return logps

        return compute_log_probs

    patch = _patch.apply(cls, "compute_log_probs", make, "v1: per-token log-probs from the fused kernel, no [N, V] "
                                                         "logits")
    return [] if patch is None else [lambda: _patch.undo(cls, "compute_log_probs")]


def patch_fully_shard() -> list:
    from llamafactory.v1.plugins.trainer_plugins.distributed import fsdp2

    said = []

    def make(original):
        def fully_shard(module, *args: Any, **kwargs: Any):
            if thirdparty.is_fsdp2(module):  # v1 shards a trainable nn.Embedding twice (its LoRA leaf loop, then
                if not said:                  # its embedding rule): the second call would raise; the unit exists
                    said.append(True)
                    info_rank0(f"[liger_fsdp] v1 FSDP2: {type(module).__name__} is already a unit (v1's LoRA leaf loop "
                               "and its embedding rule both shard an untied trainable embedding); left as it is.")
                return module
            for sub in list(module.modules())[1:]:
                if wrapping.is_marked(sub) and not thirdparty.is_fsdp2(sub):
                    own = dict(kwargs)
                    if own.get("ignored_params"):
                        mine = set(sub.parameters())
                        own["ignored_params"] = {p for p in own["ignored_params"] if p in mine}
                    original(sub, *args, **own)
            return original(module, *args, **kwargs)

        return fully_shard

    patch = _patch.apply(fsdp2, "fully_shard", make, "v1 FSDP2: the head modules become units of their own")
    return [] if patch is None else [lambda: _patch.undo(fsdp2, "fully_shard")]
