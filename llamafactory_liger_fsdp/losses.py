"""**The loss seam**: everything computed through the head goes through one :class:`HeadLoss`.

A ``HeadLoss`` holds the head strategy (:mod:`.heads`, which gathers the weights through their FSDP units /
DeepSpeed modules) and the family's quirks (:mod:`.families`: softcap, logit scale, loss variant), and owns the one
call of :func:`..ops.fused_linear_cross_entropy` (the only caller outside ``ops/``), the label shift and the
first-step memory report. It offers what a trainer asks of a head (cf. torchtune's ``SFTLoss``, which holds the
output module and calls it):

* :meth:`HeadLoss.loss` -- the model's own training loss on ``lm_head(hidden)`` (``ForCausalLMLoss``: same label
  shift, ``ignore_index``, ``sum / num_items_in_batch`` when the Trainer passes it, else the mean; or the family's
  variant; or the Trainer's label smoothing), the [N, V] logits never built;
* :meth:`HeadLoss.token_logps` -- per-token log-probs of the labels (``reduction="none"``, exact gradients for any
  weighting) and the per-position sums of the logits that LLaMA-Factory logs, for the preference stages.

A logit scale multiplies the kernel's input rows (``(s h) W^T = s (h W^T)``, the bias column included); the softcap
is the kernel's.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

from . import families, ops
from .families import Family
from .heads import Head

#: The label that scores nothing (transformers' ``ForCausalLMLoss`` and LLaMA-Factory's ``IGNORE_INDEX``).
IGNORE_INDEX = -100

#: Rows of logits formed at a time for the logit sums under a softcap (non-linear, so no ``h (W^T 1)``).
ROW_CHUNK_BYTES = 256 * 2**20


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """The plugin's ``auto``: ``triton_fast`` on CUDA, ``torch`` elsewhere."""
    if backend in (None, "auto"):
        return ops.default_backend(device, fast=True)
    return backend


def shifted_labels(labels: torch.Tensor, ignore_index: int, kind: str = "causal_lm",
                   attention_mask: Any = None) -> torch.Tensor:
    """``labels[..., 1:]`` padded with ``ignore_index`` (the label of each hidden position); for ``masked_mean``
    also ignored where the shifted attention mask is 0 (Gemma 3 aligns the mask to the *last* positions:
    ``attention_mask[:, -(T-1):]``)."""
    shift = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    t = shift.shape[-1]
    if kind == "masked_mean" and torch.is_tensor(attention_mask) and attention_mask.dim() == 2 and t > 1:
        keep = attention_mask[:, -(t - 1):].to(shift.device) != 0
        shift = shift.clone()
        shift[..., :-1] = torch.where(keep, shift[..., :-1], torch.full_like(shift[..., :-1], ignore_index))
    return shift


def _row_logit_sums(h: torch.Tensor, w: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """sum_v softcap(h W^T)[n, v] for every row, fp32, never more than a chunk of logits at a time."""
    with torch.no_grad():
        if softcap is None:
            return h.float() @ w.sum(0, dtype=torch.float32)
        rows = max(1, ROW_CHUNK_BYTES // (4 * w.shape[0]))
        out = []
        for s in range(0, h.shape[0], rows):
            z = (h[s : s + rows] @ w.t()).float()
            out.append((torch.tanh(z / softcap) * softcap).sum(1))
        return torch.cat(out)


class HeadLoss:
    """The fused loss of one causal LM: its head strategy, its family's quirks, the kernel backend."""

    def __init__(self, causal_lm: nn.Module, head: Head, family: Family, backend: str | None = None):
        self.causal_lm, self.head, self.family, self.backend = causal_lm, head, family, backend
        self.softcap = families.softcap(family, causal_lm.config)
        self.scale = families.logit_scale(family, causal_lm.config, causal_lm)
        self.report: Callable | None = None  # wraps the next training kernel call once (the memory report)

    @property
    def vocab_size(self) -> int:
        return self.causal_lm.get_output_embeddings().out_features

    def _kernel(self, device: torch.device, **kw: Any) -> Callable:
        """The fused kernel with the family's softcap and the run's backend (unscaled rows)."""
        return functools.partial(ops.fused_linear_cross_entropy, softcap=self.softcap,
                                 backend=resolve_backend(self.backend, device), **kw)

    def _scaled(self, kernel: Callable) -> Callable:
        """``kernel`` on rows multiplied (or divided) by the family's logit scale: ``(s h) W^T = s (h W^T)``."""
        if self.scale is None:
            return kernel
        value, divides = self.scale

        def run(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, **kw: Any):
            return kernel(h / value if divides else h * value, w, y, **kw)

        return run

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor | None, *, shift_labels: torch.Tensor | None = None,
             num_items_in_batch: Any = None, ignore_index: int = IGNORE_INDEX, attention_mask: Any = None,
             label_smoothing: float = 0.0) -> torch.Tensor:
        """The training loss for decoder output ``hidden [B, T, H]``: the kernel's sum over labelled positions
        divided by ``num_items_in_batch``, or by their count (the mean). With nothing labelled that is ``0 / 0`` =
        NaN, as in the model's own loss, and every gradient is exactly zero (the kernel never lets an ignored row's
        ``grad_output`` in). Loss variants ``mean``/``masked_mean`` ignore ``shift_labels``/``num_items_in_batch``/
        ``ignore_index``, as those models do; ``label_smoothing > 0`` is transformers' ``LabelSmoother``
        (``shift_labels=True``): the smoothed mean over non-ignored positions."""
        kind = self.family.loss
        if kind != "causal_lm" or label_smoothing:
            shift_labels, num_items_in_batch, ignore_index = None, None, IGNORE_INDEX
        if shift_labels is None:
            shift_labels = shifted_labels(labels, ignore_index, kind, attention_mask)
        h = hidden.reshape(-1, hidden.shape[-1])
        y = shift_labels.reshape(-1).to(h.device)
        kernel = self._scaled(self._kernel(h.device, ignore_index=ignore_index, reduction="sum",
                                           label_smoothing=float(label_smoothing)))
        if self.report is not None:
            kernel, self.report = functools.partial(self.report, kernel), None
        loss = self.head.run(self.causal_lm, h, y, kernel)
        if num_items_in_batch is None:  # the mean as the model takes it: sum / count (0 / 0 is NaN there too)
            num_items_in_batch = (y != ignore_index).sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        return loss / num_items_in_batch

    def token_logps(self, hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                    sums: bool = True, shifted: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """For ``hidden [B, T, H]`` and unshifted ``labels [B, T]``: (``logps [B, T-1]``: log p of ``labels[:, 1:]``,
        0 where ignored, fp32; ``logit_sums [B, T]``: each position's sum of its logits over the vocabulary, fp32,
        no gradient -- LLaMA-Factory's ``logits/*`` metrics -- from the same gathered weight, or None when ``sums`` is
        false). The head strategy follows PEFT's ``disable_adapter()`` at call time (the reference pass reads the base
        head). With ``shifted``, ``labels [B, T]`` are already each position's target and the log-probs are ``[B, T]``
        (a sequence-parallel shard, whose last position predicts the next shard's first label)."""
        b, t, _ = hidden.shape
        h = hidden.reshape(-1, hidden.shape[-1])
        y = (labels if shifted else shifted_labels(labels, ignore_index)).reshape(-1).to(h.device)
        per_row = self._kernel(h.device, ignore_index=ignore_index, reduction="none")
        if self.report is not None and torch.is_grad_enabled():  # the memory report: the first call that trains
            per_row, self.report = functools.partial(self.report, per_row), None
        softcap = self.softcap

        def kernel(h_in: torch.Tensor, w: torch.Tensor, y_in: torch.Tensor, frozen_weight: torch.Tensor | None = None):
            ce = per_row(h_in, w, y_in, frozen_weight=frozen_weight)
            if not sums:
                return ce
            full = w if frozen_weight is None else torch.cat([frozen_weight, w.detach()], dim=1)
            return ce, _row_logit_sums(h_in, full, softcap)

        out = self.head.live(self.causal_lm).run(self.causal_lm, h, y, self._scaled(kernel))
        ce, logit_sums = out if sums else (out, None)
        logps = -ce.view(b, t)
        return logps if shifted else logps[:, :-1], None if logit_sums is None else logit_sums.view(b, t)
