"""PEFT LoRA on the head (``lm_head`` in ``lora_target``): the LoRA delta enters the loss exactly.

``h W^T + s (A drop(h))^T B^T = [h, s A drop(h)] [W, B]^T``: one kernel call on the concatenation, in the
hidden states' dtype, run through the units of the base layer and of lora_B; ``A drop(h)`` is computed by calling lora_A as a
module (through its own unit, if it is one), so lora_A and lora_B get exact gradients. The frozen columns (the
base weight, and its bias as one more column: ``[h, 1, s A drop(h)] [W, b, B]^T``) go to the kernel as
``frozen_weight``, so only lora_B's ``[V, r]`` gradient is formed (``2 N r V`` flops, not ``2 N (H + r) V``, and no
``[V, H + r]`` fp32 accumulator). Cost: a ``[V, H + r]`` copy of the concatenated weight while the kernel runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import gather, thirdparty
from ..config import LigerFsdpConfigError
from .base import Head, Kernel, check_linear, is_shared, only_adapter


@dataclass(frozen=True)
class LoraHead(Head):
    head_path: str
    adapter: str
    scaling: float
    tied: bool = False
    kind: str = "lora"

    @property
    def weight_paths(self) -> tuple[str, ...]:
        return (f"{self.head_path}.base_layer", f"{self.head_path}.lora_B.{self.adapter}")

    def live(self, causal_lm: nn.Module) -> Head:
        """Under PEFT's ``disable_adapter()`` (LoRA as the reference model) the head is its base layer alone."""
        from .linear import LinearHead

        layer = gather.module_at(causal_lm, self.head_path)  # no weight read here: see gather.param
        if layer.disable_adapters or layer.merged:
            return LinearHead("frozen", self.head_path, f"{self.head_path}.base_layer", self.tied)
        return self

    def run(self, causal_lm: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, kernel: Kernel):
        a_path = f"{self.head_path}.lora_A.{self.adapter}"
        dropout = gather.entry_at(causal_lm, f"{self.head_path}.lora_dropout.{self.adapter}")
        a_dtype = gather.local_dtype(gather.module_at(causal_lm, a_path))  # PEFT casts the input to lora_A's dtype
        x = hidden if a_dtype is None else hidden.to(a_dtype)
        u = gather.entry_at(causal_lm, a_path)(dropout(x)) * self.scaling
        resolved = [gather.resolve(causal_lm, p) for p in self.weight_paths]
        found = [unit for unit_list, _ in resolved for unit in unit_list]
        base, lora_b = (module for _, module in resolved)

        def inside(h: torch.Tensor, u_in: torch.Tensor, y: torch.Tensor):
            w, b = base.weight, lora_b.weight
            gather.check_full(w, b)
            # the hidden states' (compute) dtype: PEFT runs the base layer in it too; an fp32 lora_B or A h is rounded
            # to it (2^-9 of the rank-r delta in bf16), never the [V, H] base weight promoted to fp32
            dtype = h.dtype
            cols = [(h, w), (u_in.to(dtype), b)]
            if base.bias is not None:
                cols.append((h.new_ones(h.shape[0], 1), base.bias[:, None]))
            frozen = [c for c in cols if not c[1].requires_grad]
            trained = [c for c in cols if c[1].requires_grad]
            if not frozen or not trained:  # nothing to leave out (or nothing to train: evaluation)
                return kernel(torch.cat([x for x, _ in cols], dim=-1), _cat(cols, dtype), y)
            hcat = torch.cat([x for x, _ in frozen + trained], dim=-1)
            return kernel(hcat, _cat(trained, dtype), y, frozen_weight=_cat(frozen, dtype).detach())

        return gather.call_through(found, inside, hidden, u, labels)


def _cat(cols: list, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([wt.to(dtype) for _, wt in cols], dim=-1)


def _base_only(causal_lm: nn.Module, head: nn.Module, head_path: str):
    from .linear import LinearHead

    check_linear(head.base_layer, "the LoRA head's base layer", bias_ok=True)
    return LinearHead("frozen", head_path, f"{head_path}.base_layer", is_shared(causal_lm, head.base_layer.weight))


def detect(causal_lm: nn.Module, head: nn.Module, head_path: str, trained_only: bool = True) -> Head | str | None:
    """A :class:`LoraHead`, a reason the head is frozen (``trained_only``; else a ``frozen`` strategy on the base
    layer where no LoRA delta applies), or None when ``head`` is not a LoRA layer."""
    if not thirdparty.is_lora_layer(head):
        return None
    if head.disable_adapters or head.merged:
        return _base_only(causal_lm, head, head_path) if not trained_only else (
            "LoRA on lm_head is disabled or merged: the head is frozen")
    adapter = only_adapter(head, "LoRA")
    if adapter not in head.lora_A:
        return _base_only(causal_lm, head, head_path) if not trained_only else (
            "the active adapter has no LoRA on lm_head: the head is frozen")
    problems = []
    if head.use_dora.get(adapter, False) or adapter in getattr(head, "lora_variant", {}):
        problems.append("DoRA/LoRA variants")
    if getattr(head, "fan_in_fan_out", False):
        problems.append("fan_in_fan_out")
    if getattr(head.lora_B[adapter], "bias", None) is not None:
        problems.append("lora_bias")
    if problems:
        raise LigerFsdpConfigError(
            f"`liger_fsdp: true` supports plain LoRA on lm_head; this head uses {', '.join(problems)}. "
            "Fix: use plain LoRA on lm_head (or put lm_head in `additional_target`), or remove `liger_fsdp`."
        )
    check_linear(head.base_layer, "the LoRA head's base layer", bias_ok=True)
    check_linear(head.lora_B[adapter], "the LoRA head's lora_B")
    if trained_only and not (head.lora_A[adapter].weight.requires_grad or head.lora_B[adapter].weight.requires_grad):
        return "the LoRA weights on lm_head are frozen"
    return LoraHead(head_path, adapter, float(head.scaling[adapter]), is_shared(causal_lm, head.base_layer.weight))
