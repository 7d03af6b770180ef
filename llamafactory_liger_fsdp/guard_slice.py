"""Which part of a micro-batch the first-step guard runs both sides on, and cutting it out.

Text-only batches are cut: the rows of one group (a row; a chosen/rejected pair of LLaMA-Factory's DPO batch) and the
columns ``[start, end)`` of up to :data:`BUDGET` positions ending at the group's last labelled position (a packed or
right-padded row ends in padding). Every tensor ``[B, T, ...]`` of the batch is cut the same way (ids, masks, position
ids, labels, v1's loss weights), so both sides see one shorter, valid batch and the logits exist for the slice only.
Gemma 3's masked mean aligns its mask to the last positions of every row: there the last ``BUDGET // B`` positions of
every row. A batch with other inputs (pixel values, grid sizes, (3, B, T) position ids) is not cut -- only the whole
batch keeps images and image tokens consistent -- and is checked whole while its fp32 logits fit
:data:`LOGITS_BUDGET`; beyond it a check that can score a window of the whole batch (SFT: the output embedding's input
cut to the window on the model's side, the labels outside it ignored on the fused side) does so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .losses import IGNORE_INDEX

BUDGET = 256
LOGITS_BUDGET = 4 * 2**30  # bytes of fp32 logits the guard may have a batch that cannot be cut build
TEXT_INPUTS = ("input_ids", "attention_mask", "position_ids", "token_type_ids", "inputs_embeds", "labels",
               "shift_labels", "loss_weights", "kto_tags")
PREFIXES = ("kl_",)  # KTO's KL batch rides in the same dict


@dataclass(frozen=True)
class Slice:
    rows: list[int] | None  # None: every row
    start: int
    end: int
    labelled: int  # labelled positions the slice scores
    cut: bool  # False: the whole batch (other inputs than text)
    where: str  # for the guard's line

    def describe(self) -> str:
        return f"{self.where}, positions {self.start}-{self.end - 1}"


def _name(key: str) -> str:
    for prefix in PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def text_only(batch: dict, b: int) -> bool:
    """Every tensor is a text input with the batch's rows (mRoPE's (3, B, T) position ids are not)."""
    return all(_name(k) in TEXT_INPUTS and v.dim() >= 1 and v.shape[0] == b
               and not (_name(k) == "position_ids" and v.dim() != 2)
               for k, v in batch.items() if torch.is_tensor(v))


def _targets(labels: torch.Tensor, shifted: bool, ignore_index: int) -> torch.Tensor:
    """Whether each position of ``labels`` is scored (its own label when ``shifted``, the next one otherwise)."""
    target = labels != ignore_index
    if not shifted:
        target = torch.nn.functional.pad(target[..., 1:], (0, 1), value=False)
    return target


def choose(batch: dict, labels: torch.Tensor, *, masked_mean: bool = False, pairs: bool = False,
           shifted: bool = False, ignore_index: int = IGNORE_INDEX, vocab: int = 0) -> tuple[Slice, bool]:
    """(the slice, whether it is too large to run whole: a batch that cannot be cut whose fp32 logits exceed the
    budget; its slice then names the window a check may still score on the whole batch). ``pairs``: rows ``i`` and
    ``i + B/2`` go together (chosen and rejected); ``shifted``: ``labels`` are already shifted (``shift_labels``)."""
    b, t = labels.shape
    target = _targets(labels, shifted, ignore_index)
    rows, start, end, n = _window(target, masked_mean, pairs, shifted)
    where = "every row" if rows is None else f"row{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows))}"
    if text_only(batch, b):
        return Slice(rows, start, end, n, True, f"{where} of {b}"), False
    if b * t * vocab * 4 <= LOGITS_BUDGET:
        return Slice(None, 0, t, int(target.sum()), False, f"every row of {b} (decoder on the whole micro-batch)"), False
    return Slice(rows, start, end, n, False, f"{where} of {b} (decoder on the whole micro-batch)"), True


def _window(target: torch.Tensor, masked_mean: bool, pairs: bool, shifted: bool):
    """(rows or None for every row, start, end, scored positions): up to BUDGET positions of the group of rows with
    the most scored positions there, ending at its last one (Gemma 3's masked mean: the last positions of every row)."""
    b, t = target.shape
    if masked_mean:
        k = min(t, max(2, BUDGET // b))
        return None, t - k, t, int(target[:, t - k:].sum())
    groups = [[i, i + b // 2] for i in range(b // 2)] if pairs and b % 2 == 0 else [[i] for i in range(b)]
    past = 0 if shifted else 1  # an unshifted slice loses its last position's label to the shift
    best = (groups[0], 0, min(t, BUDGET), 0)
    for group in groups:
        where = target[group].any(0).nonzero()
        if not where.numel():
            continue
        end = min(t, int(where.max()) + 1 + past)
        start = max(0, end - BUDGET)
        n = int(target[group, start:end].sum())
        if n > best[3]:
            best = (group, start, end, n)
    return best


def window_labels(labels: torch.Tensor, piece: Slice, shifted: bool, ignore_index: int = IGNORE_INDEX):
    """(the window's own labels ``[rows, start:end]``, full-size labels scoring the same positions and no others):
    what the model's own forward takes with its head input cut to the window, and what the fused forward takes on
    the whole batch."""
    rows = slice(None) if piece.rows is None else piece.rows
    own = labels[rows][:, piece.start:piece.end]
    first = piece.start if shifted else piece.start + 1  # the window's first position predicts labels[start + 1]
    masked = torch.full_like(labels, ignore_index)
    index = torch.arange(labels.shape[0]) if piece.rows is None else torch.tensor(piece.rows)
    masked[index.unsqueeze(1), torch.arange(first, piece.end).unsqueeze(0)] = labels[index][:, first:piece.end]
    return own, masked


def cut(batch: dict, piece: Slice, b: int, t: int) -> dict:
    """The batch restricted to the slice: rows, and columns of every ``[B, T, ...]`` tensor (a copy of the dict)."""
    if not piece.cut:
        return dict(batch)
    out = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == b:
            value = value[piece.rows] if piece.rows is not None else value
            if value.dim() >= 2 and value.shape[1] == t:
                value = value[:, piece.start:piece.end]
        out[key] = value
    return out
