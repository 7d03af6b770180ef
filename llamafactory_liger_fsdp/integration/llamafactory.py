"""The LLaMA-Factory patches of :mod:`.` that are always in place for the default engine: its parser and loader (the
launching processes: :mod:`.launch`; v1's: :mod:`.v1`)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from .. import _log, _patch, config, refusals, sharding, thirdparty, versions
from .._log import info_rank0, say_once
from ..checkpoint import resume
from ..config import LigerFsdpConfigError
from .common import SAID_DISABLED, SAID_NO_EFFECT, SAID_VERSIONS, read_model_config, zero3_dtypes


def _log_disabled(ours: dict) -> None:
    if ours:
        say_once(SAID_DISABLED, f"[liger_fsdp] {config.DISABLE_ENV}=1: the liger_fsdp keys are accepted and ignored; "
                                "this run trains as without the plugin.")


# --------------------------------------------------------------------------- the parser
def config_from_args(raw: Any, say: bool = True) -> tuple[Any, config.LigerFsdpConfig]:
    """The raw arguments without our keys, and our validated config (off when disabled by the env; misspelled
    keys are an error either way); ``say``: the run's once-said lines about the keys."""
    rest, ours = config.split(raw)
    if say:
        say_once(SAID_NO_EFFECT, config.no_effect_line(ours))
    if config.disabled_by_env():
        config.check_names(ours)
        if say:
            _log_disabled(ours)
        return rest, config.LigerFsdpConfig()
    return rest, config.from_mapping(ours)


#: Set by _parse_args: whether the arguments get_train_args is parsing turn the plugin on; set by get_train_args:
#: whether a parse is its own (another parse, get_ray_args' first, says nothing).
_PARSED = {"enabled": False, "training": False}


def patch_parser(parser_module: Any) -> None:
    """``_parse_args`` (the keys, the run's config and refusals) and ``get_train_args`` (the checks after it)."""
    _patch_parse_args(parser_module)
    _patch_get_train_args(parser_module)


def _patch_parse_args(parser_module: Any) -> None:
    _patch.require_params(parser_module._parse_args, ("parser", "args", "allow_extra_keys"), "_parse_args")
    read_args = parser_module.read_args

    def make(original):
        def _parse_args(parser, args=None, allow_extra_keys=False):
            with _log.one_message_per_run():
                rest, cfg = config_from_args(read_args(args), say=_PARSED["training"])
            _PARSED["enabled"] = cfg.enabled
            result = original(parser, rest, allow_extra_keys=allow_extra_keys)
            parsed = thirdparty.parsed_args(result)
            if cfg.enabled and "training" in parsed and "finetuning" in parsed:
                training = parsed["training"]
                cfg = dataclasses.replace(
                    cfg, sharding=sharding.decide(training),
                    grad_accum=int(getattr(training, "gradient_accumulation_steps", 1) or 1),
                    label_smoothing=float(getattr(training, "label_smoothing_factor", 0.0) or 0.0))
                with _log.one_message_per_run():  # before LLaMA-Factory's own checks; again once it derived its own
                    refusals.check_parsed(parsed, cfg.sharding, cfg)
            if "finetuning" in parsed:
                setattr(parsed["finetuning"], config.ATTR, cfg)
            return result

        return _parse_args

    _patch.apply(parser_module, "_parse_args", make, "accept and validate the liger_fsdp keys")


def _patch_get_train_args(parser_module: Any) -> None:
    # LLaMA-Factory picks the checkpoint to resume from (get_last_checkpoint of output_dir) in
    # get_train_args *after* _parse_args returns, so the resume check wraps get_train_args.
    _patch.require_params(parser_module.get_train_args, ("args",), "get_train_args")

    def make_train(original):
        def get_train_args(args=None):
            _log.new_run()
            last = getattr(parser_module, "get_last_checkpoint", None)
            if last is not None:  # with the plugin on (known once _parse_args ran), auto-resume skips half-written ones
                skipping = resume.skip_incomplete(last)
                parser_module.get_last_checkpoint = lambda folder: (skipping if _PARSED["enabled"] else last)(folder)
            _PARSED.update(enabled=False, training=True)
            try:
                result = original(args)
            finally:
                _PARSED["training"] = False
                if last is not None:
                    parser_module.get_last_checkpoint = last
            parsed = thirdparty.parsed_args(result)
            cfg = config.get_config(parsed.get("finetuning"))
            if cfg.enabled:  # again after LLaMA-Factory set what it derives (`use_mca`, ...)
                _patch.log_once()
                with _log.one_message_per_run():
                    refusals.check_parsed(parsed, cfg.sharding, cfg)
                    resume.refuse_sharded_state_dict(cfg.sharding, parsed["finetuning"])
                say_once(SAID_VERSIONS, versions.note(cfg.guard))
            if cfg.enabled and getattr(parsed.get("training"), "do_train", False):
                with _log.one_message_per_run():
                    resume.check_resume(parsed["training"])
                setattr(parsed["finetuning"], config.ATTR,
                        dataclasses.replace(cfg, start_step=resume.resumed_step(parsed["training"])))
            return result

        return get_train_args

    _patch.apply(parser_module, "get_train_args", make_train, "never resume from a half-written checkpoint")


# --------------------------------------------------------------------------- the model
def check_family(model_args: Any) -> None:
    """Refuse an unsupported family from the model's config alone (no weights loaded)."""
    from .. import families

    families.family_of(getattr(read_model_config(model_args), "model_type", None))


def patch_loader(loader_module: Any) -> None:
    _patch.require_params(loader_module.load_model, ("tokenizer", "model_args", "finetuning_args", "is_trainable"),
                          "load_model")

    def make(original):
        def load_model(tokenizer, model_args, finetuning_args, is_trainable=False, add_valuehead=False, **kwargs):
            cfg = config.get_config(finetuning_args)
            if cfg.enabled and not is_trainable:
                info_rank0("[liger_fsdp] not engaged: the model is loaded for inference/export, not training.")
            if not (cfg.enabled and is_trainable):
                return original(tokenizer, model_args, finetuning_args, is_trainable, add_valuehead, **kwargs)
            liger = bool(getattr(model_args, "enable_liger_kernel", False))
            with _log.one_message_per_run():
                check_family(model_args)
                model = original(tokenizer, model_args, finetuning_args, is_trainable, add_valuehead, **kwargs)
                if liger:
                    liger_needs_cuda(model)
                engage_model(model, cfg, finetuning_args, liger=liger)
            return model

        return load_model

    patch = _patch.apply(loader_module, "load_model", make, "engage the fused lm_head loss on the loaded model")
    if patch is not None:  # names bound before the hook (late activation only)
        for mod_name, mod in list(sys.modules.items()):
            if mod_name.startswith("llamafactory") and mod is not loader_module:
                _patch.rebind(mod, "load_model", patch.original, patch.replacement, "re-exported load_model")


def liger_needs_cuda(model: Any) -> None:
    """``enable_liger_kernel`` on a machine without CUDA: Liger's module kernels in the model (RMSNorm, SwiGLU, ...)
    cannot run there, with or without the plugin; refused at load time, before step 1 runs them."""
    import torch

    if torch.cuda.is_available():
        return
    try:
        import liger_kernel.transformers as liger
    except ImportError:
        return
    kinds = tuple(c for name in dir(liger) if name.startswith("Liger") and isinstance(c := getattr(liger, name), type)
                  and issubclass(c, torch.nn.Module))
    found = sorted({type(m).__name__ for m in model.modules() if isinstance(m, kinds)})
    if found:
        raise LigerFsdpConfigError(
            f"`enable_liger_kernel: true`: Liger's kernels in this model ({', '.join(found)}) need a CUDA GPU and this "
            "machine has none, so the first forward would fail in them, with or without `liger_fsdp`. Fix: set "
            "`enable_liger_kernel: false` on this machine, or run on a CUDA GPU.")


def engage_model(model: Any, cfg: config.LigerFsdpConfig, finetuning_args: Any = None, liger: bool = False):
    """Engage the fused loss on a freshly loaded model and patch only what this run needs: checkpoints for an FSDP2
    adapter run (whether or not the loss engages), then, once engaged, the DeepSpeed ZeRO-3 dtype policy, the FSDP
    wrap policy, label smoothing and the preference trainer of this stage. Every side effect is recorded on the
    engaged model and undone by :func:`..engage.disengage`; a patch of a class or module is held by every model that
    needs it (:func:`..engage.hold`) and undone when the last one disengages."""
    from .. import engage, fingerprints
    from . import accelerate, preference, trainer

    stage = getattr(finetuning_args, "stage", "sft")
    kind = getattr(cfg.sharding, "kind", None)
    undo = resume.use_full_state_dict(cfg.sharding, finetuning_args)  # checkpoints: whether or not the loss engages
    engage.record_undo(model, [undo] if undo is not None else [])
    if kind == sharding.FSDP2 and getattr(finetuning_args, "finetuning_type", None) in resume.ADAPTER_FINETUNING:
        engage.hold(model, "checkpointing", lambda: trainer.patch_checkpointing(cfg))
    done = engage.engage(model, cfg, any_head=stage in refusals.PREFERENCE_STAGES)
    if done is None:
        return None
    if kind == sharding.DEEPSPEED and cfg.sharding.zero_stage == 3:
        engage.record_undo(model, zero3_dtypes(model))
    if kind in (sharding.FSDP1, sharding.FSDP2):
        version = cfg.sharding.fsdp_version
        engage.hold(model, f"FSDP{version} wrap policy", lambda: accelerate.patch_wrap_policy(version))
    if kind == sharding.FSDP2:
        engage.hold(model, "FSDP2 prepare_model", accelerate.patch_setup_memory)
    if cfg.label_smoothing:
        engage.hold(model, "label smoothing", trainer.patch_label_smoothing)
    if stage in refusals.PREFERENCE_STAGES:
        engage.hold(model, f"{stage} trainer", lambda: preference.patch_stage(stage))
    if liger:
        info_rank0("[liger_fsdp] enable_liger_kernel: Liger's fused linear cross entropy is bypassed for this model "
                   "(the plugin computes the loss); Liger's other kernels stay.")
    fingerprints.settle(cfg.guard)  # the upstream code this run depends on, against what CI saw
    return done
