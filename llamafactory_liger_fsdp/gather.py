"""The ONLY place a head weight is gathered: the loss runs *through* the modules that own it.

A weight read from outside its owner's forward is a shard: FSDP1's flat 1-D view, an FSDP2 DTensor,
or DeepSpeed ZeRO-3's empty placeholder. So the kernel runs inside the forward of every module that
gathers it ("forward redirection"): :func:`call_through` swaps each unit's ``forward`` for the
kernel call for exactly one call and calls the unit. The sharding library then does what it does for
an ordinary Linear: gather before, release after, gather again for backward, and send the gradient to
the sharded parameter through its own reduce-scatter (FSDP post-backward hooks, DeepSpeed's gradient
hooks). Tensors go in as arguments so the library sees them as the unit's inputs (mixed-precision
casts, FSDP2's post-backward registration, DeepSpeed's pre-backward hooks on the outputs).

:func:`units` finds, on the path from the causal LM to a weight's module: FSDP1 wrappers, FSDP2
``FSDPModule``s, and -- for a ZeRO-3 partitioned weight -- the module itself (DeepSpeed's hooks on
every module gather that module's own parameters). Without sharding there are no units and the
function is simply called.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from . import fp32_limbs, thirdparty


def _checkpoint_inner(module: nn.Module) -> nn.Module | None:
    return module.__dict__.get("_modules", {}).get("_checkpoint_wrapped_module")


def param(module: nn.Module, name: str = "weight"):
    """``module.<name>`` read without ``nn.Module.__getattr__``. Under ZeRO-3, inside the engine's forward, an
    attribute read of a partitioned parameter makes DeepSpeed gather it and register it, for good, as an external
    parameter of the module whose forward is running (the causal LM): the head would then stay gathered for every
    later forward and backward. Reading ``_parameters`` with ``dict.get`` does not trigger that."""
    params = module.__dict__.get("_parameters")
    return dict.get(params, name) if isinstance(params, dict) else getattr(module, name, None)


def resolve(root: nn.Module, path: str) -> tuple[list[nn.Module], nn.Module]:
    """Walk the dotted ``path`` from ``root``: the units on the way (outermost first) and the plain module
    at the end. FSDP1 wrappers and activation-checkpoint wrappers are looked through."""
    found: list[nn.Module] = []
    module = root
    for name in path.split(".") if path else []:
        module = module._modules[name]
        while True:
            if thirdparty.is_fsdp1(module):
                found.append(module)
                module = module._fsdp_wrapped_module
            elif _checkpoint_inner(module) is not None:
                module = _checkpoint_inner(module)
            else:
                break
        if thirdparty.is_fsdp2(module):
            found.append(module)
    weight = param(module)
    if thirdparty.is_zero3_param(weight) and module not in found:
        found.append(module)
    return found, module


def units(root: nn.Module, path: str) -> list[nn.Module]:
    return resolve(root, path)[0]


def module_at(root: nn.Module, path: str) -> nn.Module:
    return resolve(root, path)[1]


def entry_at(root: nn.Module, path: str) -> nn.Module:
    """The module to *call* for ``path``: the FSDP1 wrapper where one replaced the module, else the module."""
    parent_path, _, name = path.rpartition(".")
    parent = module_at(root, parent_path)
    return parent._modules[name]


def unit_names(root: nn.Module, found: list[nn.Module]) -> list[str]:
    """Module paths of ``found`` as a user reads them (FSDP1/checkpoint wrapper levels left out)."""
    wrappers = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module"}
    names: dict[int, str] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        names.setdefault(id(module), ".".join(p for p in name.split(".") if p not in wrappers) or "<root>")
    return [names.get(id(u), "?") for u in found]


def local_dtype(module: nn.Module) -> torch.dtype | None:
    """dtype of ``module.weight`` as read outside a gather (what PEFT casts a LoRA input to), else None."""
    weight = param(module)
    return weight.dtype if isinstance(weight, torch.Tensor) else None


def check_full(*weights: torch.Tensor) -> None:
    """Inside :func:`call_through` every weight must be whole; a shard here means a unit was missed."""
    for w in weights:
        if thirdparty.is_dtensor(w) or w.dim() != 2 or w.numel() == 0:
            raise RuntimeError(
                f"liger_fsdp: the head weight is still sharded ({type(w).__name__} {tuple(w.shape)}) inside the "
                "call-through; the module that gathers it was not found on its path. Please report this with your "
                "FSDP/DeepSpeed settings."
            )


def _redirect(unit: nn.Module, fn: Callable, args: tuple) -> Any:
    target = unit._fsdp_wrapped_module if thirdparty.is_fsdp1(unit) else unit
    had_own = "forward" in target.__dict__
    saved = target.__dict__.get("forward")

    def restore() -> None:
        if had_own:
            target.__dict__["forward"] = saved
        else:
            target.__dict__.pop("forward", None)

    def redirected(*a: Any, **k: Any) -> Any:
        restore()
        return fn(*a, **k)

    target.__dict__["forward"] = redirected
    try:
        return unit(*args)
    finally:
        restore()


def call_through(found: Iterable[nn.Module], fn: Callable, *args: Any) -> Any:
    """Run ``fn(*args)`` inside the forward of every unit in ``found`` (outermost first). fp32 results cross FSDP2
    units as :func:`.fp32_limbs.split_fp32` limbs, so a unit's mixed-precision output cast does not round them."""
    found = list(found)
    if any(thirdparty.is_fsdp2(u) for u in found):
        return fp32_limbs.join_fp32(_call(found, lambda *a: fp32_limbs.split_all(fn(*a)), args))
    return _call(found, fn, args)


def _call(found: list, fn: Callable, args: tuple) -> Any:
    if not found:
        return fn(*args)
    return _redirect(found[0], lambda *a: _call(found[1:], fn, a), args)
