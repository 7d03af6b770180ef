"""The one generic causal-LM training forward, for every family.

Set on the causal LM *instance* by :func:`..engage.engage`. In training with labels it

1. runs the decoder exactly as the original forward does (every bound argument, ``**kwargs`` included:
   pixel values, grid sizes, masks and position ids of a vision-language model pass untouched),
2. computes the loss through the loss seam (:class:`.losses.HeadLoss`: the head strategy, softcap, logit scale,
   loss variant), and
3. adds the family's other terms as data (:mod:`.families`: the MoE aux loss, the output's fields).

The preference stages and LLaMA-Factory's v1 trainers ask explicitly: :func:`token_logps` calls the whole model with a
pending request, and the forward answers it with per-token log-probs (:meth:`.losses.HeadLoss.token_logps`) instead of
logits. With ``request_only`` (v1, whose callers read ``.logits`` whenever they pass labels) only such requests take
the fused path.

On the first training step with labels (SFT / pt) or the first log-probs request made in training with gradients
(the policy's, in the preference stages and v1) the exactness guard (:mod:`.guard`) compares the fused loss with the
original forward's on a slice.
In eval, or without labels, the original forward runs untouched (callers may want the logits); in
training without labels that is said once (the Trainer pops them for ``label_smoothing_factor > 0``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from . import families, report, transport
from ._log import info_rank0
from .config import LigerFsdpConfig
from .losses import HeadLoss


@dataclass
class Request:
    """One pending :func:`token_logps` call: its labels, whether the logit sums are wanted, the trainer's step."""

    labels: torch.Tensor
    sums: bool = True
    step: int | None = None


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

    @property
    def global_step(self) -> int:
        """The optimizer step the current forward belongs to, as the Trainer counts (a resume included)."""
        return self.start_step + (self.steps - 1) // self.grad_accum + 1


NO_LABELS = ("[liger_fsdp] training forward without labels: the fused path is bypassed for it and the model computes "
             "its full logits (the run trains correctly, without the memory saving). The usual cause is "
             "`label_smoothing_factor > 0` on an image-text class: the Trainer then pops the labels and smooths the "
             "logits itself (for causal-LM classes the plugin keeps the labels and the kernel smooths).")


OUTSIDE_REQUEST = ("[liger_fsdp] a training forward outside the trainer's log-probs call (v1): the model computes its "
                   "full logits for it, as without the plugin (correct, without the memory saving).")


def state_of(causal_lm: nn.Module) -> ForwardState | None:
    """The fused forward's state of an engaged causal LM (None when it is not engaged)."""
    return getattr(causal_lm.__dict__.get("forward"), "liger_fsdp_state", None)


@contextlib.contextmanager
def _pending(state: ForwardState, request: Request):
    state.request = request
    try:
        yield
    finally:
        state.request = None


def token_logps(model: nn.Module, causal_lm: nn.Module, inputs: dict, labels: torch.Tensor, *, sums: bool = True,
                step: int | None = None):
    """The preference stages' and v1's call: ``model(**inputs)`` (the whole wrapped model, so FSDP / DeepSpeed run
    their root hooks) answered by the fused forward of ``causal_lm`` with per-token log-probs instead of logits.
    Returns (fp32 log-probs ``[B, T-1]``, fp32 per-position logit sums ``[B, T]`` or None without ``sums``,
    vocabulary size). ``step`` is the trainer's optimizer step (the guard's messages)."""
    state = state_of(causal_lm)
    with _pending(state, Request(labels, sums, step)):
        out = model(**inputs, return_dict=True, use_cache=False)
    logps, sums = transport.unpack(out)
    return logps, sums, out.vocab_size


def make_forward(causal_lm: nn.Module, seam: HeadLoss, state: ForwardState):
    """The replacement for ``causal_lm.forward`` (signature kept: the Trainer inspects it)."""
    original = causal_lm.forward
    signature = inspect.signature(original)
    var_kw = next((n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    family = seam.family
    decoder_attr = family.decoder or causal_lm.base_model_prefix

    def first_step():
        """Count a training forward; the first one logs the engaged line (and returns the memory report's wrapper)."""
        state.steps += 1
        return report.first_step(causal_lm, seam, state.config) if state.steps == 1 else None

    def fused(params: dict, extra: dict, labels, window=None):
        """Decoder, fused loss and the family's terms; ``window`` (rows, start, end) restricts the loss to those
        positions of those rows (the guard's slice)."""
        params, extra = dict(params), dict(extra)
        with_aux = families.aux_on(family, causal_lm.config, params, extra)
        outputs = getattr(causal_lm, decoder_attr)(**params, **extra)
        hidden, shift_labels = outputs.last_hidden_state, extra.get("shift_labels")
        if window is not None:
            rows, start, end = window
            hidden, labels = hidden[rows, start:end], labels[rows, start:end]
            shift_labels = None if shift_labels is None else shift_labels[rows, start:end]
        loss = seam.loss(
            hidden, labels, shift_labels=shift_labels, num_items_in_batch=extra.get("num_items_in_batch"),
            ignore_index=extra.get("ignore_index", -100), attention_mask=params.get("attention_mask"),
            label_smoothing=state.label_smoothing if window is None else 0.0,  # the model's own loss never smooths
        )
        return families.build_output(family, causal_lm, loss, outputs, params.get("attention_mask"), with_aux)

    def window_logps_loss(params: dict, extra: dict, labels, window):
        """The guard's fused side for log-probs requests: the mean of ``-token_logps`` over the window (what the
        model's own loss is on those positions), through the same per-row kernel call as the real request."""
        rows, start, end = window
        hidden = getattr(causal_lm, decoder_attr)(**params, **extra).last_hidden_state[rows, start:end]
        labels = labels[rows, start:end]
        logps, _ = seam.token_logps(hidden, labels, sums=False)
        count = (labels[:, 1:] != -100).sum()  # the positions token_logps scores
        return SimpleNamespace(loss=-logps.sum() / count)

    def logps(params: dict, extra: dict, request: Request) -> transport.LogpsOutput:
        """Per-token log-probs (and per-position logit sums when asked), any mode (the reference pass too)."""
        for key in ("labels", "logits_to_keep", "output_router_logits"):
            params.pop(key, None)
        if state.steps == 0:
            first_step()
        if state.guard and causal_lm.training and torch.is_grad_enabled():  # the policy's first training request
            from . import guard

            step = request.step if request.step is not None else state.global_step
            state.guard = not guard.check(causal_lm, seam, original, signature, window_logps_loss, params, extra,
                                          request.labels, step=step)
        outputs = getattr(causal_lm, decoder_attr)(**params, **extra)
        token_logps, sums = seam.token_logps(outputs.last_hidden_state, request.labels, sums=request.sums)
        return transport.pack(token_logps, sums, seam.vocab_size)

    def loss(params: dict, extra: dict, labels):
        """SFT / pt: the training loss (the guard on the first step with labels on some rank)."""
        params.pop("labels")
        logits_to_keep = params.pop("logits_to_keep", 0)
        if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise ValueError("liger_fsdp: `logits_to_keep` must be 0 when training with labels")
        memory_report = first_step()
        if state.guard:
            from . import guard

            state.guard = not guard.check(causal_lm, seam, original, signature, fused, params, extra, labels,
                                          step=state.global_step)
        seam.report = memory_report  # the real step's kernel call, not the guard's
        return fused(params, extra, labels)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any):
        params = dict(signature.bind_partial(*args, **kwargs).arguments)
        extra = dict(params.pop(var_kw, {}) if var_kw else {})
        if state.request is not None:  # token_logps() asked for this call
            request, state.request = state.request, None
            return logps(params, extra, request)
        labels = params.get("labels")
        if causal_lm.training and labels is not None and not state.request_only:
            return loss(params, extra, labels)
        if causal_lm.training and not state.said_no_labels:
            state.said_no_labels = True
            info_rank0(OUTSIDE_REQUEST if state.request_only else NO_LABELS)
        return original(*args, **kwargs)

    forward.liger_fsdp_state = state
    return forward
