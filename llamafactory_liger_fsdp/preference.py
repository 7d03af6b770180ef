"""Preference stages (DPO and its variants, KTO): per-token log-probs of the labels through the head, without logits.

:func:`token_logps` runs the fused kernel with ``reduction="none"`` through the head strategy (so the head's FSDP
units / DeepSpeed modules gather it, exactly as for the SFT loss): ``log p(y_t) = -CE_t`` per position, 0 where the
label is ignored, with exact gradients for any weighting the preference loss applies. It also returns what
LLaMA-Factory logs as ``logits/chosen``/``logits/rejected`` -- means (DPO) or sums (KTO) over the full
``[B, T, V]`` logits -- as per-position sums over the vocabulary, computed from the same gathered weight without
building the logits (``z 1 = h (W^T 1)``; chunked where a softcap makes it non-linear).

:func:`sequence_logps` is LLaMA-Factory's ``get_batch_logps`` on those per-token log-probs (the sum over each
sequence's labels; with ``ld_alpha``, LD-DPO's weighting of the tokens past the shorter answer of each pair).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from . import ops
from .heads import Head
from .losses import resolve_backend, scaled

ROW_CHUNK_BYTES = 256 * 2**20
#: The keyword the preference trainers pass (the unshifted labels) to get a :class:`PreferenceOutput`.
LABELS_KEY = "liger_fsdp_logps_labels"


@dataclass
class PreferenceOutput(ModelOutput):
    """What the fused forward returns for :data:`LABELS_KEY`: no logits."""

    logps: torch.Tensor | None = None  # [B, T-1], bf16 high part (gather.split_fp32)
    logps_lo: torch.Tensor | None = None  # fp32 remainder: logps + logps_lo is the fp32 value
    logit_sums: torch.Tensor | None = None  # [B, T], no gradient, high part
    logit_sums_lo: torch.Tensor | None = None
    vocab_size: int | None = None  # the logits' last dimension


def pack(logps: torch.Tensor, logit_sums: torch.Tensor, vocab_size: int) -> PreferenceOutput:
    """The model output, each fp32 tensor as two parts that survive FSDP2's bf16 output cast of the root unit."""
    from .gather import split_fp32

    _, hi, lo = split_fp32(logps)
    _, s_hi, s_lo = split_fp32(logit_sums)
    return PreferenceOutput(logps=hi, logps_lo=lo, logit_sums=s_hi, logit_sums_lo=s_lo, vocab_size=vocab_size)


def unpack(out: PreferenceOutput) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 per-token log-probs, fp32 per-position logit sums) of a model output."""
    return out.logps.float() + out.logps_lo.float(), out.logit_sums.float() + out.logit_sums_lo.float()


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


def token_logps(
    causal_lm: nn.Module,
    head: Head,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    softcap: float | None = None,
    scale: tuple[float, bool] | None = None,
    backend: str | None = None,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``hidden [B, T, H]`` and unshifted ``labels [B, T]``: (``logps [B, T-1]``: log p of ``labels[:, 1:]``,
    0 where ignored; ``logit_sums [B, T]``: the sum over the vocabulary of every position's logits, no gradient)."""
    b, t, _ = hidden.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    y = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1).to(h.device)
    per_row = functools.partial(ops.fused_linear_cross_entropy, ignore_index=ignore_index, reduction="none",
                                softcap=softcap, backend=resolve_backend(backend, h.device))

    def kernel(h_in: torch.Tensor, w: torch.Tensor, y_in: torch.Tensor, frozen_weight: torch.Tensor | None = None):
        full = w if frozen_weight is None else torch.cat([frozen_weight, w.detach()], dim=1)
        return per_row(h_in, w, y_in, frozen_weight=frozen_weight), _row_logit_sums(h_in, full, softcap)

    if scale is not None:
        kernel = scaled(kernel, scale)
    ce, sums = head.live(causal_lm).run(causal_lm, h, y, kernel)
    return -ce.view(b, t)[:, :-1], sums.view(b, t)


def sequence_logps(logps: torch.Tensor, labels: torch.Tensor, ld_alpha: float | None = None,
                   ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaMA-Factory's ``get_batch_logps`` from per-token log-probs: (sum of each sequence's label log-probs,
    number of labels). The first half of the batch is chosen, the second rejected (for ``ld_alpha``)."""
    mask = labels[:, 1:] != ignore_index
    valid_length = mask.sum(-1)
    logps = logps.float()  # FSDP2's mixed precision hands outputs back in bf16: sum in fp32, as LLaMA-Factory does
    if ld_alpha is None:
        return (logps * mask).sum(-1), valid_length
    half = labels.shape[0] // 2
    shorter = torch.min(valid_length[:half], valid_length[half:])
    public = torch.argmax(mask.int(), dim=1) + torch.cat([shorter, shorter], dim=0)
    position = torch.arange(mask.shape[-1], device=logps.device).expand_as(logps)
    front = position < public.unsqueeze(1)
    return (logps * (front & mask)).sum(-1) + ld_alpha * (logps * (~front & mask)).sum(-1), valid_length
