"""Checkpoints that survive: what a LoRA + trained-head run saves, resumes from and exports.

Three things break for a PEFT adapter trained under FSDP2 with the stack LLaMA-Factory 0.9.5 pins
(accelerate <= 1.11, transformers 5.x), with or without this plugin; measured on 2 CPU ranks:

1. **Resume crashes.** ``Trainer._save_checkpoint`` writes the adapter for resuming through
   accelerate's ``save_fsdp_model(adapter_only=True)``. With ``FULL_STATE_DICT`` that pickles
   PEFT's adapter state dict as-is -- FSDP2 *DTensors*, so ``pytorch_model_fsdp.bin`` holds only
   rank 0's shard of every tensor -- and ``load_fsdp_model`` gives every rank but 0 an empty dict,
   which PEFT's ``set_peft_model_state_dict`` rejects (``KeyError: ...embed_tokens.weight``).
   (accelerate 1.15 fixed this one: full tensors via ``get_model_state_dict``; 2. and 3. are
   transformers'/LLaMA-Factory's and remain.)
2. **SHARDED_STATE_DICT (accelerate's FSDP2 default) saves no adapter at all**
   (``Trainer.save_model`` writes weights only for ``FULL_STATE_DICT``), and its resume loads no
   Adam moments (DCP loads into the empty state of a fresh optimizer): the loss curve after a
   resume drifts from the uninterrupted one from the second step on.
3. **Interrupted saves look like checkpoints.** ``get_last_checkpoint`` (what LLaMA-Factory uses to
   auto-resume from ``output_dir``) picks the highest ``checkpoint-N`` directory whether or not
   its files were all written.

What the plugin does, only when ``liger_fsdp: true``:

* :func:`make_save` / :func:`make_load` replace accelerate's ``save_fsdp_model`` /
  ``load_fsdp_model`` *as the Trainer calls them* (``transformers.trainer`` binds them by name) for
  exactly one case -- FSDP2, PEFT model, ``adapter_only``, ``FULL_STATE_DICT`` -- and delegate every
  other case unchanged. Save: ``get_model_state_dict(full_state_dict, cpu_offload,
  ignore_frozen_params)`` (full tensors of the trained parameters under the model's own names),
  written by rank 0 atomically (temp file + ``os.replace``). That is the format accelerate itself
  writes since it fixed this path (seen in 1.15, which uses the same call), so a plugin checkpoint
  resumes without the plugin there. Load reads the full tensors on every rank and accepts all three
  formats in the wild: model names (the plugin's, accelerate >= 1.15's) via
  ``set_model_state_dict`` (each rank keeps its own shard, no communication); PEFT adapter keys; and
  the broken rank-0 DTensor shards of accelerate <= 1.11 -- for those the checkpoint's own
  ``adapter_model.safetensors`` (full tensors, written by ``Trainer.save_model``) is read instead,
  with one log line. So plain runs resume with the plugin on either accelerate.
* :func:`check_state_dict_type` (parse time): an adapter run under FSDP2 with no state-dict type
  chosen gets ``FULL_STATE_DICT`` (one log line says so and why); an explicit
  ``SHARDED_STATE_DICT`` with an adapter is one clear error (issue 2 above: nothing would be saved).
* :func:`check_resume` (parse time): the checkpoint to resume from must be complete
  (:func:`incomplete`). An explicit ``resume_from_checkpoint`` that is not gets one clear error; an
  incomplete one that LLaMA-Factory picked by itself from ``output_dir`` is skipped for the newest
  complete one, with one log line.

The optimizer half of a checkpoint (accelerate's ``save_fsdp_optimizer`` / ``load_fsdp_optimizer``
with full state dicts) is correct as shipped and is left alone.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from typing import Any

from ._log import info_rank0
from .config import LigerFsdpConfigError

ADAPTER_FINETUNING = ("lora", "oft")
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


# --------------------------------------------------------------------------- parse-time checks
def fsdp_version(training_args: Any) -> int | None:
    """The FSDP version this run will use (None: no FSDP): accelerate's env, else the yaml keys."""
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        return int(os.environ.get("FSDP_VERSION", "1") or 1)
    fsdp = getattr(training_args, "fsdp", None)
    if fsdp:
        cfg = getattr(training_args, "fsdp_config", None) or {}
        return int(cfg.get("version", cfg.get("fsdp_version", 1)) or 1)
    return None


def check_state_dict_type(training_args: Any, finetuning_args: Any) -> None:
    """FSDP2 + adapter: make sure the adapter is written (FULL_STATE_DICT), or say why not."""
    version = fsdp_version(training_args)
    if version is None or getattr(finetuning_args, "finetuning_type", None) not in ADAPTER_FINETUNING:
        return
    chosen = os.environ.get("FSDP_STATE_DICT_TYPE", "").strip().upper()
    if chosen in ("SHARDED_STATE_DICT", "2"):
        raise LigerFsdpConfigError(
            "`liger_fsdp: true` with a LoRA adapter under FSDP does not work with `fsdp_state_dict_type: "
            "SHARDED_STATE_DICT` (env FSDP_STATE_DICT_TYPE): the Trainer then saves no adapter at all and a resume "
            "loses the optimizer's moments. Fix: set `fsdp_state_dict_type: FULL_STATE_DICT` in the accelerate config "
            "(or FSDP_STATE_DICT_TYPE=FULL_STATE_DICT in the environment)."
        )
    if not chosen and version == 2:
        os.environ["FSDP_STATE_DICT_TYPE"] = "FULL_STATE_DICT"
        info_rank0(
            "[liger_fsdp] FSDP2 + adapter: using fsdp_state_dict_type FULL_STATE_DICT (accelerate's FSDP2 default, "
            "SHARDED_STATE_DICT, saves no adapter); set FSDP_STATE_DICT_TYPE to choose yourself."
        )


def _given(raw_args: Any, key: str) -> bool:
    if isinstance(raw_args, dict):
        return raw_args.get(key) not in (None, "")
    if isinstance(raw_args, (list, tuple)):
        return any(isinstance(a, str) and (a == f"--{key}" or a.startswith(f"--{key}=")) for a in raw_args)
    return False


def incomplete(path: str) -> str | None:
    """Why ``path`` is not a complete Trainer checkpoint (None: it is).

    Complete means: ``trainer_state.json`` (written last, by rank 0) parses; every ``.safetensors``
    file's header matches its size; every torch ``.bin/.pt/.pth`` file has its zip directory (written
    last by ``torch.save``); every DCP directory has its ``.metadata`` (written last by DCP)."""
    if not os.path.isdir(path):
        return "not a directory"
    state = os.path.join(path, "trainer_state.json")
    if not os.path.isfile(state):
        return "no trainer_state.json (the Trainer writes it last)"
    try:
        with open(state, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as exc:
        return f"trainer_state.json unreadable ({exc.__class__.__name__})"
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name.endswith((".tmp", ".partial")):
            return f"{name} is an unfinished write"
        if name.endswith(".safetensors"):
            reason = _safetensors_broken(full)
            if reason:
                return f"{name} {reason}"
        elif name.endswith((".bin", ".pt", ".pth")) and os.path.isfile(full):
            if not zipfile.is_zipfile(full):
                return f"{name} is truncated (no zip directory)"
        elif os.path.isdir(full) and name.startswith(("pytorch_model_fsdp_", "optimizer_")):
            if not os.path.isfile(os.path.join(full, ".metadata")):
                return f"{name}/ has no .metadata (distributed checkpoint not finished)"
    return None


def _safetensors_broken(path: str) -> str | None:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return "has an unreadable header"
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    if 8 + n + max(ends, default=0) != size:
        return "is truncated"
    return None


def complete_checkpoints(output_dir: str) -> list[str]:
    """``checkpoint-N`` directories of ``output_dir`` that are complete, newest first."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return []
    steps = sorted(((int(m.group(1)), n) for n in names if (m := _CHECKPOINT_RE.match(n))), reverse=True)
    paths = [os.path.join(output_dir, n) for _, n in steps]
    return [p for p in paths if incomplete(p) is None]


def check_resume(raw_args: Any, training_args: Any) -> None:
    """Never resume from a half-written checkpoint (see the module docstring)."""
    path = getattr(training_args, "resume_from_checkpoint", None)
    if not isinstance(path, str) or not path or not os.path.isdir(path):
        return  # nothing to resume, or transformers' own errors apply
    reason = incomplete(path)
    if reason is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    good = [p for p in complete_checkpoints(parent) if os.path.abspath(p) != os.path.abspath(path)]
    if _given(raw_args, "resume_from_checkpoint"):
        hint = f"point `resume_from_checkpoint` at a complete one (newest: {good[0]})" if good else (
            "point `resume_from_checkpoint` at a complete checkpoint, or remove the key to start over"
        )
        raise LigerFsdpConfigError(
            f"`resume_from_checkpoint: {path}` is an incomplete checkpoint: {reason}. The run that wrote it was "
            f"interrupted while saving. Fix: {hint}."
        )
    if not good:
        raise LigerFsdpConfigError(
            f"`output_dir` {parent} holds no complete checkpoint to resume from ({path}: {reason}). "
            "Fix: delete the incomplete checkpoint-* directories, or set `overwrite_output_dir: true` to start over."
        )
    training_args.resume_from_checkpoint = good[0]
    info_rank0(f"[liger_fsdp] resume: skipping incomplete {path} ({reason}); resuming from {good[0]}")


# --------------------------------------------------------------------------- save / load (FSDP2 adapter)
def _handles(fsdp_plugin: Any, model: Any, adapter_only: bool) -> bool:
    if not adapter_only or int(getattr(fsdp_plugin, "fsdp_version", 1) or 1) != 2:
        return False
    if "FULL_STATE_DICT" not in str(getattr(fsdp_plugin, "state_dict_type", "")):
        return False
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PeftModel)


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
    from torch.distributed.tensor import DTensor

    path = os.path.join(input_dir, _weights_name(model_index))
    if os.path.isfile(path):
        state = torch.load(path, map_location="cpu", weights_only=True)
        if not any(isinstance(v, DTensor) for v in state.values()):
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
        from torch.distributed.tensor import DTensor, distribute_tensor

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
            if isinstance(like, DTensor):  # every rank holds the full tensor: keep its own shard, no communication
                value = distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
            ready[key] = value
        result = set_peft_model_state_dict(model, ready, adapter_name=model.active_adapter)
        accelerator.wait_for_everyone()
        return result

    return load_fsdp_model
