"""The upstream functions the plugin depends on (:data:`PIECES`, plus each family's ``forward``): what each is, why
the plugin depends on it, whether the first-step guard compares it, and how it is found (:func:`resolve`,
:func:`definition`). :mod:`.fingerprints` hashes them and judges them against what CI saw. Imports no torch.

A *piece* is named ``module:Qualified.name`` where it is defined (a family's forward: where transformers exports it);
a function the plugin replaces, mirrors or runs with a changed argument is one.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from importlib import metadata
from typing import Any


@dataclass(frozen=True)
class Piece:
    name: str  # "module:Qualified.name" where it is defined (a family's forward: where transformers exports it)
    compared: bool  # the first-step guard runs this very function as its reference side and compares the result
    why: str


_SP = "llamafactory.v1.plugins.model_plugins.parallelization.sequence_parallel"
_DPO1 = "llamafactory.v1.trainers.dpo_trainer:DPOTrainer"
_RM1 = "llamafactory.v1.trainers.rm_trainer:RMTrainer"

#: Every upstream function the plugin depends on, beyond the families' (:func:`family_pieces`).
PIECES: tuple[Piece, ...] = (
    Piece("llamafactory.train.dpo.trainer:CustomDPOTrainer.concatenated_forward", True, "replaced (fused log-probs)"),
    Piece("llamafactory.train.kto.trainer:CustomKTOTrainer.forward", True, "replaced (fused log-probs)"),
    Piece("llamafactory.v1.core.base_trainer:BaseTrainer.compute_log_probs", True,
          "replaced; run with a stand-in model that records its inputs"),
    Piece(f"{_DPO1}.__init__", False, "run without its cp_size refusal under CP"),
    Piece(f"{_DPO1}.compute_loss", True, "replaced; its logic kept after the fused log-probs"),
    Piece(f"{_DPO1}._compute_ref_logps", True, "replaced (fused reference log-probs)"),
    Piece(f"{_DPO1}._init_ref_model", False, "wrapped: the deep-copied reference engaged on its own"),
    Piece(f"{_RM1}.__init__", False, "run without its cp_size refusal under CP"),
    Piece(f"{_RM1}.compute_loss", True, "run with a recording stand-in model and on gathered scores under CP"),
    Piece(f"{_SP}:sequence_parallel_loss", True, "replaced under CP (fused log-probs on each shard)"),
    Piece("llamafactory.v1.plugins.trainer_plugins.distributed.fsdp2:get_transformer_layer_cls", False,
          "answered as git main's where it misses the decoder layers"),
    Piece("transformers.loss.loss_utils:ForCausalLMLoss", True, "its arithmetic mirrored by the fused kernel"),
)


def family_pieces() -> tuple[Piece, ...]:
    """Each family's model-class ``forward`` (its quirks were read off it; the guard compares the model's own loss)."""
    from . import families

    return tuple(Piece(f"transformers:{f.cls}.forward", True, f"quirks of `{f.model_type}` read off it")
                 for f in families.FAMILIES.values() if f.refuse is None)


_REGISTRY: dict[str, Piece] | None = None


def registry() -> dict[str, Piece]:
    """piece name -> :class:`Piece`, for :data:`PIECES` and the families' (built once)."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = {p.name: p for p in (*PIECES, *family_pieces())}
    return _REGISTRY


def original(fn: Any) -> Any:
    """The function under the plugin's (and any ``functools.wraps``) wrappers; a bound method's function."""
    fn = getattr(fn, "__func__", fn)
    return inspect.unwrap(fn)


def definition(fn: Any) -> str:
    """The piece name of ``fn``'s original: ``module:Qualified.name`` where it is defined."""
    fn = original(fn)
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', getattr(fn, '__name__', '?'))}"


def installed(dist: str) -> str | None:
    """The installed version of distribution ``dist``; None where it is not installed (:mod:`.versions` and
    :mod:`.fingerprints` both read it here, below them both)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def resolve(name: str) -> Any:
    """The function a piece names (imports its module); AttributeError/ImportError where this stack has none."""
    module, _, path = name.partition(":")
    obj: Any = importlib.import_module(module)
    for attr in path.split("."):
        obj = getattr(obj, attr)
    return obj
