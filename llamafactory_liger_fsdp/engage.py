"""Engage and disengage the fused loss on one model.

:func:`engage` is the plugin's whole model-level surface: given a (PEFT) causal LM it looks up the
family (:mod:`.families`), detects the head kind (:mod:`.heads`), tags the head modules that become FSDP
units of their own (:mod:`.wrapping`), builds the loss seam (:class:`.losses.HeadLoss`) and sets the generic
forward (:mod:`.forward`) on the causal-LM *instance*. A frozen head needs nothing: it says so once and leaves the
model alone. What the run says on its first step is :mod:`.report`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from . import families, fingerprints, gather, heads, thirdparty, wrapping
from ._log import info_rank0
from .config import LigerFsdpConfig, LigerFsdpConfigError
from .forward import ForwardState, make_forward
from .losses import HeadLoss

ATTR = "_liger_fsdp_engaged"
SIDE_EFFECTS = "_liger_fsdp_side_effects"  # undo callables of what was changed for this model, oldest first


@dataclass(frozen=True)
class Engaged:
    head: heads.Head
    family: families.Family
    config: LigerFsdpConfig
    marked: tuple[str, ...]  # modules tagged as FSDP units
    seam: HeadLoss  # what the forward computes through the head


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
    fingerprints.use(f"transformers:{family.cls}.forward")  # its quirks were read off it
    if loss_fn is not None:
        fingerprints.use("transformers.loss.loss_utils:ForCausalLMLoss")  # the kernel's arithmetic mirrors it
    return family


def engage(model: nn.Module, config: LigerFsdpConfig | None = None, *, backend: str | None = None,
           any_head: bool = False, request_only: bool = False) -> Engaged | None:
    """Make ``model`` compute its training loss with the fused kernel; None when nothing needed doing.

    ``any_head`` (DPO/KTO, v1): log-probs are needed from any head, a frozen one included (the reference pass, a
    separate reference model, v1's logits-based loss). ``request_only`` (v1): only explicit log-probs requests take
    the fused path (:class:`.forward.ForwardState`). Call before FSDP wraps the model (the tags decide the
    wrapping)."""
    cfg = config or LigerFsdpConfig(enabled=True, backend=backend or "auto")
    causal_lm = causal_lm_of(model)
    if ATTR in causal_lm.__dict__:
        return causal_lm.__dict__[ATTR]
    family = check_model(causal_lm)
    head = heads.detect(causal_lm, trained_only=not any_head)
    if isinstance(head, str):
        info_rank0(f"[liger_fsdp] not engaged: {head}; the plain loss has nothing to fix.")
        return None
    marked = []
    for path in head.weight_paths:
        module = causal_lm.get_submodule(path)
        if not heads.base.is_shared(causal_lm, gather.param(module)):
            wrapping.mark_unit(module)
            marked.append(path)
    for path in wrapping.idle_originals(causal_lm):  # never gathered in a training step as units of their own
        wrapping.mark_unit(causal_lm.get_submodule(path))
        marked.append(path)
    seam = HeadLoss(causal_lm, head, family, cfg.backend)
    forward = make_forward(causal_lm, seam, ForwardState(cfg, request_only))
    causal_lm.__dict__[ATTR] = Engaged(head, family, cfg, tuple(marked), seam)
    causal_lm.__dict__["forward"] = forward
    return causal_lm.__dict__[ATTR]


def record_undo(model: nn.Module, undo: list) -> None:
    """Remember the undo callables of side effects made for ``model`` (dtype casts, patches, environment)."""
    causal_lm_of(model).__dict__.setdefault(SIDE_EFFECTS, []).extend(undo)


_HELD: dict[str, dict] = {}  # a process-wide patch's key -> its undo callables and how many models hold it


def hold(model: nn.Module, key: str, apply) -> None:
    """A process-wide patch that engaged models share: ``apply()`` puts it in place (its undo callables; none when it
    is in place already) for ``model``, and it is undone when the last model holding it disengages."""
    undo = apply()
    entry = _HELD.setdefault(key, {"undo": [], "holders": 0})
    entry["undo"] = entry["undo"] or list(undo)
    entry["holders"] += 1

    def release() -> None:
        entry["holders"] -= 1
        if entry["holders"] <= 0:
            if _HELD.get(key) is entry:
                del _HELD[key]
            while entry["undo"]:
                entry["undo"].pop()()

    record_undo(model, [release])


def disengage(model: nn.Module) -> None:
    """Undo :func:`engage` and every side effect :func:`record_undo`-ed for the model, newest first (before FSDP wrapping /
    ``deepspeed.initialize``; afterwards the units and partitions stay as they were built)."""
    causal_lm = causal_lm_of(model)
    done = causal_lm.__dict__.pop(ATTR, None)
    causal_lm.__dict__.pop("forward", None)
    for path in done.marked if done is not None else ():
        wrapping.unmark_unit(causal_lm.get_submodule(path))
    undo = causal_lm.__dict__.pop(SIDE_EFFECTS, [])
    while undo:
        undo.pop()()
