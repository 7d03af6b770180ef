"""LLaMA-Factory's sequence math for the preference stages (DPO and its variants, KTO), on per-token log-probs.

The log-probs come from the loss seam (:meth:`.losses.HeadLoss.token_logps`, asked for by
:func:`.forward.token_logps`); :func:`sequence_logps` is LLaMA-Factory's ``get_batch_logps`` on them (the sum over each
sequence's labels; with ``ld_alpha``, LD-DPO's weighting of the tokens past the shorter answer of each pair).
"""

from __future__ import annotations

import torch

from .losses import IGNORE_INDEX


def ld_sum(logps: torch.Tensor, mask: torch.Tensor, public: torch.Tensor, ld_alpha: float) -> torch.Tensor:
    """LD-DPO's sequence sum: the log-probs of ``mask``'s positions before ``public`` (each row's first scored
    position plus the shorter answer's length) in full, those after it weighted by ``ld_alpha``."""
    position = torch.arange(mask.shape[-1], device=logps.device).unsqueeze(0)
    front = position < public.unsqueeze(1)
    return (logps * (front & mask)).sum(-1) + ld_alpha * (logps * (~front & mask)).sum(-1)


def sequence_logps(logps: torch.Tensor, labels: torch.Tensor, ld_alpha: float | None = None,
                   ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
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
    return ld_sum(logps, mask, public, ld_alpha), valid_length
