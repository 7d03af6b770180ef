"""The accelerate patches of :mod:`.` : accelerate's FSDP1 or FSDP2 wrapping puts each tagged head module in its own
unit (the function of this run's FSDP version only); under FSDP2 its preparation leaves frozen parameters in the dtype
they were loaded in (:func:`patch_frozen_dtype`)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from .. import _patch, wrapping
from .._log import info_rank0

GIB = 2**30


def patch_wrap_policy(version: int | None) -> list[Callable[[], None]]:
    try:
        from accelerate.utils import dataclasses as acc_dataclasses
        from accelerate.utils import fsdp_utils
    except ImportError:  # pragma: no cover - accelerate always comes with transformers' Trainer
        return []

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

    if version == 1:
        owner, name, make, params = (acc_dataclasses.FullyShardedDataParallelPlugin, "set_auto_wrap_policy", make_v1,
                                     ("self", "model"))
    else:
        owner, name, make, params = fsdp_utils, "fsdp2_prepare_auto_wrap_policy", make_v2, ("fsdp2_plugin", "model")
    try:
        _patch.require_params(getattr(owner, name, None), params, name)
        patch = _patch.apply(owner, name, make, f"FSDP{version}: the trained lm_head weights get their own unit")
    except (_patch.PatchError, TypeError) as exc:
        info_rank0(
            f"[liger_fsdp] warning: {exc}. The loss stays exact (it runs through whichever unit owns the head), "
            "but the head is not split into its own FSDP unit, so it stays gathered with the root."
        )
        return []
    return [] if patch is None else [lambda: _patch.undo(patch.owner, patch.name)]


def frozen_dtypes(model: Any) -> dict:
    """name -> dtype of the frozen floating-point parameters (before accelerate's upcast)."""
    return {n: p.dtype for n, p in model.named_parameters() if not p.requires_grad and p.is_floating_point()}


def keep_frozen_dtype(model: Any, before: dict) -> tuple[int, int]:
    """Cast back the frozen parameters that ``before`` (name -> dtype) saw in 16 bits and that are fp32 now (FSDP2's
    ``_apply`` re-registers the shards); returns (parameters, bytes saved on this rank)."""
    import torch

    to = {id(p): before[n] for n, p in model.named_parameters()
          if n in before and not p.requires_grad and p.dtype == torch.float32 and before[n].itemsize == 2}
    if not to:
        return 0, 0
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters() if id(p) in to]
    saved = sum(t.numel() * 2 for t in local)
    with torch.no_grad():
        model._apply(lambda t: t.to(to[id(t)]) if id(t) in to else t)
    return len(to), saved


@contextlib.contextmanager
def upcast_skips_frozen(model: Any, before: dict):
    """While inside, ``model.to(torch.float32)`` (accelerate <= 1.11's upcast: every parameter) casts all but the frozen
    parameters that ``before`` (name -> dtype) saw in 16 bits: those are never fp32, not even for a moment -- cast back
    afterwards, the whole frozen base model would be fp32 at the set-up's peak. Any other ``to`` call is the module's
    own. A per-instance attribute, removed on exit; yields the set of the parameters' ids it kept out."""
    import torch

    cls_to = type(model).to
    skipped: set = set()

    def to(*args, **kwargs):
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if dtype != torch.float32 or device is not None or memory_format is not None:
            return cls_to(model, *args, **kwargs)
        keep = {id(p) for n, p in model.named_parameters()
                if n in before and not p.requires_grad and p.dtype == before[n] and before[n].itemsize == 2}
        skipped.update(keep)
        # as nn.Module.to converts: floating and complex tensors only
        return model._apply(lambda t: t if id(t) in keep or not (t.is_floating_point() or t.is_complex())
                            else t.to(dtype, non_blocking=non_blocking))

    model.to = to
    try:
        yield skipped
    finally:
        model.__dict__.pop("to", None)


def patch_frozen_dtype() -> list[Callable[[], None]]:
    """accelerate's ``fsdp2_prepare_model`` (<= 1.11; 1.15 upcasts trainable parameters only) upcasts every parameter
    to fp32 under mixed precision (fp32 master weights for the optimizer). A frozen parameter is never updated, so its
    fp32 shard only doubles its memory -- the whole frozen base model under LoRA. This patch keeps them out of the
    upcast (:func:`upcast_skips_frozen`) and casts back any that another upcast path still made fp32: exact (the values
    came from that dtype, and FSDP2 all-gathers them in its ``param_dtype`` either way); trainable parameters keep
    accelerate's fp32."""
    try:
        from accelerate import accelerator as acc
    except ImportError:  # pragma: no cover
        return []
    said = []

    def make(original):
        def fsdp2_prepare_model(accelerator, model, *args, **kwargs):
            before = frozen_dtypes(model)
            with upcast_skips_frozen(model, before) as skipped:
                model = original(accelerator, model, *args, **kwargs)
            n, saved = keep_frozen_dtype(model, before)  # any that another upcast path made fp32
            kept = [p for p in model.parameters() if id(p) in skipped]  # FSDP2's _apply keeps the Parameter objects
            saved += sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 2 for p in kept)
            if (kept or n) and not said:
                said.append(True)
                info_rank0(f"[liger_fsdp] FSDP2: {len(kept) + n} frozen parameter(s) kept in the dtype they were loaded "
                           f"in ({saved / GIB:.2f} GiB less on this rank than fp32): accelerate's mixed precision "
                           "upcasts every parameter to fp32, a frozen one is never updated.")
            return model

        return fsdp2_prepare_model

    try:
        _patch.require_params(getattr(acc, "fsdp2_prepare_model", None), ("accelerator", "model"),
                              "fsdp2_prepare_model")
        patch = _patch.apply(acc, "fsdp2_prepare_model", make, "FSDP2: frozen parameters stay in their loaded dtype")
    except (_patch.PatchError, TypeError) as exc:
        info_rank0(f"[liger_fsdp] warning: {exc}. Frozen parameters stay in accelerate's fp32 (memory only).")
        return []
    return [] if patch is None else [lambda: _patch.undo(acc, "fsdp2_prepare_model")]
