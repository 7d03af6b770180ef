"""fp32 results across bf16 output casts.

Under accelerate's FSDP2 mixed precision every unit casts its floating outputs to bf16 (``output_dtype``): harmless
for a scalar SFT loss, but a per-token log-prob of -12 would move by up to 0.03 and a sum of 8k of them by far more.
An fp32 tensor therefore crosses a unit as bf16 ``hi`` + fp32 remainder ``lo`` (``hi`` is exact in bf16 and ``lo``
small, so ``hi + lo`` after the cast keeps 16 bits more); the gradient of the sum is the identity. Used by
:func:`.gather.call_through` (the head's units) and by the log-probs model output (:class:`LogpsOutput`, the root
unit's cast).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import ModelOutput

LIMBS = "__liger_fsdp_fp32_limbs__"


def split_fp32(t: torch.Tensor) -> tuple:
    """An fp32 tensor as ``(LIMBS, hi, lo)``: bf16 ``hi`` and ``lo = t - hi``."""
    hi = t.to(torch.bfloat16)
    return LIMBS, hi, t - hi.float()


def join_fp32(value: Any) -> Any:
    """Undo :func:`split_fp32` on a result (a tensor, a limbs tuple, or a tuple of those)."""
    if isinstance(value, tuple) and len(value) == 3 and value[0] == LIMBS:
        return value[1].float() + value[2].float()
    if isinstance(value, tuple):
        return tuple(join_fp32(v) for v in value)
    return value


def split_all(value: Any) -> Any:
    """:func:`split_fp32` on every fp32 tensor of a result (a tensor or nested tuples)."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        return split_fp32(value)
    if isinstance(value, tuple):
        return tuple(split_all(v) for v in value)
    return value


@dataclass
class LogpsOutput(ModelOutput):
    """What the fused forward returns for a log-probs request (:func:`.forward.token_logps`): no logits."""

    logps: torch.Tensor | None = None  # [B, T-1], bf16 high part
    logps_lo: torch.Tensor | None = None  # fp32 remainder: logps + logps_lo is the fp32 value
    logit_sums: torch.Tensor | None = None  # [B, T], no gradient, high part
    logit_sums_lo: torch.Tensor | None = None
    vocab_size: int | None = None  # the logits' last dimension


def pack(logps: torch.Tensor, logit_sums: torch.Tensor | None, vocab_size: int) -> LogpsOutput:
    """The model output, each fp32 tensor as two parts that survive the root unit's bf16 output cast."""
    _, hi, lo = split_fp32(logps)
    _, s_hi, s_lo = split_fp32(logit_sums) if logit_sums is not None else (None, None, None)
    return LogpsOutput(logps=hi, logps_lo=lo, logit_sums=s_hi, logit_sums_lo=s_lo, vocab_size=vocab_size)


def unpack(out: LogpsOutput) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(fp32 per-token log-probs, fp32 per-position logit sums or None) of a model output."""
    sums = None if out.logit_sums is None else out.logit_sums.float() + out.logit_sums_lo.float()
    return out.logps.float() + out.logps_lo.float(), sums
