"""The accelerate patch of :mod:`.` : accelerate's FSDP1 or FSDP2 wrapping puts each tagged head module in its own
unit (the function of this run's FSDP version only)."""

from __future__ import annotations

from typing import Callable

from .. import _patch, wrapping
from .._log import info_rank0


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
