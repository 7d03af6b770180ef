"""Engage and disengage the fused loss on one model, and the line that says so.

:func:`engage` is the plugin's whole model-level surface: given a (PEFT) causal LM it looks up the
family (:mod:`.families`), detects the head kind (:mod:`.heads`), tags the head modules that become FSDP
units of their own (:mod:`.wrapping`) and sets the generic forward (:mod:`.forward`) on the causal-LM
*instance*. A frozen head needs nothing: it says so once and leaves the model alone. On the first
training step rank 0 logs the engaged line (sharding, head, kernel, the units the loss runs through).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from . import families, gather, heads, losses, sharding, thirdparty, wrapping
from ._log import info_rank0, rank
from .config import LigerFsdpConfig, LigerFsdpConfigError
from .forward import ForwardState, make_forward

ATTR = "_liger_fsdp_engaged"
SIDE_EFFECTS = "_liger_fsdp_side_effects"  # undo callables of what was changed for this model, oldest first


@dataclass(frozen=True)
class Engaged:
    head: heads.Head
    family: families.Family
    config: LigerFsdpConfig
    marked: tuple[str, ...]  # modules tagged as FSDP units


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers ``*ForCausalLM`` inside a PEFT model (or the model itself)."""
    return model.get_base_model() if thirdparty.is_peft_model(model) else model


def engaged(model: nn.Module) -> Engaged | None:
    return causal_lm_of(model).__dict__.get(ATTR)


def check_model(causal_lm: nn.Module) -> families.Family:
    """The family entry; refuses a family (or its class, or a config flag it cannot take) or a loss function
    the fused loss would not reproduce."""
    family = families.family_of(getattr(causal_lm.config, "model_type", None), causal_lm.config, type(causal_lm))
    loss_fn = getattr(causal_lm, "loss_function", None)
    if loss_fn is not None and not thirdparty.is_causal_lm_loss(loss_fn):
        raise LigerFsdpConfigError(
            f"`liger_fsdp: true`: the model's loss_function is {getattr(loss_fn, '__name__', loss_fn)}, not "
            "transformers' ForCausalLMLoss, so the fused loss would not reproduce it. Fix: remove `liger_fsdp`."
        )
    return family


def engage(model: nn.Module, config: LigerFsdpConfig | None = None, *, backend: str | None = None,
           preference: bool = False) -> Engaged | None:
    """Make ``model`` compute its training loss with the fused kernel; None when nothing needed doing.

    ``preference`` (DPO/KTO): log-probs are needed from any head, a frozen one included (the reference pass, a
    separate reference model). Call before FSDP wraps the model (the tags decide the wrapping)."""
    cfg = config or LigerFsdpConfig(enabled=True, backend=backend or "auto")
    causal_lm = causal_lm_of(model)
    if ATTR in causal_lm.__dict__:
        return causal_lm.__dict__[ATTR]
    family = check_model(causal_lm)
    head = heads.detect(causal_lm, trained_only=not preference)
    if isinstance(head, str):
        info_rank0(f"[liger_fsdp] not engaged: {head}; the plain loss has nothing to fix.")
        return None
    marked = []
    for path in head.weight_paths:
        module = causal_lm.get_submodule(path)
        if not heads.base.is_shared(causal_lm, gather.param(module)):
            wrapping.mark_unit(module)
            marked.append(path)
    state = ForwardState(on_first_step=lambda: _first_step(causal_lm), guard=cfg.guard, start_step=cfg.start_step,
                         grad_accum=cfg.grad_accum)
    forward = make_forward(causal_lm, head, family, cfg.backend, state)
    causal_lm.__dict__[ATTR] = Engaged(head, family, cfg, tuple(marked))
    causal_lm.__dict__["forward"] = forward
    return causal_lm.__dict__[ATTR]


def record(model: nn.Module, undo: list) -> None:
    """Remember the undo callables of side effects made for ``model`` (dtype casts, patches, environment)."""
    causal_lm_of(model).__dict__.setdefault(SIDE_EFFECTS, []).extend(undo)


def disengage(model: nn.Module) -> None:
    """Undo :func:`engage` and every side effect :func:`record`-ed for the model, newest first (before FSDP wrapping /
    ``deepspeed.initialize``; afterwards the units and partitions stay as they were built)."""
    causal_lm = causal_lm_of(model)
    done = causal_lm.__dict__.pop(ATTR, None)
    causal_lm.__dict__.pop("forward", None)
    for path in done.marked if done is not None else ():
        wrapping.unmark_unit(causal_lm.get_submodule(path))
    undo = causal_lm.__dict__.pop(SIDE_EFFECTS, [])
    while undo:
        undo.pop()()


def _first_step(causal_lm: nn.Module):
    """Log the engaged line; return the kernel wrapper of the memory report when it was asked for."""
    done = causal_lm.__dict__[ATTR]
    info_rank0(engaged_line(causal_lm, done))
    if done.config.memory_report and rank() == 0:
        from .diagnostics import MemoryReport

        return MemoryReport(causal_lm.get_output_embeddings().out_features)
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


def engaged_line(causal_lm: nn.Module, done: Engaged) -> str:
    found = list({id(u): u for p in done.head.weight_paths for u in gather.units(causal_lm, p)}.values())
    seen = sharding.observed(causal_lm)
    label = sharding_label(done.config.sharding, seen)
    # the kernel's device, without reading `.weight` (gather.param); a flat FSDP1 head has no parameter of its own
    first = next(itertools.chain(causal_lm.get_output_embeddings().parameters(), causal_lm.parameters()), None)
    backend = losses.resolve_backend(done.config.backend, first.device if first is not None else torch.device("cpu"))
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
    quirks = families.describe(done.family, causal_lm.config, causal_lm)
    return (f"[liger_fsdp] engaged: {done.head.describe()}, sharding={label}, backend={backend}, "
            f"model={done.family.model_type} ({type(causal_lm).__name__}; quirks: {', '.join(quirks) or 'none'}), "
            f"guard={'on' if done.config.guard else 'off'}; loss computed {where}")
