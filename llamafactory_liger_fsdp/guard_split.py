"""The first-step guard under sequence parallelism (v1's Ulysses, ``cp_size > 1``): held on the very split forward the
fused path runs, not on a second, unsplit one.

No rank holds a long micro-batch's logits, and an unsplit decoder is not the split one in bf16, so a cp_size-1
reference would differ by more than the guard's bounds (measured for identical hidden states) or not run at all. So on
the first training call :class:`Probe` keeps the decoder's output of each fused log-probs call (the policy's, the
reference model's) and applies the model's own forward from there on -- the output embedding in fp32 from the same
16-bit operands (:class:`.fp32_head.HeadCalls`), the family's softcap or logit scale, the head's LoRA dropout replayed
-- in chunks of positions (bounded memory at any length): per-token log-probs at the same targets, per-position logit
sums. The CP modules run the trainer's own loss on those (LLaMA-Factory's function) and the plugin's on the fused ones
and hand both to :func:`first_call`, which decides as :func:`.guard.hold` does: one all-reduce before (a data error
anywhere stops every rank; no labels anywhere defers), one after (a mismatch anywhere stops every rank).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import guard
from ._log import rank
from .fp32_head import HeadCalls
from .losses import IGNORE_INDEX

CHUNK_BYTES = 1 << 29  # fp32 logits one chunk of the reference head may form


@dataclass
class Split:
    """One replaced function under CP: ``run(probe)`` makes the real call with the probe recording and returns (its
    result, name -> (LLaMA-Factory's value, the plugin's)); ``plain()`` makes it without."""

    what: str
    run: Callable[["Probe"], tuple[Any, dict]]
    plain: Callable[[], Any]
    dtype: torch.dtype | None = None  # the bound's dtype where no head call was probed (a score head)
    precision: str | None = None  # the line's words for it
    fix: str | None = None
    said_as: str = "with the fused kernel"  # the line's words for the plugin's side
    loss_line: bool = False


@dataclass
class Record:
    """One probed log-probs call of this rank's shard: the reference's and the plugin's per-token log-probs (each
    position's own target), the reference's per-position logit sums (or None), the vocabulary size."""

    reference: torch.Tensor
    ours: torch.Tensor
    sums: torch.Tensor | None
    vocab: int


class _Decoded(dict):
    """The decoder's output as the model's own forward reads it (``.last_hidden_state``, ``[0]``; anything else
    None: no router logits, no rope deltas)."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__(last_hidden_state=hidden)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self.get(name)

    def __getitem__(self, key):
        return self["last_hidden_state"] if key == 0 else dict.__getitem__(self, key)


def _decoder(causal_lm: torch.nn.Module) -> torch.nn.Module:
    from .engage import engaged

    return getattr(causal_lm, engaged(causal_lm).family.decoder or causal_lm.base_model_prefix)


def _dropouts(causal_lm: torch.nn.Module) -> list:
    return [m for m in causal_lm.get_output_embeddings().modules()
            if isinstance(m, torch.nn.Dropout) and m.training and m.p > 0]


@contextlib.contextmanager
def _instance_forward(module: torch.nn.Module, fn: Callable):
    before = module.__dict__.get("forward")
    module.__dict__["forward"] = fn
    try:
        yield
    finally:
        if before is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = before


class Probe:
    """The guard's reference side on the fused path's own hidden states (see the module's text)."""

    def __init__(self):
        self.records: list[Record] = []
        self.heads: list[HeadCalls] = []

    @contextlib.contextmanager
    def capture(self, causal_lm: torch.nn.Module):
        """For its duration: the decoder's last output and what the head's active dropout modules returned."""
        seen: dict = {"hidden": None, "dropout": {}}

        def keep_hidden(module, args, out):
            seen["hidden"] = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

        def keep_dropout(module, args, out):
            seen["dropout"][module] = out.detach()

        handles = [_decoder(causal_lm).register_forward_hook(keep_hidden)]
        handles += [m.register_forward_hook(keep_dropout) for m in _dropouts(causal_lm)]
        try:
            yield seen
        finally:
            for handle in handles:
                handle.remove()

    @torch.no_grad()
    def record(self, causal_lm: torch.nn.Module, seen: dict, targets: torch.Tensor, ours: torch.Tensor,
               sums: bool) -> Record:
        """The model's own forward from the captured hidden states on: per-token log-probs at ``targets`` (each
        position's own, ``[B, T]``) and, with ``sums``, per-position logit sums."""
        from .engage import engaged

        hidden = seen["hidden"]
        if hidden is None:
            raise RuntimeError("the fused log-probs call did not run the decoder the guard watches")
        original = causal_lm.__dict__["forward"].__wrapped__  # the model's own forward the fused one replaced
        vocab = engaged(causal_lm).seam.vocab_size
        b, t, h = hidden.shape
        flat, y = hidden.detach().reshape(1, b * t, h), targets.reshape(-1).to(hidden.device)
        step = max(1, CHUNK_BYTES // (4 * vocab))
        now: dict = {"rows": (0, 0), "calls": 0}
        params = inspect.signature(original).parameters
        kwargs = {k: v for k, v in (("use_cache", False), ("return_dict", True), ("output_router_logits", False),
                                    ("skip_logits", False), ("logits_to_keep", 0)) if k in params}

        def decoded(*args, **kw):
            now["calls"] += 1
            return _Decoded(flat[:, now["rows"][0]:now["rows"][1]])

        def replay(out: torch.Tensor):
            rows = out.reshape(-1, out.shape[-1])
            if rows.shape[0] != b * t:
                raise RuntimeError(f"the head's dropout saw {rows.shape[0]} rows, the shard has {b * t}")
            return lambda x: rows[now["rows"][0]:now["rows"][1]].reshape(x.shape).to(x.dtype)

        logps, logit_sums = [], []
        rng = guard.Rng()
        with contextlib.ExitStack() as stack:
            calls = stack.enter_context(HeadCalls(causal_lm))
            stack.enter_context(_instance_forward(_decoder(causal_lm), decoded))
            for module, out in seen["dropout"].items():
                stack.enter_context(_instance_forward(module, replay(out)))
            for start in range(0, b * t, step):
                now["rows"] = (start, min(b * t, start + step))
                ids = torch.zeros(1, now["rows"][1] - start, dtype=torch.long, device=hidden.device)
                logits = original(input_ids=ids, **kwargs).logits.float().reshape(-1, vocab)
                logps.append(-F.cross_entropy(logits, y[start:now["rows"][1]], reduction="none",
                                              ignore_index=IGNORE_INDEX))
                if sums:
                    logit_sums.append(logits.sum(-1))
        rng.restore()
        if now["calls"] == 0:
            raise RuntimeError(f"{type(causal_lm).__name__}'s forward did not call its decoder "
                               f"`{type(_decoder(causal_lm)).__name__}`, so the guard cannot give it the hidden states")
        self.heads.append(calls)
        found = Record(torch.cat(logps).view(b, t), ours.detach().float(),
                       torch.cat(logit_sums).view(b, t) if sums else None, vocab)
        self.records.append(found)
        return found

    def precision(self, check: Split) -> tuple[torch.dtype, bool, str | None]:
        """(the bound's dtype, whether the logits were the model's own precision, the line's words or None)."""
        if not self.heads:
            return check.dtype or torch.float32, False, check.precision
        own = sum(c.calls for c in self.heads) == 0
        dtype = next((c.dtype for c in self.heads if c.dtype is not None), None) or torch.float32
        return dtype, own, check.precision


_ACTIVE: list[Probe] = []  # the probe of the guarded call in progress (none outside it)


def active() -> Probe | None:
    return _ACTIVE[-1] if _ACTIVE else None


def token_logps(model, causal_lm, inputs: dict, targets: torch.Tensor, *, sums: bool, step: int | None = None):
    """:func:`.forward.token_logps` on a shard (``targets``: each position's own); during a guarded call its
    reference on the same hidden states is recorded."""
    from . import forward

    probe = active()
    if probe is None:
        return forward.token_logps(model, causal_lm, inputs, targets, sums=sums, step=step, shifted=True)
    with probe.capture(causal_lm) as seen:
        out = forward.token_logps(model, causal_lm, inputs, targets, sums=sums, step=step, shifted=True)
    probe.record(causal_lm, seen, targets, out[0], sums)
    return out


def first_call(state: Any, check: Split, model, model_type: str, facts: Callable[[], dict]) -> Any:
    """The real call of a function replaced under CP; on the first training call with gradients while the guard is
    on (``state.guard``), with the probe recording and the two sides compared on every rank together. ``facts()``
    (read only then): ``step`` (the run's), ``problem`` (a data error or None), ``labelled``, ``where``."""
    if state is None or not getattr(state, "guard", False) or not (model.training and torch.is_grad_enabled()):
        return check.plain()
    state.guard = False
    told = facts()
    step, problem, labelled, where = told["step"], told["problem"], told["labelled"], told["where"]
    data_rank, any_labels = guard.all_max([rank() + 1 if problem else 0, 1 if labelled else 0])
    if not guard.data_checked(problem, data_rank, any_labels, step):
        state.guard = True  # no rank has a labelled position: the next call checks
        return check.plain()
    probe = Probe()
    _ACTIVE.append(probe)
    try:
        result, pairs = check.run(probe)
    except Exception as exc:  # not a mismatch: the same error, at once (no collective after it)
        guard.note_raised(exc, step, check.what, "on the same split forward")
        raise
    finally:
        _ACTIVE.remove(probe)
    dtype, own, precision = probe.precision(check)
    guard.decide(check, model, model_type, pairs, dtype=dtype, own=own, where=where, labelled=labelled, step=step,
                 precision=precision)
    return result


def two_columns(logps: torch.Tensor, means: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., 2]`` logits whose cross-entropy at class 0 is exactly ``-logps`` (``[lp, log(1 - e^lp)]``, shifted
    by a constant per position so that their mean is ``means``, where given): a stand-in model's output that lets a
    trainer's own loss, written on logits, run on log-probs."""
    lp = logps.float().clamp(max=0)
    other = torch.maximum(torch.log(-torch.expm1(lp.clamp(max=-1e-30))), lp - 60)
    shift = 0 if means is None else means.float() - (lp + other) / 2
    return torch.stack([lp + shift, other + shift], dim=-1)


def class_zero(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``labels`` with every scored position's target class 0 (for :func:`two_columns`)."""
    return torch.where(labels == ignore_index, labels, torch.zeros_like(labels))
