"""The first-step exactness guard (``liger_fsdp_guard``, on by default).

On the first training step in which some rank has a labelled position (global step ``N``; 1 for a fresh run),
every rank computes on a slice of its real micro-batch, under ``torch.no_grad`` and from the same RNG state
(dropout masks identical; the state is restored afterwards, so the real step draws what it would have drawn):

* the model's ORIGINAL loss: its own ``forward`` (normal module calls, so FSDP/DeepSpeed gather as in any
  forward; Liger's class forward with ``skip_logits=False``), with a pre-hook on the output embedding that keeps
  only the slice's positions, and every linear layer of the head computed in fp32 from the operands it would
  have had (:class:`.fp32_head.Fp32Head`: the same 16-bit hidden states and weights, autocast's cast included; nothing
  inside the head rounded back to 16 bits, FSDP2's output cast and PEFT's result cast included);
* the fused loss of :mod:`.forward` on the same inputs and positions (its kernel also forms fp32 logits from
  those 16-bit operands).

So in bf16/fp16 the two losses differ by fp32 summation order and the few roundings the fused path makes on
purpose (a LoRA head's ``A h`` and ``B`` in the compute dtype, a logit scale applied to 16-bit rows), not by the
16-bit rounding of the logits: the bound is ``rtol=2e-3, atol=1e-4`` (fp32: ``1e-4, 1e-6``), which an injected
1% error exceeds five times over. ``bench/guard_bounds.py`` measures the worst honest difference over every
family and head kind (``bench/results/guard_bounds.json``).

The slice: up to ``BUDGET`` (256) positions of one row, ending at its last labelled position (a packed or
right-padded row ends in padding), the row with the most labels in its slice (Gemma 3's masked mean aligns its
mask to the last positions of every row, so there: the last ``BUDGET // B`` positions of every row). Text-only
calls run both forwards on that row alone; calls with other inputs (pixel values, grid sizes, (3, B, T) position
ids) on the whole micro-batch (only the whole batch keeps images and image tokens consistent without per-family
slicing); the logits still exist for the slice only. ``num_items_in_batch`` is left out of both calls.

Decisions are the same on every rank (all-reduces before and after the two forwards): token ids or labels outside
the vocabulary stop every rank with a data error naming ``resize_vocab``; a step in which no rank has a labelled
position defers the check to the next step; a mismatch stops every rank with both numbers. An exception of the model's
own forward (out of memory, a collective failure, a shape bug) propagates unchanged, at once, with a note saying where
it ran: no collective follows it, since the other ranks may be waiting inside one of the forward's own (an all-reduce
there would pair with their all-gather); the launcher (torchrun, accelerate) stops them when this rank exits.
"""

from __future__ import annotations

import torch

from . import versions
from ._log import info_rank0, rank
from .config import LigerFsdpConfigError, LigerFsdpDataError
from .fp32_head import Fp32Head
from .losses import shifted_labels

BUDGET = 256
BOUNDS = {torch.float32: (1e-4, 1e-6), torch.float64: (1e-4, 1e-6)}
LOW_PRECISION = (2e-3, 1e-4)
TEXT_INPUTS = ("input_ids", "attention_mask", "position_ids", "token_type_ids", "inputs_embeds", "shift_labels",
               "loss_weights")  # v1's per-token weights (the model ignores them)
OK, MISMATCH, DATA, FAILED = 0, 1, 2, 3


def bounds(dtype: torch.dtype) -> tuple[float, float]:
    return BOUNDS.get(dtype, LOW_PRECISION)


def _window(family, labels: torch.Tensor, shift_labels, ignore_index: int):
    """(row, or None for every row; start; end; labelled positions in the slice). Hidden positions [start, end)
    with ``labels[start:end]`` (shifted inside, as the model's own loss does) or ``shift_labels[start:end]``."""
    b, t = labels.shape
    if family.loss == "masked_mean":
        k = min(t, max(2, BUDGET // b))
        valid = (labels[:, -k:][:, 1:] != ignore_index).sum()
        return None, t - k, t, int(valid)
    # the label of each hidden position; an unshifted slice [start, end) loses its last position's label to the
    # model's own shift, so it must reach one position further
    given = shift_labels is not None
    target = (shift_labels if given else shifted_labels(labels, ignore_index)) != ignore_index
    past = 0 if given else 1
    best = (0, 0, min(t, BUDGET), 0)
    for r in range(b):
        where = target[r].nonzero()
        if not where.numel():
            continue
        end = min(t, int(where.max()) + 1 + past)  # includes the last labelled one
        start = max(0, end - BUDGET)
        n = int(target[r, start:end - past].sum())
        if n > best[3]:
            best = (r, start, end, n)
    return best


def _text_only(params: dict, extra: dict, b: int) -> bool:
    tensors = {k: v for k, v in {**params, **extra}.items() if torch.is_tensor(v)}
    return all(k in TEXT_INPUTS and v.dim() >= 1 and v.shape[0] == b for k, v in tensors.items())


def _row(values: dict, r: int, b: int) -> dict:
    return {k: v[r:r + 1] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == b else v for k, v in values.items()}


class _Rng:
    """The CPU and current-CUDA-device generator states: taken once, restorable any number of times."""

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def restore(self):
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)


def _original_loss(causal_lm, original, signature, params, extra, labels, rows, start, end):
    """(the model's own loss with fp32 logits for the slice only, the head's input dtype); (None, None) if the
    forward never calls its output embedding as a module."""
    kwargs = {**params, **extra, "labels": labels[rows, start:end]}
    if kwargs.get("shift_labels") is not None:
        kwargs["shift_labels"] = kwargs["shift_labels"][rows, start:end]
    if "skip_logits" in signature.parameters:  # Liger's lce_forward: its plain (logits) path
        kwargs["skip_logits"] = False
    seen, mode, inside = [], Fp32Head(), [False]

    def enter(module, args):
        seen.append(args[0].dtype)
        if len(seen) == 1:
            mode.__enter__()
            inside[0] = True
        return (args[0][rows, start:end], *args[1:])

    def leave(module, args, output):
        if inside[0]:
            inside[0] = False
            mode.__exit__(None, None, None)

    head = causal_lm.get_output_embeddings()
    handles = [head.register_forward_pre_hook(enter), head.register_forward_hook(leave, always_call=True)]
    try:
        loss = original(**kwargs).loss
    finally:
        for handle in handles:
            handle.remove()
        leave(None, None, None)
    return (loss, seen[0]) if len(seen) == 1 else (None, None)


def _vocab_problem(causal_lm, params: dict, labels: torch.Tensor, shift_labels, ignore_index: int) -> str | None:
    """Token ids or labels the model's vocabulary cannot take (a data error, not a mismatch)."""
    rows = getattr(causal_lm.get_input_embeddings(), "num_embeddings", None)
    ids = params.get("input_ids")
    if rows is not None and torch.is_tensor(ids) and ids.numel() and (int(ids.max()) >= rows or int(ids.min()) < 0):
        bad = int(ids.max()) if int(ids.max()) >= rows else int(ids.min())
        return f"token id {bad} in input_ids, outside the {rows} rows of the input embedding"
    v = causal_lm.get_output_embeddings().out_features
    for what, y in (("labels", labels), ("shift_labels", shift_labels)):
        if torch.is_tensor(y):
            wrong = (y != ignore_index) & ((y < 0) | (y >= v))
            if bool(wrong.any()):
                return f"label {int(y[wrong][0])} in {what}, outside the {v} rows of the head (not ignore_index)"
    return None


def _all_max(values: list[float], device) -> list[float]:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return values
    flag = torch.tensor(values, device=device, dtype=torch.float64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.tolist()


def _compare(causal_lm, original, signature, fused, params, extra, labels, r, start, end) -> tuple[bool, str]:
    b = labels.shape[0]
    rows = slice(None) if r is None else slice(r, r + 1)
    where = f"every row of {b}" if r is None else f"row {r} of {b}"
    if r is not None and _text_only(params, extra, b):
        params, extra, labels, rows = _row(params, r, b), _row(extra, r, b), labels[r:r + 1], slice(0, 1)
        where += " (decoder on that row alone)"
    else:
        where += " (decoder on the whole micro-batch)"
    rng = _Rng()
    try:
        with torch.no_grad():
            model_loss, dtype = _original_loss(causal_lm, original, signature, params, extra, labels, rows, start, end)
            rng.restore()
            fused_loss = fused(params, extra, labels, window=(rows, start, end)).loss
    finally:
        rng.restore()
    if model_loss is None:
        return False, "not checked: the model's forward never called its output embedding as a module"
    dev = labels.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
    a, f = float(model_loss), float(fused_loss)
    rtol, atol = bounds(dtype)
    bound = rtol * abs(a) + atol
    text = (f"model's own loss {a:.7g}, fused loss {f:.7g} (|diff| {abs(f - a):.3g}, bound {bound:.3g}; fp32 logits "
            f"from the same {str(dtype).replace('torch.', '')} inputs) on {where}, positions {start}-{end - 1}")
    bad = not abs(f - a) <= bound  # NaN counts as a difference
    return bad, ("" if bad else "exact: ") + text


def check(causal_lm, seam, original, signature, fused, params: dict, extra: dict, labels: torch.Tensor,
          step: int = 1) -> bool:
    """Compare the fused loss with the model's own on every rank; True once decided, False when no rank had a
    labelled position (check again next step). Raises on a mismatch or a data error (every rank)."""
    extra = {k: v for k, v in extra.items() if k != "num_items_in_batch"}
    ignore_index = extra.get("ignore_index", -100)
    problem = _vocab_problem(causal_lm, params, labels, extra.get("shift_labels"), ignore_index)
    family = seam.family
    r, start, end, n = _window(family, labels, extra.get("shift_labels"), ignore_index)
    data_rank, any_labels = _all_max([rank() + 1 if problem else 0, 1 if n else 0], labels.device)
    if data_rank:
        where = problem if problem else f"rank {int(data_rank) - 1}'s batch has a token id or label outside the vocabulary"
        raise LigerFsdpDataError(
            f"`resize_vocab`: step {step}, rank {rank()}: {where}. The tokenizer has more tokens than the model's "
            "embeddings (added tokens); the run without liger_fsdp fails on it as well. Fix: set `resize_vocab: true` "
            "(LLaMA-Factory resizes the embeddings and the head to the tokenizer), or use the model's own tokenizer."
        )
    if not any_labels:
        return False
    try:
        bad, text = _compare(causal_lm, original, signature, fused, params, extra, labels, r, start, end)
    except Exception as exc:  # not a mismatch: the same error, at once (no collective after it: the other ranks may
        if hasattr(exc, "add_note"):  # be inside one of the forward's; the launcher stops them when this rank exits)
            exc.add_note(f"[liger_fsdp] raised inside the first-step guard (step {step}), by the model's own forward "
                         "or the fused loss on a slice of the micro-batch; `liger_fsdp_guard: false` skips the check.")
        raise
    if not n:  # collectives run in both forwards, so a rank without labels runs them too and only skips the verdict
        bad, text = False, "not checked on this rank: no labelled position in its slice"
    (mismatch,) = _all_max([float(bad)], labels.device)
    if mismatch:
        if not bad:
            mine = "this rank's slice was not checked (no labelled position in it)" if not n else \
                f"this rank's slice agreed ({text})"
            text = f"{mine}; another rank's did not (see its error)"
        newer = versions.untested()
        fix = (f"Installed versions newer than tested: {', '.join(newer)}; a newer library may have changed what the "
               "loss sees. Fix: install the tested versions (README, \"Supported versions\"), or remove `liger_fsdp`, "
               "and report this line" if newer else "Fix: remove `liger_fsdp` for this model and report this line "
               "with your transformers version")
        raise LigerFsdpConfigError(
            f"`liger_fsdp_guard`: on step {step} the fused loss is not the model's own for model type "
            f"`{family.model_type}` ({type(causal_lm).__name__}), rank {rank()}: "
            f"{text}. A quirk of this model (logit scale, softcap, loss "
            f"variant, aux loss, head) is not reproduced, so training would optimise another objective. {fix} "
            "(`liger_fsdp_guard: false` skips the check)."
        )
    info_rank0(f"[liger_fsdp] guard: step {step} {text}.")
    return True
