"""What every head kind answers, and the checks they share.

A head kind is a small strategy object: which modules own the weights the kernel reads
(:attr:`Head.weight_paths`, relative to the causal LM), and how to call a kernel ``kernel(h, w, y)``
with those weights gathered (:meth:`Head.run`, which goes through :mod:`..gather`); a head whose weight is partly
frozen passes that part as ``kernel(h, w, y, frozen_weight=f)`` (columns of ``f`` first, only ``w`` differentiated). The losses
(:mod:`..losses`) build the kernel; the head knows nothing of what it computes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import torch
from torch import nn

from ..config import LigerFsdpConfigError

Kernel = Callable[..., Any]  # kernel(h, w, y) or kernel(h, w, y, frozen_weight=f)


class Head(ABC):
    kind: str
    head_path: str  # the output embedding, relative to the causal LM ("lm_head")
    tied: bool  # the weight the kernel reads is shared with another module (tied embeddings)

    @property
    @abstractmethod
    def weight_paths(self) -> tuple[str, ...]:
        """Modules whose ``.weight`` the kernel reads."""

    @abstractmethod
    def run(self, causal_lm: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, kernel: Kernel) -> Any:
        """``kernel(h, W, y)`` for ``hidden [N, H]`` and ``labels [N]``, with the head's weights gathered."""

    def live(self, causal_lm: nn.Module) -> "Head":
        """The strategy for the model's state right now (PEFT's ``disable_adapter()`` may be active)."""
        return self

    def describe(self) -> str:
        return f"head={self.kind}{' (tied)' if self.tied else ''} ({self.head_path})"


def with_bias(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``h W^T + b = [h, 1] [W, b]^T``: the bias as one more column, so one kernel call computes it exactly
    (its gradient is the last column of the weight's)."""
    if bias is None:
        return h, w
    return torch.cat([h, h.new_ones(h.shape[0], 1)], dim=-1), torch.cat([w, bias.to(w.dtype)[:, None]], dim=-1)


def is_shared(root: nn.Module, param: torch.Tensor) -> bool:
    return sum(1 for _, p in root.named_parameters(remove_duplicate=False) if p is param) > 1


def check_linear(module: nn.Module, what: str, bias_ok: bool = False) -> None:
    # exactly nn.Linear: bitsandbytes' Linear4bit/Linear8bitLt subclass it, and with bnb_4bit_quant_storage=float32
    # their packed weight even looks like a floating-point one
    if type(module) is not nn.Linear or not module.weight.is_floating_point():
        raise LigerFsdpConfigError(
            f"`liger_fsdp: true`: {what} is {type(module).__name__}, not a floating-point nn.Linear "
            "(quantized heads are not supported). Fix: do not quantize the head, or remove `liger_fsdp`."
        )
    if module.bias is not None and not bias_ok:
        raise LigerFsdpConfigError(
            f"`liger_fsdp: true`: {what} has a bias, which the fused loss does not add. Fix: remove `liger_fsdp`."
        )


def only_adapter(layer: nn.Module, what: str) -> str:
    active = list(getattr(layer, "active_adapters", []) or [])
    if len(active) != 1:
        raise LigerFsdpConfigError(
            f"`liger_fsdp: true` needs exactly one active adapter on the {what} head, found {active}. "
            "Fix: train one adapter at a time, or remove `liger_fsdp`."
        )
    return active[0]
