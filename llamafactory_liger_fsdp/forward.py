"""The one generic causal-LM training forward, for every family.

Set on the causal LM *instance* by :func:`..engage.engage`. In training with labels it

1. runs the decoder exactly as the original forward does (same arguments, ``**kwargs`` included),
2. computes the loss with :func:`..losses.causal_lm_loss` through the head strategy, and
3. adds the family's extra terms (:mod:`.families`: softcap inside the kernel, MoE router aux loss).

In eval, or without labels, the original forward runs untouched (callers may want the logits).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from torch import nn

from . import families, losses
from .families import Family
from .heads import Head


class ForwardState:
    """Per-model state of the fused forward (what happens on the first training step)."""

    def __init__(self, on_first_step: Callable[[], Callable | None] | None = None):
        self.steps = 0
        self.on_first_step = on_first_step


def make_forward(causal_lm: nn.Module, head: Head, family: Family, backend: str | None, state: ForwardState):
    """The replacement for ``causal_lm.forward`` (signature kept: the Trainer inspects it)."""
    original = causal_lm.forward
    signature = inspect.signature(original)
    var_kw = next((n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    softcap = families.softcap(family, causal_lm.config)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any):
        params = dict(signature.bind_partial(*args, **kwargs).arguments)
        extra = dict(params.pop(var_kw, {}) if var_kw else {})
        labels = params.get("labels")
        if not (causal_lm.training and labels is not None):
            return original(*args, **kwargs)
        params.pop("labels")
        logits_to_keep = params.pop("logits_to_keep", 0)
        if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise ValueError("liger_fsdp: `logits_to_keep` must be 0 when training with labels")
        if family.moe:
            orl = params.get("output_router_logits")
            params["output_router_logits"] = causal_lm.config.output_router_logits if orl is None else orl
        wrap_kernel = None
        state.steps += 1
        if state.steps == 1 and state.on_first_step is not None:
            wrap_kernel = state.on_first_step()

        outputs = getattr(causal_lm, causal_lm.base_model_prefix)(**params, **extra)
        loss = losses.causal_lm_loss(
            causal_lm,
            head,
            outputs.last_hidden_state,
            labels,
            shift_labels=extra.get("shift_labels"),
            num_items_in_batch=extra.get("num_items_in_batch"),
            ignore_index=extra.get("ignore_index", -100),
            softcap=softcap,
            backend=backend,
            wrap_kernel=wrap_kernel,
        )
        return families.build_output(family, causal_lm, loss, outputs, params.get("attention_mask"))

    return forward
