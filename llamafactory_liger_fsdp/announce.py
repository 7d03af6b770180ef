"""What the run says about itself on its first training step (rank 0): the engaged line, and the memory report's
kernel wrapper when ``liger_fsdp_memory_report`` asks for it. Called by :mod:`.forward`; reads the live model
(its units, its sharding), so the line says what really happens, not what was planned.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from . import families, gather, sharding, thirdparty
from ._log import info_rank0, rank
from .config import LigerFsdpConfig
from .losses import HeadLoss, resolve_backend

NOTES = "_liger_fsdp_notes"  # on a causal LM: callables (causal_lm) -> str, clauses its engaged line adds


def note(causal_lm: nn.Module, clause) -> list:
    """Add ``clause(causal_lm)`` (read from the live model on the first step) to the engaged line; the undo."""
    causal_lm.__dict__.setdefault(NOTES, []).append(clause)
    return [lambda: causal_lm.__dict__.pop(NOTES, None)]


def first_step(causal_lm: nn.Module, seam: HeadLoss, config: LigerFsdpConfig, device: torch.device | None = None):
    """Log the engaged line; return the memory report's kernel wrapper when it was asked for (else None).
    ``device``: where the first step's inputs are, which is where the kernel runs."""
    info_rank0(engaged_line(causal_lm, seam, config, device))
    if config.memory_report and rank() == 0:
        from .diagnostics import MemoryReport

        return MemoryReport(seam.vocab_size)
    return None


def sharding_label(decided, seen: str | None) -> str:
    """The decided sharding, checked against what the live model is (``sharding.observed``)."""
    if decided is None:
        if seen:
            return seen
        dist = torch.distributed
        return "DDP" if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else "none"
    if decided.kind in (sharding.FSDP1, sharding.FSDP2) or (decided.kind == sharding.DEEPSPEED and decided.zero_stage == 3):
        return decided.label if seen else f"{decided.label} asked for, but the model is not sharded"
    return seen or decided.label


def engaged_line(causal_lm: nn.Module, seam: HeadLoss, config: LigerFsdpConfig,
                 device: torch.device | None = None) -> str:
    head = seam.head
    found = list({id(u): u for p in head.weight_paths for u in gather.units(causal_lm, p)}.values())
    seen = sharding.observed(causal_lm)
    label = sharding_label(config.sharding, seen)
    # the kernel's device: the inputs' (a parameter's is the CPU under offload), else without reading `.weight`
    # (gather.param; a flat FSDP1 head has no parameter of its own)
    if device is None:
        first = next(itertools.chain(causal_lm.get_output_embeddings().parameters(), causal_lm.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
    backend = resolve_backend(config.backend, device)
    if found:
        names = ", ".join(gather.unit_names(causal_lm, found))
        if any(thirdparty.is_fsdp1(u) or thirdparty.is_fsdp2(u) for u in found):
            where = f"through {len(found)} FSDP unit(s) ({names})"
        else:
            where = f"through DeepSpeed's gather hooks of {len(found)} module(s) ({names})"
    elif seen in ("FSDP1", "FSDP2"):
        where = "inside the root unit"
    else:
        where = "on the whole (unpartitioned) head weight"
    quirks = families.describe(seam.family, causal_lm.config, causal_lm)
    return (f"[liger_fsdp] engaged: {head.describe()}, sharding={label}, backend={backend}, "
            f"model={seam.family.model_type} ({type(causal_lm).__name__}; quirks: {', '.join(quirks) or 'none'}), "
            f"guard={'on' if config.guard else 'off'}; loss computed {where}"
            + "".join(f"; {clause(causal_lm)}" for clause in causal_lm.__dict__.get(NOTES, ())))
