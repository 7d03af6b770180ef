"""Never resume from a half-written checkpoint, and make FSDP2 adapter runs write their adapter.

* :func:`check_resume` (parse time): an explicit ``resume_from_checkpoint`` must be complete
  (:func:`incomplete`), else one clear error. :func:`skip_incomplete` wraps the ``get_last_checkpoint`` that
  LLaMA-Factory's parser calls to pick a checkpoint from ``output_dir`` by itself (it takes the highest
  ``checkpoint-N`` whatever its state): an incomplete one is skipped for the newest complete one *before*
  LLaMA-Factory logs its ``Resuming training from ...`` line, so that line names the right checkpoint and the
  plugin's line only says what was skipped and why. "Complete" is decided from what each writer writes last
  (Trainer: ``trainer_state.json``; ``torch.save``: the zip directory; safetensors: header offsets =
  file size; DCP: ``.metadata``), so no file has to be read in full.
* :func:`use_full_state_dict` (load time, with the flag on, whether or not the loss engages): an adapter run under
  FSDP2 with no state-dict type chosen gets ``FULL_STATE_DICT`` (one log line says so and why): with accelerate's
  FSDP2 default, ``SHARDED_STATE_DICT``, ``Trainer.save_model`` writes no adapter at all and a resume loads no Adam
  moments (DCP loads into the empty state of a fresh optimizer). An explicit ``SHARDED_STATE_DICT`` with an adapter
  is one clear error at parse time (:func:`refuse_sharded_state_dict`).
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from typing import Any

from .._log import info_rank0
from ..config import LigerFsdpConfigError

ADAPTER_FINETUNING = ("lora", "oft")
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


# --------------------------------------------------------------------------- the state-dict type
def _adapter_under_fsdp(sharding: Any, finetuning_args: Any) -> int | None:
    version = getattr(sharding, "fsdp_version", None)
    if version is None or getattr(finetuning_args, "finetuning_type", None) not in ADAPTER_FINETUNING:
        return None
    return version


def refuse_sharded_state_dict(sharding: Any, finetuning_args: Any) -> None:
    """Parse time (no side effect): an explicit ``SHARDED_STATE_DICT`` with an adapter under FSDP is refused."""
    if _adapter_under_fsdp(sharding, finetuning_args) is None:
        return
    if os.environ.get("FSDP_STATE_DICT_TYPE", "").strip().upper() in ("SHARDED_STATE_DICT", "2"):
        raise LigerFsdpConfigError(
            "`liger_fsdp: true` with a LoRA adapter under FSDP does not work with `fsdp_state_dict_type: "
            "SHARDED_STATE_DICT` (env FSDP_STATE_DICT_TYPE): the Trainer then saves no adapter at all and a resume "
            "loses the optimizer's moments. Fix: set `fsdp_state_dict_type: FULL_STATE_DICT` in the accelerate config "
            "(or FSDP_STATE_DICT_TYPE=FULL_STATE_DICT in the environment)."
        )


def use_full_state_dict(sharding: Any, finetuning_args: Any):
    """Load time, before the Trainer builds its accelerator: an FSDP2 adapter run with no state-dict type chosen
    gets ``FULL_STATE_DICT`` (one log line). Returns the undo (or None when nothing was set)."""
    if _adapter_under_fsdp(sharding, finetuning_args) != 2 or os.environ.get("FSDP_STATE_DICT_TYPE", "").strip():
        return None
    os.environ["FSDP_STATE_DICT_TYPE"] = "FULL_STATE_DICT"
    info_rank0(
        "[liger_fsdp] FSDP2 + adapter: using fsdp_state_dict_type FULL_STATE_DICT (accelerate's FSDP2 default, "
        "SHARDED_STATE_DICT, saves no adapter); set FSDP_STATE_DICT_TYPE to choose yourself."
    )
    return lambda: os.environ.pop("FSDP_STATE_DICT_TYPE", None)


def resumed_step(training_args: Any) -> int:
    """The global step of the checkpoint this run resumes from (0 for a fresh run)."""
    path = getattr(training_args, "resume_from_checkpoint", None)
    if not isinstance(path, str) or not path:
        return 0
    try:
        with open(os.path.join(path, "trainer_state.json"), encoding="utf-8") as f:
            return int(json.load(f).get("global_step", 0))
    except (OSError, ValueError, TypeError):
        return 0


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


def check_resume(training_args: Any) -> None:
    """An explicit ``resume_from_checkpoint`` must be a complete checkpoint (see the module docstring)."""
    path = getattr(training_args, "resume_from_checkpoint", None)
    if not isinstance(path, str) or not path or not os.path.isdir(path):
        return  # nothing to resume, or transformers' own errors apply
    reason = incomplete(path)
    if reason is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    good = [p for p in complete_checkpoints(parent) if os.path.abspath(p) != os.path.abspath(path)]
    hint = f"point `resume_from_checkpoint` at a complete one (newest: {good[0]})" if good else (
        "point `resume_from_checkpoint` at a complete checkpoint, or remove the key to start over"
    )
    raise LigerFsdpConfigError(
        f"`resume_from_checkpoint: {path}` is an incomplete checkpoint: {reason}. The run that wrote it was "
        f"interrupted while saving. Fix: {hint}."
    )


def skip_incomplete(get_last_checkpoint):
    """``get_last_checkpoint(folder)`` that passes over incomplete checkpoints (one log line each run)."""

    def last_complete(folder: str):
        newest = get_last_checkpoint(folder)
        reason = incomplete(newest) if newest is not None else None
        if reason is None:
            return newest
        good = complete_checkpoints(folder)
        if not good:
            raise LigerFsdpConfigError(
                f"`output_dir` {folder} holds no complete checkpoint to resume from ({newest}: {reason}). "
                "Fix: delete the incomplete checkpoint-* directories, or set `overwrite_output_dir: true` to start over."
            )
        info_rank0(f"[liger_fsdp] resume: {newest} is incomplete ({reason}); skipped")
        return good[0]

    return last_complete
