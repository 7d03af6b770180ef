"""The first-step guard (``liger_fsdp_guard``, on by default): every function the plugin replaces is held against the
original on the first training call with labels, on a slice of the real micro-batch, on every rank.

What is compared is what the trainer receives from each side:

* SFT / pt: the causal LM's own ``forward`` (its ``.loss``) against the fused forward's (decoder, loss seam, the
  family's terms);
* the preference stages and v1: LLaMA-Factory's own method -- ``CustomDPOTrainer.concatenated_forward``,
  ``CustomKTOTrainer.forward``, v1's ``BaseTrainer.compute_log_probs`` and ``DPOTrainer.compute_loss`` -- against the
  plugin's replacement, each output as the trainer reads it (per-token and per-sequence log-probs, the logits'
  means or sums the metrics take, v1 DPO's loss and logged metrics), after every crossing the real call makes (FSDP
  units, the fp32 limbs, ZeRO-3 hooks, the wrapped model's root).

So a change of LLaMA-Factory's method (a newer release averaging differently) stops the run instead of being
silently replaced, and so does any error between the kernel and the trainer. Both sides run under ``torch.no_grad``
from the same RNG state (dropout masks identical; restored afterwards) on the slice of :mod:`.guard_slice`. On the
original side every call of the output embedding computes its linear layers in fp32 from the 16-bit operands it would
have had (:class:`.fp32_head.HeadCalls`), as the kernel does, so in bf16 the sides differ by summation order and the
fused path's deliberate roundings: bound ``rtol=2e-3, atol=1e-4`` (fp32 ``1e-4, 1e-6``; an injected 1% error exceeds it
five times over; ``bench/guard_bounds.py`` measures the worst honest difference). A forward that never calls its
output embedding as a module is compared in its own precision, bound ``5e-3, 1e-3``, and the line says so.

Where no comparison is possible (a batch with image inputs whose fp32 logits exceed the budget), the run stops on step
1 when a library newer than tested is installed (naming the cause, the versions and the fix) and says so in one line
otherwise: never "not checked" and on silently. Decisions are collective (all-reduces before and after the two sides):
ids or labels outside the vocabulary stop every rank naming ``resize_vocab``; a step in which no rank has a labelled
position defers the check; a mismatch on any rank stops every rank. An exception inside either side propagates at
once with a note (no collective after it: the other ranks may be inside one of the forward's own collectives).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import guard_slice, versions
from .collective import all_max, collective_device  # noqa: F401  (guard.all_max: tests replace it)
from ._log import info_rank0, rank
from .config import LigerFsdpConfigError, LigerFsdpDataError
from .forward_state import original_forwards, state_of
from .fp32_head import HeadCalls
from .guard_slice import BUDGET  # noqa: F401  (the slice's size, read by tests)
from .losses import IGNORE_INDEX

BOUNDS = {torch.float32: (1e-4, 1e-6), torch.float64: (1e-4, 1e-6)}
LOW_PRECISION = (2e-3, 1e-4)
OWN_PRECISION = (5e-3, 1e-3)  # 16-bit logits on the original side (no module call of the head to compute in fp32)
FIX_UNTESTED = ("Fix: install the tested versions (README, \"Supported versions\"), or remove `liger_fsdp`, and report "
                "this line")


def bounds(dtype: torch.dtype, own_precision: bool = False) -> tuple[float, float]:
    if dtype in BOUNDS:
        return BOUNDS[dtype]
    return OWN_PRECISION if own_precision else LOW_PRECISION


@dataclass
class Check:
    """One replaced function: how to run each side on a batch and what of their results to compare."""

    what: str  # the original's name, for the messages
    original: Callable[[dict], Any]
    ours: Callable[[dict], Any]
    compare: Callable[[Any, Any], dict]  # name -> (original's tensor, ours)
    models: tuple = ()  # engaged causal LMs whose forwards must run their original during the original side
    loss_line: bool = False  # SFT: say "model's own loss" / "fused loss"
    windowed: Callable[[Any], tuple] | None = None  # a batch too large to run whole: (original, ours) for a window
    fix: str | None = None  # the mismatch's fix where removing `liger_fsdp` alone is not one (tested versions)
    said_as: str = "with the fused kernel"  # the line's words for the plugin's side


class Rng:
    """The CPU and current-CUDA-device generator states: taken once, restorable any number of times."""

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def restore(self):
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)


def vocab_problem(causal_lm, ids, labels: torch.Tensor, shift_labels, ignore_index: int) -> str | None:
    """Token ids or labels the model's vocabulary cannot take (a data error, not a mismatch)."""
    rows = getattr(causal_lm.get_input_embeddings(), "num_embeddings", None) if causal_lm is not None else None
    if rows is not None and torch.is_tensor(ids) and ids.numel() and (int(ids.max()) >= rows or int(ids.min()) < 0):
        bad = int(ids.max()) if int(ids.max()) >= rows else int(ids.min())
        return f"token id {bad} in input_ids, outside the {rows} rows of the input embedding"
    head = causal_lm.get_output_embeddings() if causal_lm is not None else None
    if head is None:  # a score head: no vocabulary to label
        return None
    v = head.out_features
    for what, y in (("labels", labels), ("shift_labels", shift_labels)):
        if torch.is_tensor(y):
            wrong = (y != ignore_index) & ((y < 0) | (y >= v))
            if bool(wrong.any()):
                return f"label {int(y[wrong][0])} in {what}, outside the {v} rows of the head (not ignore_index)"
    return None


def worst_element(pairs: dict, rtol: float, atol: float) -> tuple[bool, str, float, float]:
    """(any element out of bound, its name, the original's value, ours) -- the worst element by excess over bound.
    NaN on one side only is a difference; NaN on both (0 / 0 on both sides) is agreement."""
    worst = (-float("inf"), "", 0.0, 0.0)
    for name, (a, b) in pairs.items():
        a, b = torch.as_tensor(a).detach().double().flatten().cpu(), torch.as_tensor(b).detach().double().flatten().cpu()
        if a.shape != b.shape:
            return True, f"{name} (shapes {tuple(a.shape)} and {tuple(b.shape)})", float("nan"), float("nan")
        both_nan = a.isnan() & b.isnan()
        excess = torch.where(both_nan, torch.zeros_like(a), (a - b).abs() - (rtol * a.abs() + atol))
        excess = torch.where(excess.isnan(), torch.full_like(a, float("inf")), excess)
        if excess.numel() and float(excess.max()) > worst[0]:
            i = int(excess.argmax())
            worst = (float(excess[i]), name, float(a[i]), float(b[i]))
    return worst[0] > 0, worst[1], worst[2], worst[3]


@contextlib.contextmanager
def _original_side(causal_lm, models, window=None):
    with contextlib.ExitStack() as stack:
        calls = [stack.enter_context(HeadCalls(m, window)) for m in
                 (causal_lm, *[m for m in models if m is not causal_lm])]
        stack.enter_context(original_forwards(causal_lm, *models))
        yield calls


def note_raised(exc: BaseException, step: int, what: str, where: str) -> None:
    """An error inside either side of the guard is that error, not a mismatch: a note says where it came from."""
    if hasattr(exc, "add_note"):
        exc.add_note(f"[liger_fsdp] raised inside the first-step guard (step {step}), by {what} or the plugin's "
                     f"replacement {where}; `liger_fsdp_guard: false` skips the check.")


def unchecked(step: int, what: str, reason: str) -> None:
    newer = versions.untested()
    if newer:
        raise LigerFsdpConfigError(
            f"`liger_fsdp_guard`: on step {step} {what} could not be compared with the plugin's replacement: {reason}. "
            f"Installed versions newer than tested: {', '.join(newer)}, so nothing else vouches for the fused loss. "
            f"{FIX_UNTESTED}; or set `liger_fsdp_guard: false` to train unchecked."
        )
    info_rank0(f"[liger_fsdp] guard: step {step} not checked: {reason}; {what} is replaced without a comparison "
               "(tested versions installed).")


def hold(check: Check, causal_lm, family, batch: dict, labels: torch.Tensor, *, step: int, shifted: bool = False,
         pairs: bool = False, ignore_index: int = IGNORE_INDEX) -> bool:
    """Run ``check`` on a slice of ``batch`` on every rank; True once decided, False when no rank had a labelled
    position (check again next step). Raises on a mismatch or a data error (every rank)."""
    problem = vocab_problem(causal_lm, batch.get("input_ids"), labels, batch.get("shift_labels"), ignore_index)
    vocab = causal_lm.get_output_embeddings().out_features
    piece, too_big = guard_slice.choose(batch, labels, masked_mean=family.loss == "masked_mean", pairs=pairs,
                                        shifted=shifted, ignore_index=ignore_index, vocab=vocab)
    data_rank, any_labels, any_too_big = all_max(
        [rank() + 1 if problem else 0, 1 if piece.labelled else 0, 1 if too_big else 0])
    if not data_checked(problem, data_rank, any_labels, step):
        return False
    original, replacement, window = check.original, check.ours, None
    if any_too_big:
        if check.windowed is None:
            unchecked(step, check.what, f"a batch with image inputs cannot be cut, and its fp32 logits would exceed "
                                         f"{guard_slice.LOGITS_BUDGET / 2**30:.0f} GiB")
            return True
        if too_big:  # this rank's own batch (another rank's may be text, cut as usual, or small enough to run whole)
            original, replacement = check.windowed(piece)
            window = (piece.rows, piece.start, piece.end)
    b, t = labels.shape
    small = guard_slice.cut(batch, piece, b, t)
    rng = Rng()
    try:
        with torch.no_grad():
            with _original_side(causal_lm, check.models, window) as calls:
                theirs = original(dict(small))
            rng.restore()
            ours = replacement(dict(small))
            pairs_out = check.compare(theirs, ours)
    except Exception as exc:  # not a mismatch: the same error, at once (no collective after it)
        note_raised(exc, step, check.what, "on a slice of the micro-batch")
        raise
    finally:
        rng.restore()
    own = sum(c.calls for c in calls) == 0
    dtype = next((c.dtype for c in calls if c.dtype is not None), None) or causal_lm.get_output_embeddings().weight.dtype
    decide(check, causal_lm, family.model_type, pairs_out, dtype=dtype, own=own, where=piece.describe(),
           labelled=bool(piece.labelled), step=step)
    return True


def data_checked(problem: str | None, data_rank: float, any_labels: float, step: int) -> bool:
    """After the first all-reduce: a data error on any rank stops every rank; False when no rank has labels."""
    if data_rank:
        where = problem or f"rank {int(data_rank) - 1}'s batch has a token id or label outside the vocabulary"
        raise LigerFsdpDataError(
            f"`resize_vocab`: step {step}, rank {rank()}: {where}. The tokenizer has more tokens than the model's "
            "embeddings (added tokens); the run without liger_fsdp fails on it as well. Fix: set `resize_vocab: true` "
            "(LLaMA-Factory resizes the embeddings and the head to the tokenizer), or use the model's own tokenizer."
        )
    return bool(any_labels)


def decide(check: Check, model, model_type: str, pairs_out: dict, *, dtype, own: bool, where: str, labelled: bool,
           step: int, precision: str | None = None) -> None:
    """Compare ``pairs_out`` (name -> (original's, ours)) within the bound of ``dtype`` and decide on every rank
    together (one all-reduce): a mismatch anywhere stops every rank; else one line (rank 0)."""
    kind = collective_device().type
    if torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
    rtol, atol = bounds(dtype, own)
    bad, name, a, f = worst_element(pairs_out, rtol, atol)
    name16 = str(dtype).replace('torch.', '')
    precision = precision or (f"{name16} logits of the model's own precision (its forward never calls the output "
                              "embedding as a module)" if own else f"fp32 logits from the same {name16} inputs")
    if check.loss_line:
        head = f"model's own {name} {a:.7g}, fused {name} {f:.7g}"
    else:
        head = f"{check.what}: {name} {a:.7g}, {check.said_as} {f:.7g} (worst element)"
    text = f"{head} (|diff| {abs(f - a):.3g}, bound {rtol * abs(a) + atol:.3g}; {precision}) on {where}"
    if not labelled:
        bad, text = False, "not checked on this rank: no labelled position in its slice"
    (mismatch,) = all_max([float(bad)])
    if mismatch:
        if not bad:
            text = ("this rank's slice was not checked (no labelled position in it)" if not labelled else
                    f"this rank's slice agreed ({text})") + "; another rank's did not (see its error)"
        newer = versions.untested()
        fix = (f"Installed versions newer than tested: {', '.join(newer)}; a newer library may have changed what the "
               f"loss sees. {FIX_UNTESTED}" if newer else check.fix or "Fix: remove `liger_fsdp` for this model and "
               f"report this line with your transformers version (llamafactory {versions.installed('llamafactory')})")
        subject = ("the fused loss is not the model's own" if check.loss_line else
                   f"the plugin's replacement of {check.what} does not give what LLaMA-Factory's own gives")
        raise LigerFsdpConfigError(
            f"`liger_fsdp_guard`: on step {step} {subject} for model type `{model_type}` "
            f"({type(model).__name__}), rank {rank()}: {text}. A quirk of this model or a change of LLaMA-Factory's "
            f"method is not reproduced, so training would optimise another objective. {fix} "
            "(`liger_fsdp_guard: false` skips the check)."
        )
    info_rank0(f"[liger_fsdp] guard: step {step} {'' if not labelled else 'exact: '}{text}.")


def first_call(causal_lm, family, check: Check, batch: dict, labels: torch.Tensor, *, step: int | None,
               pairs: bool = False) -> None:
    """A replaced trainer method's call: held against the original (:func:`hold`) on the policy's first training
    call with gradients while the guard is on (not a reference or KL pass, not eval)."""
    state = state_of(causal_lm)
    if state is None or not state.guard or not (causal_lm.training and torch.is_grad_enabled()):
        return
    state.guard = False
    state.guard = not hold(check, causal_lm, family, batch, labels, step=step or state.global_step, pairs=pairs)
