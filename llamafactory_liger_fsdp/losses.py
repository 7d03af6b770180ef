"""What is computed through the head: **the one place where the loss is computed**.

:func:`causal_lm_loss` is transformers' ``ForCausalLMLoss`` on ``lm_head(hidden)`` -- same label shift,
``ignore_index``, ``sum / num_items_in_batch`` when the Trainer passes it (gradient accumulation), else
the mean -- computed by :func:`..ops.fused_linear_cross_entropy` called through the head strategy, so
the [N, V] logits never exist.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

from . import ops
from .heads import Head


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """The plugin's ``auto``: ``triton_fast`` on CUDA (bench/RESULTS.md: faster than the unfused loss in
    real SFT), ``torch`` elsewhere."""
    if backend in (None, "auto"):
        return ops.default_backend(device, fast=True)
    return backend


def causal_lm_loss(
    causal_lm: nn.Module,
    head: Head,
    hidden: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    backend: str | None = None,
    wrap_kernel: Callable | None = None,
) -> torch.Tensor:
    """The training loss of ``causal_lm`` for decoder output ``hidden [B, T, H]``."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    h = hidden.reshape(-1, hidden.shape[-1])
    y = shift_labels.reshape(-1).to(h.device)
    kernel = functools.partial(
        ops.fused_linear_cross_entropy,
        ignore_index=ignore_index,
        reduction="sum" if num_items_in_batch is not None else "mean",
        softcap=softcap,
        backend=resolve_backend(backend, h.device),
    )
    if wrap_kernel is not None:  # diagnostics (memory report)
        kernel = functools.partial(wrap_kernel, kernel)
    loss = head.run(causal_lm, h, y, kernel)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
