"""A tiny registry of the third-party attributes the plugin replaces, so each one is guarded,
recorded, logged once and undone cleanly (:func:`undo_all`); an original that is a fingerprinted upstream piece
(:mod:`.fingerprints`) is marked used by its patch."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from . import fingerprints
from ._log import info_rank0

MARK = "__liger_fsdp_patch__"


@dataclass
class Patch:
    owner: Any
    name: str
    original: Any
    replacement: Any
    why: str

    label: str = ""  # set for a registry entry (:func:`put`)

    @property
    def where(self) -> str:
        if self.label:
            return self.label
        owner = getattr(self.owner, "__name__", type(self.owner).__name__)
        module = getattr(self.owner, "__module__", None)
        prefix = f"{module}." if module and not inspect.ismodule(self.owner) else ""
        return f"{prefix}{owner}.{self.name}"


_APPLIED: list[Patch] = []
_ABSENT = object()
_LOGGED = False


class PatchError(RuntimeError):
    """A patch point is missing or has an unexpected signature in the installed version."""


def require_params(fn: Any, names: tuple[str, ...], where: str) -> None:
    """Guard: ``fn`` must accept ``names`` (version-tolerant: extra parameters are fine). Wrappers made with
    ``functools.wraps`` are seen through (``inspect.signature`` follows ``__wrapped__``); a bare ``(*args,
    **kwargs)`` wrapper of another package hides the original, and the error says so (it is not a version)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as exc:
        raise PatchError(f"cannot inspect {where}: {exc}") from exc
    missing = [n for n in names if n not in params]
    if not missing:
        return
    kinds = {p.kind for p in params.values()}
    if inspect.Parameter.VAR_POSITIONAL in kinds and inspect.Parameter.VAR_KEYWORD in kinds:
        inner = inspect.unwrap(fn)
        who = f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', getattr(inner, '__name__', '?'))}"
        raise PatchError(f"{where} is wrapped by another package ({who}, a (*args, **kwargs) wrapper without "
                         "functools.wraps), which hides the original's parameters")
    raise PatchError(f"{where} has no parameter(s) {missing}; this version is not supported")


def apply(owner: Any, name: str, make: Callable[[Any], Any], why: str) -> Patch | None:
    """Replace ``owner.name`` by ``make(original)``; a no-op if it is already ours."""
    original = getattr(owner, name, None)
    if original is None:
        raise PatchError(f"{getattr(owner, '__name__', owner)}.{name} not found; this version is not supported")
    fingerprints.patched(original)  # a registered upstream piece: judged by its fingerprint from now on
    if getattr(original, MARK, False):
        return None
    replacement = make(original)
    setattr(replacement, MARK, True)
    setattr(replacement, "__wrapped__", original)
    setattr(owner, name, replacement)
    patch = Patch(owner, name, original, replacement, why)
    _APPLIED.append(patch)
    if _LOGGED:
        info_rank0(f"[liger_fsdp] patched {patch.where}: {why}")
    return patch


def rebind(module: Any, name: str, old: Any, new: Any, why: str) -> None:
    """Re-point a name that another module imported by value (``from x import f``)."""
    if getattr(module, name, None) is old:
        setattr(module, name, new)
        _APPLIED.append(Patch(module, name, old, new, why))


def put(mapping: dict, key: str, value: Any, why: str, where: str) -> Patch:
    """Add ``mapping[key] = value`` (a third-party registry entry), recorded and undone like an attribute."""
    patch = Patch(mapping, key, mapping.get(key, _ABSENT), value, why, where)
    if callable(patch.original):
        fingerprints.patched(patch.original)
    mapping[key] = value
    _APPLIED.append(patch)
    if _LOGGED:
        info_rank0(f"[liger_fsdp] patched {patch.where}: {why}")
    return patch


def log_once() -> None:
    """Log (rank 0, once per process) every patch in place and why."""
    global _LOGGED
    if _LOGGED:
        return
    _LOGGED = True
    for patch in _APPLIED:
        info_rank0(f"[liger_fsdp] patched {patch.where}: {patch.why}")


def undo(owner: Any, name: str) -> None:
    """Restore one patched attribute (and the names bound to its replacement elsewhere)."""
    for patch in [p for p in _APPLIED if p.owner is owner and p.name == name]:
        _APPLIED.remove(patch)
        _restore(patch)


def _restore(patch: Patch) -> None:
    import sys

    if isinstance(patch.owner, dict):
        if patch.owner.get(patch.name) is patch.replacement:
            if patch.original is _ABSENT:
                del patch.owner[patch.name]
            else:
                patch.owner[patch.name] = patch.original
        return
    if getattr(patch.owner, patch.name, None) is patch.replacement:
        setattr(patch.owner, patch.name, patch.original)
    for module in list(sys.modules.values()):
        if getattr(module, "__dict__", {}).get(patch.name) is patch.replacement:
            setattr(module, patch.name, patch.original)


def undo_all() -> None:
    """Restore every patched attribute, newest first, and every module-level name that was bound
    to a replacement by ``from x import f`` after the patch (e.g. ``llamafactory.model.load_model``)."""
    global _LOGGED
    while _APPLIED:
        _restore(_APPLIED.pop())
    _LOGGED = False
