"""The accelerate patches of :mod:`.` : accelerate's FSDP1 or FSDP2 wrapping puts each tagged head module in its own
unit (the function of this run's FSDP version only); under FSDP2 its preparation leaves frozen parameters in the dtype
they were loaded in and holds no second copy of the model (:func:`patch_setup_memory`)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
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


def _fp32_bytes_over_16bit(params: list) -> int:
    """What fp32 would cost this rank beyond 16 bits for ``params`` (their local shards)."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 2 for p in params)


def keep_frozen_dtype(model: Any, before: dict) -> tuple[int, int]:
    """Cast back the frozen parameters that ``before`` (name -> dtype) saw in 16 bits and that are fp32 now (FSDP2's
    ``_apply`` re-registers the shards); returns (parameters, bytes saved on this rank)."""
    import torch

    to = {id(p): before[n] for n, p in model.named_parameters()
          if n in before and not p.requires_grad and p.dtype == torch.float32 and before[n].itemsize == 2}
    if not to:
        return 0, 0
    saved = _fp32_bytes_over_16bit([p for p in model.parameters() if id(p) in to])
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


class _StateDictOnRead(Mapping):
    """The model's state dict, taken only when first read (``original_sd`` below)."""

    def __init__(self, model: Any) -> None:
        self._model, self._sd = model, None

    def _get(self) -> dict:
        if self._sd is None:
            self._sd = type(self._model).state_dict(self._model)
        return self._sd

    def __getitem__(self, key):
        return self._get()[key]

    def __iter__(self):
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


@contextlib.contextmanager
def originals_not_held(model: Any):
    """While inside, ``model.state_dict()`` returns a mapping that takes the state dict only when read. accelerate's
    ``fsdp2_prepare_model`` takes ``original_sd = model.state_dict()`` before sharding and reads it only under
    ``cpu_ram_efficient_loading`` (to load rank 0's weights into the shards); otherwise it holds every original
    parameter until it returns -- a second copy of the whole model beside its new shards. Used only where that option
    is off; a version that reads it anyway gets the real state dict then. A per-instance attribute, removed on exit."""
    model.state_dict = lambda *args, **kwargs: (_StateDictOnRead(model) if not args and not kwargs
                                                 else type(model).state_dict(model, *args, **kwargs))
    try:
        yield
    finally:
        model.__dict__.pop("state_dict", None)


def patch_setup_memory() -> list[Callable[[], None]]:
    """Two set-up costs of accelerate's ``fsdp2_prepare_model``, exact to leave out, at its one patch point:

    * under mixed precision it upcasts every parameter to fp32 (<= 1.11; 1.15 upcasts trainable ones only): fp32 master
      weights for the optimizer. A frozen parameter is never updated, so its fp32 shard only doubles its memory -- the
      whole frozen base model under LoRA. :func:`upcast_skips_frozen` keeps frozen 16-bit ones out of the upcast and
      :func:`keep_frozen_dtype` casts back any another path still made fp32 (the values came from that dtype, and
      FSDP2 all-gathers them in its ``param_dtype`` either way); trainable parameters keep accelerate's fp32.
    * without ``cpu_ram_efficient_loading`` it holds the original state dict it never reads until it returns
      (:func:`originals_not_held`)."""
    try:
        from accelerate import accelerator as acc
    except ImportError:  # pragma: no cover
        return []
    said = []

    def make(original):
        def fsdp2_prepare_model(accelerator, model, *args, **kwargs):
            before = frozen_dtypes(model)
            reads_originals = getattr(getattr(accelerator.state, "fsdp_plugin", None), "cpu_ram_efficient_loading",
                                      True)
            held = contextlib.nullcontext() if reads_originals else originals_not_held(model)
            with upcast_skips_frozen(model, before) as skipped, held:
                model = original(accelerator, model, *args, **kwargs)
            n, saved = keep_frozen_dtype(model, before)  # any that another upcast path made fp32
            kept = [p for p in model.parameters() if id(p) in skipped]  # FSDP2's _apply keeps the Parameter objects
            saved += _fp32_bytes_over_16bit(kept)
            said_now = []
            if kept or n:
                said_now.append(f"{len(kept) + n} frozen parameter(s) kept in the dtype they were loaded in "
                                f"({saved / GIB:.2f} GiB less on this rank than fp32; accelerate's mixed precision "
                                "upcasts every parameter, a frozen one is never updated)")
            if not reads_originals:
                said_now.append("the original weights freed as they were sharded (accelerate held them, unread, "
                                "until the model was ready)")
            if said_now and not said:
                said.append(True)
                info_rank0("[liger_fsdp] FSDP2: " + "; ".join(said_now) + ".")
            return model

        return fsdp2_prepare_model

    try:
        _patch.require_params(getattr(acc, "fsdp2_prepare_model", None), ("accelerator", "model"),
                              "fsdp2_prepare_model")
        patch = _patch.apply(acc, "fsdp2_prepare_model", make,
                             "FSDP2: frozen parameters stay in their loaded dtype, the originals are not held")
    except (_patch.PatchError, TypeError) as exc:
        info_rank0(f"[liger_fsdp] warning: {exc}. Frozen parameters stay in accelerate's fp32 and its set-up holds a "
                   "copy of the model (memory only).")
        return []
    return [] if patch is None else [lambda: _patch.undo(acc, "fsdp2_prepare_model")]
