"""FSDP2 adapter checkpoints that resume, where the installed accelerate loses them (accelerate < 1.15).

With accelerate <= 1.14 (the 1.11 that LLaMA-Factory 0.9.5 pins included; checked in the sources of
1.11-1.15), ``Trainer._save_checkpoint`` -> ``save_fsdp_model(adapter_only=True)`` with
``FULL_STATE_DICT`` pickles PEFT's adapter state dict as is -- FSDP2 DTensors, so
``pytorch_model_fsdp.bin`` holds only rank 0's shard of every tensor -- and ``load_fsdp_model`` gives
every rank but 0 an empty dict (``KeyError: ...embed_tokens.weight`` on resume). accelerate 1.15.0 is
the first release that writes full tensors there (``get_model_state_dict(full_state_dict,
ignore_frozen_params)``); from 1.15 on this module stays out of the way (:func:`needed`).

:func:`make_save` / :func:`make_load` replace ``save_fsdp_model`` / ``load_fsdp_model`` *as
``transformers.trainer`` binds them* for exactly one case -- FSDP2, PEFT model, ``adapter_only``,
``FULL_STATE_DICT`` -- and delegate every other case. Save: accelerate 1.15's own format (full tensors
of the trained parameters under the model's names, written by rank 0 to a temp file then
``os.replace``), so these checkpoints resume without the plugin on accelerate >= 1.15. Load accepts the
three formats in the wild: model names (the plugin's, accelerate >= 1.15's) via ``set_model_state_dict``
(each rank keeps its own shard, no communication); PEFT adapter keys; and the rank-0 DTensor shards of
accelerate <= 1.14, for which the checkpoint's ``adapter_model.safetensors`` (full tensors, written by
``Trainer.save_model``) is read instead, with one log line. The optimizer half (full optimizer state
dict) is correct as shipped and left alone. Switch: ``liger_fsdp_checkpoint_repair`` (default true).
"""

from __future__ import annotations

import os
from typing import Any

from .. import thirdparty
from .._log import info_rank0
from ..config import LigerFsdpConfigError

FIXED_IN = "1.15.0"  # first accelerate release that saves FSDP2 adapters as full tensors


def needed() -> bool:
    """Whether the installed accelerate loses FSDP2 adapter checkpoints."""
    import accelerate

    from .. import versions

    return not versions.at_least(accelerate.__version__, FIXED_IN)


def _handles(fsdp_plugin: Any, model: Any, adapter_only: bool) -> bool:
    if not adapter_only or int(getattr(fsdp_plugin, "fsdp_version", 1) or 1) != 2:
        return False
    if "FULL_STATE_DICT" not in str(getattr(fsdp_plugin, "state_dict_type", "")):
        return False
    return thirdparty.is_peft_model(model)


def _weights_name(model_index: int) -> str:
    from accelerate.utils.constants import FSDP_MODEL_NAME

    return f"{FSDP_MODEL_NAME}.bin" if model_index == 0 else f"{FSDP_MODEL_NAME}_{model_index}.bin"


def _full_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def make_save(original):
    """Replacement for accelerate's ``save_fsdp_model`` (same signature; see module docstring)."""

    def save_fsdp_model(fsdp_plugin, accelerator, model, output_dir, model_index=0, adapter_only=False, **kwargs):
        if not _handles(fsdp_plugin, model, adapter_only):
            return original(fsdp_plugin, accelerator, model, output_dir, model_index=model_index,
                            adapter_only=adapter_only, **kwargs)
        import torch
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        os.makedirs(output_dir, exist_ok=True)
        # Full tensors of the trained parameters under the model's own names -- the format accelerate
        # itself writes once fixed (>= 1.15), so these checkpoints resume without the plugin there.
        # A collective on every rank; with cpu_offload only rank 0 receives the values.
        state = get_model_state_dict(model, options=_full_options(cpu_offload=True, ignore_frozen_params=True))
        if accelerator.process_index == 0:
            target = os.path.join(output_dir, _weights_name(model_index))
            tmp = target + ".tmp"
            torch.save(state, tmp)
            os.replace(tmp, target)
        accelerator.wait_for_everyone()

    return save_fsdp_model


def _read_full(input_dir: str, model_index: int, model: Any) -> tuple[str, dict, str]:
    """The checkpoint's full trained tensors: ("model", {model name: tensor}) or ("peft", {adapter key: tensor})."""
    import torch

    path = os.path.join(input_dir, _weights_name(model_index))
    if os.path.isfile(path):
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not any(thirdparty.is_dtensor(v) for v in state.values()):
            trained = {n for n, p in model.named_parameters() if p.requires_grad}
            return ("model" if trained & set(state) else "peft"), state, path
    fallback = os.path.join(input_dir, "adapter_model.safetensors")
    if os.path.isfile(fallback):
        from safetensors.torch import load_file

        info_rank0(
            f"[liger_fsdp] resume: {path} holds only rank 0's FSDP2 shards (written without the plugin); "
            f"loading the full adapter from {fallback} instead"
        )
        return "peft", load_file(fallback, device="cpu"), fallback
    raise LigerFsdpConfigError(
        f"`resume_from_checkpoint: {input_dir}` has no full adapter weights: {path} holds only rank 0's FSDP2 shards "
        "(or is missing) and there is no adapter_model.safetensors. Fix: resume from a checkpoint written with "
        "`fsdp_state_dict_type: FULL_STATE_DICT`, or start the run over."
    )


def _mismatch(input_dir: str, source: str, what: str) -> LigerFsdpConfigError:
    return LigerFsdpConfigError(
        f"`resume_from_checkpoint: {input_dir}` does not match this model: {source} {what}. Fix: resume with the "
        "same `lora_target` / `additional_target` / `lora_rank` as the run that wrote it."
    )


def make_load(original):
    """Replacement for accelerate's ``load_fsdp_model`` (same signature; see module docstring)."""

    def load_fsdp_model(fsdp_plugin, accelerator, model, input_dir, model_index=0, adapter_only=False, **kwargs):
        if not _handles(fsdp_plugin, model, adapter_only):
            return original(fsdp_plugin, accelerator, model, input_dir, model_index=model_index,
                            adapter_only=adapter_only, **kwargs)
        from torch.distributed.tensor import distribute_tensor

        accelerator.wait_for_everyone()
        style, saved, source = _read_full(input_dir, model_index, model)
        if style == "model":
            # every rank holds the full tensors: torch keeps each rank's own shard, no communication
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
            missing = sorted(set(trained) - set(saved))
            if missing:
                raise _mismatch(input_dir, source, f"lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}")
            for name, param in trained.items():
                if tuple(saved[name].shape) != tuple(param.shape):
                    raise _mismatch(input_dir, source, f"has {name} of shape {tuple(saved[name].shape)}, this model "
                                    f"{tuple(param.shape)}")
            result = set_model_state_dict(model, saved, options=_full_options(strict=False))
            accelerator.wait_for_everyone()
            return result
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        live = get_peft_model_state_dict(model, adapter_name=model.active_adapter)
        missing = sorted(set(live) - set(saved))
        if missing:
            raise _mismatch(input_dir, source, f"lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}")
        ready = {}
        for key, like in live.items():
            value = saved[key].to(dtype=like.dtype)
            if tuple(value.shape) != tuple(like.shape):
                raise _mismatch(input_dir, source, f"has {key} of shape {tuple(value.shape)}, this model "
                                f"{tuple(like.shape)}")
            if thirdparty.is_dtensor(like):  # every rank holds the full tensor: keep its own shard, no communication
                value = distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
            ready[key] = value
        result = set_peft_model_state_dict(model, ready, adapter_name=model.active_adapter)
        accelerator.wait_for_everyone()
        return result

    return load_fsdp_model
