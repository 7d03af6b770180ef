"""bench/ as a tool, read from its files (AST, nothing imported or run): no bench script builds a path into tests/
(the CPU shims both use live in llamafactory_liger_fsdp/testing/), every script a user reruns names the JSON it
writes in its ``--out`` argument, so ``--help`` says where the rows go, and bench/*.py stays under 2,500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
LAUNCHERS = ("common.py", "lf_bench_launch.py", "step_profile.py")  # imported or started, no --out
MAX_LINES = 2500  # the rule: bench/ is a tool, not a notebook (fold, share and compress before adding a script)


def _code_strings(source: str) -> list[str]:
    """The string constants of ``source`` outside docstrings."""
    tree = ast.parse(source)
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs]


def _reaches_tests(source: str) -> bool:
    return any(s == "tests" or s.startswith("tests/") or "/tests/" in s for s in _code_strings(source))


def _out_help(source: str) -> str:
    """Every string of the ``add_argument("--out", ...)`` call (default and help), or "" without one."""
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == "--out"):
            return " ".join(n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return ""


def test_no_bench_script_reaches_into_tests():
    reach = [p.name for p in sorted(BENCH.glob("*.py")) if _reaches_tests(p.read_text())]
    shell = [p.name for p in sorted(BENCH.glob("*.sh")) if "tests/" in p.read_text()]
    assert not reach and not shell, (reach, shell)


@pytest.mark.parametrize("name", sorted(p.name for p in BENCH.glob("*.py") if p.name not in LAUNCHERS))
def test_each_script_names_its_output_json(name):
    text = _out_help((BENCH / name).read_text())
    assert ".json" in text or "JSON" in text, (name, text)


@pytest.mark.parametrize("bad", ['SHIM = os.path.join(ROOT, "tests", "cpu_v1_shim")\n',
                                 'env["PYTHONPATH"] = ROOT + "/tests/cpu_fsdp_shim"\n'])
def test_the_reach_check_can_fail(bad):
    assert _reaches_tests('"""Docstrings may name tests/test_x.py."""\n' + bad)
    assert not _reaches_tests('"""Docstrings may name tests/test_x.py."""\nx = 1\n')


def test_bench_is_a_tool_not_a_notebook():
    """``wc -l bench/*.py`` (newline characters) stays under MAX_LINES."""
    counts = {p.name: p.read_bytes().count(b"\n") for p in sorted(BENCH.glob("*.py"))}
    assert sum(counts.values()) < MAX_LINES, (sum(counts.values()), counts)
