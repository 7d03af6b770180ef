"""Patch 6 of :mod:`.` : FSDP2 adapter checkpoints as full tensors (:mod:`..checkpoint.repair`), applied
only where the installed accelerate loses them and ``liger_fsdp_checkpoint_repair`` is on."""

from __future__ import annotations

from typing import Any

from .. import _patch
from .._log import info_rank0
from ..checkpoint import repair


def patch_checkpointing(cfg: Any) -> None:
    if not repair.needed():
        return  # accelerate >= 1.15 saves and loads FSDP2 adapters correctly
    if not cfg.checkpoint_repair:
        info_rank0("[liger_fsdp] liger_fsdp_checkpoint_repair: false -- FSDP2 adapter checkpoints are saved as this "
                   f"accelerate (< {repair.FIXED_IN}) ships them: rank 0's shards only, not resumable on other ranks.")
        return
    try:
        import transformers.trainer as trainer_module
    except ImportError:  # pragma: no cover
        return
    try:
        for name, make in (("save_fsdp_model", repair.make_save), ("load_fsdp_model", repair.make_load)):
            fn = getattr(trainer_module, name, None)
            if fn is None:
                raise _patch.PatchError(f"transformers.trainer.{name} not found")
            _patch.require_params(fn, ("fsdp_plugin", "accelerator", "model", "adapter_only"), f"transformers.trainer.{name}")
            _patch.apply(trainer_module, name, make, "FSDP2 adapter checkpoints hold full tensors and resume on every rank")
    except _patch.PatchError as exc:
        info_rank0(f"[liger_fsdp] warning: {exc}; FSDP2 adapter checkpoints are saved and loaded as accelerate ships them.")
