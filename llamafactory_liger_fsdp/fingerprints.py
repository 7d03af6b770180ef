"""Tested means this code: a fingerprint of every upstream function the plugin replaces, mirrors or runs with a changed
argument, against those CI saw on its three stacks (``fingerprints.json``, recorded by ``python -m
llamafactory_liger_fsdp fingerprints --record``).

Every commit of LLaMA-Factory's git main reports ``0.9.6.dev0``, so a version string cannot say whether the trainer
methods the plugin depends on are the ones CI ran. A *piece* (:mod:`.pieces`) is named ``module:Qualified.name``;
its fingerprint is a hash of the function's syntax tree (docstrings and positions dropped: formatting and comments do
not count, any statement does) of the unwrapped original. A piece is judged only once a run uses it: the original of
a :mod:`._patch` patch is marked used by the patch itself, a piece read or mirrored without a patch by :func:`use`.
A used piece CI never saw is untested whatever its version string (:func:`unseen`, part of
:func:`.versions.untested`): one line names it (:func:`settle`, at engage), the guard's messages name it, and where
the guard cannot compare the piece (``compared=False``: a seam, a mirrored arithmetic, a finder whose answer is
replaced) the run stops unless ``liger_fsdp_guard: false``. Hashed once per piece per process. Imports no torch.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import os
import textwrap
from typing import Any

# the table of pieces lives in .pieces; all its names stay importable from here
from .pieces import PIECES, Piece, definition, family_pieces, installed, original, registry, resolve  # noqa: F401

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fingerprints.json")
NO_SOURCE = "no-source"
SAID = "untested_code"
FIX = ("Fix: install the tested versions (README, \"Supported versions\"), or remove `liger_fsdp`, and report this "
       "line with the pieces named")

_PRINTS: dict[str, tuple[Any, str]] = {}  # name -> (the function hashed, its fingerprint): hashed once per process
_USED: dict[str, None] = {}  # names used by runs in this process, in order
_DATA: dict | None = None


# --------------------------------------------------------------------------- the fingerprint
def _canonical(node: Any) -> Any:
    """The tree as nested lists, without positions, docstrings, or fields that are None/empty (the same on every
    Python from 3.10: later versions add empty fields such as ``type_params``)."""
    if isinstance(node, ast.AST):
        out: list = [type(node).__name__]
        for field, value in ast.iter_fields(node):
            if field == "body" and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and value \
                    and isinstance(value[0], ast.Expr) and isinstance(getattr(value[0], "value", None), ast.Constant) \
                    and isinstance(value[0].value.value, str):
                value = value[1:] or [ast.Pass()]  # the docstring does not count
            if value is None or value == [] or field == "type_comment":
                continue
            out.append([field, _canonical(value)])
        return out
    if isinstance(node, list):
        return [_canonical(v) for v in node]
    return repr(node)


def fingerprint(fn: Any) -> str:
    """16 hex digits of the hash of ``fn``'s syntax tree (:data:`NO_SOURCE` when its source cannot be read)."""
    fn = original(fn)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return NO_SOURCE
    text = json.dumps(_canonical(tree.body[0] if len(tree.body) == 1 else tree), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _print_of(name: str, fn: Any = None) -> str:
    fn = original(resolve(name) if fn is None else fn)
    hit = _PRINTS.get(name)
    if hit is None or hit[0] is not fn:
        hit = _PRINTS[name] = (fn, fingerprint(fn))
    return hit[1]


# --------------------------------------------------------------------------- the data CI recorded
def recorded() -> dict[str, dict[str, list[str]]]:
    """piece name -> fingerprint -> the stacks CI saw it on."""
    global _DATA
    if _DATA is None:
        try:
            with open(DATA, encoding="utf-8") as f:
                _DATA = json.load(f).get("pieces", {})
        except FileNotFoundError:
            _DATA = {}
    return _DATA


def _name_of(target: Any) -> str:
    if isinstance(target, str):
        name = target
    else:
        name = definition(target)
    if name not in registry():
        raise KeyError(f"{name} is not a registered piece (llamafactory_liger_fsdp/pieces.py, PIECES)")
    return name


def tested(target: Any) -> bool:
    """Whether CI saw this code of the piece (a registered name or the function)."""
    name = _name_of(target)
    return _print_of(name, None if isinstance(target, str) else target) in recorded().get(name, {})


def use(target: Any) -> None:
    """This run depends on the piece (a registered name or the function itself): judged by :func:`unseen`."""
    name = _name_of(target)
    _print_of(name, None if isinstance(target, str) else target)
    _USED[name] = None


def patched(fn: Any) -> None:
    """A :mod:`._patch` patch replaced ``fn``: used, if it is a registered piece (nothing otherwise)."""
    try:
        name = definition(fn)
    except Exception:
        return
    if name in registry():
        _print_of(name, fn)
        _USED[name] = None


def _unseen_pieces() -> list[Piece]:
    data = recorded()
    return [registry()[n] for n in _USED if _PRINTS[n][1] not in data.get(n, {})]


def _dist(name: str) -> str:
    top = name.split(".", 1)[0].split(":", 1)[0]
    return f"{top} {installed(top) or '?'}"


def unseen() -> list[str]:
    """``"llamafactory.v1...:RMTrainer.__init__ (code CI never saw, llamafactory 0.9.6.dev0)"`` for each used piece
    whose fingerprint is not in :data:`DATA`."""
    return [f"{p.name} (code CI never saw, {_dist(p.name)})" for p in _unseen_pieces()]


def settle(guard: bool) -> None:
    """Once the run's patches are in place (engage): one line naming the used pieces CI never saw; with the guard on,
    the stop for those it cannot compare (every rank: the same code everywhere)."""
    from ._log import say_once

    pieces = _unseen_pieces()
    if not pieces:
        return
    blind = [p for p in pieces if not p.compared]
    if blind and guard:
        from .config import LigerFsdpConfigError

        names = "; ".join(f"{p.name} ({p.why}; {_dist(p.name)})" for p in blind)
        raise LigerFsdpConfigError(
            f"`liger_fsdp_guard`: code CI never saw, which the first-step guard cannot compare with the plugin's use "
            f"of it: {names}. The version string is one CI tested, the code is not. {FIX}; or set "
            "`liger_fsdp_guard: false` to train unchecked.")
    checks = ("the first-step guard compares the plugin's replacement with them and stops the run if they differ"
              if guard else "`liger_fsdp_guard: false`: nothing checks the plugin against them")
    say_once(SAID, f"[liger_fsdp] untested code (CI never saw it under these version strings): "
                   f"{', '.join(p.name for p in pieces)}; training as usual, {checks}.")


# --------------------------------------------------------------------------- recording (CI, developers)
def this_stack(prefix: str = "") -> dict[str, str]:
    """piece name -> fingerprint, for every registered piece (named ``prefix...``) this stack has."""
    out = {}
    for name in (n for n in registry() if n.startswith(prefix)):
        try:
            out[name] = _print_of(name)
        except (ImportError, AttributeError):
            continue
    return out


def stack_label() -> str:
    return ", ".join(f"{n} {installed(n)}" for n in ("llamafactory", "transformers"))


def missing(prefix: str = "") -> list[str]:
    """The pieces of this stack (named ``prefix...``) whose code the data file does not hold (re-record)."""
    data = recorded()
    return [f"{n} ({fp})" for n, fp in this_stack(prefix).items() if fp not in data.get(n, {})]


def record(label: str | None = None) -> int:
    """Merge this stack's fingerprints into :data:`DATA`; the number of new entries."""
    global _DATA
    label = label or stack_label()
    try:
        with open(DATA, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        doc = {}
    pieces = doc.setdefault("pieces", {})
    new = 0
    for name, fp in this_stack().items():
        stacks = pieces.setdefault(name, {}).setdefault(fp, [])
        new += not stacks
        if label not in stacks:
            stacks.append(label)
            stacks.sort()
    doc["pieces"] = {n: dict(sorted(pieces[n].items())) for n in sorted(pieces)}
    doc["note"] = ("fingerprints of the upstream functions the plugin depends on, as CI saw them on each stack: "
                   "python -m llamafactory_liger_fsdp fingerprints --record (docs/design.md, Versions)")
    with open(DATA, "w", encoding="utf-8") as f:
        json.dump(dict(sorted(doc.items())), f, indent=1)
        f.write("\n")
    _DATA = None
    return new


def main(argv: list[str]) -> int:
    """``fingerprints``: exit 1 naming this stack's unrecorded pieces; ``fingerprints --record [LABEL]``: merge."""
    if argv[:1] == ["--record"]:
        new = record(argv[1] if len(argv) > 1 else None)
        print(f"fingerprints: {new} new in {DATA} ({stack_label()})")
        return 0
    gone = missing()
    if gone:
        print("fingerprints: code CI never saw on this stack (" + stack_label() + "):\n  " + "\n  ".join(gone) +
              "\nre-record on each CI stack: python -m llamafactory_liger_fsdp fingerprints --record")
        return 1
    print(f"fingerprints: every piece of this stack was seen by CI ({len(this_stack())} pieces; {stack_label()})")
    return 0
