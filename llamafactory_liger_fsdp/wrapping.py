"""The head as its own FSDP unit, and the call *through* that unit.

Why: FSDP gathers a unit's parameters only while that unit's forward runs. A fused loss that
reads ``lm_head.weight`` from outside the head's unit sees the flat 1-D shard (FSDP1) or a
DTensor shard (FSDP2) -- the original crash. So the loss must run *inside* the forward of every
unit that owns a weight the kernel reads.

Two halves:

* **Wrapping** (before FSDP is applied). :func:`mark_unit` tags the modules that must become
  their own unit (leaf ``nn.Linear`` modules that own a head weight shared with nothing else).
  :func:`fsdp1_policy` composes an FSDP1 ``auto_wrap_policy`` (e.g. PEFT's
  ``fsdp_auto_wrap_policy``) with "wrap the tagged modules"; :func:`fsdp2_policy` does the same
  for accelerate's FSDP2 policy callables, and :func:`shard_marked_units` applies
  ``fully_shard`` to them for code that shards by hand. Tagged modules are leaves, each holding
  one weight, so FSDP1's uniform-``requires_grad`` rule holds for ``use_orig_params=False``.

* **Call-through** (every step). :func:`resolve` walks the path from the causal LM to a weight's
  module and collects the FSDP units met on the way (FSDP1 wrappers, FSDP2 ``FSDPModule``s).
  :func:`call_through` runs a function inside the forward of each of those units, nested
  ("forward redirection"): the unit's ``forward`` is swapped for the function for exactly one
  call, so FSDP's own pre-forward hook all-gathers the weight, its post-forward reshards it and
  registers the pre-backward hook that gathers it again for backward, and the gradient reaches
  the sharded parameter through FSDP's own post-backward reduce-scatter. Tensors are passed as
  arguments (not closed over) so FSDP sees them as the unit's inputs (mixed-precision casting,
  FSDP2 post-backward). Without FSDP (DDP, one device) there are no units and the function is
  simply called. **This module is the only place where a head weight is gathered.**
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch
from torch import nn

UNIT_ATTR = "_liger_fsdp_unit"


# --------------------------------------------------------------------------- FSDP types (tolerant)
def _fsdp1_cls():
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return None


def _fsdp2_cls():
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6

        return FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule

            return FSDPModule
        except ImportError:  # pragma: no cover
            return None


def is_fsdp1(module: nn.Module) -> bool:
    cls = _fsdp1_cls()
    return cls is not None and isinstance(module, cls)


def is_fsdp2(module: nn.Module) -> bool:
    cls = _fsdp2_cls()
    return cls is not None and isinstance(module, cls)


def _checkpoint_inner(module: nn.Module) -> nn.Module | None:
    return module.__dict__.get("_modules", {}).get("_checkpoint_wrapped_module")


# --------------------------------------------------------------------------- wrapping
def mark_unit(module: nn.Module) -> None:
    """Tag ``module`` to become its own FSDP unit."""
    setattr(module, UNIT_ATTR, True)


def unmark_unit(module: nn.Module) -> None:
    module.__dict__.pop(UNIT_ATTR, None)


def is_marked(module: nn.Module) -> bool:
    return bool(module.__dict__.get(UNIT_ATTR, False))


def has_marked_units(model: nn.Module) -> bool:
    return any(is_marked(m) for m in model.modules())


def _marked_lambda(module: nn.Module) -> bool:
    return is_marked(module)


def fsdp1_policy(base: Callable | None = None) -> Callable:
    """An FSDP1 ``auto_wrap_policy``: ``base`` (may be None) or "is a tagged module"."""
    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy

    if getattr(base, UNIT_ATTR, False):
        return base  # already composed
    ours = functools.partial(lambda_auto_wrap_policy, lambda_fn=_marked_lambda)
    policy = ours if base is None else functools.partial(_or_policy, policies=[base, ours])
    setattr(policy, UNIT_ATTR, True)
    return policy


def fsdp2_policy(base: Callable[[nn.Module], bool] | None = None) -> Callable[[nn.Module], bool]:
    """A module predicate for FSDP2 wrapping loops: ``base(module)`` or "is a tagged module"."""
    if getattr(base, UNIT_ATTR, False):
        return base

    def policy(module: nn.Module) -> bool:
        return is_marked(module) or (base is not None and bool(base(module)))

    setattr(policy, UNIT_ATTR, True)
    return policy


def shard_marked_units(model: nn.Module, **fully_shard_kwargs: Any) -> list[nn.Module]:
    """``fully_shard`` every tagged module of ``model`` (call before sharding its parents)."""
    from torch.distributed.fsdp import fully_shard

    done = []
    for module in list(model.modules()):
        if is_marked(module) and not is_fsdp2(module):
            fully_shard(module, **fully_shard_kwargs)
            done.append(module)
    return done


# --------------------------------------------------------------------------- call-through
def resolve(root: nn.Module, path: str) -> tuple[list[nn.Module], nn.Module]:
    """Walk the dotted ``path`` from ``root``; return the FSDP units on the way (outermost first)
    and the plain module at the end. FSDP1 wrappers and checkpoint wrappers are looked through."""
    units: list[nn.Module] = []
    module = root
    for name in path.split(".") if path else []:
        module = module._modules[name]
        while True:
            if is_fsdp1(module):
                units.append(module)
                module = module._fsdp_wrapped_module
            elif _checkpoint_inner(module) is not None:
                module = _checkpoint_inner(module)
            else:
                break
        if is_fsdp2(module):
            units.append(module)
    return units, module


def unit_names(root: nn.Module, units: list[nn.Module]) -> list[str]:
    """Module paths of ``units`` as a user reads them (FSDP1/checkpoint wrapper levels left out)."""
    wrappers = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module"}
    names = {}
    for name, module in root.named_modules(remove_duplicate=False):
        names.setdefault(id(module), ".".join(part for part in name.split(".") if part not in wrappers) or "<root>")
    return [names.get(id(u), "?") for u in units]


def entry_at(root: nn.Module, path: str) -> nn.Module:
    """The module to *call* for ``path``: the FSDP1 wrapper where one replaced the module, else the module."""
    parent_path, _, name = path.rpartition(".")
    _, parent = resolve(root, parent_path)
    return parent._modules[name]


def param_dtype(module: nn.Module) -> torch.dtype | None:
    """dtype of ``module.weight`` if it is readable outside FSDP's forward, else None."""
    weight = getattr(module, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) else None


def _redirect(unit: nn.Module, fn: Callable, args: tuple) -> Any:
    target = unit._fsdp_wrapped_module if is_fsdp1(unit) else unit
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


def call_through(units: Iterable[nn.Module], fn: Callable, *args: Any) -> Any:
    """Run ``fn(*args)`` inside the forward of every unit in ``units`` (outermost first)."""
    units = list(units)
    if not units:
        return fn(*args)
    first, rest = units[0], units[1:]
    return _redirect(first, lambda *a: call_through(rest, fn, *a), args)


def fsdp_version(model: nn.Module) -> str:
    """How ``model`` is sharded right now: ``"FSDP1"``, ``"FSDP2"`` or ``"none"``."""
    for module in model.modules():
        if is_fsdp1(module):
            return "FSDP1"
        if is_fsdp2(module):
            return "FSDP2"
    for param in model.parameters():
        if getattr(param, "_fsdp_flattened", False) or type(param).__name__ == "FlatParameter":
            return "FSDP1"
        if type(param).__name__ == "DTensor":
            return "FSDP2"
    return "none"


def is_sharded_weight(weight: torch.Tensor) -> bool:
    """True for a DTensor or a 1-D flat shard -- what a fused loss must never read directly."""
    return type(weight).__name__ == "DTensor" or weight.dim() != 2
