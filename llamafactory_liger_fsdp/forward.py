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

On the first training step with labels (SFT / pt) the guard (:mod:`.guard`) holds the model's own forward against this
one on a slice; the trainer methods that ask for log-probs are held against LLaMA-Factory's own there too.
In eval, or without labels, the original forward runs untouched (callers may want the logits); in
training without labels that is said once (the Trainer pops them for ``label_smoothing_factor > 0``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from . import announce, families, fp32_limbs
from ._log import info_rank0
from .forward_state import ForwardState, Request, pending, state_of  # noqa: F401  (state_of, ForwardState: callers)
from .losses import IGNORE_INDEX, HeadLoss


NO_LABELS = ("[liger_fsdp] training forward without labels: the fused path is bypassed for it and the model computes "
             "its full logits (the run trains correctly, without the memory saving). The usual cause is "
             "`label_smoothing_factor > 0` on an image-text class: the Trainer then pops the labels and smooths the "
             "logits itself (for causal-LM classes the plugin keeps the labels and the kernel smooths).")


OUTSIDE_REQUEST = ("[liger_fsdp] a training forward outside the trainer's log-probs call (v1): the model computes its "
                   "full logits for it, as without the plugin (correct, without the memory saving).")


def token_logps(model: nn.Module, causal_lm: nn.Module, inputs: dict, labels: torch.Tensor, *, sums: bool = True,
                step: int | None = None, shifted: bool = False):
    """The preference stages' and v1's call: ``model(**inputs)`` (the whole wrapped model, so FSDP / DeepSpeed run
    their root hooks) answered by the fused forward of ``causal_lm`` with per-token log-probs instead of logits.
    Returns (fp32 log-probs ``[B, T-1]``, fp32 per-position logit sums ``[B, T]`` or None without ``sums``,
    vocabulary size). ``step`` is the trainer's optimizer step (the guard's messages). ``shifted``: ``labels`` are
    each position's own target (log-probs ``[B, T]``, see :meth:`.losses.HeadLoss.token_logps`)."""
    state = state_of(causal_lm)
    with pending(state, Request(labels, sums, step, shifted)):
        out = model(**inputs, return_dict=True, use_cache=False)
    logps, sums = fp32_limbs.unpack(out)
    return logps, sums, out.vocab_size


class FusedForward:
    """What replaces ``causal_lm.forward``: the request, SFT and original paths of one engaged causal LM."""

    def __init__(self, causal_lm: nn.Module, seam: HeadLoss, state: ForwardState):
        self.causal_lm, self.seam, self.state, self.family = causal_lm, seam, state, seam.family
        self.original = causal_lm.forward
        self.signature = inspect.signature(self.original)
        self.var_kw = next((n for n, p in self.signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD),
                           None)
        self.decoder_attr = self.family.decoder or causal_lm.base_model_prefix

    def split(self, args: tuple, kwargs: dict) -> tuple[dict, dict]:
        """(the bound named parameters, the ``**kwargs`` ones)."""
        params = dict(self.signature.bind_partial(*args, **kwargs).arguments)
        return params, dict(params.pop(self.var_kw, {}) if self.var_kw else {})

    def first_step(self, params: dict):
        """Count a training forward; the first one logs the engaged line (and returns the memory report's wrapper).
        The kernel runs where the inputs are (under parameter offload the weights sit on the CPU between calls)."""
        self.state.steps += 1
        if self.state.steps != 1:
            return None
        device = next((v.device for v in params.values() if torch.is_tensor(v)), None)
        return announce.first_step(self.causal_lm, self.seam, self.state.config, device)

    def decoder(self, params: dict, extra: dict):
        return getattr(self.causal_lm, self.decoder_attr)(**params, **extra)

    def fused(self, params: dict, extra: dict, labels, smoothing: float | None = None):
        """Decoder, fused loss and the family's terms (the SFT / pt output)."""
        params, extra = dict(params), dict(extra)
        with_aux = families.aux_on(self.family, self.causal_lm.config, params, extra)
        outputs = self.decoder(params, extra)
        loss = self.seam.loss(
            outputs.last_hidden_state, labels, shift_labels=extra.get("shift_labels"),
            num_items_in_batch=extra.get("num_items_in_batch"), ignore_index=extra.get("ignore_index", IGNORE_INDEX),
            attention_mask=params.get("attention_mask"),
            label_smoothing=self.state.label_smoothing if smoothing is None else smoothing,
        )
        return families.build_output(self.family, self.causal_lm, loss, outputs, params.get("attention_mask"), with_aux)

    def logps(self, params: dict, extra: dict, request: Request) -> fp32_limbs.LogpsOutput:
        """Per-token log-probs (and per-position logit sums when asked), any mode (the reference pass too); the
        trainer's method that asked is held against LLaMA-Factory's own by the guard."""
        for key in ("labels", "logits_to_keep", "output_router_logits"):
            params.pop(key, None)
        if self.state.steps == 0:  # the memory report waits for the first call with gradients (not a guard's side,
            self.seam.report = self.first_step(params)  # not a reference pass): HeadLoss.token_logps takes it then
        hidden = self.decoder(params, extra).last_hidden_state
        token_logps, sums = self.seam.token_logps(hidden, request.labels, sums=request.sums, shifted=request.shifted)
        return fp32_limbs.pack(token_logps, sums, self.seam.vocab_size)

    def _guard(self, params: dict, extra: dict, labels) -> None:
        """SFT / pt, first step with labels on some rank: the model's own ``forward(...).loss`` against the fused one
        (and, when the kernel smooths, transformers' ``LabelSmoother`` on the model's logits against it)."""
        from . import guard, guard_slice

        extra = {k: v for k, v in extra.items() if k != "num_items_in_batch"}
        batch = {**params, **extra, "labels": labels}
        eps = self.state.label_smoothing

        def theirs(small: dict):
            out = self.run_original(**small)
            if not eps:
                return (out.loss,)
            from transformers.trainer_pt_utils import LabelSmoother  # what the Trainer would have computed

            return out.loss, LabelSmoother(epsilon=eps)(out, small["labels"], shift_labels=True)

        def ours(small: dict):
            p, e = self.split((), small)
            labels_ = p.pop("labels")
            own = self.fused(p, e, labels_, smoothing=0.0).loss  # the model's own loss never smooths
            return (own,) if not eps else (own, self.fused(p, e, labels_, smoothing=eps).loss)

        def compare(a: tuple, b: tuple) -> dict:
            names = ("loss", "label-smoothed loss (the Trainer's LabelSmoother)")
            return {name: pair for name, pair in zip(names, zip(a, b))}

        given = extra.get("shift_labels")
        key = "labels" if given is None else "shift_labels"

        def windowed(piece):  # images, too large to run whole: the model's head input cut to the window
            own, masked = guard_slice.window_labels(batch[key], piece, shifted=given is not None)
            extra_ = {} if given is None else {"labels": guard_slice.window_labels(labels, piece, False)[0]}
            return (lambda small: (self.run_original(**{**small, key: own, **extra_}).loss,),
                    lambda small: ours({**small, key: masked})[:1])

        check = guard.Check("the model's forward", theirs, ours, compare, loss_line=True,
                            windowed=None if eps else windowed)
        self.state.guard = False
        self.state.guard = not guard.hold(check, self.causal_lm, self.family, batch,
                                          labels if given is None else given, step=self.state.global_step,
                                          shifted=given is not None, ignore_index=extra.get("ignore_index", IGNORE_INDEX))

    def loss(self, params: dict, extra: dict, labels):
        """SFT / pt: the training loss (the guard on the first step with labels on some rank)."""
        params.pop("labels")
        logits_to_keep = params.pop("logits_to_keep", 0)
        if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise ValueError("liger_fsdp: `logits_to_keep` must be 0 when training with labels")
        memory_report = self.first_step(params)
        if self.state.guard:
            self._guard(params, extra, labels)
        self.seam.report = memory_report  # the real step's kernel call, not the guard's
        return self.fused(params, extra, labels)

    def run_original(self, *args: Any, **kwargs: Any):
        """The class's own forward (Liger's ``lce_forward`` on its logits path)."""
        if "skip_logits" in self.signature.parameters:
            kwargs["skip_logits"] = False
        return self.original(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any):
        state = self.state
        if state.reference:  # the guard's original side
            return self.run_original(*args, **kwargs)
        params, extra = self.split(args, kwargs)
        if state.request is not None:  # token_logps() asked for this call
            request, state.request = state.request, None
            return self.logps(params, extra, request)
        labels = params.get("labels")
        if self.causal_lm.training and labels is not None and not state.request_only:
            return self.loss(params, extra, labels)
        if self.causal_lm.training and not state.said_no_labels:
            state.said_no_labels = True
            info_rank0(OUTSIDE_REQUEST if state.request_only else NO_LABELS)
        return self.original(*args, **kwargs)


def make_forward(causal_lm: nn.Module, seam: HeadLoss, state: ForwardState):
    """The replacement for ``causal_lm.forward`` (signature kept: the Trainer inspects it)."""
    impl = FusedForward(causal_lm, seam, state)

    @functools.wraps(impl.original)
    def forward(*args: Any, **kwargs: Any):
        return impl(*args, **kwargs)

    forward.liger_fsdp_state = state
    return forward
