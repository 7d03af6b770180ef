"""v1's FSDP2 makes each decoder layer a unit of its own, where the installed v1's layer finder misses them.

LLaMA-Factory 0.9.5's ``v1/plugins/trainer_plugins/distributed/fsdp2.get_transformer_layer_cls`` reads
``_no_split_modules`` only as a list or tuple (transformers 5 has a set) and falls back to ``model.model.layers``,
which a PeftModel lacks: v1 then shards the whole model as ONE unit, whose root gathers every layer's frozen weights
at once (full size on every rank). Git main finds the class of every ``nn.ModuleList`` named ``layers`` or ``blocks``.
While an engaged FSDP2 run shards, :func:`patch` makes the finder answer as git main's does for such a model (one
named patch point, undone on disengage); where the installed finder finds the decoder layers already (git main, a
model that is not a PeftModel) nothing is patched. Every rank finds the same classes in the same model.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ... import _patch, announce, engage, thirdparty

SEQUENCES = ("layers", "blocks")  # git main's names of the decoder-layer lists
NOTE = ("v1's FSDP2 found no decoder-layer class ({why}): each decoder layer made a unit, as LLaMA-Factory git main "
        "does ({units} of {layers} are FSDP2 units)")


def layer_lists(model: nn.Module) -> list[nn.ModuleList]:
    """Every non-empty ``nn.ModuleList`` named ``layers`` or ``blocks`` in ``model`` (git main's rule)."""
    found = {}
    for module in model.modules():
        for attr in SEQUENCES:
            seq = getattr(module, attr, None)
            if isinstance(seq, nn.ModuleList) and len(seq) > 0:
                found[id(seq)] = seq
    return list(found.values())


def layer_classes(model: nn.Module) -> set[type]:
    return {type(seq[0]) for seq in layer_lists(model)}


def _as_set(found: Any) -> set:
    """The finder's answer as a set: 0.9.5 returns one class or None, git main a set."""
    if found is None:
        return set()
    return set(found) if isinstance(found, (set, frozenset, list, tuple)) else {found}


def misses(finder: Any, model: nn.Module) -> bool:
    """Whether ``finder`` (v1's ``get_transformer_layer_cls``) misses a decoder-layer class of ``model``."""
    classes = layer_classes(model)
    return bool(classes) and not classes <= _as_set(finder(model))


def _answer(found: Any, model: nn.Module) -> Any:
    """``found`` with the decoder-layer classes added, in the installed finder's shape (a set, or one class: the
    class of the largest layer list -- the decoder's)."""
    if isinstance(found, (set, frozenset)):
        return set(found) | layer_classes(model)
    largest = max(layer_lists(model), key=lambda seq: sum(p.numel() for p in seq.parameters()))
    return type(largest[0])


def _why(model: nn.Module) -> str:
    from importlib.metadata import version

    names = getattr(model, "_no_split_modules", None)
    why = f"LLaMA-Factory {version('llamafactory')}'s finder"
    if names is not None and not isinstance(names, (list, tuple)):
        why += f" reads _no_split_modules only as a list, this model's is a {type(names).__name__}"
    if thirdparty.is_peft_model(model):
        why += f"; a {type(model).__name__} has no model.layers"
    return why


def _note(model: nn.Module, why: str):
    def note(_causal_lm: nn.Module) -> str:  # read from the live model on the first step (the engaged line)
        layers = [layer for seq in layer_lists(model) for layer in seq]
        units = sum(thirdparty.is_fsdp2(layer) for layer in layers)
        return NOTE.format(why=why, units=units, layers=len(layers))

    return note


def patch(model: nn.Module) -> None:
    """While ``model`` (engaged, v1 FSDP2) holds it: v1's layer finder answers with this model's decoder-layer
    classes where it would miss them, and the engaged line says so. A no-op where the finder finds them."""
    from llamafactory.v1.plugins.trainer_plugins.distributed import fsdp2

    if not misses(fsdp2.get_transformer_layer_cls, model):
        return
    engage.record_undo(model, announce.note(engage.causal_lm_of(model), _note(model, _why(model))))
    engage.hold(model, "v1 FSDP2 layer finder", patch_finder)


def patch_finder() -> list:
    """v1's layer finder answers as git main's wherever it misses (bench/v1.py --layer-units: v1 plain so wrapped)."""
    from llamafactory.v1.plugins.trainer_plugins.distributed import fsdp2

    _patch.require_params(fsdp2.get_transformer_layer_cls, ("model",), "v1 FSDP2 get_transformer_layer_cls")

    def make(original):
        def get_transformer_layer_cls(model):
            found = original(model)
            classes = layer_classes(model)
            return _answer(found, model) if classes and not classes <= _as_set(found) else found

        return get_transformer_layer_cls

    done = _patch.apply(fsdp2, "get_transformer_layer_cls", make, "v1 FSDP2: each decoder layer a unit where "
                        "v1's finder misses them (as LLaMA-Factory git main finds them)")
    return [] if done is None else [lambda: _patch.undo(fsdp2, "get_transformer_layer_cls")]
