"""The package's shape, checked from the source (AST), no imports run.

No import cycle among package modules (lazy imports inside functions counted), no module over 400 lines, no use of
another module's ``_private`` name, the kernel named only by ``ops/`` and the loss seam, one ``def rel(`` and no
``sys.path`` edits in bench/.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "llamafactory_liger_fsdp"


def _modules() -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(os.path.join(ROOT, PKG)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _read(path: str) -> str:
    return Path(path).read_text()


TREES = {m: ast.parse(_read(p), p) for m, p in MODULES.items()}


def _imports(mod: str):
    """(imported package module, imported name or None, line) for every import in `mod`, lazy ones included."""
    is_pkg = MODULES[mod].endswith("__init__.py")
    for node in ast.walk(TREES[mod]):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:
                    yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = mod.split(".") if is_pkg else mod.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in MODULES:
                    yield sub, None, node.lineno
                elif base in MODULES:
                    yield base, a.name, node.lineno


def _graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for m in MODULES:
        for target, _, _ in _imports(m):
            # a package's __init__ is run by importing any of its modules: an edge to it is not a use of it
            if target != m and not m.startswith(target + "."):
                graph[m].add(target)
    return graph


def test_sees_the_package():
    assert len(MODULES) > 40 and f"{PKG}.losses" in MODULES and f"{PKG}.ops.triton_flce" in MODULES
    assert f"{PKG}.forward" in _graph()[f"{PKG}.engage"]


def test_no_import_cycle():
    graph, state, cycles = _graph(), {}, []

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, cycles


def test_no_module_over_400_lines():
    long = {m: n for m, p in MODULES.items() if (n := _read(p).count("\n")) > 400}
    assert not long, long


def test_no_other_modules_private_names():
    found = []
    for m in MODULES:
        for target, name, line in _imports(m):
            if name and name.startswith("_") and not name.startswith("__"):
                found.append(f"{m}:{line} imports {target}.{name}")
        modules_bound = set()  # names bound by `from . import x [as y]`, then y._name
        for node in ast.walk(TREES[m]):
            if isinstance(node, ast.ImportFrom) and node.level:
                for a in node.names:
                    modules_bound.add(a.asname or a.name)
        for node in ast.walk(TREES[m]):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules_bound and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                found.append(f"{m}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not found, found


def test_kernel_named_only_by_ops_and_the_loss_seam():
    allowed = {PKG, f"{PKG}.losses"}
    users = [m for m, p in MODULES.items() if "fused_linear_cross_entropy" in _read(p)
             and m not in allowed and not m.startswith(f"{PKG}.ops")]
    assert not users, users


def _files(*dirs):
    for d in dirs:
        for root, _, files in os.walk(os.path.join(ROOT, d)):
            yield from (os.path.join(root, f) for f in files if f.endswith(".py"))


def test_one_rel_and_no_sys_path_edits_in_bench():
    rels = [p for p in _files("tests", "bench", PKG) if re.search(r"^\s*def rel\(", _read(p), re.MULTILINE)]
    assert [os.path.relpath(p, ROOT) for p in rels] == [os.path.join(PKG, "testing", "__init__.py")]
    edits = [p for p in _files("bench") if re.search(r"sys\.path\.(insert|append)|sys\.path\s*=", _read(p))]
    assert not edits, edits


@pytest.mark.parametrize("bad, expect", [
    ("from .integration.llamafactory import _say\n", "imports"),
    ("from . import gather\ngather._private()\n", "uses gather._private"),
])
def test_private_check_can_fail(bad, expect, monkeypatch):
    mod = f"{PKG}.engage"
    monkeypatch.setitem(TREES, mod, ast.parse(bad))
    with pytest.raises(AssertionError, match=expect):
        test_no_other_modules_private_names()
