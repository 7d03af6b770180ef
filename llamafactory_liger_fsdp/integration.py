"""Every point where the plugin touches third-party code (LLaMA-Factory and accelerate).

Patch points, each guarded by a signature check, recorded in :mod:`._patch`, logged once on
rank 0 when the flag is on, and undone by :func:`unpatch`:

1. ``llamafactory.hparams.parser._parse_args`` -- takes the ``liger_fsdp*`` keys out of the yaml /
   CLI arguments before ``HfArgumentParser`` sees them (so every other unknown key is still
   rejected), validates them (:mod:`.config`) and hangs the config on ``FinetuningArguments``.
2. ``llamafactory.model.loader.load_model`` -- after LLaMA-Factory has built the (PEFT) model,
   :func:`llamafactory_liger_fsdp.head.engage` swaps in the fused forward and tags the head's
   FSDP units. Patched in the loader module right after it executes, i.e. before
   ``llamafactory.model`` re-exports it (``from .loader import load_model``); names already
   bound elsewhere are re-pointed too.
3. ``accelerate.utils.dataclasses.FullyShardedDataParallelPlugin.set_auto_wrap_policy`` (FSDP1)
   and 4. ``accelerate.utils.fsdp_utils.fsdp2_prepare_auto_wrap_policy`` (FSDP2) -- compose
   whatever policy is configured (PEFT's ``fsdp_auto_wrap_policy``, transformer-based, none) with
   "the tagged head modules are units". Applied only once a model has engaged.
5. ``transformers.trainer.save_fsdp_model`` / ``load_fsdp_model`` (accelerate's functions as the
   Trainer binds them) -- FSDP2 adapter checkpoints hold full tensors and resume on every rank
   (:mod:`.checkpoint`). Applied only once a model has engaged; every other case delegates.

Parse time, flag on: :func:`.checkpoint.check_state_dict_type` (inside patch 1: the adapter gets
saved) and :func:`.checkpoint.check_resume` (1b. ``llamafactory.hparams.parser.get_train_args``,
after LLaMA-Factory chose the checkpoint to resume from: a half-written one is never resumed).

Liger-Kernel: when ``enable_liger_kernel: true`` is also set, LLaMA-Factory still applies Liger's
kernels (RMSNorm, RoPE, SwiGLU, ...). Liger's fused loss lives in the *class* ``forward`` it
installs; our fused forward is set on the *instance*, so in training Liger's fused loss is never
called (in eval the class forward runs and computes plain logits).
"""

from __future__ import annotations

import sys
from typing import Any

from . import _patch
from ._log import info_rank0
from .config import LigerFsdpConfigError

PARSER = "llamafactory.hparams.parser"
LOADER = "llamafactory.model.loader"


def on_module_loaded(name: str, module: Any) -> None:
    """Called by the import hook right after a hooked LLaMA-Factory module has executed."""
    try:
        if name == PARSER:
            patch_parser(module)
        elif name == LOADER:
            patch_loader(module)
    except _patch.PatchError as exc:
        info_rank0(f"[liger_fsdp] cannot hook {name}: {exc}; `liger_fsdp` is unavailable in this environment")


# --------------------------------------------------------------------------- 1. the flag
def _find(result: Any, cls_name: str) -> Any:
    for item in result if isinstance(result, (tuple, list)) else ():
        if type(item).__name__ == cls_name:
            return item
    return None


def patch_parser(parser_module: Any) -> None:
    from . import checkpoint, config

    _patch.require_params(parser_module._parse_args, ("parser", "args", "allow_extra_keys"), f"{PARSER}._parse_args")
    read_args = parser_module.read_args

    def make(original):
        def _parse_args(parser, args=None, allow_extra_keys=False):
            args, cfg = config.extract(read_args(args))
            result = original(parser, args, allow_extra_keys=allow_extra_keys)
            finetuning_args = _find(result, "FinetuningArguments")
            if finetuning_args is not None:
                setattr(finetuning_args, config.ATTR, cfg)
            if cfg.enabled:
                _patch.log_once()
                training_args = _find(result, "TrainingArguments") or _find(result, "Seq2SeqTrainingArguments")
                if training_args is not None and finetuning_args is not None:
                    config.check_training_args(cfg, _find(result, "ModelArguments"), training_args, finetuning_args)
                    checkpoint.check_state_dict_type(training_args, finetuning_args)
            return result

        return _parse_args

    _patch.apply(parser_module, "_parse_args", make, "accept and validate the liger_fsdp keys")

    # LLaMA-Factory picks the checkpoint to resume from (get_last_checkpoint of output_dir) in
    # get_train_args *after* _parse_args returns, so the resume check wraps get_train_args. Patched
    # before llamafactory.hparams re-exports it (the import hook runs right after this module).
    _patch.require_params(parser_module.get_train_args, ("args",), f"{PARSER}.get_train_args")

    def make_train(original):
        def get_train_args(args=None):
            result = original(args)
            finetuning_args = _find(result, "FinetuningArguments")
            training_args = _find(result, "TrainingArguments") or _find(result, "Seq2SeqTrainingArguments")
            if finetuning_args is not None and training_args is not None and config.get_config(finetuning_args).enabled:
                if getattr(training_args, "do_train", False):
                    checkpoint.check_resume(read_args(args), training_args)
            return result

        return get_train_args

    _patch.apply(parser_module, "get_train_args", make_train, "never resume from a half-written checkpoint")


# --------------------------------------------------------------------------- 2. the model
def patch_loader(loader_module: Any) -> None:
    _patch.require_params(
        loader_module.load_model,
        ("tokenizer", "model_args", "finetuning_args", "is_trainable"),
        f"{LOADER}.load_model",
    )

    def make(original):
        def load_model(tokenizer, model_args, finetuning_args, is_trainable=False, add_valuehead=False, **kwargs):
            from . import config

            cfg = config.get_config(finetuning_args)
            if not cfg.enabled:
                return original(tokenizer, model_args, finetuning_args, is_trainable, add_valuehead, **kwargs)
            if not is_trainable:
                info_rank0("[liger_fsdp] not engaged: the model is loaded for inference/export, not training.")
                return original(tokenizer, model_args, finetuning_args, is_trainable, add_valuehead, **kwargs)
            check_before_load(loader_module, model_args, add_valuehead)
            model = original(tokenizer, model_args, finetuning_args, is_trainable, add_valuehead, **kwargs)
            engage_model(model, cfg, liger=bool(getattr(model_args, "enable_liger_kernel", False)))
            return model

        return load_model

    patch = _patch.apply(loader_module, "load_model", make, "engage the fused lm_head loss on the loaded model")
    if patch is not None:  # names bound before the hook (late activation only)
        for mod_name, mod in list(sys.modules.items()):
            if mod_name.startswith("llamafactory") and mod is not loader_module:
                _patch.rebind(mod, "load_model", patch.original, patch.replacement, "re-exported load_model")


def check_before_load(loader_module: Any, model_args: Any, add_valuehead: bool) -> None:
    """Refuse what cannot work before any weight is loaded."""
    from . import families

    if add_valuehead:
        raise LigerFsdpConfigError(
            "`liger_fsdp: true` does not work with a value head (reward/PPO models need logits). Fix: remove `liger_fsdp`."
        )
    try:
        from transformers.integrations import is_deepspeed_zero3_enabled

        zero3 = is_deepspeed_zero3_enabled()
    except ImportError:  # pragma: no cover
        zero3 = False
    if zero3:
        raise LigerFsdpConfigError(
            "`liger_fsdp: true` does not support DeepSpeed ZeRO-3 yet. Fix: use FSDP (`fsdp: full_shard auto_wrap` or "
            "an accelerate FSDP config), or ZeRO-2, or remove `liger_fsdp`."
        )
    config = loader_module.load_config(model_args)
    families.family_of(getattr(config, "model_type", None))


def engage_model(model: Any, cfg: Any, liger: bool = False):
    """Engage the fused loss on a freshly loaded model and make FSDP wrap its head units."""
    from . import head

    plan = head.engage(model, backend=cfg.kernel_backend)
    if plan is None:
        return None
    patch_accelerate()
    patch_checkpointing()
    _patch.log_once()
    if liger:
        info_rank0(
            "[liger_fsdp] enable_liger_kernel: Liger's fused linear cross entropy is bypassed for this model "
            "(the plugin computes the loss); Liger's other kernels stay."
        )
    return plan


# --------------------------------------------------------------------------- 3./4. FSDP wrapping
def patch_accelerate() -> None:
    """Make accelerate's FSDP1 and FSDP2 wrapping put each tagged head module in its own unit."""
    from . import wrapping

    try:
        from accelerate.utils import dataclasses as acc_dataclasses
        from accelerate.utils import fsdp_utils
    except ImportError:  # pragma: no cover - accelerate always comes with transformers' Trainer
        return

    plugin_cls = acc_dataclasses.FullyShardedDataParallelPlugin

    def make_v1(original):
        def set_auto_wrap_policy(self, model):
            original(self, model)
            if int(getattr(self, "fsdp_version", 1) or 1) == 1 and wrapping.has_marked_units(model):
                self.auto_wrap_policy = wrapping.fsdp1_policy(self.auto_wrap_policy)

        return set_auto_wrap_policy

    def make_v2(original):
        def fsdp2_prepare_auto_wrap_policy(fsdp2_plugin, model):
            policy = original(fsdp2_plugin, model)
            return wrapping.fsdp2_policy(policy) if wrapping.has_marked_units(model) else policy

        return fsdp2_prepare_auto_wrap_policy

    try:
        _patch.require_params(plugin_cls.set_auto_wrap_policy, ("self", "model"), "FullyShardedDataParallelPlugin.set_auto_wrap_policy")
        _patch.apply(plugin_cls, "set_auto_wrap_policy", make_v1, "FSDP1: the trained lm_head weights get their own unit")
        _patch.require_params(fsdp_utils.fsdp2_prepare_auto_wrap_policy, ("fsdp2_plugin", "model"), "fsdp2_prepare_auto_wrap_policy")
        _patch.apply(fsdp_utils, "fsdp2_prepare_auto_wrap_policy", make_v2, "FSDP2: the trained lm_head weights get their own unit")
    except _patch.PatchError as exc:
        info_rank0(
            f"[liger_fsdp] warning: {exc}. The loss stays exact (it runs through whichever unit owns the head), "
            "but the head is not split into its own FSDP unit, so it stays gathered with the root."
        )


# --------------------------------------------------------------------------- 5. checkpoints
def patch_checkpointing() -> None:
    """FSDP2 adapter checkpoints that hold full tensors and resume on every rank (:mod:`.checkpoint`)."""
    from . import checkpoint

    try:
        import transformers.trainer as trainer_module
    except ImportError:  # pragma: no cover
        return
    try:
        for name, make in (("save_fsdp_model", checkpoint.make_save), ("load_fsdp_model", checkpoint.make_load)):
            fn = getattr(trainer_module, name, None)
            if fn is None:
                raise _patch.PatchError(f"transformers.trainer.{name} not found")
            _patch.require_params(fn, ("fsdp_plugin", "accelerator", "model", "adapter_only"), f"transformers.trainer.{name}")
            _patch.apply(trainer_module, name, make, "FSDP2 adapter checkpoints hold full tensors and resume on every rank")
    except _patch.PatchError as exc:
        info_rank0(f"[liger_fsdp] warning: {exc}; FSDP2 adapter checkpoints are saved and loaded as accelerate ships them.")


def unpatch() -> None:
    """Undo every patch (tests; a process that wants LLaMA-Factory back as installed)."""
    _patch.undo_all()
