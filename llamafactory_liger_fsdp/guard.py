"""The step-1 exactness guard (``liger_fsdp_guard``, on by default).

On the first training step of every rank, before the real step, :func:`check` computes on a slice of the
real micro-batch, under ``torch.no_grad`` and from the same RNG state (dropout masks identical; the
state is restored afterwards, so the real step draws what it would have drawn without the guard):

* the model's ORIGINAL loss: its own ``forward`` (normal module calls, so FSDP/DeepSpeed gather as in any
  forward; Liger's class forward with ``skip_logits=False``), with a pre-hook on the output embedding
  that keeps only the slice's positions, so the logits exist for the slice only;
* the fused loss of :mod:`.forward` on the same inputs and positions.

The slice: up to ``BUDGET`` (256) positions of one row, ending at that row's last labelled position (a packed
or right-padded row ends in padding), the row with the most labels in its slice (Gemma 3's masked mean aligns its
mask to the last positions of every row, so there: the last ``BUDGET // B`` positions of every row). Text-only calls run both forwards on that row alone. Calls with other inputs (pixel values,
grid sizes, (3, B, T) position ids, ...) run on the whole micro-batch: those tensors are not split by row
(Qwen-VL flattens the patches of all images), so only the whole batch keeps images and image tokens
consistent without family-specific slicing; the logits still exist for the slice only.
``num_items_in_batch`` is left out of both calls (both losses are means over the slice).

Bounds, ``|fused - model| <= rtol * |model| + atol``: fp32 ``rtol=1e-4, atol=1e-6`` (measured differences
are <= 1e-6 relative: summation order only); bf16/fp16 ``rtol=2e-2, atol=2e-3`` (the model rounds its
logits to 16 bits, the kernel keeps them in fp32: about ``max|logit| * 2^-9`` per row, averaged over the
slice). A missing quirk moves the loss far more: a dropped logit scale or softcap by O(1) relative.
Every rank takes the verdict of all (one all-reduce), so all ranks stop together.
"""

from __future__ import annotations

import torch

from ._log import info_rank0, rank
from .config import LigerFsdpConfigError

BUDGET = 256
BOUNDS = {torch.float32: (1e-4, 1e-6), torch.float64: (1e-4, 1e-6)}
LOW_PRECISION = (2e-2, 2e-3)
TEXT_INPUTS = ("input_ids", "attention_mask", "position_ids", "token_type_ids", "inputs_embeds", "shift_labels")


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
    target = (shift_labels if shift_labels is not None else labels[:, 1:]) != ignore_index  # label of hidden p
    best = (0, 0, min(t, BUDGET), 0)
    for r in range(b):
        where = target[r].nonzero()
        if not where.numel():
            continue
        end = min(t, int(where.max()) + (1 if shift_labels is not None else 2))  # includes the last labelled one
        start = max(0, end - BUDGET)
        n = int(target[r, start:end - (0 if shift_labels is not None else 1)].sum())
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
    """The model's own loss with its head applied to the slice only; None if it never calls the head."""
    kwargs = {**params, **extra, "labels": labels[rows, start:end]}
    if kwargs.get("shift_labels") is not None:
        kwargs["shift_labels"] = kwargs["shift_labels"][rows, start:end]
    if "skip_logits" in signature.parameters:  # Liger's lce_forward: its plain (logits) path
        kwargs["skip_logits"] = False
    seen = []

    def keep_slice(module, args):
        seen.append(args[0].dtype)
        return (args[0][rows, start:end], *args[1:])

    handle = causal_lm.get_output_embeddings().register_forward_pre_hook(keep_slice)
    try:
        loss = original(**kwargs).loss
    finally:
        handle.remove()
    return (loss, seen[0]) if len(seen) == 1 else (None, None)


def _compare(causal_lm, original, signature, fused, params, extra, labels, r, start, end) -> tuple[float, str]:
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
            try:
                model_loss, dtype = _original_loss(causal_lm, original, signature, params, extra, labels, rows, start,
                                                   end)
            except Exception as exc:  # the slice does not fit this model's own loss: its data is wrong too
                return 1.0, f"the model's own forward failed on the slice ({type(exc).__name__}: {exc})"
            rng.restore()
            fused_loss = fused(params, extra, labels, window=(rows, start, end)).loss
    finally:
        rng.restore()
    if model_loss is None:
        return 0.0, "not checked: the model's forward never called its output embedding as a module"
    dev = labels.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
    a, f = float(model_loss), float(fused_loss)
    rtol, atol = bounds(dtype)
    bound = rtol * abs(a) + atol
    text = (f"model's own loss {a:.7g}, fused loss {f:.7g} (|diff| {abs(f - a):.3g}, bound {bound:.3g} for "
            f"{str(dtype).replace('torch.', '')}) on {where}, positions {start}-{end - 1}")
    bad = not abs(f - a) <= bound  # NaN counts as a difference
    return float(bad), ("" if bad else "exact: ") + text


def check(causal_lm, family, original, signature, fused, params: dict, extra: dict, labels: torch.Tensor) -> None:
    """Raise :class:`LigerFsdpConfigError` (on every rank) if the fused loss is not the model's own."""
    extra = {k: v for k, v in extra.items() if k != "num_items_in_batch"}
    r, start, end, n = _window(family, labels, extra.get("shift_labels"), extra.get("ignore_index", -100))
    bad, text = _compare(causal_lm, original, signature, fused, params, extra, labels, r, start, end)  # every rank
    if not n:  # collectives run in both forwards, so a rank without labels runs them too and only skips the verdict
        bad, text = 0.0, "not checked: no labelled position in the slice"
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        flag = torch.tensor([bad], device=labels.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        bad = float(flag)
    if bad:
        raise LigerFsdpConfigError(
            f"`liger_fsdp_guard`: on step 1 the fused loss is not the model's own for model type `{family.model_type}` "
            f"({type(causal_lm).__name__}), rank {rank()}: {text}. A quirk of this model (logit scale, softcap, loss "
            "variant, aux loss, head) is not reproduced, so training would optimise another objective. Fix: remove "
            "`liger_fsdp` for this model and report this line with your transformers version (`liger_fsdp_guard: "
            "false` skips the check)."
        )
    info_rank0(f"[liger_fsdp] guard: step 1 {text}.")
