"""Before FSDP wraps the model: the trained head weights become FSDP units of their own.

:func:`mark_unit` tags a module (a leaf ``nn.Linear`` that owns one head weight shared with nothing
else); :func:`fsdp1_policy` composes an FSDP1 ``auto_wrap_policy`` (e.g. PEFT's
``fsdp_auto_wrap_policy``) with "wrap the tagged modules", :func:`fsdp2_policy` does the same for
accelerate's FSDP2 module predicate, and :func:`shard_marked_units` applies ``fully_shard`` to them for
code that shards by hand. Tagged modules are leaves holding one weight each, so FSDP1's
uniform-``requires_grad`` rule holds with ``use_orig_params=False``.

Why: inside the root unit the head would be gathered for the whole forward and backward; as its own
unit it is gathered only while the loss runs (:mod:`.gather`). :func:`idle_originals` names the frozen originals of
PEFT's ``modules_to_save`` wrappers, which training never calls: tagged too, FSDP never gathers them in a training
step (in the root unit they were gathered in every forward and backward: a full V x H weight a rank, each). Correctness
never depends on this, only memory. DeepSpeed needs no tagging: ZeRO-3 gathers per module already.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from torch import nn

from . import thirdparty
from .heads.base import is_shared

UNIT_ATTR = "_liger_fsdp_unit"


def mark_unit(module: nn.Module) -> None:
    """Tag ``module`` to become its own FSDP unit."""
    setattr(module, UNIT_ATTR, True)


def unmark_unit(module: nn.Module) -> None:
    module.__dict__.pop(UNIT_ATTR, None)


def is_marked(module: nn.Module) -> bool:
    return bool(module.__dict__.get(UNIT_ATTR, False))


def idle_originals(model: nn.Module) -> list[str]:
    """Paths of the ``original_module`` of every PEFT ``modules_to_save`` wrapper whose active copy is trained
    (``additional_target: embed_tokens,lm_head``): frozen, called only under ``disable_adapter()`` (a DPO reference
    pass); plain ``nn.Linear`` / ``nn.Embedding`` modules whose weight nothing else shares."""
    out = []
    for name, module in model.named_modules():
        if not thirdparty.is_modules_to_save(module) or module.disable_adapters:
            continue
        original = getattr(module, "original_module", None)
        if type(original) not in (nn.Linear, nn.Embedding) or not original.weight.is_floating_point():
            continue
        trained = any(p.requires_grad for p in module.modules_to_save.parameters())
        if trained and not any(p.requires_grad or is_shared(model, p) for p in original.parameters()):
            out.append(f"{name}.original_module")
    return out


def has_marked_units(model: nn.Module) -> bool:
    return any(is_marked(m) for m in model.modules())


def fsdp1_policy(base: Callable | None = None) -> Callable:
    """An FSDP1 ``auto_wrap_policy``: ``base`` (may be None) or "is a tagged module"."""
    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy

    if getattr(base, UNIT_ATTR, False):
        return base  # already composed
    ours = functools.partial(lambda_auto_wrap_policy, lambda_fn=is_marked)
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


def shard_marked_units(model: nn.Module, *, shard: Callable | None = None, below_only: bool = False,
                       **fully_shard_kwargs: Any) -> list[nn.Module]:
    """``fully_shard`` every tagged module of ``model`` that is not a unit yet (call before sharding its parents).
    ``shard``: the function to call (default torch's ``fully_shard``; LLaMA-Factory v1 wraps its own module global);
    ``below_only``: leave ``model`` itself to the caller. An ``ignored_params`` set is cut to each module's own."""
    if shard is None:
        from torch.distributed.fsdp import fully_shard as shard
    done = []
    for module in list(model.modules())[1 if below_only else 0:]:
        if is_marked(module) and not thirdparty.is_fsdp2(module):
            kwargs = dict(fully_shard_kwargs)
            if kwargs.get("ignored_params"):
                own = set(module.parameters())
                kwargs["ignored_params"] = {p for p in kwargs["ignored_params"] if p in own}
            shard(module, **kwargs)
            done.append(module)
    return done
