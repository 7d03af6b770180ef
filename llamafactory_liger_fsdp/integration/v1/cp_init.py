"""v1's DPO and RM trainers under Ulysses (``cp_size > 1``): their ``__init__`` as LLaMA-Factory wrote it, without its
cp_size refusal -- the one seam both share (:mod:`.cp_dpo`, :mod:`.cp_rm`).

``DPOTrainer.__init__`` (git main) and ``RMTrainer.__init__`` (0.9.5, git main) open with ``if args.cp_size > 1:
raise NotImplementedError(...)`` (0.9.5's RM first reads ``cp_size`` from ``dist_config``). For a model the plugin
takes, the trainer is built by :func:`lifted`: the same function compiled from its own source, with its module's
globals, file and line numbers and its class as ``super()``'s, with that one ``if`` statement left out. Nothing is
swapped around the call and ``args`` is never written, so ``BaseTrainer.__init__`` and every later reader see the
run's cp_size and nothing outlives the call. The patch point is ``__init__`` of that class only (a model not taken
runs the original, refusal included), undone with the model; the original is a fingerprinted piece that the guard
cannot compare (:mod:`...fingerprints`): code CI never saw stops the run while ``liger_fsdp_guard`` is on.
"""

from __future__ import annotations

import __future__
import ast
import inspect
import types
from typing import Any, Callable

from ... import _patch

PARAMS = ("self", "args", "model", "renderer", "train_dataset", "callbacks")
_FUTURE = 0
for _name in __future__.all_feature_names:
    _FUTURE |= getattr(__future__, _name).compiler_flag


def _reads_cp_size(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "cp_size"
    return isinstance(node, ast.Attribute) and node.attr == "cp_size" and isinstance(node.value, ast.Name) \
        and node.value.id == "args"


def is_refusal(stmt: ast.stmt) -> bool:
    """``if args.cp_size > 1: raise NotImplementedError(...)`` (or ``cp_size > 1``), nothing else in it."""
    if not (isinstance(stmt, ast.If) and not stmt.orelse and len(stmt.body) == 1
            and isinstance(stmt.body[0], ast.Raise)):
        return False
    exc, test = stmt.body[0].exc, stmt.test
    return (isinstance(exc, ast.Call) and isinstance(exc.func, ast.Name) and exc.func.id == "NotImplementedError"
            and isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Gt)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == 1
            and _reads_cp_size(test.left))


def lifted(init: Any, cls: type) -> Callable:
    """``cls``'s ``init`` (the original function) without its cp_size refusal; PatchError where that statement is not
    there exactly once, or the function is not a plain method of ``cls``."""
    fn = inspect.unwrap(init)
    where = f"{cls.__name__}.__init__"
    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError) as exc:
        raise _patch.PatchError(f"cannot read the source of {where}: {exc}") from exc
    # the method's own lines inside a class of its own: the same columns, and `super()` gets its `__class__` cell
    tree = ast.parse("class _Seam:\n" + "".join(lines))
    func = tree.body[0].body[0]
    refusals = [i for i, stmt in enumerate(func.body) if is_refusal(stmt)]
    if not isinstance(func, ast.FunctionDef) or func.decorator_list or len(refusals) != 1:
        raise _patch.PatchError(f"{where} no longer opens with one `if args.cp_size > 1: raise NotImplementedError` "
                                "statement, so the plugin cannot lift that refusal alone")
    del func.body[refusals[0]]
    ast.increment_lineno(tree, first - 2)
    module = compile(tree, fn.__code__.co_filename, "exec", flags=fn.__code__.co_flags & _FUTURE, dont_inherit=True)
    body = next(c for c in module.co_consts if isinstance(c, types.CodeType))
    code = next(c for c in body.co_consts if isinstance(c, types.CodeType) and c.co_name == fn.__name__)
    if code.co_freevars not in ((), ("__class__",)):
        raise _patch.PatchError(f"{where} closes over {code.co_freevars}; the plugin cannot rebuild it")
    closure = (types.CellType(cls),) if code.co_freevars else None
    out = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    out.__kwdefaults__, out.__qualname__, out.__module__ = fn.__kwdefaults__, fn.__qualname__, fn.__module__
    out.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    return out


def patch(cls: type, taken: Callable[[Any], bool], built: Callable[[Any, Any], None], why: str) -> list:
    """``cls.__init__`` runs :func:`lifted` for a ``model`` that is ``taken`` (then ``built(trainer, model)``), the
    original otherwise; the undo callables (none when it is in place already)."""
    _patch.require_params(cls.__init__, PARAMS, f"{cls.__name__}.__init__")

    def make(original):
        body = lifted(original, cls)

        def __init__(self, args, model, *rest, **kwargs):
            if not taken(model):
                return original(self, args, model, *rest, **kwargs)
            body(self, args, model, *rest, **kwargs)
            built(self, model)

        return __init__

    done = _patch.apply(cls, "__init__", make, why)
    return [] if done is None else [lambda: _patch.undo(cls, "__init__")]
