"""The per-model state of the fused forward (:mod:`.forward`): what it has done, what is pending, which path it takes.

Apart from :mod:`.forward` so that the guard (which runs the original forwards) and the forward (which calls the
guard) both read it without importing each other.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from .config import LigerFsdpConfig


@dataclass
class Request:
    """One pending :func:`token_logps` call: its labels, whether the logit sums are wanted, the trainer's step."""

    labels: torch.Tensor
    sums: bool = True
    step: int | None = None
    shifted: bool = False  # labels already give each position's target (v1's sequence-parallel shards)


class ForwardState:
    """Per-model state of the fused forward: the training forwards so far (the first one logs the engaged line),
    whether the guard is still to run, a pending log-probs request (:func:`token_logps`), and ``label_smoothing``:
    when set (> 0), the loss is transformers' ``LabelSmoother(eps)(outputs, labels, shift_labels=True)`` computed by
    the kernel -- for a caller that passes the labels instead of letting the Trainer pop them (the Trainer's own
    smoother is then off)."""

    def __init__(self, config: LigerFsdpConfig, request_only: bool = False):
        self.config = config
        self.steps = 0  # training forwards with labels so far (log-probs forwards count once, for the line)
        self.guard = config.guard  # still to run (it defers itself while no rank has a labelled position)
        self.start_step, self.grad_accum = config.start_step, max(1, config.grad_accum)
        self.label_smoothing = 0.0
        self.said_no_labels = False
        self.request: Request | None = None  # set by token_logps() for exactly one call
        self.request_only = request_only  # v1: training calls with labels but no request run the original forward
        self.reference = False  # the guard's original side: every call runs the original forward

    @property
    def global_step(self) -> int:
        """The optimizer step the current forward belongs to, as the Trainer counts (a resume included)."""
        return self.start_step + (self.steps - 1) // self.grad_accum + 1


def state_of(causal_lm: nn.Module) -> ForwardState | None:
    """The fused forward's state of an engaged causal LM (None when it is not engaged)."""
    return getattr(causal_lm.__dict__.get("forward"), "liger_fsdp_state", None)


@contextlib.contextmanager
def pending(state: ForwardState, request: Request):
    """``request`` answers the next call of the fused forward."""
    state.request = request
    try:
        yield
    finally:
        state.request = None


@contextlib.contextmanager
def original_forwards(*causal_lms: nn.Module):
    """For its duration the engaged ``causal_lms`` run their own forward (the guard's original side)."""
    states = {id(s): s for s in (state_of(m) for m in causal_lms) if s is not None}
    before = {k: s.reference for k, s in states.items()}
    for s in states.values():
        s.reference = True
    try:
        yield
    finally:
        for k, s in states.items():
            s.reference = before[k]
