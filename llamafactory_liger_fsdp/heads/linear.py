"""A head whose kernel weight is one plain ``nn.Linear`` weight: PEFT's trained ``modules_to_save`` copy
(``additional_target: lm_head``) or the head itself under full fine-tuning (tied or not). A bias (phi,
phimoe ``lm_head_bias``) enters exactly as one more column: ``[h, 1] [W, b]^T``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import gather, thirdparty
from .base import Head, Kernel, check_linear, is_shared, only_adapter, with_bias


@dataclass(frozen=True)
class LinearHead(Head):
    kind: str  # "modules_to_save" | "full" | "frozen" (preference stages: the reference pass, a frozen policy head)
    head_path: str
    weight_path: str
    tied: bool = False

    @property
    def weight_paths(self) -> tuple[str, ...]:
        return (self.weight_path,)

    def live(self, causal_lm: nn.Module) -> Head:
        """PEFT's ``disable_adapter()`` (LoRA as the reference model) switches a modules_to_save head to its
        original, frozen module: the kernel then reads that one."""
        if self.kind != "modules_to_save" or not gather.module_at(causal_lm, self.head_path).disable_adapters:
            return self
        return LinearHead("frozen", self.head_path, f"{self.head_path}.original_module", self.tied)

    def run(self, causal_lm: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, kernel: Kernel):
        found, module = gather.resolve(causal_lm, self.weight_path)

        def inside(h: torch.Tensor, y: torch.Tensor):
            gather.check_full(module.weight)
            return kernel(*with_bias(h, module.weight, module.bias), y)

        return gather.call_through(found, inside, hidden, labels)


def detect(causal_lm: nn.Module, head: nn.Module, head_path: str, trained_only: bool = True) -> LinearHead | str | None:
    """A :class:`LinearHead`, a reason the head is frozen (``trained_only``; else a ``frozen`` strategy), or None
    when ``head`` is not this kind."""
    if thirdparty.is_modules_to_save(head):
        if head.disable_adapters:
            if not trained_only:
                original = head.original_module
                return LinearHead("frozen", head_path, f"{head_path}.original_module", is_shared(causal_lm, original.weight))
            return "the lm_head copy in `additional_target` is disabled (adapters off): the head is frozen"
        adapter = only_adapter(head, "modules_to_save")
        inner = head.modules_to_save[adapter]
        check_linear(inner, "the trained lm_head copy (modules_to_save)", bias_ok=True)
        if trained_only and not inner.weight.requires_grad:
            return "the lm_head copy in `additional_target` is frozen"
        path = f"{head_path}.modules_to_save.{adapter}"
        return LinearHead("modules_to_save", head_path, path, is_shared(causal_lm, inner.weight))
    if type(head) is nn.Linear:
        check_linear(head, "lm_head", bias_ok=True)
        if not head.weight.requires_grad:
            if not trained_only:
                return LinearHead("frozen", head_path, head_path, is_shared(causal_lm, head.weight))
            return "lm_head is frozen (not in `additional_target` or `lora_target`, no full fine-tuning)"
        return LinearHead("full", head_path, head_path, is_shared(causal_lm, head.weight))
    return None
