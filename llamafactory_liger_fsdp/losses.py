"""What is computed through the head: **the one place where the loss is computed**.

:func:`causal_lm_loss` is the model's own loss on ``lm_head(hidden)`` (``ForCausalLMLoss``: same label
shift, ``ignore_index``, ``sum / num_items_in_batch`` when the Trainer passes it, else the mean; or the
family's variant, :mod:`.families` ``loss``), computed by :func:`..ops.fused_linear_cross_entropy`
called through the head strategy, so the [N, V] logits never exist. A family's logit scale multiplies
the kernel's input rows (``(s h) W^T = s (h W^T)``, the bias column included); its softcap is the kernel's.
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


def scaled(kernel: Callable, scale: tuple[float, bool]) -> Callable:
    """``kernel`` on rows multiplied (or divided) by the family's logit scale: ``(s h) W^T = s (h W^T)``."""
    value, divides = scale

    def run(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, **kw):
        return kernel(h / value if divides else h * value, w, y, **kw)

    return run


def shifted_labels(labels: torch.Tensor, ignore_index: int, kind: str, attention_mask: Any = None) -> torch.Tensor:
    """``labels[..., 1:]`` padded with ``ignore_index``; for ``masked_mean`` also ignored where the shifted
    attention mask is 0 (Gemma 3 aligns the mask to the *last* positions: ``attention_mask[:, -(T-1):]``)."""
    shift = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    t = shift.shape[-1]
    if kind == "masked_mean" and torch.is_tensor(attention_mask) and attention_mask.dim() == 2 and t > 1:
        keep = attention_mask[:, -(t - 1):].to(shift.device) != 0
        shift = shift.clone()
        shift[..., :-1] = torch.where(keep, shift[..., :-1], torch.full_like(shift[..., :-1], ignore_index))
    return shift


def causal_lm_loss(
    causal_lm: nn.Module,
    head: Head,
    hidden: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    kind: str = "causal_lm",
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    attention_mask: Any = None,
    softcap: float | None = None,
    scale: tuple[float, bool] | None = None,
    label_smoothing: float = 0.0,
    backend: str | None = None,
    wrap_kernel: Callable | None = None,
) -> torch.Tensor:
    """The training loss of ``causal_lm`` for decoder output ``hidden [B, T, H]``: the kernel's sum over labelled
    positions divided by ``num_items_in_batch``, or by their count (the mean). With nothing labelled that is
    ``0 / 0`` = NaN, as in the model's own loss, and every gradient is exactly zero (the kernel never lets an
    ignored row's ``grad_output`` in).

    ``kind``: ``causal_lm`` honours ``shift_labels``/``num_items_in_batch``/``ignore_index``; ``mean`` and
    ``masked_mean`` ignore them, as those models do. ``label_smoothing > 0``: transformers' ``LabelSmoother``
    (``shift_labels=True``): the smoothed mean over non-ignored positions, ``num_items_in_batch`` ignored."""
    if kind != "causal_lm" or label_smoothing:
        shift_labels, num_items_in_batch, ignore_index = None, None, -100
    if shift_labels is None:
        shift_labels = shifted_labels(labels, ignore_index, kind, attention_mask)
    h = hidden.reshape(-1, hidden.shape[-1])
    y = shift_labels.reshape(-1).to(h.device)
    kernel = functools.partial(
        ops.fused_linear_cross_entropy,
        ignore_index=ignore_index,
        reduction="sum",
        label_smoothing=float(label_smoothing),
        softcap=softcap,
        backend=resolve_backend(backend, h.device),
    )
    if scale is not None:
        kernel = scaled(kernel, scale)
    if wrap_kernel is not None:  # diagnostics (memory report)
        kernel = functools.partial(wrap_kernel, kernel)
    loss = head.run(causal_lm, h, y, kernel)
    if num_items_in_batch is None:  # the mean as the model takes it: sum / count (0 / 0 is NaN there too)
        num_items_in_batch = (y != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch
