"""The one generic causal-LM training forward, for every family.

Set on the causal LM *instance* by :func:`..engage.engage`. In training with labels it

1. runs the decoder exactly as the original forward does (every bound argument, ``**kwargs`` included:
   pixel values, grid sizes, masks and position ids of a vision-language model pass untouched),
2. computes the loss with :func:`..losses.causal_lm_loss` through the head strategy, and
3. applies the family's quirks as data (:mod:`.families`: softcap, logit scale, loss variant, MoE aux).

On the first training step with labels the exactness guard (:mod:`.guard`) compares it with the original forward.
In eval, or without labels, the original forward runs untouched (callers may want the logits); in
training without labels that is said once (the Trainer pops them for ``label_smoothing_factor > 0``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from torch import nn

from . import families, losses, preference
from ._log import info_rank0
from .families import Family
from .heads import Head


class ForwardState:
    """Per-model state of the fused forward: what happens on the first training step, the guard, and
    ``label_smoothing``: when set (> 0), the loss is transformers' ``LabelSmoother(eps)(outputs, labels,
    shift_labels=True)`` computed by the kernel -- for a caller that passes the labels instead of letting the
    Trainer pop them (the Trainer's own smoother is then off)."""

    def __init__(self, on_first_step: Callable[[], Callable | None] | None = None, guard: bool = True,
                 start_step: int = 0, grad_accum: int = 1):
        self.steps = 0  # training forwards with labels so far
        self.on_first_step = on_first_step
        self.guard = guard  # still to run (it defers itself while no rank has a labelled position)
        self.start_step, self.grad_accum = start_step, max(1, grad_accum)
        self.label_smoothing = 0.0
        self.said_no_labels = False

    @property
    def global_step(self) -> int:
        """The optimizer step the current forward belongs to, as the Trainer counts (a resume included)."""
        return self.start_step + (self.steps - 1) // self.grad_accum + 1


NO_LABELS = ("[liger_fsdp] training forward without labels: the fused path is bypassed for it and the model computes "
             "its full logits (the run trains correctly, without the memory saving). The usual cause is "
             "`label_smoothing_factor > 0` on an image-text class: the Trainer then pops the labels and smooths the "
             "logits itself (for causal-LM classes the plugin keeps the labels and the kernel smooths).")


def make_forward(causal_lm: nn.Module, head: Head, family: Family, backend: str | None, state: ForwardState):
    """The replacement for ``causal_lm.forward`` (signature kept: the Trainer inspects it)."""
    original = causal_lm.forward
    signature = inspect.signature(original)
    var_kw = next((n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    softcap = families.softcap(family, causal_lm.config)
    scale = families.logit_scale(family, causal_lm.config, causal_lm)
    decoder_attr = family.decoder or causal_lm.base_model_prefix

    def fused(params: dict, extra: dict, labels, wrap_kernel=None, window=None):
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
        loss = losses.causal_lm_loss(
            causal_lm, head, hidden, labels, kind=family.loss, shift_labels=shift_labels,
            num_items_in_batch=extra.get("num_items_in_batch"), ignore_index=extra.get("ignore_index", -100),
            attention_mask=params.get("attention_mask"), softcap=softcap, scale=scale,
            label_smoothing=state.label_smoothing if window is None else 0.0,  # the model's own loss never smooths
            backend=backend, wrap_kernel=wrap_kernel,
        )
        return families.build_output(family, causal_lm, loss, outputs, params.get("attention_mask"), with_aux)

    def logps(params: dict, extra: dict, labels):
        """Preference stages: per-token log-probs and per-position logit sums (:mod:`.preference`), any mode."""
        for key in ("labels", "logits_to_keep", "output_router_logits"):
            params.pop(key, None)
        if state.steps == 0 and state.on_first_step is not None:
            state.steps = 1
            state.on_first_step()
        outputs = getattr(causal_lm, decoder_attr)(**params, **extra)
        token_logps, sums = preference.token_logps(causal_lm, head, outputs.last_hidden_state, labels,
                                                   softcap=softcap, scale=scale, backend=backend)
        return preference.pack(token_logps, sums, causal_lm.get_output_embeddings().out_features)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any):
        params = dict(signature.bind_partial(*args, **kwargs).arguments)
        extra = dict(params.pop(var_kw, {}) if var_kw else {})
        if preference.LABELS_KEY in extra:
            return logps(params, extra, extra.pop(preference.LABELS_KEY))
        labels = params.get("labels")
        if not (causal_lm.training and labels is not None):
            if causal_lm.training and not state.said_no_labels:
                state.said_no_labels = True
                info_rank0(NO_LABELS)
            return original(*args, **kwargs)
        params.pop("labels")
        logits_to_keep = params.pop("logits_to_keep", 0)
        if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise ValueError("liger_fsdp: `logits_to_keep` must be 0 when training with labels")
        wrap_kernel = None
        state.steps += 1
        if state.steps == 1 and state.on_first_step is not None:
            wrap_kernel = state.on_first_step()
        if state.guard:
            from . import guard

            state.guard = not guard.check(causal_lm, family, original, signature, fused, params, extra, labels,
                                          step=state.global_step)
        return fused(params, extra, labels, wrap_kernel)

    forward.liger_fsdp_state = state
    return forward
