"""Patch 5 of :mod:`.` : accelerate's FSDP1/FSDP2 wrapping puts each tagged head module in its own unit."""

from __future__ import annotations

from .. import _patch, wrapping
from .._log import info_rank0


def patch_wrap_policies() -> None:
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
        _patch.require_params(plugin_cls.set_auto_wrap_policy, ("self", "model"), "set_auto_wrap_policy")
        _patch.apply(plugin_cls, "set_auto_wrap_policy", make_v1, "FSDP1: the trained lm_head weights get their own unit")
        _patch.require_params(fsdp_utils.fsdp2_prepare_auto_wrap_policy, ("fsdp2_plugin", "model"),
                              "fsdp2_prepare_auto_wrap_policy")
        _patch.apply(fsdp_utils, "fsdp2_prepare_auto_wrap_policy", make_v2,
                     "FSDP2: the trained lm_head weights get their own unit")
    except _patch.PatchError as exc:
        info_rank0(
            f"[liger_fsdp] warning: {exc}. The loss stays exact (it runs through whichever unit owns the head), "
            "but the head is not split into its own FSDP unit, so it stays gathered with the root."
        )
